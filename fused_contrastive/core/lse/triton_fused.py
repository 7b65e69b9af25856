"""The core op's fused kernels' launchers (``_lse_fwd``, ``_lse_bwd``: tensors in, tensors out); what every
Triton host shares is ``triton_shared/launch.py``.

The device code is in ``fused_contrastive.kernels.lse`` (the ``kernels/`` directory); its module
docstring has the math, the gradient derivation and the limits. Launch configs come from the fixed
table of ``triton_shared/configs.py``. This module

launches the kernels. The autograd Function that picks one of the three paths (this one, the panel path
``triton_panel.py``, the ahead-of-time library ``library_route.py``) is ``triton_function.py``, which imports all
three (none of them imports it).

Work per call in units of one N x M x D matmul (2 N M D FLOPs):

* forward: 1 (row LSE, LSEpos and the column LSE all come from the same tiles);
* backward, A != B: dA kernel (recompute 1 + ``dl @ B`` 1) + dB kernel (recompute 1 + ``dl^T @ A`` 1)
  = 4; without a gradient for B (a queue, a frozen tower) 2;
* backward, B is A: one kernel, recompute 1 + ``H @ A`` 1 = 2 (see the kernel docstring for why the
  half-triangle scheme is not used).

Two paths (``triton_shared/panels.py`` ``use_panel``; env ``FUSED_CONTRASTIVE_TRITON_PATH`` = auto | panel | fused):

* "fused" (the kernels above; the default on the CPU interpreter and for small problems): one
  forward kernel, one or two backward kernels, nothing but O(N + M) between them;
* "panel" (``triton_panel.py``; "auto" picks it for CUDA tensors with N * M >= 2^24): the matmuls in
  cuBLAS GEMMs on row panels of a bounded height, the per-logit work in ``kernels/panel.py``; 3 units
  for a summed loss without a column term (gradients formed in the forward's sweep), 4 with a column
  term or a per-row output (fused forward + panel backward), 3 for B is A. Its docstring has the
  memory formula and the per-panel FLOP / byte accounting.

"""

from __future__ import annotations

import dataclasses

import torch
import triton
from torch import Tensor

from ...kernels import lse as KL
from ..spec import CoreData, CoreSpec
from ..target_split import exact_weights, merge_split  # (backward_exact's exact_weights: a name tests can replace)
from ..triton_shared import launch as TL
from ..triton_shared.configs import LaunchConfig, config_for, fwd_kernel

#: warps of the fused forward with the target split (SPLIT_T): its 16-warp 16-bit tile spilled
SPLIT_FWD_MAX_WARPS = 8
#: the 16-bit triangular forward with the target split (the larger tiles spilled)
SPLIT_TRI_CONFIG = LaunchConfig(64, 64, 64, 4, 3)
#: columns per tile of the split forward with a column term (CLIP) on sm_90: its 128 x 128 tile spilled
SPLIT_COL_MAX_BLOCK_N_SM90 = 64


def _lse_fwd(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, want_col: bool,
             want_pos: bool, tri: bool = False, target: Tensor | None = None, minus_target: dict | None = None):
    """Forward launcher. ``a`` [N, D], ``b`` [M, D] or None (B is A), one dtype (fp32/fp16/bf16).

    Returns ``(lse [N], lse_col [M] or None, lse_pos [N] or None, prepared inputs)``, all fp32.
    ``tri`` (B is A without a bias, no column term, no positives: symmetric logits): the triangular
    forward, half the tiles (``lse_fwd_kernel``'s TRI: the row LSEs over the upper triangle merged
    with its column LSEs).

    ``target`` [N] (int64; no positives) with a dict ``minus_target``: the kernel keeps each
    row's target logit out of its sums (SPLIT_T; ``l_it`` from the row's fp32 dot with its target row),
    ``lse`` is ``logaddexp(LSEx_i, l_it)`` of the two, and
    the dict receives ``"loss"`` [N] fp32, each row's ``LSE_i - l_it`` as ``softplus(LSEx_i - l_it)`` (no
    cancellation; ``LSE_i`` on a row whose target entry is masked out, e.g. its own excluded column), and
    ``"fold"`` [N] fp32, 1 where the row's entry is the difference and 0 where it is ``LSE_i`` (what
    ``triton_panel.sweep``'s one pass reports under the same names). With ``want_col`` (CLIP) column j's
    statistics keep its target entry ``(j, j)`` apart too where ``target[j] == j`` (the column's target is
    the row whose target it is; other columns keep every entry): ``lse_col`` is the merged
    ``LSEcol_j = logaddexp(LSEcolx_j, l_jj)`` and the dict also receives ``"col_loss"`` [M],
    ``softplus(LSEcolx_j - l_jj)`` (``LSEcol_j`` where the column is not split), and ``"col_fold"`` [M] fp32,
    1 where it is the difference.
    """
    dev = a.device
    n, d = a.shape
    p = TL._prepare(a, b, spec, data, want_pos)
    m = p.b.shape[0]
    if tri and not (p.sym and not want_col and not p.pos_kind):
        raise ValueError("core: the triangular forward needs B is A without a bias, column term or positives")
    # the positives' softmax keeps narrower tiles, row statistics alone take wider ones on sm_90
    # (registers: see triton_configs)
    key = fwd_kernel(bool(p.pos_kind), want_col, tri, p.bias_col is not None)
    cfg, block_d, _ = config_for(key, TL._arch(dev), p.a.dtype, d)
    split = target is not None and minus_target is not None
    if split and p.pos_kind:
        raise ValueError("core: the forward's target split needs no positives")
    if split and tri and p.a.dtype != torch.float32:
        # the split's per-row and per-column target state spilled in the 128 x 128 16-bit triangular tile (16 warps:
        # 4-16 bytes a thread on sm_90 / sm_80; 8 warps: 24 + 36 on sm_90), so the split triangular forward takes
        # square 64 x 64 tiles (tests/test_triton_panel.py compiles it without spills). Untimed on a GPU.
        cfg = SPLIT_TRI_CONFIG
    elif split and cfg.num_warps > SPLIT_FWD_MAX_WARPS:
        # (16 warps: 128 registers a thread, where the split's target state spilled; 8 warps compile without)
        cfg = dataclasses.replace(cfg, num_warps=SPLIT_FWD_MAX_WARPS)
    if split and want_col and TL._arch(dev) == "sm90" and cfg.block_n > SPLIT_COL_MAX_BLOCK_N_SM90:
        # the column statistics' target mask beside the rows' in the 128 x 128 sm_90 tile at 8 warps spilled 12-44
        # bytes (D > 128, bf16 / fp16); 128 x 64 compiles without (tests/test_split_fwd_compile.py). Untimed on a GPU
        cfg = dataclasses.replace(cfg, block_n=SPLIT_COL_MAX_BLOCK_N_SM90)
    lse = TL._alloc((n,), torch.float32, dev)
    lse_pos = TL._alloc((n,), torch.float32, dev) if p.pos_kind else None
    # (without tri, LT[n:] receives each row's largest tile logit: the backward's LSE is formed from it)
    lt = torch.full((n if tri else 2 * n,), float("-inf"), dtype=torch.float32, device=dev) if split else None
    n_rb = triton.cdiv(n, cfg.block_m)
    progs, col_part, n_loop = n_rb, p.dummy, n_rb
    if want_col:
        progs = TL._col_programs(n_rb, dev)
        col_part = TL._alloc((progs, m), torch.float32, dev)  # every element is written by the kernel
    elif tri:
        progs = TL._col_programs(n_rb, dev)
        n_loop = triton.cdiv(n_rb, progs) * progs  # whole rounds of the zig-zag order
        # a program's rows reach only the columns from its first row block on
        col_part = torch.full((progs, m), float("-inf"), dtype=torch.float32, device=dev)
    TL._launch(TL.Launch(
        "lse_fwd", KL.lse_fwd_kernel, (progs,),
        dict(SA=p.sa, SB=p.sb, RSA=p.norms[4], RSB=p.norms[5], SCALE=TL._scale32(scale, dev), **TL._problem_args(p),
             LSE=lse, LSE_POS=lse_pos if lse_pos is not None else p.dummy, COL_PART=col_part,
             **TL._sizes(p), **TL._mask_args(p, spec), n_row_blocks=n_loop,
             TGT=target.contiguous() if split else p.dummy, LT=lt if split else p.dummy),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **TL._flags(p, spec),
             WANT_COL=bool(want_col), TRI=bool(tri), SPLIT_T=split),
        cfg.num_warps, cfg.num_stages))
    # merge the per-program partial column LSEs (fixed order: deterministic)
    lse_col = torch.logsumexp(col_part, dim=0) if want_col else None
    if tri:
        lse = torch.logaddexp(lse, torch.logsumexp(col_part, dim=0))
    if split:  # lse is LSEx here: the target's logit lt apart
        lse, lse_col = merge_split(lse, lse_col, lt, target, tri, minus_target)
    return lse, lse_col, lse_pos, p


def splits_forward(ctx, coef, dt: torch.dtype) -> bool:
    """Whether a log-sum-exp piece's forward keeps each row's target entry out of its statistics: a target split
    asked (``ctx.split``), a row LSE term, and any operand dtype the kernels take: fp32 tiles cancel as 16-bit ones do,
    since ``LSE_i - l_it`` and ``p_t - 1`` are formed in fp32 either way (fp32 InfoNCE at margin 13 on the fused
    kernels: a row's loss 1.85x off float64 and the gradients 0.30 of the largest before:
    tests/test_exact_target.py)."""
    return ctx.split is not None and coef.lse is not None and dt in (torch.float16, torch.bfloat16, torch.float32)


def keep_exact(ctx, minus: dict, less: Tensor, sym: bool, want_col: bool) -> None:
    """Keep, on ``ctx``, the split forward's statistics ``minus`` for the backward's :func:`exact_weights`
    (``ctx.exact``) and the target term's coefficients those weights hold (``ctx.exact_less``, ``less``), except for
    B is A with a column term (``sym`` and ``want_col``: the symmetric tile's column part of ``(i, t_i)`` belongs to
    another row's target), where both are None."""
    ok = bool(minus) and not (sym and want_col)
    ctx.exact, ctx.exact_less = (minus, less) if ok else (None, None)


def backward_exact(ctx, split: Tensor | None, g: Tensor, g_col: Tensor | None, lse_col: Tensor | None):
    """The backward's combined target weights (:func:`exact_weights`) where the forward kept the statistics
    (:func:`keep_exact`) and the backward splits the target (``split``); else None."""
    if split is None or getattr(ctx, "exact", None) is None:
        return None
    return exact_weights(ctx.exact, split, g, g_col, lse_col)


def _lse_bwd(p: TL._Prepared, scale, spec: CoreSpec, lse: Tensor, lse_col: Tensor | None,
             lse_pos: Tensor | None, g: Tensor | None, g_col: Tensor | None,
             g_pos: Tensor | None, need_a: bool, need_b: bool, need_s: bool, wide: bool = False,
             target: Tensor | None = None, g_set: Tensor | None = None, exact: Tensor | None = None):
    """Backward launcher: ``(dA, dB, ds)`` (None where not needed); dA, dB in the kernels' input dtype
    (fp32 with ``wide``: the core op sums its pieces' gradients before one rounding, ``core.PiecesFn``).
    With ``target`` [N] (int64) each row's target column is left out of dA and dB
    and ``(dA, dB, ds, tw)`` comes back, ``tw`` [N] fp32 the gradient of the LSE terms with respect to
    the target logit ``l[i, target[i]]`` (what the caller applies with the target term); with ``exact`` [N] fp32
    (:func:`exact_weights`) the tiles take it at each row's target entry, so ``tw`` is that weight (plus the SET
    term's share with ``g_set``).
    With ``g_set`` [N] fp32 (the SET term's upstream coefficients ``c.set_i g``; ``g_pos`` None, ``p`` prepared
    with its positives) the tiles take the SET term's gradient ``-g_set_i w_ij`` in fp32 before their 16-bit
    cast (kernels/lse.py ``SPLIT_SET``): dA, dB and ds then hold the SET term's gradient too.

    ``p`` comes from :func:`_lse_fwd`; ``g*`` are fp32 upstream gradients of LSE, LSEcol, LSEpos
    (None when absent). With ``p.sym`` dA holds both roles of A and dB is None. ``ds`` is a 0-dim
    fp32 tensor (no host sync anywhere).
    """
    a, b = p.a, p.b
    dev = a.device
    n, d = a.shape
    m = b.shape[0]
    need_b = need_b and not p.sym
    if g_set is not None and (g_pos is not None or not p.pos_kind):
        raise ValueError("core: the SET split needs the positives prepared and no softmax over positives")
    gs = TL._gscale(g, g_col, g_pos, set_bound(g_set, p))
    if gs is None:
        out = TL._no_grads(a, b, need_a, need_b, need_s)
        return out if target is None else (*out, torch.zeros(n, dtype=torch.float32, device=dev))
    split = target is not None
    if exact is not None and not split:
        raise ValueError("core: the exact target weights need the target split (target)")
    # (EXACT_T: the row kernel reads its rows' combined weights from TV, over gscale, then writes TV)
    tv = (exact / gs if exact is not None else torch.empty(n, dtype=torch.float32, device=dev)) if split else None
    tgt = target.contiguous() if split else None
    na, ra, nb, rb, rsa, rsb = p.norms
    dm = p.dummy
    common = dict(SCALE=TL._scale32(scale, dev), GSCALE=gs, **TL._problem_args(p),
                  LSE=lse, G=g if g is not None else dm,
                  LSE_COL=lse_col if lse_col is not None else dm, G_COL=g_col if g_col is not None else dm,
                  LSE_POS=lse_pos if lse_pos is not None else dm,
                  G_POS=g_pos if g_pos is not None else (g_set if g_set is not None else dm))
    flags = dict(**TL._flags(p, spec), HAS_G=g is not None, HAS_GCOL=g_col is not None, HAS_GPOS=g_pos is not None,
                 PRESCALE=TL.prescale(a.dtype), SPLIT_T=split, SPLIT_SET=g_set is not None)
    arch = TL._arch(dev)
    da = db = ds = None

    # (the row kernel also reports the target columns' weights; known already where the exact weights are, but for the
    # SET term's share)
    if need_a or need_s or (split and (exact is None or g_set is not None)):
        cfg, block_d, resident = config_for("bwd_rows", arch, a.dtype, d)
        n_rb = triton.cdiv(n, cfg.block_m)
        da = TL._alloc((n, d), torch.float32 if wide else a.dtype, dev) if need_a else dm
        acc = dm if (resident or not need_a) else torch.empty((n, d), dtype=torch.float32, device=dev)
        ds_part = TL._alloc((n_rb,), torch.float32, dev) if need_s else dm
        TL._launch(TL.Launch(
            "lse_bwd_rows", KL.lse_bwd_rows_kernel, (n_rb,),
            dict(A=a, SA=p.sa, SB=p.sb, RA=ra, NA=na, RSA=rsa, RSB=rsb, **common, DA=da, ACC=acc, DS_PART=ds_part,
                 TGT=tgt if split else dm, TV=tv if split else dm, **TL._sizes(p), stride_a=a.stride(0),
                 stride_da=da.stride(0) if need_a else 0,
                 **TL._mask_args(p, spec), eps=float(spec.eps)),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, SYM=p.sym,
                 NEED_DX=bool(need_a), NEED_DS=bool(need_s), RESIDENT=resident, EXACT_T=exact is not None),
            cfg.num_warps, cfg.num_stages))
        ds = ds_part.sum() * gs.reshape(()) if need_s else None
        da = da if need_a else None

    if need_b:
        gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
        cfg, block_d, resident = config_for("bwd_cols", arch, b.dtype, d)
        db = TL._alloc((m, d), torch.float32 if wide else b.dtype, dev)
        if gcols < m:
            db[gcols:].zero_()  # queue columns get no gradient
        if gcols > 0:
            acc = dm if resident else torch.empty((gcols, d), dtype=torch.float32, device=dev)
            TL._launch(TL.Launch(
                "lse_bwd_cols", KL.lse_bwd_cols_kernel, (triton.cdiv(gcols, cfg.block_n),),
                dict(B=b, SA=p.sa, SB=p.sb, RB=rb, NB=nb, RSA=rsa, RSB=rsb, **common, DB=db, ACC=acc,
                     TGT=tgt if split else dm, **TL._sizes(p),
                     stride_b=b.stride(0), stride_db=db.stride(0), **TL._mask_args(p, spec), eps=float(spec.eps),
                     grad_cols=gcols),
                dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, RESIDENT=resident),
                cfg.num_warps, cfg.num_stages))
    if split:
        return da, db, ds, tv * gs.reshape(())
    return da, db, ds


def set_bound(g_set: Tensor | None, p: TL._Prepared) -> Tensor | None:
    """``|g_set_i| max_j w_ij`` as one more vector for ``gscale`` (None without ``g_set``): the SET term's
    tile entries ``g_set_i w_ij`` over gscale then stay within 1, as every other term's, so the pre-scaled
    fp16 tile keeps its bound (kernels/lse.py, "Numerics"). Label weights are 1; a dense mask's largest
    weight is read on the device (no host synchronisation)."""
    if g_set is None:
        return None
    if p.pos_kind == 2:
        return g_set.abs() * p.pos_mask.amax().to(torch.float32)
    return g_set


def set_split(ctx, dt: torch.dtype, spec: CoreSpec, data: CoreData, coef) -> object:
    """The SET coefficients the Triton piece takes into its 16-bit tiles (``ctx.set_coef``, which
    ``core.forward_parts`` sets where a SET term runs beside it), or None: 16-bit operands (fp32 tiles do
    not round ``p``), positives present, no softmax over positives (its coefficients ride on the same
    kernel argument) and no target margin (SET then sums the unshifted logits)."""
    c = getattr(ctx, "set_coef", None)
    if c is None or dt == torch.float32 or coef.pos is not None or spec.margin != 0.0 or not data.has_positives:
        return None
    return c


