"""Triton device code of the one pass's third tile producer (``PANEL_GEMM=fp16pass``): one in-place pass over a
panel of cosines that cuBLAS wrote in fp16.

The one pass (``kernels/panel.py``, ONE_PASS; host ``core/lse/triton_panel.py`` ``sweep``) needs, per panel of
rows ``[r0, r0 + P)`` of a summed loss without a column term (bf16 operands, unit rows), the 16-bit tile
``DL_ij = e_ij rb_j`` with ``e_ij = exp(l_ij - m)``, ``m = c - 56`` the fixed shift below the logits' bound
``c = |s| (+ bias)``, and per row and column tile of ``BLOCK_N`` columns the partials ``ZP = sum_j e_ij``,
``TP = sum_j e_ij cos_ij`` and ``MXP = max_j l_ij``; the epilogue GEMM's MODE 1 writes them from its products
in registers. Here the host first writes ``cos = A_hat_P @ B_hat^T`` in fp16 (``torch.mm`` of normalised fp16
copies: ``|cos| <= 1`` cannot overflow; fp32 accumulation) into the panel's own buffer, and
:func:`logit_pass_kernel` turns each cosine into ``e_ij rb_j`` in **bf16 over the same two bytes** (bf16 has
fp32's exponent range: ``e <= e^56`` fits, exactly as MODE 1's tile) while writing the partials in MODE 1's
format. Everything after (``epi_rows_kernel``, the MODE 2 redo of rows with ``z_i < 2^-64`` from the exact
bf16 operands, the gradient GEMMs) is the existing one-pass code.

Precision: the logit comes from the fp16 cosine, ``|delta l| <= |s| 2^-11`` (the fp16 rounding of the
output, half an ulp of 2^-11 below 1, plus the normalised copies' rounding, ~2^-12 each), where MODE 1's
logit is exact in fp32; the tile itself is rounded to bf16 (2^-9) in both forms. The target column
(SPLIT_T) is the exception that matters for a saturated row (``z_i`` almost all ``e_it``): its logit is the
fp32 one (``CT``: the target term's own cosine, ``kernels/target.py``), used for ``TV``, ``z``, ``t`` and the
row maximum, not the rounded tile's.

Bytes per panel: reads ``2 P M`` (the fp16 cosines), writes ``2 P M`` (bf16, in place) plus three fp32
partials per ``BLOCK_N`` columns; one exp per logit.

:func:`siglip_pass_kernel` is the same form for SigLIP's sweeps (``SIGLIP_EPILOGUE=fp16pass``; host
``core/siglip/triton_fp16pass.py``): over a panel of fp16 cosines it writes, in place of the epilogue GEMM's MODE 4 / 5,
the per-row loss partials and the 16-bit gradient tile ``dz`` with its ``ds`` / ``db`` partials (the math of
``kernels/siglip.py``, by ``kernels/common.py``'s exact ``_softplus`` and ``_dz``), each positive pair's cosine
its fp32 one.
"""

import triton
import triton.language as tl

from .common import _dz, _flipped, _inv_norms, _logits, _softplus
from .panel import _one_pass_shift, _row_logit


@triton.jit
def logit_pass_kernel(T, DL, ZP, TP, MXP, TV, CT, CTO, RB, SCALE, BIAS_COL, TGT,
                      P, M, r0, stride_t, stride_zp, offset, bias,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr, NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr,
                      SPLIT_T: tl.constexpr):
    """One [BLOCK_R, BLOCK_N] tile of the panel per program (grid ``(cdiv(P, BLOCK_R), cdiv(M, BLOCK_N))``):
    reads the fp16 cosines ``T[i, j]`` and writes over them, in DL (the same memory as bf16), the one pass's
    ``e_ij = exp(l_ij - m)`` times ``rb_j`` with FOLD_RB (``RB`` B's inverse norms), ``m`` the fixed shift
    of ``kernels/panel.py`` ``_one_pass_shift``; ``l_ij = s cos_ij`` with the bias column (HAS_BIAS; BIAS_COS:
    the bias in cosine units, the core op's target margin) and the own column ``offset + r0 + i`` at
    ``-inf`` (EXCLUDE_SELF), as the epilogue GEMM's logits. Partials at ``ZP / TP / MXP[i * stride_zp +
    pid_n]`` (MODE 1's format: the row's sum of ``e``, with NEED_DS of ``e cos``, its largest logit).

    SPLIT_T: row i's target column ``TGT[r0 + i]`` takes its logit from ``CT[i]`` (the fp32 cosine of the
    row and its target row) by ``_row_logit``'s operations, so ``e_it``, ``TV[i] = e_it`` (written by the tile
    that holds the column), its cosine ``CTO[i]`` (NEED_DS; bias-shifted as the tile's) and its logit in MXP carry
    no fp16 rounding; as in MODE 1 the target is left out of the tile (its entry written 0), of ZP (``zx_i``:
    ``epi_rows_kernel`` adds ``e_it`` and forms the row's loss as ``log1p(zx_i / e_it)``) and of TP (which
    ``epi_rows_kernel`` completes with the target's weight times ``CTO[i]``). Each element is read and written by the
    same program, once: the in-place update has no race."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    loc = pid_m * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lmask = loc < P
    cmask = cols < M
    m2 = lmask[:, None] & cmask[None, :]
    off = loc.to(tl.int64)[:, None] * stride_t + cols[None, :]
    cos = tl.load(T + off, mask=m2, other=0.0).to(tl.float32)
    s = tl.load(SCALE).to(tl.float32)
    rows = r0 + loc
    n_end = r0 + P
    bias_c = rows
    if HAS_BIAS:
        bias_c = tl.load(BIAS_COL + rows, mask=lmask, other=-1)
    if BIAS_COS:  # the cosine that the scale's gradient takes is shifted at the bias column (as _logits_of)
        cos = tl.where(cols[None, :] == bias_c[:, None], cos + bias, cos)
        l = _logits(cos, s, rows, cols, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, False, False)
    else:
        l = _logits(cos, s, rows, cols, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS, False)
    sh = _one_pass_shift(s, bias, HAS_BIAS, BIAS_COS)
    e = tl.exp(l - sh)
    e_tile = e  # what the tile and the row sum take
    if SPLIT_T:
        # the target column from its fp32 logit: in the sums and the maximum, and as TV
        tgt = tl.load(TGT + rows, mask=lmask, other=-1).to(tl.int32)
        ct = tl.load(CT + loc, mask=lmask, other=0.0)
        one = tl.where(lmask, 1.0, 0.0)  # CT is a cosine already: no row factor, no column norm
        lt, ctb = _row_logit(ct, rows, tgt, one, one, s, n_end, M, offset, bias_c, bias, EXCLUDE_SELF, HAS_BIAS,
                             BIAS_COS)
        et = tl.exp(lt - sh)
        hit = cols[None, :] == tgt[:, None]
        e_tile = tl.where(hit, 0.0, e)  # the target out of the tile and of the row sum (MODE 1's zx)
        e = tl.where(hit, et[:, None], e)
        l = tl.where(hit, lt[:, None], l)
        if NEED_DS:  # (ctb: shifted by the bias at a bias column under BIAS_COS, as the tile's cos)
            cos = tl.where(hit, ctb[:, None], cos)
        here = lmask & (tgt >= pid_n * BLOCK_N) & (tgt < pid_n * BLOCK_N + BLOCK_N)
        tl.store(TV + loc, et, mask=here)
        if NEED_DS:  # the target's cosine apart: epi_rows_kernel adds it to the temperature's sum with its weight
            tl.store(CTO + loc, ctb, mask=here)
    out = e_tile
    if FOLD_RB:
        out = e_tile * _inv_norms(RB, cols, cmask, True)[None, :]
    tl.store(DL + off, out.to(DL.dtype.element_ty), mask=m2)
    part = loc.to(tl.int64) * stride_zp + pid_n
    tl.store(ZP + part, tl.sum(e_tile, axis=1), mask=lmask)
    if NEED_DS:
        tl.store(TP + part, tl.sum(e_tile * cos, axis=1), mask=lmask)
    tl.store(MXP + part, tl.max(l, axis=1), mask=lmask)


@triton.jit
def siglip_pass_kernel(T, DL, ZP, TP, BP, CT, RB, SCALE, LBIAS, G, GSCALE,
                       P, M, r0, stride_t, stride_zp, offset,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, WANT_LOSS: tl.constexpr, HAS_G: tl.constexpr,
                       NEED_DS: tl.constexpr, FOLD_RB: tl.constexpr, PRESCALE: tl.constexpr):
    """SigLIP on one [BLOCK_R, BLOCK_N] tile of a panel of rows ``[r0, r0 + P)`` per program (grid
    ``(cdiv(P, BLOCK_R), cdiv(M, BLOCK_N))``), what the epilogue GEMM's MODE 4 / 5 write, from the fp16 cosines
    ``T[i, j]`` of the unit rows (cuBLAS's, ``kernels/siglip.py``'s math):

    * the positive pair's cosine (column ``offset + r0 + i``, where it lies in ``[0, M)``) is ``CT[i]``, its fp32
      cosine, not the rounded tile's entry (the host writes 0 for a row without a positive in range);
    * ``z = s cos + b`` (``SCALE[0]``, ``LBIAS[0]``), ``w = -z`` at the positive, ``z`` elsewhere;
    * WANT_LOSS: ``ZP[i * stride_zp + pid_n] = sum_j softplus(w_ij)`` over the tile's valid columns;
    * HAS_G: ``dz = g_i sign_ij sigmoid(w_ij) / GSCALE[0]`` (``G`` [N] per-row upstream gradients, indexed by the
      global row), written over the cosines in DL (the same bytes, DL's 16-bit dtype) times PRESCALE and, with
      FOLD_RB, B's inverse norm ``RB[j]`` (MODE 5's tile); NEED_DS: the row sums of ``dz cos`` to TP and of ``dz``
      to BP (MODE 5's ``TP`` / ``MXP``).

    Every element is read and written by the program that owns it, once: the in-place update has no race."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    loc = pid_m * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lmask = loc < P
    cmask = cols < M
    m2 = lmask[:, None] & cmask[None, :]
    off = loc.to(tl.int64)[:, None] * stride_t + cols[None, :]
    cos = tl.load(T + off, mask=m2, other=0.0).to(tl.float32)
    rows = r0 + loc
    n_end = r0 + P
    ct = tl.load(CT + loc, mask=lmask, other=0.0)
    cos = tl.where(cols[None, :] == rows[:, None] + offset, ct[:, None], cos)  # the positive's fp32 cosine
    s = tl.load(SCALE).to(tl.float32)
    b = tl.load(LBIAS).to(tl.float32)
    part = loc.to(tl.int64) * stride_zp + pid_n
    if WANT_LOSS:
        w, valid, _ = _flipped(cos, s, b, rows, cols, n_end, M, offset)
        tl.store(ZP + part, tl.sum(tl.where(valid, _softplus(w), 0.0), axis=1), mask=lmask)
    if HAS_G:
        g_r = tl.load(G + rows, mask=lmask, other=0.0) / tl.load(GSCALE)
        dz = _dz(cos, s, b, g_r, rows, cols, n_end, M, offset)
        if NEED_DS:
            tl.store(TP + part, tl.sum(dz * cos, axis=1), mask=lmask)
            tl.store(BP + part, tl.sum(dz, axis=1), mask=lmask)
        out = dz * PRESCALE
        if FOLD_RB:
            out = out * _inv_norms(RB, cols, cmask, True)[None, :]
        tl.store(DL + off, out.to(DL.dtype.element_ty), mask=m2)
