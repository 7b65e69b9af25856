"""Routes the core op to a backend ("torch" or "triton"); the reference backend never comes here."""

from __future__ import annotations

import functools
import os
from typing import Optional

from torch import Tensor

from ._spec import CoreSpec, CoreTensors


@functools.lru_cache(maxsize=None)
def _triton_module():
    """The triton backend module, or None when triton (or the backend) cannot be imported."""
    try:
        from . import _triton_core  # noqa: F401
    except ImportError:
        return None
    return _triton_core


def triton_available() -> bool:
    return _triton_module() is not None


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton(*tensors: Tensor) -> None:
    if not triton_available():
        raise RuntimeError(
            'backend="triton" needs the triton package (Linux x86_64) and its backend module; '
            'use backend="torch" here'
        )
    if any(t.device.type == "cpu" for t in tensors) and not interpreter_on():
        raise RuntimeError(
            'backend="triton" on CPU tensors runs only under the Triton interpreter: set '
            'TRITON_INTERPRET=1 before importing triton (slow; for testing), or use backend="torch"'
        )
    if any(t.device.type not in ("cpu", "cuda") for t in tensors):
        raise RuntimeError('backend="triton" supports CUDA tensors (and CPU under TRITON_INTERPRET=1)')


def run_core(backend: str, a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors):
    """Core op on ``backend``; see ``_spec.py`` for the outputs of vector and weighted mode."""
    if backend == "triton":
        return _triton_module().core(a, b, scale, spec, t)
    from . import _torch_core

    return _torch_core.core(a, b, scale, spec, t)
