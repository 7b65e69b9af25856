"""The contract of the one core op under every InfoNCE-family loss, stated once for all backends.

Anchors ``A`` [N, D] and contrast set ``B`` [M, D]; ``b=None`` means B is A (N == M, the symmetric
case). With ``a_i = A_i / max(||A_i||, eps)`` (``b_j`` likewise; raw rows when ``normalize=False``)
and the scale ``s`` (``1 / temperature``)::

    l_ij     = s <a_i, b_j> + bias [j == bias_col_i]          logits (never materialised beyond a tile)
    l_ij     = s (<a_i, b_j> - margin)          at j == target_i when margin != 0 (additive margin)
    l_ij     = -inf                 where exclude_self and j == offset + i   (the anchor's own column)
    w_ij     = [row_labels_i == col_labels_j]  or  pos_mask[i % n0, j % m0]   (positive weights;
               w_ij = 0 at the excluded own column)

    LSE_i    = log sum_j exp(l_ij)                              row log-sum-exp
    LSEcol_j = log sum_i exp(l_ij)                              column log-sum-exp (CLIP)
    LSEpos_i = log sum_j w_ij exp(l_ij)                         log-sum-exp over positives (SupCon L_in)
    TGT_i    = l_{i, target_i}                                  the target logit (cross-entropy)
    SET_i    = sum_j w_ij l_ij                                  weighted sum of positive logits (SupCon L_out)

A loss is a coefficient vector per statistic (:class:`Coeffs`); the core op returns the per-row loss

    loss_i = c.lse_i LSE_i + c.col_i LSEcol_i + c.pos_i LSEpos_i - c.tgt_i TGT_i - c.set_i SET_i

(``reduce=False``, [N]; the column term pairs column i with row i, so it needs N == M) or its sum over
rows (``reduce=True``, 0-dim). A term whose coefficient is 0 is dropped, not multiplied, so the
``-inf`` LSEpos of a row without positives or the ``-inf`` target of an ignored row never turns into
NaN. Everything a loss adds around this (constants such as ``log |P_i|``, a ``t / t_base`` factor, the
mean's denominator) is O(N) PyTorch in ``losses/``.

The statistics come out of one pass over the logit tiles; the gradient is
``dl_ij = g_i (c.lse_i p_ij + c.pos_i q_ij - c.tgt_i [j == target_i] - c.set_i w_ij) + g_j c.col_j pc_ij``
with ``p = exp(l - LSE)``, ``pc = exp(l - LSEcol)``, ``q = w exp(l - LSEpos)``, then
``dA_i = s sum_j dl_ij b_j``, ``dB_j = s sum_i dl_ij a_i`` and the normalisation's backward
(``docs/core-op.md`` derives it). Which implementation runs is the business of
``fused_contrastive.core.run``: a dense one-tile path for problems that fit the tile budget, the
chunked PyTorch path, or the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

#: A coefficient: one value per row ([N] tensor) or the same Python number for every row.
Coef = Tensor | float


def compute_dtype(*xs: Tensor | None) -> torch.dtype:
    """The accumulation dtype of every backend: float64 if any input is float64, else float32 (half
    inputs are accumulated in float32)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def graph_free(*xs):
    """``xs`` with every tensor detached when autograd records nothing (``torch.no_grad``,
    ``torch.inference_mode``), else unchanged. An autograd Function cannot tell from inside: its forward
    always runs with grad mode off and ``ctx.needs_input_grad`` follows ``requires_grad`` alone, so the
    eager routes (a summed loss forms its gradients in the forward) would do two matmul units of work
    that no backward reads. The losses' entry points pass their inputs through this first."""
    if torch.is_grad_enabled():
        return xs
    return tuple(x.detach() if isinstance(x, Tensor) else x for x in xs)


class DirectCtx:
    """Stands in for ``ctx`` of an autograd Function whose ``forward`` and ``backward`` are called
    directly: inside a registered operator (which runs below autograd) and where one Function is
    built from others' passes (``core.blocks.TritonMergedFn``)."""

    def __init__(self, needs):
        self.needs_input_grad = tuple(needs)
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


@dataclass(frozen=True)
class CoreSpec:
    """Static options of the core op (hashable: they are carried through autograd Functions)."""

    normalize: bool = True
    eps: float = 1e-12
    exclude_self: bool = False  # -inf at column offset + i of row i
    offset: int = 0  # anchor i's own column is offset + i (anchors = a slice of the contrast set)
    bias: float = 0.0  # added to l[i, bias_col[i]] (needs CoreData.bias_col)
    grad_cols: int | None = None  # only columns [0, grad_cols) of B may need a gradient (a queue after)
    # column target[i] is left out of row i's log-sum-exps (and of that column's), while the target term
    # reads l[i, target[i]] as it is: "the positive in the numerator only" (DCL). Needs CoreData.target;
    # not combined with a bias column (the paths that stream tiles exclude it as a -inf bias)
    exclude_target: bool = False
    # an additive margin in cosine units on each row's target logit: l[i, target[i]] = s (c - margin)
    # (AM-softmax, LaBSE). Everything reads the shifted logit (the row and column LSEs, the target
    # term) and the scale's gradient takes c - margin there, but SET, which a margin takes only with one
    # weight for every column (a [1, 1] pos_mask: label smoothing's mean logit), sums the unshifted s c
    # (the caller adds the constant). Needs CoreData.target; not combined with exclude_target, a bias
    # column, or other positives' terms
    margin: float = 0.0


@dataclass
class CoreData:
    """Non-differentiable tensors of one problem (None when absent). Integer tensors are int64."""

    target: Tensor | None = None  # [N] column of each row's target logit (any valid column where c.tgt is 0)
    bias_col: Tensor | None = None  # [N] column that receives ``spec.bias``
    row_labels: Tensor | None = None  # [N] positives by label equality (with col_labels)
    col_labels: Tensor | None = None  # [M]
    pos_mask: Tensor | None = None  # [n0, m0] non-negative weights, w_ij = pos_mask[i % n0, j % m0]

    @property
    def has_positives(self) -> bool:
        return self.row_labels is not None or self.pos_mask is not None


@dataclass
class Coeffs:
    """Per-row coefficients of the statistics (see the module docstring): floating [N] tensors (``col``
    is [M]) or one Python number for every row. ``lse`` is required; None means the statistic is not
    computed at all."""

    lse: Coef
    col: Coef | None = None
    pos: Coef | None = None
    tgt: Coef | None = None
    set: Coef | None = None

    def to(self, dtype: torch.dtype) -> Coeffs:
        """Tensor coefficients cast to ``dtype`` (numbers stay numbers)."""
        def cast(v):
            return v.to(dtype) if isinstance(v, Tensor) else v
        return Coeffs(**{f.name: cast(getattr(self, f.name)) for f in fields(self)})


def check_problem(n: int, m: int, spec: CoreSpec, data: CoreData, coef: Coeffs, reduce: bool) -> None:
    """Internal consistency of a core-op call (the losses build these; a failure is a bug, not bad
    user input, so it raises AssertionError-like ValueErrors with the field names)."""
    for name, size in (("lse", n), ("col", m), ("pos", n), ("tgt", n), ("set", n)):
        c = getattr(coef, name)
        if isinstance(c, Tensor) and c.shape != (size,):
            raise ValueError(f"core: coefficient {name!r} must have shape [{size}], got {tuple(c.shape)}")
    if coef.col is not None and not reduce and n != m:
        raise ValueError("core: per-row output with a column term needs N == M")
    if coef.tgt is not None and data.target is None:
        raise ValueError("core: coefficient 'tgt' needs CoreData.target")
    if spec.exclude_target and data.target is None:
        raise ValueError("core: exclude_target needs CoreData.target")
    if spec.exclude_target and data.bias_col is not None and spec.bias != 0.0:
        raise ValueError("core: exclude_target cannot be combined with a bias column")
    if spec.margin != 0.0:
        if data.target is None:
            raise ValueError("core: margin needs CoreData.target (the column it is subtracted at)")
        uniform_set = coef.set is not None and data.pos_mask is not None and tuple(data.pos_mask.shape) == (1, 1)
        if spec.exclude_target or (data.bias_col is not None and spec.bias != 0.0) or coef.pos is not None \
                or (coef.set is not None and not uniform_set):
            raise ValueError("core: margin is not combined with exclude_target, a bias column, pos terms or set "
                             "terms other than one weight for every column")
    if (coef.pos is not None or coef.set is not None) and not data.has_positives:
        raise ValueError("core: coefficients 'pos' / 'set' need row/col labels or pos_mask")


def drop_zero(c: Coef, v: Tensor, may_be_inf: bool = True) -> Tensor:
    """``c * v`` with 0 wherever ``c == 0`` (so 0 * inf of a dropped term never leaks). Where the
    caller knows ``v`` is finite for finite inputs (``may_be_inf=False``) a plain product does: a NaN
    input then still propagates, as it must."""
    if not isinstance(c, Tensor):
        return v if c == 1 else (v * c if c != 0 else torch.zeros_like(v))
    return torch.where(c != 0, c * v, 0.0) if may_be_inf else c * v


def combine(coef: Coeffs, reduce: bool, lse: Tensor, lse_col: Tensor | None = None,
            lse_pos: Tensor | None = None, tgt: Tensor | None = None,
            set_: Tensor | None = None) -> Tensor:
    """The per-row loss (or its sum) from the statistics; differentiable in the statistics."""
    out = drop_zero(coef.lse, lse)
    col = drop_zero(coef.col, lse_col) if coef.col is not None else None
    if col is not None and not reduce:
        out = out + col
    if coef.pos is not None:
        out = out + drop_zero(coef.pos, lse_pos)
    if coef.tgt is not None:
        out = out - drop_zero(coef.tgt, tgt)
    if coef.set is not None:
        out = out - drop_zero(coef.set, set_)
    if not reduce:
        return out
    return out.sum() + col.sum() if col is not None else out.sum()


def coef_grad(c, go: Tensor, n: int, stat: Tensor | None) -> Tensor | None:
    """The upstream gradient of one statistic: ``c * go`` per row as fp32 [n], 0 where the statistic is
    -inf (a row without positives: its term is dropped, see ``spec.drop_zero``); None when absent."""
    if c is None or stat is None:
        return None
    g = (c.to(torch.float32) if isinstance(c, Tensor) else float(c)) * go
    g = g.expand(n) if g.dim() == 0 else g
    return torch.where(stat == float("-inf"), 0.0, g).contiguous()


def set_grad(c, go: Tensor, n: int) -> Tensor:
    """The SET term's upstream coefficients ``c.set_i go`` as fp32 [n] (``c`` a number or an [n] tensor)."""
    g = (c.to(device=go.device, dtype=torch.float32) if isinstance(c, Tensor) else float(c)) * go.to(torch.float32)
    return (g.expand(n) if g.dim() == 0 else g).contiguous()


def threshold_of(gpos: Tensor, margin_strategy: str, margin: float) -> Tensor:
    """GIST's ``theta_i``: ``gpos - margin`` ("absolute") or ``gpos - |gpos| * margin`` ("relative", the
    sign-independent rule of sentence-transformers 6.2), in ``gpos``'s dtype (here, the leaf both
    ``guided/torch_blocks.py`` and ``guided/triton_blocks.py`` read, so neither imports the other for it)."""
    return gpos - margin if margin_strategy == "absolute" else gpos - gpos.abs() * margin
