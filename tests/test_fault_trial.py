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
