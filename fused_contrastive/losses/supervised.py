"""The supervised family: SupCon (Khosla et al. 2020, L_out and L_in, SimCLR without labels) and
DSCL (Xuan et al. 2024). Positives by label equality or a weight mask over a view-major contrast set,
optionally followed by a memory-bank queue; the core op's positive-set statistics (SET, LSEpos).
Common arguments: see :mod:`fused_contrastive.losses`."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validate as V
from .. import core
from .. import distributed as D
from .._amp import autocast_off
from .._backend import resolve
from ..core import reference as ref
from ..core.spec import Coeffs, CoreData, compute_dtype
from ._levels import leveled
from ._scope import Scope, spec, temperature_factor

__all__ = ["dscl_loss", "supcon_loss"]


@D.agreed
@leveled("features", "queue", views=("features",))
@autocast_off
def supcon_loss(
    features: Tensor,
    labels: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    temperature=0.07,
    base_temperature=0.07,
    contrast_mode: str = "all",
    variant: str = "out",
    queue: Tensor | None = None,
    queue_labels: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    gather=False,
    _levels=None,
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020) with SupContrast's semantics.

    Args:
        features: [bsz, n_views, D] (or [bsz, D] for one view); trailing dims past 3 are flattened.
            The contrast set is the views concatenated view-major: row ``v * bsz + k`` is view v of k.
        labels: [bsz] integer classes; or ``mask`` [bsz, bsz] non-negative weights, ``mask[i, j]``
            > 0 when j is a positive of i (may be asymmetric; not both). Neither: SimCLR
            (positives are the other views of the same sample; needs n_views >= 2).
        temperature / base_temperature: floats or 0-dim tensors (differentiable); the per-anchor loss
            is multiplied by ``temperature / base_temperature``.
        contrast_mode: ``"all"`` (every view is an anchor) or ``"one"`` (only view 0).
        variant: ``"out"`` (L_out: mean of positive log-probabilities) or ``"in"`` (L_in: log of the
            mean positive probability).
        queue: [K, D] extra contrast columns (a memory bank; no gradient reaches it) with
            ``queue_labels`` [K] (needed when labels are given; without labels queue rows are
            negatives only).

    An anchor with no positive contributes 0 and still counts in the mean (over all anchors). Returns
    a 0-dim loss or per-anchor losses [n_anchors] (view-major) with ``reduction="none"``.
    """
    features = V.views("features", features)
    bsz, n_views, d = features.shape
    dev = features.device
    reduction = V.reduction(reduction)
    contrast_mode = V.choice("contrast_mode", contrast_mode, ("all", "one"))
    variant = V.choice("variant", variant, ("out", "in"))
    V.flag("normalize", normalize)
    if labels is not None and mask is not None:
        raise ValueError("give labels or mask, not both")
    if labels is not None:
        labels = V.labels("labels", labels, bsz, dev)
    scope = Scope(gather)
    if mask is not None:  # under gather, its columns (the global batch) are checked when the ranks agree
        mask = V.mask(mask, bsz, dev, cols=None if scope.local else -1)
    if labels is None and mask is None and n_views == 1:
        raise ValueError("features has one view and neither labels nor mask is given: every anchor's only "
                         "positive would be itself, which is excluded, so the loss would be 0 with zero "
                         "gradient; pass labels or mask, or features [bsz, n_views >= 2, D]")
    queue, queue_labels = V.queue(queue, queue_labels, labels, d, dev, mask is not None)
    dt = compute_dtype(features, queue)
    s, t = V.scale_of(temperature, None, 0.07, dt, dev)
    bt = V.positive_number("base_temperature", base_temperature, device=dev)
    be = resolve(backend, features, queue)
    off, bsz_g = scope.agree(s, rows=bsz, cols=None if mask is None else mask.shape[1])
    blocks = range(n_views) if contrast_mode == "all" else range(1)  # the anchors: these views
    n_anchors = len(blocks) * bsz_g
    if be == "reference":  # the global problem, then this rank's anchor rows
        feats = scope.rows(features, "features")[0]
        lab = scope.rows(labels, "labels")[0] if labels is not None else None
        full_mask = scope.rows(mask, "mask")[0] if mask is not None else None
        q, ql = _queue(scope, queue, queue_labels, feats.dtype)
        per = ref.supcon(feats, lab, full_mask, s, t, bt, contrast_mode, variant, q, ql, normalize, "none")
        per = torch.cat([per[v * bsz_g + off:v * bsz_g + off + bsz] for v in blocks])
        return scope.reduce(per, reduction, n_anchors)
    # (unbind, not features[:, v]: its backward is one stack, not a zero-filled copy of features per view)
    views = [scope.rows(x, "features")[0] for x in torch.unbind(features, dim=1)]
    q, ql = _queue(scope, queue, queue_labels, views[0].dtype)
    contrast = torch.cat(views + ([q] if q is not None else []))  # view-major, then the queue
    m = contrast.shape[0]
    n_contrast = n_views * bsz_g
    if mask is not None:
        data_labels = None
    else:
        lab = labels if labels is not None else torch.arange(bsz, device=dev) + off  # SimCLR: (global) ids
        col = scope.rows(lab, "labels")[0].repeat(n_views)
        if q is not None:
            # SimCLR with a queue: queue rows are negatives only (-1 never equals an arange label)
            col = torch.cat([col, ql if ql is not None else torch.full((q.shape[0],), -1, device=dev)])
        data_labels = (lab, col)
    if scope.local:  # every anchor view in one call: rows [0, n) of the contrast set (B is A when n == m)
        n = len(blocks) * bsz
        calls = [(contrast if n == m else contrast[:n], None if n == m else contrast, 0,
                  None if data_labels is None else data_labels[1][:n])]
    else:  # one call per anchor view v: this rank's rows, their own columns at v * global bsz + offset
        calls = [(features[:, v], contrast, v * bsz_g + off, None if data_labels is None else data_labels[0])
                 for v in blocks]
    keep = reduction != "none"
    lv = None if _levels is None else _levels.core
    outs = []
    for a, b, own, row_labels in calls:
        data = CoreData(pos_mask=mask) if mask is not None else CoreData(row_labels=row_labels,
                                                                          col_labels=data_labels[1])
        sp = spec(normalize, exclude_self=True, offset=own, grad_cols=n_contrast if q is not None else None)
        n_pos = core.positive_counts(sp, data, a.shape[0], m, contrast)
        has = n_pos > 0
        hp = has.to(n_pos.dtype)
        safe_n = torch.where(has, n_pos, torch.ones_like(n_pos))
        if variant == "out":
            out = core.run(be, a, b, s, sp, data, Coeffs(lse=hp, set=hp / safe_n), reduce=keep, levels=lv)
        else:
            const = hp * torch.log(safe_n)
            out = core.run(be, a, b, s, sp, data, Coeffs(lse=hp, pos=-hp), reduce=keep, levels=lv)
            out = out + (const.sum() if keep else const)
        outs.append(out)
    out = scope.reduce(sum(outs[1:], outs[0]) if keep else torch.cat(outs, dim=-1), reduction, n_anchors,
                       leveled=lv is not None)
    return out * temperature_factor(t, bt, out)


@D.agreed
@leveled("features", "queue", views=("features",))
@autocast_off
def dscl_loss(
    features: Tensor,
    labels: Tensor,
    *,
    beta: float = 8.0,
    temperature=0.07,
    base_temperature=None,
    queue: Tensor | None = None,
    queue_labels: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    gather=False,
    _levels=None,
) -> Tensor:
    """Decoupled supervised contrastive loss (DSCL, Xuan et al., AAAI 2024).

    Args:
        features: [bsz, 2, D]; anchors are view 0, the contrast set is ``[view 0; view 1; queue]``.
        labels: [bsz] integer classes; positives of anchor i are the contrast rows with its label,
            itself excluded (so its own view 1 is always one).
        beta: weight of the other positives: anchor i's own view 1 has weight 1, each of the other
            ``|P_i| - 1`` positives ``beta / (|P_i| - 1)``.
        base_temperature: None means equal to ``temperature``; a float or 0-dim tensor otherwise.
        queue / queue_labels: [K, D] / [K] memory bank columns (no gradient).

    Per anchor: ``-(t / t_base) * sum_j w_ij log p_ij / sum_j w_ij``. Returns a 0-dim loss (mean over
    anchors) or [bsz] per-anchor losses.
    """
    features = V.views("features", features)
    bsz, n_views, d = features.shape
    dev = features.device
    if n_views != 2:
        raise ValueError(f"features must be [bsz, 2, D] (two views), got {tuple(features.shape)}")
    if labels is None:
        raise ValueError("labels is required by dscl_loss")
    labels = V.labels("labels", labels, bsz, dev)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    beta = V.number("beta", beta, low=0.0, strict=False)
    queue, queue_labels = V.queue(queue, queue_labels, labels, d, dev, False)
    dt = compute_dtype(features, queue)
    s, t = V.scale_of(temperature, None, 0.07, dt, dev)
    bt = t if base_temperature is None else V.positive_number("base_temperature", base_temperature, device=dev)
    be = resolve(backend, features, queue)
    scope = Scope(gather)
    scope.agree(s)
    lab_g, off, bsz_g = scope.rows(labels, "labels")
    if be == "reference":  # the global problem, then this rank's anchor rows
        feats = scope.rows(features, "features")[0]
        q, ql = _queue(scope, queue, queue_labels, feats.dtype)
        per = ref.dscl(feats, lab_g, s, t, None if base_temperature is None else bt, beta, q, ql, normalize, "none")
        return scope.reduce(per[off:off + bsz], reduction, bsz_g)
    views = [scope.rows(x, "features")[0] for x in torch.unbind(features, dim=1)]
    q, ql = _queue(scope, queue, queue_labels, views[0].dtype)
    contrast = torch.cat(views + ([q] if q is not None else []))  # [view 0; view 1; queue]
    col = torch.cat([lab_g, lab_g] + ([ql] if q is not None else []))
    sp = spec(normalize, exclude_self=True, offset=off, grad_cols=2 * bsz_g if q is not None else None)
    own = torch.arange(bsz, device=dev) + bsz_g + off  # anchor i's own view 1
    data = CoreData(target=own, row_labels=labels, col_labels=col)
    n_pos = core.positive_counts(sp, data, bsz, contrast.shape[0], contrast)  # >= 1: the own view 1
    # weighted mean of the positive logits (own view 1 weight 1, the o = |P| - 1 others beta / o each):
    # (own + (beta / o) (SET - own)) / (1 + beta) = k SET / o + (1 - k - k / o) own, k = beta / (1 + beta);
    # without others it is own alone (k = 0)
    k = (n_pos > 1).to(n_pos.dtype) * (beta / (1.0 + beta))
    c_set = k / (n_pos - 1).clamp_min_(1)
    coef = Coeffs(lse=1.0, tgt=1.0 - k - c_set, set=c_set)
    a = contrast[:bsz] if scope.local else features[:, 0]  # this rank's view 0 (locally a prefix of B)
    lv = None if _levels is None else _levels.core
    out = core.run(be, a, contrast, s, sp, data, coef, reduce=reduction != "none", levels=lv)
    out = scope.reduce(out, reduction, bsz_g, leveled=lv is not None)
    return out * temperature_factor(t, bt, out)


def _queue(scope: Scope, queue: Tensor | None, queue_labels: Tensor | None, dtype):
    """The (gathered) memory bank and its labels: extra columns, detached (no gradient reaches a queue)."""
    if queue is None:
        return None, None
    q = scope.rows(queue.detach().to(dtype), "queue")[0]
    return q, (scope.rows(queue_labels, "queue_labels")[0] if queue_labels is not None else None)
