"""The tile budget every PyTorch path chunks by (:func:`tile_elements`: elements of one materialised tile,
env ``FUSED_CONTRASTIVE_TILE_ELEMENTS``) and the chunk helpers the families' PyTorch paths share: the rows of a
chunk (``_row_chunk``), an LSE safe to subtract (``_safe``), a coefficient as a vector (``_vec``) and the scale's
gradient from one softmax term (``_ScaleGrad``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..routes import setting
from .spec import Coef

_NEG_INF = float("-inf")
_DEFAULT_TILE_ELEMENTS = 1 << 21  # 8 MiB of float32 per tile


def tile_elements_set() -> bool:
    """Whether env ``FUSED_CONTRASTIVE_TILE_ELEMENTS`` sets the tile budget (then no route overrides it)."""
    return setting("TILE_ELEMENTS") is not None


def tile_elements() -> int:
    """Elements of one transient logit tile (env ``FUSED_CONTRASTIVE_TILE_ELEMENTS`` overrides)."""
    v = setting("TILE_ELEMENTS")
    return _DEFAULT_TILE_ELEMENTS if v is None else v


def _row_chunk(n: int, m: int) -> int:
    return max(1, min(n, tile_elements() // max(m, 1)))


def _safe(lse: Tensor) -> Tensor:
    """LSE with -inf (a row whose columns are all excluded) replaced by 0, so exp(l - lse) = 0."""
    return torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse)


def _vec(c: Coef | None, n: int, like: Tensor) -> Tensor | None:
    """A coefficient as an [n] tensor of ``like``'s dtype and device (None stays None)."""
    if c is None:
        return None
    if isinstance(c, Tensor):
        return c.to(like.dtype)
    return torch.full((n,), float(c), dtype=like.dtype, device=like.device)


class _ScaleGrad:
    """The scale's gradient from one softmax term, ``sum_i g_i sum_j p_ij c_ij``, accumulated per row
    (or per column of a column term) as ``e_i = sum_j p_ij c_ij`` and ``z_i = sum_j p_ij`` and combined
    as ``sum_i g_i e_i / z_i``.

    Mathematically ``z_i = 1``. Computed, ``exp(l - LSE)`` sums to ``exp(-delta_i)``, ``delta_i`` the
    rounding of the row's LSE (a few ulp, depending on the CPU's vectorised exp / log / sum); the
    scale's gradient ``e_i - c_it`` cancels (to 1/30 of its terms at D = 1), amplifying ``delta_i``, and
    rows of the same structure (every row at D = 1) share it, so it does not average out: the float32
    gradient of a temperature was off by ~30 ulp-relative on some CPUs. Dividing by the computed ``z_i``
    removes ``delta_i``. A row whose entries are all excluded has ``e_i = z_i = 0`` and adds 0.

    The vectors are float64 (O(N) memory): a column's sums collect one partial per row chunk, as many
    as there are chunks, and a float32 running sum of hundreds of partials drifts by as much again.
    """

    def __init__(self, n: int, like: Tensor):
        self.e = torch.zeros(n, device=like.device, dtype=torch.float64)
        self.z = torch.zeros(n, device=like.device, dtype=torch.float64)

    def add(self, p: Tensor, c: Tensor, i0: int, i1: int, dim: int) -> None:
        self.e[i0:i1] += torch.linalg.vecdot(p, c, dim=dim)
        self.z[i0:i1] += p.sum(dim=dim)

    def total(self, g: Tensor) -> Tensor:
        return (g * self.e / torch.where(self.z > 0, self.z, 1.0)).sum().to(g.dtype)
