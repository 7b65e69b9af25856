"""The cross-entropy family: InfoNCE (in-batch negatives, any target), CLIP, SimCSE (unsupervised
and supervised), the additive-margin softmax (LaBSE). Each row is ``CE(logits_i, target_i)`` over
cosine logits: the core op with coefficients 1 on LSE and on the target logit (CLIP adds the column
LSE; AM-softmax the op's target margin). Common arguments: see
:mod:`fused_contrastive.losses`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _validate as V
from .. import distributed as D
from .._amp import autocast_off
from .._backend import resolve
from ..core import reference as ref
from ..core.spec import compute_dtype
from . import _row_negatives as RN
from ._levels import leveled
from ._scope import DEFAULT_TEMPERATURE as _DEFAULT_TEMPERATURE
from ._scope import Scope, cross_entropy
from .guided import guide_options_unused, guided_info_nce, info_nce_masks


def _split_views(name: str, v, has_negative: bool, interleaved: bool):
    """A mask argument of ``simcse_sup_loss`` as ``(for anchor, for positive[, for negative])``: split from
    interleaved triplets (one tensor) or checked as a sequence of that length."""
    if v is None:
        return None
    want = 3 if has_negative else 2
    if interleaved:
        if v.shape[0] % 3:
            raise ValueError(f"{name} for interleaved triplets must have a multiple of 3 rows, got {v.shape[0]}")
        return (v[0::3], v[1::3], v[2::3])[:want]
    if isinstance(v, Tensor) or not isinstance(v, Sequence) or len(v) != want:
        raise TypeError(f"{name} must be a sequence of {want} tensors (for anchor, positive"
                        f"{', negative' if has_negative else ''})")
    return tuple(v)


def _key_pair(v):
    """(for the rows, for the local columns [positive; negative]) of a split mask argument."""
    if v is None:
        return None
    return v[0], (v[1] if len(v) == 2 else torch.cat([v[1], v[2].to(v[1].dtype)]))

__all__ = ["am_softmax_loss", "clip_loss", "info_nce", "simcse_loss", "simcse_sup_loss"]


@D.agreed
@leveled("query", "keys", "row_negatives", per_level_if=("guide", "ids", "row_negatives"))
@autocast_off
def info_nce(
    query: Tensor,
    keys: Tensor | None = None,
    target: Tensor | None = None,
    *,
    temperature=None,
    scale=None,
    exclude_self: bool | None = None,
    symmetric: bool = False,
    normalize: bool = True,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
    gather=False,
    guide: Tensor | Sequence[Tensor] | None = None,
    guide_margin: float = 0.0,
    guide_margin_strategy: str = "absolute",
    ids: Tensor | Sequence[Tensor] | None = None,
    label_smoothing: float = 0.0,
    tau_plus: float | Tensor = 0.0,
    row_negatives: Tensor | None = None,
    _levels=None,
) -> Tensor:
    """InfoNCE / in-batch-negatives loss, the drop-in for
    ``F.cross_entropy(cos(query, keys) / temperature, target, reduction=..., ignore_index=...)``
    without ever materialising the N x M logits.

    Args:
        query: [N, D] anchors.
        keys: [M, D] contrast set; None means ``keys = query`` (and then ``exclude_self`` defaults
            to True, removing logit (i, i) from the softmax).
        target: [N] integer column index per row; None means ``arange(N)``. Rows equal to
            ``ignore_index`` contribute 0 and leave the mean's denominator.
        temperature / scale: give at most one (``scale = 1 / temperature``); neither means
            temperature 0.05. A float or a 0-dim tensor (differentiable).
        exclude_self: remove column ``i`` from row ``i``'s softmax. An explicit target equal to the
            excluded column (``target[i] == i``) raises a ValueError for a CPU target; a CUDA target's
            values are not read (no host sync per step), and such a row's loss is inf, as the textbook
            formula's. (Under ``gather`` with ``keys`` given the own column is the global ``offset + i``:
            not checked.)
        query / keys dtypes: float64 with float64 only (a TypeError naming both otherwise); 16 / 32-bit
            mixes compute in float32.
        symmetric: CLIP loss, ``(row CE + column CE) / 2``; needs N == M and ``target=None``.
            With ``reduction="none"`` returns ``(row_i + col_i) / 2`` per pair.
        guide: guided negatives (GISTEmbed's rule): a frozen guide model's embeddings of the same
            texts, ``(guide_query [N, Dg], guide_keys [M, Dg])`` (one [N, Dg] tensor when
            ``keys=None``); no gradient flows into them. Column j is left out of row i's softmax when
            ``cos(gq_i, gk_j) > theta_i``, ``theta_i = cos(gq_i, gk_{target_i}) - guide_margin``
            ("absolute") or ``... - |cos(gq_i, gk_{target_i})| * guide_margin`` ("relative",
            ``guide_margin_strategy``); the target column is never left out. ``cos(gq_i, gk_{target_i})``
            is the target entry of the same guide products it is compared with, so an exact duplicate
            of the target ties and is kept (sentence-transformers' rule). Computed per tile, never
            stored. A row whose guide embedding is not finite gets a NaN loss. ``guide_margin`` /
            ``guide_margin_strategy`` other than their defaults without ``guide`` raise a ValueError.
        ids: duplicate masking, ``(query_ids [N], key_ids [M])`` integer (not bool) tensors (one [N] tensor when
            ``keys=None``): column j is left out of row i's softmax when the ids are equal, the target
            column excepted (the same text twice in a batch is not a negative of itself).
            ``guide`` / ``ids`` run the merged-block core (``core/guided/torch_blocks.py``: its PyTorch sweep, or
            its Triton kernels on backend="triton") and are not supported with ``symmetric=True``.
        label_smoothing: ``F.cross_entropy``'s, in [0, 1) (default 0): each row's target becomes
            ``(1 - eps) onehot + eps / |C_i|`` over the columns ``C_i`` its softmax runs over (an excluded own
            column is deleted, not smoothed onto: the textbook form with a -inf column returns inf). Ignored
            rows stay 0. O(N*D) extra work (the row mean of the logits from the sum of the unit keys). With
            ``guide`` / ``ids`` ``C_i`` is what the masks keep: the merged-block core counts and sums the kept
            logits per row in the pass that forms the LSE (its PyTorch sweep or its Triton kernels).
        tau_plus: the debiased contrastive loss (Chuang et al. 2020), a class prior in [0, 1) or an [N]
            tensor of per-row priors (no gradient); 0.0 (default) is the plain loss. Per row, with ``n``
            negatives (every column but the target and the excluded own column)::

                loss_i = -l_pos + log(e^{l_pos} + n max((mean_neg e^{l_j} - tau e^{l_pos}) / (1 - tau), e^{-s}))

            ``s`` the scale (the paper's floor ``e^{-1/t}``); computed in log space, exact gradients on both
            sides of the floor. With ``symmetric=True`` (CLIP) both directions, averaged; with
            ``label_smoothing`` the sum ``debiased_i + eps (l_pos - mean_{j in C_i} l_ij)`` (memeff 0.3.1's
            composition). A tensor prior needs no floor to differ from the plain loss; a float 0.0 is the
            plain loss exactly. Not with ``guide`` / ``ids``.
        row_negatives: [N, K, D] row-specific hard negatives (default None): row i's softmax also runs
            over its own K negatives ``s cos(query_i, row_negatives[i, k])`` (and no other row's), beside
            the shared columns: ``F.cross_entropy(cat([logits_i, own_i]), target_i)``. O(N K D) beside the
            shared part, on every backend; under ``gather`` they stay with their row (never gathered).
            Not combined with ``symmetric``, ``guide`` or ``ids``; with ``matryoshka_dims`` they are
            truncated and re-normalised with the other embeddings (one call per level).

    Returns:
        0-dim loss (mean/sum) or [N] per-row losses (none).
    """
    query = V.embeddings("query", query)
    dev = query.device
    if keys is not None:
        keys = V.embeddings("keys", keys)
        V.same_dim("query", query, "keys", keys)
        V.same_device(query=query, keys=keys)
        V.same_precision("query", query, "keys", keys)
    reduction = V.reduction(reduction)
    ignore_index = V.ignore_index(ignore_index)
    exclude_self = (keys is None) if exclude_self is None else V.flag("exclude_self", exclude_self)
    V.flag("symmetric", symmetric)
    V.flag("normalize", normalize)
    n = query.shape[0]
    m = n if keys is None else keys.shape[0]
    eps = V.label_smoothing(label_smoothing)
    tau = _tau(tau_plus, n, dev)
    s, _ = V.scale_of(temperature, scale, _DEFAULT_TEMPERATURE, compute_dtype(query, keys), dev)
    if symmetric:
        if target is not None:
            raise ValueError("target must be None when symmetric=True (the pairs are the diagonal)")
        if n != m:
            raise ValueError(f"symmetric=True needs as many keys as queries, got query {n} and keys {m}")
        if keys is None and exclude_self:
            raise ValueError("symmetric=True with keys=None needs exclude_self=False (the pairs are the diagonal)")
    given = target is not None
    if given:
        target = V.target(target, n, m, ignore_index, dev)
    elif keys is None and exclude_self and not symmetric:
        raise ValueError("target=None with keys=None means every row's target is its own excluded column; "
                         "pass target (e.g. the index of each row's positive) or keys")
    guide_options_unused(guide, guide_margin, guide_margin_strategy)
    masked = guide is not None or ids is not None
    if row_negatives is not None:
        row_negatives = RN.checked(row_negatives, query)
        if eps or tau is not None:
            raise ValueError(f"{'label_smoothing' if eps else 'tau_plus'} is not supported with row_negatives yet "
                             "(the row's own negatives would have to join the uniform part / the negatives' count)")
        if symmetric or masked:
            raise ValueError("row_negatives (each row's own negatives) is not supported with "
                             f"{'symmetric=True' if symmetric else 'guide= / ids='}")
    if masked:
        if tau is not None:
            raise ValueError("tau_plus is not supported with guide= / ids= (the debiased loss counts every column "
                             "but the target as a negative)")
        if symmetric:
            raise ValueError("guide= and ids= mask the rows' softmax; they are not supported with symmetric=True")
        mk = info_nce_masks(query, keys, guide, guide_margin, guide_margin_strategy, ids)
    be = resolve(backend, query, keys)
    scope = Scope(gather)
    if given and exclude_self and (keys is None or scope.local):  # row i's own column is i (global: same offset)
        V.target_not_excluded(target, ignore_index)
    if scope.local and not given and not symmetric:
        # the default target arange(N) names column i of row i: it must exist and not be excluded
        if m < n:
            raise ValueError(f"target=None means row i's target is key i, but there are fewer keys ({m}) than "
                             f"queries ({n}); pass target or as many keys as queries")
        if exclude_self and keys is not None:
            raise ValueError("exclude_self=True with keys and target=None would exclude every row's own target "
                             "column (key i): pass target, or exclude_self=False")
    scope.agree(s)
    if symmetric:
        return _clip(be, scope, query, query if keys is None else keys, s, normalize, reduction, _levels, eps, tau)
    contrast, koff, m_total = scope.rows(query if keys is None else keys, "query" if keys is None else "keys")
    qoff, n_total = (koff, m_total) if keys is None else scope.offset(n, dev)
    if not scope.local and not given and not symmetric and n_total > m_total:
        # every rank knows every rank's query and key counts: each raises (none waits in a collective)
        raise ValueError(f"target=None means global row i's target is global key i, but the ranks hold fewer keys "
                         f"({m_total}) than queries ({n_total}); pass target or as many keys as queries")
    if not scope.local and given and exclude_self and keys is not None and V.readable(target):
        # row i's own (excluded) column is the global key qoff + i; a target naming it gives an infinite loss
        def own_column():
            glob = torch.where(target == ignore_index, target, target + koff - qoff)
            V.target_not_excluded(glob, ignore_index, what="global key qoff + i (this rank's query offset)")
        D.all_checked(scope.grp, own_column, "info_nce")
    valid = None
    if not given:  # arange over the (global) batch: row qoff + i
        t = torch.arange(n, device=dev) + qoff
    else:
        valid = target != ignore_index
        t = torch.where(valid, target + koff, torch.zeros_like(target))
    if masked:
        return guided_info_nce(be, scope, query, contrast, qoff, n_total, s, t, valid, mk, exclude_self=exclude_self,
                               normalize=normalize, reduction=reduction, label_smoothing=eps)
    # locally keys=None is "B is A" (one normalisation, the triangular sweep where it applies)
    b = None if keys is None and scope.local else contrast
    if row_negatives is not None:
        return _row_negative_ce(be, scope, query, b, contrast, s, t, row_negatives, qoff=qoff,
                                exclude_self=exclude_self, normalize=normalize, reduction=reduction,
                                n_total=n_total, valid=valid)
    return cross_entropy(be, scope, query, b, s, t, offset=qoff, exclude_self=exclude_self, normalize=normalize,
                         reduction=reduction, n_total=n_total, valid=valid, levels=_levels, label_smoothing=eps,
                         tau_plus=tau)


def _tau(tau_plus, n: int, device):
    """``tau_plus`` checked (``V.tau_plus``): None for the plain loss (a float 0), else the float or [N] tensor."""
    tau = V.tau_plus(tau_plus, n, device)
    return None if isinstance(tau, float) and tau == 0.0 else tau


def _row_negative_ce(be: str, scope: Scope, query: Tensor, b: Tensor | None, contrast: Tensor, s, t: Tensor,
                     row_negatives: Tensor, *, qoff: int, exclude_self: bool, normalize: bool, reduction: str,
                     n_total: int, valid: Tensor | None) -> Tensor:
    """``info_nce`` with row-specific negatives (``_row_negatives``): the shared part's per-row
    cross-entropy from any backend merged with each row's own negatives; the reference backend
    materialises ``[logits_i | own_i]``."""
    if be == "reference":
        per = ref.info_nce(query, b, t, s, exclude_self, False, normalize, "none", -100, offset=qoff,
                           row_negatives=row_negatives)
        per = per if valid is None else torch.where(valid, per, torch.zeros_like(per))
    else:
        ce = cross_entropy(be, scope, query, b, s, t, offset=qoff, exclude_self=exclude_self, normalize=normalize,
                           reduction="none", n_total=n_total, valid=valid)
        per = RN.merged(ce, RN.target_logit(query, contrast[t], s, normalize),
                        RN.row_logits(query, row_negatives, s, normalize), valid=valid)
    return scope.reduce(per, reduction, n_total if valid is None else scope.sum(valid.sum()))


def _clip(be: str, scope: Scope, a: Tensor, b: Tensor, s, normalize: bool, reduction: str, levels=None,
          label_smoothing: float = 0.0, tau_plus=None) -> Tensor:
    """CLIP's ``(row CE + column CE) / 2`` per pair. Locally one core-op call (the column term is the
    op's column statistic; with ``tau_plus`` two, one per direction); across ranks a rank holds only its own
    columns, so pair i's row term is ``CE(a_i, B_global)`` and its column term ``CE(b_i, A_global)``."""
    n = a.shape[0]
    if scope.local:
        return cross_entropy(be, scope, a, b, s, torch.arange(n, device=a.device), offset=0, exclude_self=False,
                             normalize=normalize, reduction=reduction, n_total=n, symmetric=True, levels=levels,
                             label_smoothing=label_smoothing, tau_plus=tau_plus)
    a_all, off, total = scope.rows(a, "a")
    b_all, _, _ = scope.rows(b, "b")
    t = torch.arange(n, device=a.device) + off
    kw = dict(offset=off, exclude_self=False, normalize=normalize, reduction="none", n_total=total, levels=levels,
              label_smoothing=label_smoothing, tau_plus=tau_plus)
    per = (cross_entropy(be, scope, a, b_all, s, t, **kw) + cross_entropy(be, scope, b, a_all, s, t, **kw)) / 2
    return scope.reduce(per, reduction, total, leveled=levels is not None)


@D.agreed
@leveled("a", "b")
@autocast_off
def clip_loss(a: Tensor, b: Tensor, logit_scale, *, normalize: bool = True, reduction: str = "mean",
              backend: str = "auto", gather=False, label_smoothing: float = 0.0, tau_plus: float | Tensor = 0.0,
              _levels=None) -> Tensor:
    """CLIP loss: ``(CE(l, arange) + CE(l^T, arange)) / 2`` with ``l = logit_scale * cos(a, b)``, i.e.
    ``info_nce(a, b, symmetric=True, scale=logit_scale)``.

    Args:
        a: [N, D] e.g. image embeddings; b: [N, D] text embeddings (pair i is (a_i, b_i)).
        logit_scale: the multiplier of the cosines (already exponentiated, e.g. ``exp(log_scale)``),
            a float or a 0-dim tensor (differentiable).
        label_smoothing: ``F.cross_entropy``'s in both directions, in [0, 1) (default 0; HF's ALIGN and
            BLIP-2's ITC use 0.1).
        tau_plus: the debiased loss in both directions (see :func:`info_nce`), a float in [0, 1) or an [N]
            tensor of per-pair priors; the floor is ``e^{-logit_scale}``.

    Returns:
        0-dim loss (mean/sum) or [N] per-pair losses ``(row_i + col_i) / 2`` (none).
    """
    a = V.embeddings("a", a)
    b = V.paired("a", a, "b", b)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    s = V.positive_number("logit_scale", logit_scale, device=a.device)
    if isinstance(s, Tensor):
        s = s.to(device=a.device, dtype=compute_dtype(a, b))
    eps = V.label_smoothing(label_smoothing)
    tau = _tau(tau_plus, a.shape[0], a.device)
    be = resolve(backend, a, b)
    scope = Scope(gather)
    scope.agree(s)
    return _clip(be, scope, a, b, s, normalize, reduction, _levels, eps, tau)


@D.agreed
@leveled("query", "keys")
@autocast_off
def am_softmax_loss(query: Tensor, keys: Tensor, *, margin: float = 0.3, temperature=0.05, symmetric: bool = True,
                    normalize: bool = True, reduction: str = "mean", backend: str = "auto", gather=False,
                    label_smoothing: float = 0.0, _levels=None) -> Tensor:
    """Additive-margin softmax over in-batch negatives (LaBSE: Yang et al. 2019; Feng et al. 2022), one
    fused core-op call: with ``c_ij = cos(query_i, keys_j)`` and ``s = 1 / temperature``::

        row_i = -log( e^{s (c_ii - m)} / (e^{s (c_ii - m)} + sum_{j != i} e^{s c_ij}) )
        col_i = the same over column i (keys_i against every query)
        loss  = mean_i (row_i + col_i) / 2      (symmetric=True, LaBSE's bidirectional form)
                mean_i row_i                    (symmetric=False)

    The margin is in cosine units on the pair's own logit, so a learnable temperature's gradient
    includes it (``d l_ii / ds = c_ii - m``). ``margin=0`` is :func:`clip_loss` with ``logit_scale = s``
    (symmetric) or :func:`info_nce` (not).

    Args:
        query: [N, D]; keys: [N, D] (pair i is (query_i, keys_i)); float16 / bfloat16 / float32 /
            float64.
        margin: m, a finite float (default 0.3, LaBSE's).
        temperature: a positive float or a 0-dim tensor (differentiable); default 0.05 (s = 20).
        symmetric: the mean of the row and the column form (default) or the row form only.
        normalize / reduction / backend / gather: as for every loss (:mod:`fused_contrastive.losses`);
            ``gather`` contrasts with every rank's keys (and, symmetric, queries); the rank average is
            the global-batch loss.
        matryoshka_dims / matryoshka_weights / return_level_losses: Matryoshka levels (one call per
            level on the truncated, re-normalised rows).
        label_smoothing: ``F.cross_entropy``'s on the margin logits (each direction), in [0, 1) (default 0).

    Backends: "torch" (dense tile or chunked, O(N*D) memory), "triton" (the fused kernels, or the panel
    path at large N on CUDA; or the ahead-of-time library where it was built with the margin kernels),
    "reference" (materialised).

    Returns:
        0-dim loss (mean / sum) or [N] per-pair losses (none); float32 (float64 for float64 inputs).
    """
    query = V.embeddings("query", query)
    keys = V.paired("query", query, "keys", keys)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    V.flag("symmetric", symmetric)
    margin = V.number("margin", margin, low=-math.inf, strict=True)
    eps = V.label_smoothing(label_smoothing)
    dev = query.device
    s, _ = V.scale_of(temperature, None, _DEFAULT_TEMPERATURE, compute_dtype(query, keys), dev)
    be = resolve(backend, query, keys)
    n = query.shape[0]
    scope = Scope(gather)
    scope.agree(s)
    kw = dict(exclude_self=False, normalize=normalize, margin=margin, levels=_levels, label_smoothing=eps)
    if scope.local:
        return cross_entropy(be, scope, query, keys, s, torch.arange(n, device=dev), offset=0, reduction=reduction,
                             n_total=n, symmetric=symmetric, **kw)
    # across ranks a rank holds only its own pairs: row i against every rank's keys, column i (keys_i)
    # against every rank's queries, each a row-form call with the margin at the pair's global index
    k_all, off, total = scope.rows(keys, "keys")
    t = torch.arange(n, device=dev) + off
    per = cross_entropy(be, scope, query, k_all, s, t, offset=off, reduction="none", n_total=total, **kw)
    if symmetric:
        q_all = scope.rows(query, "query")[0]
        per = (per + cross_entropy(be, scope, keys, q_all, s, t, offset=off, reduction="none", n_total=total,
                                   **kw)) / 2
    return scope.reduce(per, reduction, total, leveled=_levels is not None)


@D.agreed
@leveled("z1", "z2")
@autocast_off
def simcse_loss(z1: Tensor, z2: Tensor | None = None, *, temperature=0.05, normalize: bool = True,
                reduction: str = "mean", backend: str = "auto", gather=False,
                guide: Tensor | Sequence[Tensor] | None = None, guide_margin: float = 0.0,
                guide_margin_strategy: str = "absolute", ids: Tensor | Sequence[Tensor] | None = None,
                label_smoothing: float = 0.0, _levels=None) -> Tensor:
    """Unsupervised SimCSE.

    * ``z2=None``: ``z1`` is the interleaved batch [2B, D] (rows 2i and 2i+1 are two dropout views of
      sentence i); every row is an anchor, its partner ``i xor 1`` the positive, itself excluded.
    * ``z2`` [B, D]: the official two-view form ``CE(cos(z1, z2) / t, arange(B))``.

    ``guide`` / ``guide_margin`` / ``guide_margin_strategy`` / ``ids``: ``info_nce``'s masks on the rows
    (a pair ``(for z1, for z2)``, or one tensor for the interleaved ``z1``), the positive kept.

    ``label_smoothing``: ``F.cross_entropy``'s, in [0, 1) (default 0), over each row's softmax columns (the
    interleaved form's own column deleted, as :func:`info_nce`'s; with ``guide`` / ``ids`` the masked
    columns deleted too).

    Returns a 0-dim loss, or per-anchor losses ([2B] or [B]) with ``reduction="none"``.
    """
    z1 = V.embeddings("z1", z1)
    dev = z1.device
    if z2 is None:
        if z1.shape[0] % 2:
            raise ValueError(f"z1 must hold interleaved pairs (an even number of rows), got {z1.shape[0]}")
    else:
        z2 = V.paired("z1", z1, "z2", z2)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    eps = V.label_smoothing(label_smoothing)
    guide_options_unused(guide, guide_margin, guide_margin_strategy)
    masked = guide is not None or ids is not None
    mk = info_nce_masks(z1, z2, guide, guide_margin, guide_margin_strategy, ids) if masked else None
    s, _ = V.scale_of(temperature, None, _DEFAULT_TEMPERATURE, compute_dtype(z1, z2), dev)
    be = resolve(backend, z1, z2)
    n = z1.shape[0]
    scope = Scope(gather)
    scope.agree(s)
    contrast, off, total = scope.rows(z1 if z2 is None else z2, "z1" if z2 is None else "z2")
    t = torch.arange(n, device=dev)
    t = (t ^ 1) + off if z2 is None else t + off  # the other view; offsets are even: ranks hold whole pairs
    if masked:
        return guided_info_nce(be, scope, z1, contrast, off, total, s, t, None, mk, exclude_self=z2 is None,
                               normalize=normalize, reduction=reduction, label_smoothing=eps)
    b = None if z2 is None and scope.local else contrast
    return cross_entropy(be, scope, z1, b, s, t, offset=off, exclude_self=z2 is None, normalize=normalize,
                         reduction=reduction, n_total=total, levels=_levels, label_smoothing=eps)


@D.agreed
@leveled("anchor", "positive", "negative")
@autocast_off
def simcse_sup_loss(anchor: Tensor, positive: Tensor | None = None, negative: Tensor | None = None,
                    *, temperature=0.05, hard_negative_weight: float = 0.0, normalize: bool = True,
                    reduction: str = "mean", backend: str = "auto", gather=False,
                    guide: Tensor | Sequence[Tensor] | None = None, guide_margin: float = 0.0,
                    guide_margin_strategy: str = "absolute", ids: Tensor | Sequence[Tensor] | None = None,
                    label_smoothing: float = 0.0, _levels=None) -> Tensor:
    """Supervised SimCSE (NLI triplets).

    * ``positive=None``: ``anchor`` is the interleaved triplets [3B, D]: rows 3k, 3k+1, 3k+2 are
      (x, x+, x-) of example k.
    * otherwise ``anchor``, ``positive``, ``negative`` are [B, D] each; ``negative=None`` drops the
      hard negatives (then it is the two-view InfoNCE).

    Logits of anchor i are ``[cos(a_i, p_j) / t for j] ++ [cos(a_i, n_j) / t for j]`` (B x 2B), target
    i, and ``hard_negative_weight`` is added to the logit of anchor i's own negative n_i (as in the
    official SimCSE code). Returns a 0-dim loss or [B] per-anchor losses.

    ``guide`` / ``guide_margin`` / ``guide_margin_strategy`` / ``ids``: ``info_nce``'s masks on the rows,
    given like the embeddings (``(for anchor, for positive[, for negative])``, or one tensor for the
    interleaved triplets); the positive kept. Not combined with ``hard_negative_weight``.

    ``label_smoothing``: ``F.cross_entropy``'s over the 2B (B) logits, in [0, 1) (default 0); with ``guide`` /
    ``ids`` over the columns the masks keep.
    """
    hnw = V.number("hard_negative_weight", hard_negative_weight, low=float("-inf"), strict=True)
    eps = V.label_smoothing(label_smoothing)
    if positive is None:
        if negative is not None:
            raise ValueError("negative needs positive: pass anchor, positive and negative, or only the "
                             "interleaved [3B, D] anchor")
        anchor = V.embeddings("anchor", anchor)
        if anchor.shape[0] % 3:
            raise ValueError(f"anchor must hold interleaved triplets (rows a multiple of 3), got {anchor.shape[0]}")
        anchor, positive, negative = anchor[0::3], anchor[1::3], anchor[2::3]
    if hnw != 0.0 and negative is None:
        raise ValueError(f"hard_negative_weight={hard_negative_weight!r} needs negative (it is added to each "
                         "anchor's hard-negative logit): pass negative, or leave hard_negative_weight at 0")
    guide_options_unused(guide, guide_margin, guide_margin_strategy)
    masked = guide is not None or ids is not None
    if masked:
        if hnw != 0.0:
            raise ValueError("guide= / ids= are not supported with a hard_negative_weight")
        guide, ids = (_split_views(name, v, negative is not None, interleaved=isinstance(v, Tensor))
                      for name, v in (("guide", guide), ("ids", ids)))
    anchor = V.embeddings("anchor", anchor)
    positive = V.paired("anchor", anchor, "positive", positive)
    if negative is not None:
        negative = V.paired("anchor", anchor, "negative", negative)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    dev = anchor.device
    n = anchor.shape[0]
    s, _ = V.scale_of(temperature, None, _DEFAULT_TEMPERATURE, compute_dtype(anchor, positive, negative), dev)
    keys_local = positive if negative is None else torch.cat([positive, negative.to(positive.dtype)])
    mk = info_nce_masks(anchor, keys_local, _key_pair(guide), guide_margin, guide_margin_strategy,
                        _key_pair(ids)) if masked else None
    be = resolve(backend, anchor, positive, negative)
    scope = Scope(gather)
    scope.agree(s)
    # columns: every rank's positives, then every rank's negatives (P P .. N N .., the local order)
    pos, off, total = scope.rows(positive, "positive")
    t = torch.arange(n, device=dev) + off
    if masked:
        keys = pos if negative is None else torch.cat([pos, scope.rows(negative.to(positive.dtype), "negative")[0]])
        with torch.no_grad():  # the guide / ids of the columns in the same layout
            gk = None if guide is None else torch.cat([scope.rows(g.detach(), "guide")[0] for g in guide[1:]])
            ik = None if ids is None else torch.cat([scope.rows(i.long(), "ids")[0] for i in ids[1:]])
        mk = dataclasses.replace(mk, gk=gk, ik=ik)
        return guided_info_nce(be, scope, anchor, keys, off, total, s, t, None, mk, exclude_self=False,
                               normalize=normalize, reduction=reduction, keys_gathered=True, label_smoothing=eps)
    if negative is None:
        return cross_entropy(be, scope, anchor, pos, s, t, offset=off, exclude_self=False, normalize=normalize,
                             reduction=reduction, n_total=total, levels=_levels, label_smoothing=eps)
    neg, _, _ = scope.rows(negative.to(positive.dtype), "negative")
    if be == "reference":
        return scope.reduce(ref.simcse_sup(anchor, pos, neg, s, hnw, normalize, "none", offset=off,
                                           label_smoothing=eps), reduction, total)
    return cross_entropy(be, scope, anchor, torch.cat([pos, neg]), s, t, offset=off, exclude_self=False,
                         normalize=normalize, reduction=reduction, n_total=total,
                         bias_col=t + total if hnw != 0.0 else None, bias=hnw, levels=_levels,
                         label_smoothing=eps)
