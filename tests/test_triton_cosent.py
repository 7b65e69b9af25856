"""CoSENT on the Triton kernels, run by the interpreter (conftest.py sets TRITON_INTERPRET=1).

Against the float64 truth under the project's accuracy rule, on ragged batch sizes with many ties
(grades 0..5), inputs read as views into NaN-padded buffers (an out-of-bounds read shows up) and every
kernel output pre-filled with NaN (an element a kernel forgets to write shows up). The scan runs in
blocks of 64 under the interpreter, so B = 300 and 4099 carry values across 5 and 65 blocks, and tie
groups straddle block edges.
"""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive.core.cosent import triton_cosent as TCS
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.testing import CASE_BY_NAME, compare

SIZES = [1, 2, 17, 97, 300, 4099]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("b", SIZES)
@pytest.mark.parametrize("name", ["cosent", "cosent_scores"])
def test_parity_fp32(name, b):
    c = compare(CASE_BY_NAME[name], b, 40, torch.float32, "triton", canary=True)
    assert c.ok, c


@pytest.mark.parametrize("b", [17, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["cosent", "cosent_scores"])
def test_parity_half(name, dtype, b):
    c = compare(CASE_BY_NAME[name], b, 40, dtype, "triton", canary=True)
    assert c.ok, c


def test_ties_straddling_blocks():
    """Long tie groups across the 64-wide blocks (and one group spanning several blocks), checked
    against the float64 pair matrix."""
    g = torch.Generator().manual_seed(3)
    labels = torch.cat([torch.zeros(150), torch.ones(7), torch.full((200,), 2.0), torch.full((3,), 5.0)])
    labels = labels[torch.randperm(labels.shape[0], generator=g)]
    x = torch.randn(labels.shape[0], generator=g, dtype=torch.float64, requires_grad=True)
    want = fc.cosent_loss_from_scores(x, labels, backend="reference")
    (gw,) = torch.autograd.grad(want, x)
    xf = x.detach().float().requires_grad_()
    got = fc.cosent_loss_from_scores(xf, labels, backend="triton")
    (gg,) = torch.autograd.grad(got, xf)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gg.double(), gw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("b", [1, 5, 130])
def test_no_ordered_pair_gives_exactly_zero(b):
    """B = 1, or every label equal: no term, L = log(1) = 0 and every gradient exactly 0."""
    u = torch.randn(b, 8, requires_grad=True)
    v = torch.randn(b, 8, requires_grad=True)
    s = torch.tensor(20.0, requires_grad=True)
    loss = fc.cosent_loss(u, v, torch.full((b,), 3.0), scale=s, backend="triton")
    gu, gv, gs = torch.autograd.grad(loss, (u, v, s))
    assert loss.item() == 0.0
    assert not gu.any() and not gv.any() and gs.item() == 0.0


def test_labels_of_any_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(90, generator=g)
    lab = torch.randint(0, 4, (90,), generator=g)
    want = fc.cosent_loss_from_scores(x, lab, backend="torch")
    for labels in (lab, lab.double(), lab.float(), lab.half()):
        torch.testing.assert_close(fc.cosent_loss_from_scores(x, labels, backend="triton"), want, rtol=1e-5, atol=1e-5)


def test_large_and_clamped_rows():
    """Rows of norm ~1e30 (the sums of squares are taken on rows scaled by their max entry) and zero
    rows (clamped norms: cosine 0, the projection dropped) give the torch path's finite answer."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(50, 16, generator=g)
    v = torch.randn(50, 16, generator=g)
    u[3] *= 1e30
    v[7] = 0.0
    lab = torch.randint(0, 3, (50,), generator=g).float()
    out = {}
    for be in ("torch", "triton"):
        uu, vv = u.clone().requires_grad_(), v.clone().requires_grad_()
        loss = fc.cosent_loss(uu, vv, lab, backend=be)
        out[be] = (loss, *torch.autograd.grad(loss, (uu, vv)))
    for got, want in zip(out["triton"], out["torch"], strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


def test_scan_block_size_does_not_change_the_result(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(700, generator=g, requires_grad=True)
    lab = torch.randint(0, 6, (700,), generator=g)
    res = []
    for block in (16, 64, 1024):
        monkeypatch.setattr(TCS, "SCAN_BLOCK", block)
        loss = fc.cosent_loss_from_scores(x, lab, backend="triton")
        res.append((loss, *torch.autograd.grad(loss, x)))
    for other in res[1:]:
        for a, b in zip(other, res[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
