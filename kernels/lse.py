"""Triton device code of the core op: masked row log-sum-exp over scaled cosines, forward and backward.

The core op (see ``fused_contrastive/core/spec.py``), with ``a_i = A_i r_i``, ``r_i = 1 / max(||A_i||, eps)``
(``b_j`` likewise) and the runtime scale ``s``::

    l_ij     = s <a_i, b_j> + bias [j == bias_col_i],   -inf at j == offset + i (exclude_self)
    LSE_i    = log sum_j exp(l_ij)
    LSEcol_j = log sum_i exp(l_ij)                       (WANT_COL, CLIP)
    LSEpos_i = log sum_j w_ij exp(l_ij)                  (POS_KIND: 1 label equality, 2 dense mask)

The linear positive terms of the contract (``TGT``, ``SET``) are O(N*D) and come from
``core/linear_terms.py`` (the target term alone on the triton backend: ``kernels/target.py``); these kernels
compute the log-sum-exp terms and their backward. Two exceptions keep a 16-bit gradient tile from
cancelling against those terms after rounding: SPLIT_T leaves each row's target column out of the tile
(its fp32 weight goes to the target term), SPLIT_SET subtracts the SET term's ``c.set_i w_ij`` inside
the tile in fp32 (its gradient then comes from here alone); see the backward kernels' docstrings.

Kernels (launchers and the autograd Function are in ``fused_contrastive/core/triton_shared/launch.py``,
launch configs in ``fused_contrastive/core/triton_shared/configs.py``):

* ``row_norm_kernel``      prologue: clamped norms ``max(||x||, eps)`` (overflow-free scaled sum of
                           squares), their inverses ``r``, and a copy scaled by an exact power of two
                           (every tile reads it: raw values, bounded products) with its inverse
                           norms (O(N*D)).
* ``lse_fwd_kernel``       one program per block of anchor rows streams over all column blocks:
                           LSE, LSEpos and (WANT_COL) per-program partial column LSEs.
* ``lse_bwd_rows_kernel``  dA (and the temperature gradient), one program per row block.
* ``lse_bwd_cols_kernel``  dB, one program per column block (only columns < grad_cols).

Supported: any N, M, D (D is streamed in BLOCK_D chunks; every load is masked with its loop offset),
fp32 / fp16 / bf16 embeddings (fp32 accumulation; fp32 tiles use ``input_precision="tf32x3"`` on the
GPU, i.e. tensor cores at ~fp32 accuracy), int64 pointer offsets (N*D and n0*m0 may exceed 2^31),
row strides (the inner dimension must be contiguous), a runtime scale (a pointer, never a constexpr).
Nothing N x M is ever written.

Not supported / limits:
* float64 (rejected by the launcher: use the torch backend).
* The bf16 ``tl.dot`` of the Triton CPU interpreter is wrong; ``UPCAST=True`` up-casts both tiles to
  fp32 before every dot (after rounding them to the input dtype, so the numerics still match the GPU's
  bf16 operands). The launcher turns it on for bf16 under ``TRITON_INTERPRET=1`` only.
* Logits of +inf (an infinite scale or bias) give NaN, like ``exp(inf - inf)``; the reference gives inf.
* Tested under the CPU interpreter and by ahead-of-time compilation for sm_80 / sm_90 only; no run on
  a GPU yet (launch configs are not tuned by measurement, and the streaming accumulator's barrier
  ordering needs a GPU run to be confirmed).
* The default backward is deterministic and atomic-free, which costs 4 matmul units for A != B
  (dA and dB kernels each recompute the tiles); an atomics-based single pass would cost 3.

Numerics
--------
* Online LSE: running max ``m`` and sum ``z``: ``z <- z exp(m - m') + sum_j exp(l_j - m')``. A row whose
  columns are all excluded keeps ``m = -inf``; ``m'`` is replaced by 0 inside the exponentials so
  ``exp(-inf - -inf)`` never happens, and the row's LSE stays ``-inf + log 0 = -inf``.
* NaN: ``tl.max`` ignores NaN (``maxnum`` on the GPU, ``nanmax`` in the interpreter), but the NaN still
  reaches the sum through ``exp(NaN - m')``, so a NaN input gives a NaN LSE. Masks only ever replace
  logits that the definition excludes (padding, the self column, non-positives), never by a max.
* Backward: the upstream gradients are divided by one global ``gscale = max |g|`` before the
  softmax-weighted tile is cast to the (fp16) operand dtype of the gradient matmul and multiplied back
  after it, so small ``g`` (a mean over many rows) does not underflow fp16.
* fp16 pre-scale (constexpr ``PRESCALE``, 2^13 for fp16 operands, 1 otherwise): after the division by
  gscale the softmax weights are still ~1/M, below fp16's smallest normal (6.1e-5) for most entries at
  M = 65536. The tile is multiplied by 2^13 before the cast (exact: a power of two) and the epilogue
  divides the fp32 accumulator by it. ``|dl / gscale| <= 3`` (``|H| <= 6`` on the symmetric path), and
  ``6 * 2^13 = 49152 < 65504``: it cannot overflow. tests/test_triton_panel.py measures the gain.
* The dense positive mask is read in its own dtype: bool / uint8 (0/1) masks at 1 byte per entry,
  other dtypes (general non-negative weights) as float32 (the launcher decides by dtype).

Symmetric case (``SYM``: B is A, no bias)
-----------------------------------------
A is both the anchor and the contrast set, so ``dA_k = s (sum_j dl_kj a_j + sum_i dl_ik a_i)
= s sum_j H_kj a_j`` with ``H = dl + dl^T``. Because the logits are symmetric (``l_kj = l_jk``: the
cosine is, the self column is the diagonal, there is no bias), ``dl_jk`` is computed from the *same*
tile ``l_kj`` with the other side's statistics (``g_j``, ``LSE_j``, ``LSEcol_k``, ``w_jk``). So one
kernel over row blocks produces the whole gradient from one recomputed tile per (K, J), deterministic.
Work in units of one N x N x D matmul (2 N^2 D FLOPs):

* shipped (full rows): forward 1 + backward (recompute 1 + ``H @ A`` 1) = **3 units**;
* the half-triangle scheme of ``docs/core-op.md`` (visit only I <= J): forward 1/2 + backward (recompute 1/2
  + ``H A_J`` and ``H^T A_I`` 1) = **2 units**, but tile (I, J) must add into ``dA_J`` owned by
  another program: that needs atomics (run-to-run nondeterministic sums) or per-row-block partial
  gradients of O(N^2 D / BLOCK) memory (100 GB at N = 65536, D = 768), against the deterministic,
  O(N*D), no-atomics backward the project requires by default. A plain recomputing backward that
  treats B as a separate input would cost 1 + 2 + 2 = 5 units.
The forward alone could use the half triangle with O(N^2 / BLOCK) partial buffers like the column
LSE below (saving 1/2 unit of 3); it is not done, to keep one forward code path.

Column LSE (``WANT_COL``, CLIP)
-------------------------------
Row and column statistics come from the same tiles in one pass: each program keeps, for every
column, the LSE of the rows it has visited in its own row of ``COL_PART`` [P, M] (read-modify-write,
only by that program), and the launcher merges the P partials with ``logsumexp(dim=0)``
(deterministic). The launcher caps P (a persistent loop over row blocks), so the buffer is
``P * M`` floats, not N x M.

Backward
--------
Gradient derivation. With upstream gradients ``g_i = dL/dLSE_i``, ``gc_j = dL/dLSEcol_j`` and
``gp_i = dL/dLSEpos_i``, and ``p_ij = exp(l_ij - LSE_i)``, ``pc_ij = exp(l_ij - LSEcol_j)``,
``q_ij = w_ij exp(l_ij - LSEpos_i)``::

    dL/dl_ij = dl_ij = g_i p_ij + gc_j pc_ij + gp_i q_ij    (gp_i := 0 where LSEpos_i = -inf)
    dL/da_i  = s sum_j dl_ij b_j        dL/db_j = s sum_i dl_ij a_i      dL/ds = sum_ij dl_ij cos_ij
    dL/dA_i  = (da_i - a_i <da_i, a_i>) r_i     if ||A_i|| > eps, else da_i r_i   (normalisation)

The tiles are recomputed from the saved LSEs (O(N + M) saved state). dA: one program per row block
accumulates ``dl @ B_hat`` over all column blocks; dB: one program per column block accumulates
``dl^T @ A_hat`` over all row blocks. No atomics: every output row has one owner and a fixed summation
order, so the backward is bitwise deterministic. The temperature gradient is accumulated per row
block and summed by the launcher.

Two accumulator placements (constexpr ``RESIDENT``):

* resident (16-bit inputs with ``D_PAD = next_pow2(D) <= 128``): the [BLOCK, D_PAD] fp32 accumulator
  lives in registers for the whole loop (like FlashAttention's dQ); D is one chunk.
* streaming (larger D, and fp32 inputs): the accumulator does not fit in registers, so each tile's
  contribution is added, chunk by chunk, into an fp32 scratch row block owned by the program
  (``ACC``, O(N*D), L2-resident; the first tile stores without loading, so no memset). A
  ``tl.debug_barrier`` (CTA barrier) after each tile's read-modify-write orders one thread's stores
  before another thread's loads of the same rows in the next tile (the load and the store may use
  different register layouts). The epilogue reads the scratch twice (the ``<g, x_hat>`` projection,
  then the normalisation backward). Extra traffic per tile: 8 bytes per accumulator element, i.e.
  BLOCK_N / 4 FLOP per byte for the gradient matmul; the recompute matmul has none.

Launch configs (block sizes, warps, stages) are chosen by the host code from a fixed table
(``core/triton_shared/configs.CONFIGS``); tests/test_triton_compile.py compiles every entry for sm_80 and sm_90
and checks 0 spill bytes and tensor-core instructions (``mma.sync`` / ``wgmma``).
"""

import triton
import triton.language as tl

from .common import (
    NEG_INF,
    _accumulate,
    _cos_tile,
    _dlogits,
    _grad_vec,
    _inv_norms,
    _log0,
    _logits,
    _lse_add,
    _norm_bwd_epilogue,
    _online_rows,
    _online_rows_split,
    _pos_logits,
    _row_stats,
    _stat,
    _sub_set,
)

# ------------------------------------------------------------------------------------------------
# prologue
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# tile helpers (shared by the forward and both backward kernels, so recomputed tiles match)
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------


@triton.jit
def lse_fwd_kernel(
    SA, SB, RSA, RSB, SCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, LSE_POS, COL_PART,
    N, M, D, stride_sa, stride_sb, offset, bias, n0, m0, stride_pm, n_row_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr,
    POS_KIND: tl.constexpr, WANT_COL: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    TRI: tl.constexpr,
    TGT, LT, SPLIT_T: tl.constexpr,
):
    """Row LSE (+ LSEpos, + this program's partial column LSE) for row blocks pid, pid + P, ...

    Grid: (P,), P <= n_row_blocks. Without WANT_COL the launcher uses P = n_row_blocks (one row block
    per program); with it P is capped and COL_PART is [P, M] (row pid belongs to this program).

    TRI (B is A: symmetric logits; no positives): only the tiles on and above the diagonal. LSE gets
    each row's columns j >= i (j > i in the column statistics), COL_PART (pre-filled with -inf by the
    launcher) each column's rows i < j, so that ``LSE_i = logaddexp(LSE_i, logsumexp_p COL_PART[p, i])``
    is the full row LSE: half the tiles. n_row_blocks is then a multiple of P, and round t gives
    program pid the row block t P + pid (t even) or t P + P - 1 - pid (t odd), which balances the
    triangle's unequal rows; blocks past the last row have no columns.

    SPLIT_T (no positives): each row's target entry ``(i, TGT[i])`` is left
    out of its row sums, so LSE (and with TRI the column statistics of the rows of the columns, where the entry
    is ``(TGT[j], j)``) hold ``LSEx_i``, the log-sum-exp over every column but the target (the running max may
    be the target's: a shift only), and ``LT[i]`` gets the target's logit, from the row's fp32 dot with its
    target row after the column loop (-inf where a mask takes the entry out: its own excluded column, padding).
    With WANT_COL (CLIP) column j's partial statistics leave out the entry ``(j, j)`` where ``TGT[j] == j`` (the
    column's target is the row whose target it is: CLIP's pairs; any other column keeps every entry), so they
    merge to ``LSEcolx_j`` and the column's target logit is ``LT[j]``.
    The host forms ``LSE_i = logaddexp(LSEx_i, LT_i)`` and the loss ``LSE_i - l_it = softplus(LSEx_i - LT_i)``
    (the column's likewise) without the cancellation of two values of ``~|s|`` (the saturated regime: a row
    loss of ``~1e-4``). The
    target's logit from the dot rather than captured from the tile: capturing it cost registers in the loop
    (sm_90 bf16 D = 768 compiles: 84-92 bytes of spills against 8-16 this way, 0 without SPLIT_T).
    Without TRI, ``LT`` has 2N entries: ``LT[N + i]`` gets the row's running max ``m_i`` over every logit of its
    tiles, the target's among them: where the target is the row's largest logit (the saturated regime) that is
    the tile's own rounding of ``l_it``, bit for bit. The backward recomputes the tiles and weights the target
    entry by ``exp(l_it - LSE_i)``; with ``p_t ~ 1`` its fp32 weight meets the target term's ``-1``, so ``LSE_i``
    must agree with the tile's ``l_it`` to well below an ulp of ``|s|``, which the dot's (another summation
    order) does not: the host forms the backward's ``LSE_i`` (and CLIP's ``LSEcol_j``) from ``m_i`` where the
    dot's ``l_it`` is within rounding of it (``triton_fused.TILE_TARGET_TOL``). Capturing the tile's target
    exponential instead (a second masked sum per tile) spilled 32-52 bytes in the sm_90 D = 768 tiles.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s = tl.load(SCALE).to(tl.float32)  # runtime scale: a learnable temperature never recompiles
    for rb0 in range(pid, n_row_blocks, nprog):
        rblk = rb0
        j_start = 0
        if TRI:
            t = rb0 // nprog
            rblk = t * nprog + tl.where(t % 2 == 0, pid, nprog - 1 - pid)
            j_start = (rblk * BLOCK_M) // BLOCK_N * BLOCK_N
        # 1. this program's anchor rows and their per-row data (inverse norms, bias column, label)
        rows = rblk * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < N
        rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
        bias_c = rows  # placeholder when there is no bias
        if HAS_BIAS:
            bias_c = tl.load(BIAS_COL + rows, mask=rmask, other=-1)
        lab_r = rows
        if POS_KIND == 1:
            lab_r = tl.load(ROW_LAB + rows, mask=rmask, other=0)
        m_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
        z_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        mp_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
        zp_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        tgt_r = rows
        if SPLIT_T:
            tgt_r = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int32)
        for j0 in range(j_start, M, BLOCK_N):
            # 2. column block: scaled raw tiles -> cosines (D streamed in chunks, fp32 accumulation)
            cols = j0 + tl.arange(0, BLOCK_N)
            cmask = cols < M
            rsb = _inv_norms(RSB, cols, cmask, NORMALIZE)
            cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                            BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
            # 3. scale, bias, self / padding masks
            l = _logits(cos, s, rows, cols, N, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS, BIAS_COS)
            if TRI:  # rows take j >= i (the diagonal as _logits left it), columns strictly i < j (below)
                l = tl.where(cols[None, :] >= rows[:, None], l, NEG_INF)
            # 4. online row max / sum (SPLIT_T: the target's logit kept apart, out of the row's sum)
            if SPLIT_T:  # the running max may be the target's (a shift only); the sum leaves it out
                m_i, z_i = _online_rows_split(m_i, z_i, l, cols[None, :] == tgt_r[:, None])
            else:
                m_i, z_i = _online_rows(m_i, z_i, l)
            # 5. the same over positives only (SupCon L_in)
            if POS_KIND != 0:
                lab_c = cols
                if POS_KIND == 1:
                    lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
                lp = _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                                 POS_KIND, False)
                mp_i, zp_i = _online_rows(mp_i, zp_i, lp)
            # 6. column statistics of this tile, merged into this program's partial row
            if WANT_COL or TRI:
                l_col = l
                if TRI and not EXCLUDE_SELF:  # the kept diagonal counts once, in its row (one tile live)
                    l_col = tl.where(cols[None, :] > rows[:, None], l, NEG_INF)
                if TRI and SPLIT_T:  # column j's row: its target entry (TGT[j], j) kept apart likewise
                    tgt_c = tl.load(TGT + cols, mask=cmask, other=-1).to(tl.int32)
                    hit_c = rows[:, None] == tgt_c[None, :]
                elif SPLIT_T:  # WANT_COL: column j's target entry (j, j) where row j's target is j (CLIP's pairs)
                    hit_c = (rows[:, None] == cols[None, :]) & (tgt_r == rows)[:, None]
                cmax = tl.max(l_col, axis=0)
                cms = tl.where(cmax == NEG_INF, 0.0, cmax)
                e_col = tl.exp(l_col - cms[None, :])
                if SPLIT_T:
                    e_col = tl.where(hit_c, 0.0, e_col)
                tile_lse = cms + _log0(tl.sum(e_col, axis=0))
                cp = COL_PART + pid.to(tl.int64) * M + cols
                # the first row block of this program starts from -inf (no memset needed; TRI: the
                # launcher's -inf fill, as a program's rows do not reach every column)
                keep = tl.full([BLOCK_N], rblk, tl.int32) > pid
                if TRI:
                    keep = tl.full([BLOCK_N], 1, tl.int32) > 0
                old = tl.load(cp, mask=cmask & keep, other=NEG_INF)
                tl.store(cp, _lse_add(old, tile_lse), mask=cmask)
                tl.debug_barrier()  # this row of COL_PART is re-read by other threads next time
        # 7. LSE = m + log z (-inf for a row whose columns are all excluded)
        tl.store(LSE + rows, m_i + _log0(z_i), mask=rmask)
        if SPLIT_T:  # 8. the target's logit: the row's dot with its target row, fp32, as _cos_tile / _logits
            tmask = rmask & (tgt_r >= 0) & (tgt_r < M)
            a_base = SA + rows.to(tl.int64)[:, None] * stride_sa
            b_base = SB + tgt_r.to(tl.int64)[:, None] * stride_sb
            dot_t = tl.zeros([BLOCK_M], dtype=tl.float32)
            for d0 in range(0, D, 16):  # (narrow chunks: no registers beyond the loop's)
                dd = d0 + tl.arange(0, 16)
                dmask = (dd < D)[None, :]
                xa = tl.load(a_base + dd[None, :], mask=tmask[:, None] & dmask, other=0.0).to(tl.float32)
                xb = tl.load(b_base + dd[None, :], mask=tmask[:, None] & dmask, other=0.0).to(tl.float32)
                dot_t += tl.sum(xa * xb, axis=1)
            l_t = dot_t * rsa * _inv_norms(RSB, tgt_r, tmask, NORMALIZE) * s
            if HAS_BIAS:
                if BIAS_COS:
                    l_t = tl.where(tgt_r == bias_c, l_t + bias * s, l_t)
                else:
                    l_t = tl.where(tgt_r == bias_c, l_t + bias, l_t)
            if EXCLUDE_SELF:
                l_t = tl.where(tgt_r == rows + offset, NEG_INF, l_t)
            tl.store(LT + rows, tl.where(tmask, l_t, NEG_INF), mask=rmask)
            if not TRI:  # 9. the row's max over the tile's logits, the target's among them
                tl.store(LT + N + rows, m_i, mask=rmask)
        if POS_KIND != 0:
            tl.store(LSE_POS + rows, mp_i + _log0(zp_i), mask=rmask)


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------


@triton.jit
def lse_bwd_rows_kernel(
    A, SA, SB, RA, NA, RSA, RSB, SCALE, GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, G, LSE_COL, G_COL, LSE_POS, G_POS,
    DA, ACC, DS_PART, TGT, TV,
    N, M, D, stride_a, stride_sa, stride_sb, stride_da, offset, bias, n0, m0, stride_pm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr,
    POS_KIND: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, SYM: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DS: tl.constexpr, RESIDENT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr, SPLIT_T: tl.constexpr,
    SPLIT_SET: tl.constexpr, EXACT_T: tl.constexpr,
):
    """dA for one block of rows (grid: cdiv(N, BLOCK_M)), plus its share of dL/ds.

    For each column block J:
      1. recompute the cosine tile and the masked logits exactly as the forward does;
      2. dl = g_i p_ij + gc_j pc_ij + gp_i q_ij from the saved LSEs (divided by gscale);
      3. ds_i += sum_j dl_ij cos_ij (temperature gradient, per row);
      4. SYM (B is A): H = dl + dl^T from the same tile (see the module docstring), else H = dl;
      5. dA_I += H @ B_hat_J (registers, or this program's scratch rows when D is large).
    Epilogue: dA = s gscale dA, then the normalisation backward, stored in A's dtype.

    SPLIT_T: each row's target column ``TGT[i]`` is left out of dl (after step 3) and its fp32 value
    goes to ``TV[i]`` instead (with SYM, also column j's transposed term where ``TGT[j]`` is this row:
    row j reports it): the caller applies it in fp32 with the target term (``core.PiecesFn``), where it
    nearly cancels for a peaked softmax; rounded into the 16-bit H it would leave ``~2^-9`` of the
    target's row. EXACT_T (with SPLIT_T): ``TV`` holds, on entry, each row's log-sum-exp weight at its target
    column already combined with the target term's (over gscale, formed by the host from the split forward's
    statistics without the cancellation of ``p_t - 1``: ``triton_fused.exact_weights``); the tile takes it in
    place of step 2's value there, so the temperature gradient and ``TV`` (read once, then overwritten)
    carry it.

    SPLIT_SET (no softmax over positives: HAS_GPOS False): ``G_POS`` holds the SET term's upstream
    coefficients ``c.set_i g`` and step 2 subtracts ``c.set_i w_ij`` (over gscale) in fp32
    (:func:`_sub_set`; with SYM also ``c.set_j w_ji`` from the transposed term), before the temperature
    gradient and the 16-bit cast: the SET term's whole gradient is then this kernel's (and the column
    kernel's), and the caller leaves it out of ``core/linear_terms.py``'s.
    """
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    gs = tl.load(GSCALE)
    inv_gs = 1.0 / gs
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
    bias_c = rows
    if HAS_BIAS:
        bias_c = tl.load(BIAS_COL + rows, mask=rmask, other=-1)
    lab_r = rows
    if POS_KIND == 1:
        lab_r = tl.load(ROW_LAB + rows, mask=rmask, other=0)
    # per-row statistics of this block (and, for SYM, the column-role ones of the same rows)
    lse_r, g_r, lsep_r, gp_r, lsec_r, gc_r = _row_stats(LSE, G, LSE_POS, G_POS, LSE_COL, G_COL, rows, rmask, inv_gs,
                                                        HAS_G, HAS_GPOS, SYM and HAS_GCOL)

    if RESIDENT:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)  # unused: the accumulator is the ACC scratch
    ds_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    tv_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    tgt_r = rows
    wx_r = ds_acc
    if SPLIT_T:
        tgt_r = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int32)
        if EXACT_T:  # the host's combined weight at the target (read before this program overwrites TV)
            wx_r = tl.load(TV + rows, mask=rmask, other=0.0)
    gset_r = g_r
    if SPLIT_SET:
        gset_r = tl.load(G_POS + rows, mask=rmask, other=0.0) * inv_gs
    for j0 in range(0, M, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < M
        rsb = _inv_norms(RSB, cols, cmask, NORMALIZE)
        # 1. recompute the tile
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        l = _logits(cos, s, rows, cols, N, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS, BIAS_COS)
        lab_c = cols
        if POS_KIND == 1:
            lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
        lp = l
        if HAS_GPOS:
            lp = _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND, False)
        lsec_c = lse_r  # placeholders when the column term is absent
        gc_c = g_r
        if HAS_GCOL:
            lsec_c = _stat(LSE_COL, cols, cmask)
            gc_c = _grad_vec(G_COL, LSE_COL, cols, cmask, inv_gs, False)
        # 2. dl of this tile (SPLIT_SET: the SET term's -c.set_i w_ij too, in fp32)
        dl = _dlogits(l, lp, lse_r, g_r, lsec_c, gc_c, lsep_r, gp_r, HAS_G, HAS_GCOL, HAS_GPOS)
        if SPLIT_T and EXACT_T:
            dl = tl.where(cols[None, :] == tgt_r[:, None], wx_r[:, None], dl)
        if SPLIT_SET:
            dl = _sub_set(dl, gset_r, rows, cols, N, M, offset, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND,
                          EXCLUDE_SELF, False)
        # 3. temperature gradient
        if NEED_DS:
            ds_acc += tl.sum(dl * cos, axis=1)
            if HAS_BIAS and BIAS_COS:  # dl/ds at the target is cos + bias (cos - margin)
                ds_acc += bias * tl.sum(tl.where(cols[None, :] == bias_c[:, None], dl, 0.0), axis=1)
        if SPLIT_T:
            hit = cols[None, :] == tgt_r[:, None]
            tv_acc += tl.sum(tl.where(hit, dl, 0.0), axis=1)
            dl = tl.where(hit, 0.0, dl)
        if NEED_DX:
            # 4. transposed term dl_jk (k = this block's rows) from the same symmetric tile
            if SYM:
                lse_c = _stat(LSE, cols, cmask)
                g_c = tl.zeros([BLOCK_N], dtype=tl.float32)
                if HAS_G:
                    g_c = _grad_vec(G, LSE, cols, cmask, inv_gs, False)
                lsep_c = lse_c
                gp_c = g_c
                lpt = l
                if HAS_GPOS:
                    lsep_c = _stat(LSE_POS, cols, cmask)
                    gp_c = _grad_vec(G_POS, LSE_POS, cols, cmask, inv_gs, True)
                    lpt = _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                                      POS_KIND, True)
                # dl^T_kj = g_j p_jk + gc_k pc_jk + gp_j q_jk: the column vectors play the row role
                dlt = tl.zeros_like(l)
                if HAS_G:
                    dlt += g_c[None, :] * tl.exp(l - lse_c[None, :])
                if HAS_GCOL:
                    dlt += gc_r[:, None] * tl.exp(l - lsec_r[:, None])
                if HAS_GPOS:
                    dlt += gp_c[None, :] * tl.exp(lpt - lsep_c[None, :])
                if SPLIT_SET:  # column j's SET term at this row: -c.set_j w_jk
                    gset_c = tl.load(G_POS + cols, mask=cmask, other=0.0) * inv_gs
                    dlt = _sub_set(dlt, gset_c, rows, cols, N, M, offset, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                                   POS_KIND, EXCLUDE_SELF, True)
                if SPLIT_T:  # column j's own target weight (at this row, its target) is reported by row j
                    tgt_c = tl.load(TGT + cols, mask=cmask, other=-1).to(tl.int32)
                    dlt = tl.where(tgt_c[None, :] == rows[:, None], 0.0, dlt)
                h = dl + dlt
            else:
                h = dl
            # 5. dA_I += H @ B_hat_J
            acc = _accumulate(acc, ACC, h, SB, stride_sb, rows, rsb, cols, N, M, D, j0,
                              BLOCK_D, RESIDENT, UPCAST, DOT_PREC, PRESCALE)
    if NEED_DS:
        tl.store(DS_PART + pid, tl.sum(ds_acc, axis=0))
    if SPLIT_T:
        tl.store(TV + rows, tv_acc, mask=rmask)
    if NEED_DX:
        _norm_bwd_epilogue(A, DA, ACC, NA, RA, rows, N, D, stride_a, stride_da, acc, s * gs / PRESCALE, eps,
                           BLOCK_M, BLOCK_D, NORMALIZE, RESIDENT)


@triton.jit
def lse_bwd_cols_kernel(
    B, SA, SB, RB, NB, RSA, RSB, SCALE, GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, G, LSE_COL, G_COL, LSE_POS, G_POS,
    DB, ACC, TGT,
    N, M, D, stride_b, stride_sa, stride_sb, stride_db, offset, bias, n0, m0, stride_pm, eps, grad_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr,
    POS_KIND: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr,
    RESIDENT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr,
    SPLIT_T: tl.constexpr, SPLIT_SET: tl.constexpr,
):
    """dB for one block of columns < grad_cols (grid: cdiv(grad_cols, BLOCK_N)).

    For each row block I: recompute the tile (same code as the forward), dl as in the row kernel,
    dB_J += dl^T @ A_hat_I. Epilogue: dB = s gscale dB, normalisation backward, stored in B's dtype
    (only rows j < grad_cols; the launcher zeroes the queue rows after them). SPLIT_T: each row's
    target column ``TGT[i]`` is left out of dl (as in the row kernel, which reports its value).
    SPLIT_SET: ``G_POS`` holds the SET coefficients and dl takes ``-c.set_i w_ij`` in fp32, as in the
    row kernel.
    """
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    gs = tl.load(GSCALE)
    inv_gs = 1.0 / gs
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < M
    rsb = _inv_norms(RSB, cols, cmask, NORMALIZE)
    lab_c = cols
    if POS_KIND == 1:
        lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
    lsec_c = tl.zeros([BLOCK_N], dtype=tl.float32)
    gc_c = lsec_c
    if HAS_GCOL:
        lsec_c = _stat(LSE_COL, cols, cmask)
        gc_c = _grad_vec(G_COL, LSE_COL, cols, cmask, inv_gs, False)

    if RESIDENT:
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)  # unused: the accumulator is the ACC scratch
    for i0 in range(0, N, BLOCK_M):
        rows = i0 + tl.arange(0, BLOCK_M)
        rmask = rows < N
        rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
        bias_c = rows
        if HAS_BIAS:
            bias_c = tl.load(BIAS_COL + rows, mask=rmask, other=-1)
        # 1. recompute the tile
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        l = _logits(cos, s, rows, cols, N, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS, BIAS_COS)
        # 2. the row statistics of this row block
        lse_r = _stat(LSE, rows, rmask)
        g_r = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_G:
            g_r = _grad_vec(G, LSE, rows, rmask, inv_gs, False)
        lsep_r = lse_r
        gp_r = g_r
        lp = l
        if HAS_GPOS:
            lsep_r = _stat(LSE_POS, rows, rmask)
            gp_r = _grad_vec(G_POS, LSE_POS, rows, rmask, inv_gs, True)
            lab_r = rows
            if POS_KIND == 1:
                lab_r = tl.load(ROW_LAB + rows, mask=rmask, other=0)
            lp = _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND, False)
        # 3. dl, then dB_J += dl^T @ A_hat_I
        dl = _dlogits(l, lp, lse_r, g_r, lsec_c, gc_c, lsep_r, gp_r, HAS_G, HAS_GCOL, HAS_GPOS)
        if SPLIT_SET:
            lab_rs = rows
            if POS_KIND == 1:
                lab_rs = tl.load(ROW_LAB + rows, mask=rmask, other=0)
            gset_r = tl.load(G_POS + rows, mask=rmask, other=0.0) * inv_gs
            dl = _sub_set(dl, gset_r, rows, cols, N, M, offset, lab_rs, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND,
                          EXCLUDE_SELF, False)
        if SPLIT_T:
            tgt_r = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int32)
            dl = tl.where(cols[None, :] == tgt_r[:, None], 0.0, dl)
        acc = _accumulate(acc, ACC, tl.trans(dl), SA, stride_sa, cols, rsa, rows, grad_cols, N, D, i0,
                          BLOCK_D, RESIDENT, UPCAST, DOT_PREC, PRESCALE)
    _norm_bwd_epilogue(B, DB, ACC, NB, RB, cols, grad_cols, D, stride_b, stride_db, acc, s * gs / PRESCALE, eps,
                       BLOCK_N, BLOCK_D, NORMALIZE, RESIDENT)
