"""CoSENT's PyTorch path: O(B log B) time, O(B) memory (the pair sum factored through a sort), with an
explicit backward.

    L = log(1 + sum_{(a, b): y_a > y_b} exp(x_b - x_a)),   x = scale * score

Factor the double sum: ``sum_a exp(-x_a) * sum_{b: y_b < y_a} exp(x_b)``. With the pairs sorted by label
ascending, the inner sum is an *exclusive* prefix over strictly smaller labels: ``logcumsumexp(x_sorted)``
read just before the start of a's tie group (-inf when the group is the first). Then
``L = log(1 + sum_a exp(z_a))`` with ``z_a = prefix_a - x_a``, evaluated as
``m + log(exp(-m) + sum_a exp(z_a - m))``, ``m = max(0, max_a z_a)``: no log(0) even when there is no
ordered pair (then L = 0 and every gradient is 0, not NaN).

The gradient is the same factoring run the other way: with ``W_ab = exp(x_b - x_a - L)`` (each <= 1),

    dL/dx_c = sum_{a: y_a > y_c} W_ac - sum_{b: y_b < y_c} W_cb
            = exp(x_c - L + suffix_c) - exp(z_c - L)

where ``suffix_c = log sum_{a: y_a > y_c} exp(-x_a)`` is a reverse ``logcumsumexp`` of ``-x_sorted`` read
just after the end of c's tie group. Both exponents are <= 0 up to rounding (each is the log of a
partial sum of the terms of ``exp(L) - 1``), so nothing overflows.

Batches whose B x B pair tile fits the tile budget use the tile instead (a few ops, fewer than the
sort): ``logsumexp([0] ++ {x_b - x_a : y_a > y_b})`` and ``dL/dx = W.sum(0) - W.sum(1)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..norms import clamped_norms
from ..tiles import tile_elements

_NEG_INF = float("-inf")


def _pair_tile(x: Tensor, labels: Tensor) -> Tensor:
    """``x_b - x_a`` at ``[a, b]`` where ``y_a > y_b``, -inf elsewhere (exactly absent pairs)."""
    return torch.where(labels[:, None] > labels[None, :], x[None, :] - x[:, None], _NEG_INF)


def _groups_sorted(y: Tensor) -> tuple[Tensor, Tensor]:
    """(start, end) index of the tie group of every position of the ascending labels ``y``."""
    b = y.shape[0]
    idx = torch.arange(b, device=y.device)
    differs = y[1:] != y[:-1]
    is_start = torch.cat([differs.new_ones(1), differs])
    is_end = torch.cat([differs, differs.new_ones(1)])
    start = torch.cummax(torch.where(is_start, idx, 0), dim=0).values
    end = torch.cummin(torch.where(is_end, idx, b - 1).flip(0), dim=0).values.flip(0)
    return start, end


def cosent_forward(x: Tensor, labels: Tensor) -> tuple[Tensor, tuple]:
    """(the CoSENT loss of the scaled scores ``x`` [B], what :func:`cosent_backward` needs)."""
    if x.shape[0] ** 2 <= tile_elements():
        terms = _pair_tile(x, labels)
        loss = torch.logsumexp(torch.cat([terms.new_zeros(1), terms.flatten()]), dim=0)
        return loss, ("tile", terms, loss)
    y, order = torch.sort(labels, stable=True)
    xs = x[order]
    live = y == y  # a NaN label (sorted last) is neither above nor below any label: no pair, no gradient
    start, end = _groups_sorted(y)
    lcse = torch.logcumsumexp(torch.where(live, xs, _NEG_INF), dim=0)
    prefix = torch.where(start > 0, lcse[(start - 1).clamp_min(0)], _NEG_INF)
    z = torch.where(live, prefix - xs, _NEG_INF)
    m = torch.clamp_min(z.max(), 0.0)
    loss = m + torch.log(torch.exp(-m) + torch.exp(z - m).sum())
    return loss, ("sorted", xs, z, order, end, loss, live)


def cosent_backward(state: tuple, g: Tensor) -> Tensor:
    """``g * dL/dx`` [B] from the state of :func:`cosent_forward`."""
    if state[0] == "tile":
        _, terms, loss = state
        w = torch.exp(terms - loss).mul_(g)
        return w.sum(dim=0) - w.sum(dim=1)
    _, xs, z, order, end, loss, live = state
    # suffix_c = log sum_{k > end_c} exp(-xs_k): reverse logcumsumexp, shifted by one past the group
    rev = torch.logcumsumexp(torch.where(live, -xs, _NEG_INF).flip(0), dim=0).flip(0)
    rev = torch.cat([rev, rev.new_full((1,), _NEG_INF)])
    suffix = rev[end + 1]
    d_sorted = torch.where(live, torch.exp(xs - loss + suffix) - torch.exp(z - loss), 0.0)
    dx = torch.empty_like(d_sorted).index_put_((order,), d_sorted)
    return dx.mul_(g)


def _compute_dtype(*xs: Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _scale_grad(gs: Tensor | None, dtypes: tuple):
    sdt, sshape = dtypes
    return None if gs is None else gs.to(sdt).reshape(sshape)


class ScoresCosentFn(torch.autograd.Function):
    """CoSENT of given scores [B] with labels [B] and a scale (number or 0-dim tensor); 0-dim loss in
    float32 (float64 for float64 scores)."""

    @staticmethod
    @autocast_off
    def forward(ctx, scores: Tensor, labels: Tensor, scale):
        dt = _compute_dtype(scores)
        sf = scores.to(dt)
        s = scale.detach().to(dt) if isinstance(scale, Tensor) else scale
        loss, state = cosent_forward(sf * s, labels)
        ctx.state, ctx.s = state, s
        ctx.dtypes = (scores.dtype, scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        ctx.save_for_backward(sf)
        return loss

    @staticmethod
    @autocast_off
    @first_order("ScoresCosentFn")
    def backward(ctx, g: Tensor):
        (sf,) = ctx.saved_tensors
        need_x, _, need_s = ctx.needs_input_grad[:3]
        dx = cosent_backward(ctx.state, g.to(sf.dtype))
        gs = (dx * sf).sum() if need_s else None
        gx = (dx * ctx.s).to(ctx.dtypes[0]) if need_x else None
        return gx, None, _scale_grad(gs, ctx.dtypes[1:])


class PairCosentFn(torch.autograd.Function):
    """CoSENT on the cosines of pairs (u_i, v_i) (raw dot products when ``normalize`` is False).

    With ``x = s c``, ``c_i = <u_hat_i, v_hat_i>``: ``dL/du_i = s dx_i (v_hat_i - u_hat_i c_i) / ||u_i||``
    (``/ eps`` without the projection for a clamped row) and symmetrically for v. Saves the unit rows
    (O(B*D)) and the O(B) state of the scores (the B x B tile for small batches).
    """

    @staticmethod
    @autocast_off
    def forward(ctx, u: Tensor, v: Tensor, labels: Tensor, scale, normalize: bool, eps: float):
        dt = _compute_dtype(u, v)
        uh = u if u.dtype == dt else u.to(dt)
        vh = v if v.dtype == dt else v.to(dt)
        nu = nv = None
        if normalize:
            nu, nv = clamped_norms(u, eps, dt), clamped_norms(v, eps, dt)
            uh, vh = uh / nu[:, None], vh / nv[:, None]
        c = torch.linalg.vecdot(uh, vh, dim=1)
        s = scale.detach().to(dt) if isinstance(scale, Tensor) else scale
        loss, state = cosent_forward(c * s, labels)
        ctx.state, ctx.s, ctx.eps = state, s, eps
        ctx.dtypes = (u.dtype, v.dtype, scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        ctx.save_for_backward(uh, vh, nu, nv, c)
        return loss

    @staticmethod
    @autocast_off
    @first_order("PairCosentFn")
    def backward(ctx, g: Tensor):
        uh, vh, nu, nv, c = ctx.saved_tensors
        need_u, need_v, _, need_s = ctx.needs_input_grad[:4]
        dx = cosent_backward(ctx.state, g.to(c.dtype))
        gs = (dx * c).sum() if need_s else None
        dc = (dx * ctx.s)[:, None]

        def through_norm(dh: Tensor, xh: Tensor, n: Tensor | None) -> Tensor:
            if n is None:
                return dh
            # <d x_hat, x_hat> = dc <other_hat, x_hat> = dc c (zero for a clamped row)
            proj = (dc[:, 0] * c).masked_fill_(n <= ctx.eps, 0.0)
            return dh.addcmul_(xh, proj[:, None], value=-1.0).div_(n[:, None])

        gu = through_norm(dc * vh, uh, nu).to(ctx.dtypes[0]) if need_u else None
        gv = through_norm(dc * uh, vh, nv).to(ctx.dtypes[1]) if need_v else None
        return gu, gv, None, _scale_grad(gs, ctx.dtypes[2:]), None, None
