"""The core op at K Matryoshka levels on the Triton kernels of ``kernels/matryoshka.py``: one walk along D
per tile for every level, forward and backward (``docs/matryoshka.md``).

Work in units of one N x M x D matmul, for every level together: forward 1; backward, A != B, a dA and a
dB kernel of ``(sum_k d_k + d_K) / D`` each (every level's prefix rebuilt, one gradient GEMM per segment:
3.25 for 768/512/256/128/64), 7.5 in all against one loss's 5 and K per-level calls' 11.25. B is A runs
as two inputs (the plain kernels' symmetric single-kernel backward is not used). The linear positive terms
(TGT, SET) are O(K N D) and run per level in PyTorch on the truncated, re-normalised rows: the target logits
without a graph (:func:`level_target_logits`), their value in :class:`TritonLevelsFn` (in 16 bits the forward
splits each level's target out: ``LSE_i - l_it`` as ``softplus(LSEx_i - l_it)``, :func:`_merge_levels`), their
gradient inside the kernels' gradient tiles (HAS_TGT), before any 16-bit rounding, where ``p_it - 1`` cancels in a
peaked softmax; the positive-set term by ``linear_terms.LinearTermsFn``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ...kernels import matryoshka as KM
from ...routes import setting
from .. import linear_terms
from ..norms import prefix_rows
from ..spec import Coeffs, CoreData, CoreSpec, DirectCtx, coef_grad, combine, drop_zero, set_grad
from ..target_split import exact_weights, merge_split, minus_coefficients
from ..triton_shared import launch as TL
from ..triton_shared import panels
from ..triton_shared.configs import (
    EPI_GROUP_M,
    MATRYOSHKA_SUFFIX,
    MATRYOSHKA_SUFFIX_LEVELS,
    LaunchConfig,
    d_pad,
    matryoshka_config,
)
from .torch_levels import _prefix_norms

__all__ = ["ROUTES", "TritonLevelsFn", "route", "run", "suffix_rows", "use_suffix"]

#: The register ceiling of every Matryoshka launch: without it ptxas held some variants at 128 registers
#: and spilled 4-36 bytes (sm_80); with it the same code takes 150-255 registers and spills nothing
#: (tests/test_triton_matryoshka.py)
MAXNREG = 255


def _level_data(x: Tensor, sx: Tensor, dims: list[int], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(RS, F, N)`` [K, R] fp32 of rows ``x`` and their power-of-two scaled copy ``sx = p x``: the inverse
    clamped prefix norms of the scaled copy ``1 / (p n^k)``, the factors ``n^K / n^k`` and ``n^k``."""
    nrm, _ = _prefix_norms(x, dims, eps, torch.float32)
    big = x.detach().abs().amax(1).to(torch.float32)
    p = torch.where(big > 0, sx.abs().amax(1).to(torch.float32) / torch.where(big > 0, big, 1.0), 1.0)
    rs = 1.0 / (p[:, None] * nrm)
    f = nrm[:, -1:] / nrm
    return rs.T.contiguous(), f.T.contiguous(), nrm.T.contiguous()


@functools.lru_cache(maxsize=64)
def _dims_tensor(dims: tuple[int, ...], device: torch.device) -> Tensor:
    """``[0, *dims]`` (int32) on ``device``, made once per level set and device and only read by the kernels:
    a fresh one per call was a synchronous copy from pageable host memory on every step, and cannot be made
    while a CUDA graph is being captured."""
    return torch.tensor([0, *dims], dtype=torch.int32, device=device)


class _Levels:
    """Kernel-ready inputs of one call (built in forward, kept for backward)."""

    def __init__(self, a: Tensor, b: Tensor | None, spec: CoreSpec, data: CoreData, want_pos: bool,
                 dims: tuple[int, ...]):
        self.p = TL._prepare(a, b, dataclasses.replace(spec, normalize=True), data, want_pos)
        self.dims = list(dims)
        self.k = len(dims)
        dev = a.device
        self.dims_t = _dims_tensor(tuple(int(d) for d in dims), dev)
        self.ra = _level_data(self.p.a, self.p.sa, self.dims, spec.eps)
        self.rb = self.ra if b is None else _level_data(self.p.b, self.p.sb, self.dims, spec.eps)


def _flags(L: _Levels, spec: CoreSpec) -> dict[str, object]:
    f = TL._flags(L.p, spec)
    if f.pop("BIAS_COS"):  # core._leveled runs a target margin as one plain call per level
        raise ValueError("core: the Matryoshka kernels take no target margin")
    del f["NORMALIZE"]
    # every boundary a multiple of 16 (768/512/256/128/64): the kernels' D masks are constant over 16
    # coordinates, and told so (kernels/matryoshka.py ``_bound``) their operand loads are 16-byte vectors
    return dict(**f, K=L.k, ALIGNED=all(d % 16 == 0 for d in L.dims))


def _fwd(L: _Levels, scale, spec: CoreSpec, want_col: bool, target: Tensor | None = None,
         rmax: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(LSE [K, N], LSEcol [K, M] or None, LSEpos [K, N] or None)``, fp32. With ``target`` [N] (no positives) and
    ``rmax`` [K, N] fp32: the target split (``mat_fwd_kernel``'s SPLIT_T): the statistics leave each row's target
    entry out (column j's ``(j, j)`` where ``target[j] == j``) and ``rmax`` receives each row's largest tile logit per
    level."""
    p = L.p
    dev = p.a.device
    n, d = p.a.shape
    m = p.b.shape[0]
    cfg, block_d = matryoshka_config("fwd", TL._arch(dev), p.a.dtype, d)
    lse = TL._alloc((L.k, n), torch.float32, dev)
    lse_pos = TL._alloc((L.k, n), torch.float32, dev) if p.pos_kind else None
    n_rb = triton.cdiv(n, cfg.block_m)
    progs, col_part = n_rb, p.dummy
    if want_col:
        progs = TL._col_programs(n_rb, dev)
        col_part = TL._alloc((progs, L.k, m), torch.float32, dev)
    TL._launch(TL.Launch(
        "mat_fwd", KM.mat_fwd_kernel, (progs,),
        dict(SA=p.sa, SB=p.sb, RSA=L.ra[0], RSB=L.rb[0], DIMS=L.dims_t, SCALE=TL._scale32(scale, dev),
             **TL._problem_args(p), LSE=lse, LSE_POS=lse_pos if lse_pos is not None else p.dummy,
             Z_RUN=torch.empty((L.k, n), dtype=torch.float32, device=dev),
             ZP_RUN=torch.empty((L.k, n), dtype=torch.float32, device=dev) if p.pos_kind else p.dummy,
             COL_PART=col_part, N=n, M=m, stride_sa=p.sa.stride(0), stride_sb=p.sb.stride(0),
             **TL._mask_args(p, spec), n_row_blocks=n_rb,
             TGT=target.contiguous() if target is not None else p.dummy, RMAX=rmax if target is not None else p.dummy),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **_flags(L, spec), WANT_COL=bool(want_col),
             SPLIT_T=target is not None),
        cfg.num_warps, cfg.num_stages, MAXNREG))
    lse_col = torch.logsumexp(col_part, dim=0) if want_col else None
    return lse, lse_col, lse_pos


def _grad_args(L: _Levels, s32: Tensor, spec: CoreSpec, gs: Tensor, lse, lse_col, lse_pos, g, g_col, g_pos,
               tgt, g_set=None) -> dict[str, object]:
    """The arguments both backwards' kernels take (``_level_grad``'s pointers, the sizes and masks)."""
    p = L.p
    dm = p.dummy
    return dict(SA=p.sa, SB=p.sb, RSA=L.ra[0], RSB=L.rb[0], FA=L.ra[1], FB=L.rb[1], DIMS=L.dims_t, SCALE=s32,
                GSCALE=gs, **TL._problem_args(p), LSE=lse, G=g if g is not None else dm,
                LSE_COL=lse_col if lse_col is not None else dm, G_COL=g_col if g_col is not None else dm,
                LSE_POS=lse_pos if lse_pos is not None else dm, G_POS=g_pos if g_pos is not None else dm,
                TGT=tgt[0] if tgt is not None else dm, TW=tgt[1] if tgt is not None else dm,
                G_SET=g_set if g_set is not None else dm,
                N=p.a.shape[0], M=p.b.shape[0], stride_sa=p.sa.stride(0), stride_sb=p.sb.stride(0),
                **TL._mask_args(p, spec))


def _grad_flags(L: _Levels, spec: CoreSpec, g, g_col, g_pos, tgt, g_set=None,
                exact: bool = False) -> dict[str, object]:
    """The compile-time flags both backwards' kernels take."""
    return dict(**_flags(L, spec), KP=triton.next_power_of_2(L.k), HAS_G=g is not None, HAS_GCOL=g_col is not None,
                HAS_GPOS=g_pos is not None, PRESCALE=prescale(L.p.a.dtype), HAS_TGT=tgt is not None,
                HAS_SET=g_set is not None, EXACT_T=bool(exact and tgt is not None))


def _bwd(L: _Levels, scale, spec: CoreSpec, lse, lse_col, lse_pos, g, g_col, g_pos, need_a: bool, need_b: bool,
         need_s: bool, tgt: tuple[Tensor, Tensor] | None = None, wide: bool = False, g_set: Tensor | None = None,
         exact: bool = False):
    """``(dA, dB, ds)`` of the level statistics' upstream gradients ``g*`` ([K, N] / [K, M] fp32 or None)
    and, with ``tgt = (target columns [N], signed weights [K, N] fp32)``, of the target logits' terms,
    which the kernels add inside each gradient tile. With a target the kernels split it out (SPLIT_T): each
    row's target entry of every level's gradient tile stays out of the 16-bit tiles and is applied in fp32
    (the rows kernel in its epilogue; the columns kernel from its scratch, which :func:`_target_cols` fills
    from the rows kernel's entries ``TG``), where in a peaked softmax ``p_it - 1`` nearly cancels. ``wide``: dA and dB
    in fp32 (the kernels' epilogues store their fp32 values unrounded), for a caller that adds more to them first.
    ``g_set`` [K, N] fp32 (``L.p`` with the positives' fields): the positive-set term's upstream coefficients
    ``c.set_i go_k``, its ``-w_ij`` weights formed inside the gradient tiles (HAS_SET). ``exact``: ``tgt``'s weights are
    the whole target entries (EXACT_T: :func:`level_exact_weights`), not the target term's share added to the tile."""
    p = L.p
    a, b = p.a, p.b
    dev = a.device
    n, d = a.shape
    m = b.shape[0]
    gs = TL._gscale(g, g_col, g_pos, None if tgt is None else tgt[1], g_set)
    if gs is None:
        return TL._no_grads(a, b, need_a, need_b, need_s)
    dm = p.dummy
    common = dict(_grad_args(L, TL._scale32(scale, dev), spec, gs, lse, lse_col, lse_pos, g, g_col, g_pos, tgt, g_set),
                  D=d, eps=float(spec.eps))
    # FOLD_NORM (bf16): the gradient GEMM reads the exact scaled rows, the inverse norms in the tile
    # the target split where the rows kernel runs anyway (its TG feeds the columns kernel): with frozen queries
    # (no dA, no temperature gradient) only the columns kernel runs, with the target inside its tiles as before
    split = tgt is not None and (need_a or need_s)
    flags = dict(_grad_flags(L, spec, g, g_col, g_pos, tgt, g_set, exact), SPLIT_T=split,
                 FOLD_NORM=a.dtype == torch.bfloat16)
    gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
    split_cols = split and need_b and gcols > 0  # the columns kernel needs the rows kernel's TG
    tg = TL._alloc((L.k, n), torch.float32, dev) if split else dm
    da = db = ds = None
    if need_a or need_s or split_cols:
        cfg, block_d = matryoshka_config("bwd_rows", TL._arch(dev), a.dtype, d)
        n_rb = triton.cdiv(n, cfg.block_m)
        da = TL._alloc((n, d), torch.float32 if wide else a.dtype, dev) if need_a else dm
        acc = torch.empty((n, d), dtype=torch.float32, device=dev) if need_a else dm
        ds_part = TL._alloc((n_rb,), torch.float32, dev) if need_s else dm
        TL._launch(TL.Launch(
            "mat_bwd_rows", KM.mat_bwd_kernel, (n_rb,),
            dict(X=a, NX=L.ra[2], **common, DX=da, ACC=acc, DS_PART=ds_part, TG=tg, n_out=n, stride_x=a.stride(0),
                 stride_dx=da.stride(0) if need_a else 0),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, COLS=False,
                 NEED_DX=bool(need_a), NEED_DS=bool(need_s)),
            cfg.num_warps, cfg.num_stages, MAXNREG))
        ds = ds_part.sum() * gs.reshape(()) if need_s else None
        da = da if need_a else None
    if need_b:
        db = TL._alloc((m, d), torch.float32 if wide else b.dtype, dev)
        if gcols < m:
            db[gcols:].zero_()  # queue columns get no gradient
        if gcols > 0:
            cfg, block_d = matryoshka_config("bwd_cols", TL._arch(dev), b.dtype, d)
            acc = _target_cols(L, tgt[0], tg, gcols) if split_cols else \
                torch.empty((gcols, d), dtype=torch.float32, device=dev)
            TL._launch(TL.Launch(
                "mat_bwd_cols", KM.mat_bwd_kernel, (triton.cdiv(gcols, cfg.block_n),),
                dict(X=b, NX=L.rb[2], **common, DX=db, ACC=acc, DS_PART=dm, TG=dm, n_out=gcols,
                     stride_x=b.stride(0), stride_dx=db.stride(0)),
                dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, COLS=True, NEED_DX=True,
                     NEED_DS=False),
                cfg.num_warps, cfg.num_stages, MAXNREG))
    return da, db, ds


def _target_cols(L: _Levels, t: Tensor, tg: Tensor, gcols: int) -> Tensor:
    """The columns kernel's starting scratch under SPLIT_T ([gcols, D] fp32): the target entries the 16-bit
    tiles leave out, ``PRESCALE sum_{i: t_i = j} sum_{k: c < d_k} TG[k, i] X_hat[i, c]`` in fp32 (``TG`` [K, N]
    the rows kernel's entries, ``X_hat`` the rows' top-level unit rows; 0 past d_K). ``index_put_`` with
    ``accumulate`` sums rows that share a target in a fixed order (sorted, no atomics)."""
    p = L.p
    n, d = p.a.shape
    xhat = p.sa.to(torch.float32) * L.ra[0][L.k - 1][:, None]
    tail = tg.flip(0).cumsum(0).flip(0)  # tail[r] = sum_{k >= r} TG[k]: the weight of segment r's coordinates
    bounds = [0, *L.dims]
    coef = torch.zeros((n, d), dtype=torch.float32, device=xhat.device)
    for r in range(L.k):
        coef[:, bounds[r]:bounds[r + 1]] = tail[r][:, None]
    acc = torch.zeros((gcols, d), dtype=torch.float32, device=xhat.device)
    keep = (t >= 0) & (t < gcols)  # rows whose target is not a gradient column add 0 (no data-dependent shape)
    acc.index_put_((torch.where(keep, t, 0).long(),),
                   coef * xhat * torch.where(keep, prescale(p.a.dtype), 0.0)[:, None], accumulate=True)
    return acc


#: Routes of the Matryoshka levels on the triton backend (env ``FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE``, read per
#: call by ``core.run``): "auto" (default) one plain call per level where the plain loss takes the panel path
#: or past ``core.MAX_KERNEL_LEVELS`` levels, the Matryoshka kernels otherwise, with the suffix backward where
#: :func:`use_suffix` says (16-bit, N x M from :data:`SUFFIX_MIN_ELEMENTS`, on CUDA); "calls" one plain call per
#: level; "kernels" the Matryoshka kernels (forward and backward); "suffix" their forward and the suffix
#: backward (:func:`_bwd_suffix`; 16-bit inputs and at most ``MATRYOSHKA_SUFFIX_LEVELS`` levels, else the
#: kernels' backward). "kernels" and "suffix" take at most ``core.MAX_KERNEL_LEVELS`` levels (more run as
#: "calls").
ROUTES = ("auto", "calls", "kernels", "suffix")


def route() -> str:
    """Env ``FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE``, one of :data:`ROUTES` (default "auto")."""
    return setting("MATRYOSHKA_ROUTE")


#: Smallest N x M at which "auto" takes the suffix backward (on CUDA; 16-bit, at most
#: MATRYOSHKA_SUFFIX_LEVELS levels); above the panel path's threshold "auto" runs one plain call per level.
#: Evidence: ``routes.ROUTES`` (the Matryoshka rows); the model's figures: docs/gpu-measurements.md.
SUFFIX_MIN_ELEMENTS = 1 << 20
#: With a column term (CLIP's levels) "auto" keeps the Matryoshka kernels (and so the suffix backward) up to this
#: N x M although the plain loss takes the panel path from 2^24; without a column term the plain calls take the
#: one-tile path there (``core.CUDA_DENSE_ELEMENTS``). Evidence: ``routes.ROUTES``; the measurements:
#: docs/gpu-measurements.md.
COL_KERNELS_MAX_ELEMENTS = 1 << 24
#: Device types on which "auto" may take the suffix backward (meta: the GPU model records what CUDA runs);
#: the CPU interpreter runs it when the tests ask for it.
SUFFIX_DEVICES = ("cuda", "meta")


def use_suffix(dev: torch.device, dtype: torch.dtype, k: int, elements: int) -> bool:
    """Whether the Matryoshka kernels' call takes the suffix backward (:func:`_bwd_suffix`): its kernel takes
    16-bit operands and at most :data:`MATRYOSHKA_SUFFIX_LEVELS` levels (compiled without spills); then
    route "suffix", or "auto" on :data:`SUFFIX_DEVICES` from :data:`SUFFIX_MIN_ELEMENTS` (N x M)."""
    if dtype == torch.float32 or k > MATRYOSHKA_SUFFIX_LEVELS:
        return False
    r = route()
    return r == "suffix" or (r == "auto" and dev.type in SUFFIX_DEVICES and elements >= SUFFIX_MIN_ELEMENTS)


#: Test hooks of the suffix backward: its launch configuration and panel height (None: MATRYOSHKA_SUFFIX, and
#: the switchboard's PANEL_ROWS or the byte budget).
SUFFIX_CONFIG: LaunchConfig | None = None


def suffix_rows(n: int, m: int, d: int, k: int, dtype: torch.dtype, need_b: bool) -> int:
    """Rows per panel of the suffix backward: its K 16-bit tiles of the panel ([K, P, M]), the per-tile
    scalars and the panel's dA rows (fp32) within the panel path's byte budget (``panels.panel_rows``'s
    budget and hooks), beside dB's fp32 accumulators; a multiple of 64, at least ``panels.P_MIN``."""
    if setting("PANEL_ROWS") is not None:
        return max(1, min(n, setting("PANEL_ROWS")))
    budget = setting("PANEL_BUDGET") or panels.BUDGET_BYTES
    e = torch.empty((), dtype=dtype).element_size()
    kp = triton.next_power_of_2(k)
    fixed = 4 * m * d if need_b else 0
    cfg = SUFFIX_CONFIG or MATRYOSHKA_SUFFIX  # per row: its tiles, RHO_R's column tiles, its share of RHO_C
    per_row = k * e * m + 4 * kp * (triton.cdiv(m, cfg.block_n) + triton.cdiv(m, cfg.block_m)) + 4 * d
    p = (budget - fixed) // per_row
    p = p - p % 64 if p >= 64 else p
    return max(1, min(n, max(panels.P_MIN, p)))


def _finish(x: Tensor, acc: list[Tensor], nx: Tensor, rho: Tensor, bounds: list[int], eps: float, mult: Tensor,
            pre: float, dtype: torch.dtype) -> Tensor:
    """The normalisation backward of one side from its segment products ``acc[r]`` ([R, |S_r|] fp32, the
    suffix sums times the other side's top-level unit rows, pre-scaled by ``pre``): ``out_ic = mult
    (acc_ic / (pre n^K_i) - x_ic sum_{k >= r, n^k_i > eps} rho^k_i / (n^k_i)^2)`` for c in segment r, 0 past
    d_K; ``nx`` [K, R] the clamped prefix norms, ``rho`` [R, K]. (The Matryoshka kernels' ``_mat_epilogue``.)"""
    k = nx.shape[0]
    c = torch.where(nx > eps, rho.T / (nx * nx), 0.0)
    tail = c.flip(0).cumsum(0).flip(0)  # tail[r] = sum_{k >= r} c_k
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    n_top = nx[k - 1][:, None]
    for r in range(k):
        lo, hi = bounds[r], bounds[r + 1]
        seg = acc[r] / (pre * n_top) - x[:, lo:hi].to(torch.float32) * tail[r][:, None]
        out[:, lo:hi] = (seg * mult).to(dtype)
    return out


def _bwd_suffix(L: _Levels, scale, spec: CoreSpec, lse, lse_col, lse_pos, g, g_col, g_pos, need_a: bool,
                need_b: bool, need_s: bool, tgt: tuple[Tensor, Tensor] | None = None, wide: bool = False,
                g_set: Tensor | None = None, exact: bool = False):
    """:func:`_bwd`'s gradients by suffix sums: per panel of rows, ``kernels/matryoshka.py``
    ``mat_epi_kernel`` writes ``H^r = sum_{k >= r} G^k`` (16-bit, [K, P, M]: 1 unit of matmul work for
    every level, one walk along D per tile) and the levels' row and column scalars; then cuBLAS multiplies
    ``H^r`` into segment S_r of each side, ``dA[:, S_r] = H^r Y_hat[:, S_r]`` and ``dB[:, S_r] += H^r^T
    X_hat[P, S_r]`` (the other side's top-level unit rows; fp32 outputs, ``triton_panel``'s probed GEMM
    routes): 1 unit per side, whatever K is, against the kernels' ``(sum_k d_k + d_K) / D`` per side. Memory:
    the panel's K tiles within the panel path's byte budget (:func:`suffix_rows`), O((N + M) D) besides.
    16-bit inputs."""
    p = L.p
    a, b = p.a, p.b
    dev = a.device
    n, d = a.shape
    m = b.shape[0]
    gs = TL._gscale(g, g_col, g_pos, None if tgt is None else tgt[1], g_set)
    if gs is None:
        return TL._no_grads(a, b, need_a, need_b, need_s)
    dt, k = a.dtype, L.k
    kp = triton.next_power_of_2(k)
    cfg = SUFFIX_CONFIG or MATRYOSHKA_SUFFIX
    gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
    need_cols = need_b and gcols > 0
    bounds = [0, *L.dims]
    pre = prescale(dt)
    s32 = TL._scale32(scale, dev)
    # the other side's top-level unit rows, in the operand dtype (as the kernels' gradient dots take them)
    yhat = (p.sb.to(torch.float32) * L.rb[0][k - 1][:, None]).to(dt) if need_a else None
    xhat = (p.sa.to(torch.float32) * L.ra[0][k - 1][:, None]).to(dt) if need_cols else None
    segs = list(zip(bounds[:-1], bounds[1:], strict=True))
    acc_a = [torch.empty((n, hi - lo), dtype=torch.float32, device=dev) for lo, hi in segs] if need_a else None
    acc_b = [torch.zeros((gcols, hi - lo), dtype=torch.float32, device=dev) for lo, hi in segs] if need_cols else None
    rho_a = torch.empty((n, k), dtype=torch.float32, device=dev)
    rho_b = torch.zeros((m, k), dtype=torch.float32, device=dev)
    args = _grad_args(L, s32, spec, gs, lse, lse_col, lse_pos, g, g_col, g_pos, tgt, g_set)
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=min(cfg.block_d, d_pad(d)), GROUP_M=EPI_GROUP_M,
                 **_grad_flags(L, spec, g, g_col, g_pos, tgt, g_set, exact))
    rows = suffix_rows(n, m, d, k, dt, need_cols)
    for r0 in range(0, n, rows):
        pr = min(rows, n - r0)
        n_pm, n_pn = triton.cdiv(pr, cfg.block_m), triton.cdiv(m, cfg.block_n)
        h = TL._alloc((k, pr, m), dt, dev)
        rho_r = TL._alloc((pr, n_pn, kp), torch.float32, dev)
        rho_c = TL._alloc((n_pm, kp, m), torch.float32, dev)
        TL._launch(TL.Launch("mat_epi", KM.mat_epi_kernel, (n_pm * n_pn,),
                             dict(args, H=h, RHO_R=rho_r, RHO_C=rho_c, P=pr, r0=r0), const,
                             cfg.num_warps, cfg.num_stages, MAXNREG))
        rho_a[r0:r0 + pr] = rho_r[:, :, :k].sum(1)
        rho_b += rho_c[:, :k].sum(0).T
        for r, (lo, hi) in enumerate(segs):
            if need_a:
                acc_a[r][r0:r0 + pr] = panels._mm32(h[r], yhat[:, lo:hi])
            if need_cols:
                panels._addmm32_(acc_b[r], h[r][:, :gcols].T, xhat[r0:r0 + pr, lo:hi])
    mult = s32.reshape(()) * gs.reshape(())
    ds = rho_a.sum() * gs.reshape(()) if need_s else None
    da = _finish(a, acc_a, L.ra[2], rho_a, bounds, float(spec.eps), mult, pre,
                 torch.float32 if wide else a.dtype) if need_a else None
    db = None
    if need_b:
        # (queue columns past grad_cols get no gradient)
        db = torch.zeros((m, d), dtype=torch.float32 if wide else b.dtype, device=dev)
        if need_cols:
            db[:gcols] = _finish(b[:gcols], acc_b, L.rb[2][:, :gcols], rho_b[:gcols], bounds, float(spec.eps), mult,
                                 pre, torch.float32 if wide else b.dtype)
    return da, db, ds


def prescale(dtype: torch.dtype) -> float:
    """The gradient operand's power-of-two pre-scale: 2^8 for fp16 (``kernels/matryoshka.py`` derives the
    headroom), 1 otherwise."""
    return 256.0 if dtype == torch.float16 else 1.0


class TritonLevelsFn(torch.autograd.Function):
    """``c.lse LSE^k + c.col LSEcol^k + c.pos LSEpos^k - c.tgt l^k_t`` at every level: [K, N] per row or [K]
    summed, float32, on the Matryoshka kernels (``lt`` [K, N]: the target logits, :func:`level_target_logits`;
    None without a target term). ``may_split``: the forward may split the target out in 16 bits (not where the
    target is out of the softmax already). Every level re-normalises its prefix (``spec.normalize`` does not
    apply). Saved: the inputs, the scaled copies, O(K (N + M)) norms and statistics; the backward
    recomputes the tiles."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                reduce: bool, dims: tuple[int, ...], lt: Tensor | None = None, may_split: bool = False,
                set_term: tuple[CoreSpec, CoreData, Coeffs] | None = None):
        dt = TL.kernel_dtype(a, b)
        L = _Levels(a.to(dt), None if b is None else b.to(dt), spec, data, coef.pos is not None, dims)
        want_col = coef.col is not None
        if lt is not None and may_split and coef.pos is None:
            # the target split at every level (any operand dtype: the statistics are fp32 either way): each level's
            # LSE_i - l_it as softplus(LSEx_i - l_it), without the cancellation of two nearly equal fp32 numbers in a
            # saturated softmax (as the plain kernels' split)
            rmax = TL._alloc((L.k, L.p.a.shape[0]), torch.float32, a.device)
            lse, lse_col, lse_pos = _fwd(L, scale, spec, want_col, data.target, rmax)
            lse, lse_col, value, ctx.level_minus = _merge_levels(lse, lse_col, rmax, lt, data.target, coef, reduce)
        else:
            ctx.level_minus = None
            lse, lse_col, lse_pos = _fwd(L, scale, spec, want_col)
            c32 = coef.to(torch.float32) if lt is not None else dataclasses.replace(coef.to(torch.float32), tgt=None)
            value = torch.stack([combine(c32, reduce, lse[k], None if lse_col is None else lse_col[k],
                                         None if lse_pos is None else lse_pos[k], None if lt is None else lt[k])
                                 for k in range(L.k)])
        ctx.spec, ctx.coef, ctx.reduce = spec, coef, reduce
        ctx.scale = None if isinstance(scale, Tensor) else scale
        ctx.dtypes = (a.dtype, None if b is None else b.dtype, scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        # the inputs and their scaled copies go through save_for_backward (in-place edits are caught); the
        # O(K (N + M)) level data and the labels / masks ride on ctx
        p, same = L.p, b is None
        ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos, p.a,
                              None if same else p.b, p.sa, None if same else p.sb)
        L.p = p._replace(a=None, b=None, sa=None, sb=None)
        ctx.levels = L
        ctx.suffix = use_suffix(a.device, dt, L.k, p.a.shape[0] * (p.a if same else p.b).shape[0])
        ctx.target = data.target if coef.tgt is not None else None
        ctx.set_coef = ctx.data = None
        if set_term is not None:  # its value here; its gradient inside the kernels' tiles (HAS_SET)
            value = value - _set_value(a, b, scale, set_term, reduce, dims)
            ctx.set_coef, ctx.data = set_term[2].set, data
        return value

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @autocast_off
    @first_order("TritonLevelsFn")
    def backward(ctx, go: Tensor):
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        scale, lse, lse_col, lse_pos, a, b, sa, sb = ctx.saved_tensors
        if scale is None:
            scale = ctx.scale
        L, coef = ctx.levels, ctx.coef
        same = ctx.dtypes[1] is None
        L.p = L.p._replace(a=a, b=a if same else b, sa=sa, sb=sa if same else sb)
        go = go.to(torch.float32)
        n, k = lse.shape[1], L.k
        m = L.p.b.shape[0]

        def per_level(c, size, stat):
            if c is None or stat is None:
                return None
            return torch.stack([coef_grad(c, go[i], size, stat[i]) for i in range(k)]).contiguous()

        g = per_level(coef.lse, n, lse)
        g_col = per_level(coef.col, m, lse_col)
        g_pos = per_level(coef.pos, n, lse_pos)
        tgt, exact = None, False
        if coef.tgt is not None:
            # the target logits' term -c_i TGT^k_i: its weight -c_i go_k at column t_i of every level's tile,
            # none for a row whose target is its excluded own column (as linear_terms.LinearTermsFn)
            t, spec = ctx.target, ctx.spec
            c = coef.tgt.to(torch.float32) if isinstance(coef.tgt, Tensor) else float(coef.tgt)
            tw = -(drop_zero(c, go[:, None] if go.dim() == 1 else go).expand(k, n))
            exact = ctx.level_minus is not None
            if exact:  # the split forward's statistics: the whole target entry, without the cancellation of p_t - 1
                tw = level_exact_weights(ctx.level_minus, coef, t, go, g, g_col, lse_col)
            if spec.exclude_self:
                tw = torch.where(t == torch.arange(n, device=t.device) + spec.offset, 0.0, tw)
            tgt = (t, tw.contiguous())
        g_set = None
        if ctx.set_coef is not None:
            # the positive-set term's -c.set_i go_k w_ij joins every level's tile in fp32 (its positives' fields
            # prepared here: the forward ran without them)
            g_set = torch.stack([set_grad(ctx.set_coef, go[i], n) for i in range(k)]).contiguous()
            L.p = TL.with_positives(L.p, L.p.a, None if same else L.p.b, ctx.spec, ctx.data)
        # B is A: the two roles' gradients summed in fp32 before the one rounding
        da, db, ds = (_bwd_suffix if ctx.suffix else _bwd)(L, scale, ctx.spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                                                         need_a, (need_b and not same) or (same and need_a), need_s,
                                                         tgt, same, g_set, exact)
        if same and da is not None:
            da = da + db
        adt, bdt, sdt, sshape = ctx.dtypes
        ga = da.to(adt) if need_a and da is not None else None
        gb = db.to(bdt) if need_b and not same and db is not None else None
        gs = ds.to(sdt).reshape(sshape) if need_s and ds is not None else None
        return ga, gb, gs, None, None, None, None, None, None, None, None


def _set_value(a: Tensor, b: Tensor | None, scale, set_term: tuple[CoreSpec, CoreData, Coeffs], reduce: bool,
               dims: tuple[int, ...]) -> Tensor:
    """The positive-set term ``c.set SET^k`` [K] or [K, N] of every level on its re-normalised fp32 prefix, without
    a graph (``linear_terms.LinearTermsFn``'s forward called directly); its gradient is formed inside the kernels'
    gradient tiles (HAS_SET), where in a softmax concentrated on the positives it nearly cancels against ``p_ij``."""
    spec, data, coef = set_term
    spec = dataclasses.replace(spec, normalize=True)  # each level's prefix normalised (eps-clamped, as F.normalize)
    with torch.no_grad():
        a32 = a.detach().to(torch.float32)
        b32 = None if b is None else b.detach().to(torch.float32)
        sc = scale.detach() if isinstance(scale, Tensor) else scale
        return torch.stack([linear_terms.LinearTermsFn.forward(DirectCtx((False,) * 9), a32[:, :d],
                                                               None if b32 is None else b32[:, :d], sc, spec, data,
                                                               coef, reduce, torch.float32, False) for d in dims])


def _merge_levels(lse_x: Tensor, lse_col_x: Tensor | None, rmax: Tensor, lt: Tensor, target: Tensor, coef: Coeffs,
                  reduce: bool) -> tuple[Tensor, Tensor | None, Tensor, list[dict]]:
    """The split forward's host step at every level (``target_split.merge_split`` per level): from the kernel's
    ``LSEx`` [K, N], CLIP's ``LSEcolx`` [K, M] (or None), the rows' largest tile logits ``rmax`` [K, N] and the fp32
    target logits ``lt`` [K, N], the backward's merged ``(LSE [K, N], LSEcol [K, M] or None)`` and each level's
    value [K] (summed) or [K, N], the target term's included: ``c_i l_it`` taken out of it where the level's loss is
    the difference (``minus_coefficients``), and each level's split statistics (``merge_split``'s dicts, for the
    backward's :func:`level_exact_weights`)."""
    n = lse_x.shape[1]
    c32 = dataclasses.replace(coef.to(torch.float32), tgt=None)
    lse, lse_col, value, minus_k = [], [], [], []
    for k in range(lse_x.shape[0]):
        minus: dict = {}
        lk, ck = merge_split(lse_x[k], None if lse_col_x is None else lse_col_x[k], torch.cat([lt[k], rmax[k]]),
                             target, False, minus)
        v = combine(c32, reduce, minus["loss"], minus.get("col_loss"))
        rows = linear_terms.target_rows_less(coef.tgt, minus_coefficients(coef, minus, n), lt[k])
        lse.append(lk)
        lse_col.append(ck)
        value.append(v - (rows.sum() if reduce else rows))
        minus_k.append(minus)
    return torch.stack(lse), None if lse_col_x is None else torch.stack(lse_col), torch.stack(value), minus_k


def level_exact_weights(level_minus: list[dict], coef: Coeffs, target: Tensor, go: Tensor, g: Tensor | None,
                        g_col: Tensor | None, lse_col: Tensor | None) -> Tensor:
    """Every level's whole target entry ``(i, t_i)`` of the gradient tile, [K, N] fp32 (the kernels' EXACT_T): the
    log-sum-exp terms' weight combined with the share of the target term the split forward's loss holds
    (``target_split.exact_weights`` from the level's statistics), plus the rest of the target term,
    ``-(c.tgt_i - c_i) go_k`` (``c_i`` from ``minus_coefficients``: 0 where ``c.tgt = c.lse``)."""
    n = target.shape[0]
    c = coef.tgt.to(torch.float32) if isinstance(coef.tgt, Tensor) else float(coef.tgt)
    out = []
    for i, minus in enumerate(level_minus):
        gk = g[i] if g is not None else torch.zeros(n, dtype=torch.float32, device=target.device)
        w = exact_weights(minus, target, gk, None if g_col is None else g_col[i],
                          None if lse_col is None else lse_col[i])
        out.append(w - (c - minus_coefficients(coef, minus, n)) * go[i])  # (go [K] summed, [K, N] per row)
    return torch.stack(out)


def level_target_logits(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData,
                        dims: tuple[int, ...]) -> Tensor:
    """Each level's target logits ``l^k_it`` [K, N] fp32, without a graph, on the truncated rows re-normalised in
    float32 (the kernels' prefix norms are exact; normalising 16-bit rows in their own dtype put the target logit
    2e-4 off the LSE's): ``linear_terms``'s target logits per level."""
    plain = dataclasses.replace(spec, normalize=False)
    with torch.no_grad():
        a32 = a.detach().to(torch.float32)
        b32 = a32 if b is None else b.detach().to(torch.float32)
        s = scale.detach().to(torch.float32) if isinstance(scale, Tensor) else float(scale)
        return torch.stack([linear_terms.target_logits(prefix_rows(a32, d, spec.eps), prefix_rows(b32, d, spec.eps),
                                                       s, plain, data) for d in dims])


def run(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs, reduce: bool,
        dims: tuple[int, ...]) -> Tensor:
    """The core op at every level on the Triton kernels: ``[K]`` sums or ``[K, N]`` per-row values
    (float32), level k in row k (``dims`` ascending)."""
    # the linear terms' gradients are formed inside the kernels' tiles (TritonLevelsFn.backward: the target's at its
    # column, the positive set's at its positives), their values on the host without a graph
    lse_terms = Coeffs(lse=coef.lse, col=coef.col, pos=coef.pos, tgt=coef.tgt)
    lspec, ldata = spec, data
    if spec.exclude_target:  # the target column leaves the softmax as a -inf bias on it, as core.pieces does
        lspec = dataclasses.replace(spec, exclude_target=False, bias=float("-inf"))
        ldata = dataclasses.replace(data, bias_col=data.target)
    # the target term's value rides with the kernels' (its logits per level, without a graph), so that in a 16-bit
    # softmax the levels' losses can split the target out (not where it is out of the softmax already)
    lt = None if coef.tgt is None else level_target_logits(a, b, scale, spec, data, tuple(dims))
    # the O(N*D) positive-set term per level rides with them too (its value there, its gradient in their tiles)
    set_term = None if coef.set is None else (spec, data, Coeffs(lse=coef.lse, set=coef.set))
    return TritonLevelsFn.apply(a, b, scale, lspec, ldata, lse_terms, reduce, tuple(dims), lt, not spec.exclude_target,
                                set_term)
