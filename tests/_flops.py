"""A probe shared by the tests that count matmul work: the FLOPs of every 2-d and batched matmul an op
runs (``2 m n k`` each), in-place accumulating forms included."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

A = torch.ops.aten
_MM = (A.mm.default,)
_ADDMM = (A.addmm.default, A.addmm_.default)
_BMM = (A.bmm.default,)
_BADDBMM = (A.baddbmm.default, A.baddbmm_.default)


class MatmulFlops(TorchDispatchMode):
    """``flops``: the total over ``aten.mm``, ``addmm`` (and ``addmm_``), ``bmm`` and ``baddbmm`` (and
    ``baddbmm_``) while the mode is active."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _MM + _ADDMM:
            a, b = (args[0], args[1]) if func in _MM else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif func in _BMM + _BADDBMM:
            a, b = (args[0], args[1]) if func in _BMM else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return out
