"""Whether the losses are being traced, and the hook through which ``core.run`` reaches the registered
operator: a leaf module (it imports only torch), so that ``core/`` never imports ``ops.py``, which
imports ``core``.

``ops.py`` registers ``fused_contrastive::core`` and hands its Python entry to :func:`set_traced_core`
when it is imported; the package's ``__init__`` imports it (through ``losses``), so the entry is in
place before any loss runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["forced", "set_traced_core", "set_traced_op", "tensors_are_traced", "traced_core", "traced_op",
           "tracing_route"]

_FORCE = False
_TRACED_CORE: Callable | None = None
_TRACED_OPS: dict[str, Callable] = {}


def tracing_route() -> bool:
    """Whether the losses call the registered operators: under ``torch.compile`` and
    ``torch.export``, or inside :func:`forced`."""
    return _FORCE or torch.compiler.is_compiling() or torch.compiler.is_exporting()


@contextlib.contextmanager
def forced() -> Iterator[None]:
    """Route the losses through the registered operators outside of compile too (tests, and
    ``make_fx`` traces of a training step)."""
    global _FORCE
    old, _FORCE = _FORCE, True
    try:
        yield
    finally:
        _FORCE = old


def tensors_are_traced() -> bool:
    """True under a fake, proxy or functional dispatch mode (make_fx, Inductor's lowering, export):
    tensors then have no data and no real storage, so host code must not read either."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL))


def set_traced_core(fn: Callable) -> None:
    """Called once by ``ops.py``: the Python entry of the registered core operator."""
    global _TRACED_CORE
    _TRACED_CORE = fn


def traced_core() -> Callable:
    """The registered core operator's entry (``ops.core``)."""
    if _TRACED_CORE is None:  # pragma: no cover - the package's __init__ imports ops
        raise RuntimeError("fused_contrastive.ops is not imported: import fused_contrastive first")
    return _TRACED_CORE


def set_traced_op(name: str, fn: Callable) -> None:
    """Called by ``ops.py``: the Python entry of a registered operator that ``core/`` calls when
    :func:`tracing_route` (``"merged_lse"``: ``core.guided.torch_blocks.merged_lse``)."""
    _TRACED_OPS[name] = fn


def traced_op(name: str) -> Callable:
    """The registered operator's entry ``name`` (see :func:`set_traced_op`)."""
    if name not in _TRACED_OPS:  # pragma: no cover - the package's __init__ imports ops
        raise RuntimeError("fused_contrastive.ops is not imported: import fused_contrastive first")
    return _TRACED_OPS[name]
