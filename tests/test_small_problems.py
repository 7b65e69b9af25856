"""The small-problem path costs no more than the textbook formula it replaces.

Timings are the benchmark's job (its small-batch table); here the claim is checked deterministically
by counting, with a TorchDispatchMode, the ATen ops of one forward + backward that produce a tensor of
N x M size (a pass over the logits) and the matrix multiplications: for every benchmark loss, at a
size where the whole logit tile fits the budget, this library's torch backend does at most as many of
each as the ``formula`` baseline (``testing.baselines``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_contrastive.testing import BENCH_CASES
from fused_contrastive.testing.baselines import formula_of

MATMULS = ("mm", "bmm", "addmm", "matmul", "baddbmm")
#: in-place writes at an index (``self.scatter_(dim, index, src)``): their work is the index's size, not the tile's
#: they return (one entry per row: a target's entry written into the tile is not a pass over it)
INDEXED_WRITES = ("scatter_", "scatter_add_", "scatter_reduce_")


class Passes(TorchDispatchMode):
    def __init__(self, tile: int):
        super().__init__()
        self.tile, self.tile_ops, self.matmuls = tile, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.matmuls += name in MATMULS
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if name in INDEXED_WRITES:
            outs = (args[2],)  # (the index)
        if any(isinstance(t, torch.Tensor) and t.numel() >= self.tile for t in outs):
            self.tile_ops.append(name)
        return out


def _count(fn, x, tile):
    for v in x.values():
        if isinstance(v, torch.Tensor):
            v.grad = None
    with Passes(tile) as p:
        fn().backward()
    return p


@pytest.mark.parametrize("case", BENCH_CASES, ids=lambda c: c.name)
def test_no_more_tile_passes_or_matmuls_than_the_formula(case):
    n, d = 256, 64  # N x M / 2 > N x D: an op on the tile is told apart from an op on the embeddings
    tensors, kwargs = case.build(n, d, torch.Generator().manual_seed(0))
    x = {**{k: v.requires_grad_() for k, v in tensors.items()}, **kwargs}
    r, c = case.logits(n) if case.logits is not None else (n, n)
    formula = formula_of(case.name)
    ours = _count(lambda: case.fn(**x, backend="torch"), x, r * c // 2)
    theirs = _count(lambda: formula.fn(x), x, r * c // 2)
    assert len(ours.tile_ops) <= len(theirs.tile_ops), (ours.tile_ops, theirs.tile_ops)
    assert ours.matmuls <= theirs.matmuls, (ours.matmuls, theirs.matmuls)
