"""CoSENT in O(B log B) time and O(B) memory.

    L = log(1 + sum_{(a, b): y_a > y_b} exp(u_b - u_a)),   u = scale * s

where ``s`` is the cosine of each pair (or any given score). Only the order of the labels matters;
tied labels add no term. Factor the double sum: ``sum_a exp(-u_a) * sum_{b: y_b < y_a} exp(u_b)``.
With the pairs sorted by label ascending, the inner sum is an *exclusive* prefix over strictly
smaller labels: ``logcumsumexp(u_sorted)`` read just before the start of a's tie group (-inf when the
group is the first). Then ``L = log(1 + sum_a exp(z_a))`` with ``z_a = prefix_a - u_a``, evaluated as
``m + log(exp(-m) + sum_a exp(z_a - m))``, ``m = max(0, max_a z_a)``: no log(0) even when there is no
ordered pair (then L = 0 and every gradient is 0, not NaN). Autograd through sort / gather /
logcumsumexp gives the exact gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _reference as ref
from . import _validate as V
from ._spec import compute_dtype

__all__ = ["cosent_loss", "cosent_loss_from_scores"]


def _check_labels(labels, b: int, device) -> Tensor:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_complex():
        raise TypeError(f"labels must be real, got {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != b:
        raise ValueError(f"labels must have shape [{b}], got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but the scores are on {device}")
    return labels


def _backend(backend: str, *tensors: Tensor) -> str:
    """CoSENT has no kernel: asking for "triton" is an error, while "auto" (which picks triton for
    CUDA tensors) runs the O(B log B) torch path."""
    if backend == "triton":
        raise ValueError('CoSENT has no triton kernel: it is O(B log B) already; use backend="torch" or "auto"')
    be = V.backend(backend, *tensors)
    return "torch" if be == "triton" else be


def _cosent_sorted(u: Tensor, labels: Tensor) -> Tensor:
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


def cosent_loss_from_scores(scores: Tensor, labels: Tensor, *, scale=20.0, backend: str = "auto") -> Tensor:
    """CoSENT on given scores (e.g. a cross-encoder's logits).

    Args:
        scores: [B] floating scores ``s_i`` of the B pairs.
        labels: [B] real labels (any order-comparable values; ties add no term).
        scale: lambda, default 20.0 (float or 0-dim tensor, differentiable).
        backend: "auto"/"torch" (sorted prefix, O(B log B)) or "reference" (B x B pair matrix).

    Returns:
        0-dim float32 loss (float64 for float64 scores).
    """
    scores = V.embeddings("scores", scores, ndim=1)
    labels = _check_labels(labels, scores.shape[0], scores.device)
    V.positive_number("scale", scale, device=scores.device)
    sc = V.as_scalar_tensor(scale, scores.device)
    be = _backend(backend, scores)
    if be == "reference":
        return ref.cosent(scores, labels, sc)
    dt = compute_dtype(scores)
    return _cosent_sorted(scores.to(dt) * sc.to(dt), labels)


def cosent_loss(u: Tensor, v: Tensor, labels: Tensor, *, scale=20.0, backend: str = "auto") -> Tensor:
    """CoSENT on sentence pairs: the score of pair i is ``cos(u_i, v_i)``.

    Args:
        u, v: [B, D] embeddings of the two sides of each pair (any float dtype).
        labels: [B] real labels (similarity grades; only their order matters).
        scale: lambda, default 20.0.

    Returns:
        0-dim float32 loss (float64 for float64 inputs).
    """
    u = V.embeddings("u", u)
    v = V.embeddings("v", v)
    if u.shape != v.shape:
        raise ValueError(f"v must have the shape of u {tuple(u.shape)}, got {tuple(v.shape)}")
    V.same_device(u=u, v=v)
    dt = compute_dtype(u, v)
    cos = (F.normalize(u.to(dt), dim=1, eps=1e-12) * F.normalize(v.to(dt), dim=1, eps=1e-12)).sum(dim=1)
    return cosent_loss_from_scores(cos, labels, scale=scale, backend=backend)
