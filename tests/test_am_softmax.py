"""``am_softmax_loss`` (LaBSE's additive-margin softmax) and the core op's target margin, against the
textbook computation in float64 (``testing.baselines.am_softmax_formula``, the benchmark's: the N x N
cosines, ``m`` off the diagonal, ``F.cross_entropy`` both ways), on every path: torch dense and
chunked, the reference, the Triton fused kernels and the panel path (interpreted), Matryoshka levels,
the module form. The registry cases ``am_softmax`` / ``am_softmax_row_none`` put it through the shared
families as well (parity, gradcheck, compile, autocast, memory, gather, the training matrix)."""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive import core
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from fused_contrastive.testing.baselines import am_softmax_formula as textbook

TOL64 = dict(rtol=1e-11, atol=1e-12)


def _inputs(n, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=dtype)
    k = (q + 0.7 * torch.randn(n, d, generator=g, dtype=dtype))  # correlated pairs: the margin matters
    return q, k


def _grads(fn, q, k, t):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, t)]
    out = fn(*leaves)
    return out, torch.autograd.grad(out.sum(), leaves)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("margin", [0.3, -0.2, 0.0])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_equals_the_textbook_in_float64(backend, margin, symmetric, reduction, path):
    q, k = _inputs(23, 7, 1)
    t = torch.tensor(0.07, dtype=torch.float64)  # a learnable temperature: its gradient goes through the margin
    got, gg = _grads(lambda q_, k_, t_: fc.am_softmax_loss(q_, k_, margin=margin, temperature=t_, symmetric=symmetric,
                                                          reduction=reduction, backend=backend), q, k, t)
    want, gw = _grads(lambda q_, k_, t_: textbook(q_, k_, margin, t_, symmetric, reduction), q, k, t)
    torch.testing.assert_close(got, want, **TOL64)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b, **TOL64)


def test_margin_zero_is_clip_and_info_nce():
    q, k = _inputs(12, 5, 2)
    torch.testing.assert_close(fc.am_softmax_loss(q, k, margin=0.0, temperature=0.05), fc.clip_loss(q, k, 20.0),
                               **TOL64)
    torch.testing.assert_close(fc.am_softmax_loss(q, k, margin=0.0, temperature=0.05, symmetric=False),
                               fc.info_nce(q, k, temperature=0.05), **TOL64)


def test_the_temperature_gradient_includes_the_margin():
    """The margin is in cosine units: d l_ii / d s = c_ii - m. A margin in logit units (the core op's
    ``bias``, s held fixed there) gives the same loss and another temperature gradient; the test tells them
    apart, so the margin field is not a renamed bias."""
    q, k = _inputs(16, 6, 3)
    t = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    fc.am_softmax_loss(q, k, margin=0.3, temperature=t, symmetric=False).backward()
    s = 1 / t.detach()
    t2 = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    n = q.shape[0]
    as_bias = core.run("torch", q, k, 1 / t2, CoreSpec(bias=-float(0.3 * s)),
                       CoreData(target=torch.arange(n), bias_col=torch.arange(n)), Coeffs(lse=1 / n, tgt=1 / n), True)
    torch.testing.assert_close(as_bias, fc.am_softmax_loss(q, k, margin=0.3, temperature=0.05, symmetric=False),
                               **TOL64)
    as_bias.backward()
    t3 = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    textbook(q, k, 0.3, t3, symmetric=False).backward()
    torch.testing.assert_close(t.grad, t3.grad, **TOL64)
    assert abs(float(t2.grad - t3.grad)) > 1e-3 * abs(float(t3.grad)), (t2.grad, t3.grad)


@pytest.mark.parametrize("triton_path", ["fused", "panel"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_triton_interpreted_equals_the_textbook(triton_path, symmetric, monkeypatch, route):
    route(TRITON_PATH=triton_path)
    route(DENSE="0")  # the kernels, not the one-tile torch path
    q, k = _inputs(70, 24, 4, torch.float32)
    t = torch.tensor(0.05)
    got, gg = _grads(lambda q_, k_, t_: fc.am_softmax_loss(q_, k_, margin=0.3, temperature=t_, symmetric=symmetric,
                                                          reduction="none", backend="triton"), q, k, t)
    want, gw = _grads(lambda q_, k_, t_: textbook(q_, k_, 0.3, t_, symmetric, "none"),
                      q.double(), k.double(), t.double())
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-4 * float(b.abs().max()))


def test_matryoshka_levels_are_one_loss_per_prefix(path):
    q, k = _inputs(15, 8, 5)
    dims, w = [8, 5, 2], [1.0, 0.5, 2.0]
    got = fc.am_softmax_loss(q, k, margin=0.25, matryoshka_dims=dims, matryoshka_weights=w)
    want = sum(wi * textbook(q[:, :d], k[:, :d], 0.25, 0.05) for d, wi in zip(dims, w, strict=True))
    torch.testing.assert_close(got, want, **TOL64)


def test_module_form():
    q, k = _inputs(9, 4, 6)
    mod = fc.nn.AMSoftmaxLoss(0.2, 0.1, symmetric=False)
    torch.testing.assert_close(mod(q, k), textbook(q, k, 0.2, 0.1, symmetric=False), **TOL64)
    with pytest.raises(ValueError, match="margin"):
        fc.nn.AMSoftmaxLoss(float("nan"))


def test_bad_arguments_name_themselves():
    q, k = _inputs(5, 3, 7)
    with pytest.raises(ValueError, match="margin"):
        fc.am_softmax_loss(q, k, margin=float("inf"))
    with pytest.raises(TypeError, match="symmetric"):
        fc.am_softmax_loss(q, k, symmetric="yes")
    with pytest.raises(ValueError, match="keys"):
        fc.am_softmax_loss(q, k[:4])


def test_core_margin_contract():
    a = torch.randn(4, 3)
    with pytest.raises(ValueError, match="margin needs CoreData.target"):
        core.run("torch", a, a, 10.0, CoreSpec(margin=0.1), CoreData(), Coeffs(lse=1.0), True)
    with pytest.raises(ValueError, match="margin is not combined"):
        core.run("torch", a, a, 10.0, CoreSpec(margin=0.1, exclude_target=True), CoreData(target=torch.arange(4)),
                 Coeffs(lse=1.0, tgt=1.0), True)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_label_smoothing_against_f_cross_entropy(backend, symmetric, reduction, path, monkeypatch):
    """``label_smoothing=0.15``: ``F.cross_entropy(..., label_smoothing=)`` on the margin logits, each
    direction (loss, both embeddings' and the temperature's gradients)."""
    import torch.nn.functional as F

    if backend == "triton":
        monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")  # the kernels, not the one-tile path
    dt, tol = (torch.float32, 2e-4) if backend == "triton" else (torch.float64, 1e-9)
    q, k = _inputs(9, 6, 5)
    up = torch.rand(9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if reduction == "mean":
        up = torch.tensor(1 / 9, dtype=torch.float64)  # the mean's weights, summed by _grads

    def definition(q_, k_, t_):
        cos = F.normalize(q_, dim=1) @ F.normalize(k_, dim=1).T
        logits = (cos - 0.3 * torch.eye(9, dtype=torch.float64)) / t_
        rows = F.cross_entropy(logits, torch.arange(9), label_smoothing=0.15, reduction="none")
        cols = F.cross_entropy(logits.T, torch.arange(9), label_smoothing=0.15, reduction="none")
        return (rows + cols) / 2 if symmetric else rows

    t = torch.tensor(0.1, dtype=torch.float64)
    got, gg = _grads(lambda q_, k_, t_: fc.am_softmax_loss(q_, k_, margin=0.3, temperature=t_, symmetric=symmetric,
                                                          label_smoothing=0.15, reduction=reduction,
                                                          backend=backend) * (up.to(dt) if reduction == "none" else 1),
                      q.to(dt), k.to(dt), t.to(dt))
    want, gw = _grads(lambda q_, k_, t_: (definition(q_, k_, t_) * up).sum(), q, k, t)
    want = want if reduction == "mean" else definition(q, k, t) * up
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))
