"""A probe shared by the tests of the epilogue-GEMM routes: which [P, >= M / 2]-shaped tensors the ops create,
and their element size (the routes promise that the only such tensor is the 16-bit tile)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class WideTensors(TorchDispatchMode):
    """Records ``(op, element size, shape)`` of every newly stored 2-d tensor of ``rows`` rows and at least
    ``cols`` columns that an op creates (not a view of one of its arguments). Calls wrapped by
    :meth:`counted` are recorded by their result only: their internals are not seen."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.rows, self.cols, self.seen, self.inside = rows, cols, [], 0

    def note(self, what, t) -> None:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == self.rows and t.shape[1] >= self.cols:
            self.seen.append((what, t.element_size(), tuple(t.shape)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            return out
        given = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.note(str(func), t)
        return out

    def counted(self, fn, name: str):
        """``fn`` whose internals this probe does not count, its result it does (the GEMM helpers: the CPU's
        "upcast" route copies the 16-bit tile to fp32 for torch.mm; CUDA's native route reads it as it is)."""

        def g(*args):
            self.inside += 1
            try:
                out = fn(*args)
            finally:
                self.inside -= 1
            self.note(name, out)
            return out

        return g
