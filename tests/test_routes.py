"""Every default route has its evidence (fused_contrastive.routes): the committed bench-gpu rows it quotes exist,
agree with their float64 definition, and show the chosen form at least as fast as every alternative (within the
table's TIE); a route without evidence says why it is unmeasured."""

from __future__ import annotations

import functools
import importlib
import json
import os

import pytest

from fused_contrastive import routes

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


def check_rows(ev: routes.Rows, rows: dict[tuple, dict]) -> str | None:
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
    if got[ev.chosen] > routes.TIE * got[fastest]:
        return (f"{ev.loss} N={ev.n} D={ev.d}: {ev.chosen} {got[ev.chosen]:.3f} ms is slower than {fastest} "
                f"{got[fastest]:.3f} ms by more than the tie {routes.TIE}")
    return None


EVIDENCE = [(r, e) for r in routes.ROUTES for e in r.evidence]


@pytest.mark.parametrize("route", routes.ROUTES, ids=lambda r: f"{r.family}:{r.decision}")
def test_every_route_has_evidence_or_says_why_not(route):
    assert bool(route.evidence) != bool(route.unmeasured), route
    module, _, attr = route.setting.split(" ")[0].split("[")[0].split(",")[0].rpartition(".")
    mod = importlib.import_module(f"fused_contrastive.{module}")
    assert hasattr(mod, attr), f"{route.setting}: fused_contrastive.{module} has no {attr}"


@pytest.mark.parametrize("route,ev", EVIDENCE, ids=[f"{r.family}:{e.file.split('/')[-2] if '/' in e.file else ''}:"
                                                   f"{getattr(e, 'loss', '')}{getattr(e, 'n', '')}"
                                                   for r, e in EVIDENCE])
def test_the_evidence_shows_the_default_wins(route, ev):
    if isinstance(ev, routes.Quote):
        with open(os.path.join(ROOT, ev.file)) as fh:
            assert ev.line in fh.read(), f"{ev.file} does not hold {ev.line!r}"
        return
    problem = check_rows(ev, _rows(ev.file))
    assert problem is None, problem


def test_the_check_fails_a_route_whose_alternative_won():
    ev = routes.Rows("x", "info_nce", 4096, 768, "a", ("b",))
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
    text = routes.table()
    assert text.count("\n") == len(routes.ROUTES) + 1
    for r in routes.ROUTES:
        assert r.decision in text


def test_the_readme_quotes_the_table():
    with open(os.path.join(ROOT, "docs", "gpu-measurements.md")) as fh:  # the README links the routes there
        readme = fh.read()
    begin, end = "<!-- routes table:", "<!-- end of the routes table"
    assert readme[readme.index(begin):readme.index(end)].split("\n", 1)[1].strip() == routes.table()


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


# --- the switchboard: the one reader of the FUSED_CONTRASTIVE_* variables --------------------------------------


def test_every_variable_the_code_names_is_a_setting():
    """The variables named anywhere in the package, the C library or the docs are the switchboard's rows (and
    each row is named somewhere besides routes.py: none is dead)."""
    import re
    import subprocess

    out = subprocess.run(["git", "grep", "-ohE", r"FUSED_CONTRASTIVE_[A-Z_]+[A-Z]", "--", "fused_contrastive", "csrc",
                          "docs", "README.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    named = set(re.findall(r"FUSED_CONTRASTIVE_(\w+)", out)) - {"H"}  # FUSED_CONTRASTIVE_H: the C header's guard
    assert named == set(routes.SETTINGS), (sorted(named - set(routes.SETTINGS)), sorted(set(routes.SETTINGS) - named))


@pytest.mark.parametrize("name,raw,want", [
    ("TRITON_PATH", None, "auto"), ("TRITON_PATH", "panel", "panel"), ("TRITON_PATH", " fused ", "fused"),
    ("TILE_ELEMENTS", None, None), ("TILE_ELEMENTS", "4096", 4096), ("TILE_ELEMENTS", "", None),
    ("DENSE", None, True), ("DENSE", "0", False), ("DENSE", "1", True), ("DENSE", "", True),
    ("TRITON_POISON", None, False), ("TRITON_POISON", "1", True), ("TRITON_POISON", "0", False),
    ("AOT_LIB", None, None), ("AOT_LIB", "", None), ("AOT_LIB", "/x/lib.so", "/x/lib.so"),
    ("BACKEND", "", "auto"), ("BACKEND", "torch", "torch"), ("EPI_FORM", None, None), ("EPI_FORM", "tma", "tma"),
])
def test_a_setting_reads_the_environment(monkeypatch, name, raw, want):
    var = "FUSED_CONTRASTIVE_" + name
    if raw is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, raw)
    assert routes.setting(name) == want


@pytest.mark.parametrize("name,raw,allowed", [
    ("TRITON_PATH", "pannel", "one of 'auto', 'panel', 'fused'"),
    ("MATRYOSHKA_ROUTE", "fast", "one of 'auto', 'calls', 'kernels', 'suffix'"),
    ("TILE_ELEMENTS", "abc", "a positive integer (>= 1)"), ("PANEL_BUDGET", "-5", "a positive integer (>= 1)"),
    ("BACKEND", "cuda", "one of 'auto', 'torch', 'triton', 'reference'"),
])
def test_one_error_text_names_the_variable_and_what_it_takes(monkeypatch, name, raw, allowed):
    monkeypatch.setenv("FUSED_CONTRASTIVE_" + name, raw)
    want = f"environment variable FUSED_CONTRASTIVE_{name} must be {allowed}, got {raw!r}"
    with pytest.raises(ValueError) as e:
        routes.setting(name)
    assert str(e.value) == want


def test_override_wins_over_the_environment_and_is_undone(monkeypatch):
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "fused")
    with routes.override(TRITON_PATH="panel", PANEL_BUDGET=4096, DENSE=False):
        assert (routes.setting("TRITON_PATH"), routes.setting("PANEL_BUDGET"), routes.setting("DENSE")) == (
            "panel", 4096, False)
        assert routes.raw("TRITON_PATH") == "panel"
        with routes.override(TRITON_PATH=None):  # None: the default, whatever the environment says
            assert routes.setting("TRITON_PATH") == "auto"
        assert routes.setting("TRITON_PATH") == "panel"
    assert (routes.setting("TRITON_PATH"), routes.setting("PANEL_BUDGET"), routes.setting("DENSE")) == (
        "fused", None, True)
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_TRITON_PATH must be one of"):
        with routes.override(TRITON_PATH="pannel"):
            pass
    with pytest.raises(KeyError, match="FUSED_CONTRASTIVE_PATH is not a setting"):
        routes.setting("PATH")


def test_an_override_routes_a_loss(monkeypatch):
    """The switchboard is what the code reads: an override of DENSE sends a small problem through the chunked
    path (its tile budget then bounds the largest tensor), the environment left alone; the value is the float64
    definition's either way."""
    import torch
    from test_memory import LargestTensor

    import fused_contrastive as fc

    monkeypatch.delenv("FUSED_CONTRASTIVE_DENSE", raising=False)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    want = torch.nn.functional.cross_entropy(torch.nn.functional.normalize(q.double(), dim=1)
                                             @ torch.nn.functional.normalize(k.double(), dim=1).T / 0.05,
                                             torch.arange(64))
    with LargestTensor() as dense:  # 64 x 64 logits fit the default tile: the one-tile path
        got_dense = fc.info_nce(q, k, backend="torch")
    with routes.override(DENSE=False, TILE_ELEMENTS=256), LargestTensor() as chunked:  # chunks of 4 x 64 logits
        got_chunked = fc.info_nce(q, k, backend="torch")
    torch.testing.assert_close(got_dense.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_chunked.double(), want, rtol=1e-5, atol=1e-6)
    assert chunked.largest < 64 * 64 <= dense.largest, (chunked.largest, dense.largest)
    assert os.environ.get("FUSED_CONTRASTIVE_DENSE") is None


def test_a_hook_has_no_variable_and_is_set_by_override_only(monkeypatch):
    """The in-process hooks (fixed panel heights, program counts) read no environment variable: only an
    override sets them, and the code reads them (a fixed panel height is the panel count the sweep runs)."""
    import torch

    from fused_contrastive.core.triton_shared import panels

    monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_ROWS", "64")  # not a variable of the package: ignored
    assert routes.setting("PANEL_ROWS") is None and routes.raw("PANEL_ROWS") == ""
    want = panels.panel_rows(4096, 4096, 64, torch.bfloat16, True)
    assert want > 100
    with routes.override(PANEL_ROWS=100):
        assert routes.setting("PANEL_ROWS") == 100
        assert panels.panel_rows(4096, 4096, 64, torch.bfloat16, True) == 100
    assert panels.panel_rows(4096, 4096, 64, torch.bfloat16, True) == want
    with pytest.raises(ValueError, match="the switchboard's hook PANEL_ROWS must be a positive integer"):
        with routes.override(PANEL_ROWS=0):
            pass
