"""Deterministic memory claims: a TorchDispatchMode sees every tensor every ATen op creates during
forward + backward and records the largest.

* the chunked path (problems larger than the tile budget) never creates anything near N x M;
* the dense path (problems within the budget) creates nothing larger than the budget;
* the reference backend (which materialises the logits) is run through the same probe to show that
  the probe does catch an N x M tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_contrastive.core import tile_elements
from fused_contrastive.testing import CASE_BY_NAME, CASES, make_inputs
from fused_contrastive.testing.accuracy import run


class LargestTensor(TorchDispatchMode):
    """The largest tensor with storage of its own that any op creates (views of inputs not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest and t.untyped_storage().data_ptr() not in seen:
                self.largest, self.op = t.numel(), str(func)
        return out


N = 4096  # N x M = 16.8 M elements > the default tile budget of 2 M: the chunked path
D = 32


def _probe(case, backend, n, d=D):
    inputs = make_inputs(case, n, d)
    with LargestTensor() as probe:
        run(case, inputs, backend, torch.float32)
    return probe


@pytest.mark.parametrize("case", [c for c in CASES if c.op == "core"], ids=lambda c: c.name)
def test_torch_backend_allocates_far_below_n_by_m(case):
    m = case.cols(N)
    probe = _probe(case, "torch", N)
    assert probe.largest <= N * m // 8, f"largest tensor {probe.largest} elements from {probe.op}"


@pytest.mark.parametrize("name", ["info_nce", "clip", "supcon_in", "dscl"])
def test_dense_path_stays_within_the_tile_budget(name, monkeypatch, route):
    # N x M = 32 x 64 = 2048 <= a budget of 4096: the one-tile path, whose tiles are bounded by it
    route(TILE_ELEMENTS="4096")
    largest = _probe(CASE_BY_NAME[name], "torch", 32, 16).largest
    assert largest <= max(tile_elements(), 2 * 64 * 16), largest


def test_probe_sees_the_reference_logits():
    assert _probe(CASE_BY_NAME["info_nce"], "reference", N).largest >= N * N


def test_tile_budget_env_shrinks_the_largest_tensor(monkeypatch, route):
    route(TILE_ELEMENTS=str(1 << 16))
    largest = _probe(CASE_BY_NAME["simcse"], "torch", N).largest
    assert largest <= max(1 << 16, N * D), largest


def test_cosent_is_linear_memory_beyond_the_pair_tile():
    b = 1 << 14  # B^2 = 268 M > the budget: the sorted O(B log B) path
    assert _probe(CASE_BY_NAME["cosent_scores"], "torch", b).largest <= 4 * b
