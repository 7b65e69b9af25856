"""``tau_plus=`` (the debiased contrastive loss, Chuang et al. 2020) on ``info_nce`` and ``clip_loss``, against
the paper's formula written here in float64 (loss and every gradient, both sides of the floor ``e^{-s}``),
against memeff 0.3.1's own debiased denominator (a pure-PyTorch function of its package), on every backend,
with a per-row prior, Matryoshka levels and ``label_smoothing``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc


def _unit(x):
    return F.normalize(x.double(), dim=-1)


def debiased_def(logits, target, tau, s, keep=None, eps=0.0, clamped=None):
    """Per row, the paper's eq. (6) as written: ``-l_pos + log(e^{l_pos} + n max((mean_neg e^{l_j} -
    tau e^{l_pos}) / (1 - tau), e^{-s}))``, negatives every kept column but the target; plus ``eps (l_pos -
    mean over the kept columns)`` (label smoothing, memeff's sum). ``clamped``: a list that receives, per
    row, whether the floor ruled."""
    out = []
    for i in range(logits.shape[0]):
        kept = torch.ones(logits.shape[1], dtype=torch.bool) if keep is None else keep[i]
        t = int(target[i])
        neg = kept.clone()
        neg[t] = False
        pos, negs = logits[i, t], logits[i, neg]
        ti = tau[i] if isinstance(tau, torch.Tensor) else tau
        est = (negs.exp().mean() - ti * pos.exp()) / (1 - ti)
        floor = torch.exp(-s) if isinstance(s, torch.Tensor) else math.exp(-s)
        if clamped is not None:
            clamped.append(bool(est < floor))
        loss = -pos + torch.log(pos.exp() + negs.numel() * torch.maximum(est, torch.as_tensor(floor)))
        out.append(loss + eps * (pos - logits[i, kept].mean()))
    return torch.stack(out)


def _run(fn, *xs, upstream=None):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*leaves)
    total = out if out.dim() == 0 else (out * upstream.to(out.dtype)).sum()
    return out.detach(), torch.autograd.grad(total, leaves)


def _check(got, want, tol):
    (vg, gg), (vw, gw) = got, want
    torch.testing.assert_close(vg.double(), vw, rtol=tol, atol=tol)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))


@pytest.fixture
def backend_setup(monkeypatch):
    def setup(backend):
        if backend == "triton":
            monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
            return torch.float32, 3e-4
        return torch.float64, 1e-9
    return setup


BACKENDS = ["reference", "torch", "triton"]


def _inputs(n, m, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(m, d, generator=g, dtype=torch.float64).to(dtype), g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tau", [0.1, 0.6, "rows"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_info_nce_with_keys(backend, tau, eps, path, backend_setup):
    """A learnable temperature, two ignored rows; tau 0.6 puts rows on the floor (checked), "rows" a prior
    per row (some on it)."""
    dt, tol = backend_setup(backend)
    q, k, g = _inputs(11, 9, 3, 0, dt)
    target = torch.randint(0, 9, (11,), generator=g)
    target[[3, 8]] = -100
    ignore = target == -100
    prior = torch.rand(11, generator=g, dtype=torch.float64) * 0.8 if tau == "rows" else tau
    up = torch.rand(11, generator=g, dtype=torch.float64)
    t = torch.tensor(0.5, dtype=dt)
    fc_prior = prior.to(dt) if isinstance(prior, torch.Tensor) else prior

    def definition(q_, k_, t_, clamped=None):
        per = debiased_def(_unit(q_) @ _unit(k_).T / t_, torch.where(ignore, 0, target), prior, 1 / t_, eps=eps,
                           clamped=clamped)
        return torch.where(ignore, 0.0, per)

    got = _run(lambda q_, k_, t_: fc.info_nce(q_, k_, target, temperature=t_, tau_plus=fc_prior, label_smoothing=eps,
                                              reduction="none", backend=backend), q, k, t, upstream=up)
    _check(got, _run(definition, q.double(), k.double(), t.double(), upstream=up), tol)
    if tau != 0.1:
        clamped = []
        definition(q.double(), k.double(), t.double(), clamped)
        on_floor = [c for c, bad in zip(clamped, ignore.tolist(), strict=True) if not bad]
        assert any(on_floor) and not all(on_floor), on_floor  # both sides of the floor are exercised
    mean = fc.info_nce(q, k, target, temperature=0.5, tau_plus=fc_prior, label_smoothing=eps, backend=backend)
    torch.testing.assert_close(mean.double(), definition(q.double(), k.double(), t.double()).sum() / 9, rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_info_nce_own_column_is_no_negative(backend, path, backend_setup):
    dt, tol = backend_setup(backend)
    q, _, g = _inputs(10, 1, 4, 1, dt)
    target = (torch.arange(10) + 1 + torch.randint(0, 8, (10,), generator=g)) % 10
    up = torch.rand(10, generator=g, dtype=torch.float64)
    keep = ~torch.eye(10, dtype=torch.bool)
    got = _run(lambda q_: fc.info_nce(q_, None, target, temperature=0.2, tau_plus=0.2, reduction="none",
                                      backend=backend), q, upstream=up)
    want = _run(lambda q_: debiased_def(_unit(q_) @ _unit(q_).T / 0.2, target, 0.2, 5.0, keep), q.double(),
                upstream=up)
    _check(got, want, tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["clip_loss", "symmetric"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_clip_both_directions(backend, form, eps, path, backend_setup):
    dt, tol = backend_setup(backend)
    a, b, g = _inputs(9, 9, 4, 2, dt)
    up = torch.rand(9, generator=g, dtype=torch.float64)
    scale = torch.tensor(3.0, dtype=dt)
    if form == "clip_loss":
        def fn(a_, b_, s_):
            return fc.clip_loss(a_, b_, s_, tau_plus=0.3, label_smoothing=eps, reduction="none", backend=backend)
    else:
        def fn(a_, b_, s_):
            return fc.info_nce(a_, b_, symmetric=True, scale=s_, tau_plus=0.3, label_smoothing=eps, reduction="none",
                               backend=backend)

    def definition(a_, b_, s_):
        logits = _unit(a_) @ _unit(b_).T * s_
        t = torch.arange(9)
        return (debiased_def(logits, t, 0.3, s_, eps=eps) + debiased_def(logits.T, t, 0.3, s_, eps=eps)) / 2

    _check(_run(fn, a, b, scale, upstream=up), _run(definition, a.double(), b.double(), scale.double(), upstream=up),
           tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss", ["info_nce", "clip_loss"])
def test_matryoshka_levels(backend, loss, path, backend_setup):
    dt, tol = backend_setup(backend)
    q, k, g = _inputs(10, 10, 9, 3, dt)
    dims, w = [9, 4, 2], [1.0, 0.5, 2.0]
    t = torch.tensor(0.3, dtype=dt)
    if loss == "info_nce":
        def fn(q_, k_, t_):
            return fc.info_nce(q_, k_, temperature=t_, tau_plus=0.2, matryoshka_dims=dims, matryoshka_weights=w,
                               backend=backend)

        def one(q_, k_, t_):
            return debiased_def(_unit(q_) @ _unit(k_).T / t_, torch.arange(10), 0.2, 1 / t_).mean()
    else:
        def fn(q_, k_, t_):
            return fc.clip_loss(q_, k_, 1 / t_, tau_plus=0.2, matryoshka_dims=dims, matryoshka_weights=w,
                                backend=backend)

        def one(q_, k_, t_):
            logits = _unit(q_) @ _unit(k_).T / t_
            r = torch.arange(10)
            return ((debiased_def(logits, r, 0.2, 1 / t_) + debiased_def(logits.T, r, 0.2, 1 / t_)) / 2).mean()

    def definition(q_, k_, t_):
        return sum(wi * one(q_[:, :d], k_[:, :d], t_) for d, wi in zip(dims, w, strict=True))

    _check(_run(fn, q, k, t), _run(definition, q.double(), k.double(), t.double()), tol)


@pytest.mark.parametrize("tau", [0.05, 0.4, 0.9])
def test_memeff_denominator(tau):
    """memeff 0.3.1's own ``debias_denominators`` (its eager PyTorch transform; the kernels around it are
    GPU-only) on the same logits: ``loss_i = log(denom_i / e^{l_pos})``, floor ``e^{-s}``."""
    common = pytest.importorskip("memeff._common")
    a, b, _ = _inputs(12, 12, 5, 4, torch.float64)
    s = 4.0
    logits = _unit(a) @ _unit(b).T * s
    pos = logits.diagonal().exp()
    denom, _, _ = common.debias_denominators(pos, logits.exp().sum(1), 11, tau, math.exp(-s))
    want_rows = torch.log(denom / pos)
    denom_c, _, _ = common.debias_denominators(pos, logits.exp().sum(0), 11, tau, math.exp(-s))
    want = (want_rows + torch.log(denom_c / pos)) / 2
    got = fc.clip_loss(a, b, s, tau_plus=tau, reduction="none", backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fc.info_nce(a, b, scale=s, tau_plus=tau, reduction="none"), want_rows, rtol=1e-12,
                               atol=1e-12)


def test_plain_loss_at_zero_and_finite_far_past_the_floor():
    a, b, _ = _inputs(8, 8, 3, 5, torch.float32)
    assert torch.equal(fc.info_nce(a, b, tau_plus=0.0), fc.info_nce(a, b))
    # tau = 0 as a tensor: the estimator is the plain negatives' mean (never under e^{-s} for unit rows)
    torch.testing.assert_close(fc.info_nce(a, b, tau_plus=torch.zeros(8)), fc.info_nce(a, b), rtol=1e-5, atol=1e-5)
    # a large scale with every row on the floor: finite loss and gradients (log space, no overflow)
    x = a.clone().requires_grad_()
    loss = fc.info_nce(x, b, scale=200.0, tau_plus=0.99)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(tau_plus=1.0), ValueError, r"tau_plus must be in \[0, 1\)"),
    (dict(tau_plus=-0.1), ValueError, "tau_plus"),
    (dict(tau_plus=float("nan")), ValueError, "tau_plus"),
    (dict(tau_plus="0.1"), TypeError, "tau_plus"),
    (dict(tau_plus=torch.zeros(3)), ValueError, r"tau_plus as a tensor must have shape \[4\]"),
    (dict(tau_plus=torch.tensor([0.1, 0.2, 1.0, 0.0])), ValueError, r"tau_plus\[2\] = 1.0"),
    (dict(tau_plus=torch.zeros(4, dtype=torch.long)), TypeError, "tau_plus"),
    (dict(tau_plus=0.1, ids=torch.arange(4)), ValueError, "tau_plus is not supported with guide= / ids="),
])
def test_bad_values_name_the_argument(kwargs, err, match):
    q, k, _ = _inputs(4, 4, 3, 6, torch.float32)
    with pytest.raises(err, match=match):
        fc.info_nce(q, None if "ids" in kwargs else k, torch.tensor([1, 0, 3, 2]) if "ids" in kwargs else None,
                    **kwargs)
    if "ids" not in kwargs:
        with pytest.raises(err, match=match):
            fc.clip_loss(q, k, 10.0, **kwargs)


def test_needs_a_negative():
    q, k, _ = _inputs(1, 1, 3, 7, torch.float32)
    with pytest.raises(ValueError, match="tau_plus needs at least one negative"):
        fc.info_nce(q, k, tau_plus=0.1)


def test_modules():
    """InfoNCELoss takes both options; CLIPLoss holds a float prior that forward's tau_plus overrides."""
    a, b, g = _inputs(6, 6, 3, 8, torch.float64)
    logits = _unit(a) @ _unit(b).T / 0.05
    want = debiased_def(logits, torch.arange(6), 0.2, 20.0, eps=0.1).mean()
    torch.testing.assert_close(fc.nn.InfoNCELoss(tau_plus=0.2, label_smoothing=0.1)(a, b), want, rtol=1e-12,
                               atol=1e-12)
    mod = fc.nn.CLIPLoss(0.05, tau_plus=0.2, label_smoothing=0.1).double()
    r = torch.arange(6)
    clip = lambda tau: ((debiased_def(logits, r, tau, 20.0, eps=0.1)  # noqa: E731
                         + debiased_def(logits.T, r, tau, 20.0, eps=0.1)) / 2).mean()
    # (the parameter is log(20) rounded to float32: 2e-8 relative)
    torch.testing.assert_close(mod(a, b), clip(0.2), rtol=1e-6, atol=1e-6)
    prior = torch.rand(6, generator=g, dtype=torch.float64) * 0.5
    torch.testing.assert_close(mod(a, b, tau_plus=prior), clip(prior), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="tau_plus"):
        fc.nn.CLIPLoss(tau_plus=1.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        fc.nn.InfoNCELoss(label_smoothing=1.0)
