"""Labels: one rule per argument across the functional, ``nn`` and drop-in forms (issue 24 items 7-8).

Class labels (SupCon / DSCL ``labels``, ``queue_labels``) are integer or bool (two classes); CoSENT's
labels are real, integer or bool (their order: False below True). Values are data: a SupCon anchor
without positives contributes 0, a NaN CoSENT label forms no pair. Every expectation here is computed
independently: the same call with int64 / float labels on the float64 reference backend, or the
textbook formula written in this file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc

BACKENDS = ["torch", "triton", "reference"]


def _grad(fn, *xs):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [x.grad for x in leaves]


def _cosent_textbook(u, v, y, scale):
    """sentence-transformers' CoSENT written out: log(1 + sum over pairs y_i > y_j of
    exp(scale (cos_j - cos_i)))."""
    cos = F.cosine_similarity(u, v, dim=1) * scale
    diff = cos[None, :] - cos[:, None]  # [i, j]: cos_j - cos_i
    keep = y[:, None] > y[None, :]  # NaN compares False: no pair
    return torch.logsumexp(torch.cat([torch.zeros(1, dtype=u.dtype), diff[keep]]), dim=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_class_labels_are_two_classes(backend):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, 2, 8, generator=g, dtype=torch.float64)
    yb = torch.rand(12, generator=g) > 0.5
    dt = torch.float32 if backend == "triton" else torch.float64
    for name, fn in [("supcon", lambda f, y: fc.supcon_loss(f, y, backend=backend)),
                     ("dscl", lambda f, y: fc.dscl_loss(f, y, backend=backend)),
                     ("nn.SupConLoss", lambda f, y: fc.nn.SupConLoss(backend=backend)(f, y)),
                     ("nn.DSCLLoss", lambda f, y: fc.nn.DSCLLoss(backend=backend)(f, y))]:
        got, (gg,) = _grad(lambda f, fn=fn: fn(f, yb), feats.to(dt))
        ref_fn = fc.dscl_loss if "DSCL" in name or name == "dscl" else fc.supcon_loss
        want, (gw,) = _grad(lambda f, ref_fn=ref_fn: ref_fn(f, yb.long(), backend="reference"), feats)
        tol = 1e-5 if dt == torch.float32 else 1e-12
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (name, got, want)
        assert torch.allclose(gg.double(), gw, rtol=10 * tol, atol=10 * tol), name


def test_bool_queue_labels():
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(6, 2, 5, generator=g, dtype=torch.float64)
    q = torch.randn(9, 5, generator=g, dtype=torch.float64)
    y, qy = torch.rand(6, generator=g) > 0.5, torch.rand(9, generator=g) > 0.5
    got = fc.supcon_loss(feats, y, queue=q, queue_labels=qy)
    want = fc.supcon_loss(feats, y.long(), queue=q, queue_labels=qy.long(), backend="reference")
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_cosent_labels_are_ordered(backend):
    g = torch.Generator().manual_seed(2)
    u, v = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randn(10, 6, generator=g, dtype=torch.float64)
    y = torch.rand(10, generator=g) > 0.5
    dt = torch.float32 if backend == "triton" else torch.float64
    want = _cosent_textbook(u, v, y.double(), 20.0)
    for got in (fc.cosent_loss(u.to(dt), v.to(dt), y, backend=backend),
                fc.nn.CoSENTLoss(backend=backend)(u.to(dt), v.to(dt), y),
                fc.cosent_loss_from_scores(F.cosine_similarity(u, v, dim=1).to(dt), y, backend=backend)):
        tol = 1e-4 if dt == torch.float32 else 1e-12
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got, want)


def test_supcon_anchors_without_positives_contribute_zero():
    """One view, all-distinct labels: no anchor has a positive; the loss is 0 with zero gradient (the
    textbook sum over an empty positive set, SupContrast's guard), on every backend."""
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(7, 1, 4, generator=g, dtype=torch.float64)
    for backend in ("torch", "reference"):
        loss, (gr,) = _grad(lambda f, backend=backend: fc.supcon_loss(f, torch.arange(7), backend=backend), feats)
        assert loss.item() == 0.0 and torch.count_nonzero(gr) == 0, (backend, loss, gr)
    # some anchors with positives: the mean runs over every anchor, the others adding 0
    y = torch.tensor([0, 0, 1, 2, 3, 4, 5])
    z = F.normalize(feats[:, 0], dim=1)
    logits = z @ z.T / 0.07
    logits.fill_diagonal_(float("-inf"))
    lsm = torch.log_softmax(logits, dim=1)
    want = (-(lsm[0, 1] + lsm[1, 0]) / 7).item()  # base_temperature = temperature: the factor is 1
    assert abs(fc.supcon_loss(feats, y).item() - want) < 1e-12


@pytest.mark.parametrize("backend", ["torch-tile", "torch-sorted", "triton", "reference"])
def test_cosent_nan_labels_form_no_pair(backend, monkeypatch, route):
    """NaN labels (anywhere, several, all): the loss and gradients of the textbook formula, whose
    comparisons with NaN are false; on the pair tile, the sorted scan (NaN sorts last) and the kernels."""
    if backend == "torch-sorted":  # a tile budget below B^2: the O(B log B) sorted path
        route(TILE_ELEMENTS="16")
    be = backend.split("-")[0]
    g = torch.Generator().manual_seed(4)
    dt = torch.float32 if be == "triton" else torch.float64
    u, v = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64)
    nan = float("nan")
    for y in (torch.tensor([1.0, nan, 2.0, 0.5, nan, 2.0, 3.0, nan, 0.0], dtype=torch.float64),
              torch.full((9,), nan, dtype=torch.float64)):
        want, gw = _grad(lambda a, b, y=y: _cosent_textbook(a, b, y, 20.0), u, v)
        got, gg = _grad(lambda a, b, y=y: fc.cosent_loss(a, b, y.to(dt), backend=be), u.to(dt), v.to(dt))
        tol = 1e-4 if dt == torch.float32 else 1e-12
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (backend, got, want)
        for a, b in zip(gg, gw, strict=True):
            assert torch.allclose(a.double(), b, rtol=tol, atol=tol), backend
    assert want.item() == 0.0  # all-NaN labels: no pair
