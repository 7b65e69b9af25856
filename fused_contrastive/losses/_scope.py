"""What every loss body shares: the spec cache, the contrast set's :class:`Scope` (this process or
every rank of a process group), the cross-entropy rows of the core op and the reduction contract.

A loss has one body. A local call (``gather=False``) is the world of one rank: its rows start at
offset 0, the "gathered" contrast set is its own, counts are its own and the reduction divides by the
local denominator. Under ``gather`` the same body sees every rank's rows, its anchors' own columns at
the rank's offset, and returns the per-rank value of :meth:`Scope.reduce`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import core, ops
from .. import distributed as D
from ..core import reference as ref
from ..core.spec import Coeffs, CoreData, CoreSpec, compute_dtype
from . import _row_terms as rows

EPS = 1e-12
DEFAULT_TEMPERATURE = 0.05

_SPECS: dict = {}  # a plain dict, not functools.lru_cache (Dynamo warns when it traces through one)


def spec(normalize: bool, exclude_self: bool = False, bias: float = 0.0, offset: int = 0, **more) -> CoreSpec:
    """A CoreSpec with the losses' eps (``more``: its other fields). Specs are immutable: those without a
    size in them (offset 0, ``more`` flags only) are shared, since constructing one per call costs
    microseconds, which a small batch notices; one holding a size (a rank's offset, a queue's
    ``grad_cols``) is made fresh, as sizes are unbounded."""
    sized = any(not isinstance(v, bool) and v is not None for v in more.values())
    if offset or sized or ops.tracing_route():  # no cache mutation inside a compiled graph (it would be guarded on)
        return CoreSpec(normalize=normalize, eps=EPS, exclude_self=exclude_self, bias=bias, offset=offset, **more)
    key = (normalize, exclude_self, bias, *sorted(more.items()))
    s = _SPECS.get(key)
    if s is None:
        s = _SPECS[key] = CoreSpec(normalize=normalize, eps=EPS, exclude_self=exclude_self, bias=bias, **more)
    return s


class Scope:
    """Where a loss's contrast set lives: this process (``gather`` False) or every rank of a process
    group (``gather`` True or a ProcessGroup; see :func:`distributed.process_group`)."""

    def __init__(self, gather) -> None:
        self.grp = D.process_group(gather)
        self.local = self.grp is None
        self.world = 1 if self.local else D.world_size(self.grp)

    def agree(self, scale, rows: int | None = None, cols: int | None = None) -> tuple[int, int]:
        """The ranks' first collective (the scale checked equal everywhere, a failing rank reported on
        all of them): ``(this rank's offset, the global rows)``; locally ``(0, rows)``."""
        if self.local:
            return 0, rows or 0
        return D.agree(self.grp, scale=scale, rows=rows, cols=cols)

    def rows(self, x: Tensor, name: str) -> tuple[Tensor, int, int]:
        """``(every rank's x in rank order, this rank's row offset, the total rows)``; locally
        ``(x, 0, len(x))``. Differentiable (see :func:`distributed.gather_rows`)."""
        if self.local:
            return x, 0, x.shape[0]
        out, off, sizes = D.gather_rows(x, self.grp, name=name)
        return out, off, sum(sizes)

    def offset(self, n: int, device) -> tuple[int, int]:
        """``(this rank's offset, the total)`` of a batch of which every rank holds ``n`` rows."""
        return (0, n) if self.local else D.row_offset(n, device, self.grp)

    def sum(self, x: Tensor) -> Tensor:
        """A count summed over the ranks (no gradient)."""
        return x if self.local else D.all_sum(x, self.grp)

    def reduce(self, out: Tensor, reduction: str, denom, leveled: bool = False) -> Tensor:
        """The value a loss returns from ``out`` (per-anchor losses, or their sum when 0-dim):
        ``"none"``: the (local) per-anchor losses; ``"sum"`` / ``"mean"``: the sum / the sum over
        ``denom`` (the global denominator, a number or an integer tensor). Under ``gather`` a rank
        returns its local sum times ``world`` (divided by the global denominator for a mean), so that
        the average over ranks (what DDP's gradient all-reduce takes) is the global-batch loss.
        ``leveled``: ``out`` has a leading Matryoshka level dimension ([K, N] or [K]), kept."""
        if reduction == "none":
            return out
        out = out.sum(-1) if out.dim() > leveled else out
        if self.local:
            return out / denom if reduction == "mean" else out
        if reduction == "sum":
            return out * self.world
        if isinstance(denom, Tensor):  # a count summed over ranks (an integer tensor: no host read)
            return out * self.world / denom.to(out.dtype)
        return out * (self.world / denom)


def cross_entropy(be: str, scope: Scope, query: Tensor, keys: Tensor | None, s, target: Tensor, *,
                  offset: int, exclude_self: bool, normalize: bool, reduction: str, n_total: int,
                  valid: Tensor | None = None, symmetric: bool = False, bias_col: Tensor | None = None,
                  bias: float = 0.0, margin: float = 0.0, levels=None, label_smoothing: float = 0.0,
                  tau_plus=None) -> Tensor:
    """``CE(logits_i, target_i)`` of every local anchor ``query`` against ``keys`` (None: the anchors
    themselves, B is A), the anchors' own columns at ``offset``, rows outside ``valid`` contributing 0
    (and leaving the mean's denominator), reduced by ``scope`` over ``n_total`` anchors. With
    ``symmetric`` (local only, ``valid`` None) CLIP's ``(row CE + column CE) / 2``: the core op with
    coefficients 1/2 on LSE and on LSEcol, 1 on the target logit. ``levels`` (a ``_levels.Levels``):
    one value per Matryoshka level (leading dimension K). ``margin``: the core op's additive margin on
    the target logit, ``s (cos - margin)`` (AM-softmax; no ``valid``, ``exclude_self`` or bias).
    ``label_smoothing``: ``F.cross_entropy``'s, over the columns of each row's softmax (``_row_terms``);
    ``tau_plus`` (a float in (0, 1) or an [N] tensor; no bias or margin): the debiased loss instead."""
    n = query.shape[0]
    if tau_plus is not None:
        return _debiased(be, scope, query, keys, s, target, tau_plus, offset=offset, exclude_self=exclude_self,
                         normalize=normalize, reduction=reduction, n_total=n_total, valid=valid,
                         symmetric=symmetric, levels=levels, label_smoothing=label_smoothing)
    if be == "reference" and margin != 0.0:
        per = ref.margin_cross_entropy(query, keys, target, s, margin, symmetric, normalize, label_smoothing)
        return scope.reduce(per, reduction, n_total)
    if be == "reference":
        per = ref.info_nce(query, keys, target, s, exclude_self, symmetric, normalize, "none", -100, offset=offset,
                           label_smoothing=label_smoothing)
        if valid is not None:
            per = torch.where(valid, per, torch.zeros_like(per))
        return scope.reduce(per, reduction, n_total if valid is None else scope.sum(valid.sum()))
    keep = reduction != "none"
    # label smoothing inside the core op where it can be: 1 - eps on the target logit and eps / |C_i| on the
    # SET statistic with one weight for every column (the mean logit: O(N*D) on the streaming paths, a row sum
    # of the tile on the one-tile path; the op's SET sums the unshifted logits, so a target margin adds its
    # constant here); outside it (O(N*D) autograd, ``_row_terms``) for CLIP's per-pair values (SET is a row
    # statistic) and under compile / export (a coefficient eps / M would be a constant of the graph, recompiled
    # for every batch size; Inductor fuses the O(N*D) term's elementwise work)
    inside = bool(label_smoothing) and (keep or not symmetric) and not ops.tracing_route()
    smooth = None
    if label_smoothing and not inside:
        tgt, mean, mean_t = rows.logit_terms(query, keys, s, target, offset=offset, exclude_self=exclude_self,
                                             normalize=normalize, bias_col=bias_col, bias=bias, margin=margin,
                                             levels=levels, transposed=symmetric)
        smooth = rows.smoothing(label_smoothing, tgt, mean, mean_t)
    sp = spec(normalize, exclude_self, bias, offset if exclude_self else 0,
              **({"margin": float(margin)} if margin != 0.0 else {}))
    data = CoreData(target=target, bias_col=bias_col)
    lv = None if levels is None else levels.core
    if inside:
        data.pos_mask = torch.ones(1, 1, dtype=compute_dtype(query, keys), device=query.device)
    if valid is None:
        # the same weight on every row: a local mean is the sum with weights 1/N (no division after;
        # under compile the weights are 1 and the sum is divided after: a weight 1/N would be a
        # constant of the compiled graph, recompiled for every batch size)
        per_n = reduction == "mean" and scope.local and not ops.tracing_route()
        c = 1.0 / n if per_n else 1.0
        coef = Coeffs(lse=0.5 * c, col=0.5 * c, tgt=c) if symmetric else Coeffs(lse=c, tgt=c)
        if inside:
            coef = _smoothed(coef, label_smoothing, query, keys, offset, exclude_self, c)
        out = core.run(be, query, keys, s, sp, data, coef, reduce=keep, levels=lv)
        if smooth is not None:
            out = out + _weighted(smooth * c, keep)
        if inside and margin != 0.0:  # the mean logit's - s margin / M at the target (SET reads s c)
            per = label_smoothing * margin / (n if keys is None else keys.shape[0]) * c
            out = out + s * (per * n if keep else torch.full((n,), per, dtype=out.dtype, device=out.device))
        return out if per_n else scope.reduce(out, reduction, n_total, leveled=lv is not None)
    w = valid.to(compute_dtype(query, keys))
    coef = Coeffs(lse=w, tgt=w)
    if inside:
        coef = _smoothed(coef, label_smoothing, query, keys, offset, exclude_self, w)
    out = core.run(be, query, keys, s, sp, data, coef, reduce=keep, levels=lv)
    if smooth is not None:
        out = out + _weighted(smooth * w, keep)
    return scope.reduce(out, reduction, scope.sum(valid.sum()), leveled=lv is not None)


def _smoothed(coef: Coeffs, eps: float, query: Tensor, keys: Tensor | None, offset: int, exclude_self: bool,
              c) -> Coeffs:
    """``coef`` (unsmoothed, row weight ``c``: a number or an [N] tensor) with label smoothing: ``(1 - eps)`` of
    the target term and ``eps c / |C_i|`` on SET with one weight for every column, i.e. ``eps c`` times the mean
    logit over the softmax's columns. With a column term (CLIP, summed) the column means add up to the row
    means' total, so SET's ``eps c / M`` per row carries both halves."""
    n = query.shape[0]
    m = n if keys is None else keys.shape[0]
    if not exclude_self:
        per = eps / m
    elif offset + n <= m:  # every row's own column exists
        per = eps / (m - 1)
    else:
        _, has = rows.columns(n, m, offset, exclude_self, query.device)
        per = eps / (m - has.to(compute_dtype(query, keys)))
    return Coeffs(lse=coef.lse, col=coef.col, tgt=coef.tgt * (1 - eps), set=c * per)


def _weighted(per: Tensor, keep: bool) -> Tensor:
    """Per-row terms ([N] or [K, N]) summed over the rows when the core op's output is (``keep``)."""
    return per.sum(-1) if keep else per


def _debiased(be: str, scope: Scope, query: Tensor, keys: Tensor | None, s, target: Tensor, tau, *, offset: int,
              exclude_self: bool, normalize: bool, reduction: str, n_total: int, valid: Tensor | None,
              symmetric: bool, levels, label_smoothing: float) -> Tensor:
    """The debiased contrastive loss (Chuang et al. 2020) of every local anchor (``_row_terms.debiased``),
    plus ``label_smoothing``'s term when given (the sum, memeff's composition). ``symmetric``: CLIP's pair
    ``(row + column) / 2`` (local; ``keys`` given, target the diagonal), the column direction as the
    transposed problem (a second core-op call). Ignored rows (``valid`` False) give 0 and leave the mean."""
    n = query.shape[0]
    m = n if keys is None else keys.shape[0]
    if m - 1 - int(exclude_self) < 1:
        raise ValueError(f"tau_plus needs at least one negative per row (every column but the target and the "
                         f"excluded own column), got {m} columns{' with the own column excluded' * exclude_self}")
    dt = compute_dtype(query, keys)
    if be == "reference":
        per = ref.debiased(query, keys, target, s, tau, exclude_self, symmetric, normalize, offset=offset,
                           label_smoothing=label_smoothing)
    else:
        lv = None if levels is None else levels.core
        sp = spec(normalize, exclude_self, 0.0, offset if exclude_self else 0, exclude_target=True)
        data = CoreData(target=target)
        tgt, mean, mean_t = rows.logit_terms(query, keys, s, target, offset=offset, exclude_self=exclude_self,
                                             normalize=normalize, levels=levels, transposed=symmetric,
                                             means=bool(label_smoothing))
        n_neg = rows.negatives(n, m, offset, exclude_self, query.device, dt)
        r = core.run(be, query, keys, s, sp, data, Coeffs(lse=1.0, tgt=1.0), reduce=False, levels=lv)
        per = rows.debiased(r, tgt, s, tau, n_neg)
        if symmetric:
            rc = core.run(be, keys, query, s, sp, data, Coeffs(lse=1.0, tgt=1.0), reduce=False, levels=lv)
            per = (per + rows.debiased(rc, tgt, s, tau, n_neg)) / 2
        if label_smoothing:
            per = per + rows.smoothing(label_smoothing, tgt, mean, mean_t)
    if valid is not None:
        per = torch.where(valid, per, torch.zeros_like(per))
    return scope.reduce(per, reduction, n_total if valid is None else scope.sum(valid.sum()),
                        leveled=levels is not None)


def temperature_factor(t, base_temperature, out: Tensor):
    """SupCon / DSCL's ``temperature / base_temperature`` multiplier, in ``out``'s dtype when a tensor."""
    f = t / base_temperature
    return f.to(out.dtype) if isinstance(f, Tensor) else f
