"""Matryoshka levels (``matryoshka_dims`` / ``matryoshka_weights``) on every InfoNCE-family loss and
CoSENT against the definition written here: ``sum_k w_k loss(F.normalize(x[..., :d_k]))`` with the plain
loss on the reference backend, float64, loss and every gradient (temperature / logit scale included),
on one row chunk and on many; the per-level losses; K = 1; the argument errors; no N x M tensor; the
routes that are not the one-pass PyTorch path (compile, gather over gloo, autocast, backend='triton')."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_memory import LargestTensor

import fused_contrastive as fc
from fused_contrastive import core
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from tests._ranks import gloo_rank, run_ranks

F64 = torch.float64
DIMS = [8, 3, 13, 5]  # unsorted; 13 = D (the full size), 3 and 5 off any tile edge
WEIGHTS = [1.0, 0.5, 2.0, -0.25]


def _shrink(x, d):
    return None if x is None else F.normalize(x[..., :d], dim=-1, eps=1e-12)


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _inputs(n=7, d=13):
    """name -> (loss fn, embedding tensors, other kwargs, temperature keyword or None)."""
    q, k, p, ng = _r(n, d, seed=1), _r(n + 4, d, seed=2), _r(n, d, seed=3), _r(n, d, seed=4)
    f = _r(n, 2, d, seed=5)
    lab = torch.tensor([0, 1, 0, 2, 1, 2, 0])[:n]
    tgt = torch.tensor([0, 3, 2, 10, 1, 5, 4])[:n]
    tgt_ign = tgt.clone()
    tgt_ign[2] = -100
    return {
        "info_nce": (fc.info_nce, [q, k], dict(target=tgt), "temperature"),
        "info_nce_ignore": (fc.info_nce, [q, k], dict(target=tgt_ign), None),
        "info_nce_self": (fc.info_nce, [q, None], dict(target=(torch.arange(n) + 1) % n), None),
        "info_nce_symmetric": (fc.info_nce, [q, p], dict(symmetric=True), "temperature"),
        "clip": (fc.clip_loss, [q, p], dict(), "logit_scale"),
        "simcse_2view": (fc.simcse_loss, [q, p], dict(), "temperature"),
        "simcse_interleaved": (fc.simcse_loss, [_r(2 * n, d, seed=6)], dict(), None),
        "simcse_sup": (fc.simcse_sup_loss, [q, p, ng], dict(hard_negative_weight=0.3), "temperature"),
        "simcse_sup_no_neg": (fc.simcse_sup_loss, [q, p], dict(), None),
        "supcon_out": (fc.supcon_loss, [f], dict(labels=lab), "temperature"),
        "supcon_in": (fc.supcon_loss, [f], dict(labels=lab, variant="in"), "temperature"),
        "supcon_simclr": (fc.supcon_loss, [f], dict(), None),
        "supcon_one": (fc.supcon_loss, [f], dict(labels=lab, contrast_mode="one"), None),
        "supcon_mask": (fc.supcon_loss, [f], dict(mask=(lab[:, None] == lab[None]).to(F64) * 0.5), None),
        "supcon_queue": (lambda x, qu, **kw: fc.supcon_loss(x, queue=qu, **kw), [f, _r(4, d, seed=7)],
                         dict(labels=lab, queue_labels=torch.tensor([0, 1, 2, 3])), None),
        "dscl": (fc.dscl_loss, [f], dict(labels=lab), "temperature"),
        "cosent": (fc.cosent_loss, [q, p], dict(labels=torch.rand(n, generator=torch.Generator().manual_seed(8),
                                                                   dtype=F64)), "scale"),
    }


CASES = list(_inputs())
TEMPS = {"temperature": 0.1, "logit_scale": 10.0, "scale": 20.0}


def _call(name, reduction, route, tensor_temp: bool):
    """(value, gradients) of case ``name``: route "ours" (matryoshka_dims on the torch backend) or "def"
    (the definition: the plain reference loss per level on truncated, re-normalised inputs)."""
    fn, xs, kw, tkey = _inputs()[name]
    xs = [x.clone().requires_grad_() if x is not None else None for x in xs]
    kw = dict(kw)
    t = None
    if tkey is not None:
        t = torch.tensor(TEMPS[tkey], dtype=F64, requires_grad=True) if tensor_temp else TEMPS[tkey]
        kw[tkey] = t
    if name != "cosent":
        kw["reduction"] = reduction
    if route == "ours":
        out = fn(*xs, backend="torch", matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS, **kw)
    else:
        out = sum(w * fn(*[_shrink(x, d) for x in xs], backend="reference", **kw)
                  for d, w in zip(DIMS, WEIGHTS, strict=True))
    wts = torch.linspace(0.5, 1.5, out.numel(), dtype=F64).reshape(out.shape)
    (out * wts).sum().backward()
    grads = [x.grad for x in xs if x is not None and x.grad is not None]
    if isinstance(t, torch.Tensor):
        grads.append(t.grad)
    return out.detach(), grads


@pytest.mark.parametrize("chunks", ["one", "many"])
@pytest.mark.parametrize("name,reduction", [(c, r) for c in CASES for r in ("mean", "sum", "none")
                                            if c != "cosent" or r == "mean"])  # cosent: no reduction argument
def test_levels_equal_the_definition(name, reduction, chunks, monkeypatch, route):
    if chunks == "many":  # a tile of 24 elements: one or two rows per chunk
        route(TILE_ELEMENTS="24")
    for tensor_temp in (False, True):
        got, g_got = _call(name, reduction, "ours", tensor_temp)
        want, g_want = _call(name, reduction, "def", tensor_temp)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert len(g_got) == len(g_want) > 0
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", ["info_nce", "supcon_in", "clip", "cosent"])
def test_per_level_losses_are_each_levels_loss(name):
    fn, xs, kw, tkey = _inputs()[name]
    if tkey is not None:
        kw[tkey] = TEMPS[tkey]
    loss, per = fn(*xs, backend="torch", matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS,
                   return_level_losses=True, **kw)
    assert per.shape == (len(DIMS),) and not per.requires_grad
    for i, d in enumerate(DIMS):  # in the order the dims were given
        torch.testing.assert_close(per[i], fn(*[_shrink(x, d) for x in xs], backend="reference", **kw),
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, sum(w * v for w, v in zip(WEIGHTS, per, strict=True)), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("name", ["info_nce", "simcse_interleaved", "supcon_out", "dscl", "clip"])
def test_one_level_at_full_size_is_the_plain_loss(name):
    fn, xs, kw, tkey = _inputs()[name]
    if tkey is not None:
        kw[tkey] = TEMPS[tkey]
    xs = [x * 3.0 for x in xs]  # not unit rows: the level's normalisation is the loss's
    d = xs[0].shape[-1]
    for be in ("torch", "reference"):  # the plain loss itself: bit for bit
        got, per = fn(*xs, backend=be, matryoshka_dims=[d], return_level_losses=True, **kw)
        plain = fn(*xs, backend=be, **kw)
        assert torch.equal(got, plain) and torch.equal(per, plain[None])
    # normalize=False: the level still re-normalises its prefix (the one-pass path), so it is the
    # normalised plain loss, to round-off
    got = fn(*xs, backend="torch", matryoshka_dims=[d], normalize=False, **kw)
    torch.testing.assert_close(got, fn(*xs, backend="torch", **kw), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(matryoshka_dims=[]), ValueError, "matryoshka_dims must hold at least one"),
    (dict(matryoshka_dims=[4, 0]), ValueError, "matryoshka_dims must be > 0"),
    (dict(matryoshka_dims=[4, 14]), ValueError, "matryoshka_dims must not exceed the embedding dimension 13"),
    (dict(matryoshka_dims=[4, 4]), ValueError, "matryoshka_dims must not repeat"),
    (dict(matryoshka_dims=[4.0]), TypeError, "matryoshka_dims must hold ints"),
    (dict(matryoshka_dims=8), TypeError, "matryoshka_dims must be a sequence"),
    (dict(matryoshka_dims=[4, 8], matryoshka_weights=[1.0]), ValueError, "matryoshka_weights must have one"),
    (dict(matryoshka_dims=[4], matryoshka_weights=[float("nan")]), ValueError, "matryoshka_weights must hold finite"),
    (dict(matryoshka_weights=[1.0]), ValueError, "matryoshka_weights needs matryoshka_dims"),
    (dict(return_level_losses=True), ValueError, "return_level_losses needs matryoshka_dims"),
])
def test_bad_levels_name_the_argument(kw, exc, match):
    q = _r(4, 13, seed=0)
    with pytest.raises(exc, match=match):
        fc.info_nce(q, q + 1, **kw)


def test_no_n_by_m_tensor_with_levels():
    # N x M = 16.8 M elements; a level tile is the plain chunked path's (2 M elements by default)
    n, d = 4096, 32
    q, k = _r(n, d, seed=1).float().requires_grad_(), _r(n, d, seed=2).float().requires_grad_()
    labels = torch.arange(n) % 97
    for fn in (lambda: fc.info_nce(q, k, backend="torch", matryoshka_dims=[32, 16, 8, 4]),
               lambda: fc.supcon_loss(torch.stack([q, k], 1), labels, backend="torch", matryoshka_dims=[32, 16],
                                      reduction="none").sum(),
               lambda: fc.clip_loss(q, k, 10.0, backend="torch", matryoshka_dims=[32, 8])):
        with LargestTensor() as probe:
            fn().backward()
        assert probe.largest <= n * n // 8, f"largest tensor {probe.largest} elements from {probe.op}"
        q.grad = k.grad = None


def test_core_levels_take_any_upstream_gradient():
    # the eager route's gradients are for go = alpha * weights; another upstream gradient recomputes
    a, b = _r(6, 10, seed=1).requires_grad_(), _r(9, 10, seed=2).requires_grad_()
    tgt = torch.tensor([0, 2, 4, 6, 8, 1])
    args = (CoreSpec(), CoreData(target=tgt), Coeffs(lse=1.0, tgt=1.0), True)
    out = core.run("torch", a, b, 5.0, *args, levels=((4, 10), (1.0, 1.0)))
    out[0].backward()  # level 4 alone
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    core.run("torch", a2[:, :4], b2[:, :4], 5.0, *args).backward()
    torch.testing.assert_close(a.grad, a2.grad, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-12, atol=1e-13)


def test_core_levels_on_triton_run_the_matryoshka_kernels_without_a_warning():
    a, b = _r(5, 8, seed=1), _r(5, 8, seed=2)
    args = (CoreSpec(), CoreData(target=torch.arange(5)), Coeffs(lse=1.0, tgt=1.0), True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = core.run("triton", a.float(), b.float(), 5.0, *args, levels=((3, 8), (1.0, 2.0)))
    assert got.dtype == torch.float32  # the kernels' output, not the float64 PyTorch pass
    torch.testing.assert_close(got.double(), core.run("torch", a, b, 5.0, *args, levels=((3, 8), (1.0, 2.0))),
                               rtol=1e-5, atol=1e-5)


def test_compiled_levels_equal_eager():
    q, k = _r(12, 16, seed=1), _r(12, 16, seed=2)

    def step(q, k):
        return fc.info_nce(q, k, backend="torch", matryoshka_dims=[16, 8, 4], matryoshka_weights=[1.0, 0.5, 0.5])

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (12, 9):
        qa, ka = q[:n].clone().requires_grad_(), k[:n].clone().requires_grad_()
        qb, kb = q[:n].clone().requires_grad_(), k[:n].clone().requires_grad_()
        got = compiled(qa, ka)
        got.backward()
        want = step(qb, kb)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(qa.grad, qb.grad, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-suffix"])
def test_autocast_training_step_with_levels(backend, monkeypatch, route):
    # bf16 embeddings from an autocast encoder: the one-pass loss (the torch pass, or the Matryoshka kernels
    # under the interpreter, with their own backward or the suffix backward) against the definition on the
    # same bf16 embeddings (float32 math in both), and the encoder's gradient through the same bf16 backward
    if backend == "triton-suffix":
        route(MATRYOSHKA_ROUTE="suffix")
        backend = "triton"
    torch.manual_seed(0)
    enc = torch.nn.Linear(24, 16)
    x, y = torch.randn(32, 24), torch.randn(32, 24)
    grads = []
    for route in ("ours", "def"):
        enc.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k = enc(x), enc(y)
            assert q.dtype == torch.bfloat16
            if route == "ours":
                loss = fc.info_nce(q, k, matryoshka_dims=[16, 8, 4], backend=backend)
            else:
                loss = sum(fc.info_nce(_shrink(q.float(), d), _shrink(k.float(), d), backend="reference")
                           for d in (16, 8, 4))
        loss.backward()
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        grads.append((loss.detach(), enc.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    scale = grads[1][1].abs().max()
    assert scale > 1e-3
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=2e-2 * float(scale))


def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:

    with gloo_rank(rank, world, init, out):
        n, off = sum(sizes), sum(sizes[:rank])
        q, k = _r(n, 12, seed=1), _r(n, 12, seed=2)
        lab = torch.arange(n) % 3
        res = {"rank": rank}
        for name, fn in {
            "info_nce": lambda a, b, **kw: fc.info_nce(a, b, **kw),
            "clip": lambda a, b, **kw: fc.clip_loss(a, b, 10.0, **kw),
            "supcon": lambda a, b, **kw: fc.supcon_loss(torch.stack([a, b], 1), kw.pop("labels"), **kw),
        }.items():
            extra = {"labels": lab[off:off + sizes[rank]]} if name == "supcon" else {}
            mine = slice(off, off + sizes[rank])
            qa, ka = q[mine].clone().requires_grad_(), k[mine].clone().requires_grad_()
            loss = fn(qa, ka, backend="torch", gather=True, matryoshka_dims=[12, 6, 3], matryoshka_weights=[1, 2, 3],
                      **extra)
            loss.backward()
            qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
            extra = {"labels": lab} if name == "supcon" else {}
            want = sum(w * fn(_shrink(qr, d), _shrink(kr, d), backend="reference", **dict(extra))
                       for d, w in ((12, 1), (6, 2), (3, 3)))
            want.backward()
            res[name] = (float(loss), float(want), bool(torch.allclose(qa.grad, qr.grad[off:off + sizes[rank]] * world,
                                                                        rtol=1e-10, atol=1e-12)))
            if name != "supcon":  # the Matryoshka kernels (interpreter) under gather, float32
                qt, kt = q[mine].float().requires_grad_(), k[mine].float().requires_grad_()
                loss = fn(qt, kt, backend="triton", gather=True, matryoshka_dims=[12, 6, 3],
                          matryoshka_weights=[1, 2, 3])
                loss.backward()
                res[name + "_triton"] = (float(loss), float(want),
                                         bool(torch.allclose(qt.grad.double(), qr.grad[mine] * world, rtol=1e-4,
                                                             atol=1e-5)))
                # bf16 rows on the suffix backward (16-bit only), against the float64 definition on the
                # same bf16 rows
                os.environ["FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE"] = "suffix"
                try:
                    qb, kb = q.bfloat16(), k.bfloat16()
                    qt, kt = qb[mine].clone().requires_grad_(), kb[mine].clone().requires_grad_()
                    loss = fn(qt, kt, backend="triton", gather=True, matryoshka_dims=[12, 6, 3],
                              matryoshka_weights=[1, 2, 3])
                    loss.backward()
                finally:
                    del os.environ["FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE"]
                qr, kr = qb.double().requires_grad_(), kb.double().requires_grad_()
                want16 = sum(w * fn(_shrink(qr, d), _shrink(kr, d), backend="reference")
                             for d, w in ((12, 1), (6, 2), (3, 3)))
                want16.backward()
                ref = qr.grad[mine] * world
                res[name + "_suffix"] = (float(loss), float(want16),
                                         float((qt.grad.double() - ref).abs().max() / ref.abs().max()))
        out.put(res)


def test_gather_with_levels_two_ranks_uneven(tmp_path):
    sizes = [5, 3]
    results = run_ranks(_gather_worker, 2, tmp_path, sizes, timeout=180)
    for r in results:
        assert "error" not in r, r.get("error")
        for name in ("info_nce", "clip", "supcon"):
            got, want, grads = r[name]
            # a rank returns its local share times world: the mean over ranks is the global loss
            assert grads, (name, r["rank"])
        mean = {name: sum(x[name][0] for x in results) / 2 for name in ("info_nce", "clip", "supcon")}
        for name, v in mean.items():
            assert abs(v - r[name][1]) < 1e-10, (name, v, r[name][1])
        for name in ("info_nce_triton", "clip_triton"):
            assert r[name][2], (name, r["rank"])
            v = sum(x[name][0] for x in results) / 2
            assert abs(v - r[name][1]) < 1e-5 * max(1.0, abs(r[name][1])), (name, v, r[name][1])
        for name in ("info_nce_suffix", "clip_suffix"):  # bf16 on the suffix backward (the bf16 gradient
            assert r[name][2] <= 6e-2, (name, r["rank"], r[name][2])  # tolerance of test_triton_matryoshka.TOLS)
            v = sum(x[name][0] for x in results) / 2
            assert abs(v - r[name][1]) < 1e-2 * max(1.0, abs(r[name][1])), (name, v, r[name][1])


def test_triton_backend_takes_the_levels_in_one_pass(monkeypatch):
    # under the interpreter (conftest): backend="triton" with levels runs the Matryoshka kernels once (no
    # per-level calls of the plain loss), equal to the definition
    from fused_contrastive.core.matryoshka import triton_levels as TM

    calls = []
    real = TM.run
    monkeypatch.setattr(TM, "run", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    q, k = _r(9, 16, seed=1).float(), _r(9, 16, seed=2).float()
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = fc.info_nce(qa, ka, backend="triton", matryoshka_dims=[16, 4, 8], matryoshka_weights=[1.0, 2.0, 0.5])
    got.backward()
    assert calls == [(4, 8, 16)]
    qb, kb = q.clone().requires_grad_(), k.clone().requires_grad_()
    want = sum(w * fc.info_nce(_shrink(qb, d), _shrink(kb, d), backend="reference")
               for d, w in ((16, 1.0), (4, 2.0), (8, 0.5)))
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qa.grad, qb.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ka.grad, kb.grad, rtol=1e-4, atol=1e-5)


def test_module_forms_take_the_levels():
    q, k = _r(6, 12, seed=1), _r(6, 12, seed=2)
    m = fc.nn.InfoNCELoss(0.1, matryoshka_dims=[12, 3], matryoshka_weights=[1.0, 2.0])
    want = sum(w * fc.info_nce(_shrink(q, d), _shrink(k, d), temperature=0.1, backend="reference")
               for d, w in ((12, 1.0), (3, 2.0)))
    torch.testing.assert_close(m(q, k), want, rtol=1e-12, atol=1e-12)
    f, lab = _r(4, 2, 12, seed=3), torch.tensor([0, 1, 0, 1])
    s = fc.nn.SupConLoss(0.1, matryoshka_dims=[6])
    torch.testing.assert_close(s(f, lab), fc.supcon_loss(_shrink(f, 6), lab, temperature=0.1, backend="reference"),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="matryoshka_dims must not repeat"):
        fc.nn.InfoNCELoss(0.1, matryoshka_dims=[8, 8])
    with pytest.raises(ValueError, match="matryoshka_weights needs matryoshka_dims"):
        fc.nn.SimCSELoss(matryoshka_weights=[1.0])
    with pytest.raises(ValueError, match="must not exceed the embedding dimension 12"):  # D is known at forward
        fc.nn.InfoNCELoss(0.1, matryoshka_dims=[16])(q, k)
