"""Triton device code of the panel backward: the per-logit work of a panel of whole rows, in one pass.

The panel path (host code in ``fused_contrastive/core/lse/triton_panel.py``) hands every matmul to cuBLAS
and keeps only what cuBLAS cannot do in Triton. For a panel of rows ``[r0, r0 + P)`` (whole rows: all
M columns) the host computes the raw dot products with one GEMM,
``Lraw = (A_P diag(pw)) @ B^T`` (fp32 output; ``pw_i`` a power of two that puts the row's largest
magnitude in [1, 2), so the products cannot overflow - exact, as in the fused kernels' prologue), and
this kernel turns ``Lraw`` into the gradient tile ``DL`` in the operand dtype, which two more GEMMs
consume (``dA_P = DL @ B_op``, ``dB += DL^T @ A_hat_P``). Math (``spec.py``, ``lse.py``'s docstring):

    cos_ij = Lraw_ij rsp_i rb_j            rsp_i = r_i / pw_i (the scaled row's inverse norm)
    l_ij   = s cos_ij (+ bias at bias_col_i; -inf at the own column offset + i)
    dl_ij  = g_i p_ij + gc_j pc_ij + gp_i q_ij            (all / gscale, as the fused kernels)
    SYM:   h_ij = dl_ij + dl_ji (B is A: dl_ji from the same l_ij with the column's statistics)
    DL_ij  = h_ij * PRESCALE * (rb_j if FOLD_RB else 1)    cast to the operand dtype

* ``FOLD_RB`` (16-bit bf16 / fp32 operands with normalisation): the column's inverse norm is folded
  into DL so the dA GEMM reads the raw B (no normalised copy of B); the host divides dB's row j by
  ``rb_j`` again (multiplies by the norm). fp16 operands do not fold (``rb_j`` can push DL out of the
  fp16 range, e.g. ``1/eps`` of a zero row): the host passes a normalised fp16 copy of B instead.
* ``PRESCALE`` (fp16 operands: 2^13, else 1): softmax weights ``p ~ 1/M`` are subnormal in fp16
  (below 6.1e-5) for most entries at large M; scaling by 2^13 before the cast keeps them normal.
  ``|h| <= 3`` (``<= 6`` on the symmetric path) after the division by gscale, so
  ``6 * 2^13 = 49152 < 65504``: no overflow. The host divides the GEMM output by PRESCALE in fp32.
* ``EAGER`` (a summed loss without a column term): the panel spans whole rows, so each row's LSE (and
  LSEpos) is complete inside the panel. A first loop over the columns forms them (written to
  ``LSE_OUT`` / ``LSE_POS_OUT``), a second forms DL with ``g`` = the coefficients (the upstream
  gradient of a sum is a scalar, applied later): the forward's sweep produces the gradient.
* ``ONE_PASS`` (EAGER without positives' softmax, unit rows, bf16 / fp32 DL): one loop. Every logit is
  at most ``c = |s|`` (+ the bias when positive), so with the fixed shift ``m = c - 56``
  ``e_ij = exp(l_ij - m)`` is at most ``e^56`` and needs no running maximum: the loop stores
  ``DL_ij = e_ij`` (times rb_j when folding) while summing ``z_i = sum_j e_ij`` (and
  ``t_i = sum_j e_ij cos_ij`` for the temperature gradient); then ``LSE_i = m + log z_i`` (exact for
  any m: the shift cancels) and the row weight ``W_i = g_i / (gscale z_i)``: ``g_i p_ij = W_i e_ij``,
  and the host applies W to the GEMMs' P x D operands and outputs (O(P D) work instead of a second
  read of the fp32 panel). Precision: ``e_ij`` is rounded once to the operand dtype, as DL is otherwise.
  The shift: a per-row bound ``m_i`` works when ``l_ij - m_i <= K`` for every j keeps ``z_i`` finite,
  ``M e^K < 3.4e38`` (fp32 / bf16 largest), i.e. ``K <= 88.7 - ln M`` = 67 for M < 2^31. Only ``c``
  bounds the logits from above (a lower bound on the row's maximum, e.g. its target logit, does not),
  so ``m_i >= c - 67`` whatever else is known; and for the redo test below a larger per-row ``m_i``
  only helps where ``z_i >= 1`` anyway. Hence one ``m = c - 56`` (margin e^7): ``DL`` and ``z_i``
  cannot overflow (``z_i <= 2.4e35``), and the GEMMs' sums ``sum_j e_ij |x_j|`` of unit rows neither.
  When a row's ``z_i < 2^-64`` (every logit of the row below ``m - 44.4 = c - 100.4``, so its relevant
  ``e_ij`` may be subnormal or flushed; impossible for ``|s| + bias <= 50``: logits of unit rows are
  ``>= -|s|``; at ``|s| = 100`` only for a row whose every cosine is below -0.004), its block of rows is
  redone exactly by the two loops of EAGER (a runtime branch; W = 1 there). Without ONE_PASS, W_OUT is 1.

One program owns BLOCK_R rows of the panel and walks all M columns in BLOCK_C chunks (so EAGER can
finish a row's LSE before its DL), writing each element of DL once: deterministic, no atomics. The
temperature gradient ``sum_ij dl_ij cos_ij`` is summed per program into ``DS_PART`` (fixed order).

Bytes per panel (P rows, M columns, operand element size e): reads ``4 P M`` (two-pass EAGER: ``8 P M``,
two loops over Lraw) plus, with a dense positive mask, ``P M`` (uint8) or ``4 P M`` (float weights) per loop
(L2-resident when the mask is periodic), writes ``e P M``; O(P + M) of vectors. FLOPs per logit: a
few dozen, 1-6 exps (one per statistic with a gradient, doubled by SYM; ONE_PASS: 1). The GEMMs and
the workspace are accounted in ``triton_panel.py``'s docstring. ``panel_rows_kernel`` is the row-wise
epilogue of the GEMMs (the normalisation backward of dA or dB and the weighted dB operand).

``epi_gemm_kernel`` is the other form of the logits GEMM and this kernel together (16-bit operands): a
Triton GEMM whose tiles of ``X_P @ B^T`` stay in registers and go through the same per-logit code
(``_exp_chunk`` for the one pass, ``_dl_chunk`` for known statistics) as its epilogue, so only ``DL``
(2 bytes per logit) and per-tile partials are written; it also has a statistics-only mode (the forward
of a column term or per-row output, and the triangular sweep's). See its docstring and
``docs/panel-path.md``.
"""

import triton
import triton.language as tl

from .common import (
    NEG_INF,
    _dlogits,
    _dz,
    _dz_lean,
    _flipped,
    _grad_vec,
    _inv_norms,
    _log0,
    _logits,
    _norm_bwd_rows,
    _online_rows,
    _pos_logits,
    _row_stats,
    _softplus,
    _softplus_lean,
    _stat,
    _sub_set,
)


@triton.jit
def _panel_logits(L, loc, lmask, rows, cols, cmask, rsp, RB, s, n_end, M, stride_l, offset, bias_c, bias,
                  NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BIAS_COS: tl.constexpr):
    """(cos, l, rb) of one [BLOCK_R, BLOCK_C] chunk of the panel from the GEMM's raw products in L."""
    raw = tl.load(L + loc.to(tl.int64)[:, None] * stride_l + cols[None, :],
                  mask=lmask[:, None] & cmask[None, :], other=0.0)
    return _logits_of(raw, rows, cols, cmask, rsp, RB, s, n_end, M, offset, bias_c, bias, NORMALIZE, EXCLUDE_SELF,
                      HAS_BIAS, BIAS_COS)


@triton.jit
def _logits_of(raw, rows, cols, cmask, rsp, RB, s, n_end, M, offset, bias_c, bias,
               NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr):
    """(cos, l, rb) of a tile of raw products ``raw`` [R, C] (fp32; in registers: the epilogue GEMM's
    accumulator, or loaded from the panel): :func:`_logits_rb` with the columns' inverse norms loaded here."""
    return _logits_rb(raw, _inv_norms(RB, cols, cmask, NORMALIZE), rows, cols, rsp, s, n_end, M, offset, bias_c, bias,
                      EXCLUDE_SELF, HAS_BIAS, BIAS_COS)


@triton.jit
def _logits_rb(raw, rb, rows, cols, rsp, s, n_end, M, offset, bias_c, bias, EXCLUDE_SELF: tl.constexpr,
               HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr):
    """(cos, l, rb) of a tile of raw products ``raw`` [R, C] with the columns' inverse norms ``rb`` [C] given.
    BIAS_COS (the core op's target margin, bias = -margin at the bias column): the returned cosine is already
    shifted there, so that every ``dl * cos`` (the scale's gradient) takes ``c - margin``."""
    cos = raw * rsp[:, None] * rb[None, :]
    if BIAS_COS:
        cos = tl.where(cols[None, :] == bias_c[:, None], cos + bias, cos)
        l = _logits(cos, s, rows, cols, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, False, False)
    else:
        l = _logits(cos, s, rows, cols, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS, False)
    return cos, l, rb


@triton.jit
def _row_logit(raw, rows, c, rsp, rbt, s, n_end, M, offset, bias_c, bias, EXCLUDE_SELF: tl.constexpr,
               HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr):
    """``(l, cos)``: the logit of each row ``i`` at its own column ``c[i]`` and its cosine there ([R] vectors;
    ``raw`` the raw products there, ``rbt`` the column's inverse norm): :func:`_logits_rb`'s operations in the
    same order, so the same fp32 values as the tile's."""
    cm = (c >= 0) & (c < M)
    cos = raw * rsp * rbt
    if BIAS_COS:
        cos = tl.where(c == bias_c, cos + bias, cos)
    l = cos * s
    if HAS_BIAS and not BIAS_COS:
        l = tl.where(c == bias_c, l + bias, l)
    if EXCLUDE_SELF:
        l = tl.where(c == rows + offset, NEG_INF, l)
    return tl.where((rows < n_end) & cm, l, NEG_INF), cos


#: The one-pass sweep's fallback threshold: a row block is redone in two passes when a row's sum
#: z_i = sum_j exp(l_ij - m) is below 2^-64 (see ONE_PASS in the module docstring).
ONE_PASS_MIN_Z = tl.constexpr(5.421010862427522e-20)
#: The one-pass sweep's shift below the logits' bound: m = c - ONE_PASS_SHIFT (see ONE_PASS).
ONE_PASS_SHIFT = tl.constexpr(56.0)


@triton.jit
def _one_pass_shift(s, bias, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr):
    """The one-pass sweep's fixed shift ``m = c - ONE_PASS_SHIFT``, ``c`` >= every logit of a unit row:
    ``|s|``, plus the bias when positive (in cosine units with BIAS_COS: ``|s| (1 + max(bias, 0))``)."""
    c = tl.abs(s)
    if HAS_BIAS:
        if BIAS_COS:
            c = c + tl.abs(s) * tl.maximum(bias, 0.0)
        else:
            c = c + tl.maximum(bias, 0.0)
    return c - ONE_PASS_SHIFT


@triton.jit
def _exp_chunk(cos, l, rb, sh, cols, tgt_r, NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr, NEED_MAX: tl.constexpr,
               SPLIT_T: tl.constexpr, SPLIT_Z: tl.constexpr = False):
    """The one-pass per-logit epilogue (shared by the panel kernel and the epilogue GEMM): with the
    rows' shifts ``sh`` [R], ``e_ij = exp(l_ij - sh_i)``; returns ``(out, z, t, mx, tv)``: the tile to
    store (``e`` times ``rb_j`` when folding), the rows' partial sums ``z_i = sum_j e_ij`` and
    ``t_i = sum_j e_ij cos_ij`` (zeros without NEED_DS), (NEED_MAX) the rows' largest logit, and
    (SPLIT_T) ``e`` at each row's target column ``tgt_r`` if it is in the chunk (else 0), which is then
    left out of the tile (not out of t; out of z and t with SPLIT_Z: ``z`` is then ``zx_i``, every column but
    the target, the sum the saturated row's loss ``log1p(zx_i / e_it)`` is formed from, and the caller adds the
    target's share of ``t`` with its weight, :func:`_target_weight`)."""
    e = tl.exp(l - sh[:, None])
    if SPLIT_Z:
        ex, tv = _split_target(e, cols, tgt_r, SPLIT_T)
        z = tl.sum(ex, axis=1)
    else:
        z = tl.sum(e, axis=1)
    t = tl.zeros_like(z)
    if NEED_DS:
        if SPLIT_Z:
            t = tl.sum(ex * cos, axis=1)
        else:
            t = tl.sum(e * cos, axis=1)
    mx = z
    if NEED_MAX:
        mx = tl.max(l, axis=1)
    if SPLIT_Z:
        e = ex
    else:
        e, tv = _split_target(e, cols, tgt_r, SPLIT_T)
    out = e
    if FOLD_RB:
        out = out * rb[None, :]
    return out, z, t, mx, tv


@triton.jit
def _split_target(x, cols, tgt_r, SPLIT_T: tl.constexpr):
    """``(x without each row's target column, the rows' values there)`` (SPLIT_T; else ``(x, 0)``): the
    target's fp32 weight goes to the caller, which applies it with the core op's target term, where
    the two nearly cancel for a peaked softmax (``core.PiecesFn``); rounded into the 16-bit tile it
    would leave ``~2^-9`` of the target's row."""
    tv = tl.sum(tl.zeros_like(x), axis=1)
    if SPLIT_T:
        hit = cols[None, :] == tgt_r[:, None]
        tv = tl.sum(tl.where(hit, x, 0.0), axis=1)
        x = tl.where(hit, 0.0, x)
    return x, tv


@triton.jit
def _dl_chunk(cos, l, rb, rows, cols, cmask, lmask, n_end, M, lab_r, lse_r, g_r, lsec_r, gc_r, lsep_r, gp_r, inv_gs,
              RB, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, COL_LAB, POS_MASK, n0, m0, stride_pm, tgt_r, TGT,
              NORMALIZE: tl.constexpr, POS_KIND: tl.constexpr, HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr,
              HAS_GPOS: tl.constexpr, SYM: tl.constexpr, NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr,
              PRESCALE: tl.constexpr, TRI: tl.constexpr, SPLIT_T: tl.constexpr, EXCLUDE_SELF: tl.constexpr = False,
              offset=0, SPLIT_SET: tl.constexpr = False, pm_shift=0, WX=None, wx_r=None,
              EXACT_T: tl.constexpr = False):
    """The gradient tile of one chunk of logits from known statistics (the per-logit epilogue shared by
    the panel kernel's second loop and the epilogue GEMM): ``(out, ds, tv, tvc)`` with ``out`` the
    fp32 tile to cast and store (DL of the module docstring: pre-scaled, the inverse norms folded),
    ``ds`` [R] the rows' temperature-gradient sums ``sum_j dl_ij cos_ij`` (zeros without NEED_DS) and,
    with SPLIT_T, ``tv`` [R] ``dl`` at each row's target column ``tgt_r`` if it is in the chunk, left out
    of the tile (:func:`_split_target`); with SYM also the transposed term of column j at the row
    ``TGT[j]`` is left out (column j's own target weight), its value summed in ``tvc`` [C] where that row
    is in the block (the triangular sweep's caller reports the nonzero ones for the columns past the
    panel, whose rows have no row term here; zeros otherwise). SPLIT_SET (HAS_GPOS False): ``G_POS`` holds
    the SET term's coefficients and ``dl`` takes ``-c.set_i w_ij`` in fp32 before anything else reads it
    (with SYM also ``-c.set_j w_ji`` in the transposed term; :func:`_sub_set`, the own column ``offset + i``
    excluded with EXCLUDE_SELF; a dense mask indexed at ``rows + pm_shift``, ``cols + pm_shift``): the SET term's
    whole gradient is then this tile's. EXACT_T (with SPLIT_T): the log-sum-exp weight at each row's target entry is
    the host's, already combined with the target term's share (``wx_r`` [R], over gscale,
    ``triton_fused.exact_weights``,
    formed without the cancellation of ``p_t - 1``), in place of ``dl``'s own there (before the SET term, the
    temperature gradient and the split read it); with SYM also the transposed term of column j at the row ``TGT[j]``
    takes column j's, ``WX[j]``."""
    ds = tl.sum(tl.zeros_like(l), axis=1)
    lab_c = cols
    if POS_KIND == 1:
        lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
    lp = l
    if HAS_GPOS:
        lp = _pos_logits(l, rows, cols, n_end, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND,
                         False)
    lsec_c = lse_r  # placeholders when the column term is absent
    gc_c = g_r
    if HAS_GCOL:
        lsec_c = _stat(LSE_COL, cols, cmask)
        gc_c = _grad_vec(G_COL, LSE_COL, cols, cmask, inv_gs, False)
    dl = _dlogits(l, lp, lse_r, g_r, lsec_c, gc_c, lsep_r, gp_r, HAS_G, HAS_GCOL, HAS_GPOS)
    if SPLIT_T and EXACT_T:
        dl = tl.where(cols[None, :] == tgt_r[:, None], wx_r[:, None], dl)
    if SPLIT_SET:
        gset_r = tl.load(G_POS + rows, mask=lmask, other=0.0) * inv_gs
        dl = _sub_set(dl, gset_r, rows, cols, n_end, M, offset, lab_r, lab_c, POS_MASK, n0, m0, stride_pm, POS_KIND,
                      EXCLUDE_SELF, False, pm_shift)
    if NEED_DS:
        ds += tl.sum(dl * cos, axis=1)
    dl, tv = _split_target(dl, cols, tgt_r, SPLIT_T)
    tvc = tl.sum(tl.zeros_like(l), axis=0)
    if SYM:
        # dl_ji (j a column, i this panel's row) from the same symmetric logit: the column's
        # statistics play the row role (see lse.py, "Symmetric case")
        lse_c = _stat(LSE, cols, cmask)
        g_c = tl.zeros_like(lse_c)
        if HAS_G:
            g_c = _grad_vec(G, LSE, cols, cmask, inv_gs, False)
        dlt = tl.zeros_like(l)
        if HAS_G:
            dlt += g_c[None, :] * tl.exp(l - lse_c[None, :])
        if HAS_GCOL:
            dlt += gc_r[:, None] * tl.exp(l - lsec_r[:, None])
        if HAS_GPOS:
            lsep_c = _stat(LSE_POS, cols, cmask)
            gp_c = _grad_vec(G_POS, LSE_POS, cols, cmask, inv_gs, True)
            lpt = _pos_logits(l, rows, cols, n_end, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                              POS_KIND, True)
            dlt += gp_c[None, :] * tl.exp(lpt - lsep_c[None, :])
        if SPLIT_T and EXACT_T:  # column j's own target entry (j, TGT[j]) at this row: the host's weight of row j
            tgt_x = tl.load(TGT + cols, mask=cmask, other=-1).to(tl.int32)
            dlt = tl.where(tgt_x[None, :] == rows[:, None], tl.load(WX + cols, mask=cmask, other=0.0)[None, :], dlt)
        if SPLIT_SET:
            gset_c = tl.load(G_POS + cols, mask=cmask, other=0.0) * inv_gs
            dlt = _sub_set(dlt, gset_c, rows, cols, n_end, M, offset, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                           POS_KIND, EXCLUDE_SELF, True, pm_shift)
        if TRI and NEED_DS:
            # the triangular panel: dl_ji of the columns below the panel belongs to those rows
            # (in the diagonal block both orders are already in dl)
            ds += tl.sum(tl.where(cols[None, :] >= n_end, dlt * cos, 0.0), axis=1)
        if SPLIT_T:
            tgt_c = tl.load(TGT + cols, mask=cmask, other=-1).to(tl.int32)
            hitc = (tgt_c[None, :] == rows[:, None]) & lmask[:, None]
            tvc = tl.sum(tl.where(hitc, dlt, 0.0), axis=0)
            dlt = tl.where(hitc, 0.0, dlt)
        dl = dl + dlt
    # pre-scale (fp16), fold the column's inverse norm (TRI: the row's too); the caller casts
    out = dl * PRESCALE
    if FOLD_RB:
        out = out * rb[None, :]
        if TRI:
            out = out * _inv_norms(RB, rows, lmask, NORMALIZE)[:, None]
    return out, ds, tv, tvc


@triton.jit
def _two_pass(L, DL, dl_base, RB, G, LSE, LSE_COL, G_COL, LSE_POS, G_POS, LSE_OUT, LSE_POS_OUT, COL_LAB, POS_MASK,
              TGT, TV, loc, lmask, rows, n_end, rsp, s, inv_gs, bias_c, bias, lab_r, M, stride_l, offset, n0, m0,
              stride_pm, tgt_r,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr, POS_KIND: tl.constexpr, HAS_G: tl.constexpr,
              HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, SYM: tl.constexpr, EAGER: tl.constexpr,
              NEED_DS: tl.constexpr,
              FOLD_RB: tl.constexpr, PRESCALE: tl.constexpr, TRI: tl.constexpr, SPLIT_T: tl.constexpr,
              SPLIT_SET: tl.constexpr = False, pm_shift=0, WX=None, EXACT_T: tl.constexpr = False):
    """The exact sweep of a block of rows: the statistics (EAGER: a first loop; else the forward's),
    then DL chunk by chunk. Returns the block's per-row temperature-gradient sums and (SPLIT_T) the
    rows' ``dl`` at their target columns, left out of DL, and (EAGER) the rows' LSE it wrote to ``LSE_OUT``
    (else the known one, 0 for -inf)."""
    # 1. row statistics: from the forward, or (EAGER) from a first loop over this panel's full rows
    if EAGER:
        m_i = tl.full([BLOCK_R], NEG_INF, dtype=tl.float32)
        z_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        mp_i = tl.full([BLOCK_R], NEG_INF, dtype=tl.float32)
        zp_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j0 in range(0, M, BLOCK_C):
            cols = j0 + tl.arange(0, BLOCK_C)
            cmask = cols < M
            cos, l, rb = _panel_logits(L, loc, lmask, rows, cols, cmask, rsp, RB, s, n_end, M, stride_l,
                                       offset, bias_c, bias, NORMALIZE, EXCLUDE_SELF, HAS_BIAS, BIAS_COS)
            m_i, z_i = _online_rows(m_i, z_i, l)
            if HAS_GPOS:
                lab_c = cols
                if POS_KIND == 1:
                    lab_c = tl.load(COL_LAB + cols, mask=cmask, other=0)
                lp = _pos_logits(l, rows, cols, n_end, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                                 POS_KIND, False)
                mp_i, zp_i = _online_rows(mp_i, zp_i, lp)
        lse_full = m_i + _log0(z_i)
        tl.store(LSE_OUT + rows, lse_full, mask=lmask)
        lse_r = tl.where(lse_full == NEG_INF, 0.0, lse_full)
        g_r = tl.load(G + rows, mask=lmask, other=0.0) * inv_gs
        lsep_r = lse_r
        gp_r = g_r
        if HAS_GPOS:
            lsep_full = mp_i + _log0(zp_i)
            tl.store(LSE_POS_OUT + rows, lsep_full, mask=lmask)
            lsep_r = tl.where(lsep_full == NEG_INF, 0.0, lsep_full)
            # a row without positives carries no softmax over positives (its term is dropped)
            gp_r = tl.where(lsep_full == NEG_INF, 0.0, tl.load(G_POS + rows, mask=lmask, other=0.0) * inv_gs)
        lsec_r = lse_r  # (no column term in an eager sweep)
        gc_r = g_r
        lse_ret = lse_full
    else:
        lse_r, g_r, lsep_r, gp_r, lsec_r, gc_r = _row_stats(LSE, G, LSE_POS, G_POS, LSE_COL, G_COL, rows, lmask,
                                                            inv_gs, HAS_G, HAS_GPOS, SYM and HAS_GCOL)
        lse_ret = lse_r

    # 2. the gradient tile, chunk by chunk
    ds_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    tv_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    wx_r = tv_acc
    if EXACT_T:  # (the host's combined target weights, indexed as the rows)
        wx_r = tl.load(WX + rows, mask=lmask, other=0.0)
    for j0 in range(0, M, BLOCK_C):
        cols = j0 + tl.arange(0, BLOCK_C)
        cmask = cols < M
        cos, l, rb = _panel_logits(L, loc, lmask, rows, cols, cmask, rsp, RB, s, n_end, M, stride_l,
                                   offset, bias_c, bias, NORMALIZE, EXCLUDE_SELF, HAS_BIAS, BIAS_COS)
        dl_out, ds_c, tv_c, tvc = _dl_chunk(cos, l, rb, rows, cols, cmask, lmask, n_end, M, lab_r, lse_r, g_r,
                                                lsec_r, gc_r, lsep_r, gp_r, inv_gs, RB, LSE, G, LSE_COL, G_COL, LSE_POS,
                                                G_POS, COL_LAB, POS_MASK, n0, m0, stride_pm, tgt_r, TGT, NORMALIZE,
                                                POS_KIND, HAS_G, HAS_GCOL, HAS_GPOS, SYM, NEED_DS, FOLD_RB, PRESCALE,
                                                TRI, SPLIT_T, EXCLUDE_SELF, offset, SPLIT_SET, pm_shift, WX, wx_r,
                                                EXACT_T)
        if NEED_DS:
            ds_acc += ds_c
        tv_acc += tv_c
        if SPLIT_T and TRI:  # the columns past the panel: their own target weight, at this block's row
            tl.store(TV + cols, tvc, mask=cmask & (cols >= n_end) & (tvc != 0.0))
        tl.store(dl_base + cols[None, :], dl_out.to(DL.dtype.element_ty), mask=lmask[:, None] & cmask[None, :])
    return ds_acc, tv_acc, lse_ret


@triton.jit
def panel_dl_kernel(
    L, DL, W_OUT, RSP, RB, SCALE, GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK,
    LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, LSE_OUT, LSE_POS_OUT, DS_PART, TGT, TV, LOSS, FOLD, WX,
    M, r0, P, stride_l, stride_dl, offset, bias, n0, m0, stride_pm,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr,
    POS_KIND: tl.constexpr, HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, SYM: tl.constexpr,
    EAGER: tl.constexpr, ONE_PASS: tl.constexpr, NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr,
    PRESCALE: tl.constexpr, TRI: tl.constexpr, SPLIT_T: tl.constexpr, SPLIT_SET: tl.constexpr, pm_shift,
    EXACT_T: tl.constexpr,
):
    """DL (the gradient tile of panel rows [r0, r0 + P), operand dtype) and the row weights W_OUT [P]
    from the raw products L [P, M]: the true gradient tile is ``diag(W_OUT) DL`` (W_OUT = 1 except on
    the one-pass sweep).

    Grid: cdiv(P, BLOCK_R). Row vectors (LSE, G, labels, bias columns) are indexed by the global row
    r0 + i, RSP and W_OUT by the panel row i; column vectors by the column. With EAGER, G / G_POS are
    the coefficients and LSE_OUT / LSE_POS_OUT receive the rows' statistics. TRI (with SYM): a
    triangular panel in its own frame (r0 = 0, the host passes every vector from the panel's first
    row on, L holds the columns from that row on), see ``triton_panel.tri_backward``. SPLIT_T (as
    :func:`epi_gemm_kernel`'s, SYM and TRI included): each row's target column ``TGT[r0 + i]`` is left
    out of DL and its fp32 value (in DL's units before PRESCALE and the folded norm; the true weight is
    ``W_OUT[i] gscale TV[i]``) goes to ``TV[i]`` (:func:`_split_target`). ONE_PASS with SPLIT_T: the target's
    ``e_it`` is also kept out of the row's sum (``zx_i``, every other column; ``z_i = zx_i + e_it``) and of the
    temperature's (to which it returns with its weight), ``TV[i]`` is :func:`_target_weight` (``-zx_i``, the target
    term's share in it, where FOLD is 1), and
    ``LOSS[r0 + i]`` gets the row's loss less its target logit, ``log1p(zx_i / e_it)`` (``LSE_i - l_it`` without
    its cancellation in the saturated regime, :func:`_loss_less_target`) with ``FOLD[r0 + i] = 1``, or ``LSE_i``
    with ``FOLD = 0`` where that form is not taken (a tiny ``e_it``, a huge ratio, or a row block redone in two
    passes); LOSS / FOLD are not read otherwise. SPLIT_SET (not with ONE_PASS, whose
    ``e_ij`` tile is stored before the row's sum is known): ``G_POS`` holds the SET term's coefficients (with
    EAGER the coefficients, as G) and the tile takes ``-c.set_i w_ij`` in fp32 (:func:`_dl_chunk`; ``pm_shift``
    the dense mask's index shift, TRI's first row, else 0). EXACT_T (SPLIT_T, known statistics: not EAGER or
    ONE_PASS): ``WX`` [N] (indexed as the rows; TRI: in the frame) holds each row's combined target weight over
    gscale, which the tile takes at the target entry (:func:`_dl_chunk`), so ``TV`` reports it.
    """
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    gs = tl.load(GSCALE)
    inv_gs = 1.0 / gs
    loc = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    lmask = loc < P
    rows = r0 + loc
    n_end = r0 + P  # rows past the panel are padding (-inf logits)
    rsp = tl.load(RSP + loc, mask=lmask, other=0.0)
    bias_c = rows
    if HAS_BIAS:
        bias_c = tl.load(BIAS_COL + rows, mask=lmask, other=-1)
    lab_r = rows
    if POS_KIND == 1:
        lab_r = tl.load(ROW_LAB + rows, mask=lmask, other=0)
    dl_base = DL + loc.to(tl.int64)[:, None] * stride_dl
    tgt_r = rows
    if SPLIT_T:
        tgt_r = tl.load(TGT + rows, mask=lmask, other=-1).to(tl.int32)
    tv_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if ONE_PASS:
        # 0. one read of the panel: e_ij = exp(l_ij - m), m = c - ONE_PASS_SHIFT, with the fixed bound
        # c >= every logit of the row (|s| for unit rows, + the bias), stored as DL (times rb_j when
        # folding); the row's z_i = sum_j e_ij gives LSE_i = m + log z_i and the weight
        # W_i = g_i / (gscale z_i). Why the shift of 56 (module docstring, ONE_PASS): no overflow,
        # e_ij <= e^56 and z_i <= M e^56 < 2^31 e^56 = 4.5e33 < 3.4e38 (fp32 and bf16 range; DL_ij =
        # e_ij rb_j <= e^56 / eps = 2.1e36), and a redo only where every logit of the row is below c - 100.4
        c = _one_pass_shift(s, bias, HAS_BIAS, BIAS_COS)
        z_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        t_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        ct_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j0 in range(0, M, BLOCK_C):
            cols = j0 + tl.arange(0, BLOCK_C)
            cmask = cols < M
            cos, l, rb = _panel_logits(L, loc, lmask, rows, cols, cmask, rsp, RB, s, n_end, M, stride_l,
                                       offset, bias_c, bias, NORMALIZE, EXCLUDE_SELF, HAS_BIAS, BIAS_COS)
            # (SPLIT_T: z_c and t_c sum every column but the target, e_it apart in tv_c, its cosine in ct_acc)
            out, z_c, t_c, _, tv_c = _exp_chunk(cos, l, rb, c + tl.zeros([BLOCK_R], dtype=tl.float32), cols, tgt_r,
                                                NEED_DS, FOLD_RB, False, SPLIT_T, SPLIT_T)
            z_i += z_c
            t_i += t_c
            tv_acc += tv_c
            if SPLIT_T and NEED_DS:
                ct_acc += tl.sum(tl.where(cols[None, :] == tgt_r[:, None], cos, 0.0), axis=1)
            tl.store(dl_base + cols[None, :], out.to(DL.dtype.element_ty), mask=lmask[:, None] & cmask[None, :])
        zx_i = z_i
        if SPLIT_T:  # the row's whole sum: every other column and the target's e_it
            z_i = zx_i + tv_acc
        ok = (z_i >= ONE_PASS_MIN_Z) | (loc >= P)
        lse_i = c + _log0(z_i)  # c is the shifted bound m here
        tl.store(LSE_OUT + rows, lse_i, mask=lmask)
        z_safe = tl.where(ok & lmask, z_i, 1.0)
        w_r = tl.where(lmask, tl.load(G + rows, mask=lmask, other=0.0) * inv_gs / z_safe, 0.0)
        loss_r, fold_r = _loss_less_target(zx_i, tv_acc, lse_i)
        if SPLIT_T:  # the target's weight (combined with the target term's where the loss folds) and its t share
            tv_acc = _target_weight(zx_i, tv_acc, fold_r)
            t_i += tv_acc * ct_acc
        ds_acc = w_r * t_i
        # a row whose logits all sit far below the bound (possible only for |s| + bias > 50): its
        # small e_ij lost precision, so the block is redone exactly in two passes below
        redo = tl.min(ok.to(tl.int32), axis=0) == 0
        if redo:
            ds_acc, tv_acc, lse_rd = _two_pass(L, DL, dl_base, RB, G, LSE, LSE_COL, G_COL, LSE_POS, G_POS, LSE_OUT,
                                               LSE_POS_OUT, COL_LAB, POS_MASK, TGT, TV, loc, lmask, rows, n_end, rsp, s,
                                               inv_gs, bias_c, bias, lab_r, M, stride_l, offset, n0, m0, stride_pm,
                                               tgt_r, BLOCK_R, BLOCK_C, NORMALIZE, EXCLUDE_SELF, HAS_BIAS, BIAS_COS,
                                               POS_KIND, HAS_G, HAS_GCOL, HAS_GPOS, SYM, EAGER, NEED_DS, FOLD_RB,
                                               PRESCALE, False, SPLIT_T)
            w_r = tl.full([BLOCK_R], 1.0, tl.float32)
            loss_r = lse_rd  # (the two passes keep e_it in the row's sum: LSE_i - l_it as before)
            fold_r = tl.zeros_like(fold_r)
        tl.store(W_OUT + loc, w_r, mask=lmask)
        if SPLIT_T:
            tl.store(LOSS + rows, loss_r, mask=lmask)
            tl.store(FOLD + rows, fold_r, mask=lmask)
    else:
        tl.store(W_OUT + loc, tl.full([BLOCK_R], 1.0, tl.float32), mask=lmask)
        ds_acc, tv_acc, _ = _two_pass(L, DL, dl_base, RB, G, LSE, LSE_COL, G_COL, LSE_POS, G_POS, LSE_OUT, LSE_POS_OUT,
                                   COL_LAB, POS_MASK, TGT, TV, loc, lmask, rows, n_end, rsp, s, inv_gs, bias_c, bias,
                                   lab_r, M, stride_l, offset, n0, m0, stride_pm, tgt_r,
                                   BLOCK_R, BLOCK_C, NORMALIZE, EXCLUDE_SELF, HAS_BIAS, BIAS_COS, POS_KIND, HAS_G,
                                   HAS_GCOL, HAS_GPOS, SYM, EAGER, NEED_DS, FOLD_RB, PRESCALE, TRI, SPLIT_T, SPLIT_SET,
                                   pm_shift, WX, EXACT_T)
    if NEED_DS:
        tl.store(DS_PART + pid, tl.sum(ds_acc, axis=0))
    if SPLIT_T:  # (a target before the triangular frame, < 0 there, is reported by its own panel)
        tl.store(TV + loc, tv_acc, mask=lmask & (tgt_r >= 0))


@triton.jit
def panel_rows_kernel(G, X, RS, NRM, W, SCALE, GSCALE, OUT, XW, R, D, stride_g, stride_x, stride_o, stride_xw,
                      eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, NORMALIZE: tl.constexpr,
                      NEED_OUT: tl.constexpr, NEED_XW: tl.constexpr, PRESCALE: tl.constexpr):
    """The row-wise epilogue of a panel's GEMMs, R rows of D (one launch instead of a dozen ATen ops).

    With ``x_hat_i = X_i RS_i`` (X the operand rows: scaled by a power of two, RS the inverse that gives
    the normalised, or without normalisation the raw, row) and ``g_i = G_i W_i s gscale / PRESCALE``:

    * NEED_OUT: ``OUT_i`` = the normalisation backward of ``g_i``, ``(g_i - x_hat_i <g_i, x_hat_i>) /
      NRM_i`` (no projection for a clamped row, NRM_i <= eps; ``g_i`` itself without NORMALIZE), cast
      to OUT's dtype: dA of the panel rows from ``G = DL @ B`` (or dB from the accumulator);
    * NEED_XW: ``XW_i = x_hat_i W_i`` in XW's dtype: the dB GEMM's right operand.

    Grid: cdiv(R, BLOCK_R); each program makes two passes over D when it normalises (the projection,
    then the output) and writes every element once.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)[:, None]
    w = tl.load(W + rows, mask=rmask, other=0.0)
    rs = tl.load(RS + rows, mask=rmask, other=0.0)
    if NEED_OUT:
        gw = w * (tl.load(SCALE).to(tl.float32) * tl.load(GSCALE) / PRESCALE)
        nrm = tl.where(rmask, 1.0, 1.0)
        if NORMALIZE:
            nrm = tl.load(NRM + rows, mask=rmask, other=1.0)
        _norm_bwd_rows(G, stride_g, X, stride_x, OUT, stride_o, rows, rmask, gw, rs, 1.0 / nrm, nrm > eps, D,
                       BLOCK_D, NORMALIZE)
    if NEED_XW:
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            m2 = rmask[:, None] & (dd < D)[None, :]
            x = tl.load(X + r64 * stride_x + dd[None, :], mask=m2, other=0.0).to(tl.float32)
            tl.store(XW + r64 * stride_xw + dd[None, :], (x * (rs * w)[:, None]).to(XW.dtype.element_ty), mask=m2)


@triton.jit
def _row_partials(X, r64, rmask, n, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MAX: tl.constexpr):
    """Per row of a block of rows: the sum (MAX: the largest) of the ``n`` fp32 partials ``X[i, 0:n]``
    (row stride ``stride``), BLOCK_C at a time in a fixed order: the row kernels' merge of the epilogue
    GEMMs' per-column-tile partials (this module's ``epi_rows_kernel``, kernels/guided.py's
    ``guided_rows_kernel``).

    The first chunk starts the accumulator (a loaded value, not a constant): Triton 3.6's thread-locality
    pass rewrites a loop whose reduction accumulator starts at a constant and asserts when the loop's result
    has more than one use, as the callers' results do (it stopped the H200's compile of both kernels; newer
    Tritons drop the rewrite there instead). The sums and maxima are the same numbers."""
    cc = tl.arange(0, BLOCK_C)
    m2 = rmask[:, None] & (cc < n)[None, :]
    off = r64[:, None] * stride + cc[None, :]
    if MAX:
        acc = tl.max(tl.load(X + off, mask=m2, other=NEG_INF), axis=1)
    else:
        acc = tl.sum(tl.load(X + off, mask=m2, other=0.0), axis=1)
    for c0 in range(BLOCK_C, n, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        m2 = rmask[:, None] & (cc < n)[None, :]
        off = r64[:, None] * stride + cc[None, :]
        if MAX:
            acc = tl.maximum(acc, tl.max(tl.load(X + off, mask=m2, other=NEG_INF), axis=1))
        else:
            acc += tl.sum(tl.load(X + off, mask=m2, other=0.0), axis=1)
    return acc


@triton.jit
def _redo_flags(z, mx, SHIFT0, BAD, SH, rows, rmask):
    """The one pass's redo decision per row: ``BAD_i = z_i < 2^-64`` (int8) and the redo's shift ``SH_i``,
    the row's largest logit ``mx_i`` where BAD and finite, else the fixed shift ``SHIFT0[0]``."""
    bad = z < ONE_PASS_MIN_Z
    tl.store(BAD + rows, bad.to(tl.int8), mask=rmask)
    tl.store(SH + rows, tl.where(bad & (mx > NEG_INF), mx, tl.load(SHIFT0)), mask=rmask)


#: Below this target exponential (or with a ratio ``zx / e_t`` above ``1 / ONE_PASS_MIN_TE``) the one pass's row
#: loss is ``LSE_i`` and the target term subtracts ``l_it`` as before: ``log1p(zx / e_t)`` would lose precision
#: (``e_t`` subnormal) or overflow, and the loss is then large (``>= log(zx / e_t)``, no cancellation to avoid).
ONE_PASS_MIN_TE = tl.constexpr(1e-30)


@triton.jit
def _loss_less_target(zx, et, lse):
    """``(loss, fold)`` [R] of rows whose sums keep the target apart (``zx`` every column but the target, ``et`` the
    target's ``e_it``, the same shift; ``lse`` the rows' ``LSE_i``): the row's loss less its target logit,
    ``log1p(zx / et)`` (``LSE_i - l_it`` without its cancellation: a few ulps of the loss however close ``p_t`` is to
    1) with ``fold = 1.0``, or where ``et <= ONE_PASS_MIN_TE`` or the ratio exceeds ``1 / ONE_PASS_MIN_TE``,
    ``LSE_i`` with ``fold = 0.0`` (the target logit is then subtracted by the target term)."""
    big = et > ONE_PASS_MIN_TE
    x = zx / tl.where(big, et, 1.0)
    fold = big & (x <= 1.0 / ONE_PASS_MIN_TE)
    x = tl.where(fold, x, 0.0)
    # log1p(x) = log(u) x / (u - 1), u = 1 + x: a few ulps for any x >= 0 (x itself where u rounds to 1)
    u = 1.0 + x
    du = u - 1.0
    ratio = tl.where(du == 0.0, x, tl.log(u) * (x / tl.where(du == 0.0, 1.0, du)))
    return tl.where(fold, ratio, lse), fold.to(tl.float32)


@triton.jit
def _target_weight(zx, et, fold):
    """The one pass's target weight in the units of ``e`` (the row weight ``W_i gscale`` times it is the weight on
    ``l_it``): where the row's loss is ``log1p(zx_i / e_it)`` (``fold``, whose target term leaves its coefficient
    out: ``core.backward_parts``) the log-sum-exp weight ``e_it`` combined with the target term's ``-z_i``, i.e.
    ``-zx_i``, formed without the cancellation of ``p_t - 1`` (``e_it / z_i - 1`` keeps nothing in fp32 where
    ``1 - p_t`` is below its ulp); elsewhere ``e_it`` as before."""
    return tl.where(fold > 0.0, -zx, et)


@triton.jit
def epi_rows_kernel(ZP, MXP, TP, SHIFT0, BAD, SH, LSE_OUT, G, GSCALE, W_OUT, DSW, TV, TW, LOSS, FOLD, CT,
                    P, n_pn, r0, stride_zp,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FINISH: tl.constexpr, NEED_DS: tl.constexpr,
                    SPLIT_T: tl.constexpr):
    """The per-row bookkeeping of the epilogue GEMM's one pass (``core/triton_shared/panels.py`` ``_epi_panel``),
    one launch before and one after the redo instead of a dozen ATen ops per panel. Row i of the panel
    (global row ``r0 + i``): ``zx_i = sum_k ZP[i, k]`` over its ``n_pn`` column tiles' partials (with SPLIT_T
    every column but the target, whose ``e_it`` is ``TV_i``; else every column and ``e_it = 0``) and
    ``z_i = zx_i + e_it``:

    * FINISH off: ``BAD_i = z_i < 2^-64`` (int8) and the redo's shift ``SH_i``: the row's largest logit
      ``max_k MXP[i, k]`` where BAD (and finite), else the fixed shift ``SHIFT0[0]``;
    * FINISH on (after the redo rewrote the partials of the BAD rows): ``LSE_OUT[r0 + i] = SH_i + log z_i``,
      the row weight ``W_OUT_i = G[r0 + i] / (GSCALE z_i)`` (0 for ``z_i = 0``: a row without any column),
      with NEED_DS ``DSW_i = W_i sum_k TP[i, k]`` (the temperature gradient's part, summed by the host; with
      SPLIT_T plus ``w_t CT_i``, the target's cosine, which the partials leave out),
      with SPLIT_T the target logit's weight ``TW_i = w_t W_i GSCALE``, ``w_t`` :func:`_target_weight` (``-zx_i``,
      the target term's share in it, where FOLD is 1; ``e_it = TV_i`` elsewhere), the row's loss less its target logit
      ``LOSS_i = log1p(zx_i / e_it)`` (``LSE_i - l_it`` without its cancellation: a few ulps of the loss
      however close ``p_t`` is to 1) with ``FOLD_i = 1``, or where ``e_it <= ONE_PASS_MIN_TE`` or the ratio
      exceeds ``1 / ONE_PASS_MIN_TE``, ``LOSS_i = LSE_i`` with ``FOLD_i = 0`` (the target logit is then
      subtracted by the target term).
    Partials are summed in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < P
    r64 = rows.to(tl.int64)
    zx = _row_partials(ZP, r64, rmask, n_pn, stride_zp, BLOCK_R, BLOCK_C, False)
    et = tl.zeros([BLOCK_R], dtype=tl.float32)
    if SPLIT_T:
        et = tl.load(TV + rows, mask=rmask, other=0.0)
    z = zx + et
    if not FINISH:
        _redo_flags(z, _row_partials(MXP, r64, rmask, n_pn, stride_zp, BLOCK_R, BLOCK_C, True), SHIFT0, BAD, SH,
                    rows, rmask)
    else:
        gs = tl.load(GSCALE)
        lse = tl.load(SH + rows, mask=rmask, other=0.0) + tl.log(z)
        tl.store(LSE_OUT + r0 + rows, lse, mask=rmask)
        g = tl.load(G + r0 + rows, mask=rmask, other=0.0)
        w = tl.where(z > 0, g / (gs * z), 0.0)
        tl.store(W_OUT + rows, w, mask=rmask)
        wt = et
        if SPLIT_T:
            loss, fold = _loss_less_target(zx, et, lse)
            wt = _target_weight(zx, et, fold)
            tl.store(TW + rows, wt * w * gs, mask=rmask)
            tl.store(LOSS + rows, loss, mask=rmask)
            tl.store(FOLD + rows, fold, mask=rmask)
        if NEED_DS:
            t = _row_partials(TP, r64, rmask, n_pn, stride_zp, BLOCK_R, BLOCK_C, False)
            if SPLIT_T:  # the target's cosine with its weight (the partials leave it out)
                t += wt * tl.load(CT + rows, mask=rmask, other=0.0)
            tl.store(DSW + rows, w * t, mask=rmask)


@triton.jit
def stats_merge_kernel(MX, Z, OUT, n_out, n_part, stride_o, stride_p,
                       BLOCK_O: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """The merge of the epilogue GEMM's statistics partials (MODE 3; ``core/lse/triton_panel.py``
    ``stats_forward``), one launch per panel and direction instead of a dozen ATen ops: for each of
    ``n_out`` outputs ``o`` (a row of the panel, or a column), its ``n_part`` partials (the row's column
    tiles, or the column's row tiles) ``MX[o, k]`` (the largest logit) and ``Z[o, k]`` (the sum of
    ``exp(l - MX)``) at ``o * stride_o + k * stride_p`` give

        LSE_o = mu_o + log sum_k exp(MX[o, k] + log Z[o, k] - mu_o),   mu_o = max_k (MX[o, k] + log Z[o, k])

    (-inf when every partial is empty: ``Z = 0`` or ``MX = -inf``), stored to ``OUT[o]`` or, with ACC,
    merged into it: ``OUT[o] = logaddexp(OUT[o], LSE_o)`` (the columns' statistics over the panels). Two
    passes over the partials, BLOCK_P at a time in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    o = pid * BLOCK_O + tl.arange(0, BLOCK_O)
    omask = o < n_out
    base = o.to(tl.int64)[:, None] * stride_o
    mu = tl.full([BLOCK_O], NEG_INF, tl.float32)
    for k0 in range(0, n_part, BLOCK_P):
        k = k0 + tl.arange(0, BLOCK_P)
        m2 = omask[:, None] & (k < n_part)[None, :]
        off = base + k.to(tl.int64)[None, :] * stride_p
        v = tl.load(MX + off, mask=m2, other=NEG_INF) + tl.log(tl.load(Z + off, mask=m2, other=0.0))
        mu = tl.maximum(mu, tl.max(v, axis=1))
    sh = tl.where(mu == NEG_INF, 0.0, mu)
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for k0 in range(0, n_part, BLOCK_P):
        k = k0 + tl.arange(0, BLOCK_P)
        m2 = omask[:, None] & (k < n_part)[None, :]
        off = base + k.to(tl.int64)[None, :] * stride_p
        v = tl.load(MX + off, mask=m2, other=NEG_INF) + tl.log(tl.load(Z + off, mask=m2, other=0.0))
        acc += tl.sum(tl.exp(v - sh[:, None]), axis=1)
    lse = sh + tl.log(acc)  # acc = 0 (no partial): -inf
    if ACC:
        old = tl.load(OUT + o, mask=omask, other=NEG_INF)
        top = tl.maximum(old, lse)
        ts = tl.where(top == NEG_INF, 0.0, top)
        lse = ts + tl.log(tl.exp(old - ts) + tl.exp(lse - ts))
    tl.store(OUT + o, lse, mask=omask)


@triton.jit
def _tile_products(X, Y, loc, cols, P, M, D, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 tile ``X[loc] @ Y[cols]^T`` [BLOCK_M, BLOCK_N] of an epilogue GEMM (this module's and the
    guided blocks' in kernels/guided.py), accumulated in registers over D in BLOCK_K steps. Indices past
    the ends are wrapped (``loc % P``, ``cols % M``): whole 16-byte operand loads without masks, which the
    compiler pipelines; the caller masks its stores. EVEN_K: D is a multiple of BLOCK_K (no mask along D).
    UPCAST: fp32 dots of bf16 tiles (the interpreter's bf16 dot is wrong)."""
    xr = (loc % P).to(tl.int64)
    yr = (cols % M).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    xp = X + xr[:, None] * stride_x + kk[None, :]
    yp = Y + yr[None, :] * stride_y + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            x = tl.load(xp)
            y = tl.load(yp)
        else:
            x = tl.load(xp, mask=(k0 + kk)[None, :] < D, other=0.0)
            y = tl.load(yp, mask=(k0 + kk)[:, None] < D, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, y, acc)
        xp += BLOCK_K
        yp += BLOCK_K
    return acc


@triton.jit
def _tile_products_tma(X, Y, pid_m, pid_n, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr):
    """:func:`_tile_products` with X and Y given as tensor descriptors (block shapes [BLOCK_M, BLOCK_K] and
    [BLOCK_N, BLOCK_K], made by the host): the operand tiles are TMA copies on sm_90 (one instruction per
    tile, no address arithmetic in the threads). Rows and columns past the ends of the descriptors' shapes
    read as 0 (the hardware's bounds check), so no index is wrapped and no mask is needed along D."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        x = X.load([pid_m * BLOCK_M, k0])
        y = Y.load([pid_n * BLOCK_N, k0])
        if UPCAST:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, y.T, acc)
    return acc


@triton.jit
def _row_loads(SCALE, RSP, BIAS_COL, TGT, RB, loc, lmask, rows, M, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
               SPLIT_T: tl.constexpr):
    """The per-row loads of an epilogue tile that do not depend on its products: ``(s, rsp, bias_c, tgt, rbt)``, the
    scale, the rows' scale factors, bias columns (the rows themselves without HAS_BIAS), target columns and the
    target columns' inverse norms (SPLIT_T; else the rows and 0)."""
    s = tl.load(SCALE).to(tl.float32)
    rsp = tl.load(RSP + loc, mask=lmask, other=0.0)
    bias_c = rows
    if HAS_BIAS:
        bias_c = tl.load(BIAS_COL + rows, mask=lmask, other=-1)
    tgt = rows
    rbt = rsp * 0.0
    if SPLIT_T:
        tgt = tl.load(TGT + rows, mask=lmask, other=-1).to(tl.int32)
        rbt = _inv_norms(RB, tgt, (tgt >= 0) & (tgt < M), NORMALIZE)
    return s, rsp, bias_c, tgt, rbt


@triton.jit
def _epi_tile(pid, pid_m, pid_n, X, Y, DL, ZP, TP, MXP, CZ, CM, DS_PART, BAD, SHIFT, LBIAS, RSP, RB, SCALE, GSCALE,
              BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TV, CT,
              P, M, D, r0, stride_x, stride_y, stride_dl, stride_zp, offset, bias, n0, m0, stride_pm, bad,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              UPCAST: tl.constexpr, MODE: tl.constexpr, NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr, POS_KIND: tl.constexpr, HAS_G: tl.constexpr,
              HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, SYM: tl.constexpr, NEED_DS: tl.constexpr,
              FOLD_RB: tl.constexpr, PRESCALE: tl.constexpr, TRI: tl.constexpr, WANT_COL: tl.constexpr,
              SPLIT_T: tl.constexpr, TMA: tl.constexpr, LEAN: tl.constexpr, HOIST: tl.constexpr,
              SPLIT_SET: tl.constexpr = False, pm_shift=0, WX=None, EXACT_T: tl.constexpr = False):
    """One output tile of :func:`epi_gemm_kernel` (its docstring): the products, then the epilogue. HOIST (MODE 0 /
    1 / 2): the per-row loads (:func:`_row_loads`; MODE 0 also the rows' statistics and labels) and the columns'
    inverse norms are issued before the products' loop, once; else after it, as the epilogue reaches them.
    LEAN (MODE 4 / 5): SigLIP's lean per-logit math (:func:`_softplus_lean`, :func:`_dz_lean`). SPLIT_SET, pm_shift:
    the SET term's gradient formed in the tile (MODE 0; :func:`epi_gemm_kernel`)."""
    loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lmask = loc < P
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < M
    rows = r0 + loc
    n_end = r0 + P
    HOISTED: tl.constexpr = HOIST and MODE <= 2
    if HOISTED:
        s, rsp, bias_c, tgt_r, rbt = _row_loads(SCALE, RSP, BIAS_COL, TGT, RB, loc, lmask, rows, M, NORMALIZE,
                                                HAS_BIAS, SPLIT_T)
        rb_h = _inv_norms(RB, cols, cmask, NORMALIZE)
        if MODE == 2:
            sh_h = tl.load(SHIFT + loc, mask=lmask, other=0.0)
        if MODE == 0:
            inv_gs = 1.0 / tl.load(GSCALE)
            lab_r = rows
            if POS_KIND == 1:
                lab_r = tl.load(ROW_LAB + rows, mask=lmask, other=0)
            lse_r, g_r, lsep_r, gp_r, lsec_r, gc_r = _row_stats(LSE, G, LSE_POS, G_POS, LSE_COL, G_COL, rows, lmask,
                                                                inv_gs, HAS_G, HAS_GPOS, SYM and HAS_GCOL)
    if TMA:
        acc = _tile_products_tma(X, Y, pid_m, pid_n, D, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    else:
        acc = _tile_products(X, Y, loc, cols, P, M, D, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                             UPCAST)
    if SPLIT_T and (MODE == 1 or MODE == 2):
        # the one pass: each row's target logit l_t, e_t = exp(l_t - sh) and (NEED_DS) cos_t, from the raw product
        # read off the accumulator before the epilogue (a where over the e tile there spilled on sm_90), by the
        # tile's own fp32 operations (bitwise its values); the epilogue leaves the target out of the tile and the
        # partials, the tile holding it stores e_t to TV and adds e_t cos_t to its TP and l_t to its MXP
        if not HOISTED:
            s, rsp, bias_c, tgt_r, rbt = _row_loads(SCALE, RSP, BIAS_COL, TGT, RB, loc, lmask, rows, M, NORMALIZE,
                                                    HAS_BIAS, SPLIT_T)
        traw = tl.sum(tl.where(cols[None, :] == tgt_r[:, None], acc, 0.0), axis=1)
        if MODE == 1:
            sh0 = _one_pass_shift(s, bias, HAS_BIAS, BIAS_COS) + tl.zeros([BLOCK_M], dtype=tl.float32)
        elif HOISTED:
            sh0 = sh_h
        else:
            sh0 = tl.load(SHIFT + loc, mask=lmask, other=0.0)
        lt, ct = _row_logit(traw, rows, tgt_r, rsp, rbt, s, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS,
                            BIAS_COS)
        here0 = bad & (tgt_r >= pid_n * BLOCK_N) & (tgt_r < pid_n * BLOCK_N + BLOCK_N)
        et = tl.exp(lt - sh0)
        tl.store(TV + loc, et, mask=here0)

    # the per-logit epilogue, on the fp32 products in registers
    if not HOISTED:
        s = tl.load(SCALE).to(tl.float32)
        rsp = tl.load(RSP + loc, mask=lmask, other=0.0)
        bias_c = rows
        if HAS_BIAS:
            bias_c = tl.load(BIAS_COL + rows, mask=lmask, other=-1)
        rb_h = _inv_norms(RB, cols, cmask, NORMALIZE)
    cos, l, rb = _logits_rb(acc, rb_h, rows, cols, rsp, s, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS,
                            BIAS_COS)
    smask = bad[:, None] & cmask[None, :]
    dl_ptr = DL + loc.to(tl.int64)[:, None] * stride_dl + cols[None, :]
    if not HOISTED:
        tgt_r = rows
        if SPLIT_T:  # the rows whose target column is in this tile store its value (one tile per row)
            tgt_r = tl.load(TGT + rows, mask=lmask, other=-1).to(tl.int32)
    if MODE == 0:
        t_here = lmask
        if SPLIT_T:
            t_here = bad & (tgt_r >= pid_n * BLOCK_N) & (tgt_r < pid_n * BLOCK_N + BLOCK_N)
        if not HOISTED:
            inv_gs = 1.0 / tl.load(GSCALE)
            lab_r = rows
            if POS_KIND == 1:
                lab_r = tl.load(ROW_LAB + rows, mask=lmask, other=0)
            lse_r, g_r, lsep_r, gp_r, lsec_r, gc_r = _row_stats(LSE, G, LSE_POS, G_POS, LSE_COL, G_COL, rows, lmask,
                                                                inv_gs, HAS_G, HAS_GPOS, SYM and HAS_GCOL)
        wx_r = lse_r
        if SPLIT_T and EXACT_T:  # (the host's combined target weights, indexed as the rows)
            wx_r = tl.load(WX + rows, mask=lmask, other=0.0)
        out, ds, tv, tvc = _dl_chunk(cos, l, rb, rows, cols, cmask, lmask, n_end, M, lab_r, lse_r, g_r, lsec_r,
                                         gc_r, lsep_r, gp_r, inv_gs, RB, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS,
                                         COL_LAB, POS_MASK, n0, m0, stride_pm, tgt_r, TGT, NORMALIZE, POS_KIND, HAS_G,
                                         HAS_GCOL, HAS_GPOS, SYM, NEED_DS, FOLD_RB, PRESCALE, TRI, SPLIT_T,
                                         EXCLUDE_SELF, offset, SPLIT_SET, pm_shift, WX, wx_r, EXACT_T)
        tl.store(dl_ptr, out.to(DL.dtype.element_ty), mask=smask)
        if SPLIT_T:
            tl.store(TV + loc, tv, mask=t_here)
            if TRI:  # the columns past the panel: their own target weight, at this tile's row
                tl.store(TV + cols, tvc, mask=cmask & (cols >= n_end) & (tvc != 0.0))
        if NEED_DS:
            tl.store(DS_PART + pid, tl.sum(tl.where(lmask, ds, 0.0), axis=0))
    elif MODE == 4 or MODE == 5:
        # SigLIP (kernels/siglip.py's math; ``offset`` places row i's positive at column offset + i, the
        # logit bias is LBIAS[0]): the tile's per-row loss sums softplus(w) -> ZP (MODE 4 without HAS_G: the
        # forward; MODE 5: the one pass of a summed loss, with the gradient tile); with HAS_G the gradient
        # tile dz = g_i sign sigmoid(w) / gscale (pre-scaled, rb_j folded) -> DL and the per-row sums of
        # dz cos (the scale's gradient) -> TP and of dz (the bias's) -> MXP
        b = tl.load(LBIAS).to(tl.float32)
        w, valid, pos = _flipped(cos, s, b, rows, cols, n_end, M, offset)
        part = loc.to(tl.int64) * stride_zp + pid_n
        if MODE == 5 or not HAS_G:
            if LEAN:
                sp = _softplus_lean(w)
            else:
                sp = _softplus(w)
            tl.store(ZP + part, tl.sum(tl.where(valid, sp, 0.0), axis=1), mask=lmask)
        if HAS_G:
            g_r = tl.load(G + rows, mask=lmask, other=0.0) / tl.load(GSCALE)
            if LEAN:  # the same e = exp(-|w|) as the softplus above (one exp per logit)
                dz = _dz_lean(w, valid, pos, g_r)
            else:
                dz = _dz(cos, s, b, g_r, rows, cols, n_end, M, offset)
            if NEED_DS:
                tl.store(TP + part, tl.sum(dz * cos, axis=1), mask=lmask)
                tl.store(MXP + part, tl.sum(dz, axis=1), mask=lmask)
            out = dz * PRESCALE
            if FOLD_RB:
                out = out * rb[None, :]
            tl.store(dl_ptr, out.to(DL.dtype.element_ty), mask=smask)
    elif MODE == 3:
        # statistics only: the tile's row (and column) maxima and sums of exp(l - max), exact (no fixed
        # shift: no redo), merged by the host; nothing of size P x M is written. SPLIT_T: each row's target entry
        # (i, TGT[i]) is left out of its row's statistics, and with TRI (TGT[j], j) out of column j's (row j's
        # target entry, by symmetry), else (WANT_COL, CLIP) (j, j) out of column j's where TGT[j] == j, so the
        # merged statistics are LSEx over every other column
        lr = l
        if SPLIT_T:
            # the tile holding a row's target stores its logit as the tiles round it (TV): the backward's LSE is
            # formed from it, so its fp32 weight exp(l_t - LSE) against the target term's -1 sees no ulp of |s|
            # between this rounding and the dot's (the panel's rows, frame columns; a target before the frame is
            # not in this panel's tiles and keeps the dot's value)
            hit_t = cols[None, :] == tgt_r[:, None]
            lr = tl.where(hit_t, NEG_INF, l)
            t_in = lmask & (tgt_r >= pid_n * BLOCK_N) & (tgt_r < pid_n * BLOCK_N + BLOCK_N)
            tl.store(TV + loc, tl.sum(tl.where(hit_t, l, 0.0), axis=1), mask=t_in)
        rm = tl.max(lr, axis=1)
        rz = tl.sum(tl.exp(lr - tl.where(rm == NEG_INF, 0.0, rm)[:, None]), axis=1)
        part = loc.to(tl.int64) * stride_zp + pid_n
        tl.store(MXP + part, rm, mask=lmask)
        tl.store(ZP + part, rz, mask=lmask)
        if WANT_COL:
            lc = l
            if TRI:  # the triangular sweep's frame: only the columns past the panel (rows of later panels)
                lc = tl.where(cols[None, :] >= n_end, l, NEG_INF)
                if SPLIT_T:
                    tgt_c = tl.load(TGT + cols, mask=cmask, other=-1).to(tl.int32)
                    lc = tl.where(rows[:, None] == tgt_c[None, :], NEG_INF, lc)
            elif SPLIT_T:  # column j's target entry (j, j) where row j's target is j (CLIP's pairs), as lse_fwd's
                lc = tl.where((rows[:, None] == cols[None, :]) & (tgt_r[:, None] == cols[None, :]), NEG_INF, lc)
            cm = tl.max(lc, axis=0)
            cz = tl.sum(tl.exp(lc - tl.where(cm == NEG_INF, 0.0, cm)[None, :]), axis=0)
            cpart = pid_m.to(tl.int64) * M + cols
            tl.store(CM + cpart, cm, mask=cmask)
            tl.store(CZ + cpart, cz, mask=cmask)
    else:
        if MODE == 1:
            sh = _one_pass_shift(s, bias, HAS_BIAS, BIAS_COS) + tl.zeros([BLOCK_M], dtype=tl.float32)
        elif HOISTED:
            sh = sh_h
        else:
            sh = tl.load(SHIFT + loc, mask=lmask, other=0.0)
        if SPLIT_T:  # the target column leaves the tile and the partials (its e_t went to TV above)
            l = tl.where(cols[None, :] == tgt_r[:, None], NEG_INF, l)
        out, z, t, mx, _ = _exp_chunk(cos, l, rb, sh, cols, tgt_r, NEED_DS, FOLD_RB, MODE == 1, False)
        if SPLIT_T:  # the target's own terms, from the tile that holds it (its cosine to CT: epi_rows_kernel adds
            # its share of the temperature's sum with its weight, _target_weight)
            if NEED_DS:
                tl.store(CT + loc, ct, mask=here0)
            if MODE == 1:
                mx = tl.maximum(mx, tl.where(here0, lt, NEG_INF))
        tl.store(dl_ptr, out.to(DL.dtype.element_ty), mask=smask)
        part = loc.to(tl.int64) * stride_zp + pid_n
        tl.store(ZP + part, z, mask=bad)
        if NEED_DS:
            tl.store(TP + part, t, mask=bad)
        if MODE == 1:
            tl.store(MXP + part, mx, mask=bad)


@triton.jit
def _grouped_tile(t, P, n_pn, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``t`` of the epilogue GEMM as (row tile, column tile): groups of GROUP_M row tiles sweep the
    column tiles together, so Y's column tiles stay in L2 across a group."""
    n_pm = tl.cdiv(P, BLOCK_M)
    group = GROUP_M * n_pn
    first_m = (t // group) * GROUP_M
    size_m = tl.minimum(n_pm - first_m, GROUP_M)
    return first_m + (t % group) % size_m, (t % group) // size_m


@triton.jit
def epi_gemm_kernel(
    X, Y, DL, ZP, TP, MXP, CZ, CM, DS_PART, BAD, SHIFT, LBIAS, RSP, RB, SCALE, GSCALE, BIAS_COL, ROW_LAB, COL_LAB,
    POS_MASK,
    LSE, G, LSE_COL, G_COL, LSE_POS, G_POS, TGT, TV, WX, CT,
    P, M, D, r0, stride_x, stride_y, stride_dl, stride_zp, offset, bias, n0, m0, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, MODE: tl.constexpr,
    NORMALIZE: tl.constexpr, EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr,
    POS_KIND: tl.constexpr, HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr, SYM: tl.constexpr,
    NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr, PRESCALE: tl.constexpr, TRI: tl.constexpr,
    WANT_COL: tl.constexpr, SPLIT_T: tl.constexpr, PERSIST: tl.constexpr, TMA: tl.constexpr,
    LEAN: tl.constexpr,
    HOIST: tl.constexpr,
    SPLIT_SET: tl.constexpr, pm_shift,
    EXACT_T: tl.constexpr,
):
    """The epilogue GEMM: [BLOCK_M, BLOCK_N] tiles of the panel's raw products ``X @ Y^T`` (X the panel's
    rows [P, D] scaled by powers of two, Y the raw B [M, D]; fp32 accumulation in registers), turned
    into the gradient tile by the per-logit epilogue and stored in DL's dtype: the fp32 products never
    reach memory (the cuBLAS form writes and re-reads them, 8 bytes per logit).

    MODE 0 (known statistics: the recomputing backward): ``DL`` = :func:`_dl_chunk` of the tile (as the
    panel kernel's second loop), ``DS_PART[pid]`` the tile's temperature-gradient sum.
    MODE 1 (one pass: the eager sweep of a summed loss): ``DL = e_ij`` (times ``rb_j`` when folding)
    with the fixed shift ``m`` of :func:`_one_pass_shift` and, per row and column tile, the partial
    sums ``ZP[i, tile] = sum_j e_ij``, ``TP[i, tile] = sum_j e_ij cos_ij`` (NEED_DS) and the largest
    logit ``MXP[i, tile]``; the host sums the partials in a fixed order (``LSE_i = m + log z_i``, the
    row weight ``W_i = g_i / (gscale z_i)``).
    MODE 3 (the statistics forward of a column term or per-row output: no gradient tile): per row and
    column tile the rows' largest logit ``MXP[i, tile]`` and ``ZP[i, tile] = sum_j exp(l_ij - MXP)``, with
    WANT_COL also per row tile the columns' ``CM[tile, j]`` and ``CZ[tile, j]``: exact for any logits
    (two exps per logit), merged by the host into LSE_i and LSEcol_j. With TRI (B is A; the panel's frame:
    rows [r0, r0 + P) against rows [r0, N), r0 = 0 passed) the column statistics cover only the columns
    past the panel: the row LSE of a later row j gathers them (its logits against this panel's rows).
    SPLIT_T with TRI (TGT in the frame): each row's target entry ``(i, TGT[i])`` is left out of its row
    statistics and ``(TGT[j], j)`` out of column j's, so the merged statistics are ``LSEx_i`` over every column
    but the target (the host adds the target's logit back, ``triton_panel.stats_forward``).
    MODE 4 (SigLIP's sigmoid loss, ``kernels/siglip.py``'s math): per row and column tile the loss sum
    ``ZP`` or, with HAS_G (the upstream gradients in G), the gradient tile ``DL`` and the sums for the
    scale's (``TP``) and the bias's (``MXP``) gradients (NEED_DS); LBIAS[0] is the logit bias.
    MODE 5 (SigLIP's one pass, HAS_G: a summed loss, whose upstream gradient is one scalar known up to
    that factor in the forward): MODE 4's loss sums and its gradient tile from the same products.
    LEAN (MODE 4 / 5, from the switchboard's SIGLIP_EPILOGUE; False in the other modes): SigLIP's per-logit
    math in its lean form (``kernels/common.py`` ``_softplus_lean``, ``_dz_lean``: one exp, a degree-7 log1p
    polynomial, one approximate reciprocal per logit) instead of ``_softplus`` / ``_dz`` (libdevice log, IEEE
    divisions).
    MODE 2 (the redo of MODE 1's rows with ``z_i < 2^-64``: every logit of the row below
    ``c - 100.4``, see ONE_PASS in the module docstring): one program per row tile; a tile without a
    ``BAD`` row returns at once, the others walk every column tile and store ``e_ij = exp(l_ij - SHIFT_i)``
    (``SHIFT_i`` the row's largest logit: ``e <= 1``, ``z_i >= 1``, exact) and the partials, for
    the BAD rows only.
    SPLIT_T (MODE 0 / 1 / 2; MODE 3 above): each row's target column ``TGT[r0 + i]`` is left out of DL; its fp32 value,
    in DL's units before PRESCALE and the folded norm (``e_ij`` in MODE 1 / 2), goes to ``TV[i]`` from
    the one column tile that holds it (:func:`_split_target`). MODE 1 / 2 form ``e_it`` from the raw product
    read off the accumulator (:func:`_row_logit`: bitwise the tile's value) and leave the target out of the
    tile by a -inf logit there, so ``ZP`` and ``TP`` sum every other column (``zx_i``: ``epi_rows_kernel`` forms
    the row's loss as ``log1p(zx_i / e_it)``, without the cancellation of ``LSE_i - l_it``, and the target's weight
    and its share of the temperature's sum, :func:`_target_weight`), while the tile holding the target stores
    ``cos_it`` to ``CT[i]`` (NEED_DS) and adds ``l_it`` to its ``MXP``. With SYM, column
    j's transposed term at the row ``TGT[j]`` is left out too (row j reports it; with TRI, for the
    columns past the panel, this tile stores it in ``TV[j]``: TGT and TV then in the panel's frame, as
    the other vectors).
    SPLIT_SET (MODE 0 only): ``G_POS`` holds the SET term's coefficients and the tile takes
    ``-c.set_i w_ij`` in fp32 before its cast (:func:`_dl_chunk`); ``pm_shift`` shifts the dense mask's indices
    (the triangular frame's first row; 0 elsewhere). EXACT_T (MODE 0 with SPLIT_T): ``WX`` (indexed as the rows,
    ``r0 + i``; TRI: in the frame) holds each row's combined target weight over gscale, which the tile takes at
    the target entry (:func:`_dl_chunk`).

    Grid: MODE 0 / 1 / 3 / 4 / 5 ``cdiv(P, BLOCK_M) * cdiv(M, BLOCK_N)``, in groups of GROUP_M row tiles that sweep
    the columns together (Y's column tiles stay in L2 across a group); MODE 2 ``cdiv(P, BLOCK_M)``.
    Indices past the panel are wrapped for the operand loads (no masks: whole 16-byte loads, which the
    compiler pipelines) and masked at the stores. EVEN_K: D is a multiple of BLOCK_K (no mask along
    D). UPCAST: fp32 dots of bf16 tiles (the interpreter's bf16 dot is wrong).
    PERSIST (MODE 0 / 1 / 3 / 4 / 5): a persistent grid (the host launches about one program per resident
    CTA) whose programs take the tiles ``pid, pid + grid, ...`` in the grouped order above, one flattened
    loop, so the next tile's operand copies are in flight during this tile's epilogue. TMA (with
    PERSIST or without; MODE 2 never): X and Y are tensor descriptors of ``x`` [P, D] and ``y`` [M, D] with
    block shapes [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] (the host makes them; sm_90 and later), and
    the operand tiles are TMA copies (:func:`_tile_products_tma`). Every form accumulates each tile's
    products over D in the same BLOCK_K steps and applies the same epilogue to them.
    HOIST (MODE 0 / 1 / 2; ignored by the others): every load that does not depend on the products (the
    scale, the rows' RSP, bias columns and targets, the targets' and the columns' inverse norms, MODE 2's
    SHIFT, MODE 0's row statistics, upstream gradients and labels) is issued before the D loop, once,
    instead of after it where the epilogue reaches it (with SPLIT_T in MODE 1 / 2 a chain of dependent
    loads, some of them twice): the same values through the same operations, bitwise the same outputs.
    """
    pid = tl.program_id(0)
    n_pn = tl.cdiv(M, BLOCK_N)
    if MODE == 2:
        loc = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        bad = tl.load(BAD + loc, mask=loc < P, other=0) != 0
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            for pid_n in range(0, n_pn):
                _epi_tile(pid, pid, pid_n, X, Y, DL, ZP, TP, MXP, CZ, CM, DS_PART, BAD, SHIFT, LBIAS, RSP, RB, SCALE,
                          GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS,
                          TGT, TV, CT, P, M, D, r0, stride_x, stride_y, stride_dl, stride_zp, offset, bias, n0, m0,
                          stride_pm, bad, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, MODE, NORMALIZE, EXCLUDE_SELF,
                          HAS_BIAS, BIAS_COS, POS_KIND, HAS_G, HAS_GCOL, HAS_GPOS, SYM, NEED_DS, FOLD_RB, PRESCALE, TRI,
                          WANT_COL, SPLIT_T, TMA, LEAN, HOIST, SPLIT_SET, pm_shift, WX, EXACT_T)
    elif PERSIST:
        # one program per SM (or per resident CTA): the programs walk the tiles in steps of the grid, in the
        # same grouped order; flatten lets the software pipeline issue the next tile's operand copies while
        # this tile's epilogue runs (the fill is ~1/4 of a 12-step D loop at D = 768)
        n_t = tl.cdiv(P, BLOCK_M) * n_pn
        for t in tl.range(pid, n_t, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(t, P, n_pn, BLOCK_M, GROUP_M)
            loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            _epi_tile(t, pid_m, pid_n, X, Y, DL, ZP, TP, MXP, CZ, CM, DS_PART, BAD, SHIFT, LBIAS, RSP, RB, SCALE,
                      GSCALE, BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS,
                      TGT, TV, CT, P, M, D, r0, stride_x, stride_y, stride_dl, stride_zp, offset, bias, n0, m0,
                      stride_pm, loc < P, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, MODE, NORMALIZE, EXCLUDE_SELF,
                      HAS_BIAS, BIAS_COS, POS_KIND, HAS_G, HAS_GCOL, HAS_GPOS, SYM, NEED_DS, FOLD_RB, PRESCALE, TRI,
                      WANT_COL, SPLIT_T, TMA, LEAN, HOIST, SPLIT_SET, pm_shift, WX, EXACT_T)
    else:
        pid_m, pid_n = _grouped_tile(pid, P, n_pn, BLOCK_M, GROUP_M)
        loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        _epi_tile(pid, pid_m, pid_n, X, Y, DL, ZP, TP, MXP, CZ, CM, DS_PART, BAD, SHIFT, LBIAS, RSP, RB, SCALE, GSCALE,
                  BIAS_COL, ROW_LAB, COL_LAB, POS_MASK, LSE, G, LSE_COL, G_COL, LSE_POS, G_POS,
                  TGT, TV, CT, P, M, D, r0, stride_x, stride_y, stride_dl, stride_zp, offset, bias, n0, m0, stride_pm,
                  loc < P, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, MODE, NORMALIZE, EXCLUDE_SELF, HAS_BIAS,
                  BIAS_COS, POS_KIND, HAS_G, HAS_GCOL, HAS_GPOS, SYM, NEED_DS, FOLD_RB, PRESCALE, TRI, WANT_COL,
                  SPLIT_T, TMA, LEAN, HOIST, SPLIT_SET, pm_shift, WX, EXACT_T)
