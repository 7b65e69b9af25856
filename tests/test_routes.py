"""Every default route has its evidence (fused_contrastive.routes): the committed bench-gpu rows it quotes exist,
agree with their float64 definition, and show the chosen form at least as fast as every alternative (within the
table's TIE); a route without evidence says why it is unmeasured."""

from __future__ import annotations

import functools
import importlib
import json
import os

import pytest

from fused_contrastive import routes as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _rows(file: str) -> dict[tuple, dict]:
    out = {}
    with open(os.path.join(ROOT, file)) as fh:
        for line in fh:
            obj = json.loads(line)
            if "meta" not in obj:
                out[(obj["loss"], obj["n"], obj["d"], obj["contender"])] = obj
    return out


def check_rows(ev: R.Rows, rows: dict[tuple, dict]) -> str | None:
    """None when ``ev`` holds in ``rows``, else what is wrong (the test's verdict, also run on planted rows)."""
    got = {}
    for name in (ev.chosen, *ev.alternatives):
        r = rows.get((ev.loss, ev.n, ev.d, name))
        if r is None:
            return f"no row {ev.loss} N={ev.n} D={ev.d} {name} in {ev.file}"
        if r.get("status") != "ok" or not r.get("agrees"):
            return f"{name}: status {r.get('status')}, agrees {r.get('agrees')}"
        got[name] = r["ms"]
    fastest = min(ev.alternatives, key=got.get)
    if got[ev.chosen] > R.TIE * got[fastest]:
        return (f"{ev.loss} N={ev.n} D={ev.d}: {ev.chosen} {got[ev.chosen]:.3f} ms is slower than {fastest} "
                f"{got[fastest]:.3f} ms by more than the tie {R.TIE}")
    return None


EVIDENCE = [(r, e) for r in R.ROUTES for e in r.evidence]


@pytest.mark.parametrize("route", R.ROUTES, ids=lambda r: f"{r.family}:{r.decision}")
def test_every_route_has_evidence_or_says_why_not(route):
    assert bool(route.evidence) != bool(route.unmeasured), route
    module, _, attr = route.setting.split(" ")[0].split("[")[0].split(",")[0].rpartition(".")
    mod = importlib.import_module(f"fused_contrastive.{module}")
    assert hasattr(mod, attr), f"{route.setting}: fused_contrastive.{module} has no {attr}"


@pytest.mark.parametrize("route,ev", EVIDENCE, ids=[f"{r.family}:{e.file.split('/')[-2] if '/' in e.file else ''}:"
                                                   f"{getattr(e, 'loss', '')}{getattr(e, 'n', '')}"
                                                   for r, e in EVIDENCE])
def test_the_evidence_shows_the_default_wins(route, ev):
    if isinstance(ev, R.Quote):
        with open(os.path.join(ROOT, ev.file)) as fh:
            assert ev.line in fh.read(), f"{ev.file} does not hold {ev.line!r}"
        return
    problem = check_rows(ev, _rows(ev.file))
    assert problem is None, problem


def test_the_check_fails_a_route_whose_alternative_won():
    ev = R.Rows("x", "info_nce", 4096, 768, "a", ("b",))
    ok = {"status": "ok", "agrees": True}
    rows = {("info_nce", 4096, 768, "a"): dict(ok, ms=2.0), ("info_nce", 4096, 768, "b"): dict(ok, ms=1.0)}
    assert "slower than b" in check_rows(ev, rows)
    rows[("info_nce", 4096, 768, "b")]["ms"] = 1.95  # within the tie
    assert check_rows(ev, rows) is None
    rows[("info_nce", 4096, 768, "b")]["agrees"] = False  # a row that disagrees proves nothing
    assert "agrees False" in check_rows(ev, rows)
    del rows[("info_nce", 4096, 768, "a")]
    assert "no row" in check_rows(ev, rows)


def test_the_table_lists_every_route():
    text = R.table()
    assert text.count("\n") == len(R.ROUTES) + 1
    for r in R.ROUTES:
        assert r.decision in text


def test_the_readme_quotes_the_table():
    with open(os.path.join(ROOT, "docs", "gpu-measurements.md")) as fh:  # the README links the routes there
        readme = fh.read()
    begin, end = "<!-- routes table:", "<!-- end of the routes table"
    assert readme[readme.index(begin):readme.index(end)].split("\n", 1)[1].strip() == R.table()


def test_the_one_tile_route_is_what_the_code_takes(monkeypatch):
    import torch

    from fused_contrastive import core

    monkeypatch.delenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", raising=False)
    monkeypatch.delenv("FUSED_CONTRASTIVE_DENSE", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # (a device object: no GPU needed to ask)
    assert core.dense_path(4096, 4096, cuda, col=False)  # the measured win (4096 x 4096 = 2^24)
    assert not core.dense_path(4096, 4097, cuda, col=False)  # past the measured size
    assert not core.dense_path(4096, 4096, cuda, col=True)  # CLIP measured slower there
    assert not core.dense_path(4096, 4096, cpu, col=False)  # the CPU keeps its own tile budget
    monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", "1024")  # an explicit budget wins
    assert not core.dense_path(4096, 4096, cuda, col=False)
