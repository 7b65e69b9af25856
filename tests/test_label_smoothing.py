"""``label_smoothing=`` on every single-target loss, against the float64 definition written here:
``F.cross_entropy(logits_i, t_i, label_smoothing=eps)`` on the logits with the excluded columns deleted
(loss and every gradient: the embeddings and a learnable temperature), on every backend (reference,
torch's dense and chunked paths, triton under the interpreter; the additive-margin loss's in its own test
module), with ``reduction="none"`` / ``"mean"``,
``ignore_index`` and Matryoshka levels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc

EPS = 0.15


def _unit(x):
    return F.normalize(x.double(), dim=-1)


def smoothed(logits, target, eps, keep=None):
    """Per row: F.cross_entropy on row i's logits with the columns ``~keep[i]`` deleted (target re-indexed)."""
    out = []
    for i in range(logits.shape[0]):
        cols = torch.arange(logits.shape[1]) if keep is None else keep[i].nonzero()[:, 0]
        t = int((cols == int(target[i])).nonzero()[0, 0])
        out.append(F.cross_entropy(logits[i, cols][None], torch.tensor([t]), label_smoothing=eps))
    return torch.stack(out)


def _inputs(n, m, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(m, d, generator=g, dtype=torch.float64).to(dtype), g)


def _run(fn, *xs, upstream=None):
    """(value, grads of every tensor in xs) with ``upstream`` weights on a per-row value."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*leaves)
    total = out if out.dim() == 0 else (out * upstream.to(out.dtype)).sum()
    grads = torch.autograd.grad(total, leaves)
    return out.detach(), grads


def _check(got, want, tol):
    (vg, gg), (vw, gw) = got, want
    torch.testing.assert_close(vg.double(), vw, rtol=tol, atol=tol)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))


# the backends: reference, the torch paths (the ``path`` fixture), triton under the interpreter (float32)
BACKENDS = ["reference", "torch", "triton"]


@pytest.fixture
def backend_setup(request, monkeypatch):
    def setup(backend):
        if backend == "triton":
            monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")  # the kernels, not the one-tile path
            return torch.float32, 2e-4
        return torch.float64, 1e-9
    return setup


def _info_nce_def(q, k, target, t, eps, exclude_self=False, ignore=None):
    qn = _unit(q)
    kn = qn if k is None else _unit(k)
    logits = qn @ kn.T / t
    keep = None
    if exclude_self:
        keep = ~torch.eye(q.shape[0], logits.shape[1], dtype=torch.bool)
    tt = target if ignore is None else torch.where(ignore, 0, target)
    per = smoothed(logits, tt, eps, keep)
    return per if ignore is None else torch.where(ignore, 0.0, per)


@pytest.mark.parametrize("backend", BACKENDS)
def test_info_nce_with_keys_and_ignored_rows(backend, path, backend_setup):
    dt, tol = backend_setup(backend)
    q, k, g = _inputs(11, 9, 6, 0, dt)
    target = torch.randint(0, 9, (11,), generator=g)
    target[[2, 7]] = -100
    ignore = target == -100
    up = torch.rand(11, generator=g, dtype=torch.float64)
    t = torch.tensor(0.2, dtype=dt)
    got = _run(lambda q_, k_, t_: fc.info_nce(q_, k_, target, temperature=t_, label_smoothing=EPS, reduction="none",
                                              backend=backend), q, k, t, upstream=up)
    want = _run(lambda q_, k_, t_: _info_nce_def(q_, k_, target, t_, EPS, ignore=ignore), q.double(), k.double(),
                t.double(), upstream=up)
    _check(got, want, tol)
    # the mean leaves the ignored rows out of its denominator, as F.cross_entropy's
    mean = fc.info_nce(q, k, target, temperature=0.2, label_smoothing=EPS, backend=backend)
    ref = F.cross_entropy(_unit(q) @ _unit(k).T / 0.2, target, label_smoothing=EPS)
    torch.testing.assert_close(mean.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_info_nce_own_column_is_deleted(backend, path, backend_setup):
    """keys=None: the own column leaves the softmax, and the uniform part runs over the other N - 1."""
    dt, tol = backend_setup(backend)
    q, _, g = _inputs(10, 1, 5, 1, dt)
    target = (torch.arange(10) + 1 + torch.randint(0, 8, (10,), generator=g)) % 10
    up = torch.rand(10, generator=g, dtype=torch.float64)
    got = _run(lambda q_: fc.info_nce(q_, None, target, temperature=0.1, label_smoothing=EPS, reduction="none",
                                      backend=backend), q, upstream=up)
    want = _run(lambda q_: _info_nce_def(q_, None, target, 0.1, EPS, exclude_self=True), q.double(), upstream=up)
    _check(got, want, tol)
    # the textbook form with the own column at -inf spreads eps / N onto it: inf, which is why it is deleted
    textbook = F.cross_entropy((_unit(q) @ _unit(q).T / 0.1).fill_diagonal_(float("-inf")), target,
                               label_smoothing=EPS)
    assert torch.isinf(textbook)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["clip_loss", "symmetric"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_clip_both_directions(backend, form, reduction, path, backend_setup):
    """Per pair (the column means computed apart) and summed (one SET statistic carries both halves)."""
    dt, tol = backend_setup(backend)
    a, b, g = _inputs(9, 9, 7, 2, dt)
    up = torch.rand(9, generator=g, dtype=torch.float64)
    scale = torch.tensor(8.0, dtype=dt)
    if form == "clip_loss":
        def fn(a_, b_, s_):
            return fc.clip_loss(a_, b_, s_, label_smoothing=EPS, reduction=reduction, backend=backend)
    else:
        def fn(a_, b_, s_):
            return fc.info_nce(a_, b_, symmetric=True, scale=s_, label_smoothing=EPS, reduction=reduction,
                               backend=backend)

    def definition(a_, b_, s_):
        logits = _unit(a_) @ _unit(b_).T * s_
        t = torch.arange(9)
        per = (smoothed(logits, t, EPS) + smoothed(logits.T, t, EPS)) / 2
        return per if reduction == "none" else per.mean()

    _check(_run(fn, a, b, scale, upstream=up), _run(definition, a.double(), b.double(), scale.double(), upstream=up),
           tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("two_view", [False, True])
def test_simcse(backend, two_view, path, backend_setup):
    dt, tol = backend_setup(backend)
    z1, z2, g = _inputs(10, 10, 6, 3, dt)
    up = torch.rand(10, generator=g, dtype=torch.float64)
    if two_view:
        got = _run(lambda x, y: fc.simcse_loss(x, y, temperature=0.1, label_smoothing=EPS, reduction="none",
                                               backend=backend), z1, z2, upstream=up)
        want = _run(lambda x, y: smoothed(_unit(x) @ _unit(y).T / 0.1, torch.arange(10), EPS), z1.double(),
                    z2.double(), upstream=up)
    else:
        got = _run(lambda x: fc.simcse_loss(x, temperature=0.1, label_smoothing=EPS, reduction="none",
                                            backend=backend), z1, upstream=up)
        want = _run(lambda x: _info_nce_def(x, None, torch.arange(10) ^ 1, 0.1, EPS, exclude_self=True), z1.double(),
                    upstream=up)
    _check(got, want, tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hnw", [0.0, 0.7])
def test_simcse_sup_with_hard_negatives(backend, hnw, path, backend_setup):
    dt, tol = backend_setup(backend)
    a, p, g = _inputs(8, 8, 5, 4, dt)
    n = torch.randn(8, 5, generator=g, dtype=torch.float64).to(dt)
    up = torch.rand(8, generator=g, dtype=torch.float64)

    def definition(a_, p_, n_):
        logits = torch.cat([_unit(a_) @ _unit(p_).T, _unit(a_) @ _unit(n_).T], dim=1) / 0.05
        logits = logits + hnw * torch.cat([torch.zeros(8, 8), torch.eye(8)], dim=1).double()  # SimCSE's weights
        return smoothed(logits, torch.arange(8), EPS)

    got = _run(lambda x, y, z: fc.simcse_sup_loss(x, y, z, hard_negative_weight=hnw, label_smoothing=EPS,
                                                  reduction="none", backend=backend), a, p, n, upstream=up)
    _check(got, _run(definition, a.double(), p.double(), n.double(), upstream=up), tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss", ["info_nce", "clip_loss"])
def test_matryoshka_levels(backend, loss, path, backend_setup):
    """Every level is the smoothed loss of the truncated, re-normalised rows (one pass over D)."""
    dt, tol = backend_setup(backend)
    q, k, g = _inputs(10, 10, 12, 6, dt)
    dims, w = [12, 7, 3], [1.0, 0.5, 2.0]
    t = torch.tensor(0.1, dtype=dt)
    target = torch.randperm(10, generator=g)
    if loss == "info_nce":
        def fn(q_, k_, t_):
            return fc.info_nce(q_, k_, target, temperature=t_, label_smoothing=EPS, matryoshka_dims=dims,
                               matryoshka_weights=w, backend=backend)

        def one(q_, k_, t_):
            return smoothed(_unit(q_) @ _unit(k_).T / t_, target, EPS).mean()
    else:
        def fn(q_, k_, t_):
            return fc.clip_loss(q_, k_, 1 / t_, label_smoothing=EPS, matryoshka_dims=dims, matryoshka_weights=w,
                                backend=backend)

        def one(q_, k_, t_):
            logits = _unit(q_) @ _unit(k_).T / t_
            return ((smoothed(logits, torch.arange(10), EPS) + smoothed(logits.T, torch.arange(10), EPS)) / 2).mean()

    def definition(q_, k_, t_):
        return sum(wi * one(q_[:, :d], k_[:, :d], t_) for d, wi in zip(dims, w, strict=True))

    _check(_run(fn, q, k, t), _run(definition, q.double(), k.double(), t.double()), tol)


def test_zero_is_the_plain_loss_and_sum_reduction():
    q, k, g = _inputs(12, 12, 4, 7)
    target = torch.randperm(12, generator=g)
    assert torch.equal(fc.info_nce(q, k, target, label_smoothing=0.0), fc.info_nce(q, k, target))
    got = fc.info_nce(q, k, target, temperature=0.1, label_smoothing=0.1, reduction="sum")
    want = F.cross_entropy(_unit(q) @ _unit(k).T / 0.1, target, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, fc.info_nce(q, k, target, temperature=0.1, reduction="sum"))


def test_modules_take_it():
    q, k, _ = _inputs(8, 8, 4, 8)
    want = F.cross_entropy(_unit(q) @ _unit(k).T / 0.05, torch.arange(8), label_smoothing=0.1)
    torch.testing.assert_close(fc.nn.InfoNCELoss(label_smoothing=0.1)(q, k), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [lambda q, k, **kw: fc.info_nce(q, k, **kw),
                                lambda q, k, **kw: fc.clip_loss(q, k, 10.0, **kw),
                                lambda q, k, **kw: fc.simcse_loss(q, k, **kw),
                                lambda q, k, **kw: fc.simcse_sup_loss(q, k, **kw)])
@pytest.mark.parametrize("bad,err", [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                     ("0.1", TypeError), (True, TypeError)])
def test_bad_values_name_the_argument(fn, bad, err):
    q, k, _ = _inputs(4, 4, 3, 9)
    with pytest.raises(err, match="label_smoothing"):
        fn(q, k, label_smoothing=bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_maxsim(backend, reduction, backend_setup):
    """Late interaction: F.cross_entropy(scale * S, target, label_smoothing=eps) on the MaxSim scores written
    here (ColBERT's sum over query tokens of the best document token), hard negatives, an ignored row, a
    masked document token and a learnable scale."""
    dt, tol = backend_setup(backend)
    g = torch.Generator().manual_seed(10)
    q = torch.randn(6, 3, 4, generator=g, dtype=torch.float64).to(dt)
    d = torch.randn(6, 5, 4, generator=g, dtype=torch.float64).to(dt)
    neg = torch.randn(2, 4, 4, generator=g, dtype=torch.float64).to(dt)
    dmask = torch.ones(6, 5, dtype=torch.bool)
    dmask[2, 3:] = False
    target = torch.tensor([0, 1, 2, -100, 4, 7])
    up = torch.rand(6, generator=g, dtype=torch.float64) if reduction == "none" else None
    sc = torch.tensor(3.0, dtype=dt)

    def definition(q_, d_, n_, s_):
        qn, dn, nn_ = (F.normalize(x, dim=-1) for x in (q_, d_, n_))
        sim = torch.einsum("iad,jbd->ijab", qn, dn).masked_fill(~dmask[None, :, None, :], float("-inf"))
        scores = torch.cat([sim.amax(-1).sum(-1), torch.einsum("iad,jbd->ijab", qn, nn_).amax(-1).sum(-1)], dim=1)
        return F.cross_entropy(s_ * scores, target, label_smoothing=EPS, reduction=reduction)

    def fn(q_, d_, n_, s_):
        return fc.maxsim.maxsim_info_nce(q_, d_, target, doc_mask=dmask, negatives=n_, scale=s_, label_smoothing=EPS,
                                         reduction=reduction, backend=backend)

    _check(_run(fn, q, d, neg, sc, upstream=up),
           _run(definition, q.double(), d.double(), neg.double(), sc.double(), upstream=up), tol)
