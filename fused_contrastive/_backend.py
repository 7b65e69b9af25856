"""Backend resolution: the one place that decides which implementation runs.

:func:`resolve` turns the ``backend`` argument of a loss into "reference", "torch" or "triton" and
raises, naming the argument, when the choice cannot run on the given tensors. :func:`triton_status`
says whether the Triton path can be used here at all: triton not installed is a normal state (then
``"auto"`` is ``"torch"``), but triton installed with a kernels module that fails to import is an
error, raised wherever the Triton path would be chosen, never silently replaced by another backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import routes

BACKENDS = ("auto", "torch", "triton", "reference")

#: Ops with a Triton implementation.
_TRITON_OPS = ("core", "cosent", "maxsim")

_INSTALL_HINT = ('pip install "/path/to/fused-contrastive[triton]" (from a checkout of this project; CUDA wheels of '
                 "PyTorch already bring triton; triton runs on Linux x86_64 / aarch64)")


class TritonStatus(NamedTuple):
    installed: bool  # ``import triton`` works
    error: str | None  # why the kernels cannot be imported although triton is installed
    interpreted: bool  # triton runs its CPU interpreter (TRITON_INTERPRET=1 before its import)


_STATUS: TritonStatus | None = None  # a plain cache (no functools.lru_cache: dynamo warns on it)


def triton_status() -> TritonStatus:
    """Import triton and the kernels once; the result is cached for the process."""
    global _STATUS
    if _STATUS is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _STATUS = TritonStatus(False, None, False)
        else:
            try:
                # every family's kernels that the backend routes to import here: a broken one is a broken install
                from .core.cosent import triton_cosent  # noqa: F401
                from .core.lse import triton_function  # noqa: F401
                from .core.maxsim import triton_maxsim  # noqa: F401
                from .core.triton_shared import launch as TL
            except Exception as exc:  # noqa: BLE001 - any failure here is a broken install
                _STATUS = TritonStatus(True, f"{type(exc).__name__}: {exc}", False)
            else:
                _STATUS = TritonStatus(True, None, TL.interpreted())
    return _STATUS


def _broken(status: TritonStatus) -> ImportError:
    return ImportError(
        "triton is installed but fused_contrastive's Triton kernels do not import "
        f"({status.error}); reinstall the package (pip install -e . from a checkout: the kernels/ "
        'directory is installed as fused_contrastive.kernels) or pass backend="torch"')


def triton_usable_on(device: torch.device) -> bool:
    """Whether ``backend="triton"`` can run on ``device`` here (CUDA, or CPU under the interpreter)."""
    st = triton_status()
    if not st.installed or st.error is not None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and st.interpreted)


def resolve(backend: str, *tensors: Tensor | None, op: str = "core") -> str:
    """The backend that runs ``op`` ("core": every InfoNCE-family loss; "cosent"; "maxsim": late
    interaction) on ``tensors``.

    ``"auto"``: the environment variable ``FUSED_CONTRASTIVE_BACKEND`` when set (any name but "auto"
    there is used as if passed), else "triton" for CUDA tensors when the op has a Triton kernel, the
    inputs are not float64 and triton is installed; else "torch". An explicit "triton" raises
    ``ValueError`` when the op has no kernel or the tensors are on a device it cannot run on (CPU
    runs only under ``TRITON_INTERPRET=1``), ``TypeError`` for float64 inputs, ``ValueError`` when
    triton is not installed, and ``ImportError`` when it is installed but the kernels are broken.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    xs = [t for t in tensors if t is not None]
    name = backend
    if name == "auto":
        name = routes.setting("BACKEND")
    if name == "auto":
        wants_triton = (op in _TRITON_OPS and any(t.is_cuda for t in xs)
                        and not any(t.dtype == torch.float64 for t in xs))
        if not wants_triton:
            return "torch"
        st = triton_status()
        if not st.installed:
            return "torch"
        if st.error is not None:
            raise _broken(st)
        return "triton"
    if name == "triton":
        if op not in _TRITON_OPS:
            raise ValueError(f'backend="triton": {op} has no Triton kernel; use backend="torch" or "auto"')
        st = triton_status()
        if not st.installed:
            raise ValueError(f'backend="triton" needs the triton package: {_INSTALL_HINT}')
        if st.error is not None:
            raise _broken(st)
        if any(t.dtype == torch.float64 for t in xs):
            raise TypeError('backend="triton" takes float32, float16 or bfloat16 embeddings, got float64; '
                            'use backend="torch" (or "reference") for float64')
        for t in xs:
            if t.device.type == "cpu" and not st.interpreted:
                raise ValueError('backend="triton" runs on CUDA tensors; CPU tensors run only under the Triton '
                                 'interpreter (TRITON_INTERPRET=1 set before triton is imported; slow, for '
                                 'tests); use backend="torch" on the CPU')
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f'backend="triton" runs on CUDA tensors, got a tensor on {t.device}')
    return name
