"""What the fault trial found (issue 57), one test per finding that failed before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fused_contrastive as fc
import fused_contrastive.nn as fnn


def _qk(n=8, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


# --- 4: a tensor option of a module belongs to it -----------------------------------------------------


@pytest.mark.parametrize("cls,name,args", [(fnn.InfoNCELoss, "temperature", ()), (fnn.SupConLoss, "temperature", ()),
                                           (fnn.CoSENTLoss, "scale", ())])
def test_a_learnable_option_is_a_parameter_of_the_module(cls, name, args):
    p = nn.Parameter(torch.tensor(0.2))
    m = cls(p)
    assert [n for n, _ in m.named_parameters()] == [name] and name in m.state_dict()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if cls is fnn.SupConLoss:
        loss = m(torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 0, 1, 2, 2]))
    elif cls is fnn.CoSENTLoss:
        q, k = _qk()
        loss = m(q, k, torch.arange(8.0))
    else:
        loss = m(*_qk())
    loss.backward()
    before = float(p)
    opt.step()
    assert p.grad is not None and float(getattr(m, name)) != before  # the optimizer trained it
    # a checkpoint carries it, and a module loaded from it computes with the loaded value
    m2 = cls(nn.Parameter(torch.tensor(0.5)))
    m2.load_state_dict(m.state_dict())
    assert float(getattr(m2, name)) == float(getattr(m, name))


def test_a_tensor_option_moves_with_the_module_and_a_copy_keeps_it():
    m = fnn.InfoNCELoss(torch.tensor(0.05))
    assert list(m.state_dict()) == ["temperature"] and not list(m.parameters())  # a buffer
    assert m.to(torch.float64).temperature.dtype == torch.float64
    q, k = _qk()
    want = fc.info_nce(q, k, temperature=0.05)
    assert torch.allclose(copy.deepcopy(m)(q, k), want)


def test_maxsim_module_keeps_a_learnable_scale():
    s = nn.Parameter(torch.tensor(2.0))
    m = fnn.MaxSimInfoNCELoss(scale=s)
    q, d = torch.randn(3, 4, 5), torch.randn(3, 6, 5)
    loss = m(q, d)
    assert torch.allclose(loss, fc.maxsim.maxsim_info_nce(q, d, scale=2.0))
    loss.backward()
    assert s.grad is not None and [n for n, _ in m.named_parameters()] == ["given_scale"]
    with pytest.raises(ValueError, match="learn_scale"):
        fnn.MaxSimInfoNCELoss(scale=nn.Parameter(torch.tensor(2.0)), learn_scale=True)


def test_siglip_module_refuses_a_bool_scale_as_clip_does():
    with pytest.raises(ValueError, match="init_scale"):
        fnn.SigLIPLoss(init_scale=True)
    with pytest.raises(ValueError, match="init_bias"):
        fnn.SigLIPLoss(init_bias=False)
    with pytest.raises(ValueError, match="init_temperature"):
        fnn.CLIPLoss(init_temperature=True)


# --- 5: a second backward through a retained graph ---------------------------------------------------------


def _gist(dtype=torch.float32, n=6, d=4):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]
    guide = tuple(torch.randn(n, 3, generator=g, dtype=dtype) for _ in range(3))
    return xs, guide


@pytest.mark.parametrize("how", ["torch", "triton", "triton-panel", "info_nce-guide", "info_nce-ids"])
def test_a_second_backward_through_a_retained_graph_adds_the_same_gradients(how, monkeypatch):
    monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
    dtype = torch.float32
    if how == "triton-panel":  # the guided epilogue route (a summed bf16 loss on CUDA), forced on the interpreter
        monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "panel")
        monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", "epilogue")
        dtype = torch.bfloat16
    (a, p, n), guide = _gist(dtype)
    backend = "torch" if how.startswith(("torch", "info_nce")) else "triton"
    if how == "info_nce-guide":
        loss = fc.info_nce(a, p, guide=guide[:2], backend=backend)
    elif how == "info_nce-ids":
        loss = fc.info_nce(a, p, ids=(torch.tensor([0, 1, 1, 2, 3, 3]), torch.tensor([0, 1, 2, 2, 3, 4])),
                           backend=backend)
    else:
        loss = fc.gist_loss(a, p, n, guide=guide, backend=backend)
    loss.backward(retain_graph=True)
    (3 * loss).backward()  # (crashed: "not enough values to unpack" / the blocks' contexts already released)
    # the same as one backward of 4 x the loss, computed in float64 by the reference backend
    ref = [x.detach().double().requires_grad_() for x in (a, p, n)]
    g64 = [gg.double() for gg in guide]
    if how == "info_nce-guide":
        want = fc.info_nce(ref[0], ref[1], guide=g64[:2], backend="reference")
    elif how == "info_nce-ids":
        want = fc.info_nce(ref[0], ref[1], ids=(torch.tensor([0, 1, 1, 2, 3, 3]), torch.tensor([0, 1, 2, 2, 3, 4])),
                           backend="reference")
    else:
        want = fc.gist_loss(*ref, guide=tuple(g64), backend="reference")
    (4 * want).backward()
    slack = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for x, r in zip((a, p), ref[:2], strict=True):
        err = (x.grad.double() - r.grad).abs().max()
        assert err <= slack * r.grad.abs().max(), (how, float(err), float(r.grad.abs().max()))


def test_a_second_backward_through_chunked_encoding_with_batchnorm():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    x = torch.randn(16, 4)
    z = fc.encode_in_chunks(enc, x, 4)
    stats = enc[1].running_mean.clone(), enc[1].running_var.clone()
    loss = fc.info_nce(z[:8], z[8:])
    loss.backward(retain_graph=True)
    first = enc[0].weight.grad.clone()
    loss.backward()  # (AttributeError: '_GeneratorContextManager' object has no attribute 'args')
    torch.testing.assert_close(enc[0].weight.grad, 2 * first)
    # the recomputes left the running statistics as the forward did
    assert torch.equal(enc[1].running_mean, stats[0]) and torch.equal(enc[1].running_var, stats[1])
