"""Alignment and uniformity (Wang and Isola, 2020; seed 002), the two metrics SimCSE is evaluated by.

* ``alignment(x, y, alpha)  = mean_i ||x_i - y_i||^alpha`` over positive pairs (x_i, y_i): O(N*D) as
  written.
* ``uniformity(x, t) = log mean_{i != j} exp(-t ||x_i - x_j||^2)``: the N x N distance matrix of the
  textbook formula (``torch.pdist(x).pow(2).mul(-t).exp().mean().log()``) is never formed. With
  ``n_i = ||x_i||^2`` (of the normalised rows when ``normalize``),

      -t ||x_i - x_j||^2 = <u_i, v_j>,   u_i = [2t x_i, -t n_i, 1],   v_j = [x_j, 1, -t n_j]

  (D + 2 columns), so ``uniformity = logsumexp_i LSE_i - log(N (N - 1))`` with the row log-sum-exps
  ``LSE_i = log sum_{j != i} exp(<u_i, v_j>)`` of the core op of every InfoNCE loss (scale 1, the own
  column excluded): O(N*D) memory, one pass, exact gradients, on any backend. The shorter
  ``||x_i - x_j||^2 = 2 - 2 <x_i, x_j>`` holds only for unit rows: a zero row (normalised to 0) or a
  row of norm below ``eps`` (normalised to ``x / eps``, norm < 1) would get the wrong distance, so the
  norms are kept in the augmented columns.

  Near-duplicate rows cancel: their pair's gradient ``x_i - x_j`` comes out of the inner-product form
  as a difference of two terms of size ``4t``, so in float32 a duplicated row at t = 20 has a relative
  gradient error of 1e-3 to 1e-1 where the textbook's ``x_i - x_j`` is exact. The torch backend
  therefore runs this metric in float64 whatever the input dtype (the result is float32 for 16/32-bit
  inputs, as documented); the triton backend computes in float32 and has that error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validate as V
from . import core
from ._amp import autocast_off
from ._backend import resolve
from .core.norms import unit_rows
from .core.spec import Coeffs, CoreData, CoreSpec, compute_dtype

__all__ = ["alignment", "uniformity"]

_EPS = 1e-12


@autocast_off
def alignment(x: Tensor, y: Tensor, alpha: float = 2.0, *, normalize: bool = True,
              backend: str = "auto") -> Tensor:
    """Alignment of positive pairs: ``mean_i ||x_i - y_i||_2 ^ alpha`` (Wang and Isola 2020).

    Args:
        x: [N, D] embeddings; y: [N, D] their positives (pair i is (x_i, y_i)). Any floating dtype.
        alpha: the exponent, a float > 0 (default 2: the squared distance).
        normalize: L2-normalise the rows first (default True: the metric is defined on the unit
            sphere; already-normalised rows are unchanged by it).
        backend: "auto" (default), "torch" or "reference": the same elementwise O(N*D) PyTorch code
            (nothing here is N x N, so there is no kernel); "triton" raises ``ValueError``. Accepted so
            that every metric and loss takes the same argument.

    Returns:
        0-dim tensor, float32 (float64 for float64 inputs), differentiable. Lower is better
        (0 when every pair coincides; at most ``2^alpha`` for unit rows).

    The gradient at a pair with ``x_i == y_i`` is 0 (the subgradient; the distance is not
    differentiable there for ``alpha <= 1``).
    """
    x = V.embeddings("x", x)
    y = V.paired("x", x, "y", y)
    alpha = V.number("alpha", alpha, low=0.0, strict=True)
    V.flag("normalize", normalize)
    resolve(backend, x, y, op="alignment")
    dt = compute_dtype(x, y)
    xs, ys = x.to(dt), y.to(dt)
    if normalize:
        xs, ys = unit_rows(xs, _EPS), unit_rows(ys, _EPS)
    diff = xs - ys
    if alpha == 2.0:
        return (diff * diff).sum(dim=1).mean()
    dist = torch.linalg.vector_norm(diff, dim=1)
    pos = dist > 0
    # pow of a zero distance has an infinite or undefined slope for alpha <= 1: take the value 0 and
    # a zero gradient there (the where keeps NaN/inf out of the backward)
    safe = torch.where(pos, dist, torch.ones_like(dist))
    return torch.where(pos, safe.pow(alpha), torch.zeros_like(dist)).mean()


@autocast_off
def uniformity(x: Tensor, t=2.0, *, normalize: bool = True, backend: str = "auto") -> Tensor:
    """Uniformity: ``log mean_{i != j} exp(-t ||x_i - x_j||_2^2)`` over all ordered pairs of distinct
    rows (Wang and Isola 2020), in O(N*D) memory: nothing N x N is allocated (module docstring).

    Args:
        x: [N, D] embeddings, N >= 2. Any floating dtype (the triton backend takes 16/32-bit).
        t: the temperature of the Gaussian potential, a float > 0 or a 0-dim tensor (differentiable);
            default 2.
        normalize: L2-normalise the rows first (default True: the metric is defined on the unit
            sphere). With False the raw Euclidean distances are used.
        backend: "auto" (default), "torch", "triton" or "reference" (the textbook formula on the
            materialised distance matrix; for tests), as for the losses (docs/backends.md).

    Returns:
        0-dim tensor, float32 (float64 for float64 inputs), differentiable. Lower is more uniform;
        for unit rows it lies in ``[-4t, 0]``.
    """
    x = V.embeddings("x", x)
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"uniformity needs at least 2 rows (it averages over pairs i != j), got {n}")
    V.flag("normalize", normalize)
    dt = compute_dtype(x)
    t = V.positive_number("t", t, device=x.device)
    if isinstance(t, Tensor):
        t = t.to(device=x.device, dtype=dt)
    be = resolve(backend, x)
    if be == "reference":
        xs = x.to(dt)
        if normalize:
            xs = unit_rows(xs, _EPS)
        sq = (xs[:, None, :] - xs[None, :, :]).pow(2).sum(-1)
        off = ~torch.eye(n, dtype=torch.bool, device=x.device)
        return torch.logsumexp((-t * sq)[off], dim=0) - _log_pairs(sq.diagonal())
    # torch: float64 (module docstring: duplicated rows cancel); triton: its float32 accumulation
    xs = x.to(torch.float64 if be == "torch" else dt)
    if isinstance(t, Tensor):
        t = t.to(xs.dtype)
    if normalize:
        xs = unit_rows(xs, _EPS)
    sq = (xs * xs).sum(dim=1, keepdim=True)
    one = torch.ones_like(sq)
    u = torch.cat([2 * t * xs, -t * sq, one], dim=1)
    v = torch.cat([xs, one, -t * sq], dim=1)
    # (u, v stay in the compute dtype: the distance is a difference of large terms, which 16-bit
    # operands would round away)
    spec = CoreSpec(normalize=False, eps=_EPS, exclude_self=True)
    lse = core.run(be, u, v, 1.0, spec, CoreData(), Coeffs(lse=1.0), reduce=False)
    return (torch.logsumexp(lse, dim=0) - _log_pairs(lse)).to(dt)


def _log_pairs(row: Tensor) -> Tensor:
    """``log(N (N - 1))`` for an [N] tensor, computed from its size as tensor ops: ``math.log`` of N
    would make ``torch.compile`` specialise on the batch size (a recompile per N)."""
    cnt = torch.ones_like(row).sum()
    return torch.log(cnt) + torch.log(cnt - 1)
