"""Triton device code of CoSENT (host side: ``fused_contrastive/core/cosent/triton_cosent.py``).

    L = log(1 + sum_{(a, b): y_a > y_b} exp(x_b - x_a)),   x_i = scale * s_i

Two kernel pairs:

* ``pair_cos_fwd_kernel`` / ``pair_cos_bwd_kernel``: the paired cosines ``c_i = <u_i, v_i> / (|u_i| |v_i|)``
  (norms clamped at eps) in one pass over each row pair, and their backward
  ``du_i = (g_i v_i / |v_i| - u_i / |u_i| * g_i c_i) / |u_i|`` (the projection dropped for a clamped row),
  O(B*D). The norms are scaled sums of squares (each row divided by its max |entry| first), so rows of
  any finite size give the finite answer.
* ``cosent_scan_fwd_kernel`` / ``cosent_scan_bwd_kernel``: one program that walks the label-sorted
  scores block by block with carried values (the O(B log B) algorithm of ``core/cosent/torch_cosent.py``, whose
  docstring derives it). Forward: the exclusive prefix ``E_j = log sum_{k<j} exp(x_k)`` is an inclusive
  ``tl.associative_scan`` (log-add-exp combine on (max, sum) pairs) of the scores shifted by one, plus
  the carry of earlier blocks; the prefix over strictly smaller labels is ``E`` at the start of j's tie
  group, which (``E`` is non-decreasing) is the running maximum of ``E`` over group starts; then
  ``z_j = prefix_j - x_j`` and an online ``log(1 + sum exp z)``. Backward, blocks from the last: the
  suffix ``F_j = log sum_{k>j} exp(-x_k)`` read at the end of j's group (the running maximum over group
  ends, scanning right to left) gives ``dL/dx_j = exp(x_j - L + F_end) - exp(z_j - L)``, written back
  through the sort permutation. Ties add no term; B = 1 or all-equal labels give L = 0 and zero
  gradients exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _log0, _lse_add

NEG_INF = tl.constexpr(float("-inf"))


# ------------------------------------------------------------------------------------------------
# paired cosines
# ------------------------------------------------------------------------------------------------


@triton.jit
def _row_max_abs(X, rows, rmask, stride, D, BLOCK_D: tl.constexpr):
    base = X + rows.to(tl.int64)[:, None] * stride
    big = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(base + dd[None, :], mask=rmask[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
        big = tl.maximum(big, tl.max(tl.abs(x), axis=1))
    return tl.where(big > 0, big, 1.0)


@triton.jit
def pair_cos_fwd_kernel(U, V, C, NU, NV, B, D, stride_u, stride_v, eps,
                        NORMALIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """C_i = cos(U_i, V_i) (the raw dot product without NORMALIZE), NU_i / NV_i = the clamped norms
    (fp32). Rows are scaled by their max |entry| before the sums (exact in the ratio, no overflow)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    bu = tl.full([BLOCK_R], 1.0, tl.float32)
    bv = tl.full([BLOCK_R], 1.0, tl.float32)
    if NORMALIZE:
        bu = _row_max_abs(U, rows, rmask, stride_u, D, BLOCK_D)
        bv = _row_max_abs(V, rows, rmask, stride_v, D, BLOCK_D)
    su = tl.zeros([BLOCK_R], dtype=tl.float32)
    sv = tl.zeros([BLOCK_R], dtype=tl.float32)
    uv = tl.zeros([BLOCK_R], dtype=tl.float32)
    ub = U + rows.to(tl.int64)[:, None] * stride_u
    vb = V + rows.to(tl.int64)[:, None] * stride_v
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        u = tl.load(ub + dd[None, :], mask=m2, other=0.0).to(tl.float32) / bu[:, None]
        v = tl.load(vb + dd[None, :], mask=m2, other=0.0).to(tl.float32) / bv[:, None]
        su += tl.sum(u * u, axis=1)
        sv += tl.sum(v * v, axis=1)
        uv += tl.sum(u * v, axis=1)
    if NORMALIZE:
        ru = tl.sqrt(su)
        rv = tl.sqrt(sv)
        nu = bu * ru
        nv = bv * rv
        nu = tl.where(nu < eps, eps, nu)  # "x < eps ? eps : x": a NaN norm stays NaN
        nv = tl.where(nv < eps, eps, nv)
        # c = bu bv uv / (nu nv) = (uv / (ru rv)) (bu ru / nu) (bv rv / nv): every factor bounded
        cos = uv / tl.where(ru * rv > 0, ru * rv, 1.0) * ((bu * ru) / nu) * ((bv * rv) / nv)
        tl.store(NU + rows, nu, mask=rmask)
        tl.store(NV + rows, nv, mask=rmask)
    else:
        cos = uv
    tl.store(C + rows, cos, mask=rmask)


@triton.jit
def _pair_grad(X, Y, rows, rmask, stride_x, stride_y, GX, stride_gx, dc, cos, nx, ny, eps, D,
               NORMALIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """GX_i = (dc_i Y_i / ny_i - X_i / nx_i * proj_i) / nx_i, proj_i = dc_i c_i (0 for a clamped row);
    GX_i = dc_i Y_i without NORMALIZE."""
    xb = X + rows.to(tl.int64)[:, None] * stride_x
    yb = Y + rows.to(tl.int64)[:, None] * stride_y
    gb = GX + rows.to(tl.int64)[:, None] * stride_gx
    proj = tl.where(nx <= eps, 0.0, dc * cos)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        y = tl.load(yb + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        if NORMALIZE:
            x = tl.load(xb + dd[None, :], mask=m2, other=0.0).to(tl.float32)
            g = (dc[:, None] * (y / ny[:, None]) - (x / nx[:, None]) * proj[:, None]) / nx[:, None]
        else:
            g = dc[:, None] * y
        tl.store(gb + dd[None, :], g.to(GX.dtype.element_ty), mask=m2)


@triton.jit
def pair_cos_bwd_kernel(U, V, C, NU, NV, DX, S, GU, GV, B, D, stride_u, stride_v, stride_gu, stride_gv, eps,
                        NORMALIZE: tl.constexpr, NEED_U: tl.constexpr, NEED_V: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """GU, GV: the gradients of U and V (in their dtype) for the gradients DX (fp32) of the scaled
    cosines x = S c."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    dc = tl.load(DX + rows, mask=rmask, other=0.0) * tl.load(S)
    cos = tl.load(C + rows, mask=rmask, other=0.0)
    nu = tl.full([BLOCK_R], 1.0, tl.float32)
    nv = tl.full([BLOCK_R], 1.0, tl.float32)
    if NORMALIZE:
        nu = tl.load(NU + rows, mask=rmask, other=1.0)
        nv = tl.load(NV + rows, mask=rmask, other=1.0)
    if NEED_U:
        _pair_grad(U, V, rows, rmask, stride_u, stride_v, GU, stride_gu, dc, cos, nu, nv, eps, D,
                   NORMALIZE, BLOCK_D)
    if NEED_V:
        _pair_grad(V, U, rows, rmask, stride_v, stride_u, GV, stride_gv, dc, cos, nv, nu, eps, D,
                   NORMALIZE, BLOCK_D)


# ------------------------------------------------------------------------------------------------
# the sorted scan
# ------------------------------------------------------------------------------------------------


@triton.jit
def _lse_combine(m1, s1, m2, s2):
    """(max, sum of exp(. - max)) pairs: their log-add-exp, safe when both are empty (-inf, 0)."""
    m = tl.maximum(m1, m2)
    safe = tl.where(m == NEG_INF, 0.0, m)
    return m, s1 * tl.exp(m1 - safe) + s2 * tl.exp(m2 - safe)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _block_lse(x):
    m = tl.max(x, axis=0)
    safe = tl.where(m == NEG_INF, 0.0, m)
    return safe + _log0(tl.sum(tl.exp(x - safe), axis=0))


@triton.jit
def cosent_scan_fwd_kernel(X, ORDER, YS, S, Z, LOSS, B, BLOCK_B: tl.constexpr):
    """One program. The scaled scores in label order are ``x_j = S * X[ORDER_j]`` (X fp32 [B], ORDER the
    permutation of ``torch.sort`` of the labels, YS the sorted labels, ascending). Writes
    Z_j = log sum_{k: y_k < y_j} exp(x_k) - x_j (-inf without a smaller label) and LOSS = log(1 + sum exp Z)."""
    sc = tl.load(S)
    carry = tl.full([], NEG_INF, tl.float32)  # log sum exp of every score before the block
    best = tl.full([], NEG_INF, tl.float32)  # the largest prefix at a group start so far
    m_run = tl.full([], 0.0, tl.float32)  # online log(1 + sum exp z): the 1 is exp(0)
    s_run = tl.full([], 1.0, tl.float32)
    for b0 in range(0, B, BLOCK_B):
        k = b0 + tl.arange(0, BLOCK_B)
        mask = k < B
        y = tl.load(YS + k, mask=mask)
        live = mask & (y == y)  # a NaN label (sorted last) forms no pair: its score is absent
        x = sc * tl.load(X + tl.load(ORDER + k, mask=mask, other=0), mask=mask, other=0.0)
        x = tl.where(live, x, NEG_INF)
        yp = tl.load(YS + k - 1, mask=mask & (k >= 1))
        prev_in = mask & (k - 1 >= b0) & (yp == yp)
        xp = sc * tl.load(X + tl.load(ORDER + k - 1, mask=prev_in, other=0), mask=prev_in, other=0.0)
        xp = tl.where(prev_in, xp, NEG_INF)
        start = (k == 0) | (yp != y)
        pm, ps = tl.associative_scan((xp, tl.full([BLOCK_B], 1.0, tl.float32)), 0, _lse_combine)
        within = pm + _log0(ps)  # log sum_{b0 <= k' < k} exp(x_k')
        e = _lse_add(carry, within)
        q = tl.where(start & mask, e, NEG_INF)
        prefix = tl.maximum(best, tl.associative_scan(q, 0, _max2))
        z = tl.where(live, prefix - tl.where(live, x, 0.0), NEG_INF)  # no -inf - -inf on dead lanes
        tl.store(Z + k, z, mask=mask)
        bm = tl.maximum(m_run, tl.max(z, axis=0))
        s_run = s_run * tl.exp(m_run - bm) + tl.sum(tl.exp(z - bm), axis=0)
        m_run = bm
        carry = _lse_add(carry, _block_lse(x))
        best = tl.maximum(best, tl.max(q, axis=0))
    tl.store(LOSS, m_run + _log0(s_run))


@triton.jit
def cosent_scan_bwd_kernel(X, ORDER, YS, S, Z, LOSS, G, DX, B, BLOCK_B: tl.constexpr):
    """One program, blocks from the last. DX[ORDER_j] = G (exp(x_j - L + F_j) - exp(z_j - L)), the
    gradient with respect to x, with F_j = log sum_{k: y_k > y_j} exp(-x_k) (fp32)."""
    sc = tl.load(S)
    loss = tl.load(LOSS)
    g = tl.load(G)
    carry = tl.full([], NEG_INF, tl.float32)  # log sum exp(-x) of every score after the block
    best = tl.full([], NEG_INF, tl.float32)  # the largest suffix at a group end so far (to the right)
    nblocks = tl.cdiv(B, BLOCK_B)
    for i in range(nblocks):
        b0 = (nblocks - 1 - i) * BLOCK_B
        k = b0 + tl.arange(0, BLOCK_B)
        mask = k < B
        dst = tl.load(ORDER + k, mask=mask, other=0)
        x = sc * tl.load(X + dst, mask=mask, other=0.0)
        y = tl.load(YS + k, mask=mask)
        live = mask & (y == y)  # a NaN label forms no pair: no term, zero gradient
        yn = tl.load(YS + k + 1, mask=mask & (k + 1 < B))
        next_in = mask & (k + 1 < b0 + BLOCK_B) & (k + 1 < B) & (yn == yn)
        xn = sc * tl.load(X + tl.load(ORDER + k + 1, mask=next_in, other=0), mask=next_in, other=0.0)
        vn = tl.where(next_in, -xn, NEG_INF)
        end = (k == B - 1) | (yn != y)
        sm, ss = tl.associative_scan((vn, tl.full([BLOCK_B], 1.0, tl.float32)), 0, _lse_combine, reverse=True)
        f = _lse_add(carry, sm + _log0(ss))  # log sum_{k' > k} exp(-x_k')
        q = tl.where(end & mask, f, NEG_INF)
        suffix = tl.maximum(best, tl.associative_scan(q, 0, _max2, reverse=True))
        z = tl.load(Z + k, mask=mask, other=NEG_INF)
        d = tl.where(live, tl.exp(x - loss + suffix) - tl.exp(z - loss), 0.0)
        tl.store(DX + dst, d * g, mask=mask)
        carry = _lse_add(carry, _block_lse(tl.where(live, -x, NEG_INF)))
        best = tl.maximum(best, tl.max(q, axis=0))
