"""Triton device code of the core op at K Matryoshka levels in one pass over D (``docs/matryoshka.md``).

Levels ``0 = d_0 < d_1 < ... < d_K <= D`` (``DIMS`` = [d_0, ..., d_K], int32; K a constexpr). Level k's
cosine is ``cos^k_ij = <A_i[:d_k], B_j[:d_k]> / (n^k_i m^k_j)`` with the clamped prefix norms
``n^k_i = max(||A_i[:d_k]||, eps)`` (``m^k_j`` likewise); its logits, masks and statistics are those of
``kernels/lse.py`` on that cosine (the same tile helpers). Boundaries need not fall on a D-chunk edge: a
walk over a segment ``S_k = [d_{k-1}, d_k)`` starts at the chunk that holds d_{k-1} and masks the chunk to
the segment (a straddled chunk is read once per segment). ``ALIGNED`` (every boundary a multiple of 16, set
by the host): the boundaries are declared so (``_bound``), the masks are then constant over 16 coordinates and
the operands arrive in 16-byte pipelined copies; otherwise each masked element is a scalar load.

Per-level host data (``core/matryoshka/triton_levels.py``), fp32 [K, N] (rows) or [K, M] (columns):

* ``RSA[k]`` = 1 / (p_i n^k_i): the inverse prefix norm of the power-of-two scaled copy ``SA = p A``
  (``kernels/lse.row_norm_kernel``), so ``cos^k = <SA_i, SB_j>[:d_k] RSA[k, i] RSB[k, j]``;
* ``FA[k]`` = n^K_i / n^k_i: the level's factor relative to the top level (>= 1 for unclamped rows);
* ``NA[k]`` = n^k_i (a prefix is projected in the normalisation backward when > eps).

Kernels:

* ``mat_fwd_kernel``: one program per row block (persistent with a column LSE, like ``lse_fwd_kernel``).
  Per column block one walk along D: the raw products accumulate segment by segment, and at each
  boundary the level's logits update its online row statistics, its positives' statistics and its
  partial column LSE (``COL_PART`` [P, K, M]). **1 unit** of matmul for every level together. The level
  loop is a loop, not unrolled, and the running maxima / sums live in memory ([K, N] rows of the outputs
  and the ``Z_RUN`` scratch, read and written once per tile and level between CTA barriers), so nothing
  per level stays live across the levels: the registers do not grow with K. SPLIT_T: each row's target
  entry stays out of every level's sums (the host forms the loss as ``softplus(LSEx - l_t)``).
* ``mat_bwd_kernel``: dA over row blocks (or, ``COLS``, dB over column blocks < grad_cols),
  deterministic and atomic-free like the fused kernels. Per tile, from the top level down: a walk over
  [0, d_k) rebuilds level k's raw products, its gradient tile ``G^k = dl^k FA[k, i] FB[k, j]`` (dl^k /
  gscale from the saved statistics) joins the suffix sum ``H += G^k``, and a walk over S_k adds
  ``H^k Y_hat[:, S_k]`` into this program's fp32 scratch rows (``Y_hat`` = the other side's top-level unit
  rows ``SB RSB[K-1]``, cast to the operand dtype as in the fused kernels; in bf16 ``(H^k RSB[K-1]) SB``, the
  scaled rows exact: FOLD_NORM). Each row's target entry stays out of the 16-bit tile (SPLIT_T). The row scalars
  ``rho^k = sum_j dl^k cos^k`` accumulate in a [BLOCK, KP] tensor; the epilogue forms, per element of
  segment r, ``dA_ic = s gscale (ACC_ic / (PRESCALE n^K_i) - A_ic sum_{k >= r, n^k_i > eps} rho^k_i / (n^k_i)^2)``
  (0 past d_K: no level reads those coordinates). Two tiles live (the level's and H) whatever K is.
  Matmul work per kernel: ``(sum_k d_k + d_K) / D`` units, 3.25 for 768/512/256/128/64, against the
  fused kernels' 2 for one loss and ``2 sum_k d_k / D`` = 4.5 for K of their calls.

* ``mat_epi_kernel``: the suffix backward's panel kernel (16-bit operands, ``core/matryoshka/triton_levels.py``
  ``_bwd_suffix``): one output tile of a row panel per program, one walk along D; each level's gradient
  tile is parked in 16 bits at its boundary, and after the walk the suffix sums ``H^r = sum_{k >= r} G^k``
  are written ([K, P, M]) for cuBLAS to multiply into each segment of both sides. 1 unit of matmul work for
  every level, the gradient GEMMs outside (see its docstring).

Why the kernels' own backward rebuilds every prefix instead of keeping K tiles or peeling segments:

* keeping the K levels' gradient tiles live until the top-down suffix sums (2 units per kernel) needs K
  fp32 tiles in registers: compiled for sm_80 at K = 8 it spilled 60-490 bytes even at 32 x 32 tiles, and
  32-row tiles cannot use wgmma on sm_90;
* peeling ``P^k`` off the top level's tile (``acc_{k-1} = acc_k - P^k``, 2.9 units) cancels: the cosine of
  a short prefix loses ~1e-7 |A_i| |B_j| / (n^k_i m^k_j), and the normalisation backward multiplies that
  by 1 / n^k_i. Measured on a 1-wide level with a small first coordinate: a gradient of 0.14 off by 0.36.
  Rebuilding the prefix is exact (no cancellation) for 0.33 units more.

The gradient GEMM always streams through the fp32 scratch ``ACC`` (no resident accumulator). fp16
operands take ``PRESCALE`` = 2^8 here (the fused kernels' 2^13 assumes ``|dl / gscale| <= 6``; the level
factors make ``|H / gscale| <= 4 sum_k FA[k] FB[k]`` with the target term in the tile (HAS_TGT; gscale
covers its weights), about 93 for 768/512/256/128/64 on random rows, and 93 * 2^8 < 65504). Every launch
sets ``maxnreg`` 255: without it ptxas held some variants at 128
registers and spilled a few bytes. Not supported (the launcher never routes them here): the symmetric
single-kernel backward (B is A runs as two inputs), the triangular forward, float64.
"""

import triton
import triton.language as tl

from .common import (
    NEG_INF,
    _dlogits,
    _grad_vec,
    _log0,
    _logits,
    _lse_add,
    _online_rows,
    _online_rows_split,
    _pos_logits,
    _stat,
    _sub_set,
)
from .panel import _grouped_tile


@triton.jit
def _seg_dot(acc, a_base, b_base, rmask, cmask, lo, hi,
             BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += A[rows, lo:hi] B[cols, lo:hi]^T (chunks aligned to BLOCK_D, masked to the segment)."""
    for d0 in range(lo // BLOCK_D * BLOCK_D, hi, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dmask = ((dd >= lo) & (dd < hi))[None, :]
        a = tl.load(a_base + dd[None, :], mask=rmask[:, None] & dmask, other=0.0)
        b = tl.load(b_base + dd[None, :], mask=cmask[:, None] & dmask, other=0.0)
        if UPCAST:  # interpreter only (its bf16 tl.dot is wrong)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _bound(DIMS, k, ALIGNED: tl.constexpr):
    """The level boundary ``d_k`` (``DIMS[k]``). ALIGNED (the host checked every boundary is a multiple of 16):
    told to the compiler, so that the D masks ``lo <= d < hi`` are constant over 16 coordinates and the operand
    loads become 16-byte vectors (pipelined by ``cp.async``); without it every masked element is its own
    16-bit load."""
    v = tl.load(DIMS + k)
    if ALIGNED:
        v = tl.multiple_of(v, 16)
    return v


@triton.jit
def _col(x, kk, k):
    """Column k of a [R, KP] tensor, as [R]."""
    return tl.sum(tl.where(kk[None, :] == k, x, 0.0), axis=1)


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------


@triton.jit
def _online_level(M_RUN, Z_RUN, idx, mask, first, l, hit, SPLIT: tl.constexpr):
    """One online LSE step of one level over a tile, its running max / sum kept in memory (M_RUN, Z_RUN
    rows ``idx``; the first tile starts from -inf / 0): every level's statistics cost no registers. SPLIT: the
    entries ``hit`` [BLOCK_M, BLOCK_N] stay out of the sum (the running max may be theirs: a shift only)."""
    m_i = tl.load(M_RUN + idx, mask=mask & (first > 0), other=NEG_INF)
    z_i = tl.load(Z_RUN + idx, mask=mask & (first > 0), other=0.0)
    # a row's value is held by several threads (and warps): all of them read before any of them writes,
    # and all writes land before the next read
    tl.debug_barrier()
    if SPLIT:
        m_i, z_i = _online_rows_split(m_i, z_i, l, hit)
    else:
        m_i, z_i = _online_rows(m_i, z_i, l)
    tl.store(M_RUN + idx, m_i, mask=mask)
    tl.store(Z_RUN + idx, z_i, mask=mask)
    tl.debug_barrier()


@triton.jit
def mat_fwd_kernel(
    SA, SB, RSA, RSB, DIMS, SCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, LSE_POS, Z_RUN, ZP_RUN, COL_PART, TGT, RMAX,
    N, M, stride_sa, stride_sb, offset, bias, n0, m0, stride_pm, n_row_blocks,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, POS_KIND: tl.constexpr, WANT_COL: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, ALIGNED: tl.constexpr, SPLIT_T: tl.constexpr,
):
    """LSE [K, N] (+ LSE_POS [K, N], + this program's partial column LSEs COL_PART[pid] [K, M]) for row
    blocks pid, pid + P, ... (grid (P,); without WANT_COL P = n_row_blocks). The running maxima live in
    LSE / LSE_POS and the running sums in the scratch Z_RUN / ZP_RUN [K, N] until the row block ends.

    SPLIT_T (no positives; ``kernels/lse.py``'s split at every level): each row's target entry ``(i, TGT[i])`` stays
    out of every level's row sum, so LSE holds ``LSEx^k_i`` (the running max may be the target's: a shift only), and
    RMAX [K, N] receives each row's largest tile logit per level (the backward's LSE is formed from it where the target
    is the row's max: ``core/lse/triton_fused.py`` ``tile_target``); with WANT_COL column j's statistics leave
    ``(j, j)`` out where ``TGT[j] == j`` (CLIP's pairs). The target logits themselves come from the host, in fp32."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s = tl.load(SCALE).to(tl.float32)
    for rblk in range(pid, n_row_blocks, nprog):
        rows = rblk * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < N
        a_base = SA + rows.to(tl.int64)[:, None] * stride_sa
        bias_c = rows
        if HAS_BIAS:
            bias_c = tl.load(BIAS_COL + rows, mask=rmask, other=-1)
        lab_r = rows
        if POS_KIND == 1:
            lab_r = tl.load(ROW_LAB + rows, mask=rmask, other=0)
        tgt_r = rows
        if SPLIT_T:
            tgt_r = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int32)
        for j0 in range(0, M, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            cmask = cols < M
            b_base = SB + cols.to(tl.int64)[:, None] * stride_sb
            lab_c = cols
            if POS_KIND == 1:
                lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(K):  # a loop, not unrolled: nothing per level stays live across the levels
                # 1. the next segment of the walk along D: acc holds level k's raw prefix products
                acc = _seg_dot(acc, a_base, b_base, rmask, cmask, _bound(DIMS, k, ALIGNED),
                               _bound(DIMS, k + 1, ALIGNED), BLOCK_D, UPCAST, DOT_PREC)
                rsa = tl.load(RSA + k * N + rows, mask=rmask, other=0.0)
                rsb = tl.load(RSB + k * M + cols, mask=cmask, other=0.0)
                l = _logits(acc * rsa[:, None] * rsb[None, :], s, rows, cols, N, M, offset, bias_c, bias,
                            EXCLUDE_SELF, HAS_BIAS, False)
                # 2. level k's online row statistics (SPLIT_T: the target entry out of the sum)
                hit = cols[None, :] == tgt_r[:, None]
                _online_level(LSE + k * N, Z_RUN + k * N, rows, rmask, j0, l, hit, SPLIT_T)
                if POS_KIND != 0:
                    lp = _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                                     POS_KIND, False)
                    _online_level(LSE_POS + k * N, ZP_RUN + k * N, rows, rmask, j0, lp, hit, False)
                # 3. level k's column statistics, merged into this program's partial row
                if WANT_COL:
                    cmax = tl.max(l, axis=0)
                    cms = tl.where(cmax == NEG_INF, 0.0, cmax)
                    e_col = tl.exp(l - cms[None, :])
                    if SPLIT_T:  # column j's target entry (j, j) apart where row j's target is j
                        e_col = tl.where((rows[:, None] == cols[None, :]) & (tgt_r == rows)[:, None], 0.0, e_col)
                    tile_lse = cms + _log0(tl.sum(e_col, axis=0))
                    cp = COL_PART + (pid * K + k).to(tl.int64) * M + cols
                    keep = tl.full([BLOCK_N], rblk, tl.int32) > pid  # the program's first block starts at -inf
                    old = tl.load(cp, mask=cmask & keep, other=NEG_INF)
                    tl.store(cp, _lse_add(old, tile_lse), mask=cmask)
                    tl.debug_barrier()
        # 4. LSE = m + log z per level (-inf for a row whose columns are all excluded; SPLIT_T: RMAX = m)
        for k in tl.static_range(K):
            m_k = tl.load(LSE + k * N + rows, mask=rmask, other=0.0)
            if SPLIT_T:
                tl.store(RMAX + k * N + rows, m_k, mask=rmask)
            tl.store(LSE + k * N + rows, m_k + _log0(tl.load(Z_RUN + k * N + rows, mask=rmask, other=1.0)),
                     mask=rmask)
            if POS_KIND != 0:
                tl.store(LSE_POS + k * N + rows, tl.load(LSE_POS + k * N + rows, mask=rmask, other=0.0)
                         + _log0(tl.load(ZP_RUN + k * N + rows, mask=rmask, other=1.0)), mask=rmask)


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------


@triton.jit
def _level_grad(acc, k, rows, cols, N, M, s, inv_gs, PTRS, MASKS,
                EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, POS_KIND: tl.constexpr, HAS_G: tl.constexpr,
                HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, COLS: tl.constexpr, HAS_TGT: tl.constexpr,
                HAS_SET: tl.constexpr, EXACT_T: tl.constexpr):
    """Level k's gradient tile from its raw prefix products ``acc``: ``(G^k = dl^k FA[k, i] FB[k, j], this
    program's scalars sum_j dl^k cos^k per row, or sum_i per column with COLS, the tile dl^k cos^k)``, dl^k
    from the saved statistics (/ gscale) exactly as ``kernels/lse.py`` forms it. ``PTRS`` / ``MASKS`` are the kernel's
    pointer and mask arguments. HAS_TGT: the target logit's term joins the tile, ``TW[k, i]`` (its
    upstream gradient / gscale, signed) at column ``TGT[i]``, in fp32 before anything is rounded: in a
    peaked softmax ``p_it - 1`` cancels, and formed from a 16-bit ``p_it`` it lost ~2e-2 of the gradient.
    EXACT_T (with HAS_TGT): ``TW[k, i]`` is the whole entry at the target, the log-sum-exp terms' weight combined with
    the target term's (``-g_i (1 - p_t)`` from the split forward's statistics, ``target_split.exact_weights``), which
    replaces the tile's ``p_t``-based value instead of adding to it: in fp32 too ``p_t - 1`` keeps nothing of
    ``1 - p_t`` below an ulp. HAS_SET: the positive-set term's ``-G_SET[k, i] w_ij`` (``c.set_i`` times the level's
    upstream gradient, / gscale; ``w_ij`` the positives' weights, ``kernels/common.py`` ``_sub_set``) joins the tile
    likewise: in a softmax concentrated on the positives ``p_ij`` and ``c.set_i w_ij`` nearly cancel."""
    RSA, RSB, FA, FB, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TW, G_SET = \
        PTRS
    offset, bias, n0, m0, stride_pm = MASKS
    rmask = rows < N
    cmask = cols < M
    rsa = tl.load(RSA + k * N + rows, mask=rmask, other=0.0)
    rsb = tl.load(RSB + k * M + cols, mask=cmask, other=0.0)
    cos = acc * rsa[:, None] * rsb[None, :]
    bias_c = rows
    if HAS_BIAS:
        bias_c = tl.load(BIAS_COL + rows, mask=rmask, other=-1)
    l = _logits(cos, s, rows, cols, N, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS, False)
    lse_r = _stat(LSE + k * N, rows, rmask)
    g_r = tl.zeros([rows.shape[0]], dtype=tl.float32)
    if HAS_G:
        g_r = _grad_vec(G + k * N, LSE + k * N, rows, rmask, inv_gs, False)
    lp = l
    lsep_r = lse_r
    gp_r = g_r
    lab_r = rows
    lab_c = cols
    if POS_KIND == 1:
        lab_r = tl.load(ROW_LAB + rows, mask=rmask, other=0)
        lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
    if HAS_GPOS:
        lp = _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND, False)
        lsep_r = _stat(LSE_POS + k * N, rows, rmask)
        gp_r = _grad_vec(G_POS + k * N, LSE_POS + k * N, rows, rmask, inv_gs, True)
    lsec_c = tl.zeros([cols.shape[0]], dtype=tl.float32)
    gc_c = lsec_c
    if HAS_GCOL:
        lsec_c = _stat(LSE_COL + k * M, cols, cmask)
        gc_c = _grad_vec(G_COL + k * M, LSE_COL + k * M, cols, cmask, inv_gs, False)
    dl = _dlogits(l, lp, lse_r, g_r, lsec_c, gc_c, lsep_r, gp_r, HAS_G, HAS_GCOL, HAS_GPOS)
    if HAS_TGT:
        tgt_r = tl.load(TGT + rows, mask=rmask, other=-1)
        tw_r = tl.load(TW + k * N + rows, mask=rmask, other=0.0) * inv_gs
        if EXACT_T:
            dl = tl.where(cols[None, :] == tgt_r[:, None], tw_r[:, None], dl)
        else:
            dl += tl.where(cols[None, :] == tgt_r[:, None], tw_r[:, None], 0.0)
    if HAS_SET:
        gset_r = tl.load(G_SET + k * N + rows, mask=rmask, other=0.0) * inv_gs
        dl = _sub_set(dl, gset_r, rows, cols, N, M, offset, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND,
                      EXCLUDE_SELF, False)
    dc = dl * cos
    fa = tl.load(FA + k * N + rows, mask=rmask, other=0.0)
    fb = tl.load(FB + k * M + cols, mask=cmask, other=0.0)
    if COLS:
        v = tl.sum(dc, axis=0)
    else:
        v = tl.sum(dc, axis=1)
    return dl * fa[:, None] * fb[None, :], v, dc


@triton.jit
def _mat_epilogue(X, OUT, ACC, NX, nx_stride, DIMS, rho, kk, rows, n_out, D, stride_x, stride_o, mult, eps,
                  tg, tgt_r, Y, RSY, stride_y, n_y,
                  K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PRESCALE: tl.constexpr,
                  ALIGNED: tl.constexpr, SPLIT_T: tl.constexpr):
    """OUT_ic = mult (ACC_ic / (PRESCALE n^K_i) - X_ic sum_{k: c < d_k, n^k_i > eps} rho^k_i / (n^k_i)^2),
    0 for c >= d_K; cast to OUT's dtype. ``NX`` [K, nx_stride] holds the clamped prefix norms n^k, ``rho``
    [BLOCK_R, KP] the scalars of level k in column k. SPLIT_T: plus, in fp32, the target entries the
    16-bit tiles left out: ``sum_{k: c < d_k} tg^k_i Y_hat[t_i, c] / n^K_i`` (``tg`` [BLOCK_R, KP] the
    levels' gradient-tile entries at each row's target column ``tgt_r``, ``Y_hat = Y RSY[K - 1]`` the other
    side's top-level unit rows, in fp32 here, ``n_y`` its rows)."""
    rmask = rows < n_out
    n_top = tl.load(NX + (K - 1) * nx_stride + rows, mask=rmask, other=1.0)
    top = _bound(DIMS, K, ALIGNED)
    x_base = X + rows.to(tl.int64)[:, None] * stride_x
    o_base = OUT + rows.to(tl.int64)[:, None] * stride_o
    a_base = ACC + rows.to(tl.int64)[:, None] * D
    if SPLIT_T:
        tmask = rmask & (tgt_r >= 0) & (tgt_r < n_y)
        y_base = Y + tl.where(tmask, tgt_r, 0).to(tl.int64)[:, None] * stride_y
        rs_t = tl.load(RSY + (K - 1) * n_y + tgt_r, mask=tmask, other=0.0)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        live = m2 & (dd < top)[None, :]
        g = tl.load(a_base + dd[None, :], mask=live, other=0.0) / (PRESCALE * n_top[:, None])
        corr = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        tco = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for k in range(K):
            nk = tl.load(NX + k * nx_stride + rows, mask=rmask, other=1.0)
            ck = tl.where(nk > eps, _col(rho, kk, k) / (nk * nk), 0.0)
            below = (dd < _bound(DIMS, k + 1, ALIGNED))[None, :]
            corr += tl.where(below, ck[:, None], 0.0)
            if SPLIT_T:
                tco += tl.where(below, _col(tg, kk, k)[:, None], 0.0)
        if SPLIT_T:
            yt = tl.load(y_base + dd[None, :], mask=tmask[:, None] & live, other=0.0).to(tl.float32)
            g += tco * yt * (rs_t / n_top)[:, None]
        x = tl.load(x_base + dd[None, :], mask=live, other=0.0).to(tl.float32)
        tl.store(o_base + dd[None, :], ((g - x * corr) * mult).to(OUT.dtype.element_ty), mask=m2)


@triton.jit
def mat_bwd_kernel(
    X, SA, SB, RSA, RSB, FA, FB, NX, DIMS, SCALE, GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TW, G_SET,
    DX, ACC, DS_PART, TG,
    N, M, D, n_out, stride_x, stride_sa, stride_sb, stride_dx, offset, bias, n0, m0, stride_pm, eps,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, POS_KIND: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, COLS: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DS: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    PRESCALE: tl.constexpr, HAS_TGT: tl.constexpr, ALIGNED: tl.constexpr, SPLIT_T: tl.constexpr,
    FOLD_NORM: tl.constexpr, HAS_SET: tl.constexpr, EXACT_T: tl.constexpr,
):
    """dA for one block of rows (grid cdiv(N, BLOCK_M); X = A, NX = NA, n_out = N) and its share of dL/ds,
    or with COLS dB for one block of columns < n_out (grid cdiv(n_out, BLOCK_N); X = B, NX = NB).

    Per tile, from the top level down: a walk over [0, d_k) gives level k's raw products and its gradient
    tile G^k, which joins the suffix sum ``H += G^k``; a walk over the segment S_k multiplies ``H`` into the
    scratch (``ACC[:, S_k] += H Y_hat[:, S_k]``). Two tiles live whatever K is.

    SPLIT_T (with HAS_TGT): each row's target entry ``G^k[i, TGT[i]]`` stays out of the 16-bit tile ``H`` (and
    so out of the 16-bit ``Y_hat`` of the GEMM). In a peaked softmax it is the largest entry of its row, nearly
    cancelled (``p_it - 1``), and both roundings (H's and Y_hat's, 2^-9 each in bf16) fell on it whole: 1e-2
    of max |grad| in bf16 at temperature 0.05 against 2-4e-3 for one plain call per level under the CPU
    interpreter, whose bf16 casts truncate; with the GPU's rounding to nearest 6.5e-3 against 2.5-4.5e-3, and
    3.2e-3 with SPLIT_T and FOLD_NORM (tests/test_matryoshka_target_split.py). The rows kernel
    (COLS False) writes the entries to ``TG[k, i]`` (fp32, [K, N]) and adds ``sum_k TG[k, i] Y_hat[t_i, :d_k]``
    in fp32 in its epilogue; the columns kernel leaves them out and starts from ``ACC`` as the host filled it
    (``PRESCALE sum_{i: t_i = j} sum_k TG[k, i] X_hat[i, :d_k]`` in fp32, from the rows kernel's TG).

    FOLD_NORM (bf16): the other side's inverse norms multiply the tile (``H rs_y``, fp32, then one rounding)
    and the GEMM reads the scaled rows as they are (exact), instead of rounding both ``H`` and
    ``Y_hat = SY rs_y``. Every level shares the one ``Y_hat`` of a segment, so its rounding errors added up
    coherently over the levels (segment 0 holds K of them): about twice the error of one plain call per level
    (under the interpreter; with the GPU's rounding SPLIT_T alone measured 4.5e-3 on one seed where SPLIT_T and
    FOLD_NORM measure 2.7e-3 and the plain calls 2.8e-3).
    bf16 only: ``rs_y`` (down to ``1 / (2 sqrt D)``) would push fp16's small entries toward subnormals."""
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    gs = tl.load(GSCALE)
    inv_gs = 1.0 / gs
    kk = tl.arange(0, KP)
    PTRS = (RSA, RSB, FA, FB, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TW,
            G_SET)
    MASKS = (offset, bias, n0, m0, stride_pm)
    if COLS:
        own = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_other = N
        step = BLOCK_M
        rho = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
    else:
        own = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        n_other = M
        step = BLOCK_N
        rho = tl.zeros([BLOCK_M, KP], dtype=tl.float32)
    # SPLIT_T: the rows kernel's target entries per level ([BLOCK_M, KP]); each row's target column
    tg = tl.zeros([BLOCK_M, KP], dtype=tl.float32)
    tgt_own = tl.full([BLOCK_M], -1, tl.int32)
    if SPLIT_T and not COLS:
        tgt_own = tl.load(TGT + own, mask=own < N, other=-1).to(tl.int32)
    for t0 in range(0, n_other, step):
        if COLS:
            rows = t0 + tl.arange(0, BLOCK_M)
            cols = own
            rs_y = tl.load(RSA + (K - 1) * N + rows, mask=rows < N, other=0.0)
        else:
            rows = own
            cols = t0 + tl.arange(0, BLOCK_N)
            rs_y = tl.load(RSB + (K - 1) * M + cols, mask=cols < M, other=0.0)
        rmask = rows < N
        cmask = cols < M
        a_base = SA + rows.to(tl.int64)[:, None] * stride_sa
        b_base = SB + cols.to(tl.int64)[:, None] * stride_sb
        h = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        hit = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)
        if SPLIT_T:
            hit = cols[None, :] == tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int32)[:, None]
        for j in range(K):
            k = K - 1 - j
            lo = _bound(DIMS, k, ALIGNED)
            hi = _bound(DIMS, k + 1, ALIGNED)
            # level k's raw prefix products, walked afresh over [0, d_k): no cancellation (peeling the
            # segment products off the top level's tile instead lost ~1e-7 |A_i| |B_j| / (n^k_i m^k_j) of
            # the cosine: 0.36 of a gradient of 0.14 for a row with a 1-wide level and a small first coordinate)
            acc = _seg_dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a_base, b_base, rmask, cmask, 0, hi,
                           BLOCK_D, UPCAST, DOT_PREC)
            g_k, v, _ = _level_grad(acc, k, rows, cols, N, M, s, inv_gs, PTRS, MASKS, EXCLUDE_SELF, HAS_BIAS,
                                    POS_KIND, HAS_G, HAS_GCOL, HAS_GPOS, COLS, HAS_TGT, HAS_SET, EXACT_T)
            rho = tl.where(kk[None, :] == k, rho + v[:, None], rho)
            if SPLIT_T:  # the target entries leave the tile (the rows kernel keeps them in fp32)
                if not COLS:
                    tg = tl.where(kk[None, :] == k, tg + tl.sum(tl.where(hit, g_k, 0.0), axis=1)[:, None], tg)
                g_k = tl.where(hit, 0.0, g_k)
            if NEED_DX:
                # the suffix sum H^k = H^{k+1} + G^k, then ACC[own, S_k] += H^k (SY rs_y)[other, S_k] (the
                # other side's top-level unit rows), in the operand dtype like the fused kernels; FOLD_NORM:
                # as (H^k rs_y) SY[other, S_k], the scaled rows exact and one rounding (of the tile) per term
                h += g_k
                if COLS:
                    if FOLD_NORM:
                        ho = (tl.trans(h * rs_y[:, None]) * PRESCALE).to(SA.dtype.element_ty)
                    else:
                        ho = (tl.trans(h) * PRESCALE).to(SA.dtype.element_ty)
                    y_base = a_base
                    ymask = rmask
                    yt = SA.dtype.element_ty
                else:
                    if FOLD_NORM:
                        ho = (h * rs_y[None, :] * PRESCALE).to(SB.dtype.element_ty)
                    else:
                        ho = (h * PRESCALE).to(SB.dtype.element_ty)
                    y_base = b_base
                    ymask = cmask
                    yt = SB.dtype.element_ty
                if UPCAST:
                    ho = ho.to(tl.float32)
                acc_base = ACC + own.to(tl.int64)[:, None] * D
                for d0 in range(lo // BLOCK_D * BLOCK_D, hi, BLOCK_D):
                    dd = d0 + tl.arange(0, BLOCK_D)
                    dmask = ((dd >= lo) & (dd < hi))[None, :]
                    y = tl.load(y_base + dd[None, :], mask=ymask[:, None] & dmask, other=0.0)
                    if FOLD_NORM:
                        yh = y
                    else:
                        yh = (y.to(tl.float32) * rs_y[:, None]).to(yt)
                    if UPCAST:  # interpreter only (its bf16 tl.dot is wrong)
                        yh = yh.to(tl.float32)
                    omask = (own < n_out)[:, None] & dmask
                    # (SPLIT_T, columns: ACC starts from the host's fp32 target terms)
                    prev = tl.load(acc_base + dd[None, :], mask=omask & ((t0 > 0) | (SPLIT_T and COLS)), other=0.0)
                    tl.store(acc_base + dd[None, :], tl.dot(ho, yh, prev, input_precision=DOT_PREC), mask=omask)
        if NEED_DX:
            tl.debug_barrier()  # order this tile's scratch stores before the next tile's loads
    if NEED_DS:
        tl.store(DS_PART + pid, tl.sum(tl.sum(rho, axis=1), axis=0))
    if SPLIT_T and not COLS:
        for k in tl.static_range(K):
            tl.store(TG + k * N + own, _col(tg, kk, k), mask=own < N)
    if NEED_DX:
        if COLS:
            _mat_epilogue(X, DX, ACC, NX, M, DIMS, rho, kk, own, n_out, D, stride_x, stride_dx, s * gs, eps,
                          tg, tgt_own, SA, RSA, stride_sa, N, K, BLOCK_N, BLOCK_D, PRESCALE, ALIGNED, False)
        else:
            _mat_epilogue(X, DX, ACC, NX, N, DIMS, rho, kk, own, n_out, D, stride_x, stride_dx, s * gs, eps,
                          tg, tgt_own, SB, RSB, stride_sb, M, K, BLOCK_M, BLOCK_D, PRESCALE, ALIGNED, SPLIT_T)


# ------------------------------------------------------------------------------------------------
# backward: the suffix sums of one panel (the "suffix" route)
# ------------------------------------------------------------------------------------------------


@triton.jit
def _park(k: tl.constexpr, x, p0, p1, p2, p3, p4, p5, p6):
    """Slot k of the parked tiles set to ``x`` (k a constexpr: the other slots pass through)."""
    if k == 0:
        p0 = x
    if k == 1:
        p1 = x
    if k == 2:
        p2 = x
    if k == 3:
        p3 = x
    if k == 4:
        p4 = x
    if k == 5:
        p5 = x
    if k == 6:
        p6 = x
    return p0, p1, p2, p3, p4, p5, p6


@triton.jit
def _slot(k: tl.constexpr, p0, p1, p2, p3, p4, p5, p6):
    """Parked slot k (k a constexpr)."""
    x = p0
    if k == 1:
        x = p1
    if k == 2:
        x = p2
    if k == 3:
        x = p3
    if k == 4:
        x = p4
    if k == 5:
        x = p5
    if k == 6:
        x = p6
    return x


@triton.jit
def mat_epi_kernel(
    SA, SB, RSA, RSB, FA, FB, DIMS, SCALE, GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TW, G_SET,
    H, RHO_R, RHO_C,
    N, M, P, r0, stride_sa, stride_sb, offset, bias, n0, m0, stride_pm,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_M: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, POS_KIND: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, HAS_TGT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_SET: tl.constexpr, EXACT_T: tl.constexpr,
):
    """The suffix sums of one panel, rows ``r0 .. r0 + P`` against every column: one output tile per program
    (grid ``cdiv(P, BLOCK_M) * cdiv(M, BLOCK_N)``, groups of GROUP_M row tiles sweep the columns together).

    One walk along D: after segment S_k the accumulator holds level k's raw prefix products, whose gradient
    tile ``G^k = dl^k FA[k, i] FB[k, j]`` (``_level_grad``, from the saved statistics) is parked in H's
    dtype (times PRESCALE) for k < K - 1; after the walk, top down, ``H^r = sum_{k >= r} G^k`` in fp32 from
    the top level's fp32 tile and the parked ones, stored (times PRESCALE, H's dtype) to
    ``H[r, i - r0, j]`` ([K, P, M]). 1 unit of matmul work for every level, against the fused backward's
    per-level rebuilds; the host then multiplies ``H^r`` into segment S_r of both sides (cuBLAS, 1 unit per
    side). Each level's ``dl^k cos^k`` is summed per row into ``RHO_R[i - r0, column tile, k]`` ([P, n_pn,
    KP]) and per column into ``RHO_C[row tile, k, j]`` ([n_pm, KP, M]): the normalisation backward's and
    the scale's scalars. At most 8 levels (7 parked tiles).

    Precision: each parked ``G^k`` is rounded once to H's dtype before the fp32 sums, so ``H^r`` carries up
    to ``K - r`` roundings of its terms instead of one. Every term of one entry has the same sign when the
    loss has only softmax terms with positive coefficients and the target term (``p - 1`` for every level),
    so the rounding errors add in relative terms and do not cancel: at most about ``K / 2`` units in the
    last place of the entry, against the other routes' half unit."""
    pid = tl.program_id(0)
    n_pn = tl.cdiv(M, BLOCK_N)
    pid_m, pid_n = _grouped_tile(pid, P, n_pn, BLOCK_M, GROUP_M)
    loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lmask = loc < P
    rows = r0 + loc
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < M
    smask = lmask[:, None] & cmask[None, :]
    s = tl.load(SCALE).to(tl.float32)
    inv_gs = 1.0 / tl.load(GSCALE)
    PTRS = (RSA, RSB, FA, FB, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TW,
            G_SET)
    MASKS = (offset, bias, n0, m0, stride_pm)
    a_base = SA + rows.to(tl.int64)[:, None] * stride_sa
    b_base = SB + cols.to(tl.int64)[:, None] * stride_sb
    h_base = H + loc.to(tl.int64)[:, None] * M + cols[None, :]
    plane = P.to(tl.int64) * M
    rr = RHO_R + (loc.to(tl.int64) * n_pn + pid_n) * KP
    rc = RHO_C + pid_m.to(tl.int64) * KP * M + cols
    z = tl.zeros([BLOCK_M, BLOCK_N], dtype=H.dtype.element_ty)
    p0, p1, p2, p3, p4, p5, p6 = z, z, z, z, z, z, z
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(K):
        acc = _seg_dot(acc, a_base, b_base, lmask, cmask, _bound(DIMS, k, ALIGNED), _bound(DIMS, k + 1, ALIGNED),
                       BLOCK_D, UPCAST, DOT_PREC)
        g, _, dc = _level_grad(acc, k, rows, cols, N, M, s, inv_gs, PTRS, MASKS, EXCLUDE_SELF, HAS_BIAS, POS_KIND,
                               HAS_G, HAS_GCOL, HAS_GPOS, False, HAS_TGT, HAS_SET, EXACT_T)
        dc = tl.where(smask, dc, 0.0)
        tl.store(rr + k, tl.sum(dc, axis=1), mask=lmask)
        tl.store(rc + k * M, tl.sum(dc, axis=0), mask=cmask)
        if k == K - 1:
            h = g * PRESCALE
        else:
            p0, p1, p2, p3, p4, p5, p6 = _park(k, (g * PRESCALE).to(H.dtype.element_ty), p0, p1, p2, p3, p4, p5, p6)
    tl.store(h_base + (K - 1) * plane, h.to(H.dtype.element_ty), mask=smask)
    for j in tl.static_range(K - 1):
        h += _slot(K - 2 - j, p0, p1, p2, p3, p4, p5, p6).to(tl.float32)
        tl.store(h_base + (K - 2 - j) * plane, h.to(H.dtype.element_ty), mask=smask)
