"""Locked towers (LiT: a frozen image tower, or frozen keys): when one side does not require grad, no path
does work for its gradient. Counted in matmul units (one N x M x D matmul, ``2 N M D`` FLOPs) on the torch
paths, and in kernel launches on the Triton kernels under the interpreter; the trainable side's gradient
is the one it gets when both train."""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc
import fused_contrastive.core.triton_shared.launch as TL
from tests._flops import MatmulFlops

N, M, D = 48, 64, 32
UNIT = 2 * N * M * D

LOSSES = {
    "info_nce": lambda q, k, **kw: fc.info_nce(q, k, **kw),
    "info_nce-none": lambda q, k, **kw: fc.info_nce(q, k, reduction="none", **kw).sum(),
    "info_nce-smoothed": lambda q, k, **kw: fc.info_nce(q, k, label_smoothing=0.1, **kw),
    "info_nce-debiased": lambda q, k, **kw: fc.info_nce(q, k, tau_plus=0.1, **kw),
}
SQUARE = {  # N == M: the pairs are the diagonal
    "clip": lambda q, k, **kw: fc.clip_loss(q, k, 10.0, **kw),
    "clip-none": lambda q, k, **kw: fc.clip_loss(q, k, 10.0, reduction="none", **kw).sum(),
    "siglip": lambda q, k, **kw: fc.siglip_loss(q, k, 10.0, -10.0, **kw),
    "simcse_sup": lambda q, k, **kw: fc.simcse_sup_loss(q, k, **kw),
}


def _inputs(m):
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randn(m, D, generator=g)


def _units_and_grads(fn, q, k, train_q, train_k, backend):
    q = q.clone().requires_grad_(train_q)
    k = k.clone().requires_grad_(train_k)
    with MatmulFlops() as f:
        fn(q, k, backend=backend).backward()
    return f.flops / (2 * q.shape[0] * k.shape[0] * D), q.grad, k.grad


@pytest.mark.parametrize("name", [*LOSSES, *SQUARE])
def test_a_frozen_side_costs_one_unit_less(name, path):
    fn = LOSSES.get(name) or SQUARE[name]
    q, k = _inputs(N if name in SQUARE else M)
    both, gq, gk = _units_and_grads(fn, q, k, True, True, "torch")
    sides = [("keys", True, False), ("queries", False, True)]
    for what, tq, tk in sides:
        units, gq2, gk2 = _units_and_grads(fn, q, k, tq, tk, "torch")
        # (O(N·D) matmuls, a [1, 1] weight mask's, are ~1e-3 of a unit: not units)
        assert abs(units - (both - 1)) < 1e-2, (what, units, both)
        assert (gq2 is None) != tq and (gk2 is None) != tk
        torch.testing.assert_close(gq2 if tq else gk2, gq if tq else gk, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["info_nce", "info_nce-none"])
def test_lit_info_nce_is_two_units(name, path):
    """InfoNCE with frozen keys (LiT): the logits and dA, 2 units, against 3 with both trained (summed
    loss: the gradient formed in the forward; per-row loss on the dense tile)."""
    q, k = _inputs(M)
    both = _units_and_grads(LOSSES[name], q, k, True, True, "torch")[0]
    lit = _units_and_grads(LOSSES[name], q, k, True, False, "torch")[0]
    if name == "info_nce" or path == "dense":
        assert (both, lit) == (3, 2)
    else:  # the per-row chunked path recomputes its tiles in the backward: 4 and 3
        assert (both, lit) == (4, 3)


@pytest.fixture
def launches(monkeypatch):
    seen = []
    real = TL._launch

    def record(launch):
        seen.append((launch.name, launch.constexprs.get("NEED_DX")))
        return real(launch)

    monkeypatch.setattr(TL, "_launch", record)
    monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")  # the kernels, not the one-tile path
    return seen


@pytest.mark.parametrize("name", ["info_nce", "info_nce-none", "clip", "clip-none", "info_nce-smoothed",
                                  "info_nce-debiased"])
@pytest.mark.parametrize("frozen", ["keys", "queries"])
def test_triton_kernels_skip_the_frozen_side(name, frozen, launches):
    """Frozen keys: the column-gradient kernel is not launched; frozen queries: the row kernel does not
    accumulate dA (float32: it is not launched at all)."""
    fn = LOSSES.get(name) or SQUARE[name]
    q, k = _inputs(N)
    _, gq, gk = _units_and_grads(fn, q, k, True, True, "triton")
    launches.clear()
    _, gq2, gk2 = _units_and_grads(fn, q, k, frozen != "queries", frozen != "keys", "triton")
    names = [n for n, _ in launches]
    if frozen == "keys":
        assert "lse_bwd_cols" not in names and "lse_bwd_rows" in names, launches
        torch.testing.assert_close(gq2, gq, rtol=1e-5, atol=1e-7)
        assert gk2 is None
    else:
        assert "lse_bwd_cols" in names and "lse_bwd_rows" not in names, launches
        torch.testing.assert_close(gk2, gk, rtol=1e-5, atol=1e-7)
        assert gq2 is None


_GUIDE = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
OTHER_KERNELS = {
    "matryoshka": lambda q, k, **kw: fc.info_nce(q, k, matryoshka_dims=[D, D // 2], **kw),
    "siglip": SQUARE["siglip"],
    "guided": lambda q, k, **kw: fc.gist_loss(q, k, guide=(_GUIDE, _GUIDE.flip(0)), contrast_anchors=False,
                                              contrast_positives=False, **kw),
    "ids": lambda q, k, **kw: fc.info_nce(q, k, ids=(torch.arange(N), torch.arange(N)), **kw),
}


@pytest.mark.parametrize("name", list(OTHER_KERNELS))
@pytest.mark.parametrize("frozen", ["keys", "queries"])
def test_other_kernels_skip_the_frozen_side(name, frozen, launches):
    """The Matryoshka, SigLIP and guided kernels: no column-gradient kernel for frozen keys (images), no row
    kernel for frozen queries."""
    q, k = _inputs(N)
    _, gq, gk = _units_and_grads(OTHER_KERNELS[name], q, k, True, True, "triton")
    launches.clear()
    _, gq2, gk2 = _units_and_grads(OTHER_KERNELS[name], q, k, frozen != "queries", frozen != "keys", "triton")
    names = [n for n, _ in launches]
    skipped, kept = ("_bwd_cols", "_bwd_rows") if frozen == "keys" else ("_bwd_rows", "_bwd_cols")
    assert not any(n.endswith(skipped) for n in names) and any(n.endswith(kept) for n in names), names
    torch.testing.assert_close(gq2 if frozen == "keys" else gk2, gq if frozen == "keys" else gk, rtol=1e-5,
                               atol=1e-7)
