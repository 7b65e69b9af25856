"""Triton device code of the core op's target term: ``TGT_i = s <a_i, b_{t_i}>`` (unit rows) and its
backward, O(N*D), one kernel per pass.

With ``a_i = A_i / max(||A_i||, eps)`` (``b_j`` likewise; the raw rows when NORMALIZE is off) and
``c_i = <a_i, b_{t_i}>``, the gradient of ``sum_i h_i c_i`` (``h_i`` the upstream gradient times the
term's coefficient and the scale, fp32, folded by the host) is, row by row::

    dA_i       = h_i (b_{t_i} - [||A_i|| > eps] c_i a_i) / max(||A_i||, eps)
    dB_{t_i}  += h_i (a_i - [||B_{t_i}|| > eps] c_i b_{t_i}) / max(||B_{t_i}||, eps)

(a clamped row's normalisation is the linear map ``x / eps``: no projection). The kernel writes
``dA_i`` and row i's contribution to ``dB_{t_i}`` (``DB[i]``); the host adds the latter into its rows
(``index_add_``: several rows may share a target). The whole term is two reads of A and of the gathered
target rows and two fp32 writes, where the PyTorch route materialised the unit rows of A and B, their
gradients and the normalisation backward (~20 passes over an N x D fp32 tensor).

The norms are one-pass scaled sums of squares (as ``lse.row_norm_kernel``: no overflow for any finite
row), the dot is taken on the same scaled rows. Launchers: ``fused_contrastive/core/triton_shared/target.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk(pa, pb, rmask, d0, D, BLOCK_D: tl.constexpr):
    """Columns ``[d0, d0 + BLOCK_D)`` of the rows (``pa``) and their target rows (``pb``) in fp32, with the
    column offsets and the mask."""
    dd = d0 + tl.arange(0, BLOCK_D)
    m2 = rmask[:, None] & (dd < D)[None, :]
    x = tl.load(pa + dd[None, :], mask=m2, other=0.0).to(tl.float32)
    y = tl.load(pb + dd[None, :], mask=m2, other=0.0).to(tl.float32)
    return x, y, dd, m2


@triton.jit
def target_rows_kernel(A, B, TGT, H, COS, DA, DB, N, D, stride_a, stride_b, stride_da, stride_db, eps,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, NORMALIZE: tl.constexpr, BWD: tl.constexpr,
                       ACC: tl.constexpr):
    """COS_i = c_i (fp32) for BLOCK_R rows per program; with BWD also DA_i and DB_i (module docstring;
    fp32, H the folded upstream gradients [N]; ACC: DA holds a gradient already, dA is added to it in
    place). ``TGT`` [N] the target rows of B (int64 or int32)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    t = tl.load(TGT + rows, mask=rmask, other=0).to(tl.int64)
    pa = A + rows.to(tl.int64)[:, None] * stride_a
    pb = B + t[:, None] * stride_b
    big_a = tl.zeros([BLOCK_R], dtype=tl.float32)
    big_b = tl.zeros([BLOCK_R], dtype=tl.float32)
    ssq_a = tl.zeros([BLOCK_R], dtype=tl.float32)
    ssq_b = tl.zeros([BLOCK_R], dtype=tl.float32)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        x, y, _, _ = _chunk(pa, pb, rmask, d0, D, BLOCK_D)
        if NORMALIZE:
            # running row maxima; the sums rescaled when a chunk raises them
            new_a = tl.maximum(big_a, tl.max(tl.abs(x), axis=1))
            new_b = tl.maximum(big_b, tl.max(tl.abs(y), axis=1))
            sa = tl.where(new_a > 0, new_a, 1.0)
            sb = tl.where(new_b > 0, new_b, 1.0)
            ra = big_a / sa
            rb = big_b / sb
            xs = x / sa[:, None]
            ys = y / sb[:, None]
            ssq_a = ssq_a * ra * ra + tl.sum(xs * xs, axis=1)
            ssq_b = ssq_b * rb * rb + tl.sum(ys * ys, axis=1)
            dot = dot * ra * rb + tl.sum(xs * ys, axis=1)
            big_a = new_a
            big_b = new_b
        else:
            dot += tl.sum(x * y, axis=1)
    if NORMALIZE:
        sa = tl.where(big_a > 0, big_a, 1.0)
        sb = tl.where(big_b > 0, big_b, 1.0)
        root_a = tl.sqrt(ssq_a)
        root_b = tl.sqrt(ssq_b)
        # ||A_i|| = big root; "not (norm > eps)" is the clamp (a NaN row stays NaN through its values)
        keep_a = big_a * root_a > eps
        keep_b = big_b * root_b > eps
        # the unit row is the scaled row (x / big) times fa: 1 / root, or big / eps when clamped
        fa = tl.where(keep_a, 1.0 / root_a, sa / eps)
        fb = tl.where(keep_b, 1.0 / root_b, sb / eps)
        cos = dot * fa * fb
    else:
        cos = dot
    tl.store(COS + rows, cos, mask=rmask)
    if BWD:
        h = tl.load(H + rows, mask=rmask, other=0.0)
        pda = DA + rows.to(tl.int64)[:, None] * stride_da
        pdb = DB + rows.to(tl.int64)[:, None] * stride_db
        if NORMALIZE:
            ca = tl.where(keep_a, cos, 0.0)
            cb = tl.where(keep_b, cos, 0.0)
            # h / max(||x||, eps) = h fa / big (no overflow of the norm itself)
            ha = h * fa / sa
            hb = h * fb / sb
        for d0 in range(0, D, BLOCK_D):
            x, y, dd, m2 = _chunk(pa, pb, rmask, d0, D, BLOCK_D)
            if NORMALIZE:
                xh = (x / sa[:, None]) * fa[:, None]
                yh = (y / sb[:, None]) * fb[:, None]
                ga = ha[:, None] * (yh - ca[:, None] * xh)
                gb = hb[:, None] * (xh - cb[:, None] * yh)
            else:
                ga = h[:, None] * y
                gb = h[:, None] * x
            if ACC:
                ga += tl.load(pda + dd[None, :], mask=m2, other=0.0)
            tl.store(pda + dd[None, :], ga, mask=m2)
            tl.store(pdb + dd[None, :], gb, mask=m2)
