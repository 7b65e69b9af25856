"""CoSENT's PyTorch path: O(B log B) time, O(B) memory (the pair sum factored through a sort).

    L = log(1 + sum_{(a, b): y_a > y_b} exp(u_b - u_a)),   u = scale * s

Factor the double sum: ``sum_a exp(-u_a) * sum_{b: y_b < y_a} exp(u_b)``. With the pairs sorted by label
ascending, the inner sum is an *exclusive* prefix over strictly smaller labels: ``logcumsumexp(u_sorted)``
read just before the start of a's tie group (-inf when the group is the first). Then
``L = log(1 + sum_a exp(z_a))`` with ``z_a = prefix_a - u_a``, evaluated as
``m + log(exp(-m) + sum_a exp(z_a - m))``, ``m = max(0, max_a z_a)``: no log(0) even when there is no
ordered pair (then L = 0 and every gradient is 0, not NaN). Autograd through sort / gather /
logcumsumexp gives the exact gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunked import tile_elements
from .norms import clamped_norms


def cosent(u: Tensor, labels: Tensor) -> Tensor:
    """The CoSENT loss of scaled scores ``u`` [B]: the B x B pair tile when it fits the tile budget (five
    ops, fewer than the sort), else the sorted O(B log B) form."""
    if u.shape[0] ** 2 <= tile_elements():
        return cosent_pairs(u, labels)
    return cosent_sorted(u, labels)


def cosent_pairs(u: Tensor, labels: Tensor) -> Tensor:
    """``logsumexp([0] ++ {u_b - u_a : y_a > y_b})`` on the B x B tile; pairs outside the order are -inf
    (exactly absent), and the leading 0 keeps the result and its gradient finite when no pair is ordered."""
    diff = u[None, :] - u[:, None]  # [a, b] = u_b - u_a
    terms = torch.where(labels[:, None] > labels[None, :], diff, float("-inf")).flatten()
    return torch.logsumexp(torch.cat([terms.new_zeros(1), terms]), dim=0)


def cosent_sorted(u: Tensor, labels: Tensor) -> Tensor:
    """The CoSENT loss of scaled scores ``u`` [B] with labels [B] (differentiable in ``u``)."""
    y, order = torch.sort(labels, stable=True)
    us = u[order]
    lcse = torch.logcumsumexp(us, dim=0)
    idx = torch.arange(u.shape[0], device=u.device)
    is_start = torch.ones_like(y, dtype=torch.bool)
    is_start[1:] = y[1:] != y[:-1]
    group_start = torch.cummax(torch.where(is_start, idx, torch.zeros_like(idx)), dim=0).values
    prev = (group_start - 1).clamp_min(0)
    prefix = torch.where(group_start > 0, lcse[prev], torch.full_like(us, float("-inf")))
    z = prefix - us
    m = torch.clamp_min(z.max().detach(), 0.0)
    return m + torch.log(torch.exp(-m) + torch.exp(z - m).sum())


class DensePairCosentFn(torch.autograd.Function):
    """CoSENT on the cosines of pairs (u_i, v_i), for batches whose B x B pair tile fits the tile budget:
    one Function, so the backward is a handful of ops instead of the autograd graph of the
    normalisation, the row dot and the pair tile.

    With ``x = s cos(u, v)`` and the pair weights ``W_ab = exp(x_b - x_a - L)`` (``y_a > y_b``, else 0):
    ``dL/dx_b = sum_a W_ab``, ``dL/dx_a = -sum_b W_ab``; then ``dL/du_i = s dx_i (v_hat_i - u_hat_i c_i) /
    ||u_i||`` (``/ eps`` without the projection for a clamped row) and symmetrically for v.
    """

    @staticmethod
    def forward(ctx, u: Tensor, v: Tensor, labels: Tensor, scale, normalize: bool, eps: float):
        dt = torch.float64 if torch.float64 in (u.dtype, v.dtype) else torch.float32
        uh = u if u.dtype == dt else u.to(dt)
        vh = v if v.dtype == dt else v.to(dt)
        nu = nv = None
        if normalize:
            nu, nv = clamped_norms(u, eps, dt), clamped_norms(v, eps, dt)
            uh, vh = uh / nu[:, None], vh / nv[:, None]
        c = (uh * vh).sum(dim=1)
        s = scale.detach().to(dt) if isinstance(scale, Tensor) else scale
        x = c * s
        terms = torch.where(labels[:, None] > labels[None, :], x[None, :] - x[:, None], float("-inf"))
        loss = torch.logsumexp(torch.cat([terms.new_zeros(1), terms.flatten()]), dim=0)
        ctx.s, ctx.eps = s, eps
        ctx.dtypes = (u.dtype, v.dtype, scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        ctx.save_for_backward(uh, vh, nu, nv, c, terms, loss)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        uh, vh, nu, nv, c, terms, loss = ctx.saved_tensors
        need_u, need_v, _, need_s = ctx.needs_input_grad[:4]
        w = torch.exp(terms - loss).mul_(g.to(terms.dtype))
        dx = w.sum(dim=0) - w.sum(dim=1)
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
        sdt, sshape = ctx.dtypes[2:]
        return gu, gv, None, (gs.to(sdt).reshape(sshape) if gs is not None else None), None, None
