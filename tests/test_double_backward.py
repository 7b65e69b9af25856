"""Double backward (a gradient penalty: ``torch.autograd.grad(loss, x, create_graph=True)``, then differentiating
the gradient): the torch and triton backends' hand-written gradients raise an error naming double backward as
soon as they are differentiated, for every public loss; the reference backend's gradients are differentiable and
pass gradgradcheck."""

from __future__ import annotations

import pytest
import torch

from fused_contrastive import maxsim
from fused_contrastive.testing import CASES, make_inputs

#: one registry case per public loss function (the Inductor test's representatives) and every case the
#: gradient checks run
CHOSEN = sorted({c.name for c in CASES if c.inductor or "gradcheck" in c.families})


def _problem(name: str, dtype=torch.float64):
    case = next(c for c in CASES if c.name == name)
    tensors, kwargs = make_inputs(case, max(case.min_n, 5), 4, 0)
    leaves = {k: v.to(dtype).clone().requires_grad_(True) for k, v in tensors.items()}
    return case, leaves, kwargs


def _penalty(case, leaves, kwargs, backend: str):
    loss = case.fn(**leaves, **kwargs, backend=backend)
    if loss.dim():
        loss = loss.sum()
    x = [v for v in leaves.values() if v.dim()][0]
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    return g


@pytest.mark.parametrize("name", CHOSEN)
def test_the_hand_written_gradients_refuse_to_be_differentiated(name):
    case, leaves, kwargs = _problem(name, torch.float32)
    if case.op == "alignment":  # plain PyTorch ops on every backend: differentiable (checked below)
        pytest.skip("alignment has no hand-written gradient")
    g = _penalty(case, leaves, kwargs, "torch")
    # before: the gradient did not require grad, and a penalty on it silently added nothing
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        (g * g).sum().backward()
    # a plain backward is unchanged
    case2, leaves2, kwargs2 = _problem(name, torch.float32)
    loss = case2.fn(**leaves2, **kwargs2, backend="torch")
    (loss.sum() if loss.dim() else loss).backward()
    assert all(v.grad is not None for v in leaves2.values() if v.dim())


def test_the_triton_backend_refuses_too():
    case, leaves, kwargs = _problem("info_nce", torch.float32)
    g = _penalty(case, leaves, kwargs, "triton")
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_maxsim_refuses_too():
    q = torch.randn(3, 4, 5, requires_grad=True)
    d = torch.randn(3, 6, 5, requires_grad=True)
    (g,) = torch.autograd.grad(maxsim.maxsim_info_nce(q, d, backend="torch"), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("name", ["info_nce", "clip_scale", "siglip_learn", "cosent", "uniformity",
                                  "gist_relative_none", "supcon_in"])
def test_the_reference_backend_is_twice_differentiable(name):
    case, leaves, kwargs = _problem(name)

    def f(*xs):
        out = case.fn(**dict(zip(leaves, xs, strict=True)), **kwargs, backend="reference")
        return out.sum() if out.dim() else out
    assert torch.autograd.gradgradcheck(f, tuple(leaves.values()), atol=1e-6)


def test_maxsim_reference_is_twice_differentiable():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    d = torch.randn(3, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: maxsim.maxsim_info_nce(a, b, backend="reference"), (q, d))
