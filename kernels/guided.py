"""Triton device code of one column block of the guided (GISTEmbed) / id-masked cross-entropy: the
row log-sum-exp over scaled cosines with an exclusion mask computed inside each tile, and its
backward. The host side (``fused_contrastive/core/guided/triton_blocks.py``) runs one block per call and
merges the blocks of a row by log-sum-exp in PyTorch (O(N)).

For rows ``a_i`` and columns ``b_j`` (normalised as in ``kernels/lse.py``, scale ``s``)::

    l_ij   = s <a_i, b_j>,  -inf at the own column offset + i (EXCLUDE_SELF) and where excluded:
    excl   = (<ga_i, gb_j> > theta_i  [HAS_GUIDE]  or  idr_i == idc_j  [HAS_IDS])  and  j != t_i  [PROTECT]
    LSE_i  = log sum_j exp(l_ij)          TL_i = l_{i, t_i}  (PROTECT: the target logit, from the same tile)
    KN_i   = #{j: l_ij > -inf}            SL_i = sum_{j: l_ij > -inf} l_ij   (SMOOTH: label smoothing's
                                          kept count and kept-logit sum, from the same tiles)

``ga``, ``gb`` are unit-normalised guide rows (no gradient) in the guide embeddings' dtype: fp32 (the
guide tile a ``tf32x3`` dot, ~fp32 accuracy, so the threshold compare is the fp32 one) or fp16 / bf16
(one tensor-core pass on the 16-bit operands, fp32 accumulation: a sixth of the tf32x3 cost, the
compare at the guide's own precision). The guide tile is a second dot per tile, ``Dg`` streamed in
``BLOCK_G`` chunks. A NaN guide similarity excludes (``~(g <= theta)``); the host makes such rows NaN.

Backward, with the upstream gradients ``g_i`` of ``LSE_i`` and ``gt_i`` of ``TL_i`` (HAS_GT)::

    dl_ij = g_i exp(l_ij - LSE_i) + gt_i [j == t_i] + gsl_i [l_ij > -inf]   (gsl: SMOOTH, the upstream of SL)
    dA_i  = s sum_j dl_ij b_j     dB_j = s sum_i dl_ij a_i     ds = sum_ij dl_ij cos_ij

through the normalisation's backward: the row kernel owns dA (and ds), the column kernel dB, each
recomputing the tile and its guide tile (deterministic, no atomics), exactly as ``lse_bwd_rows_kernel``
/ ``lse_bwd_cols_kernel`` do; they share those kernels' helpers (``_cos_tile``, ``_accumulate``, the
normalisation epilogue), so the numerics (power-of-two scaled copies, ``gscale``, ``PRESCALE``) are the
same. Merged across blocks, the row's LSE (a row left with its target alone has ``LSE_i = TL_i``
exactly) and its gradient (``exp(0) = 1``, minus 1: exactly 0) keep an all-masked row at 0.
"""

import triton
import triton.language as tl

from .common import NEG_INF, _accumulate, _cos_tile, _inv_norms, _log0, _logits, _norm_bwd_epilogue, _online_rows
from .panel import ONE_PASS_SHIFT, _grouped_tile, _redo_flags, _row_partials, _tile_products


@triton.jit
def _masked(l, rows, cols, N, M, GA, GB, stride_ga, stride_gb, Dg, theta_r, idr, ID_C, tgt_r,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
            HAS_GUIDE: tl.constexpr, HAS_IDS: tl.constexpr, PROTECT: tl.constexpr,
            GUIDE_UPCAST: tl.constexpr, GUIDE_PREC: tl.constexpr):
    """``l`` with -inf where the guide or the ids exclude the pair (the target column kept)."""
    ex = (rows[:, None] < 0) & (cols[None, :] < 0)  # all False, [BLOCK_M, BLOCK_N]
    if HAS_GUIDE:
        one_r = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        one_c = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
        gsim = _cos_tile(GA, GB, stride_ga, stride_gb, rows, cols, N, M, Dg, one_r, one_c,
                         BLOCK_M, BLOCK_N, BLOCK_G, GUIDE_UPCAST, GUIDE_PREC)
        ex = ex | ~(gsim <= theta_r[:, None])
    if HAS_IDS:
        idc = tl.load(ID_C + cols, mask=cols < M, other=-1)
        ex = ex | (idr[:, None] == idc[None, :])
    if PROTECT:
        ex = ex & (cols[None, :] != tgt_r[:, None])
    return tl.where(ex, NEG_INF, l)


@triton.jit
def _row_data(THETA, ID_R, TGT, rows, rmask, BLOCK: tl.constexpr, HAS_GUIDE: tl.constexpr,
              HAS_IDS: tl.constexpr, PROTECT: tl.constexpr):
    """Per-row threshold, id and protected (target) column (placeholders where absent)."""
    theta_r = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_GUIDE:
        theta_r = tl.load(THETA + rows, mask=rmask, other=0.0)
    idr = rows.to(tl.int64)
    if HAS_IDS:
        idr = tl.load(ID_R + rows, mask=rmask, other=-2)
    tgt_r = rows.to(tl.int64)
    if PROTECT:
        tgt_r = tl.load(TGT + rows, mask=rmask, other=-1)
    return theta_r, idr, tgt_r


@triton.jit
def guided_fwd_kernel(
    SA, SB, RSA, RSB, SCALE, GA, GB, THETA, ID_R, ID_C, TGT,
    LSE, TL, KN, SL,
    N, M, D, Dg, stride_sa, stride_sb, stride_ga, stride_gb, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_GUIDE: tl.constexpr, HAS_IDS: tl.constexpr,
    PROTECT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, GUIDE_UPCAST: tl.constexpr,
    GUIDE_PREC: tl.constexpr, SMOOTH: tl.constexpr,
):
    """LSE_i (and TL_i with PROTECT, KN_i and SL_i with SMOOTH) of one block of rows (grid: cdiv(N,
    BLOCK_M)), streaming over all column blocks: model tile, guide tile, mask, online max / sum."""
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
    theta_r, idr, tgt_r = _row_data(THETA, ID_R, TGT, rows, rmask, BLOCK_M, HAS_GUIDE, HAS_IDS, PROTECT)
    m_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
    z_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    sl_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range(0, M, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < M
        rsb = _inv_norms(RSB, cols, cmask, NORMALIZE)
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        l = _logits(cos, s, rows, cols, N, M, offset, rows, 0.0, EXCLUDE_SELF, False, False)
        l = _masked(l, rows, cols, N, M, GA, GB, stride_ga, stride_gb, Dg, theta_r, idr, ID_C, tgt_r,
                    BLOCK_M, BLOCK_N, BLOCK_G, HAS_GUIDE, HAS_IDS, PROTECT, GUIDE_UPCAST, GUIDE_PREC)
        m_i, z_i = _online_rows(m_i, z_i, l)
        if PROTECT:  # the target logit, read from the same tile (the column appears in one tile)
            t_i += tl.sum(tl.where(cols[None, :] == tgt_r[:, None], l, 0.0), axis=1)
        if SMOOTH:  # the kept columns (finite logits; padding and exclusions are -inf)
            kept = l > NEG_INF
            k_i += tl.sum(kept.to(tl.float32), axis=1)
            sl_i += tl.sum(tl.where(kept, l, 0.0), axis=1)
    tl.store(LSE + rows, m_i + _log0(z_i), mask=rmask)
    if PROTECT:
        tl.store(TL + rows, t_i, mask=rmask)
    if SMOOTH:
        tl.store(KN + rows, k_i, mask=rmask)
        tl.store(SL + rows, sl_i, mask=rmask)


@triton.jit
def _dl(l, cols, lse_r, g_r, gt_r, tgt_r, HAS_GT: tl.constexpr, gsl_r, SMOOTH: tl.constexpr):
    """dl_ij = g_i exp(l_ij - LSE_i) + gt_i [j == t_i] (+ gsl_i on the kept columns with SMOOTH; all / gscale)."""
    dl = g_r[:, None] * tl.exp(l - lse_r[:, None])
    if HAS_GT:
        dl += tl.where(cols[None, :] == tgt_r[:, None], gt_r[:, None], 0.0)
    if SMOOTH:
        dl += tl.where(l > NEG_INF, gsl_r[:, None], 0.0)
    return dl


@triton.jit
def _row_gsl(GSL, GSCALE, rows, rmask, BLOCK: tl.constexpr, SMOOTH: tl.constexpr):
    """The upstream of SL per row (/ gscale; zeros without SMOOTH)."""
    gsl = tl.zeros([BLOCK], dtype=tl.float32)
    if SMOOTH:
        gsl = tl.load(GSL + rows, mask=rmask, other=0.0) / tl.load(GSCALE)
    return gsl


@triton.jit
def _row_grads(LSE, G, GT, GSCALE, rows, rmask, HAS_GT: tl.constexpr):
    inv_gs = 1.0 / tl.load(GSCALE)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    lse = tl.where(lse == NEG_INF, 0.0, lse)
    g = tl.load(G + rows, mask=rmask, other=0.0) * inv_gs
    gt = g
    if HAS_GT:
        gt = tl.load(GT + rows, mask=rmask, other=0.0) * inv_gs
    return lse, g, gt


@triton.jit
def guided_bwd_rows_kernel(
    A, SA, SB, RA, NA, RSA, RSB, SCALE, GSCALE, GA, GB, THETA, ID_R, ID_C, TGT,
    LSE, G, GT, DA, ACC, DS_PART,
    N, M, D, Dg, stride_a, stride_sa, stride_sb, stride_da, stride_ga, stride_gb, offset, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_GUIDE: tl.constexpr, HAS_IDS: tl.constexpr,
    PROTECT: tl.constexpr, HAS_GT: tl.constexpr, NEED_DX: tl.constexpr, NEED_DS: tl.constexpr,
    RESIDENT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr,
    GUIDE_UPCAST: tl.constexpr, GUIDE_PREC: tl.constexpr, GSL, SMOOTH: tl.constexpr,
):
    """dA (and this row block's share of ds) for one block of rows (grid: cdiv(N, BLOCK_M))."""
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    gs = tl.load(GSCALE)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
    theta_r, idr, tgt_r = _row_data(THETA, ID_R, TGT, rows, rmask, BLOCK_M, HAS_GUIDE, HAS_IDS, PROTECT)
    lse_r, g_r, gt_r = _row_grads(LSE, G, GT, GSCALE, rows, rmask, HAS_GT)
    gsl_r = _row_gsl(GSL, GSCALE, rows, rmask, BLOCK_M, SMOOTH)
    if RESIDENT:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)  # unused: the accumulator is the ACC scratch
    ds_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range(0, M, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < M
        rsb = _inv_norms(RSB, cols, cmask, NORMALIZE)
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        l = _logits(cos, s, rows, cols, N, M, offset, rows, 0.0, EXCLUDE_SELF, False, False)
        l = _masked(l, rows, cols, N, M, GA, GB, stride_ga, stride_gb, Dg, theta_r, idr, ID_C, tgt_r,
                    BLOCK_M, BLOCK_N, BLOCK_G, HAS_GUIDE, HAS_IDS, PROTECT, GUIDE_UPCAST, GUIDE_PREC)
        dl = _dl(l, cols, lse_r, g_r, gt_r, tgt_r, HAS_GT, gsl_r, SMOOTH)
        if NEED_DS:
            ds_acc += tl.sum(dl * cos, axis=1)
        if NEED_DX:
            acc = _accumulate(acc, ACC, dl, SB, stride_sb, rows, rsb, cols, N, M, D, j0,
                              BLOCK_D, RESIDENT, UPCAST, DOT_PREC, PRESCALE)
    if NEED_DS:
        tl.store(DS_PART + pid, tl.sum(ds_acc, axis=0))
    if NEED_DX:
        _norm_bwd_epilogue(A, DA, ACC, NA, RA, rows, N, D, stride_a, stride_da, acc, s * gs / PRESCALE, eps,
                           BLOCK_M, BLOCK_D, NORMALIZE, RESIDENT)


@triton.jit
def guided_bwd_cols_kernel(
    B, SA, SB, RB, NB, RSA, RSB, SCALE, GSCALE, GA, GB, THETA, ID_R, ID_C, TGT,
    LSE, G, GT, DB, ACC,
    N, M, D, Dg, stride_b, stride_sa, stride_sb, stride_db, stride_ga, stride_gb, offset, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_GUIDE: tl.constexpr, HAS_IDS: tl.constexpr,
    PROTECT: tl.constexpr, HAS_GT: tl.constexpr,
    RESIDENT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr,
    GUIDE_UPCAST: tl.constexpr, GUIDE_PREC: tl.constexpr, GSL, SMOOTH: tl.constexpr,
):
    """dB for one block of columns (grid: cdiv(M, BLOCK_N)), streaming over all row blocks."""
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    gs = tl.load(GSCALE)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < M
    rsb = _inv_norms(RSB, cols, cmask, NORMALIZE)
    if RESIDENT:
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)  # unused: the accumulator is the ACC scratch
    for i0 in range(0, N, BLOCK_M):
        rows = i0 + tl.arange(0, BLOCK_M)
        rmask = rows < N
        rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
        theta_r, idr, tgt_r = _row_data(THETA, ID_R, TGT, rows, rmask, BLOCK_M, HAS_GUIDE, HAS_IDS, PROTECT)
        lse_r, g_r, gt_r = _row_grads(LSE, G, GT, GSCALE, rows, rmask, HAS_GT)
        gsl_r = _row_gsl(GSL, GSCALE, rows, rmask, BLOCK_M, SMOOTH)
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        l = _logits(cos, s, rows, cols, N, M, offset, rows, 0.0, EXCLUDE_SELF, False, False)
        l = _masked(l, rows, cols, N, M, GA, GB, stride_ga, stride_gb, Dg, theta_r, idr, ID_C, tgt_r,
                    BLOCK_M, BLOCK_N, BLOCK_G, HAS_GUIDE, HAS_IDS, PROTECT, GUIDE_UPCAST, GUIDE_PREC)
        dl = _dl(l, cols, lse_r, g_r, gt_r, tgt_r, HAS_GT, gsl_r, SMOOTH)
        acc = _accumulate(acc, ACC, tl.trans(dl), SA, stride_sa, cols, rsa, rows, M, N, D, i0,
                          BLOCK_D, RESIDENT, UPCAST, DOT_PREC, PRESCALE)
    _norm_bwd_epilogue(B, DB, ACC, NB, RB, cols, M, D, stride_b, stride_db, acc, s * gs / PRESCALE, eps,
                       BLOCK_N, BLOCK_D, NORMALIZE, RESIDENT)



@triton.jit
def guided_theta_kernel(
    GA, GB, TGT, GPOS,
    N, M, Dg, stride_ga, stride_gb,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    GUIDE_UPCAST: tl.constexpr, GUIDE_PREC: tl.constexpr,
):
    """GPOS_i = <ga_i, gb_{t_i}>: each row's target entry of the guide tile, computed by the tile code
    of the masking kernels (``_cos_tile`` on the same BLOCK_M x BLOCK_N tiles at the same column block
    offsets, launched with the same warps), so the threshold is the very product that the target's
    exact duplicates are compared with (grid: cdiv(N, BLOCK_M); visits only the column blocks that hold
    a target of the row block)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    tgt_r = tl.load(TGT + rows, mask=rmask, other=-1)
    lo = tl.min(tl.where(rmask, tgt_r, M), axis=0)
    hi = tl.max(tl.where(rmask, tgt_r, -1), axis=0)
    one_r = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    one_c = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
    gpos = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range((lo // BLOCK_N) * BLOCK_N, hi + 1, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        gsim = _cos_tile(GA, GB, stride_ga, stride_gb, rows, cols, N, M, Dg, one_r, one_c,
                         BLOCK_M, BLOCK_N, BLOCK_G, GUIDE_UPCAST, GUIDE_PREC)
        gpos += tl.sum(tl.where(cols[None, :] == tgt_r[:, None], gsim, 0.0), axis=1)
    tl.store(GPOS + rows, gpos, mask=rmask)


@triton.jit
def _guided_epi_tile(pid_m, pid_n, X, Y, DL, ZP, TP, MXP, ETP, CTP, SHIFT, RSP, RB, SCALE, GA, GB, THETA, ID_R, ID_C,
                     TGT, P, M, D, Dg, r0, stride_x, stride_y, stride_ga, stride_gb, stride_dl, stride_zp, offset,
                     bad, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                     EVEN_K: tl.constexpr, UPCAST: tl.constexpr, MODE: tl.constexpr, NORMALIZE: tl.constexpr,
                     EXCLUDE_SELF: tl.constexpr, HAS_GUIDE: tl.constexpr, HAS_IDS: tl.constexpr,
                     PROTECT: tl.constexpr, SPLIT_T: tl.constexpr, NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr,
                     GUIDE_UPCAST: tl.constexpr, GUIDE_PREC: tl.constexpr):
    """One output tile of :func:`guided_epi_kernel` (its docstring): the products, the guide tile and
    mask, the fixed-shift exponentials."""
    loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lmask = loc < P
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < M
    acc = _tile_products(X, Y, loc, cols, P, M, D, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)

    s = tl.load(SCALE).to(tl.float32)
    rows = r0 + loc  # the block's row index (the guide rows, thresholds, ids and targets are indexed by it)
    n_end = r0 + P
    rsp = tl.load(RSP + loc, mask=lmask, other=0.0)
    rb = _inv_norms(RB, cols, cmask, NORMALIZE)
    cos = acc * rsp[:, None] * rb[None, :]
    l = _logits(cos, s, rows, cols, n_end, M, offset, rows, 0.0, EXCLUDE_SELF, False, False)
    theta_r, idr, tgt_r = _row_data(THETA, ID_R, TGT, rows, lmask, BLOCK_M, HAS_GUIDE, HAS_IDS, PROTECT)
    l = _masked(l, rows, cols, n_end, M, GA, GB, stride_ga, stride_gb, Dg, theta_r, idr, ID_C, tgt_r,
                BLOCK_M, BLOCK_N, BLOCK_G, HAS_GUIDE, HAS_IDS, PROTECT, GUIDE_UPCAST, GUIDE_PREC)
    if MODE == 1:
        sh = tl.abs(s) - ONE_PASS_SHIFT + tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        sh = tl.load(SHIFT + loc, mask=lmask, other=0.0)
    e = tl.exp(l - sh[:, None])
    part = loc.to(tl.int64) * stride_zp + pid_n
    if SPLIT_T:
        # the target column leaves the 16-bit tile: its exponential (fp32) and cosine go to the partials,
        # and the host forms its gradient coefficient without the cancellation of p_t - 1 in 16 bits
        is_t = cols[None, :] == tgt_r[:, None]
        tl.store(ETP + part, tl.sum(tl.where(is_t, e, 0.0), axis=1), mask=bad)
        tl.store(CTP + part, tl.sum(tl.where(is_t, cos, 0.0), axis=1), mask=bad)
        e = tl.where(is_t, 0.0, e)
    tl.store(ZP + part, tl.sum(e, axis=1), mask=bad)
    if NEED_DS:
        tl.store(TP + part, tl.sum(e * cos, axis=1), mask=bad)
    if MODE == 1:
        tl.store(MXP + part, tl.max(l, axis=1), mask=bad)
    out = e
    if FOLD_RB:
        out = out * rb[None, :]
    tl.store(DL + loc.to(tl.int64)[:, None] * stride_dl + cols[None, :], out.to(DL.dtype.element_ty),
             mask=bad[:, None] & cmask[None, :])


@triton.jit
def guided_epi_kernel(
    X, Y, DL, ZP, TP, MXP, ETP, CTP, BAD, SHIFT, RSP, RB, SCALE, GA, GB, THETA, ID_R, ID_C, TGT,
    P, M, D, Dg, r0, stride_x, stride_y, stride_ga, stride_gb, stride_dl, stride_zp, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, MODE: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_GUIDE: tl.constexpr, HAS_IDS: tl.constexpr,
    PROTECT: tl.constexpr, SPLIT_T: tl.constexpr, NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr,
    GUIDE_UPCAST: tl.constexpr, GUIDE_PREC: tl.constexpr, PERSIST: tl.constexpr,
):
    """The epilogue GEMM of one masked block on a panel of rows (host: ``core/guided/triton_panel.py``):
    [BLOCK_M, BLOCK_N] tiles of ``X @ Y^T`` (X the panel's rows [P, D] scaled by powers of two, Y the
    block's raw columns [M, D]; fp32 accumulation in registers), then in registers the cosines, the
    guide tile and the exclusion mask (``_masked``: the guide dot, thresholds, ids, the protected target
    kept, the own column), and the one-pass exponentials ``e_ij = exp(l_ij - m)`` with the core panel's
    fixed shift ``m = |s| - ONE_PASS_SHIFT`` shared by every block of a row (kernels/panel.py, ONE_PASS:
    unit rows, ``e <= e^56``, no running maximum, so the blocks' partial sums simply add). Only the
    16-bit tile ``DL = e`` (times ``rb_j`` with FOLD_RB) and per row and column tile the fp32 partials
    ``ZP = sum_j e_ij``, ``TP = sum_j e_ij cos_ij`` (NEED_DS) and ``MXP = max_j l_ij`` (MODE 1) reach
    memory. SPLIT_T (the block whose target logit the loss subtracts): the target column is stored as 0
    and its ``e`` and cosine go to ``ETP`` / ``CTP`` instead (fp32; every other tile writes 0 there).

    MODE 1: grid ``cdiv(P, BLOCK_M) * cdiv(M, BLOCK_N)`` in groups of GROUP_M row tiles. MODE 2 (the redo
    of rows whose merged ``z_i < 2^-64``, shift ``SHIFT_i`` = the row's largest logit over every block):
    grid ``cdiv(P, BLOCK_M)``, a row tile without a ``BAD`` row returns at once, the others rewrite their
    BAD rows' tiles and partials. Row vectors THETA, ID_R, TGT and the guide rows GA are indexed by the
    block's row ``r0 + i``, RSP by the panel row ``i``; RB, ID_C, GB by the column. PERSIST (MODE 1): a
    persistent grid whose programs take the tiles ``pid, pid + grid, ...`` in the same grouped order, in one
    flattened loop (kernels/panel.py ``epi_gemm_kernel``'s PERSIST): the same tiles, the same results."""
    pid = tl.program_id(0)
    n_pn = tl.cdiv(M, BLOCK_N)
    if MODE == 2:
        loc = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        bad = tl.load(BAD + loc, mask=loc < P, other=0) != 0
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            for pid_n in range(0, n_pn):
                _guided_epi_tile(pid, pid_n, X, Y, DL, ZP, TP, MXP, ETP, CTP, SHIFT, RSP, RB, SCALE, GA, GB, THETA,
                                 ID_R, ID_C, TGT, P, M, D, Dg, r0, stride_x, stride_y, stride_ga, stride_gb, stride_dl,
                                 stride_zp, offset, bad, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_G, EVEN_K, UPCAST, MODE,
                                 NORMALIZE, EXCLUDE_SELF, HAS_GUIDE, HAS_IDS, PROTECT, SPLIT_T, NEED_DS, FOLD_RB,
                                 GUIDE_UPCAST, GUIDE_PREC)
    elif PERSIST:
        n_t = tl.cdiv(P, BLOCK_M) * n_pn
        for t in tl.range(pid, n_t, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(t, P, n_pn, BLOCK_M, GROUP_M)
            loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            _guided_epi_tile(pid_m, pid_n, X, Y, DL, ZP, TP, MXP, ETP, CTP, SHIFT, RSP, RB, SCALE, GA, GB, THETA, ID_R,
                             ID_C, TGT, P, M, D, Dg, r0, stride_x, stride_y, stride_ga, stride_gb, stride_dl, stride_zp,
                             offset, loc < P, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_G, EVEN_K, UPCAST, MODE, NORMALIZE,
                             EXCLUDE_SELF, HAS_GUIDE, HAS_IDS, PROTECT, SPLIT_T, NEED_DS, FOLD_RB, GUIDE_UPCAST,
                             GUIDE_PREC)
    else:
        pid_m, pid_n = _grouped_tile(pid, P, n_pn, BLOCK_M, GROUP_M)
        loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        _guided_epi_tile(pid_m, pid_n, X, Y, DL, ZP, TP, MXP, ETP, CTP, SHIFT, RSP, RB, SCALE, GA, GB, THETA, ID_R,
                         ID_C, TGT, P, M, D, Dg, r0, stride_x, stride_y, stride_ga, stride_gb, stride_dl, stride_zp,
                         offset, loc < P, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_G, EVEN_K, UPCAST, MODE, NORMALIZE,
                         EXCLUDE_SELF, HAS_GUIDE, HAS_IDS, PROTECT, SPLIT_T, NEED_DS, FOLD_RB, GUIDE_UPCAST,
                         GUIDE_PREC)


@triton.jit
def guided_rows_kernel(ZP, TP, MXP, ETP, CTP, SHIFT0, BAD, SH, LOSS, W, WROW, ZX, DSW, SCALE,
                       P, n_all, n_t, r0, stride_zp, min_te,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FINISH: tl.constexpr, SPLIT: tl.constexpr,
                       NEED_DS: tl.constexpr):
    """The merge over the blocks of one panel of the guided route (``core/guided/triton_panel.py``, its
    step 2), one launch before and one after the redo instead of ~60 ATen ops per panel. Row i of the
    panel (global row ``r0 + i``): ``zx_i = sum_k ZP[i, k]`` over the ``n_all`` column tiles of every block
    (their partials side by side in one buffer), with SPLIT the target's ``e_it = sum_k ETP[i, k]`` and
    ``c_it = sum_k CTP[i, k]`` over the protected block's ``n_t`` tiles (0 in every tile but one);
    ``z_i = zx_i + e_it``.

    * FINISH off: ``BAD_i = z_i < 2^-64`` (int8) and the redo's shift ``SH_i`` (the row's largest logit over
      every block where BAD and finite, else ``SHIFT0[0]``);
    * FINISH on: ``LOSS[r0 + i]`` = ``log1p(zx_i / e_it)`` (``LSE_i - l_it`` without its cancellation) or,
      where ``e_it <= min_te``, ``SH_i + log z_i - s c_it`` (without SPLIT ``SH_i + log z_i``); the row weight
      ``WROW_i = W[r0 + i] / z_i`` (0 unless z is finite and positive and the weight nonzero), ``ZX_i``, and
      with NEED_DS ``DSW_i = WROW_i (sum_k TP[i, k] - zx_i c_it)`` (the temperature gradient's part).
    Partials are summed in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < P
    r64 = rows.to(tl.int64)
    zx = _row_partials(ZP, r64, rmask, n_all, stride_zp, BLOCK_R, BLOCK_C, False)
    et = tl.zeros([BLOCK_R], dtype=tl.float32)
    if SPLIT:
        et = _row_partials(ETP, r64, rmask, n_t, stride_zp, BLOCK_R, BLOCK_C, False)
    z = zx + et
    if not FINISH:
        _redo_flags(z, _row_partials(MXP, r64, rmask, n_all, stride_zp, BLOCK_R, BLOCK_C, True), SHIFT0, BAD, SH,
                    rows, rmask)
    else:
        lse = tl.load(SH + rows, mask=rmask, other=0.0) + tl.log(z)
        ct = tl.zeros([BLOCK_R], dtype=tl.float32)
        if SPLIT:
            ct = _row_partials(CTP, r64, rmask, n_t, stride_zp, BLOCK_R, BLOCK_C, False)
            s = tl.load(SCALE).to(tl.float32)
            big = et > min_te
            x = zx / tl.where(big, et, 1.0)
            # log1p(x) = log(u) x / (u - 1), u = 1 + x: a few ulps for any x >= 0 (x where u rounds to 1)
            u = 1.0 + x
            du = u - 1.0
            ratio = tl.where(du == 0.0, x, tl.log(u) * (x / tl.where(du == 0.0, 1.0, du)))
            loss = tl.where(big, ratio, lse - s * ct)
        else:
            loss = lse
        tl.store(LOSS + r0 + rows, loss, mask=rmask)
        w = tl.load(W + r0 + rows, mask=rmask, other=0.0)
        # "z is finite and positive" (NaN fails both comparisons); a zero weight passes no gradient
        ok = (z > 0) & (z < float("inf")) & (w != 0)
        wrow = tl.where(ok, w / tl.where(ok, z, 1.0), 0.0)
        tl.store(WROW + rows, wrow, mask=rmask)
        tl.store(ZX + rows, zx, mask=rmask)
        if NEED_DS:
            tx = _row_partials(TP, r64, rmask, n_all, stride_zp, BLOCK_R, BLOCK_C, False)
            if SPLIT:  # the target's d/ds: (W e_t - w) cos_t = -W zx cos_t
                tx = tx - zx * ct
            tl.store(DSW + rows, wrow * tx, mask=rmask)


@triton.jit
def guided_acc_kernel(ACC, RAW, C, TGT, CT, F, P, D, stride_acc, stride_raw, stride_c,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_T: tl.constexpr):
    """A row tensor's panel of the guided route into its fp32 accumulator (step 3 of
    ``core/guided/triton_panel.py``), one pass instead of six ATen ops: ``ACC_i += F_i (RAW_i - CT_i
    C[TGT_i])`` for the P rows (RAW the fp32 ``sum_k E_k @ C_hat_k`` of the panel, ``F_i = W_i rb_i``; with
    HAS_T the target's term, ``CT_i = zx_i rb_t`` times the raw target row of C, 16-bit)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < P
    r64 = rows.to(tl.int64)
    f = tl.load(F + rows, mask=rmask, other=0.0)
    if HAS_T:
        tgt = tl.load(TGT + rows, mask=rmask, other=0).to(tl.int64)
        ct = tl.load(CT + rows, mask=rmask, other=0.0)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        raw = tl.load(RAW + r64[:, None] * stride_raw + dd[None, :], mask=m2, other=0.0)
        if HAS_T:
            raw -= ct[:, None] * tl.load(C + tgt[:, None] * stride_c + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        pa = ACC + r64[:, None] * stride_acc + dd[None, :]
        tl.store(pa, tl.load(pa, mask=m2, other=0.0) + raw * f[:, None], mask=m2)
