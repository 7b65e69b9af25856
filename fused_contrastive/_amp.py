"""Autocast: the losses compute in the dtypes of the tensors they are given, never in autocast's.

``torch.autocast`` re-types matmuls to bfloat16 / float16 inside its region. The losses of this library
accumulate in float32 themselves (float64 for float64 inputs) and their autograd functions form the
gradient from saved tensors in the compute dtype, so a matmul re-typed by autocast inside them mixes
dtypes (``expected m1 and m2 to have the same dtype``) or silently loses precision. Autocast's own
policy treats ``cross_entropy`` the same way: an op that runs in float32 whatever the region says.

:func:`autocast_off` runs a function with autocast disabled on every device type where it is enabled
(the public losses and the operators' implementations are wrapped); inputs keep their dtypes (a
bfloat16 activation from an autocast encoder stays bfloat16 and is accumulated in float32), so a loss
inside an autocast region returns exactly what it returns outside it for the same tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor  # noqa: F401  torch.library.infer_schema resolves a wrapped operator's annotations here

__all__ = ["autocast_off"]

F = TypeVar("F", bound=Callable)
_DEVICE_TYPES = ("cpu", "cuda")


def autocast_off(fn: F) -> F:
    """``fn`` run with autocast disabled on the device types where it is enabled (no-op otherwise)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on = [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]
        if not on:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for d in on:
                stack.enter_context(torch.autocast(device_type=d, enabled=False))
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
