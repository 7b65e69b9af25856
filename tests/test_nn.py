"""The nn.Module wrappers equal the functional losses; CLIPLoss learns its temperature."""

from __future__ import annotations

import math

import torch

import fused_contrastive as fc
from fused_contrastive import nn as fnn
from fused_contrastive.testing import assert_close

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(8, 5, generator=G), torch.randn(8, 5, generator=G)
F3 = torch.randn(8, 2, 5, generator=G)
LAB = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


def test_modules_match_functional():
    assert_close(fnn.InfoNCELoss(0.1)(X, Y), fc.info_nce(X, Y, temperature=0.1), atol=0)
    assert_close(fnn.SimCSELoss()(X), fc.simcse_loss(X), atol=0)
    assert_close(fnn.SupConLoss(variant="in")(F3, LAB), fc.supcon_loss(F3, LAB, variant="in"), atol=0)
    assert_close(fnn.DSCLLoss(beta=2.0)(F3, LAB), fc.dscl_loss(F3, LAB, beta=2.0), atol=0)
    assert_close(fnn.CoSENTLoss()(X, Y, LAB.float()), fc.cosent_loss(X, Y, LAB.float()), atol=0)


def test_clip_loss_module_owns_a_learnable_logit_scale():
    m = fnn.CLIPLoss()
    assert isinstance(m.logit_scale, torch.nn.Parameter)
    assert abs(m.logit_scale.item() - math.log(1 / 0.07)) < 1e-6
    loss = m(X, Y)
    assert_close(loss, fc.clip_loss(X, Y, 1 / 0.07, backend="reference"), atol=1e-5)
    loss.backward()
    # d loss / d log_scale = scale * d loss / d scale, checked against the reference backend
    ls = torch.tensor(math.log(1 / 0.07), requires_grad=True)
    fc.clip_loss(X, Y, ls.exp(), backend="reference").backward()
    assert_close(m.logit_scale.grad, ls.grad, atol=1e-5, rtol=1e-5)
