"""The chunked PyTorch path of the core op's log-sum-exp terms: O(N*D) memory, any device.

It computes ``c.lse LSE + c.col LSEcol + c.pos LSEpos`` (per row, or summed); the linear positive
terms (``TGT``, ``SET``) are O(N*D) and come from ``linear_terms.py``. The N x M logits are never
allocated: rows are processed in chunks of a ``rows x M`` tile whose size comes from
:func:`tile_elements`, with an online log-sum-exp where a statistic spans chunks (column LSE,
symmetric blocks).

Work, in units of one N x M x D matmul (the naive autograd graph costs 3):

* summed output, A != B, no column term: each row chunk spans all M columns, so its LSE is final
  inside the chunk and the gradient is formed right away from the same tile ("eager" gradients,
  scaled by the scalar upstream gradient in backward): 1 (S) + 2 (dA, dB) = **3 units**, one exp
  per logit, no recompute.
* B is A (symmetric): only blocks (I, J) with I <= J are visited. Forward 1/2; backward recomputes
  the tile (1/2) and applies ``H = G_IJ + G_JI^T`` to both sides (1): **2 units**.
* per-row output (``reduction="none"``) or a column term (CLIP): a stats pass (1) and a recomputing
  gradient pass (3): 4 units.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..norms import clamped_norms, normalize_backward_, normalize_rows
from ..spec import Coeffs, CoreData, CoreSpec, combine, compute_dtype
from ..target_split import exact_weights, logsumexp_without, merge_split, minus_coefficients
from ..tiles import _row_chunk, _safe, _ScaleGrad, _vec, tile_elements

_NEG_INF = float("-inf")


def _sym_block(n: int) -> int:
    c = math.isqrt(tile_elements())
    if c >= 128:
        c -= c % 64
    return max(1, min(n, c))


class _Tiles:
    """Builds masked logit tiles of the core op for a row range and a column range."""

    def __init__(self, a: Tensor, a_norm: Tensor | None, b: Tensor, s, spec: CoreSpec,
                 data: CoreData, a_is_hat: bool):
        """``a``: anchors, already normalised (``a_is_hat``) or raw with clamped norms ``a_norm``
        (rows are then normalised one chunk at a time: no full normalised copy of A)."""
        self.a, self.a_norm, self.a_is_hat = a, a_norm, a_is_hat
        self.b, self.s, self.spec, self.data = b, s, spec, data
        self.m = b.shape[0]
        self.dtype = b.dtype

    def arows(self, r0: int, r1: int) -> Tensor:
        """Normalised anchor rows [r0, r1) in the compute dtype."""
        x = self.a[r0:r1]
        if self.a_is_hat:
            return x
        x = x.to(self.dtype)
        return x / self.a_norm[r0:r1, None] if self.a_norm is not None else x

    def logits(self, r0: int, r1: int, c0: int, c1: int) -> tuple[Tensor, Tensor]:
        """(cosine tile, masked logit tile) for rows [r0, r1) and columns [c0, c1)."""
        spec, data = self.spec, self.data
        c = self.arows(r0, r1) @ self.b[c0:c1].T
        if spec.margin != 0.0:  # c - margin at the targets inside [c0, c1): the scale's gradient reads it
            tc = data.target[r0:r1] - c0
            inside = (tc >= 0) & (tc < c1 - c0)
            shift = torch.where(inside, torch.full_like(c[:, 0], -spec.margin), torch.zeros_like(c[:, 0]))
            c.scatter_add_(1, tc.clamp(0, c1 - c0 - 1)[:, None], shift[:, None])
        l = c * self.s
        if data.bias_col is not None and spec.bias != 0.0:
            bc = data.bias_col[r0:r1] - c0
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
        data = self.data
        if data.pos_mask is not None:
            n0, m0 = data.pos_mask.shape
            ri = torch.arange(r0, r1, device=l.device) % n0
            ci = torch.arange(c0, c1, device=l.device) % m0
            w = data.pos_mask[ri[:, None], ci[None, :]].to(l.dtype)
            return l + torch.log(w)
        eq = data.row_labels[r0:r1, None] == data.col_labels[None, c0:c1]
        return l.masked_fill(~eq, _NEG_INF)


def _lse_rows(x: Tensor) -> Tensor:
    return torch.logsumexp(x, dim=1)


def _softmax_grad(l: Tensor, lse: Tensor, g: Tensor, dim: int, acc: tuple | None = None) -> Tensor:
    """g * exp(l - lse) along rows (dim=1: lse, g per row) or columns (dim=0: per column). With
    ``acc = (scale_grad, cosines, i0, i1)`` the unscaled softmax is added to a :class:`_ScaleGrad` first,
    at rows (dim=1) or columns (dim=0) ``i0:i1`` of its vectors."""
    p = (l - (_safe(lse)[:, None] if dim == 1 else _safe(lse)[None, :])).exp_()
    if acc is not None:
        sg, c, i0, i1 = acc
        sg.add(p, c, i0, i1, dim)
    return p.mul_(g[:, None] if dim == 1 else g[None, :])


def _stats_rows(tiles: _Tiles, n: int, want_col: bool, want_pos: bool, target: Tensor | None = None):
    """Forward stats pass, non-symmetric: row chunks spanning all columns. With ``target`` [N] (no positives) the
    target split: each row's target entry out of its LSE (``LSEx``), and CLIP's ``(j, j)`` out of column j's where
    ``t_j = j``; returns ``(LSEx, LSEcolx, None, l_t)`` with the rows' target logits ``l_t`` [N] from the tiles."""
    m = tiles.m
    dev, dt = tiles.b.device, tiles.dtype
    lse = torch.empty(n, device=dev, dtype=dt)
    lse_pos = torch.empty(n, device=dev, dtype=dt) if want_pos else None
    lse_col = torch.full((m,), _NEG_INF, device=dev, dtype=dt) if want_col else None
    lt = torch.empty(n, device=dev, dtype=dt) if target is not None else None
    step = _row_chunk(n, m)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        _, l = tiles.logits(r0, r1, 0, m)
        if target is not None:
            t = target[r0:r1, None]
            lt[r0:r1], lse[r0:r1] = logsumexp_without(l, t, 1)
            if lse_col is not None:  # the column sums keep every target entry but the pairs' (j, j)
                own = t[:, 0] == torch.arange(r0, r1, device=dev)
                l.scatter_(1, t, torch.where(own, _NEG_INF, lt[r0:r1])[:, None])
                lse_col = torch.logaddexp(lse_col, torch.logsumexp(l, dim=0))
            continue
        lse[r0:r1] = _lse_rows(l)
        if lse_pos is not None:
            lse_pos[r0:r1] = _lse_rows(tiles.pos_logits(l, r0, r1, 0, m))
        if lse_col is not None:
            lse_col = torch.logaddexp(lse_col, torch.logsumexp(l, dim=0))
    return (lse, lse_col, lse_pos) if target is None else (lse, lse_col, lse_pos, lt)


def _grads_rows(tiles, n, spec, lse, lse_col, lse_pos, g, g_col, g_pos, need_a, need_b, need_s,
                eager_w: tuple[Tensor, Tensor | None] | None = None, exact: Tensor | None = None,
                target: Tensor | None = None, split: dict | None = None):
    """Gradient pass, non-symmetric: d l_ij = g_i p_ij + gc_j pc_ij + gp_i q_ij per row chunk.

    Returns ``da`` already through the normalisation backward (input space, one chunk at a time),
    ``db`` in normalised space (its rows collect contributions from every chunk), and ``ds``.
    With ``eager_w = (w_row, w_pos)`` the pass also produces LSE / LSEpos (each row chunk spans all
    columns, so its LSE is final) and uses the weights as the upstream gradient: one pass, 3 units.

    The target split (``target`` [N]): each row's target entry of ``dl`` is its combined weight, never ``p_t - 1``:
    ``exact`` [N] (``target_split.exact_weights``, known statistics), or with ``eager_w`` the row's own ``-w_i (1 -
    p_t)`` from the chunk's split statistics, which ``split`` (a dict) receives as ``loss``, ``fold`` and ``rest``
    (``target_split.merge_split``'s names); the scale's gradient is then ``sum_ij dl_ij c_ij`` of these tiles.
    """
    m = tiles.m
    b, s = tiles.b, tiles.s
    dev, dt = b.device, tiles.dtype
    d = b.shape[1]
    gcols = m if spec.grad_cols is None else spec.grad_cols
    da = torch.empty(n, d, device=dev, dtype=dt) if need_a else None
    db = torch.zeros(gcols, d, device=dev, dtype=dt) if need_b else None
    want_pos = g_pos is not None or (eager_w is not None and eager_w[1] is not None)
    if eager_w is not None:
        g, g_pos = eager_w
        lse = torch.empty(n, device=dev, dtype=dt)
        lse_pos = torch.empty(n, device=dev, dtype=dt) if want_pos else None
    # the scale's gradient per softmax term (rows, columns, positives); with the target split, from the tiles
    splitting = target is not None
    sg_row = _ScaleGrad(n, b) if need_s and g is not None and not splitting else None
    sg_col = _ScaleGrad(m, b) if need_s and g_col is not None and not splitting else None
    sg_pos = _ScaleGrad(n, b) if need_s and g_pos is not None and not splitting else None
    ds_tiles = torch.zeros((), device=dev, dtype=torch.float64) if need_s and splitting else None
    if splitting and eager_w is not None:
        split.update(loss=torch.empty(n, device=dev, dtype=dt), fold=torch.empty(n, device=dev, dtype=dt),
                     rest=torch.empty(n, device=dev, dtype=dt))
    step = _row_chunk(n, m)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        c, l = tiles.logits(r0, r1, 0, m)
        lp = tiles.pos_logits(l, r0, r1, 0, m) if want_pos else None
        if eager_w is not None and splitting:  # the chunk's split statistics: LSEx, l_t, then the merged LSE
            lt, lse_x = logsumexp_without(l, target[r0:r1, None], 1)
            chunk: dict = {}
            lse[r0:r1] = merge_split(lse_x, None, torch.cat([lt, lt]), target[r0:r1], False, chunk)[0]
            for key in ("loss", "fold", "rest"):
                split[key][r0:r1] = chunk[key]
        elif eager_w is not None:
            lse[r0:r1] = _lse_rows(l)
            if lp is not None:
                lse_pos[r0:r1] = _lse_rows(lp)
                # zero-positive rows (LSEpos = -inf) carry no softmax over positives
                g_pos_r = torch.where(lse_pos[r0:r1] == _NEG_INF, torch.zeros_like(g_pos[r0:r1]), g_pos[r0:r1])
        elif g_pos is not None:
            g_pos_r = g_pos[r0:r1]
        dl = None
        if g is not None:
            dl = _softmax_grad(l, lse[r0:r1], g[r0:r1], 1, sg_row and (sg_row, c, r0, r1))
        if g_col is not None:
            part = _softmax_grad(l, lse_col, g_col, 0, sg_col and (sg_col, c, 0, m))
            dl = part if dl is None else dl.add_(part)
        if g_pos is not None and lp is not None:
            part = _softmax_grad(lp, lse_pos[r0:r1], g_pos_r, 1, sg_pos and (sg_pos, c, r0, r1))
            dl = part if dl is None else dl.add_(part)
        if splitting and dl is not None:  # each row's target entry: its combined weight
            t = target[r0:r1, None]
            if exact is not None:
                w_t = exact[r0:r1]
            else:
                w_t = torch.where(split["fold"][r0:r1] > 0, -g[r0:r1] * split["rest"][r0:r1], dl.gather(1, t)[:, 0])
            dl.scatter_(1, t, w_t[:, None].to(dl.dtype))
            if ds_tiles is not None:
                ds_tiles += torch.linalg.vecdot(dl, c, dim=1).to(torch.float64).sum()
        del l, lp, c
        if dl is None:
            if need_a:
                da[r0:r1] = 0
            continue
        ar = tiles.arows(r0, r1) if (need_a or need_b) else None
        if need_a:
            dar = torch.matmul(dl, b).mul_(s)
            na = tiles.a_norm[r0:r1] if tiles.a_norm is not None else None
            da[r0:r1] = normalize_backward_(dar, ar, na, spec.eps)
        if need_b:
            db.addmm_(dl[:, :gcols].T, ar)
    if need_b:
        db.mul_(s)
        if gcols < m:
            db = torch.cat([db, torch.zeros(m - gcols, d, device=dev, dtype=dt)])
    ds = torch.zeros((), device=dev, dtype=dt) if ds_tiles is None else ds_tiles.to(dt)
    for sg, w in ((sg_row, g), (sg_col, g_col), (sg_pos, g_pos)):
        if sg is not None:
            ds = ds + sg.total(w)
    if eager_w is not None:
        return da, db, ds, lse, lse_pos
    return da, db, ds


def _sym_pairs(n: int):
    step = _sym_block(n)
    starts = list(range(0, n, step))
    for bi, i0 in enumerate(starts):
        for j0 in starts[bi:]:
            yield i0, min(n, i0 + step), j0, min(n, j0 + step)


def _sym_hits(target: Tensor, i0: int, i1: int, j0: int, j1: int) -> tuple[Tensor, Tensor]:
    """The target entries of block (I, J) of the symmetric tile: ``(rows I at their targets in J, rows J at their
    targets in I)``, both [|I|, |J|] bool (the second read down the block's columns)."""
    dev = target.device
    rows, cols = torch.arange(i0, i1, device=dev), torch.arange(j0, j1, device=dev)
    return target[i0:i1, None] == cols[None, :], rows[:, None] == target[None, j0:j1]


def _stats_sym(tiles: _Tiles, n: int, want_pos: bool, target: Tensor | None = None):
    """Forward stats pass over blocks I <= J of the symmetric S = A_hat A_hat^T (1/2 unit). With ``target`` [N] (no
    positives) the target split: each row's target entry out of its LSE, in whichever block (or its transpose) holds
    it; returns ``(LSEx, None, None, l_t)``."""
    dev, dt = tiles.b.device, tiles.dtype
    lse = torch.full((n,), _NEG_INF, device=dev, dtype=dt)
    lse_pos = torch.full((n,), _NEG_INF, device=dev, dtype=dt) if want_pos else None
    lt = torch.full((n,), _NEG_INF, device=dev, dtype=dt) if target is not None else None
    for i0, i1, j0, j1 in _sym_pairs(n):
        _, l = tiles.logits(i0, i1, j0, j1)
        if target is not None:
            hr, hc = _sym_hits(target, i0, i1, j0, j1)
            lt[i0:i1] = torch.maximum(lt[i0:i1], torch.where(hr, l, _NEG_INF).amax(dim=1))
            lse[i0:i1] = torch.logaddexp(lse[i0:i1], _lse_rows(torch.where(hr, _NEG_INF, l)))
            if i0 != j0:
                lt[j0:j1] = torch.maximum(lt[j0:j1], torch.where(hc, l, _NEG_INF).amax(dim=0))
                lse[j0:j1] = torch.logaddexp(lse[j0:j1], torch.logsumexp(torch.where(hc, _NEG_INF, l), dim=0))
            continue
        lse[i0:i1] = torch.logaddexp(lse[i0:i1], _lse_rows(l))
        if lse_pos is not None:
            lse_pos[i0:i1] = torch.logaddexp(lse_pos[i0:i1], _lse_rows(tiles.pos_logits(l, i0, i1, j0, j1)))
        if i0 != j0:
            # the transposed tile is block (J, I): l_JI = l_IJ^T (no self, no bias off the diagonal)
            lse[j0:j1] = torch.logaddexp(lse[j0:j1], torch.logsumexp(l, dim=0))
            if lse_pos is not None:
                lt = tiles.pos_logits(l.T, j0, j1, i0, i1)
                lse_pos[j0:j1] = torch.logaddexp(lse_pos[j0:j1], _lse_rows(lt))
    return (lse, None, lse_pos) if target is None else (lse, None, lse_pos, lt)


def _grads_sym(tiles, n, lse, lse_pos, g, g_pos, need_s, exact: Tensor | None = None, target: Tensor | None = None):
    """Symmetric backward: per block pair H = G_IJ + G_JI^T, dA_I += s H A_J, dA_J += s H^T A_I.
    Returns dA in normalised space. ``exact`` [N] with ``target``: each row's target entry takes its combined weight
    (``target_split.exact_weights``) in the role that holds it; the scale's gradient is then ``sum dl c`` of the
    tiles."""
    a, s = tiles.b, tiles.s
    da = torch.zeros_like(a)
    splitting = exact is not None
    sg_row = _ScaleGrad(n, a) if need_s and g is not None and not splitting else None
    sg_pos = _ScaleGrad(n, a) if need_s and g_pos is not None and not splitting else None
    ds_tiles = torch.zeros((), device=a.device, dtype=torch.float64) if need_s and splitting else None
    for i0, i1, j0, j1 in _sym_pairs(n):
        c, l = tiles.logits(i0, i1, j0, j1)
        h = _softmax_grad(l, lse[i0:i1], g[i0:i1], 1, sg_row and (sg_row, c, i0, i1)) if g is not None \
            else torch.zeros_like(l)
        if splitting:
            hr, hc = _sym_hits(target, i0, i1, j0, j1)
            h = torch.where(hr, exact[i0:i1, None].to(h.dtype), h)
        if g_pos is not None:
            h.add_(_softmax_grad(tiles.pos_logits(l, i0, i1, j0, j1), lse_pos[i0:i1], g_pos[i0:i1], 1,
                                 sg_pos and (sg_pos, c, i0, i1)))
        if i0 != j0:
            if g is not None:
                part = _softmax_grad(l, lse[j0:j1], g[j0:j1], 0, sg_row and (sg_row, c, j0, j1))
                if splitting:
                    part = torch.where(hc, exact[None, j0:j1].to(h.dtype), part)
                h.add_(part)
                del part
            if g_pos is not None:
                lt = tiles.pos_logits(l.T, j0, j1, i0, i1)
                h.add_(_softmax_grad(lt, lse_pos[j0:j1], g_pos[j0:j1], 1, sg_pos and (sg_pos, c.T, j0, j1)).T)
        if ds_tiles is not None:  # (an off-diagonal block holds both roles; a diagonal one its rows')
            ds_tiles += (h * c).sum(dtype=torch.float64)
        del l, c
        if i0 != j0:
            da[i0:i1].addmm_(h, a[j0:j1])
            da[j0:j1].addmm_(h.T, a[i0:i1])
        else:
            da[i0:i1].addmm_(h + h.T, a[i0:i1])
    da.mul_(s)
    ds = torch.zeros((), device=a.device, dtype=a.dtype) if ds_tiles is None else ds_tiles.to(a.dtype)
    for sg, w in ((sg_row, g), (sg_pos, g_pos)):
        if sg is not None:
            ds = ds + sg.total(w)
    return da, ds


def _setup(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, dt: torch.dtype):
    """Tiles of the problem plus the normalised contrast set (the only full normalised copy:
    anchor rows are normalised chunk by chunk unless A is B)."""
    s = scale.detach().to(dt) if isinstance(scale, Tensor) else float(scale)
    if b is None:
        bh, nb = normalize_rows(a, spec.eps, dt, spec.normalize)
        return _Tiles(bh, nb, bh, s, spec, data, a_is_hat=True), bh, nb
    bh, nb = normalize_rows(b, spec.eps, dt, spec.normalize)
    na = clamped_norms(a, spec.eps, dt) if spec.normalize else None
    return _Tiles(a, na, bh, s, spec, data, a_is_hat=False), bh, nb


def _input_grads(tiles, bh, nb, same, sym, n, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                 need_a, need_b, need_s, eager_w=None, exact=None, target=None, split=None):
    """(grad A, grad B, grad s[, LSE, LSEpos]) in the compute dtype, through the normalisation."""
    if sym:
        da_hat, ds = _grads_sym(tiles, n, lse, lse_pos, g, g_pos, need_s, exact, target)
        return normalize_backward_(da_hat, bh, nb, spec.eps), None, ds
    res = _grads_rows(tiles, n, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                      need_a, need_b or (same and need_a), need_s, eager_w=eager_w, exact=exact, target=target,
                      split=split)
    ga, db_hat, ds = res[:3]
    gb = normalize_backward_(db_hat, bh, nb, spec.eps) if db_hat is not None else None
    if same:
        ga = ga.add_(gb) if ga is not None else None
        gb = None
    return (ga, gb, ds) + tuple(res[3:])


def split_target(ctx, data: CoreData, want_pos: bool, dt: torch.dtype) -> Tensor | None:
    """The targets whose entries the piece splits out of its softmax (``core.forward_parts`` asks with
    ``ctx.split_target``, beside a target term): fp32 tiles (float64's keep the plain form), no softmax over
    positives; else None."""
    ok = getattr(ctx, "split_target", False) and not want_pos and dt == torch.float32 and data.target is not None
    return data.target if ok else None


class ChunkedCoreFn(torch.autograd.Function):
    """``c.lse LSE + c.col LSEcol + c.pos LSEpos`` per row (or summed) with a chunked forward and an
    O(N*D)-memory backward.

    Inputs: ``a`` [N, D] raw anchors, ``b`` [M, D] raw contrast set or None (B is A), ``scale`` a number
    or a 0-dim tensor (s = 1/temperature). Output in the compute dtype (float32, or float64 for
    float64 inputs); gradients come back in each input's dtype.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                reduce: bool):
        dt = compute_dtype(a, b)
        coef = coef.to(dt)
        same = b is None
        want_col, want_pos = coef.col is not None, coef.pos is not None
        tiles, bh, nb = _setup(a, b, scale, spec, data, dt)
        n = a.shape[0]
        sym = same and not want_col and (data.bias_col is None or spec.bias == 0.0) and spec.margin == 0.0
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[2]
        ctx.spec, ctx.data, ctx.coef, ctx.reduce, ctx.sym, ctx.same = spec, data, coef, reduce, sym, same
        ctx.dtypes = (a.dtype, None if same else b.dtype,
                      scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        ctx.scale = None if isinstance(scale, Tensor) else scale
        # the target split (core.forward_parts asks, with a target term; fp32 tiles, no softmax over positives): each
        # row's LSE_i - l_it, and CLIP's column's, without their cancellation in a saturated
        # softmax, the backward's target entries from 1 - p_t (target_split); the target term then leaves out the
        # coefficients those hold (ctx.minus_target here, ctx.moved_less in backward)
        ctx.split = split_target(ctx, data, want_pos, dt)
        ctx.exact = ctx.split_less = None

        if reduce and not sym and not want_col and (need_a or need_b or need_s):
            # eager: the upstream gradient of a sum is a scalar, so form the gradients now
            split: dict = {}
            ga, gb, ds, lse, lse_pos = _input_grads(
                tiles, bh, nb, same, sym, n, spec, None, None, None, None, None, None,
                need_a, need_b, need_s, eager_w=(_vec(coef.lse, n, bh), _vec(coef.pos, n, bh)), target=ctx.split,
                split=split)
            ctx.eager = (ga, gb, ds if need_s else None)
            # keep what a recomputing backward needs, should backward run twice (retain_graph)
            ctx.save_for_backward(a, b, scale if isinstance(scale, Tensor) else None, lse, None, lse_pos)
            if split:
                ctx.exact, ctx.split_less = split, _vec(coef.lse, n, bh) * split["fold"]
                ctx.minus_target = ctx.split_less
                return combine(coef, True, split["loss"], None, lse_pos)
            return combine(coef, True, lse, None, lse_pos)

        ctx.eager = None
        if sym and ctx.split is None:
            lse, lse_col, lse_pos = _stats_sym(tiles, n, want_pos)
        elif ctx.split is not None:
            lse, lse_col, lse_pos, lt = (_stats_sym(tiles, n, want_pos, ctx.split) if sym else
                                         _stats_rows(tiles, n, want_col, want_pos, ctx.split))
            minus: dict = {}
            lse, lse_col = merge_split(lse, lse_col, torch.cat([lt, lt]), ctx.split, False, minus)
            ctx.exact, ctx.split_less = minus, minus_coefficients(coef, minus, n)
            ctx.minus_target = ctx.split_less
            ctx.save_for_backward(a, b, scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos)
            return combine(coef, reduce, minus["loss"], minus.get("col_loss", lse_col), lse_pos)
        else:
            lse, lse_col, lse_pos = _stats_rows(tiles, n, want_col, want_pos)
        ctx.save_for_backward(a, b, scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos)
        return combine(coef, reduce, lse, lse_col, lse_pos)

    @staticmethod
    @autocast_off
    @first_order("ChunkedCoreFn")
    def backward(ctx, go: Tensor):
        spec, data, coef = ctx.spec, ctx.data, ctx.coef
        need_a, need_b, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]

        def out(ga, gb, ds):
            adt, bdt, sdt, sshape = ctx.dtypes
            return (
                ga.to(adt) if need_a and ga is not None else None,
                gb.to(bdt) if need_b and gb is not None else None,
                ds.to(sdt).reshape(sshape) if need_s and ds is not None else None,
                None, None, None, None,
            )

        if ctx.split_less is not None:
            # the target entries' weights are in these gradients already (nothing moved): the target term leaves out
            # the coefficients they hold (core.backward_parts)
            ctx.moved_target = torch.zeros_like(ctx.split_less)
            ctx.moved_less = ctx.split_less
        if ctx.eager is not None:
            # gradients computed in the forward: scale them in place (the buffers are ours, and are
            # dropped here; a second backward through a retained graph takes the recompute path)
            ga, gb, ds = ctx.eager
            ctx.eager = None
            return out(ga.mul_(go) if ga is not None else None, gb.mul_(go) if gb is not None else None,
                       ds * go if ds is not None else None)
        a, b, scale, lse, lse_col, lse_pos = ctx.saved_tensors
        if scale is None:
            scale = ctx.scale
        dt = lse.dtype
        n = a.shape[0]
        go = go.to(dt)
        g = _vec(coef.lse, n, lse) * go
        g_col = _vec(coef.col, lse_col.shape[0], lse) * go if lse_col is not None else None
        g_pos = None
        if lse_pos is not None:
            # zero-positive rows (LSEpos = -inf) carry no softmax over positives
            g_pos = _vec(coef.pos, n, lse) * go
            g_pos = torch.where(lse_pos == _NEG_INF, torch.zeros_like(g_pos), g_pos)
        tiles, bh, nb = _setup(a, b, scale, spec, data, dt)
        exact = None if ctx.exact is None else exact_weights(ctx.exact, ctx.split, g, g_col, lse_col)
        ga, gb, ds = _input_grads(tiles, bh, nb, ctx.same, ctx.sym, n, spec, lse, lse_col, lse_pos,
                                  g, g_col, g_pos, need_a, need_b, need_s, exact=exact,
                                  target=None if exact is None else ctx.split)
        return out(ga, gb, ds)


def core(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
         reduce: bool) -> Tensor:
    """The log-sum-exp terms of the core op on the chunked path (see :class:`ChunkedCoreFn`)."""
    return ChunkedCoreFn.apply(a, b, scale, spec, data, coef, reduce)
