"""Input checks shared by every loss: each error names the offending argument."""

from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "torch", "reference", "triton")
REDUCTIONS = ("mean", "sum", "none")

Number = Union[float, int, Tensor]


def embeddings(name: str, x, *, ndim: int = 2) -> Tensor:
    """A floating tensor of ``ndim`` dims with no empty dimension."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def same_device(**tensors: Optional[Tensor]) -> None:
    items = [(k, v) for k, v in tensors.items() if isinstance(v, Tensor)]
    if not items:
        return
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{k} is on {v.device} but {items[0][0]} is on {dev}; put them on one device")


def same_dim(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{name_b} has embedding dimension {b.shape[-1]} but {name_a} has {a.shape[-1]}"
        )


def positive_number(name: str, v: Number, *, device: torch.device) -> None:
    """``v`` is a finite number > 0, or a 0-dim floating tensor on ``device`` (value checked on CPU).

    The value of a CUDA tensor is not read (that would be a host sync every training step).
    """
    if isinstance(v, Tensor):
        if v.numel() != 1 or v.dim() > 1:
            raise ValueError(f"{name} must be a float or a 0-dim tensor, got shape {tuple(v.shape)}")
        if not v.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {v.dtype}")
        if v.device != device and v.device.type != "cpu":
            raise ValueError(f"{name} is on {v.device} but the embeddings are on {device}")
        if v.device.type == "cpu":
            val = float(v.detach())
            if not (math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be finite and > 0, got {val}")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float or a 0-dim tensor, got {type(v).__name__}")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")


def as_scalar_tensor(v: Number, device: torch.device) -> Tensor:
    """A 0-dim float tensor on ``device`` (gradient kept if ``v`` is a tensor that requires it)."""
    if isinstance(v, Tensor):
        t = v.reshape(())
        if t.device != device:
            t = t.to(device)
        return t if t.dtype in (torch.float32, torch.float64) else t.float()
    return torch.tensor(float(v), dtype=torch.float32, device=device)


def labels(name: str, y, n: int, device: torch.device) -> Tensor:
    if not isinstance(y, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer class labels, got {type(y).__name__}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {y.dtype}")
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(y.shape)}")
    if y.device != device:
        raise ValueError(f"{name} is on {y.device} but the embeddings are on {device}")
    return y.long()


def target(y, n: int, m: int, ignore_index: int, device: torch.device) -> Tensor:
    """Class-index target in [0, m) or ``ignore_index``. The range is checked for CPU tensors;
    on CUDA an out-of-range index trips the gather's device-side assert instead of a host sync."""
    if not isinstance(y, Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(y).__name__}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class indices (int64), got {y.dtype}; "
            "class probabilities are not supported"
        )
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(f"target must have shape [{n}] (one index per query row), got {tuple(y.shape)}")
    if y.device != device:
        raise ValueError(f"target is on {y.device} but query is on {device}")
    y = y.long()
    if y.device.type == "cpu":
        bad = (y != ignore_index) & ((y < 0) | (y >= m))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"target[{i}] = {int(y[i])} is out of range: must be in [0, {m}) or ignore_index={ignore_index}"
            )
    return y


def reduction(r: str) -> str:
    if r not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {r!r}")
    return r


def backend(name: str, *tensors: Tensor) -> str:
    """Resolve ``backend``: "auto" reads ``FUSED_CONTRASTIVE_BACKEND``, then picks triton for CUDA
    tensors when the triton backend is importable, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        env = os.environ.get("FUSED_CONTRASTIVE_BACKEND", "").strip()
        if env and env != "auto":
            if env not in BACKENDS:
                raise ValueError(f"FUSED_CONTRASTIVE_BACKEND must be one of {BACKENDS}, got {env!r}")
            name = env
        else:
            from . import _dispatch

            name = auto_backend(
                on_cuda=any(t.is_cuda for t in tensors),
                has_float64=any(t.dtype == torch.float64 for t in tensors),
                triton_ok=_dispatch.triton_available(),
            )
    if name == "triton":
        from . import _dispatch

        _dispatch.check_triton(*tensors)
    return name


def auto_backend(*, on_cuda: bool, has_float64: bool, triton_ok: bool) -> str:
    """What "auto" means: triton for CUDA tensors when it imports (and the inputs are not float64,
    which the kernels do not take), torch otherwise."""
    return "triton" if on_cuda and triton_ok and not has_float64 else "torch"
