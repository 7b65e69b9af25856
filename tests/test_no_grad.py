"""Under ``torch.no_grad()`` (an evaluation loop) a summed loss forms no gradients.

The eager routes form the gradients of a summed loss in its forward (its upstream gradient is one scalar),
two more matmul units of work. An autograd Function cannot see ``torch.no_grad`` from inside (its forward
always runs with grad mode off, and ``ctx.needs_input_grad`` follows ``requires_grad`` alone), so the
entry points detach their inputs there (``core.spec.graph_free``). Checked by counting the matmul FLOPs
of the torch backend's forward (a ``TorchDispatchMode``) against the unit ``2 N M D`` computed by hand,
and by the Triton panel route's launches (the statistics forward, not the one pass with its gradient
tile); the loss is the same value as with gradients on, and the float64 definition's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_siglip import _truth as siglip_truth  # tests/ is on sys.path (rootdir-relative imports)

import fused_contrastive as fc
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.testing import assert_close
from tests._flops import MatmulFlops

N, D = 256, 32
UNIT = 2 * N * N * D  # one N x N x D matmul, by hand


def _leaves():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, D, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(N, D, generator=g, dtype=torch.float64).requires_grad_())


def _truth(name, q, k):
    """The float64 definitions, differentiable: InfoNCE's textbook formula, SigLIP's from
    tests/test_siglip.py (``_truth``, its softplus terms from the label matrix)."""
    if name == "info_nce":
        return F.cross_entropy(F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / 0.05, torch.arange(N))
    return siglip_truth(q, k, 10.0, -10.0)


LOSSES = {
    "info_nce": lambda q, k, be: fc.info_nce(q, k, torch.arange(N), temperature=0.05, backend=be),
    "siglip": lambda q, k, be: fc.siglip_loss(q, k, 10.0, -10.0, backend=be),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_torch_backend_forward_under_no_grad_is_one_matmul_unit(name, monkeypatch, route):
    route(TILE_ELEMENTS="4096")  # row chunks: the streaming path
    q, k = _leaves()
    with MatmulFlops() as on:
        with_grad = LOSSES[name](q, k, "torch")
    with torch.no_grad(), MatmulFlops() as off:
        plain = LOSSES[name](q, k, "torch")
    assert on.flops >= 2 * UNIT, on.flops / UNIT  # the eager forward: logits and gradients
    assert off.flops == UNIT, off.flops / UNIT  # the logits alone
    assert not plain.requires_grad
    assert_close(plain, with_grad.detach(), atol=1e-12, rtol=1e-12, what="loss")
    assert_close(plain, _truth(name, q.detach(), k.detach()), atol=1e-10, rtol=1e-10, what="loss vs definition")
    with torch.inference_mode():
        assert_close(LOSSES[name](q, k, "torch"), plain, atol=1e-12, rtol=1e-12, what="inference_mode")
    # and with gradients on, the eager gradients are the definition's
    with_grad.backward()
    q64, k64 = (t.detach().clone().requires_grad_() for t in (q, k))
    want = torch.autograd.grad(_truth(name, q64, k64), (q64, k64))
    assert_close(q.grad, want[0], atol=1e-10, rtol=1e-8, what="grad q")
    assert_close(k.grad, want[1], atol=1e-10, rtol=1e-8, what="grad k")


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_triton_panel_route_under_no_grad_forms_no_gradient_tile(name, monkeypatch, route):
    """The panel path's epilogue GEMM (forced, bf16, interpreted): with gradients on, a summed loss runs
    the one pass that forms the gradient tile (InfoNCE MODE 1, SigLIP MODE 5) and the cuBLAS GEMMs after
    it; under no_grad the losses alone (InfoNCE the statistics forward, MODE 3; SigLIP MODE 4 without G)."""
    route(TRITON_PATH="panel")
    route(PANEL_GEMM="epilogue")
    route(DENSE="0")  # not the one-tile path of a small problem
    route(PANEL_ROWS=128)
    seen = []
    orig = TL._launch
    monkeypatch.setattr(TL, "_launch", lambda x: (seen.append(x), orig(x))[1])
    q64, k64 = _leaves()
    q, k = q64.detach().bfloat16().requires_grad_(), k64.detach().bfloat16().requires_grad_()

    def modes():
        out = {(x.name, x.constexprs.get("MODE"), x.constexprs.get("HAS_G")) for x in seen
               if x.name.startswith("epi_gemm")}
        seen.clear()
        return out

    with_grad = LOSSES[name](q, k, "triton")
    eager = modes()
    with torch.no_grad(), MatmulFlops() as off:
        plain = LOSSES[name](q, k, "triton")
    lazy = modes()
    if name == "info_nce":
        assert ("epi_gemm", 1, True) in eager and not any(m == 3 for _, m, _ in eager), eager
        assert {m for _, m, _ in lazy} == {3}, lazy
    else:
        assert eager == {("epi_gemm_siglip", 5, True)}, eager
        assert lazy == {("epi_gemm_siglip", 4, False)}, lazy
    assert off.flops == 0, off.flops / UNIT  # no cuBLAS gradient GEMM
    truth = _truth(name, q.detach().double(), k.detach().double())
    assert_close(plain.double(), truth, atol=0, rtol=5e-3, what="no_grad loss vs definition")
    assert_close(plain, with_grad.detach(), atol=0, rtol=5e-3, what="no_grad loss vs eager loss")
