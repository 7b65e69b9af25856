"""``label_smoothing=`` where the columns of a row's softmax depend on the data: ``gist_loss`` (the guide's
dropped candidates) and ``info_nce`` / ``simcse_loss`` / ``simcse_sup_loss`` with ``guide=`` / ``ids=``.
Against the float64 definition written here: per row, ``F.cross_entropy(logits_i[C_i], t_i,
label_smoothing=eps)`` on the logits with the dropped / own / same-id columns deleted (loss and every
gradient: the embeddings and a learnable temperature), on every backend (reference, the torch sweep in one
chunk and in row chunks, triton under the interpreter: its fused kernels count and sum the kept logits),
``reduction="none"`` / ``"mean"``, ``ignore_index``, Matryoshka levels and gather over two gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from tests._ranks import gloo_rank, run_ranks
from tests.test_label_smoothing import smoothed

EPS = 0.2


def _cos(x, y):
    return F.normalize(x.double(), dim=-1) @ F.normalize(y.double(), dim=-1).T


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gist_inputs(b=9, d=6, dg=3, seed=0):
    # a low-dimensional guide: cosines of both signs, so the mask drops some candidates and keeps others
    a, p, n = _r(b, d, seed=seed), _r(b, d, seed=seed + 1), _r(b, d, seed=seed + 2)
    ga, gp, gn = _r(b, dg, seed=seed + 3), _r(b, dg, seed=seed + 4), _r(b, dg, seed=seed + 5)
    return a, p, n, ga, gp, gn


def gist_logits(a, p_all, n, ga, gp_all, gn, t, margin, off=0, a_cols=None, ga_cols=None):
    """GISTEmbed's logits [B, 4 blocks] and the kept columns (sentence-transformers' GISTEmbedLoss rule:
    a candidate is dropped when its guide cosine is > gpos_i - margin, the positive kept)."""
    b = a.shape[0]
    a_cols = a if a_cols is None else a_cols
    ga_cols = ga if ga_cols is None else ga_cols
    rows = torch.arange(b)
    gpos = _cos(ga, gp_all)[rows, off + rows]
    theta = gpos - margin
    logits, keep = [], []
    for x, y, gx, gy, protect in ((a, p_all, ga, gp_all, True), (a, a_cols, ga, ga_cols, False),
                                  (p_all[off:off + b], p_all, gp_all[off:off + b], gp_all, False),
                                  (a, n, ga, gn, False)):
        drop = _cos(gx, gy) > theta[:, None]
        if protect:
            drop[rows, off + rows] = False
        logits.append(_cos(x, y) / t)
        keep.append(~drop)
    return torch.cat(logits, dim=1), torch.cat(keep, dim=1), rows + off


def _gist_definition(a, p, n, ga, gp, gn, t, margin, eps, dims=None, weights=None, **kw):
    """Per-row smoothed GIST losses (summed over Matryoshka prefixes, each re-normalised by the cosine)."""
    out = 0
    for d, w in zip(dims or [a.shape[1]], weights or [1.0], strict=True):
        cut = {k: v[:, :d] for k, v in kw.items() if k == "a_cols"}
        logits, keep, tgt = gist_logits(a[:, :d], p[:, :d], n[:, :d], ga, gp, gn, t, margin,
                                        **{**kw, **cut})
        out = out + w * smoothed(logits, tgt, eps, keep)
    return out


def _grads(fn, xs, t0, dtype, upstream):
    leaves = [x.to(dtype).clone().requires_grad_() for x in xs]
    t = torch.tensor(t0, dtype=dtype, requires_grad=True)
    out = fn(*leaves, t)
    total = out if out.dim() == 0 else (out * upstream.to(out.dtype)).sum()
    return (out.detach().double(), *(g.double() for g in torch.autograd.grad(total, [*leaves, t])))


def _close(got, want, tol):
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * max(1.0, float(y.abs().max())))


# backends: (backend, dtype, tolerance, env): the torch sweep in one chunk and in one-row chunks, the
# triton backend interpreted (float32 inputs: their rounding)
SETUPS = {
    "reference": ("reference", torch.float64, 1e-10, {}),
    "torch": ("torch", torch.float64, 1e-10, {}),
    "torch-row-chunks": ("torch", torch.float64, 1e-10, {"FUSED_CONTRASTIVE_TILE_ELEMENTS": "24"}),
    "triton": ("triton", torch.float32, 3e-4, {"FUSED_CONTRASTIVE_DENSE": "0"}),
}


@pytest.fixture(params=list(SETUPS))
def setup(request, monkeypatch):
    backend, dt, tol, env = SETUPS[request.param]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return backend, dt, tol


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_gist(setup, reduction):
    backend, dt, tol = setup
    a, p, n, ga, gp, gn = _gist_inputs()
    up = torch.linspace(0.5, 2.0, a.shape[0], dtype=torch.float64)

    def ours(a_, p_, n_, t_):
        return fc.gist_loss(a_, p_, n_, guide=(ga.to(dt), gp.to(dt), gn.to(dt)), temperature=t_, margin=0.1,
                            label_smoothing=EPS, reduction=reduction, backend=backend)

    def want(a_, p_, n_, t_):
        per = _gist_definition(a_, p_, n_, ga, gp, gn, t_, 0.1, EPS)
        return per if reduction == "none" else per.mean()

    got = _grads(ours, (a, p, n), 0.1, dt, up)
    ref = _grads(want, (a, p, n), 0.1, torch.float64, up)
    # not vacuous: the guide drops some candidates, and smoothing changes the loss
    _, keep, _ = gist_logits(a, p, n, ga, gp, gn, 0.1, 0.1)
    assert 0 < int((~keep).sum()) < keep.numel() - 2 * keep.shape[0]
    plain = fc.gist_loss(a, p, n, guide=(ga, gp, gn), temperature=0.1, margin=0.1, reduction=reduction,
                         backend="reference")
    assert float((plain.double() - ref[0]).abs().max()) > 1e-2
    _close(got, ref, tol)


def test_gist_matryoshka(setup):
    backend, dt, tol = setup
    a, p, n, ga, gp, gn = _gist_inputs(seed=4)
    dims, weights = [6, 3, 4], [1.0, 0.5, 2.0]
    up = torch.ones(a.shape[0], dtype=torch.float64)

    def ours(a_, p_, n_, t_):
        return fc.gist_loss(a_, p_, n_, guide=(ga.to(dt), gp.to(dt), gn.to(dt)), temperature=t_, margin=0.05,
                            label_smoothing=EPS, backend=backend, matryoshka_dims=dims, matryoshka_weights=weights)

    def want(a_, p_, n_, t_):
        return _gist_definition(a_, p_, n_, ga, gp, gn, t_, 0.05, EPS, dims, weights).mean()

    _close(_grads(ours, (a, p, n), 0.1, dt, up), _grads(want, (a, p, n), 0.1, torch.float64, up), tol)


def test_gist_module_takes_it():
    a, p, n, ga, gp, gn = _gist_inputs(seed=7)
    mod = fc.nn.GISTLoss(0.1, margin=0.1, label_smoothing=EPS, backend="torch")
    got = mod(a, p, n, guide=(ga, gp, gn))
    want = _gist_definition(a, p, n, ga, gp, gn, 0.1, 0.1, EPS).mean()
    torch.testing.assert_close(got.double(), want, rtol=1e-10, atol=1e-10)
    assert "label_smoothing=0.2" in repr(mod)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.5"):
        fc.nn.GISTLoss(label_smoothing=1.5)


@pytest.mark.parametrize("bad,err", [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                     ("0.1", TypeError)])
def test_gist_bad_values_name_the_argument(bad, err):
    a, p, n, ga, gp, gn = _gist_inputs()
    with pytest.raises(err, match="label_smoothing"):
        fc.gist_loss(a, p, n, guide=(ga, gp, gn), label_smoothing=bad)


def test_triton_smooths_in_the_kernels(monkeypatch):
    # the Triton backend forms the kept count and sum in its fused kernels (SMOOTH), never the torch sweep
    from fused_contrastive.core.guided import torch_blocks as blocks
    from fused_contrastive.core.triton_shared import launch as TL

    launched = []
    real = TL._launch

    def spy(launch):
        launched.append((launch.name, launch.constexprs.get("SMOOTH")))
        return real(launch)

    def no_sweep(*a, **k):
        raise AssertionError("the torch sweep ran on backend='triton'")

    monkeypatch.setattr(TL, "_launch", spy)
    monkeypatch.setattr(blocks, "_sweep", no_sweep)
    monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
    a, p, n, ga, gp, gn = (x.float().requires_grad_() for x in _gist_inputs())
    fc.gist_loss(a, p, n, guide=(ga, gp, gn), margin=0.1, label_smoothing=EPS, reduction="none",
                 backend="triton").sum().backward()
    fused = {name: flag for name, flag in launched if name.startswith("guided_")}
    assert fused == {"guided_fwd": True, "guided_bwd_rows": True, "guided_bwd_cols": True}, launched


# ---------------------------------------------------------------------------------------------
# info_nce / SimCSE with guide= / ids=
# ---------------------------------------------------------------------------------------------

def _masked_def(q, k, target, t, eps, gq=None, gk=None, margin=0.0, iq=None, ik=None, own=False, ignore=None):
    """Per-row smoothed losses of one query block against keys, the guide / id / own columns deleted (the
    target kept); ignored rows 0."""
    logits = _cos(q, k) / t
    n, m = logits.shape
    rows = torch.arange(n)
    tt = target if ignore is None else torch.where(ignore, 0, target)
    drop = torch.zeros(n, m, dtype=torch.bool)
    if gq is not None:
        g = _cos(gq, gk)
        drop |= g > (g[rows, tt] - margin)[:, None]
    if iq is not None:
        drop |= iq[:, None] == ik[None, :]
    drop[rows, tt] = False
    if own:
        drop[rows, rows] = True
    per = smoothed(logits, tt, eps, ~drop)
    return per if ignore is None else torch.where(ignore, 0.0, per)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_info_nce_guide_and_ids_with_ignored_rows(setup, reduction):
    backend, dt, tol = setup
    n, m, d = 8, 11, 5
    q, k = _r(n, d, seed=1), _r(m, d, seed=2)
    gq, gk = _r(n, 3, seed=3), _r(m, 3, seed=4)
    iq, ik = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), torch.arange(m) % 5
    target = torch.tensor([3, 0, -100, 7, 10, 2, 5, -100])
    ignore = target == -100
    up = torch.linspace(0.5, 2.0, n, dtype=torch.float64)

    def ours(q_, k_, t_):
        return fc.info_nce(q_, k_, target, temperature=t_, guide=(gq.to(dt), gk.to(dt)), guide_margin=0.1,
                           ids=(iq, ik), label_smoothing=EPS, reduction=reduction, backend=backend)

    def want(q_, k_, t_):
        per = _masked_def(q_, k_, target, t_, EPS, gq, gk, 0.1, iq, ik, ignore=ignore)
        return per if reduction == "none" else per.sum() / (~ignore).sum()

    _close(_grads(ours, (q, k), 0.1, dt, up), _grads(want, (q, k), 0.1, torch.float64, up), tol)


def test_info_nce_ids_own_column(setup):
    backend, dt, tol = setup
    n, d = 10, 4
    q = _r(n, d, seed=5)
    ids = torch.tensor([0, 1, 0, 2, 3, 1, 4, 5, 2, 6])
    target = torch.tensor([2, 5, 0, 8, 6, 1, 9, 3, 3, 7])
    up = torch.ones(n, dtype=torch.float64)

    def ours(q_, t_):
        return fc.info_nce(q_, None, target, temperature=t_, ids=ids, label_smoothing=EPS, backend=backend)

    def want(q_, t_):
        return _masked_def(q_, q_, target, t_, EPS, iq=ids, ik=ids, own=True).mean()

    _close(_grads(ours, (q,), 0.07, dt, up), _grads(want, (q,), 0.07, torch.float64, up), tol)


@pytest.mark.parametrize("two_view", [False, True])
def test_simcse_with_ids(setup, two_view):
    backend, dt, tol = setup
    b, d = 5, 4
    up = torch.ones(2 * b, dtype=torch.float64)
    if two_view:
        z1, z2 = _r(b, d, seed=6), _r(b, d, seed=7)
        ids = torch.tensor([0, 1, 0, 2, 1])

        def ours(x, y, t_):
            return fc.simcse_loss(x, y, temperature=t_, ids=(ids, ids), label_smoothing=EPS, backend=backend)

        def want(x, y, t_):
            return _masked_def(x, y, torch.arange(b), t_, EPS, iq=ids, ik=ids).mean()

        xs = (z1, z2)
    else:
        z = _r(2 * b, d, seed=8)
        ids = torch.tensor([0, 0, 1, 1, 0, 0, 2, 2, 1, 1])  # sentences 0 and 2, 1 and 4 are the same text

        def ours(x, t_):
            return fc.simcse_loss(x, temperature=t_, ids=ids, label_smoothing=EPS, backend=backend)

        def want(x, t_):
            return _masked_def(x, x, torch.arange(2 * b) ^ 1, t_, EPS, iq=ids, ik=ids, own=True).mean()

        xs = (z,)
    _close(_grads(ours, xs, 0.05, dt, up), _grads(want, xs, 0.05, torch.float64, up), tol)


def test_simcse_sup_with_guide(setup):
    backend, dt, tol = setup
    b, d = 6, 5
    a, p, n = _r(b, d, seed=9), _r(b, d, seed=10), _r(b, d, seed=11)
    ga, gp, gn = _r(b, 3, seed=12), _r(b, 3, seed=13), _r(b, 3, seed=14)
    up = torch.ones(b, dtype=torch.float64)

    def ours(a_, p_, n_, t_):
        return fc.simcse_sup_loss(a_, p_, n_, temperature=t_, guide=(ga.to(dt), gp.to(dt), gn.to(dt)),
                                  guide_margin=0.05, label_smoothing=EPS, reduction="none", backend=backend)

    def want(a_, p_, n_, t_):
        return _masked_def(a_, torch.cat([p_, n_]), torch.arange(b), t_, EPS, ga, torch.cat([gp, gn]), 0.05)

    _close(_grads(ours, (a, p, n), 0.05, dt, up), _grads(want, (a, p, n), 0.05, torch.float64, up), tol)


def test_zero_is_the_plain_masked_loss():
    q, k = _r(6, 4, seed=15), _r(6, 4, seed=16)
    ids = (torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 1, 2, 3, 4, 5]))
    for be in ("torch", "reference"):
        plain = fc.info_nce(q, k, ids=ids, backend=be)
        assert torch.equal(fc.info_nce(q, k, ids=ids, label_smoothing=0.0, backend=be), plain)
        want = _masked_def(q, k, torch.arange(6), 0.05, 0.0, iq=ids[0], ik=ids[1]).mean()
        torch.testing.assert_close(plain.double(), want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# gather over two gloo ranks (uneven): the rank average is the global loss, its gradients DDP's
# ---------------------------------------------------------------------------------------------

def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with gloo_rank(rank, world, init, out):
        total, off, b = sum(sizes), sum(sizes[:rank]), sizes[rank]
        a, p, n, ga, gp, gn = _gist_inputs(b=total, d=6, seed=3)
        mine = slice(off, off + b)
        res = {"rank": rank}
        for backend in ("torch", "reference", "triton"):
            dt = torch.float32 if backend == "triton" else torch.float64
            la, lp, ln = (x[mine].to(dt).clone().requires_grad_() for x in (a, p, n))
            t = torch.tensor(0.1, dtype=dt, requires_grad=True)
            loss = fc.gist_loss(la, lp, ln, guide=(ga[mine].to(dt), gp[mine].to(dt), gn[mine].to(dt)),
                                temperature=t, margin=0.05, gather=True, backend=backend, label_smoothing=EPS)
            loss.backward()
            ra, rp, rn = (x.clone().requires_grad_() for x in (a, p, n))
            t2 = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
            parts = []
            for r in range(world):
                o = sum(sizes[:r])
                s = slice(o, o + sizes[r])
                logits, keep, tgt = gist_logits(ra[s], rp, rn, ga[s], gp, gn, t2, 0.05, off=o, a_cols=ra, ga_cols=ga)
                parts.append(smoothed(logits, tgt, EPS, keep))
            want = torch.cat(parts).mean()
            want.backward()
            mean = loss.detach().double().clone()
            dist.all_reduce(mean)
            tg = t.grad.double().clone()
            dist.all_reduce(tg)
            grad_err = max(float((x.grad.double() / world - y.grad[mine]).abs().max())
                           for x, y in ((la, ra), (lp, rp), (ln, rn)))
            res[backend] = dict(loss_err=abs(float(mean) / world - float(want)), loss=float(want), grad_err=grad_err,
                                t_err=abs(float(tg) / world - float(t2.grad)),
                                scale=max(float(y.grad.abs().max()) for y in (ra, rp, rn)))
        out.put(res)


def test_gist_gather_is_the_global_smoothed_loss(tmp_path):
    results = run_ranks(_gather_worker, 2, tmp_path, [6, 4], timeout=240)
    for r in results:
        for backend in ("torch", "reference", "triton"):
            e = r[backend]
            tol = 1e-12 if backend != "triton" else 2e-5
            assert e["loss"] > 0.1 and e["scale"] > 1e-3, (r["rank"], backend, e)
            assert e["loss_err"] < tol * max(1.0, e["loss"]), (backend, e)
            assert e["grad_err"] < tol * max(1.0, e["scale"]) * 10, (backend, e)
            assert e["t_err"] < tol * 100, (backend, e)
            assert math.isfinite(e["t_err"])
