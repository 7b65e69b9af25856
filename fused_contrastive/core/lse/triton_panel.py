"""The panel path of the Triton backend: matmuls in cuBLAS GEMMs, the per-logit work in one Triton kernel.

Why: the fused backward kernels (``kernels/lse.py``) recompute tiles and accumulate ``dl @ B`` through
a per-64-column read-modify-write of an fp32 scratch when D > 128 (~18 FLOP/B of L2 traffic, modelled
at 12-20% of bf16 peak on an H100; ``docs/panel-path.md``). Here every matmul is a
``torch.mm`` / ``addmm`` (cuBLAS on a GPU, fixed call order: deterministic for a fixed shape and
device), and ``kernels/panel.py`` does the softmax work of a panel in one pass.

Sweep over row panels of P rows (whole rows, all M columns), panel ``P_k = [r0, r0 + P)``:

1. ``X_P`` = A's rows scaled by a power of two each (exact; the products cannot overflow) with their
   clamped norms, by the row-norm prologue kernel (one launch per panel; B's norms once, in chunks);
2. ``Lraw = X_P @ B^T``, fp32 output (``out_dtype`` GEMM for 16-bit operands) [P, M]; the inverse
   norms are folded in by the kernel (raw operands: no normalised copy of A or B);
3. ``DL, W = panel_dl_kernel(Lraw, statistics)``: DL [P, M] in the operand dtype (fp16: times 2^13),
   W [P] row weights, the gradient tile being ``diag(W) DL`` (see "one pass" below);
4. ``dA_P`` = the normalisation backward of ``s gs / PRESCALE * diag(W) (DL @ B_op)`` (GEMM fp32 out,
   then ``panel_rows_kernel``, which also writes ``XW = diag(W) A_hat_P`` in the operand dtype);
5. ``acc[:gcols] += DL[:, :gcols]^T @ XW`` (fp32 accumulator of dB, ``addmm`` with ``out=acc``: one
   fixed order over the panels); after the sweep, dB from ``acc`` by the same row epilogue (times
   the norm of each row when the kernel folded its inverse norm).

Six launches per panel (row norms, 2 GEMMs + addmm, 2 Triton kernels), a handful per call.

**The epilogue GEMM** (16-bit operands, :func:`use_epilogue`): steps 2 and 3 become one Triton GEMM,
``kernels/panel.py`` ``epi_gemm_kernel``, whose epilogue forms DL (and W) from the products in registers
(:func:`_epi_panel`); the fp32 ``Lraw`` is never allocated (``panel_rows(..., epilogue=True)``: about 2.7x
taller panels for the same budget). Its statistics mode (:func:`stats_forward`) replaces the fused
forward kernel where the statistics come first (a column term, per-row output, the triangular sweep).

**One pass** (``ONE_PASS``: a summed loss without a column term and without a softmax over positives,
unit rows, bf16 / fp32 operands: InfoNCE, SimCSE, DSCL, ...): every logit is at most
``c = |s| (+ bias)``, so the kernel writes ``e_ij = exp(l_ij - m)``, ``m = c - 56`` (``e_ij <= e^56``:
no overflow of fp32 sums over M < 2^31 columns, derived in kernels/panel.py) in the same read that sums
``z_i = sum_j e_ij``; ``LSE_i = m + log z_i`` and ``W_i = g_i / (gscale z_i)`` follow, and the
gradient tile ``g_i p_ij = W_i e_ij`` needs no second read of the fp32 panel. A row block with a row of
``z_i < 2^-64`` (all its logits below ``c - 104.4``: possible only for ``|s| + bias > 52``; at
``|s| = 100`` a row whose every cosine is below -0.004; its small ``e_ij`` would lose precision) is
redone exactly in two passes (``W = 1`` there). Otherwise
(positives' softmax, fp16, raw dot products) the eager sweep reads the panel twice; with a target term split out
of 16-bit tiles (no bias column, no positives' softmax) those take the split statistics forward and the recomputing
backward instead, whose exact target weights the eager sweep's statistics cannot give.

Units (one unit = one N x M x D matmul = 2 N M D FLOPs), by case:

* B is A without a bias, no column term, no softmax over positives (symmetric SimCSE,
  InfoNCE of a batch against itself; summed or per row): the **triangular sweep**, **2 units** plus
  the diagonal blocks (``P / N`` of a unit). Forward: the fused forward kernel over the tiles on and
  above the diagonal only (``lse_fwd_kernel`` with TRI, half a unit, no logits in memory: each tile's
  row statistics for its rows, its column statistics for the rows of its columns, merged per row by
  the host; 16-bit operands with a target term: each row's target logit kept apart, SPLIT_T, so that the
  row's loss is ``softplus(LSEx_i - l_it)``, not the cancellation ``LSE_i - l_it``). Backward
  (:func:`tri_backward`): panel ``[r0, r1)`` holds its rows against columns
  ``[r0, N)`` only (the logits are symmetric), the logits GEMM (half a unit over the sweep),
  ``H = G + G^T`` from the same tile (``panel_dl_kernel`` with SYM and TRI), then
  ``acc[r0:r1] += H @ A[r0:]`` and ``acc[r1:] += H[:, P:]^T @ A_P`` (one unit), one fp32 accumulator
  of dA.
* other summed losses without a column term (InfoNCE, two-view / supervised SimCSE, SupCon, DSCL, ...;
  B is A with a bias or positives included, its two roles summed): **3 units, all cuBLAS**. The panel
  spans whole rows, so the kernel forms each row's LSE / LSEpos in the same sweep (``EAGER``) and the
  gradient is formed in the forward (scaled by the scalar upstream gradient in backward), as the
  torch backend does on CPU.
* per-row output or a column term (CLIP), A != B: the statistics first, from the fused forward kernel
  (1 unit, ``lse_fwd_kernel``: row, positive and column LSEs from the same tiles), then the panel
  backward (3 units, cuBLAS): **4 units**. (A panel sweep for the column LSE would also cost 1 unit.)
* the same with A is B without a bias (CLIP of A against itself, positives' softmax): fused forward (1) +
  panel backward with ``H = dl + dl^T`` from the same tile (logits 1 + ``H @ A`` 1): **3 units**, no
  dB accumulator.
* ``need_b`` False (a frozen tower): the ``dl^T @ A`` GEMM is skipped (2 units).
* a second backward through a retained graph after an EAGER forward: the recomputing panel backward
  from the statistics the eager sweep saved (3 more units).

No case falls back to the fused kernels on this path: every term of the core op (LSE, LSEcol, LSEpos
with label or dense-mask positives, exclude_self with an offset, the bias column, grad_cols, the
temperature gradient) is covered; TGT and SET are O(N*D) and come from ``linear_terms.py`` on every path.

Memory (bytes; e = operand element size; "extra" = allocated by the loss beyond its inputs and the
gradients it returns; the fused forward's scaled copies ``sa, sb`` (``e (N + M) D``) and column
partials (``4 x 2 SMs x M``) of the non-EAGER cases exist only during the forward and are not kept;
B's row-norm chunks, ``e 2^22`` bytes, only before the sweep)::

    fixed  = 4 M D  [dB accumulator, dB needed]  +  e M D  [fp16 only: normalised B]
    per panel row  = (4 + e) M  [Lraw fp32, DL]  +  (4 + 2 e) D  [X_P, the dA GEMM's fp32 output, XW]
                     + 16  [norms, W]
    P = min(N, max(P_MIN, round_down_64((BUDGET - fixed) / per_row)))
    extra = fixed + P * per_row + O(N + M)

With the default ``BUDGET = 0.70e9`` at N = M = 131072, D = 768, bf16: fixed = 402.7 MB, per_row =
792 592 B, P = 320, extra = 656.3 MB + ~5 MB of vectors < 0.72 GB. At N = M = 65536: P = 1216.

GEMM FLOPs and bytes per panel (the model helper's inputs; P rows, M columns, D, e):

* logits: ``2 P M D`` FLOPs; reads ``e (P + M) D``, writes ``4 P M``;
* ``DL @ B``: ``2 P M D``; reads ``e (P M + M D)``, writes ``4 P D``;
* ``DL^T @ XW``: ``2 P M D``; reads ``e (P M + P D)``, read-modify-writes the fp32 accumulator
  ``8 M D`` (arithmetic intensity ~P/4 FLOP per accumulator byte: P >= ~1200 keeps it compute-bound
  on an H100's HBM, so small budgets at very large M make this GEMM bandwidth-bound);
* the Triton kernel: reads ``4 P M`` (two-pass EAGER ``8 P M``) + masks, writes ``e P M``
  (``kernels/panel.py``); the row epilogue O(P D).

Limits: products ``|pw_i A_i| |B_j|`` must stay in the fp32 range (raw B: rows of norm above ~1e37);
cuBLAS GEMMs are deterministic for a fixed shape, device and library version (set
``CUBLAS_WORKSPACE_CONFIG`` as PyTorch's determinism notes say when several streams are used); fp32
operands run the GEMMs in fp32 (or TF32 where the user allowed it), unlike the fused kernels' tf32x3.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...kernels import panel as KP
from .. import target_split
from ..spec import Coeffs, combine, set_grad
from ..triton_shared import gluon_epi, logit_pass, panels
from ..triton_shared import launch as TL
from ..triton_shared.configs import (
    EPI_GEMM,
    EPI_GROUP_M,
    PANEL_WARPS,
    STATS_MERGE_BLOCK_O,
    STATS_MERGE_BLOCK_P,
)
from ..triton_shared.launch import (
    Launch,
    _alloc,
    _gscale,
    _mask_args,
    _problem_args,
    _upcast,
)
from ..triton_shared.target import target_cos
from . import triton_fused

# The fp32-output GEMM of 16-bit operands. ``torch.mm(x, y, out_dtype=torch.float32)`` and
# ``torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)`` (fp32 ``acc``, bf16 / fp16 ``x``, ``y``)
# are the cheap route on CUDA (cuBLAS accumulates in fp32 and writes fp32), but whether a torch build
# has them, and accepts an fp32 ``self`` beside 16-bit operands, depends on its version (the overload
# is new; some CUDA builds reject the mixed-dtype addmm). So neither runs unproven: the first CUDA call
# per (device, dtype) runs both on tiny tensors of the real call's layout (transposed views, ``out=``
# the accumulator) against a float64 product (:func:`_probe`) and caches the verdict; on an exception
# or a mismatch it warns once and takes the fallback, which is correct everywhere:
#   mm    "native" | "upcast": torch.mm(x.float(), y.float()) (an fp32 copy of both operands)
#   addmm "native" | "mm_add": acc.add_(panels._mm32(x, y)) (one fp32 [rows, cols] temporary)
#         | "upcast": acc.addmm_(x.float(), y.float())
# The CPU has neither op (torch 2.13: "Could not run 'aten::mm.dtype' ... CPU"): it takes "upcast"
# unprobed; the meta device (the GPU model) records the native calls. Tests force the probe on the CPU
# with stand-ins for the native calls (:data:`GEMM_PROBE_DEVICES`, :data:`NATIVE_GEMMS`).


def stats_forward(launch, prep, a: Tensor, b: Tensor, scale_t: Tensor, spec, want_col: bool, tri: bool = False,
                  target: Tensor | None = None, minus_target: dict | None = None) -> tuple[Tensor, Tensor | None]:
    """``(LSE [N], LSEcol [M] or None)`` by the epilogue GEMM's statistics mode (MODE 3, one matmul unit,
    two exps per logit, nothing of size P x M written): per panel of rows the tiles' row maxima and
    sums, and with ``want_col`` their column maxima and sums, merged in a fixed order (``logsumexp`` over
    the tiles; the columns' over the panels by ``logaddexp``): deterministic and exact for any logits.
    Replaces the fused forward kernel (``lse_fwd``) for 16-bit panels without a softmax over positives.
    ``b`` is A itself when B is A. ``tri`` (the triangular sweep: B is A, symmetric logits, row LSE
    only): panel ``[r0, r1)`` against rows ``[r0, N)`` only (half a unit over the sweep), its row
    statistics for its rows and its column statistics for the rows past it, merged per row.

    ``target`` [N] (int64) with a dict ``minus_target``: the tiles leave each row's target entry out of its
    statistics (SPLIT_T: ``(i, t_i)`` out of row i's; with ``tri`` ``(t_j, j)`` out of column j's, else with
    ``want_col`` ``(j, j)`` out of column j's where ``t_j = j``, CLIP's pairs), so the merge gives ``LSEx_i`` over
    every other column; the target's logit ``l_it = s c_i`` comes from the row's fp32 cosine with its target row
    (``triton_shared.target.target_cos``, -inf where the target is out of range or the row's own excluded column),
    the returned LSE is ``logaddexp(LSEx_i, l_it)`` (``l_it`` as the tile rounds it), and the dict receives
    ``"loss"`` [N] fp32, each row's ``LSE_i - l_it`` as ``softplus(LSEx_i - l_it)`` (no cancellation in the
    saturated regime; ``LSE_i`` where ``l_it`` is -inf) and ``"fold"`` [N] fp32, 1 where the row's entry is the
    difference and 0 where it is ``LSE_i``, as ``triton_fused._lse_fwd``'s split forward reports them (without
    ``tri``: ``target_split.merge_split``, the columns' too). A bias column (a margin: AM-softmax, LaBSE) adds its
    bias to ``l_it`` where ``t_i`` is the row's bias column, as the tiles do. No bias column with ``tri``.
    With the option ``FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws`` (sm_90 and a tested Triton: ``triton_shared.gluon_epi``)
    the partials come from the persistent warp-specialised Gluon kernel instead (the same rows' layout; the columns'
    per 64 rows), but not with the target split, which the Gluon kernel does not have."""
    split = target is not None and minus_target is not None
    if split and tri and prep.bias_col is not None:
        raise ValueError("stats_forward: target: the triangular statistics forward's split takes no bias column")
    n, d = a.shape
    m = b.shape[0]
    dev, dt = a.device, a.dtype
    config = "stats_split" if split and not tri else "stats"  # (their persistent forms differ: configs.py)
    cfg = EPI_GEMM[config]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_d
    pr = panels._Problem(a, b, spec, need_op=False)
    p_rows = panels.panel_rows(n, m, d, dt, False, True)
    dm = prep.dummy
    lse = _alloc((n,), torch.float32, dev)
    lse_col = torch.full((m,), float("-inf"), dtype=torch.float32, device=dev) if want_col or tri else None
    # (split) each row's target logit as the tiles round it, where its panel's tiles hold it; NaN elsewhere
    lt_tile = torch.full((n,), float("nan"), dtype=torch.float32, device=dev) if split else None
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0, UPCAST=_upcast(dt),
                 MODE=3, NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                 HAS_BIAS=prep.bias_col is not None, BIAS_COS=spec.margin != 0.0, POS_KIND=0, HAS_G=False,
                 HAS_GCOL=False, HAS_GPOS=False, SYM=False, NEED_DS=False, FOLD_RB=False, PRESCALE=1.0, TRI=bool(tri),
                 WANT_COL=bool(want_col or tri), SPLIT_T=split, LEAN=False)
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        x, rs, _ = pr.rows(r0, r1)
        c0 = r0 if tri else 0  # the triangular frame: columns [r0, N) of B = A, indices from 0
        y, mc = b[c0:], m - c0
        n_pm, n_pn = triton.cdiv(pp, bm), triton.cdiv(mc, bn)
        # (the option FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws, sm_90 only: the Gluon kernel, whose column partials are per
        # row tile of its own height)
        gluon = gluon_epi.use_gluon(x, y, const)
        n_cp = triton.cdiv(pp, gluon_epi.BLOCK_M) if gluon else n_pm
        rm = _alloc((pp, n_pn), torch.float32, dev)
        rz = _alloc((pp, n_pn), torch.float32, dev)
        cm = _alloc((n_cp, mc), torch.float32, dev) if want_col or tri else dm
        cz = _alloc((n_cp, mc), torch.float32, dev) if want_col or tri else dm
        args = dict(X=x, Y=y, DL=dm, ZP=rz, TP=dm, MXP=rm, CZ=cz, CM=cm, DS_PART=dm, BAD=dm, SHIFT=dm, LBIAS=dm,
                    RSP=rs.contiguous(), RB=pr.rb[c0:] if pr.rb is not None else dm, SCALE=scale_t,
                    GSCALE=dm, **_problem_args(prep), LSE=dm, G=dm, LSE_COL=dm, G_COL=dm, LSE_POS=dm, G_POS=dm,
                    TGT=(target[c0:] - c0).contiguous() if split else dm, TV=lt_tile[r0:r1] if split else dm,
                    P=pp, M=mc, D=d, r0=0 if tri else r0, stride_x=x.stride(0), stride_y=y.stride(0), stride_dl=0,
                    stride_zp=n_pn, **_mask_args(prep, spec))
        if gluon:
            gluon_epi.stats_launch(launch, gluon_epi.NAME, args, const, n_cp * n_pn, panels.persistent_programs(dev))
        else:
            panels._epi_launch(launch, "epi_gemm_stats", args, const, config, n_pm * n_pn)
        del x
        # the partials merged by stats_merge_kernel: the rows' over their column tiles, the columns' over the
        # panel's row tiles and into their statistics so far
        bo, bp = STATS_MERGE_BLOCK_O, STATS_MERGE_BLOCK_P
        launch(Launch("stats_merge", KP.stats_merge_kernel, (triton.cdiv(pp, bo),),
                      dict(MX=rm, Z=rz, OUT=lse[r0:r1], n_out=pp, n_part=n_pn, stride_o=n_pn, stride_p=1),
                      dict(BLOCK_O=bo, BLOCK_P=bp, ACC=False), 4, 1))
        if want_col or tri:
            launch(Launch("stats_merge", KP.stats_merge_kernel, (triton.cdiv(mc, bo),),
                          dict(MX=cm, Z=cz, OUT=lse_col[c0:], n_out=mc, n_part=n_cp, stride_o=1, stride_p=mc),
                          dict(BLOCK_O=bo, BLOCK_P=bp, ACC=True), 4, 1))
    if tri:  # every row: its panel's row statistics and the column statistics of the panels above it
        lse = torch.logaddexp(lse, lse_col)
        if split:  # lse is LSEx here: the target's logit apart
            lse = _add_target(lse, a, target, scale_t, spec, minus_target, lt_tile)
        return lse, None
    if split:  # LSEx and LSEcolx: the dot's target logit for the losses, the tile's for the backward's LSEs
        # (merge_split's second half is each row's largest tile logit, which it takes where the dot's value lies
        # within TILE_TARGET_TOL of it: the tile's own target logit always does)
        lt = _target_logit(a, b, target, scale_t, spec, bias_col=prep.bias_col)
        return target_split.merge_split(lse, lse_col, torch.cat([lt, lt_tile]), target, False, minus_target)
    return lse, lse_col


def _target_logit(a: Tensor, b: Tensor, target: Tensor, scale_t: Tensor, spec, with_valid: bool = False,
                  bias_col: Tensor | None = None):
    """``l_it = s c_i`` [N] fp32, ``c_i`` the fp32 cosine of row i of ``a`` with row ``t_i`` of ``b`` (one O(N D) row
    kernel, ``target_cos``), -inf where the target is out of range or the row's own excluded column; with
    ``with_valid`` ``(valid, l_it)``. ``bias_col`` [N] (the prepared bias column, or None): where ``t_i`` is it, the
    tiles' bias, ``s (c_i - margin)`` for a margin (the kernels' BIAS_COS), else ``s c_i + bias``."""
    n = a.shape[0]
    idx = torch.arange(n, device=a.device)
    valid = (target >= 0) & (target < b.shape[0])
    if spec.exclude_self:
        valid = valid & (target != idx + int(spec.offset))
    cos = target_cos(a, b, torch.where(valid, target, torch.zeros_like(target)), spec.eps, spec.normalize)
    s = scale_t.reshape(())
    lt = cos * s
    if bias_col is not None:
        hit = target == bias_col
        lt = torch.where(hit, (cos - spec.margin) * s if spec.margin != 0.0 else lt + spec.bias, lt)
    lt = torch.where(valid, lt, float("-inf"))
    return (valid, lt) if with_valid else lt


def _add_target(lsex: Tensor, a: Tensor, target: Tensor, scale_t: Tensor, spec, minus_target: dict,
                lt_tile: Tensor) -> Tensor:
    """``LSE_i = logaddexp(LSEx_i, l_it)`` of the triangular statistics forward with the target split out (B is A,
    no bias: ``l_it = s c_i``, ``c_i`` the fp32 cosine of row i with row ``t_i``; -inf for a target out of range
    or at the row's own excluded column), and ``minus_target``'s ``"loss"`` / ``"fold"`` (:func:`stats_forward`).
    The returned LSE (the backward's) takes ``l_it`` as the tiles round it (``lt_tile``, MODE 3's TV; NaN where the
    row's panel did not hold its target: the dot's value there): the backward weighs the target entry by
    ``exp(l_it - LSE_i)`` from its own tile against the target term's -1, and in the saturated regime an ulp of
    ``|s|`` between the dot's rounding and the tile's was the whole error of that difference (SimCSE bf16 at a
    margin of 13: 1.2e-2 of the largest gradient with the dot's value, 6.3e-3 without the split)."""
    valid, lt = _target_logit(a, a, target, scale_t, spec, True)
    x = lsex - lt  # softplus(x) = log(1 + e^x), accurate on both sides
    loss = torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))
    lse = torch.logaddexp(lsex, torch.where(valid & ~torch.isnan(lt_tile), lt_tile, lt))
    # (1 - p_t as the backward's LSE makes it: target_split.exact_weights)
    minus_target.update(loss=torch.where(valid, loss, lse), fold=valid.to(torch.float32),
                        rest=torch.where(valid, torch.exp(lsex - lse), 0.0))
    return lse


def _one_pass_shift(scale_t: Tensor, spec, has_bias: bool, bias: float) -> Tensor:
    """The fixed shift ``m = c - 56`` of the one-pass sweep as a 0-dim fp32 tensor (the kernels'
    ``_one_pass_shift``: ``c = |s|``, plus the kernels' ``bias`` argument (``_mask_args``) when positive,
    in cosine units for a margin)."""
    s = scale_t.reshape(()).abs()
    c = s
    if has_bias:
        c = s + s * max(bias, 0.0) if spec.margin != 0.0 else s + max(bias, 0.0)
    return c - KP.ONE_PASS_SHIFT.value


def sweep(launch, prep, a: Tensor, b: Tensor, sym: bool, scale_t: Tensor, spec,
          lse: Tensor | None, lse_col: Tensor | None, lse_pos: Tensor | None,
          g: Tensor | None, g_col: Tensor | None, g_pos: Tensor | None,
          need_a: bool, need_b: bool, need_s: bool, eager: bool, wide: bool = False,
          target: Tensor | None = None, minus_target: dict | None = None, g_set: Tensor | None = None,
          exact: Tensor | None = None):
    """One panel sweep: ``(dA, dB, ds, LSE, LSEpos, tw)`` (dA / dB in the operand dtype, fp32 with ``wide``;
    ds 0-dim fp32; LSE / LSEpos only with ``eager``, else None; None where not asked).

    ``target`` [N] (int64): each row's target column is left out of the gradient
    tiles, and ``tw`` [N] fp32 is the gradient with respect to the target logit ``l[i, target[i]]``
    (for the coefficients ``g``; what the caller applies with the target term, ``core.PiecesFn``);
    else ``tw`` is None.

    ``g_set`` [N] fp32 (``g_pos`` None, ``prep`` with the positives, not the one pass: :func:`takes_one_pass`): the SET
    term's upstream coefficients (with ``eager`` its coefficients), whose gradient ``-g_set_i w_ij`` the tiles
    form in fp32 before their 16-bit cast (``SPLIT_SET``): dA, dB and ds then hold it.
    ``minus_target`` (a dict, with ``target``): where the sweep is the one pass (the epilogue GEMM's, or the
    cuBLAS form's ``panel_dl_kernel`` with ONE_PASS) it receives ``"loss"`` [N] fp32, each row's ``LSE_i - l_it``
    formed without the cancellation (``log1p(zx_i / e_it)`` from the tile's exponentials, the target's kept out of
    the row's sum; ``kernels/panel.py`` ``_loss_less_target``; ``LSE_i`` on a row where that form is not taken)
    and ``"fold"`` [N] fp32, 1 where the row's entry is the difference and 0 where it is ``LSE_i``; other sweeps
    leave it empty.

    ``exact`` [N] fp32 (with ``target``, known statistics: not ``eager``): each row's log-sum-exp weight at its
    target combined with the target term's share (``target_split.exact_weights``), which the tiles take at the
    target entry (EXACT_T): ``tw`` is then that weight.

    ``prep`` is the fused path's ``_Prepared`` (labels, mask, bias columns, dummy); ``launch`` is
    ``triton_shared/launch.py`` ``_launch`` (so the AOT recorder sees these launches). With ``eager``, ``g`` /
    ``g_pos`` are the coefficients as [N] fp32 and ``lse`` / ``lse_pos`` are produced here. ``sym``:
    B is A without a bias, dA holds both roles and dB is None.
    """
    n, d = a.shape
    m = b.shape[0]
    dev, dt = a.device, a.dtype
    need_b = need_b and not sym
    gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
    # one read of each panel (the fixed-bound exponentials, see kernels/panel.py) where the bound is
    # known (unit rows) and a single softmax forms the gradient (no positives' softmax); fp16 keeps the
    # two passes (its range cannot hold exp(l - |s|))
    one_pass = takes_one_pass(eager, g_pos is not None, spec, dt)
    if one_pass and g_set is not None:
        raise ValueError("core: the one-pass sweep does not take the SET term's gradient into its tiles")
    # the one pass's tiles: the epilogue GEMM's MODE 1, or (PANEL_GEMM=fp16pass) cuBLAS fp16 cosines and one
    # in-place pass over them (core/triton_shared/logit_pass.py), the rest of the one pass shared
    f16 = one_pass and logit_pass.use_fp16_pass(dt)
    # the epilogue GEMM needs the statistics first: known ones (the recomputing backward) or one pass
    epi = f16 or (panels.use_epilogue(dev, dt, "one_pass" if one_pass else "known", n * m) and (one_pass or not eager))
    p_rows = panels.panel_rows(n, m, d, dt, need_b, epi, logit_pass.panel_bytes(m, d) if f16 else (0, 0))
    block_r, block_c = panels.panel_blocks(min(n, p_rows), panels._programs(dev))
    pr = panels._Problem(a, b, spec)
    gs = _gscale(g, g_col, g_pos, triton_fused.set_bound(g_set, prep))
    dm = prep.dummy
    lse_out = torch.empty(n, dtype=torch.float32, device=dev) if eager else None
    lsep_out = torch.empty(n, dtype=torch.float32, device=dev) if eager and g_pos is not None else None
    split = target is not None
    if exact is not None and (not split or eager):
        raise ValueError("core: the exact target weights need the target split and known statistics")
    tw = torch.empty(n, dtype=torch.float32, device=dev) if split else None
    rows_minus = split and one_pass  # (the row kernel, or panel_dl_kernel, writes them; reported when asked)
    loss_rows = torch.empty(n, dtype=torch.float32, device=dev) if rows_minus else None
    fold_rows = torch.empty(n, dtype=torch.float32, device=dev) if rows_minus else None
    da = _alloc((n, d), torch.float32 if wide else dt, dev) if need_a else None
    acc = torch.zeros((gcols, d), dtype=torch.float32, device=dev) if need_b and gcols > 0 else None
    ds_parts = []
    common = dict(RB=pr.rb if pr.rb is not None else dm, SCALE=scale_t, GSCALE=gs, **_problem_args(prep),
                  LSE=lse if lse is not None else dm, G=g if g is not None else dm,
                  LSE_COL=lse_col if lse_col is not None else dm, G_COL=g_col if g_col is not None else dm,
                  LSE_POS=lse_pos if lse_pos is not None else dm,
                  G_POS=g_pos if g_pos is not None else (g_set if g_set is not None else dm),
                  LSE_OUT=lse_out if lse_out is not None else dm,
                  LSE_POS_OUT=lsep_out if lsep_out is not None else dm, TGT=target.contiguous() if split else dm,
                  WX=(exact / gs).contiguous() if exact is not None else dm)
    flags = dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                 HAS_BIAS=prep.bias_col is not None, BIAS_COS=spec.margin != 0.0, POS_KIND=prep.pos_kind,
                 HAS_G=g is not None,
                 HAS_GCOL=g_col is not None, HAS_GPOS=g_pos is not None, SYM=bool(sym), EAGER=bool(eager),
                 ONE_PASS=one_pass, NEED_DS=bool(need_s), FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale,
                 TRI=False, SPLIT_T=split, SPLIT_SET=g_set is not None, EXACT_T=exact is not None)
    bt = b.T
    margs = _mask_args(prep, spec)
    shift = _one_pass_shift(scale_t, spec, prep.bias_col is not None, margs["bias"]) if epi and one_pass else None
    producer = logit_pass.Fp16Pass(a, b, spec, target if split else None) if f16 else None
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        x, rs, nrm = pr.rows(r0, r1)
        dl = _alloc((pp, m), dt, dev)
        tv = _alloc((pp,), torch.float32, dev) if split else dm
        if epi:
            w, ds_part = panels._epi_panel(launch, x, b, dl, rs, dict(common, TV=tv), flags, margs, r0, one_pass, g, gs,
                                           shift, lse_out, dm, tw[r0:r1] if split else None,
                                           loss_rows[r0:r1] if rows_minus else None,
                                           fold_rows[r0:r1] if rows_minus else None, producer)
        else:
            lraw = panels._mm32(x, bt)
            w = _alloc((pp,), torch.float32, dev)
            n_prog = triton.cdiv(pp, block_r)
            ds_part = _alloc((n_prog,), torch.float32, dev) if need_s else dm
            launch(Launch(
                "panel_dl", KP.panel_dl_kernel, (n_prog,),
                dict(L=lraw, DL=dl, W_OUT=w, RSP=rs.contiguous(), **common, TV=tv, DS_PART=ds_part,
                     LOSS=loss_rows if rows_minus else dm, FOLD=fold_rows if rows_minus else dm, M=m, r0=r0, P=pp,
                     stride_l=lraw.stride(0), stride_dl=dl.stride(0), **margs, pm_shift=0),
                dict(BLOCK_R=block_r, BLOCK_C=block_c, **flags), PANEL_WARPS, 1))
            del lraw
        if need_s:
            ds_parts.append(ds_part)
        if split and not (epi and one_pass):  # the target columns' true weights W_i gscale tv_i (tv is in the
            tw[r0:r1] = tv * w * gs.reshape(())  # tile's units; the one-pass epilogue GEMM writes them itself)
        panels._panel_gemms(launch, pr, dl, w, x, rs, nrm, scale_t, gs, da[r0:r1] if need_a else None, acc, gcols, dm)
        del dl, x
    db = None
    if need_b:
        db = panels._db_from_acc(launch, pr, acc, b, gcols, scale_t, gs, dm, wide)
        del acc
    ds = None
    if need_s:
        ds = (torch.cat(ds_parts).sum() * gs.reshape(())) if ds_parts else torch.zeros((), device=dev)
    if rows_minus and minus_target is not None:
        minus_target.update(loss=loss_rows, fold=fold_rows)
    return da, db, ds, lse_out, lsep_out, tw


def takes_one_pass(eager: bool, want_pos: bool, spec, dt: torch.dtype) -> bool:
    """Whether :func:`sweep` reads each panel once (``ONE_PASS``): an eager sweep without a softmax over
    positives, unit rows, bf16 / fp32 operands (fp16's range cannot hold ``exp(l - |s|)``)."""
    return bool(eager and not want_pos and spec.normalize and dt != torch.float16)


def use_tri(p, want_col: bool, want_pos: bool) -> bool:
    """The triangular sweep: B is A without a bias (symmetric logits), no column term, no softmax over
    positives (symmetric SimCSE, InfoNCE of a batch against itself)."""
    return bool(p.sym and not want_col and not want_pos)


def _tri_panels(pr: panels._Problem, a: Tensor, p_rows: int, epilogue: bool):
    """The triangular sweep's panels: ``(r0, P, C, Lraw, rs, x)`` for rows [r0, r0 + P) against rows
    [r0, N) (C = N - r0): ``x`` the rows' operand and ``rs`` its factors; with the cuBLAS form ``Lraw``
    [P, C] their raw products (fp32, one GEMM) and ``x`` None, with the epilogue GEMM ``Lraw`` None."""
    n = a.shape[0]
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        x, rs, _ = pr.rows(r0, r1)
        if epilogue:
            yield r0, r1 - r0, n - r0, None, rs, x
        else:
            lraw = panels._mm32(x, a[r0:].T)
            del x
            yield r0, r1 - r0, n - r0, lraw, rs, None
            del lraw


def tri_backward(launch, prep, a: Tensor, spec, scale_t: Tensor, lse: Tensor, g: Tensor, need_a: bool,
                 need_s: bool, wide: bool = False, target: Tensor | None = None, g_set: Tensor | None = None,
                 exact: Tensor | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward of the triangular sweep: ``(dA, ds)`` of B-is-A logits from the upper triangle only.

    The gradient of symmetric logits is ``dA_hat = s (G + G^T) A_hat`` with ``G_ij = g_i p_ij``. Per panel
    (rows [r0, r1), columns [r0, N)) ``panel_dl_kernel`` (SYM, TRI) writes ``H_ij = G_ij + G_ji`` from
    the one logit (the rows' and the columns' LSE), then ``acc[r0:r1] += H @ A[r0:]`` and
    ``acc[r1:] += H[:, P:]^T @ A_P``: pairs inside the diagonal block once, every other pair from the
    panel of its smaller row. Logits half a unit + the two GEMMs one unit: with the forward's half
    unit, 2 matmul units (the eager sweep takes 3). bf16 / fp32 fold both inverse norms into H, so
    both GEMMs read the raw A and the accumulator holds ``dA_hat_i rb_i`` (undone by the epilogue);
    fp16 reads a normalised fp16 copy of A. dL/ds counts the diagonal block's ``G_ji`` once.

    Returns ``(dA, ds, tw)``. With ``target`` [N] (int64) every row's own target weight ``G_{i, t_i}`` is
    left out of H (at ``(i, t_i)``, and transposed at ``(t_i, i)``) and comes back in ``tw`` [N] fp32
    (as :func:`sweep`'s): from the row's panel when ``t_i`` is in its frame, else from the panel of
    ``t_i`` (the pair's transposed term there); else ``tw`` is None.

    ``g_set`` [N] fp32 (``prep`` with the positives): the SET term's upstream coefficients, its gradient
    ``-g_set_i w_ij`` (and ``-g_set_j w_ji`` in the transposed term) formed in fp32 inside H (``SPLIT_SET``),
    the labels (or the mask's indices, shifted by the panel's first row) in the panel's frame.

    ``exact`` [N] fp32 (with ``target``): each row's combined target weight (``target_split.exact_weights``), which
    H takes at ``(i, t_i)`` and, transposed, at ``(t_i, i)`` in whichever panel holds the pair (EXACT_T, in the
    frame): ``tw`` is then that weight."""
    n, d = a.shape
    dev, dt = a.device, a.dtype
    epi = panels.use_epilogue(dev, dt, "tri", n * n)
    p_rows = panels.panel_rows(n, n, d, dt, True, epi)
    block_r, block_c = panels.panel_blocks(min(n, p_rows), panels._programs(dev))
    pr = panels._Problem(a, a, spec, need_op=need_a)
    gs = _gscale(g, triton_fused.set_bound(g_set, prep))
    dm = prep.dummy
    acc = torch.zeros((n, d), dtype=torch.float32, device=dev) if need_a else None
    ds_parts = []
    split = target is not None
    if exact is not None and not split:
        raise ValueError("core: the exact target weights need the target split (target)")
    tv = torch.zeros(n, dtype=torch.float32, device=dev) if split else None
    wx = (exact / gs).contiguous() if exact is not None else None
    flags = dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self), HAS_BIAS=False, BIAS_COS=False,
                 POS_KIND=0,
                 HAS_G=True, HAS_GCOL=False, HAS_GPOS=False, SYM=True, EAGER=False, ONE_PASS=False,
                 NEED_DS=bool(need_s), FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale, TRI=True, SPLIT_T=split,
                 SPLIT_SET=g_set is not None, EXACT_T=exact is not None)
    if g_set is not None:
        flags["POS_KIND"] = prep.pos_kind
    a_op = pr.b_op  # raw A (folded norms, or no normalisation) or the normalised fp16 copy
    for r0, pp, c, lraw, rs, x in _tri_panels(pr, a, p_rows, epi):
        r1 = r0 + pp
        h = _alloc((pp, c), dt, dev)
        common = dict(RB=pr.rb[r0:] if pr.rb is not None else dm, SCALE=scale_t, GSCALE=gs, **_problem_args(prep),
                      LSE=lse[r0:], G=g[r0:], LSE_COL=dm, G_COL=dm, LSE_POS=dm, G_POS=dm,
                      TGT=(target[r0:] - r0).contiguous() if split else dm, TV=tv[r0:] if split else dm,
                      WX=wx[r0:] if wx is not None else dm)
        if g_set is not None:  # the positives in the panel's frame (row r0 is row 0)
            common.update(G_POS=g_set[r0:], **_framed_positives(prep, r0))
        if epi:
            _, ds_part = panels._epi_panel(launch, x, a[r0:], h, rs, common, flags, _mask_args(prep, spec), 0, False,
                                           None, gs, None, None, dm)
        else:
            n_prog = triton.cdiv(pp, block_r)
            ds_part = _alloc((n_prog,), torch.float32, dev) if need_s else dm
            launch(Launch(
                "panel_dl", KP.panel_dl_kernel, (n_prog,),
                dict(L=lraw, DL=h, W_OUT=_alloc((pp,), torch.float32, dev), RSP=rs.contiguous(),
                     **{"pm_shift": 0, **common},
                     LSE_OUT=dm, LSE_POS_OUT=dm, DS_PART=ds_part, LOSS=dm, FOLD=dm, M=c, r0=0, P=pp,
                     stride_l=lraw.stride(0),
                     stride_dl=h.stride(0), **_mask_args(prep, spec)),
                dict(BLOCK_R=block_r, BLOCK_C=block_c, **flags), PANEL_WARPS, 1))
        del lraw, x
        if need_s:
            ds_parts.append(ds_part)
        if acc is not None:
            panels._addmm32_(acc[r0:r1], h, a_op[r0:])
            if c > pp:
                panels._addmm32_(acc[r1:], h[:, pp:].T, a_op[r0:r1])
        del h
    da = None
    if acc is not None:
        da = _alloc((n, d), torch.float32 if wide else dt, dev)
        wrow = pr.nb if pr.fold else torch.ones(n, dtype=torch.float32, device=dev)
        panels._rows_launch(launch, acc, a, pr.rb, pr.nb, wrow, scale_t, gs, da, None, spec.eps, spec.normalize,
                     pr.prescale, dm)
        del acc
    ds = None
    if need_s:
        ds = torch.cat(ds_parts).sum() * gs.reshape(()) if ds_parts else torch.zeros((), device=dev)
    return da, ds, (tv * gs.reshape(()) if split else None)


def _framed_positives(prep, r0: int) -> dict:
    """ROW_LAB / COL_LAB, or the dense mask's index shift ``pm_shift``, of the triangular sweep's frame that
    starts at row r0 (B is A): the labels from r0 on (views), or ``pm_shift = r0`` (the kernels read
    ``mask[(r0 + i) % n0, (r0 + j) % m0]``)."""
    if prep.pos_kind == 1:
        return dict(ROW_LAB=prep.row_lab[r0:], COL_LAB=prep.col_lab[r0:])
    return dict(pm_shift=r0)


def _vec(c, n: int, dev) -> Tensor:
    if isinstance(c, Tensor):
        return c.to(device=dev, dtype=torch.float32).contiguous()
    return torch.full((n,), float(c), dtype=torch.float32, device=dev)


def forward(ctx, a: Tensor, b: Tensor | None, orig_dtypes, scale, spec, data, coef: Coeffs, reduce: bool):
    """TritonCoreFn.forward on the panel path (``a``, ``b`` already in the kernel dtype)."""
    same = b is None
    want_col, want_pos = coef.col is not None, coef.pos is not None
    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    need_s = need_s and isinstance(scale, Tensor)
    n = a.shape[0]
    dev = a.device
    p = TL._prepare_data(a, b, spec, data, want_pos)
    bb = p.b
    ctx.path = "panel"
    ctx.spec, ctx.coef, ctx.reduce = spec, coef, reduce
    ctx.scale = None if isinstance(scale, Tensor) else scale
    ctx.dtypes = orig_dtypes
    ctx.prep = p._replace(a=None, b=None, sa=None, sb=None)
    scale_t = TL._scale32(scale, dev)
    ctx.tri = use_tri(p, want_col, want_pos)
    # the target column left out of the 16-bit tiles (core.PiecesFn asks, with a target term)
    ctx.split = data.target if getattr(ctx, "split_target", False) and coef.pos is None else None
    eager = reduce and not want_col and not ctx.tri and (need_a or need_b or need_s)
    if eager and not takes_one_pass(eager, want_pos, spec, a.dtype) and not want_pos \
            and triton_fused.splits_forward(ctx, coef, a.dtype):
        # 16-bit tiles with a target term where the one pass does not apply (fp16's range, raw dot products): the
        # split statistics forward and the recomputing backward with the exact target weights, as per-row losses
        # take, instead of the two-pass eager sweep, whose statistics keep the target in (the loss's LSE_i - l_it
        # and the target's p_t - 1 then cancel in a saturated softmax). The same matmul work: 1 unit forward and 2
        # backward against the eager sweep's 3 in forward.
        eager = False
    # the SET term's gradient formed inside the 16-bit tiles (core.PiecesFn hands over its coefficients), except
    # on the one-pass sweep: its e_ij tile is stored before the row's sum is known, so p_ij - c.set_i w_ij cannot
    # be formed there (that route keeps SET's gradient in core/linear_terms.py, rounded apart from p_ij)
    ctx.set_c = triton_fused.set_split(ctx, a.dtype, spec, data, coef)
    if ctx.set_c is not None and takes_one_pass(eager, want_pos, spec, a.dtype):
        ctx.set_c = None
    if ctx.set_c is not None:
        p = TL.with_positives(p, a, b, spec, data)
        ctx.prep = p._replace(a=None, b=None, sa=None, sb=None)
    if eager:
        g = _vec(coef.lse, n, dev)
        g_pos = _vec(coef.pos, n, dev) if want_pos else None
        minus: dict = {}
        da, db, ds, lse, lse_pos, tw = sweep(TL._launch, p, p.a, bb, False, scale_t, spec, None, None, None,
                                             g, None, g_pos, need_a, need_b or (same and need_a), need_s, True,
                                             getattr(ctx, "wide", False), ctx.split, minus_target=minus,
                                             g_set=None if ctx.set_c is None else _vec(ctx.set_c, n, dev))
        if same and da is not None:
            da = da + db  # B is A with a bias: both roles of A
            db = None
        ctx.eager = (da, db, ds, tw)
        lse_col = None
    elif ctx.tri:
        ctx.eager = None
        lse_col, lse_pos = None, None
        minus = {}
        # 16-bit tiles with a target term: each row's loss less its target logit without the cancellation
        # (the epilogue GEMM's statistics with SPLIT_T, stats_forward; the fused forward's, triton_fused._lse_fwd)
        split16 = triton_fused.splits_forward(ctx, coef, a.dtype)
        if panels.use_epilogue(dev, a.dtype, "tri", n * n):
            lse = stats_forward(TL._launch, p, p.a, p.a, scale_t, spec, False, tri=True,
                                target=ctx.split if split16 else None, minus_target=minus)[0]
        else:
            lse = triton_fused._lse_fwd(a, None, scale, spec, data, False, False, tri=True,
                                        target=ctx.split if split16 else None, minus_target=minus)[0]
    else:
        ctx.eager = None
        minus = {}
        # 16-bit tiles with a target term (CLIP, per-row InfoNCE, AM-softmax's margin): each row's loss less its target
        # logit, and CLIP's column's, without the cancellation (the fused forward's split, or the epilogue GEMM's
        # statistics with SPLIT_T); not where FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws asks for the Gluon statistics
        # forward, which has no split (that option keeps the old loss: docs/panel-path.md)
        split16 = triton_fused.splits_forward(ctx, coef, a.dtype) and not want_pos
        if panels.use_epilogue(dev, a.dtype, "known", n * bb.shape[0]) and not want_pos:
            split16 = split16 and not gluon_epi.requested()
            lse, lse_col = stats_forward(TL._launch, p, p.a, bb, scale_t, spec, want_col,
                                         target=ctx.split if split16 else None, minus_target=minus)
            lse_pos = None
        else:
            lse, lse_col, lse_pos, _ = triton_fused._lse_fwd(a, b, scale, spec, data, want_col, want_pos,
                                                             target=ctx.split if split16 else None, minus_target=minus)
    ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos, p.a,
                          None if same else p.b)
    if minus:
        # the one pass (or a split statistics forward) formed each row's LSE_i - l_it without its cancellation (the
        # saturated regime's loss of ~1e-4 against logits of ~|s|): this piece's value takes the target logit out
        # at the coefficient
        # ctx.minus_target [N] (c.lse where the row's entry is the difference, else 0; CLIP's column coefficient
        # where column i's is), which core.forward_parts takes out of the target term's value in turn (the
        # gradients are unchanged)
        ctx.minus_target = g * minus["fold"] if eager else target_split.minus_coefficients(coef, minus, n)
        # the split's statistics for the backward's exact target weights; the one pass's backward ran already, its
        # target weights holding these coefficients' share (kernels/panel.py _target_weight)
        triton_fused.keep_exact(ctx, {} if eager else minus, ctx.minus_target, p.sym, want_col)
        if eager:
            ctx.exact_less = ctx.minus_target
        return combine(coef.to(torch.float32), reduce, minus["loss"], minus.get("col_loss", lse_col), lse_pos)
    return combine(coef.to(torch.float32), reduce, lse, lse_col, lse_pos)


def backward(ctx, go: Tensor):
    """TritonCoreFn.backward on the panel path."""
    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    adt, bdt, sdt, sshape = ctx.dtypes
    same = bdt is None
    go = go.to(torch.float32)

    def out(da, db, ds):
        return (da.to(adt) if need_a and da is not None else None,
                db.to(bdt) if need_b and not same and db is not None else None,
                ds.to(sdt).reshape(sshape) if need_s and ds is not None else None,
                None, None, None, None)

    if ctx.eager is not None:
        da, db, ds, tw = ctx.eager
        ctx.eager = None  # a second backward (retain_graph) recomputes from the saved statistics
        if tw is not None:
            ctx.moved_target = tw * go  # what core.PiecesFn applies with the target term
            ctx.moved_less = getattr(ctx, "exact_less", None)  # (its coefficients, which the target term leaves out)
        ctx.took_set = ctx.set_c is not None  # the SET term's gradient is in these (core.PiecesFn drops its own)
        return out(da.mul_(go.to(da.dtype)) if da is not None else None,
                   db.mul_(go.to(db.dtype)) if db is not None else None,
                   ds * go if ds is not None else None)
    scale, lse, lse_col, lse_pos, a, b = ctx.saved_tensors
    if scale is None:
        scale = ctx.scale
    spec, coef = ctx.spec, ctx.coef
    p = ctx.prep
    n = lse.shape[0]
    g = TL._coef_grad(coef.lse, go, n, lse)
    g_set = None if ctx.set_c is None else set_grad(ctx.set_c, go, n)
    ctx.took_set = g_set is not None  # the SET term's gradient is in these (core.PiecesFn drops its own)
    if ctx.tri:
        need_s = need_s and isinstance(scale, Tensor)
        if g is None:
            g = torch.zeros(n, dtype=torch.float32, device=a.device)
        exact = triton_fused.backward_exact(ctx, ctx.split, g, None, None)
        da, ds, tw = tri_backward(TL._launch, p, a, spec, TL._scale32(scale, a.device), lse, g, need_a, need_s,
                                  getattr(ctx, "wide", False), ctx.split, g_set=g_set, exact=exact)
        if tw is not None:
            ctx.moved_target = tw  # what core.PiecesFn applies with the target term
            ctx.moved_less = ctx.exact_less if exact is not None else None  # (its coefficients, left out there)
        return out(da, None, ds)
    g_col = TL._coef_grad(coef.col, go, lse_col.shape[0], lse_col) if lse_col is not None else None
    g_pos = TL._coef_grad(coef.pos, go, n, lse_pos)
    bb = a if same else b
    sym = p.sym
    need_s = need_s and isinstance(scale, Tensor)
    exact = triton_fused.backward_exact(ctx, ctx.split, g, g_col, lse_col)
    da, db, ds, _, _, tw = sweep(TL._launch, p, a, bb, sym, TL._scale32(scale, a.device), spec, lse, lse_col,
                                 lse_pos, g, g_col, g_pos, need_a,
                                 (need_b and not same) or (same and not sym and need_a), need_s, False,
                                 getattr(ctx, "wide", False), ctx.split, g_set=g_set, exact=exact)
    if tw is not None:
        ctx.moved_target = tw  # what core.PiecesFn applies with the target term
        ctx.moved_less = ctx.exact_less if exact is not None else None  # (its coefficients, left out there)
    if same and not sym and da is not None:
        da = da + db
        db = None
    return out(da, db, ds)
