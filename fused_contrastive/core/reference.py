"""The reference backend: every loss written naively from its definition.

It materialises the full logits matrix and uses ``F.cross_entropy`` / ``logsumexp``; O(N*M) memory.
It shares no code with the other backends and is the oracle of the test-suite. Arguments arrive
validated from ``losses/`` / ``cosent.py``; ``s`` is the scale (1 / temperature), a number or a
0-dim tensor.

Rows are normalised as ``x / max(||x||, eps)`` with the norm taken as ``m * ||x / m||`` (``m`` the row's
largest magnitude), so a finite row never overflows when squared (``F.normalize`` squares in the input
dtype and maps rows with norms above ~1.8e19 in float32 to 0).

:func:`computing_in` makes every function here compute in a given dtype instead of float32 /
float64: the test-suite's accuracy rule uses it to measure PyTorch's own error in a half dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

_EPS = 1e-12
_FORCED: torch.dtype | None = None


@contextlib.contextmanager
def computing_in(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, the reference computes in ``dtype`` (e.g. bfloat16: PyTorch's same-dtype
    error) instead of float32 (float64 for float64 inputs)."""
    global _FORCED
    prev, _FORCED = _FORCED, dtype
    try:
        yield
    finally:
        _FORCED = prev


def _dt(*xs) -> torch.dtype:
    if _FORCED is not None:
        return _FORCED
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _scalar(s, dt):
    return s.to(dt) if isinstance(s, Tensor) else s


def _unit(x: Tensor, normalize: bool, dt) -> Tensor:
    """x / max(||x||, eps) along the last dim, the norm computed as m * ||x / m|| (no overflow)."""
    x = x.to(dt)
    if not normalize:
        return x
    m = x.detach().abs().amax(dim=-1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    xs = x / m
    r = torch.linalg.vector_norm(xs, dim=-1, keepdim=True)
    keep = r * m > _EPS
    return torch.where(keep, xs / torch.where(keep, r, torch.ones_like(r)), x / _EPS)


def _self_mask(n: int, m: int, offset: int, device) -> Tensor:
    """[n, m] bool, True at (i, offset + i)."""
    return torch.arange(m, device=device)[None, :] == (torch.arange(n, device=device) + offset)[:, None]


def smoothed_cross_entropy(logits: Tensor, target: Tensor, label_smoothing: float) -> Tensor:
    """Per row ``F.cross_entropy(logits_i, target_i, label_smoothing=eps)`` over the finite columns only (an
    excluded column is -inf here; the textbook form would spread ``eps / M`` onto it and return inf):
    ``(1 - eps) (LSE - l_t) + eps (LSE - mean of the finite logits)``."""
    lse = torch.logsumexp(logits, dim=1)
    kept = logits > float("-inf")
    mean = torch.where(kept, logits, torch.zeros_like(logits)).sum(dim=1) / kept.sum(dim=1)
    picked = logits.gather(1, target[:, None])[:, 0]
    return (1 - label_smoothing) * (lse - picked) + label_smoothing * (lse - mean)


def info_nce(query, keys, target, s, exclude_self, symmetric, normalize, reduction, ignore_index, offset=0,
             label_smoothing=0.0, row_negatives=None):
    """``offset``: the anchors' own columns are ``offset + i`` (anchors that are a slice of the keys).
    ``row_negatives`` [N, K, D]: row i's own K extra columns ``s <q_i, n_ik>``, appended to row i's logits."""
    dt = _dt(query, keys)
    q = _unit(query, normalize, dt)
    k = q if keys is None else _unit(keys, normalize, dt)
    logits = (q @ k.T) * _scalar(s, dt)
    if exclude_self:
        logits = logits.masked_fill(_self_mask(q.shape[0], k.shape[0], offset, q.device), float("-inf"))
    if row_negatives is not None:
        own = torch.einsum("nd,nkd->nk", q, _unit(row_negatives, normalize, dt)) * _scalar(s, dt)
        logits = torch.cat([logits, own], dim=1)
    if exclude_self and label_smoothing:
        return _reduce(smoothed_cross_entropy(logits, target, label_smoothing), reduction)
    ce = dict(label_smoothing=label_smoothing)
    if symmetric:
        rows = F.cross_entropy(logits, target, reduction="none", **ce)
        cols = F.cross_entropy(logits.T, target, reduction="none", **ce)
        per = (rows + cols) / 2
        return per if reduction == "none" else (per.sum() if reduction == "sum" else per.mean())
    return F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index, **ce)


def debiased(query, keys, target, s, tau_plus, exclude_self, symmetric, normalize, offset=0, label_smoothing=0.0):
    """The debiased contrastive loss (Chuang et al. 2020, eq. 6) per row from its definition, on the
    materialised logits shifted by their row maximum ``c_i`` (so that no ``e^l`` overflows)::

        loss_i = -l_pos + log(e^{l_pos} + n_neg max((mean_neg e^{l_j} - tau e^{l_pos}) / (1 - tau), e^{-s}))

    negatives every column but the target and the excluded own column; ``symmetric``: the mean of the row
    and the column (transposed) loss per pair; plus ``label_smoothing`` times ``l_pos - mean_j l_ij`` over the
    softmax's columns (memeff's sum)."""
    dt = _dt(query, keys)
    q = _unit(query, normalize, dt)
    k = q if keys is None else _unit(keys, normalize, dt)
    sd = _scalar(s, dt)
    logits = (q @ k.T) * sd
    tau = tau_plus.to(dt) if isinstance(tau_plus, Tensor) else tau_plus
    cols = torch.arange(k.shape[0], device=q.device)[None, :]

    def one(lg: Tensor, excl: Tensor) -> Tensor:
        pos = lg.gather(1, target[:, None])[:, 0]
        neg = ~excl & (cols != target[:, None])
        c = lg.detach().amax(dim=1)
        e = torch.where(neg, (lg - c[:, None]).exp(), torch.zeros_like(lg))
        n_neg = neg.sum(dim=1).to(dt)
        est = (e.sum(dim=1) / n_neg - tau * (pos - c).exp()) / (1 - tau)
        ng = n_neg * torch.maximum(est, torch.exp(-sd - c))
        per = -(pos - c) + torch.log((pos - c).exp() + ng)
        if label_smoothing:
            kept = ~excl
            mean = torch.where(kept, lg, torch.zeros_like(lg)).sum(dim=1) / kept.sum(dim=1)
            per = per + label_smoothing * (pos - mean)
        return per

    own = _self_mask(q.shape[0], k.shape[0], offset, q.device) if exclude_self else \
        torch.zeros(logits.shape, dtype=torch.bool, device=q.device)
    per = one(logits, own)
    if symmetric:
        per = (per + one(logits.T, own)) / 2
    return per


def margin_cross_entropy(query, keys, target, s, margin, symmetric, normalize, label_smoothing=0.0):
    """Cross-entropy with an additive target margin (AM-softmax; LaBSE, Yang et al. 2019), per query row,
    from the definition: the logits ``s cos(q_i, k_j)`` with ``s margin`` taken off each row's target
    ``t_i`` (``am_softmax_loss``'s oracle); the row form is
    ``CE(logits_i, t_i)``, the symmetric form the mean of it and the column form ``CE(logits^T_{t_i}, i)``
    (the keys as anchors against the queries; needs every column to be one row's target: ``t`` a
    permutation, as LaBSE's pairs)."""
    dt = _dt(query, keys)
    q = _unit(query, normalize, dt)
    k = _unit(keys, normalize, dt)
    cos = q @ k.T
    sd = _scalar(s, dt)
    shift = torch.zeros_like(cos).scatter_(1, target[:, None], margin)
    logits = (cos - shift) * sd
    rows = F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)
    if not symmetric:
        return rows
    cols = F.cross_entropy(logits.T, torch.argsort(target), reduction="none",  # column t_i's target row is i
                           label_smoothing=label_smoothing)
    return (rows + cols[target]) / 2


def simcse_sup(anchor, positive, negative, s, hard_negative_weight, normalize, reduction, offset=0,
               label_smoothing=0.0):
    """``offset``: anchor i's positive and negative are rows ``offset + i`` of ``positive`` / ``negative``
    (which may hold more rows: other ranks' examples)."""
    dt = _dt(anchor, positive, negative)
    a, p, n = (_unit(x, normalize, dt) for x in (anchor, positive, negative))
    sd = _scalar(s, dt)
    own = _self_mask(a.shape[0], n.shape[0], offset, a.device).to(dt)
    neg = (a @ n.T) * sd + hard_negative_weight * own
    logits = torch.cat([(a @ p.T) * sd, neg], dim=1)
    return F.cross_entropy(logits, torch.arange(a.shape[0], device=a.device) + offset, reduction=reduction,
                           label_smoothing=label_smoothing)


def dcl_rows(anchors, contrast, s, own, partner, weight, normalize):
    """Decoupled contrastive learning (Yeh et al. 2022, eq. 6), per anchor row, from the definition:
    ``-w_i l_{i, partner_i} + log sum_{j not in (own_i, partner_i)} exp(l_ij)`` with ``l = s cos``.
    ``own`` / ``partner``: [n] column indices; ``weight``: [n] or None (1)."""
    dt = _dt(anchors, contrast)
    a = _unit(anchors, normalize, dt)
    c = _unit(contrast, normalize, dt)
    logits = (a @ c.T) * _scalar(s, dt)
    cols = torch.arange(c.shape[0], device=a.device)[None, :]
    pos = logits.gather(1, partner[:, None])[:, 0]
    neg = logits.masked_fill((cols == own[:, None]) | (cols == partner[:, None]), float("-inf"))
    w = 1.0 if weight is None else weight.to(dt)
    return torch.logsumexp(neg, dim=1) - w * pos


def dclw_weights(z1, z2, sigma, normalize):
    """DCLW's positive weights ``2 - N softmax_i(<z1_i, z2_i> / sigma)`` (no gradient)."""
    dt = _dt(z1, z2)
    with torch.no_grad():
        d = (_unit(z1, normalize, dt) * _unit(z2, normalize, dt)).sum(dim=1)
        return 2.0 - z1.shape[0] * torch.softmax(d / sigma, dim=0)


def _reduce(per: Tensor, reduction: str) -> Tensor:
    return per if reduction == "none" else (per.sum() if reduction == "sum" else per.mean())


def supcon(features, labels, mask, s, t, base_temperature, contrast_mode, variant, queue, queue_labels,
           normalize, reduction):
    """SupContrast's algorithm, without its max shift and 1e-30 fudge (exact), plus queue columns."""
    dt = _dt(features, queue)
    bsz, n_views, _ = features.shape
    dev = features.device
    f = _unit(features, normalize, dt)
    contrast = torch.cat(torch.unbind(f, dim=1), dim=0)
    anchors = contrast if contrast_mode == "all" else f[:, 0]
    n_anchor_views = n_views if contrast_mode == "all" else 1
    if mask is None:
        lab = labels if labels is not None else torch.arange(bsz, device=dev)
        mask = (lab[:, None] == lab[None, :]).to(dt)
    else:
        mask = mask.to(dt)
    pos = mask.repeat(n_anchor_views, n_views)
    if queue is not None:
        q = _unit(queue.detach(), normalize, dt)
        contrast = torch.cat([contrast, q])
        if queue_labels is not None:
            lab_rows = labels.repeat(n_anchor_views)
            qpos = (lab_rows[:, None] == queue_labels[None, :]).to(dt)
        else:
            qpos = torch.zeros(pos.shape[0], q.shape[0], dtype=dt, device=dev)
        pos = torch.cat([pos, qpos], dim=1)
    logits = (anchors @ contrast.T) * _scalar(s, dt)
    self_m = _self_mask(anchors.shape[0], contrast.shape[0], 0, dev)
    pos = pos.masked_fill(self_m, 0)
    logits = logits.masked_fill(self_m, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    n_pos = pos.sum(dim=1)
    has = n_pos > 0
    safe = torch.where(has, n_pos, torch.ones_like(n_pos))
    if variant == "out":
        # 0 * (-inf) at the excluded self column must read as 0
        term = torch.where(pos != 0, pos * log_prob, torch.zeros_like(log_prob)).sum(dim=1) / safe
    else:
        lp = log_prob + torch.log(pos)  # log(w_ij p_ij), -inf off the positives
        # rows without a positive are all -inf: give them finite logits so that their (discarded)
        # logsumexp has a finite gradient instead of 0 * nan
        lp = torch.where(has[:, None], lp, torch.zeros_like(lp))
        term = torch.logsumexp(lp, dim=1) - torch.log(safe)
    per = torch.where(has, -term, torch.zeros_like(term))
    return _scalar(t / base_temperature, dt) * _reduce(per, reduction)


def dscl(features, labels, s, t, base_temperature, beta, queue, queue_labels, normalize, reduction):
    """DSCL by its definition: an explicit [bsz, 2*bsz + K] weight matrix over the contrast set."""
    dt = _dt(features, queue)
    bsz = features.shape[0]
    dev = features.device
    f = _unit(features, normalize, dt)
    anchors = f[:, 0]
    contrast = torch.cat([f[:, 0], f[:, 1]])
    col_lab = labels.repeat(2)
    if queue is not None:
        contrast = torch.cat([contrast, _unit(queue.detach(), normalize, dt)])
        col_lab = torch.cat([col_lab, queue_labels])
    logits = (anchors @ contrast.T) * _scalar(s, dt)
    self_m = _self_mask(bsz, contrast.shape[0], 0, dev)
    logits = logits.masked_fill(self_m, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    pos = (labels[:, None] == col_lab[None, :]) & ~self_m
    own = _self_mask(bsz, contrast.shape[0], bsz, dev)
    n_pos = pos.sum(dim=1, keepdim=True).to(dt)
    others = n_pos - 1
    w = torch.where(pos, beta / others.clamp_min(1), torch.zeros_like(log_prob))
    w = torch.where(own, torch.ones_like(w), w)
    mean = torch.where(w != 0, w * log_prob, torch.zeros_like(log_prob)).sum(dim=1) / w.sum(dim=1)
    tb = t if base_temperature is None else base_temperature
    return _scalar(t / tb, dt) * _reduce(-mean, reduction)


def pair_cosines(u: Tensor, v: Tensor, normalize: bool) -> Tensor:
    """cos(u_i, v_i) per pair (the raw dot product without normalisation)."""
    dt = _dt(u, v)
    return (_unit(u, normalize, dt) * _unit(v, normalize, dt)).sum(dim=-1)


def cosent(scores: Tensor, labels: Tensor, scale) -> Tensor:
    """CoSENT with the B x B pair matrix: log(1 + sum_{y_a > y_b} exp(scale * (s_b - s_a)))."""
    dt = _dt(scores)
    u = scores.to(dt) * (scale.to(dt) if isinstance(scale, Tensor) else scale)
    diff = u[None, :] - u[:, None]  # [a, b] -> u_b - u_a
    pairs = labels[:, None] > labels[None, :]
    terms = torch.cat([torch.zeros(1, dtype=dt, device=u.device), diff[pairs]])
    return torch.logsumexp(terms, dim=0)


def qwen3_embedding(query, docs, d_all, q_all, row_negatives, s, margin, query_query, doc_doc, normalize, offset):
    """The Qwen3-Embedding InfoNCE per query row (``losses/qwen3.py`` has the math), materialised: the blocks
    ``[q d_all^T | q q_all^T | d d_all^T | <q_i, n_ik>] * s`` side by side, a column at ``-inf`` when its
    cosine (no gradient) is ``> cos(q_i, d_i) + margin``, the positive (column ``offset + i`` of the first
    block) always kept, the own columns of the q-q and d-d blocks always dropped."""
    dt = _dt(query, docs)
    n = query.shape[0]
    idx = torch.arange(n, device=query.device)
    own = idx + offset
    sc = _scalar(s, dt)

    def cos_of(x):
        return _unit(x.detach(), True, dt)

    cq, cd = cos_of(query), cos_of(docs)
    gpos = (cq * cd).sum(-1)
    q = _unit(query, normalize, dt)

    def block(rows, cols, c_rows, c_cols, *, protect: bool):
        logits = (rows @ cols.T) * sc
        drop = (c_rows @ c_cols.T) > (gpos + margin)[:, None]
        drop[idx, own] = not protect  # the positive kept; the own query / document dropped
        return logits.masked_fill(drop, float("-inf"))

    parts = [block(q, _unit(d_all, normalize, dt), cq, cos_of(d_all), protect=True)]
    if query_query:
        parts.append(block(q, _unit(q_all, normalize, dt), cq, cos_of(q_all), protect=False))
    if doc_doc:
        parts.append(block(_unit(docs, normalize, dt), _unit(d_all, normalize, dt), cd, cos_of(d_all), protect=False))
    if row_negatives is not None:
        own_neg = torch.einsum("nd,nkd->nk", q, _unit(row_negatives, normalize, dt)) * sc
        drop = torch.einsum("nd,nkd->nk", cq, cos_of(row_negatives)) > (gpos + margin)[:, None]
        parts.append(own_neg.masked_fill(drop, float("-inf")))
    logits = torch.cat(parts, dim=1)
    return torch.logsumexp(logits, dim=1) - logits[idx, own]
