"""Row L2 normalisation without overflow, shared by every PyTorch code path of the backends.

``x / max(||x||, eps)`` is ``F.normalize``'s definition, but ``F.normalize`` (``vector_norm``) squares in
the input's precision: a float32 or bfloat16 row with norm above ~1.8e19 overflows to ``inf`` and
normalises to 0 (or, through ``inf / inf``, to NaN), although every value is finite. Here norms of
float16 / bfloat16 / float32 rows are accumulated in float64 (whose range holds the square of any
float32), and float64 rows are scaled by their largest magnitude before squaring, as BLAS ``nrm2``
does. Only NaN or infinite inputs give NaN. (A float32 row whose norm itself exceeds the float32
range, elements of ~1e37, normalises with a subnormal inverse norm: imprecise, never NaN.)
"""

from __future__ import annotations

import torch
from torch import Tensor


def clamped_norms(x: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """``max(||x_i||, eps)`` per row of ``x`` [R, D], in ``dtype``, without overflow for finite ``x``."""
    if x.dtype != torch.float64:
        return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).clamp_min_(eps).to(dtype)
    big = x.detach().abs().amax(dim=1)
    big = torch.where(big > 0, big, torch.ones_like(big))  # zero rows (and NaN rows: NaN > 0 is False)
    return (torch.linalg.vector_norm(x / big[:, None], dim=1) * big).clamp_min_(eps).to(dtype)


def normalize_rows(x: Tensor, eps: float, dtype: torch.dtype, normalize: bool = True
                   ) -> tuple[Tensor, Tensor | None]:
    """``(x_hat, norms)``: ``x`` in ``dtype`` divided by its clamped row norms (``norms`` None and
    ``x_hat`` the raw rows when ``normalize`` is False). Not differentiable (used inside autograd
    Functions); see :func:`unit_rows` for the differentiable form."""
    xf = x.to(dtype)
    if not normalize:
        return xf, None
    norm = clamped_norms(x, eps, dtype)
    return xf / norm[:, None], norm


def normalize_backward_(g_hat: Tensor, x_hat: Tensor, norm: Tensor | None, eps: float) -> Tensor:
    """Backward of ``x -> x / max(||x||, eps)``: ``(g - x_hat <g, x_hat>) / ||x||``, or ``g / eps`` for a
    clamped row (then the map is linear). In place on ``g_hat`` (a buffer the caller owns)."""
    if norm is None:
        return g_hat
    proj = torch.linalg.vecdot(g_hat, x_hat, dim=1)
    proj = torch.where(norm > eps, proj, torch.zeros_like(proj))
    g_hat.addcmul_(x_hat, proj[:, None], value=-1.0)
    return g_hat.div_(norm[:, None])


def unit_rows(x: Tensor, eps: float, dtype: torch.dtype, normalize: bool = True) -> Tensor:
    """Differentiable ``x / max(||x||, eps)`` in ``dtype`` (the raw rows when ``normalize`` is False)."""
    xf = x.to(dtype)
    if not normalize:
        return xf
    if x.dtype != torch.float64:
        norm = torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).clamp_min(eps).to(dtype)
        return xf / norm[:, None]
    # x / ||x|| does not depend on the scale: dividing by a detached row maximum first is exact
    big = x.detach().abs().amax(dim=1, keepdim=True)
    xs = x / torch.where(big > 0, big, torch.ones_like(big))
    norm = torch.linalg.vector_norm(xs, dim=1, keepdim=True)
    # the clamp compares the true norm (norm * big) with eps; a clamped row is x / eps. The unused
    # branch divides by 1, not by a zero norm, so its (discarded) gradient is 0, not NaN.
    keep = norm * big > eps
    return torch.where(keep, xs / torch.where(keep, norm, torch.ones_like(norm)), x / eps)
