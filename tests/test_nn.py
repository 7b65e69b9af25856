"""The nn.Module wrappers equal the functional losses; CLIPLoss learns its temperature."""

from __future__ import annotations

import math

import pytest
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


@pytest.mark.parametrize("make,arg", [
    (lambda: fc.nn.InfoNCELoss(0), "temperature"),
    (lambda: fc.nn.InfoNCELoss(0.1, reduction="avg"), "reduction"),
    (lambda: fc.nn.SimCSELoss(-1.0), "temperature"),
    (lambda: fc.nn.SupConLoss(variant="x"), "variant"),
    (lambda: fc.nn.SupConLoss(contrast_mode="none"), "contrast_mode"),
    (lambda: fc.nn.DSCLLoss(beta=-1.0), "beta"),
    (lambda: fc.nn.CoSENTLoss(scale=float("nan")), "scale"),
    (lambda: fc.nn.CLIPLoss(init_temperature=0), "init_temperature"),
    (lambda: fc.nn.CLIPLoss(init_temperature=-1), "init_temperature"),
    (lambda: fc.nn.InfoNCELoss(gather=3), "gather"),
])
def test_module_constructors_validate_their_options(make, arg):
    # issue 24 item 11: they failed only at the first forward (or with ZeroDivisionError / math domain error)
    with pytest.raises((ValueError, TypeError), match=arg):
        make()


def test_module_defaults_construct_and_equal_the_functional_form():
    q, k = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    for mod, fn in ((fc.nn.InfoNCELoss(0.1), lambda: fc.info_nce(q, k, temperature=0.1)),
                    (fc.nn.InfoNCELoss(symmetric=True), lambda: fc.info_nce(q, k, symmetric=True))):
        torch.testing.assert_close(mod(q, k), fn(), rtol=0, atol=0)
    clip = fc.nn.CLIPLoss(0.07)
    # the module's logit_scale is a float32 parameter: exp(log(1 / 0.07)) in float32 is 1/0.07 to 1e-7
    torch.testing.assert_close(clip(q, k), fc.clip_loss(q, k, torch.tensor(1 / 0.07, dtype=torch.float64)),
                               rtol=1e-6, atol=1e-6)
