"""Public InfoNCE-family losses. Each is the core op of ``core/spec.py`` (per row: coefficients times
``LSE``, ``LSEcol``, ``LSEpos`` minus coefficients times the target logit ``TGT`` and the weighted
positive logits ``SET``) with the coefficients, constants and denominator the loss defines.

Common keyword arguments:

* ``normalize`` (default True): L2-normalise rows inside the loss (``x / max(||x||, 1e-12)``, like
  ``F.normalize``, without overflow for large finite rows). With False the raw dot products are used.
* ``reduction``: ``"mean"`` (default), ``"sum"`` or ``"none"`` (per-anchor losses).
* ``backend``: ``"auto"`` (default; env ``FUSED_CONTRASTIVE_BACKEND`` overrides it, then triton for
  CUDA tensors that are not float64 when triton is installed, else torch), ``"torch"`` (PyTorch,
  O(N*D) memory, any device), ``"triton"`` (fused kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``)
  or ``"reference"`` (materialises the logits; the test oracle). Problems whose N x M logits fit the
  tile budget run one materialised tile on both torch and triton (see ``core.dense_path``).

* ``gather`` (default False): True (the default process group) or a ``torch.distributed`` ProcessGroup:
  the contrast set is gathered from every rank and each rank computes its own anchors' rows; the
  returned value averages over ranks to the global-batch loss (README, "Negatives across ranks").

Embeddings may be float16, bfloat16, float32 or float64, contiguous or not. Accumulation is in
float32 (float64 for float64 inputs); the loss is float32 (float64 for float64 inputs) and gradients
come back in each input's dtype. Temperatures / scales may be Python numbers (exact: kept in double
precision) or 0-dim tensors (differentiable). Tensor values are validated only on CPU (reading a CUDA
value would be a host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validate as V
from . import core, ops
from . import distributed as D
from ._amp import autocast_off
from ._backend import resolve
from .core import reference as ref
from .core.norms import normalize_rows
from .core.spec import Coeffs, CoreData, CoreSpec, compute_dtype

__all__ = ["clip_loss", "dcl_loss", "dclw_loss", "dscl_loss", "info_nce", "simcse_loss", "simcse_sup_loss",
           "supcon_loss"]

_EPS = 1e-12
_DEFAULT_TEMPERATURE = 0.05


_SPECS: dict = {}  # a plain dict, not functools.lru_cache (Dynamo warns when it traces through one)


def _spec(normalize: bool, exclude_self: bool, bias: float) -> CoreSpec:
    """CoreSpec objects are immutable: share them (constructing one per call costs microseconds)."""
    if ops.tracing_route():  # no cache mutation inside a compiled graph (it would be guarded on)
        return CoreSpec(normalize=normalize, eps=_EPS, exclude_self=exclude_self, bias=bias)
    key = (normalize, exclude_self, bias)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=exclude_self, bias=bias)
    return spec


def _reduced(out: Tensor, reduction: str, denom) -> Tensor:
    return out / denom if reduction == "mean" else out


def _cross_entropy(be: str, query: Tensor, keys: Tensor | None, s, target: Tensor, *, exclude_self: bool,
                   normalize: bool, reduction: str, valid: Tensor | None = None, symmetric: bool = False,
                   bias_col: Tensor | None = None, bias: float = 0.0) -> Tensor:
    """``CE(logits_i, target_i)`` of every row (mean over ``valid`` rows), or CLIP's (row + column) / 2
    when ``symmetric`` (then ``valid`` is None): the core op with coefficients 1 on LSE and on the
    target logit."""
    spec = _spec(normalize, exclude_self, bias)
    data = CoreData(target=target, bias_col=bias_col)
    n = query.shape[0]
    if valid is None:
        # the same weight on every row: a mean is the sum with weights 1/N (no division afterwards)
        # (under compile the weights are 1 and the sum is divided afterwards: a weight 1/N would be
        # a constant of the compiled graph, recompiled for every batch size)
        per_n = reduction == "mean" and not ops.tracing_route()
        c = 1.0 / n if per_n else 1.0
        coef = Coeffs(lse=0.5 * c, col=0.5 * c, tgt=c) if symmetric else Coeffs(lse=c, tgt=c)
        out = core.run(be, query, keys, s, spec, data, coef, reduce=reduction != "none")
        return out / n if reduction == "mean" and not per_n else out
    w = valid.to(compute_dtype(query, keys))
    out = core.run(be, query, keys, s, spec, data, Coeffs(lse=w, tgt=w), reduce=reduction != "none")
    return _reduced(out, reduction, w.sum())


def _per_rank(out: Tensor, reduction: str, denom, world: int) -> Tensor:
    """The value a rank returns under ``gather``: with ``"mean"`` / ``"sum"`` the local sum scaled so that
    the average over ranks is the global loss (``world / global denominator``, ``world``); with
    ``"none"`` the local per-anchor losses."""
    if reduction == "none":
        return out
    out = out.sum() if out.dim() else out
    if reduction == "sum":
        return out * world
    if isinstance(denom, Tensor):  # a count summed over ranks (an integer tensor: no host read)
        return out * world / denom.to(out.dtype)
    return out * (world / denom)


def _gathered_ce(be: str, grp, query: Tensor, keys: Tensor, s, target: Tensor, *, offset: int, exclude_self: bool,
                 normalize: bool, reduction: str, n_total: int, valid: Tensor | None = None) -> Tensor:
    """``CE`` of the local anchors ``query`` against the gathered contrast set ``keys`` (targets and the
    own column already global), under the per-rank contract of :func:`_per_rank`."""
    world = D.world_size(grp)
    if be == "reference":
        per = ref.info_nce(query, keys, target, s, exclude_self, False, normalize, "none", -100, offset=offset)
        if valid is not None:
            per = torch.where(valid, per, torch.zeros_like(per))
        out = per
    else:
        spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=exclude_self, offset=offset)
        w = 1.0 if valid is None else valid.to(compute_dtype(query, keys))
        out = core.run(be, query, keys, s, spec, CoreData(target=target), Coeffs(lse=w, tgt=w),
                       reduce=reduction != "none")
    denom = n_total if valid is None else D.all_sum(valid.sum(), grp)
    return _per_rank(out, reduction, denom, world)


def _gathered_clip(be: str, grp, a: Tensor, b: Tensor, s, normalize: bool, reduction: str) -> Tensor:
    """CLIP under ``gather``: pair i's row term is ``CE(a_i, B_global)``, its column term ``CE(b_i, A_global)``."""
    a_all, off, sizes = D.gather_rows(a, grp, name="a")
    b_all, _, _ = D.gather_rows(b, grp, name="b")
    t = torch.arange(a.shape[0], device=a.device) + off
    kw = dict(offset=off, exclude_self=False, normalize=normalize, reduction="none", n_total=sum(sizes))
    per = (_gathered_ce(be, grp, a, b_all, s, t, **kw) + _gathered_ce(be, grp, b, a_all, s, t, **kw)) / 2
    return _per_rank(per, reduction, sum(sizes), D.world_size(grp))


# ----------------------------------------------------------------------------------------------
# InfoNCE / cross-entropy over cosine logits
# ----------------------------------------------------------------------------------------------


@D.agreed
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
        exclude_self: remove column ``i`` from row ``i``'s softmax (a target equal to the excluded
            column gives an infinite loss, as the textbook formula does).
        symmetric: CLIP loss, ``(row CE + column CE) / 2``; needs N == M and ``target=None``.
            With ``reduction="none"`` returns ``(row_i + col_i) / 2`` per pair.

    Returns:
        0-dim loss (mean/sum) or [N] per-row losses (none).
    """
    query = V.embeddings("query", query)
    dev = query.device
    if keys is not None:
        keys = V.embeddings("keys", keys)
        V.same_dim("query", query, "keys", keys)
        V.same_device(query=query, keys=keys)
    reduction = V.reduction(reduction)
    ignore_index = V.ignore_index(ignore_index)
    exclude_self = (keys is None) if exclude_self is None else V.flag("exclude_self", exclude_self)
    V.flag("symmetric", symmetric)
    V.flag("normalize", normalize)
    n = query.shape[0]
    m = n if keys is None else keys.shape[0]
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
    be = resolve(backend, query, keys)
    grp = D.process_group(gather)
    if grp is None and not given and not symmetric:
        # the default target arange(N) names column i of row i: it must exist and not be excluded
        if m < n:
            raise ValueError(f"target=None means row i's target is key i, but there are fewer keys ({m}) than "
                             f"queries ({n}); pass target or as many keys as queries")
        if exclude_self and keys is not None:
            raise ValueError("exclude_self=True with keys and target=None would exclude every row's own target "
                             "column (key i): pass target, or exclude_self=False")
    if grp is not None:
        D.agree(grp, scale=s)
        return _info_nce_gathered(be, grp, query, keys, target, s, exclude_self, symmetric, normalize, reduction,
                                  ignore_index)
    if be == "reference":
        tgt = target if given else torch.arange(n, device=dev)
        return ref.info_nce(query, keys, tgt, s, exclude_self, symmetric, normalize, reduction, ignore_index)
    if not given:
        return _cross_entropy(be, query, keys, s, torch.arange(n, device=dev), exclude_self=exclude_self,
                              normalize=normalize, reduction=reduction, symmetric=symmetric)
    valid = target != ignore_index
    return _cross_entropy(be, query, keys, s, torch.where(valid, target, torch.zeros_like(target)),
                          exclude_self=exclude_self, normalize=normalize, reduction=reduction, valid=valid)


def _info_nce_gathered(be, grp, query, keys, target, s, exclude_self, symmetric, normalize, reduction,
                       ignore_index) -> Tensor:
    """info_nce under ``gather``: the local rows against every rank's keys (or queries, keys=None)."""
    n = query.shape[0]
    if symmetric:
        return _gathered_clip(be, grp, query, query if keys is None else keys, s, normalize, reduction)
    if keys is None:
        contrast, qoff, sizes = D.gather_rows(query, grp, name="query")
        koff = qoff
    else:
        contrast, koff, _ = D.gather_rows(keys, grp, name="keys")
        qoff, total = D.row_offset(n, query.device, grp)
        sizes = [total]
    n_total = sum(sizes)
    valid = None
    if target is None:  # arange over the global batch: global row qoff + i
        t = torch.arange(n, device=query.device) + qoff
    else:
        valid = target != ignore_index
        t = torch.where(valid, target + koff, torch.zeros_like(target))
    return _gathered_ce(be, grp, query, contrast, s, t, offset=qoff, exclude_self=exclude_self, normalize=normalize,
                        reduction=reduction, n_total=n_total, valid=valid)


@D.agreed
@autocast_off
def clip_loss(a: Tensor, b: Tensor, logit_scale, *, normalize: bool = True, reduction: str = "mean",
              backend: str = "auto", gather=False) -> Tensor:
    """CLIP loss: ``(CE(l, arange) + CE(l^T, arange)) / 2`` with ``l = logit_scale * cos(a, b)``, i.e.
    ``info_nce(a, b, symmetric=True, scale=logit_scale)``.

    Args:
        a: [N, D] e.g. image embeddings; b: [N, D] text embeddings (pair i is (a_i, b_i)).
        logit_scale: the multiplier of the cosines (already exponentiated, e.g. ``exp(log_scale)``),
            a float or a 0-dim tensor (differentiable).

    Returns:
        0-dim loss (mean/sum) or [N] per-pair losses ``(row_i + col_i) / 2`` (none).
    """
    a = V.embeddings("a", a)
    b = V.embeddings("b", b)
    V.same_dim("a", a, "b", b)
    V.same_device(a=a, b=b)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"b must have as many rows as a (pair i is (a_i, b_i)), got a {a.shape[0]} and "
                         f"b {b.shape[0]}")
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    s = V.positive_number("logit_scale", logit_scale, device=a.device)
    if isinstance(s, Tensor):
        s = s.to(device=a.device, dtype=compute_dtype(a, b))
    be = resolve(backend, a, b)
    grp = D.process_group(gather)
    if grp is not None:
        D.agree(grp, scale=s)
        return _gathered_clip(be, grp, a, b, s, normalize, reduction)
    target = torch.arange(a.shape[0], device=a.device)
    if be == "reference":
        return ref.info_nce(a, b, target, s, False, True, normalize, reduction, -100)
    return _cross_entropy(be, a, b, s, target, exclude_self=False, normalize=normalize, reduction=reduction,
                          symmetric=True)


# ----------------------------------------------------------------------------------------------
# SimCSE
# ----------------------------------------------------------------------------------------------


@D.agreed
@autocast_off
def simcse_loss(z1: Tensor, z2: Tensor | None = None, *, temperature=0.05, normalize: bool = True,
                reduction: str = "mean", backend: str = "auto", gather=False) -> Tensor:
    """Unsupervised SimCSE.

    * ``z2=None``: ``z1`` is the interleaved batch [2B, D] (rows 2i and 2i+1 are two dropout views of
      sentence i); every row is an anchor, its partner ``i xor 1`` the positive, itself excluded.
    * ``z2`` [B, D]: the official two-view form ``CE(cos(z1, z2) / t, arange(B))``.

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
    s, _ = V.scale_of(temperature, None, _DEFAULT_TEMPERATURE, compute_dtype(z1, z2), dev)
    be = resolve(backend, z1, z2)
    n = z1.shape[0]
    grp = D.process_group(gather)
    if grp is not None:
        D.agree(grp, scale=s)
        contrast, off, sizes = D.gather_rows(z1 if z2 is None else z2, grp, name="z1" if z2 is None else "z2")
        t = torch.arange(n, device=dev)
        t = (t ^ 1) + off if z2 is None else t + off  # offsets are even: every rank holds whole pairs
        return _gathered_ce(be, grp, z1, contrast, s, t, offset=off, exclude_self=z2 is None, normalize=normalize,
                            reduction=reduction, n_total=sum(sizes))
    target = torch.arange(n, device=dev)
    if z2 is None:
        target = target ^ 1  # the other view of the same sentence
    if be == "reference":
        return ref.info_nce(z1, z2, target, s, z2 is None, False, normalize, reduction, -100)
    return _cross_entropy(be, z1, z2, s, target, exclude_self=z2 is None, normalize=normalize,
                          reduction=reduction)


# ----------------------------------------------------------------------------------------------
# Decoupled contrastive learning
# ----------------------------------------------------------------------------------------------


def _dcl(z1: Tensor, z2: Tensor, temperature, sigma, normalize: bool, reduction: str, backend: str,
         gather) -> Tensor:
    """DCL (``sigma`` None) or DCLW: validation, then the core op with the target column left out of
    each row's log-sum-exp and read in the target term (``CoreSpec.exclude_target``)."""
    z1 = V.embeddings("z1", z1)
    z2 = V.paired("z1", z1, "z2", z2)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    if sigma is not None:
        sigma = V.number("sigma", sigma, low=0.0, strict=True)
    dt = compute_dtype(z1, z2)
    s, _ = V.scale_of(temperature, None, 0.1, dt, z1.device)
    be = resolve(backend, z1, z2)
    grp = D.process_group(gather)
    n = z1.shape[0]
    if grp is None and n < 2:
        raise ValueError(f"z1 must hold at least 2 samples (each anchor needs a negative), got {n}")
    dev = z1.device
    if grp is not None:
        off, n_glob = D.agree(grp, scale=s, rows=n)
        if n_glob < 2:
            raise ValueError(f"z1 must hold at least 2 samples over all ranks, got {n_glob}")
        z1_all, _, _ = D.gather_rows(z1, grp, name="z1")
        z2_all, _, _ = D.gather_rows(z2, grp, name="z2")
        contrast = torch.cat([z1_all, z2_all])
    else:
        off, n_glob, contrast = 0, n, torch.cat([z1, z2])
    w = None
    if sigma is not None:  # DCLW: softmax over the global batch of the positive pairs' similarities
        with torch.no_grad():
            # the backends' own overflow-free normalisation (the reference backend is the oracle's)
            ref_rows = (normalize_rows(z1, _EPS, dt, normalize)[0] * normalize_rows(z2, _EPS, dt, normalize)[0]).sum(1)
            if grp is not None:
                ref_rows = D.gather_rows(ref_rows.detach()[:, None], grp, name="z1")[0][:, 0]
            w = (2.0 - n_glob * torch.softmax(ref_rows / sigma, dim=0))[off:off + n]
    i = torch.arange(n, device=dev)
    if grp is None:  # one problem: B is A = [z1; z2], row r's own column r, its partner r +- n
        blocks = [(None, 0, torch.cat([i + n, i]), None if w is None else w.repeat(2))]
    else:  # view-1 anchors: own column off + i, partner n_glob + off + i; view-2 anchors the other way
        blocks = [(z1, off, n_glob + off + i, w), (z2, n_glob + off, off + i, w)]
    per_n = reduction == "mean" and not ops.tracing_route() and grp is None
    c = 1.0 / (2 * n) if per_n else 1.0
    outs = []
    for anchors, own, partner, wb in blocks:
        rows = contrast if anchors is None else anchors
        if be == "reference":
            own_cols = own + torch.arange(rows.shape[0], device=dev)
            per = ref.dcl_rows(rows, contrast, s, own_cols, partner, wb, normalize)
            outs.append(per if reduction == "none" else per.sum() * c)
            continue
        spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True, offset=own, exclude_target=True)
        coef = Coeffs(lse=c, tgt=c if wb is None else wb.to(dt) * c)
        outs.append(core.run(be, anchors if anchors is not None else contrast, None if anchors is None else contrast,
                             s, spec, CoreData(target=partner), coef, reduce=reduction != "none"))
    out = outs[0] if len(outs) == 1 else (torch.cat(outs) if reduction == "none" else outs[0] + outs[1])
    if grp is not None:
        return _per_rank(out, reduction, 2 * n_glob, D.world_size(grp))
    return out / (2 * n) if reduction == "mean" and not per_n else out


@D.agreed
@autocast_off
def dcl_loss(z1: Tensor, z2: Tensor, *, temperature=0.1, normalize: bool = True, reduction: str = "mean",
             backend: str = "auto", gather=False) -> Tensor:
    """Decoupled contrastive learning (Yeh et al. 2022, eq. 6): the positive pair removed from the
    denominator.

    ``z1``, ``z2`` [N, D]: two views of N samples (N >= 2). Every row of both views is an anchor:
    ``L_i = -l_{i, p(i)} + log sum_{j != i, p(i)} exp(l_ij)`` over the 2N rows of both views, ``l = cos /
    temperature``, ``p(i)`` the other view of sample i (as lightly's ``DCLLoss``). ``temperature``: a
    float or a 0-dim tensor (default 0.1). Returns the mean over the 2N anchors (0-dim), their sum, or
    with ``reduction="none"`` the [2N] per-anchor losses (view 1's anchors first). O(N·D) memory on the
    torch and triton backends; ``gather=`` contrasts each rank's anchors with every rank's rows.
    """
    return _dcl(z1, z2, temperature, None, normalize, reduction, backend, gather)


@D.agreed
@autocast_off
def dclw_loss(z1: Tensor, z2: Tensor, *, temperature=0.1, sigma=0.5, normalize: bool = True,
              reduction: str = "mean", backend: str = "auto", gather=False) -> Tensor:
    """Weighted DCL (Yeh et al. 2022, eq. 6 with the von Mises-Fisher weighting): :func:`dcl_loss` with
    the positive term of sample i weighted by ``w_i = 2 - N softmax_i(<z1_i, z2_i> / sigma)`` (the rows
    normalised when ``normalize``; the softmax over the N samples, over the global batch under
    ``gather``), with no gradient through ``w``. ``sigma`` > 0 (default 0.5); the rest as
    :func:`dcl_loss`.
    """
    return _dcl(z1, z2, temperature, sigma, normalize, reduction, backend, gather)


@D.agreed
@autocast_off
def simcse_sup_loss(anchor: Tensor, positive: Tensor | None = None, negative: Tensor | None = None,
                    *, temperature=0.05, hard_negative_weight: float = 0.0, normalize: bool = True,
                    reduction: str = "mean", backend: str = "auto", gather=False) -> Tensor:
    """Supervised SimCSE (NLI triplets).

    * ``positive=None``: ``anchor`` is the interleaved triplets [3B, D]: rows 3k, 3k+1, 3k+2 are
      (x, x+, x-) of example k.
    * otherwise ``anchor``, ``positive``, ``negative`` are [B, D] each; ``negative=None`` drops the
      hard negatives (then it is the two-view InfoNCE).

    Logits of anchor i are ``[cos(a_i, p_j) / t for j] ++ [cos(a_i, n_j) / t for j]`` (B x 2B), target
    i, and ``hard_negative_weight`` is added to the logit of anchor i's own negative n_i (as in the
    official SimCSE code). Returns a 0-dim loss or [B] per-anchor losses.
    """
    hnw = V.number("hard_negative_weight", hard_negative_weight, low=float("-inf"), strict=True)
    if positive is None:
        if negative is not None:
            raise ValueError("negative needs positive: pass anchor, positive and negative, or only the "
                             "interleaved [3B, D] anchor")
        anchor = V.embeddings("anchor", anchor)
        if anchor.shape[0] % 3:
            raise ValueError(f"anchor must hold interleaved triplets (rows a multiple of 3), got {anchor.shape[0]}")
        anchor, positive, negative = anchor[0::3], anchor[1::3], anchor[2::3]
    anchor = V.embeddings("anchor", anchor)
    positive = V.embeddings("positive", positive)
    if positive.shape != anchor.shape:
        raise ValueError(f"positive must have the shape of anchor {tuple(anchor.shape)}, got {tuple(positive.shape)}")
    if negative is not None:
        negative = V.embeddings("negative", negative)
        if negative.shape != anchor.shape:
            raise ValueError(f"negative must have the shape of anchor {tuple(anchor.shape)}, "
                             f"got {tuple(negative.shape)}")
    V.same_device(anchor=anchor, positive=positive, negative=negative)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    dev = anchor.device
    n = anchor.shape[0]
    s, _ = V.scale_of(temperature, None, _DEFAULT_TEMPERATURE, compute_dtype(anchor, positive, negative), dev)
    be = resolve(backend, anchor, positive, negative)
    grp = D.process_group(gather)
    if grp is not None:
        D.agree(grp, scale=s)
        return _simcse_sup_gathered(be, grp, anchor, positive, negative, s, hnw, normalize, reduction)
    if negative is None:
        if be == "reference":
            return ref.info_nce(anchor, positive, torch.arange(n, device=dev), s, False, False, normalize,
                                reduction, -100)
        return _cross_entropy(be, anchor, positive, s, torch.arange(n, device=dev), exclude_self=False,
                              normalize=normalize, reduction=reduction)
    if be == "reference":
        return ref.simcse_sup(anchor, positive, negative, s, hnw, normalize, reduction)
    keys = torch.cat([positive, negative.to(positive.dtype)], dim=0)
    target = torch.arange(n, device=dev)
    bias_col = target + n if hnw != 0.0 else None
    return _cross_entropy(be, anchor, keys, s, target, exclude_self=False, normalize=normalize,
                          reduction=reduction, bias_col=bias_col, bias=hnw)


def _simcse_sup_gathered(be, grp, anchor, positive, negative, s, hnw, normalize, reduction) -> Tensor:
    """Supervised SimCSE under ``gather``: columns are every rank's positives, then every rank's
    negatives (P P .. N N .., the single-process order), anchor i's target and hard negative at the
    rank's offset."""
    n = anchor.shape[0]
    pos, off, sizes = D.gather_rows(positive, grp, name="positive")
    n_total = sum(sizes)
    t = torch.arange(n, device=anchor.device) + off
    if negative is None:
        return _gathered_ce(be, grp, anchor, pos, s, t, offset=off, exclude_self=False, normalize=normalize,
                            reduction=reduction, n_total=n_total)
    neg, _, _ = D.gather_rows(negative.to(positive.dtype), grp, name="negative")
    world = D.world_size(grp)
    if be == "reference":
        out = ref.simcse_sup(anchor, pos, neg, s, hnw, normalize, "none", offset=off)
    else:
        spec = CoreSpec(normalize=normalize, eps=_EPS, bias=hnw)
        data = CoreData(target=t, bias_col=t + n_total if hnw != 0.0 else None)
        out = core.run(be, anchor, torch.cat([pos, neg]), s, spec, data, Coeffs(lse=1.0, tgt=1.0),
                       reduce=reduction != "none")
    return _per_rank(out, reduction, n_total, world)


# ----------------------------------------------------------------------------------------------
# SupCon and DSCL
# ----------------------------------------------------------------------------------------------


def _factor(t, bt, reduction: str, n: int, out: Tensor):
    """``t / t_base``, divided by the anchors for a mean: one multiplier of the summed (or per-row) loss."""
    f = t / bt / n if reduction == "mean" else t / bt
    return f.to(out.dtype) if isinstance(f, Tensor) else f


def _contrast_set(features: Tensor, queue: Tensor | None) -> Tensor:
    """The views concatenated view-major ([V * bsz, D]: row ``v * bsz + k`` is view v of sample k),
    then the queue rows (detached: a memory bank gets no gradient)."""
    contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
    if queue is not None:
        contrast = torch.cat([contrast, queue.detach().to(contrast.dtype)])
    return contrast


@D.agreed
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
    grp = D.process_group(gather)
    if mask is not None:  # under gather, its columns (the global batch) are checked in D.agree
        mask = V.mask(mask, bsz, dev, cols=-1 if grp is not None else None)
    if labels is None and mask is None and n_views == 1:
        raise ValueError("features has one view and neither labels nor mask is given: every anchor's only "
                         "positive would be itself, which is excluded, so the loss would be 0 with zero "
                         "gradient; pass labels or mask, or features [bsz, n_views >= 2, D]")
    queue, queue_labels = V.queue(queue, queue_labels, labels, d, dev, mask is not None)
    dt = compute_dtype(features, queue)
    s, t = V.scale_of(temperature, None, 0.07, dt, dev)
    bt = V.positive_number("base_temperature", base_temperature, device=dev)
    be = resolve(backend, features, queue)
    if grp is not None:
        off, bsz_g = D.agree(grp, scale=s, rows=bsz, cols=None if mask is None else mask.shape[1])
        return _supcon_gathered(be, grp, off, bsz_g, features, labels, mask, s, t, bt, contrast_mode, variant,
                                queue, queue_labels, normalize, reduction)
    if be == "reference":
        return ref.supcon(features, labels, mask, s, t, bt, contrast_mode, variant, queue, queue_labels,
                          normalize, reduction)

    contrast = _contrast_set(features, queue)
    n_contrast = bsz * n_views
    n = n_contrast if contrast_mode == "all" else bsz
    m = contrast.shape[0]
    if mask is not None:
        data = CoreData(pos_mask=mask)
    else:
        lab = labels if labels is not None else torch.arange(bsz, device=dev)
        col = lab.repeat(n_views)
        if queue is not None:
            # SimCLR with a queue: queue rows are negatives only (-1 never equals an arange label)
            col = torch.cat([col, queue_labels if queue_labels is not None
                             else torch.full((queue.shape[0],), -1, device=dev)])
        data = CoreData(row_labels=col[:n], col_labels=col)
    spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True,
                    grad_cols=n_contrast if queue is not None else None)
    a, b = (contrast, None) if n == m else (contrast[:n], contrast)  # "all" without a queue: B is A
    n_pos = core.positive_counts(spec, data, n, m, contrast)
    has_pos = n_pos > 0
    hp = has_pos.to(n_pos.dtype)
    safe_n = torch.where(has_pos, n_pos, torch.ones_like(n_pos))
    keep = reduction != "none"
    if variant == "out":
        out = core.run(be, a, b, s, spec, data, Coeffs(lse=hp, set=hp / safe_n), reduce=keep)
    else:
        const = hp * torch.log(safe_n)
        out = core.run(be, a, b, s, spec, data, Coeffs(lse=hp, pos=-hp), reduce=keep)
        out = out + (const.sum() if keep else const)
    return out * _factor(t, bt, reduction, n, out)


@D.agreed
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
    grp = D.process_group(gather)
    if grp is not None:
        D.agree(grp, scale=s)
        return _dscl_gathered(be, grp, features, labels, beta, s, t, bt, base_temperature is None, queue,
                              queue_labels, normalize, reduction)
    if be == "reference":
        return ref.dscl(features, labels, s, t, base_temperature if base_temperature is None else bt, beta,
                        queue, queue_labels, normalize, reduction)

    contrast = _contrast_set(features, queue)
    col = torch.cat([labels, labels] if queue is None else [labels, labels, queue_labels])
    spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True,
                    grad_cols=2 * bsz if queue is not None else None)
    own = torch.arange(bsz, 2 * bsz, device=dev)  # anchor i's own view 1
    data = CoreData(target=own, row_labels=labels, col_labels=col)
    a = contrast[:bsz]  # view 0: the first rows of the contrast set
    n_pos = core.positive_counts(spec, data, bsz, contrast.shape[0], contrast)  # >= 1: the own view 1
    # weighted mean of the positive logits (own view 1 weight 1, the o = |P| - 1 others beta / o each):
    # (own + (beta / o) (SET - own)) / (1 + beta) = k SET / o + (1 - k - k / o) own, k = beta / (1 + beta);
    # without others it is own alone (k = 0)
    k = (n_pos > 1).to(n_pos.dtype) * (beta / (1.0 + beta))
    c_set = k / (n_pos - 1).clamp_min_(1)
    coef = Coeffs(lse=1.0, tgt=1.0 - k - c_set, set=c_set)
    out = core.run(be, a, contrast, s, spec, data, coef, reduce=reduction != "none")
    return out * _factor(t, bt, reduction, bsz, out)


# ----------------------------------------------------------------------------------------------
# SupCon and DSCL under gather
# ----------------------------------------------------------------------------------------------


def _gathered_views(features: Tensor, grp) -> list[Tensor]:
    """Every view of every rank's samples: [global bsz, D] per view (the contrast set, view-major)."""
    return [D.gather_rows(features[:, v], grp, name="features")[0] for v in range(features.shape[1])]


def _gathered_queue(queue: Tensor | None, queue_labels: Tensor | None, dtype, grp):
    if queue is None:
        return None, None
    q, _, _ = D.gather_rows(queue.detach().to(dtype), grp, name="queue")
    ql = D.gather_rows(queue_labels, grp, name="queue_labels")[0] if queue_labels is not None else None
    return q, ql


def _supcon_gathered(be, grp, off, bsz_g, features, labels, mask, s, t, bt, contrast_mode, variant, queue,
                     queue_labels, normalize, reduction) -> Tensor:
    """SupCon under ``gather``: each view's anchor block of this rank against the gathered view-major
    contrast set (its own columns at ``v * global bsz + offset``), then the gathered queue."""
    bsz, n_views, _ = features.shape
    dev = features.device
    world = D.world_size(grp)
    blocks = range(n_views) if contrast_mode == "all" else range(1)
    n_anchors = len(blocks) * bsz_g
    factor = t / bt
    if be == "reference":
        feats, _, _ = D.gather_rows(features, grp, name="features")
        lab = D.gather_rows(labels, grp, name="labels")[0] if labels is not None else None
        full_mask = D.gather_rows(mask, grp, name="mask")[0] if mask is not None else None
        q, ql = _gathered_queue(queue, queue_labels, feats.dtype, grp)
        per = ref.supcon(feats, lab, full_mask, s, t, bt, contrast_mode, variant, q, ql, normalize, "none")
        per = torch.cat([per[v * bsz_g + off:v * bsz_g + off + bsz] for v in blocks])
        return _per_rank(per, reduction, n_anchors, world)
    views = _gathered_views(features, grp)
    contrast = torch.cat(views)
    q, ql = _gathered_queue(queue, queue_labels, contrast.dtype, grp)
    if q is not None:
        contrast = torch.cat([contrast, q])
    m = contrast.shape[0]
    if mask is not None:
        data = CoreData(pos_mask=mask)
    else:
        lab = labels if labels is not None else torch.arange(bsz, device=dev) + off  # SimCLR: global ids
        lab_g, _, _ = D.gather_rows(lab, grp, name="labels")
        col = lab_g.repeat(n_views)
        if q is not None:
            col = torch.cat([col, ql if ql is not None else torch.full((q.shape[0],), -1, device=dev)])
        data = CoreData(row_labels=lab, col_labels=col)
    keep = reduction != "none"
    outs = []
    for v in blocks:
        spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True, offset=v * bsz_g + off,
                        grad_cols=n_views * bsz_g if q is not None else None)
        n_pos = core.positive_counts(spec, data, bsz, m, contrast)
        has = n_pos > 0
        hp = has.to(n_pos.dtype)
        safe_n = torch.where(has, n_pos, torch.ones_like(n_pos))
        if variant == "out":
            out = core.run(be, features[:, v], contrast, s, spec, data, Coeffs(lse=hp, set=hp / safe_n), reduce=keep)
        else:
            const = hp * torch.log(safe_n)
            out = core.run(be, features[:, v], contrast, s, spec, data, Coeffs(lse=hp, pos=-hp), reduce=keep)
            out = out + (const.sum() if keep else const)
        outs.append(out)
    out = sum(outs[1:], outs[0]) if keep else torch.cat(outs)
    out = _per_rank(out, reduction, n_anchors, world)
    return out * (factor.to(out.dtype) if isinstance(factor, Tensor) else factor)


def _dscl_gathered(be, grp, features, labels, beta, s, t, bt, bt_is_t, queue, queue_labels, normalize,
                   reduction) -> Tensor:
    """DSCL under ``gather``: this rank's view-0 anchors against [view 0; view 1; queue] of every rank."""
    bsz = features.shape[0]
    dev = features.device
    world = D.world_size(grp)
    lab_g, off, sizes = D.gather_rows(labels, grp, name="labels")
    bsz_g = sum(sizes)
    factor = t / bt
    if be == "reference":
        feats, _, _ = D.gather_rows(features, grp, name="features")
        q, ql = _gathered_queue(queue, queue_labels, feats.dtype, grp)
        per = ref.dscl(feats, lab_g, s, t, None if bt_is_t else bt, beta, q, ql, normalize, "none")
        return _per_rank(per[off:off + bsz], reduction, bsz_g, world)
    views = _gathered_views(features, grp)
    q, ql = _gathered_queue(queue, queue_labels, views[0].dtype, grp)
    contrast = torch.cat(views + ([q] if q is not None else []))
    col = torch.cat([lab_g, lab_g] + ([ql] if q is not None else []))
    spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True, offset=off,
                    grad_cols=2 * bsz_g if q is not None else None)
    own = torch.arange(bsz, device=dev) + bsz_g + off  # anchor i's own view 1
    data = CoreData(target=own, row_labels=labels, col_labels=col)
    n_pos = core.positive_counts(spec, data, bsz, contrast.shape[0], contrast)
    k = (n_pos > 1).to(n_pos.dtype) * (beta / (1.0 + beta))
    c_set = k / (n_pos - 1).clamp_min_(1)
    out = core.run(be, features[:, 0], contrast, s, spec, data, Coeffs(lse=1.0, tgt=1.0 - k - c_set, set=c_set),
                   reduce=reduction != "none")
    out = _per_rank(out, reduction, bsz_g, world)
    return out * (factor.to(out.dtype) if isinstance(factor, Tensor) else factor)
