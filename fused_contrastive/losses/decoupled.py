"""Decoupled contrastive learning (Yeh et al. 2022): the positive pair removed from the denominator,
``L_i = -w_i l_{i, p(i)} + log sum_{j != i, p(i)} exp(l_ij)``. The core op with the target column left
out of each row's log-sum-exp and read in the target term (``CoreSpec.exclude_target``). Common
arguments: see :mod:`fused_contrastive.losses`."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validate as V
from .. import core, ops
from .. import distributed as D
from .._amp import autocast_off
from .._backend import resolve
from ..core import reference as ref
from ..core.norms import normalize_rows
from ..core.spec import Coeffs, CoreData, compute_dtype
from ._scope import EPS, Scope, spec

__all__ = ["dcl_loss", "dclw_loss"]


def _dcl(z1: Tensor, z2: Tensor, temperature, sigma, normalize: bool, reduction: str, backend: str,
         gather) -> Tensor:
    """DCL (``sigma`` None) or DCLW: validation, then one core-op call per anchor block."""
    z1 = V.embeddings("z1", z1)
    z2 = V.paired("z1", z1, "z2", z2)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    if sigma is not None:
        sigma = V.number("sigma", sigma, low=0.0, strict=True)
    dt = compute_dtype(z1, z2)
    s, _ = V.scale_of(temperature, None, 0.1, dt, z1.device)
    be = resolve(backend, z1, z2)
    scope = Scope(gather)
    n = z1.shape[0]
    if scope.local and n < 2:
        raise ValueError(f"z1 must hold at least 2 samples (each anchor needs a negative), got {n}")
    dev = z1.device
    off, n_glob = scope.agree(s, rows=n)
    if n_glob < 2:
        raise ValueError(f"z1 must hold at least 2 samples over all ranks, got {n_glob}")
    z1_all = scope.rows(z1, "z1")[0]
    contrast = torch.cat([z1_all, scope.rows(z2, "z2")[0]])  # view 1 of every sample, then view 2
    w = None
    if sigma is not None:  # DCLW: softmax over the (global) batch of the positive pairs' similarities
        with torch.no_grad():
            # the backends' own overflow-free normalisation (the reference backend is the oracle's)
            sim = (normalize_rows(z1, EPS, dt, normalize)[0] * normalize_rows(z2, EPS, dt, normalize)[0]).sum(1)
            sim = scope.rows(sim[:, None], "z1")[0][:, 0]
            w = (2.0 - n_glob * torch.softmax(sim / sigma, dim=0))[off:off + n]
    i = torch.arange(n, device=dev)
    if scope.local:  # one problem: B is A = [z1; z2], row r's own column r, its partner r +- n
        blocks = [(None, 0, torch.cat([i + n, i]), None if w is None else w.repeat(2))]
    else:  # view-1 anchors: own column off + i, partner n_glob + off + i; view-2 anchors the other way
        blocks = [(z1, off, n_glob + off + i, w), (z2, n_glob + off, off + i, w)]
    per_n = reduction == "mean" and not ops.tracing_route() and scope.local
    c = 1.0 / (2 * n) if per_n else 1.0
    outs = []
    for anchors, own, partner, wb in blocks:
        rows = contrast if anchors is None else anchors
        if be == "reference":
            own_cols = own + torch.arange(rows.shape[0], device=dev)
            per = ref.dcl_rows(rows, contrast, s, own_cols, partner, wb, normalize)
            outs.append(per if reduction == "none" else per.sum() * c)
            continue
        sp = spec(normalize, exclude_self=True, offset=own, exclude_target=True)
        coef = Coeffs(lse=c, tgt=c if wb is None else wb.to(dt) * c)
        outs.append(core.run(be, rows, None if anchors is None else contrast, s, sp, CoreData(target=partner), coef,
                             reduce=reduction != "none"))
    out = outs[0] if len(outs) == 1 else (torch.cat(outs) if reduction == "none" else outs[0] + outs[1])
    return out if per_n else scope.reduce(out, reduction, 2 * n_glob)


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
