"""Row L2 normalisation without overflow, shared by every PyTorch code path of the backends.

``x / max(||x||, eps)`` is ``F.normalize``'s definition, but ``F.normalize`` (``vector_norm``) squares in
the input's precision: a float32 or bfloat16 row with norm above ~1.8e19 overflows to ``inf`` and
normalises to 0 (or, through ``inf / inf``, to NaN), although every value is finite. Here norms of
float16 / bfloat16 / float32 rows are accumulated in float64 (whose range holds the square of any
float32), and float64 rows are scaled by their largest magnitude before squaring, as BLAS ``nrm2``
does. Only NaN or infinite inputs give NaN. (A float32 row whose norm itself exceeds the float32
range, elements of ~1e37, normalises with a subnormal inverse norm: imprecise, never NaN.)

The float64 work runs on row blocks of at most :data:`CHUNK_ELEMENTS` elements on the CPU (2 MiB
temporaries; and only for inputs whose plain norm overflowed, see :func:`clamped_norms`) and
:data:`DEVICE_CHUNK_ELEMENTS` elsewhere: each block costs four kernel launches, and on an H100 at
N = 65536, D = 768 the CPU's block size meant 193 blocks per call, four calls per InfoNCE step (the
target term's forward and backward), ~3000 launches and about 25 ms of a 84 ms step (measured with
``bench/gpu_profile.py``, bench/results/h100-epilogue/). A device block of 2^24 elements (a 128 MiB
float64 temporary, less than the [N, D] float32 copies the callers make at that size) takes 3.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 18  # elements of one float64 temporary on the CPU (2 MiB)
DEVICE_CHUNK_ELEMENTS = 1 << 24  # on other devices (128 MiB; fewer launches, see the module docstring)


def _block_norms(x: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    if x.dtype != torch.float64:
        return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).clamp_min_(eps).to(dtype)
    big = x.detach().abs().amax(dim=1)
    big = torch.where(big > 0, big, torch.ones_like(big))  # zero rows (and NaN rows: NaN > 0 is False)
    return (torch.linalg.vector_norm(x / big[:, None], dim=1) * big).clamp_min_(eps).to(dtype)


def clamped_norms(x: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """``max(||x_i||, eps)`` per row of ``x`` [R, D], in ``dtype``, without overflow for finite ``x``.
    Not differentiable (used inside autograd Functions and for saved statistics).

    On the CPU the norms are first taken in ``dtype`` (no float64 temporary: 3x faster at 64 x 768),
    and the float64 route runs only when one of them overflowed; reading a CPU tensor is not a
    host-device synchronisation. On other devices the float64 route always runs (no read at all).
    """
    if x.device.type == "cpu" and x.dtype != torch.float64:
        fast = torch.linalg.vector_norm(x, dim=1, dtype=dtype)
        if not bool(torch.isinf(fast).any()):
            return fast.clamp_min_(eps)
    chunk = CHUNK_ELEMENTS if x.device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    step = max(1, chunk // max(x.shape[1], 1))
    if x.shape[0] <= step:
        return _block_norms(x, eps, dtype)
    out = torch.empty(x.shape[0], dtype=dtype, device=x.device)
    for r0 in range(0, x.shape[0], step):
        out[r0:r0 + step] = _block_norms(x[r0:r0 + step], eps, dtype)
    return out


def normalize_rows(x: Tensor, eps: float, dtype: torch.dtype, normalize: bool = True
                   ) -> tuple[Tensor, Tensor | None]:
    """``(x_hat, norms)``: ``x`` in ``dtype`` divided by its clamped row norms (``norms`` None and
    ``x_hat`` the raw rows when ``normalize`` is False). Not differentiable."""
    xf = x.to(dtype)
    if not normalize:
        return xf, None
    norm = clamped_norms(x, eps, dtype)
    return xf / norm[:, None], norm


def normalize_backward_(g_hat: Tensor, x_hat: Tensor, norm: Tensor | None, eps: float) -> Tensor:
    """Backward of ``x -> x / max(||x||, eps)``: ``(g - x_hat <g, x_hat>) / ||x||``, or ``g / eps`` for a
    clamped row (then the map is linear). In place on ``g_hat`` (a buffer the caller owns)."""
    if norm is None:
        return g_hat
    proj = torch.linalg.vecdot(g_hat, x_hat, dim=1)
    proj = torch.where(norm > eps, proj, torch.zeros_like(proj))
    g_hat.addcmul_(x_hat, proj[:, None], value=-1.0)
    return g_hat.div_(norm[:, None])


def unit_rows(x: Tensor, eps: float) -> Tensor:
    """Differentiable ``x / max(||x||, eps)`` per row (autograd through PyTorch ops; for O(N*D) code
    outside the backends' Functions), the norm taken as ``m ||x / m||`` with ``m`` the row's largest
    magnitude so that no finite row overflows when squared."""
    m = x.detach().abs().amax(dim=1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    xs = x / m
    r = torch.linalg.vector_norm(xs, dim=1, keepdim=True)
    keep = r * m > eps
    return torch.where(keep, xs / torch.where(keep, r, torch.ones_like(r)), x / eps)


def prefix_rows(x: Tensor, d: int, eps: float) -> Tensor:
    """One Matryoshka level's rows, differentiable: ``x[:, :d] / max(||x[:, :d]||, eps)`` (``F.normalize``,
    sentence-transformers' truncate-then-normalise)."""
    return torch.nn.functional.normalize(x[:, :d], p=2, dim=1, eps=eps)
