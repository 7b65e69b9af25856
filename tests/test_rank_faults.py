"""Ranks that disagree under ``gather=``: every rank raises promptly, naming the argument (issue 39).

One spawn of 2 and one of 3 gloo ranks (a 30 s process-group timeout, so a hang fails the test instead
of stalling it); the last rank gets a bad or a different argument in each case, the others the same
good call. Every rank must raise within 10 s: a rank's own argument error (a bad ``matryoshka_dims``, a
``backend`` typo, an unknown keyword) is raised there and announced to the others (a ``ValueError``
naming the failing rank); valid calls that differ between ranks (reduction, Matryoshka levels and
weights, GIST options, mask vs labels, negatives on some ranks only, SupCon's base temperature, a
learnable temperature's value, another loss) raise the same ``ValueError`` on every rank, naming the
argument and which ranks passed what. Afterwards the ranks are still in step, and a gathered call on
``@leveled``'s per-level route agrees once, not once per level.
"""

from __future__ import annotations

import torch

import fused_contrastive as fc
from tests._ranks import gloo_rank, run_ranks, timed_calls

D = 8


def _cases(rank: int, world: int):
    """(name, call, the argument every rank's error must name, whether the odd rank fails locally)."""
    g = torch.Generator().manual_seed(rank)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    odd = rank == world - 1
    n = 3 + rank  # uneven local batches
    q, k = r(n, D), r(n, D)
    a, p, ng = r(n, D), r(n, D), r(n, D)
    guide = (r(n, 5), r(n, 5))
    guide_d = (r(n, D), r(n, D), r(n, D))  # the guide's D equals the model's (was a gloo abort)
    feats, lab = r(n, 2, D), torch.arange(n) % 2
    n_glob = sum(3 + i for i in range(world))
    mask = (torch.rand(n, n_glob, generator=g) < 0.5).double()

    def gist(**kw):
        base = dict(guide=guide, temperature=0.05, gather=True)
        return fc.gist_loss(a, p, **{**base, **kw})

    return [
        ("bad matryoshka_dims", lambda: fc.info_nce(q, k, gather=True, matryoshka_dims=[4, 99 if odd else 2]),
         "matryoshka_dims", True),
        ("backend typo", lambda: fc.info_nce(q, k, gather=True, backend="tourch" if odd else "torch"),
         "backend", True),
        ("unknown keyword", lambda: fc.simcse_loss(a, p, gather=True, **({"temprature": 0.1} if odd else {})),
         "temprature", True),
        ("gist reduction none", lambda: gist(reduction="none" if odd else "mean"), "reduction", False),
        ("supcon mask vs labels",
         lambda: fc.supcon_loss(feats, mask=mask, gather=True) if odd else fc.supcon_loss(feats, lab, gather=True),
         "mask", False),
        ("gist negatives on one rank",
         lambda: fc.gist_loss(a, p, ng, guide=guide_d, gather=True) if odd
         else fc.gist_loss(a, p, guide=guide_d[:2], gather=True),
         "negatives", False),
        ("matryoshka dims differ", lambda: fc.info_nce(q, k, gather=True, matryoshka_dims=[8, 2 if odd else 4]),
         "matryoshka_dims", False),
        ("matryoshka weights differ",
         lambda: fc.clip_loss(a, p, 10.0, gather=True, matryoshka_dims=[8, 4],
                              matryoshka_weights=[1.0, 0.5 if odd else 1.0]),
         "matryoshka_weights", False),
        ("matryoshka level count", lambda: gist(matryoshka_dims=[8, 4, 2] if odd else [8, 4]),
         "matryoshka_dims", False),
        ("gist margin", lambda: gist(margin=0.1 if odd else 0.0), "margin", False),
        ("gist margin_strategy", lambda: gist(margin_strategy="relative" if odd else "absolute"),
         "margin_strategy", False),
        ("gist contrast_anchors", lambda: gist(contrast_anchors=not odd), "contrast_anchors", False),
        ("sum vs mean", lambda: fc.info_nce(q, k, gather=True, reduction="sum" if odd else "mean"),
         "reduction", False),
        ("supcon base_temperature",
         lambda: fc.supcon_loss(feats, lab, gather=True, base_temperature=0.1 if odd else 0.07),
         "base_temperature", False),
        ("learnable temperature value",
         lambda: fc.simcse_loss(a, p, gather=True, temperature=torch.tensor(0.06 if odd else 0.05,
                                                                             requires_grad=True)),
         "temperature", False),
        ("another loss", lambda: (fc.info_nce if odd else fc.simcse_loss)(a, p, gather=True), "info_nce", False),
    ]


def _worker(rank: int, world: int, init: str, out) -> None:
    import fused_contrastive.distributed as fd

    with gloo_rank(rank, world, init, out, timeout=30):
        res = {"rank": rank, "cases": timed_calls((name, call) for name, call, _, _ in _cases(rank, world))}
        # still in step; the per-level route (GIST, 3 levels) and the one-pass route agree once per call
        exchanges = []
        real = fd._exchange

        def counted(*args, **kwargs):
            exchanges.append(1)
            return real(*args, **kwargs)

        fd._exchange = counted
        g = torch.Generator().manual_seed(rank)
        n = 2 + rank
        a, p = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
        guide = (torch.randn(n, 5, generator=g), torch.randn(n, 5, generator=g))
        t = torch.tensor(0.05, requires_grad=True)
        loss = fc.gist_loss(a, p, guide=guide, temperature=t, gather=True, matryoshka_dims=[8, 4, 2])
        loss.backward()
        res["gist_exchanges"] = len(exchanges)
        exchanges.clear()
        fc.info_nce(a, p, gather=True, matryoshka_dims=[8, 4], matryoshka_weights=[1.0, 0.5])
        res["info_nce_exchanges"] = len(exchanges)
        fd._exchange = real
        res["finite"] = bool(torch.isfinite(loss)) and t.grad is not None
        out.put(res)


def _check(results: list[dict], world: int) -> None:
    odd = world - 1
    for name, _, arg, local in _cases(0, world):
        for res in results:
            err, took = res["cases"][name]
            assert err is not None, (world, name, res["rank"], "did not raise")
            kind, text, notes = err
            assert took < 10, (world, name, res["rank"], took)
            full = f"{text}\n{notes}"
            assert arg in full, (world, name, res["rank"], err)
            if local and res["rank"] == odd:  # its own error, with a note: the others were told
                assert "every rank" in notes and f"this is rank {odd}" in notes, (world, name, err)
                continue
            assert kind == "ValueError", (world, name, res["rank"], err)
            assert f"rank {odd}" in text and f"this is rank {res['rank']}" in text, (world, name, res["rank"], err)
            if not local:  # which ranks passed what: the odd one against the others
                healthy = "rank 0" if world == 2 else "ranks 0, 1"
                assert f"on {healthy}" in text and f"on rank {odd}" in text, (world, name, res["rank"], err)
    for res in results:
        assert res["finite"], res
        assert res["gist_exchanges"] == 1 and res["info_nce_exchanges"] == 1, res


def test_disagreeing_ranks_raise_promptly_naming_the_argument(tmp_path):
    for world in (2, 3):
        sub = tmp_path / f"w{world}"
        sub.mkdir()
        _check(run_ranks(_worker, world, sub, timeout=150), world)


def _gathered_losses():
    import fused_contrastive.distributed as fd

    out = []
    for name in dir(fc):
        f = getattr(fc, name)
        w, depth = f, 0
        while w is not None and callable(w):  # an @agreed wrapper keeps its binder in its closure
            cells = getattr(w, "__closure__", None) or ()
            if any(isinstance(c.cell_contents, fd._Binder) for c in cells if c.cell_contents is not None):
                out.append((name, f, depth))
                break
            w, depth = getattr(w, "__wrapped__", None), depth + 1
    return out


def test_every_gathered_loss_digests_its_whole_signature():
    """The agreement's digest binds arguments as ``inspect.Signature.bind`` does (defaults applied,
    ``gather`` left out), for every public loss that takes ``gather=``; a call that does not bind is
    an unknown digest (the call's own TypeError is what that rank reports)."""
    import inspect

    from fused_contrastive.distributed import _UNKNOWN, _Binder, _Digest

    losses = _gathered_losses()
    names = {n for n, _, _ in losses}
    assert {"info_nce", "clip_loss", "simcse_loss", "simcse_sup_loss", "gist_loss", "supcon_loss", "dscl_loss",
            "dcl_loss", "dclw_loss", "cosent_loss", "cosent_loss_from_scores", "siglip_loss"} <= names, names
    # @D.agreed is the outermost decorator (above @leveled: its level checks can raise on one rank)
    assert all(depth == 0 for _, _, depth in losses), losses
    x = torch.randn(4, 3)
    for name, f, _ in losses:
        sig = inspect.signature(f)
        assert "gather" in sig.parameters, name
        required = [p.name for p in sig.parameters.values() if p.default is inspect.Parameter.empty]
        args = tuple(x for _ in required if sig.parameters[_].kind != inspect.Parameter.KEYWORD_ONLY)
        kwargs = {p: x for p in required if sig.parameters[p].kind == inspect.Parameter.KEYWORD_ONLY}
        kwargs["gather"] = True
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        want = [(k, v) for k, v in bound.arguments.items() if k != "gather" and not k.startswith("_")]
        got = _Binder(f)(args, kwargs)
        assert [k for k, _ in got] == [k for k, _ in want], name
        assert all(a is b for (_, a), (_, b) in zip(got, want, strict=True)), name
        assert _Digest(name, _Binder(f), args, {**kwargs, "no_such_option": 1}).head == _UNKNOWN, name
        assert _Digest(name, _Binder(f), args, kwargs).head == _Digest(name, _Binder(f), args, kwargs).head
