"""The O(N*D) per-row logit terms of ``label_smoothing=`` and ``tau_plus=`` (the debiased loss), on every
backend: PyTorch autograd on the unit rows beside the core op's call, never an N x M tile.

Label smoothing. ``F.cross_entropy(l_i, t_i, label_smoothing=eps)`` over the columns ``C_i`` a row's
softmax runs over is ``(1 - eps) (LSE_i - l_{i t_i}) + eps (LSE_i - mean_{j in C_i} l_ij)``, i.e. the
unsmoothed loss plus ``eps (l_{i t_i} - mean_{j in C_i} l_ij)``. With ``l_ij = s <a_i, b_j>`` the mean is
``s <a_i, sum_j b_j> / |C_i|`` minus the excluded own column: O(D) per row from the sum of the unit keys.
A bias column (supervised SimCSE's ``hard_negative_weight``) and a target margin (AM-softmax) are
constants of one column, added to the target and to the mean as they are to the logits.

The debiased loss (Chuang et al. 2020). With ``r_i = LSE_i^- - l_{i t_i}`` (the core op with the target
column left out of the log-sum-exp, ``exclude_target``, and coefficients 1 on LSE and on the target) and
``n_i`` the negatives' count, ``loss_i = log(e^{l_pos} + n_i max((mean_neg e^l - tau e^{l_pos}) /
(1 - tau), e^{-s})) - l_pos`` is, in log space, ``softplus(max(r_i + log(1 - n_i tau e^{-r_i}) -
log(1 - tau), log n_i - s - l_pos))`` (:func:`debiased`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.norms import prefix_rows, unit_rows
from ..core.spec import compute_dtype

_EPS = 1e-12


def _units(x: Tensor, normalize: bool, dt: torch.dtype, dims) -> list[Tensor]:
    """The rows as the core op sees them, differentiable: one tensor, or one per Matryoshka level
    (truncated and re-normalised, whatever ``normalize`` says)."""
    x = x.to(dt)
    if dims is None:
        return [unit_rows(x, _EPS) if normalize else x]
    return [prefix_rows(x, d, _EPS) for d in dims]


def columns(n: int, m: int, offset: int, exclude_self: bool, device) -> tuple[Tensor, Tensor]:
    """``(own column of every row clamped into [0, M), whether it is excluded)`` for rows ``offset + i``."""
    own = torch.arange(n, device=device) + offset
    has = (own < m) if exclude_self else torch.zeros(n, dtype=torch.bool, device=device)
    return own.clamp(max=m - 1), has


def logit_terms(query: Tensor, keys: Tensor | None, s, target: Tensor, *, offset: int = 0,
                exclude_self: bool = False, normalize: bool = True, bias_col: Tensor | None = None,
                bias: float = 0.0, margin: float = 0.0, levels=None, transposed: bool = False, means: bool = True
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(TGT, MEAN, MEAN_T)``: per row ``l_{i t_i}`` and ``mean_{j in C_i} l_ij`` ([N], or [K, N] with
    Matryoshka ``levels``), ``C_i`` the columns of row i's softmax (all M but the excluded own column
    ``offset + i``); ``MEAN_T`` (``transposed``: N == M, target the diagonal) the mean of column i over every
    row (CLIP's second direction), else None. ``keys`` None: B is A. ``s`` a number or a 0-dim tensor.
    ``means`` False: TGT alone (MEAN None), from the target rows of the keys only."""
    dt = compute_dtype(query, keys)
    dims = None if levels is None else levels.dims
    qs = _units(query, normalize, dt, dims)
    if not means:  # the target rows alone: N unit rows of the keys, not M
        ts = _units((query if keys is None else keys)[target], normalize, dt, dims)
        tgt = torch.stack([torch.linalg.vecdot(a, b) for a, b in zip(qs, ts, strict=True)])
        tgt = tgt * (s.to(dt) if isinstance(s, Tensor) else s)
        return (tgt if levels is not None else tgt[0]), None, None
    ks = qs if keys is None else _units(keys, normalize, dt, dims)
    n = query.shape[0]
    m = n if keys is None else keys.shape[0]
    own, has = columns(n, m, offset, exclude_self, query.device)
    count = m - has.to(dt)
    sd = s.to(dt) if isinstance(s, Tensor) else s
    tgts, means, means_t = [], [], []
    for a, b in zip(qs, ks, strict=True):
        tgt = torch.linalg.vecdot(a, b[target])
        tot = a @ b.sum(0)
        if exclude_self:
            tot = tot - torch.where(has, torch.linalg.vecdot(a, b[own]), 0.0)
        mean = tot / count
        if margin != 0.0:  # s (c - margin) at the target, which is one of the softmax's columns
            tgt, mean = tgt - margin, mean - margin / count
        tgts.append(tgt * sd)
        means.append(mean * sd)
        if transposed:
            means_t.append((b @ a.sum(0) - margin) / n * sd)
    tgt, mean = torch.stack(tgts), torch.stack(means)
    if bias_col is not None and bias != 0.0:  # the bias column is one of the softmax's columns
        tgt = tgt + bias * (target == bias_col).to(dt)
        mean = mean + bias / count
    mean_t = torch.stack(means_t) if transposed else None
    if levels is None:
        return tgt[0], mean[0], None if mean_t is None else mean_t[0]
    return tgt, mean, mean_t


def smoothing(eps: float, tgt: Tensor, mean: Tensor, mean_t: Tensor | None = None) -> Tensor:
    """What label smoothing adds to the unsmoothed per-row loss: ``eps (TGT - MEAN)``; CLIP's pair
    ``eps (2 TGT - MEAN - MEAN_T) / 2`` (both directions' halves)."""
    if mean_t is None:
        return eps * (tgt - mean)
    return eps * (tgt - (mean + mean_t) / 2)


def negatives(n: int, m: int, offset: int, exclude_self: bool, device, dt) -> Tensor:
    """The debiased loss's negatives per row: every column but the target and the excluded own column."""
    _, has = columns(n, m, offset, exclude_self, device)
    return (m - 1 - has.to(dt)).to(dt)


def debiased(r: Tensor, tgt: Tensor, s, tau, n_neg: Tensor) -> Tensor:
    """The debiased per-row loss from ``r = LSE^- - l_pos`` (the log-sum-exp over the negatives minus the
    positive's logit), ``tgt = l_pos``, the scale ``s``, the prior ``tau`` (a float or an [N] tensor) and
    the negatives' count ``n_neg`` [N]; ``r`` / ``tgt`` [N] or [K, N]. Exact gradients on both sides of
    the floor ``e^{-s}`` (a clamped row's negatives get none; the scale gets the floor's ``-1``)."""
    dt = r.dtype
    tau_t = tau.to(dt) if isinstance(tau, Tensor) else torch.tensor(float(tau), dtype=dt, device=r.device)
    log_n = torch.log(n_neg)
    # x = n tau e^{-r} in (0, 1) on the unclamped branch; at x >= 1 the estimator is <= 0: the floor rules
    e = (log_n + torch.log(tau_t) - r).clamp(max=0.0)
    ok = e < 0
    unclamped = r + torch.log1p(-torch.exp(torch.where(ok, e, -1.0))) - torch.log1p(-tau_t)
    unclamped = torch.where(ok, unclamped, -math.inf)
    sd = s.to(dt) if isinstance(s, Tensor) else s
    floor = log_n - sd - tgt
    z = torch.maximum(unclamped, floor)
    # softplus(z) = log(1 + e^z) exactly (F.softplus returns z itself past z = 20, off by e^-z)
    return torch.logaddexp(z, torch.zeros_like(z))
