"""Pure-PyTorch backend of the core op: chunked, O(N*D) memory, runs on any device.

The N x M logits are never allocated. Rows are processed in chunks (a ``rows x M`` tile whose
size comes from :func:`tile_elements`), with an online log-sum-exp across chunks where a statistic
spans chunks (column LSE, symmetric blocks).

Work, in units of one N x M x D matmul (the naive autograd graph costs 3):

* weighted mode, A != B, no column LSE: each row chunk spans all M columns, so its LSE is final
  inside the chunk and the gradient is formed right away from the same tile ("eager" gradients,
  scaled by the scalar upstream gradient in backward): 1 (S) + 2 (dA, dB) = **3 units**, one exp
  per logit, no recompute.
* A is B (symmetric): only blocks (I, J) with I <= J are visited. Forward 1/2; backward recomputes
  the tile (1/2) and applies ``H = G_IJ + G_JI^T`` to both sides (1): **2 units**.
* vector mode (``reduction="none"``) or a column LSE (CLIP): a stats pass (1) and a recomputing
  gradient pass (3): 4 units.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._spec import CoreSpec, CoreTensors, compute_dtype, weighted_total

_NEG_INF = float("-inf")
_DEFAULT_TILE_ELEMENTS = 1 << 21  # 8 MiB of float32 per tile


def tile_elements() -> int:
    """Elements of one transient tile (env ``FUSED_CONTRASTIVE_TILE_ELEMENTS`` overrides)."""
    env = os.environ.get("FUSED_CONTRASTIVE_TILE_ELEMENTS")
    if env:
        return max(1, int(env))
    return _DEFAULT_TILE_ELEMENTS


def _row_chunk(n: int, m: int) -> int:
    return max(1, min(n, tile_elements() // max(m, 1)))


def _sym_block(n: int) -> int:
    c = math.isqrt(tile_elements())
    if c >= 128:
        c -= c % 64
    return max(1, min(n, c))


def _safe(lse: Tensor) -> Tensor:
    """LSE with -inf (a row whose columns are all excluded) replaced by 0, so exp(l - lse) = 0."""
    return torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse)


def _prep(x: Tensor, spec: CoreSpec, dtype: torch.dtype) -> Tuple[Tensor, Optional[Tensor]]:
    """Cast to the compute dtype and normalise rows. Returns (x_hat, clamped norms or None)."""
    xf = x.to(dtype)
    if not spec.normalize:
        return xf, None
    norm = torch.linalg.vector_norm(xf, dim=1).clamp_min(spec.eps)
    return xf / norm[:, None], norm


def _norm_bwd(d_hat: Tensor, x_hat: Tensor, norm: Optional[Tensor], eps: float) -> Tensor:
    """Backward of x -> x / max(||x||, eps): (g - x_hat <g, x_hat>) / ||x||, or g / eps if clamped.

    Works in place on ``d_hat`` (a buffer this module owns) to keep the peak memory at O(N*D) with
    a small constant.
    """
    if norm is None:
        return d_hat
    proj = torch.linalg.vecdot(d_hat, x_hat, dim=1)
    proj = torch.where(norm > eps, proj, torch.zeros_like(proj))
    d_hat.addcmul_(x_hat, proj[:, None], value=-1.0)
    return d_hat.div_(norm[:, None])


class _Tiles:
    """Builds masked logit tiles of the core op for a row range and a column range."""

    def __init__(self, a: Tensor, a_norm: Optional[Tensor], b: Tensor, s: Tensor, spec: CoreSpec,
                 t: CoreTensors, a_is_hat: bool):
        """``a``: anchors, already normalised (``a_is_hat``) or raw with clamped norms ``a_norm``
        (rows are then normalised one chunk at a time: no full normalised copy of A)."""
        self.a, self.a_norm, self.a_is_hat = a, a_norm, a_is_hat
        self.b, self.s, self.spec, self.t = b, s, spec, t
        self.m = b.shape[0]
        self.dtype = b.dtype

    def arows(self, r0: int, r1: int) -> Tensor:
        """Normalised anchor rows [r0, r1) in the compute dtype."""
        x = self.a[r0:r1]
        if self.a_is_hat:
            return x
        x = x.to(self.dtype)
        return x / self.a_norm[r0:r1, None] if self.a_norm is not None else x

    def logits(self, r0: int, r1: int, c0: int, c1: int) -> Tuple[Tensor, Tensor]:
        """(cosine tile, masked logit tile) for rows [r0, r1) and columns [c0, c1)."""
        spec, t = self.spec, self.t
        c = self.arows(r0, r1) @ self.b[c0:c1].T
        l = c * self.s
        if t.bias_col is not None:
            bc = t.bias_col[r0:r1] - c0
            inside = (bc >= 0) & (bc < c1 - c0)
            bias = torch.where(inside, torch.full_like(c[:, 0], spec.bias), torch.zeros_like(c[:, 0]))
            l.scatter_add_(1, bc.clamp(0, c1 - c0 - 1)[:, None], bias[:, None])
        if spec.exclude_self:
            # own column of row i is offset + i; the rows whose own column is in [c0, c1)
            lo = max(r0, c0 - spec.offset)
            hi = min(r1, c1 - spec.offset)
            if hi > lo:
                sub = l[lo - r0 : hi - r0, lo + spec.offset - c0 : hi + spec.offset - c0]
                sub.diagonal().fill_(_NEG_INF)
        return c, l

    def pos_logits(self, l: Tensor, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """Logits restricted to positives: l + log w (w = label equality or the dense mask)."""
        t = self.t
        if t.pos_mask is not None:
            n0, m0 = t.pos_mask.shape
            ri = torch.arange(r0, r1, device=l.device) % n0
            ci = torch.arange(c0, c1, device=l.device) % m0
            w = t.pos_mask[ri[:, None], ci[None, :]].to(l.dtype)
            return l + torch.log(w)
        eq = t.row_labels[r0:r1, None] == t.col_labels[None, c0:c1]
        return l.masked_fill(~eq, _NEG_INF)


def _lse_rows(x: Tensor) -> Tensor:
    return torch.logsumexp(x, dim=1)


def _softmax_grad(l: Tensor, lse: Tensor, g: Tensor, dim: int) -> Tensor:
    """g * exp(l - lse) along rows (dim=1: lse, g per row) or columns (dim=0: per column)."""
    if dim == 1:
        return torch.exp(l - _safe(lse)[:, None]).mul_(g[:, None])
    return torch.exp(l - _safe(lse)[None, :]).mul_(g[None, :])


def _stats_rows(tiles: _Tiles, n: int, spec: CoreSpec):
    """Forward stats pass, non-symmetric: row chunks spanning all columns."""
    m = tiles.m
    dev, dt = tiles.b.device, tiles.dtype
    lse = torch.empty(n, device=dev, dtype=dt)
    lse_pos = torch.empty(n, device=dev, dtype=dt) if spec.want_pos else None
    lse_col = torch.full((m,), _NEG_INF, device=dev, dtype=dt) if spec.want_col else None
    step = _row_chunk(n, m)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        _, l = tiles.logits(r0, r1, 0, m)
        lse[r0:r1] = _lse_rows(l)
        if lse_pos is not None:
            lse_pos[r0:r1] = _lse_rows(tiles.pos_logits(l, r0, r1, 0, m))
        if lse_col is not None:
            lse_col = torch.logaddexp(lse_col, torch.logsumexp(l, dim=0))
    return lse, lse_col, lse_pos


def _grads_rows(tiles, n, spec, lse, lse_col, lse_pos, g, g_col, g_pos, need_a, need_b, need_s,
                eager_w: Optional[Tuple[Tensor, Optional[Tensor]]] = None):
    """Gradient pass, non-symmetric: d l_ij = g_i p_ij + gc_j pc_ij + gp_i q_ij per row chunk.

    Returns ``da`` already through the normalisation backward (input space, one chunk at a time),
    ``db`` in normalised space (its rows collect contributions from every chunk), and ``ds``.
    With ``eager_w = (w_row, w_pos)`` the pass also produces LSE / LSEpos (each row chunk spans all
    columns, so its LSE is final) and uses the weights as the upstream gradient: one pass, 3 units.
    """
    m = tiles.m
    b, s = tiles.b, tiles.s
    dev, dt = b.device, tiles.dtype
    d = b.shape[1]
    gcols = m if spec.grad_cols is None else spec.grad_cols
    da = torch.empty(n, d, device=dev, dtype=dt) if need_a else None
    db = torch.zeros(gcols, d, device=dev, dtype=dt) if need_b else None
    ds = torch.zeros((), device=dev, dtype=dt)
    if eager_w is not None:
        g, g_pos = eager_w
        lse = torch.empty(n, device=dev, dtype=dt)
        lse_pos = torch.empty(n, device=dev, dtype=dt) if spec.want_pos else None
    step = _row_chunk(n, m)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        c, l = tiles.logits(r0, r1, 0, m)
        lp = tiles.pos_logits(l, r0, r1, 0, m) if spec.want_pos else None
        if eager_w is not None:
            lse[r0:r1] = _lse_rows(l)
            if lp is not None:
                lse_pos[r0:r1] = _lse_rows(lp)
        dl = None
        if g is not None:
            dl = _softmax_grad(l, lse[r0:r1], g[r0:r1], 1)
        if g_col is not None:
            part = _softmax_grad(l, lse_col, g_col, 0)
            dl = part if dl is None else dl.add_(part)
        if g_pos is not None and lp is not None:
            part = _softmax_grad(lp, lse_pos[r0:r1], g_pos[r0:r1], 1)
            dl = part if dl is None else dl.add_(part)
        del l, lp
        if dl is None:
            if need_a:
                da[r0:r1] = 0
            continue
        if need_s:
            ds += torch.vdot(dl.reshape(-1), c.reshape(-1))
        del c
        ar = tiles.arows(r0, r1) if (need_a or need_b) else None
        if need_a:
            dar = torch.matmul(dl, b).mul_(s)
            na = tiles.a_norm[r0:r1] if tiles.a_norm is not None else None
            da[r0:r1] = _norm_bwd(dar, ar, na, spec.eps)
        if need_b:
            db.addmm_(dl[:, :gcols].T, ar)
    if need_b:
        db.mul_(s)
        if gcols < m:
            db = torch.cat([db, torch.zeros(m - gcols, d, device=dev, dtype=dt)])
    if eager_w is not None:
        return da, db, ds, lse, lse_pos
    return da, db, ds


def _sym_pairs(n: int):
    step = _sym_block(n)
    starts = list(range(0, n, step))
    for bi, i0 in enumerate(starts):
        for j0 in starts[bi:]:
            yield i0, min(n, i0 + step), j0, min(n, j0 + step)


def _stats_sym(tiles: _Tiles, n: int, spec: CoreSpec):
    """Forward stats pass over blocks I <= J of the symmetric S = A_hat A_hat^T (1/2 unit)."""
    dev, dt = tiles.b.device, tiles.dtype
    lse = torch.full((n,), _NEG_INF, device=dev, dtype=dt)
    lse_pos = torch.full((n,), _NEG_INF, device=dev, dtype=dt) if spec.want_pos else None
    for i0, i1, j0, j1 in _sym_pairs(n):
        _, l = tiles.logits(i0, i1, j0, j1)
        lse[i0:i1] = torch.logaddexp(lse[i0:i1], _lse_rows(l))
        if lse_pos is not None:
            lse_pos[i0:i1] = torch.logaddexp(lse_pos[i0:i1], _lse_rows(tiles.pos_logits(l, i0, i1, j0, j1)))
        if i0 != j0:
            # the transposed tile is block (J, I): l_JI = l_IJ^T (no self, no bias off the diagonal)
            lse[j0:j1] = torch.logaddexp(lse[j0:j1], torch.logsumexp(l, dim=0))
            if lse_pos is not None:
                lt = tiles.pos_logits(l.T, j0, j1, i0, i1)
                lse_pos[j0:j1] = torch.logaddexp(lse_pos[j0:j1], _lse_rows(lt))
    return lse, None, lse_pos


def _grads_sym(tiles, n, spec, lse, lse_pos, g, g_pos, need_s):
    """Symmetric backward: per block pair H = G_IJ + G_JI^T, dA_I += s H A_J, dA_J += s H^T A_I.
    Returns dA in normalised space."""
    a, s = tiles.b, tiles.s
    da = torch.zeros_like(a)
    ds = torch.zeros((), device=a.device, dtype=a.dtype)
    for i0, i1, j0, j1 in _sym_pairs(n):
        c, l = tiles.logits(i0, i1, j0, j1)
        h = _softmax_grad(l, lse[i0:i1], g[i0:i1], 1) if g is not None else torch.zeros_like(l)
        if g_pos is not None:
            h.add_(_softmax_grad(tiles.pos_logits(l, i0, i1, j0, j1), lse_pos[i0:i1], g_pos[i0:i1], 1))
        if i0 != j0:
            if g is not None:
                h.add_(_softmax_grad(l, lse[j0:j1], g[j0:j1], 0))
            if g_pos is not None:
                lt = tiles.pos_logits(l.T, j0, j1, i0, i1)
                h.add_(_softmax_grad(lt, lse_pos[j0:j1], g_pos[j0:j1], 1).T)
            del l
            if need_s:
                ds += torch.vdot(h.reshape(-1), c.reshape(-1))
            da[i0:i1].addmm_(h, a[j0:j1])
            da[j0:j1].addmm_(h.T, a[i0:i1])
        else:
            del l
            if need_s:
                ds += torch.vdot(h.reshape(-1), c.reshape(-1))
            da[i0:i1].addmm_(h + h.T, a[i0:i1])
    da.mul_(s)
    return da, ds


def _norms(x: Tensor, spec: CoreSpec, dtype: torch.dtype) -> Optional[Tensor]:
    if not spec.normalize:
        return None
    return torch.linalg.vector_norm(x, dim=1, dtype=dtype).clamp_min(spec.eps)


def _setup(a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors, dt: torch.dtype):
    """Tiles of the problem plus the normalised contrast set (the only full normalised copy:
    anchor rows are normalised chunk by chunk unless A is B)."""
    s = scale.detach().to(dt)
    if b is None:
        bh, nb = _prep(a, spec, dt)
        return _Tiles(bh, nb, bh, s, spec, t, a_is_hat=True), bh, nb
    bh, nb = _prep(b, spec, dt)
    return _Tiles(a, _norms(a, spec, dt), bh, s, spec, t, a_is_hat=False), bh, nb


def _input_grads(tiles, bh, nb, same, sym, n, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                 need_a, need_b, need_s, eager_w=None):
    """(grad A, grad B, grad s[, LSE, LSEpos]) in the compute dtype, through the normalisation."""
    if sym:
        da_hat, ds = _grads_sym(tiles, n, spec, lse, lse_pos, g, g_pos, need_s)
        return _norm_bwd(da_hat, bh, nb, spec.eps), None, ds
    res = _grads_rows(tiles, n, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                      need_a, need_b or (same and need_a), need_s, eager_w=eager_w)
    ga, db_hat, ds = res[:3]
    gb = _norm_bwd(db_hat, bh, nb, spec.eps) if db_hat is not None else None
    if same:
        ga = ga.add_(gb) if ga is not None else None
        gb = None
    return (ga, gb, ds) + tuple(res[3:])


class TorchCoreFn(torch.autograd.Function):
    """Core op (see ``_spec.py``) with a chunked forward and an O(N*D)-memory backward.

    Inputs: ``a`` [N, D] raw anchors, ``b`` [M, D] raw contrast set or None (``spec.same``: B is A),
    ``scale`` 0-dim tensor (s = 1/temperature). Outputs: vector mode ``(LSE [N], LSEcol [M] or [0],
    LSEpos [N] or [0])``; weighted mode a 0-dim tensor. All in the compute dtype (float32, or float64
    for float64 inputs); gradients are returned in each input's dtype.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors):
        dt = compute_dtype(a, b)
        same = b is None
        tiles, bh, nb = _setup(a, b, scale, spec, t, dt)
        n = a.shape[0]
        sym = same and not spec.want_col and t.bias_col is None
        need_a, need_b, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        ctx.spec, ctx.t, ctx.sym, ctx.same = spec, t, sym, same
        ctx.dtypes = (a.dtype, None if same else b.dtype, scale.dtype)

        if t.weighted and not sym and not spec.want_col and (need_a or need_b or need_s):
            # eager: the upstream gradient of a weighted sum is a scalar, so form the gradients now
            ga, gb, ds, lse, lse_pos = _input_grads(
                tiles, bh, nb, same, sym, n, spec, None, None, None, None, None, None,
                need_a, need_b, need_s, eager_w=(t.w_row.to(dt), _opt(t.w_pos, dt)))
            ctx.eager = (ga, gb, ds if need_s else None)
            # keep what a recomputing backward needs, should backward run twice (retain_graph)
            ctx.save_for_backward(a, b, scale, lse, None, lse_pos)
            return weighted_total(lse, None, lse_pos, t)

        ctx.eager = None
        if sym:
            lse, lse_col, lse_pos = _stats_sym(tiles, n, spec)
        else:
            lse, lse_col, lse_pos = _stats_rows(tiles, n, spec)
        ctx.save_for_backward(a, b, scale, lse, lse_col, lse_pos)
        if t.weighted:
            return weighted_total(lse, lse_col, lse_pos, t)
        empty = lse.new_empty(0)
        return lse, (lse_col if lse_col is not None else empty), (lse_pos if lse_pos is not None else empty)

    @staticmethod
    def backward(ctx, *grads):
        spec, t = ctx.spec, ctx.t
        need_a, need_b, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]

        def out(ga, gb, ds):
            return (
                ga.to(ctx.dtypes[0]) if need_a else None,
                gb.to(ctx.dtypes[1]) if need_b and gb is not None else None,
                ds.to(ctx.dtypes[2]).reshape(()) if need_s else None,
                None, None,
            )

        if ctx.eager is not None:
            # gradients computed in the forward: scale them in place (the buffers are ours, and are
            # dropped here; a second backward through a retained graph takes the recompute path)
            ga, gb, ds = ctx.eager
            ctx.eager = None
            go = grads[0]
            return out(ga.mul_(go) if ga is not None else None, gb.mul_(go) if gb is not None else None,
                       ds * go if ds is not None else None)
        a, b, scale, lse, lse_col, lse_pos = ctx.saved_tensors
        dt = lse.dtype
        if t.weighted:
            go = grads[0].to(dt)
            g = t.w_row.to(dt) * go
            g_col = t.w_col.to(dt) * go if (lse_col is not None and t.w_col is not None) else None
            g_pos = t.w_pos.to(dt) * go if (lse_pos is not None and t.w_pos is not None) else None
        else:
            g, g_col, g_pos = (x.to(dt) if x is not None and x.numel() else None for x in grads)
            if lse_col is None:
                g_col = None
            if lse_pos is None:
                g_pos = None
        if g_pos is not None:
            # zero-positive rows (LSEpos = -inf) carry no softmax over positives
            g_pos = torch.where(lse_pos == _NEG_INF, torch.zeros_like(g_pos), g_pos)
        tiles, bh, nb = _setup(a, b, scale, spec, t, dt)
        ga, gb, ds = _input_grads(tiles, bh, nb, ctx.same, ctx.sym, a.shape[0], spec, lse, lse_col, lse_pos,
                                  g, g_col, g_pos, need_a, need_b, need_s)
        return out(ga, gb, ds)


def _opt(x: Optional[Tensor], dt) -> Optional[Tensor]:
    return None if x is None else x.to(dt)


def core(a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors):
    """Run the core op on the torch backend (see :class:`TorchCoreFn`)."""
    return TorchCoreFn.apply(a, b, scale, spec, t)
