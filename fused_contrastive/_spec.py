"""The one core op under every InfoNCE-family loss, described once for all backends.

Anchors ``A`` [N, D] and contrast set ``B`` [M, D] (``B`` may be ``A`` itself: ``same=True``).
With ``a_i = A_i / max(||A_i||, eps)`` (when ``normalize``) and scale ``s = 1 / temperature``::

    l_ij = s * <a_i, b_j> + bias * [j == bias_col_i]          (logits, never materialised)
    l_ij = -inf  where  exclude_self and j == offset + i       (the anchor's own column)

    LSE_i    = log sum_j exp(l_ij)                             (always)
    LSEcol_j = log sum_i exp(l_ij)                             (want_col: CLIP's column CE)
    LSEpos_i = log sum_j w_ij exp(l_ij)                        (want_pos: SupCon L_in)

where the positive weights ``w_ij`` are ``[row_labels_i == col_labels_j]`` or a dense non-negative
``pos_mask[i % n0, j % m0]`` (SupContrast's [bsz, bsz] mask, tiled over views without being
repeated). Everything else a loss needs is O(N*D) PyTorch around this op (see ``losses.py``).

Backends implement it as an autograd Function in one of two modes:
- *vector* mode returns ``(LSE, LSEcol, LSEpos)`` and recomputes the tiles in backward;
- *weighted* mode returns the scalar ``sum_i wr_i LSE_i + sum_j wc_j LSEcol_j + sum_i wp_i LSEpos_i``
  (terms with weight 0 are dropped, so a ``-inf`` LSEpos of a zero-positive row contributes 0).
  A mean or sum reduction only ever needs this scalar, and because its upstream gradient is a
  scalar, a backend may compute the gradients during the forward (no recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def compute_dtype(*xs: Optional[torch.Tensor]) -> torch.dtype:
    """The accumulation dtype of every backend and positive term: float64 if any input is float64,
    else float32 (half inputs are accumulated in float32)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


@dataclass(frozen=True)
class CoreSpec:
    """Non-tensor options of the core op (hashable, carried through the autograd Function)."""

    normalize: bool = True
    eps: float = 1e-12
    exclude_self: bool = False
    offset: int = 0  # anchor i's own column is offset + i
    same: bool = False  # contrast set is the anchor tensor itself (N == M, offset 0)
    want_col: bool = False
    want_pos: bool = False
    bias: float = 0.0  # added to l[i, bias_col[i]] when bias_col is given
    grad_cols: Optional[int] = None  # only columns [0, grad_cols) of B need a gradient (queue after)


@dataclass
class CoreTensors:
    """Optional non-differentiable tensors of the core op (None when absent)."""

    row_labels: Optional[torch.Tensor] = None  # [N] int64
    col_labels: Optional[torch.Tensor] = None  # [M] int64
    pos_mask: Optional[torch.Tensor] = None  # [n0, m0] float, w_ij = pos_mask[i % n0, j % m0]
    bias_col: Optional[torch.Tensor] = None  # [N] int64
    w_row: Optional[torch.Tensor] = None  # weighted mode: [N] float
    w_col: Optional[torch.Tensor] = None  # weighted mode: [M] float
    w_pos: Optional[torch.Tensor] = None  # weighted mode: [N] float

    @property
    def weighted(self) -> bool:
        return self.w_row is not None


def weighted_total(lse: torch.Tensor, lse_col: Optional[torch.Tensor], lse_pos: Optional[torch.Tensor],
                   t: CoreTensors) -> torch.Tensor:
    """The weighted-mode output ``sum_i wr_i LSE_i + sum_j wc_j LSEcol_j + sum_i wp_i LSEpos_i``.

    Terms with weight 0 are dropped (``where``, not ``0 * x``), so the ``-inf`` LSEpos of a row with no
    positive contributes 0 instead of NaN. Differentiable in the statistics.
    """

    def term(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w = w.to(v.dtype)
        return torch.where(w != 0, w * v, torch.zeros_like(v)).sum()

    total = term(t.w_row, lse)
    if lse_col is not None and t.w_col is not None:
        total = total + term(t.w_col, lse_col)
    if lse_pos is not None and t.w_pos is not None:
        total = total + term(t.w_pos, lse_pos)
    return total
