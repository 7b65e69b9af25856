"""The target term's row kernel (``kernels/target.py``, ``core/triton_shared/target.py``) on the Triton
interpreter, against float64 autograd of its definition: ``sum_i h_i <a_i, b_{t_i}>`` of the unit rows
``x / max(||x||, eps)`` (``F.normalize``), or of the raw rows without normalisation.

Rows that stress it: zero and tiny rows (clamped: no projection term), rows of norm ~1e36 (an fp32 sum
of squares would overflow; fp16 rows at its range's end), targets shared by several rows (the host's
``index_add_``), B is A, and the backward that adds into another piece's fp32 gradient in place. Then the
same term inside the losses: the triton backend's target piece against the torch backend's on the
streaming paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from fused_contrastive import core
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from fused_contrastive.core.triton_shared import target  # imports triton: the test extra installs it (no skip)

EPS = 1e-6


def _inputs(n: int, m: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g)
    b = torch.randn(m, d, generator=g)
    a[0] = 0.0  # a zero row (clamped)
    a[1] *= 1e-8  # below eps (clamped, not zero)
    b[2] *= min(1e36, torch.finfo(dtype).max / 16)  # fp32 / bf16: an fp32 sum of squares overflows there
    a[3] *= 1e-30
    t = torch.randint(0, m, (n,), generator=g)
    t[4:8] = 2  # a shared target, the huge row
    t[8] = 0
    h = torch.randn(n, generator=g)
    return a.to(dtype), b.to(dtype), t, h


def _truth(a, b, t, h, normalize: bool):
    a64 = a.double().requires_grad_()
    b64 = b.double().requires_grad_()
    ua = F.normalize(a64, dim=1, eps=EPS) if normalize else a64
    ub = F.normalize(b64, dim=1, eps=EPS) if normalize else b64
    cos = (ua * ub[t]).sum(1)
    (cos * h.double()).sum().backward()
    return cos.detach(), a64.grad, b64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["unit", "raw"])
def test_target_rows_against_float64(dtype, normalize):
    n, m, d = 40, 24, 200  # D over two chunks of the kernel's 128 columns, with a ragged end
    a, b, t, h = _inputs(n, m, d, dtype)
    if not normalize:  # raw rows: moderate values (the raw dot is an fp32 sum, as in the torch backend)
        a, b = (a.float().clamp(-4, 4) / 4).to(dtype), (b.float().clamp(-4, 4) / 4).to(dtype)
    cos_t, ga_t, gb_t = _truth(a, b, t, h, normalize)
    cos = target.target_cos(a, b, t, EPS, normalize)
    cos2, da, dbr = target.target_backward(a, b, t, h.float(), EPS, normalize)
    db = torch.zeros(m, d, dtype=torch.float64).index_add_(0, t, dbr.double())
    assert cos.dtype == torch.float32 and da.dtype == torch.float32 and dbr.dtype == torch.float32
    torch.testing.assert_close(cos.double(), cos_t, rtol=1e-5, atol=1e-6)
    assert torch.equal(cos, cos2)
    # fp32 arithmetic on the (exact) 16-bit inputs: relative to each row's largest entry
    for got, want in ((da.double(), ga_t), (db, gb_t)):
        scale = want.abs().amax(1, keepdim=True).clamp_min(1e-300)
        assert ((got - want).abs() / scale).max() < 1e-5, ((got - want).abs() / scale).max()
    # the clamped rows' gradients are finite and those of the zero row are the linear map's (h b_t / eps)
    assert torch.isfinite(da).all() and torch.isfinite(db).all()


def test_target_rows_b_is_a_and_accumulates_in_place():
    n, d = 32, 48
    a, _, t, h = _inputs(n, n, d, torch.bfloat16, seed=1)
    a[2] = a[5]  # (the huge row of _inputs is in b; here moderate rows only)
    _, ga_t, gb_t = _truth(a, a, t, h, True)
    want = ga_t + gb_t  # B is A: both roles' gradients land on the same rows
    prior = torch.randn(n, d)
    acc = prior.clone()
    _, da, dbr = target.target_backward(a, a, t, h.float(), EPS, True, acc)
    assert da.data_ptr() == acc.data_ptr()  # in place
    da.index_add_(0, t, dbr)
    got = da.double() - prior.double()
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize("path", ["fused", "panel"])
@pytest.mark.parametrize("loss", ["info_nce", "simcse", "clip"])
def test_losses_target_piece_matches_the_torch_backend(loss, path, monkeypatch):
    """The triton backend's target piece (the row kernels) inside the losses, against the torch backend's
    (unit rows in PyTorch) on fp32 inputs: same loss and gradients to fp32 rounding. A margin and a
    learnable temperature exercise the term's host side."""
    monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", path)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(48, 40, generator=g), torch.randn(48, 40, generator=g)
    out = {}
    for be in ("torch", "triton"):
        x, y = q.clone().requires_grad_(), k.clone().requires_grad_()
        temp = torch.tensor(0.07, requires_grad=True)
        if loss == "info_nce":
            val = fc.info_nce(x, y, temperature=temp, backend=be)
        elif loss == "simcse":
            val = fc.simcse_loss(x, y, temperature=temp, backend=be)
        else:
            val = fc.clip_loss(x, y, 1.0 / temp, backend=be)
        val.backward()
        out[be] = (val.detach(), x.grad, y.grad, temp.grad)
    for got, want in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_target_margin_and_learnable_scale_on_the_target_kernel(monkeypatch, route):
    """A target margin (additive-margin softmax) subtracts from the target cosine: the core op's forward
    and the scale's gradient ``h (c - margin)`` against the torch backend, with shuffled targets and
    exclude_self (a row whose target is its own column passes no gradient)."""
    route(DENSE="0")
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    tgt = torch.randperm(40, generator=g)
    tgt[5] = 5  # its own column, excluded
    spec = CoreSpec(margin=0.3, exclude_self=True)
    data = CoreData(target=tgt)
    coef = Coeffs(lse=1.0, tgt=1.0)
    out = {}
    for be in ("torch", "triton"):
        x, y = q.clone().requires_grad_(), k.clone().requires_grad_()
        s = torch.tensor(8.0, requires_grad=True)
        val = core.run(be, x, y, s, spec, data, coef, True)
        val.backward()
        out[be] = (val.detach(), x.grad, y.grad, s.grad)
    for got, want in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
