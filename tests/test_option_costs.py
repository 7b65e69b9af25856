"""bench/option_costs.py: its contenders alternate within each repeat, it takes the medians, and its tables
cover every benchmark case that takes the options (found here from the functions' signatures)."""

from __future__ import annotations

import importlib.util
import inspect
import statistics
from pathlib import Path

import torch

from fused_contrastive.testing import BENCH_CASES

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("option_costs", ROOT / "bench" / "option_costs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_medians_interleave_the_contenders_and_take_each_ones_median():
    oc = _script()
    order: list[str] = []
    durations = {"a": iter([9.0, 1.0, 5.0, 3.0]), "b": iter([7.0, 2.0, 4.0, 8.0])}

    def contender(name):
        def run(clock):
            order.append(name)
            return next(durations[name])
        return run

    med = oc.medians({"a": contender("a"), "b": contender("b")}, repeats=3, clock=lambda: 0.0)
    assert order == ["a", "b"] * 4  # one warm-up round, then a, b alternate in every repeat
    assert med == {"a": statistics.median([1.0, 5.0, 3.0]), "b": statistics.median([2.0, 4.0, 8.0])}


def test_a_step_times_one_forward_and_backward_on_fresh_leaves():
    oc = _script()
    x = torch.randn(4, 3)
    seen = []

    def fn(a):
        seen.append(a)
        return (a * a).sum()

    ticks = iter([10.0, 12.5])
    assert oc.step(fn, (x,))(lambda: next(ticks)) == 2.5
    (leaf,) = seen
    assert leaf is not x and leaf.requires_grad and torch.equal(leaf.grad, 2 * x)
    assert x.grad is None


def test_the_options_table_covers_every_case_that_takes_the_options_on_both_paths():
    oc = _script()
    rows = list(oc.option_rows(32, 8))
    want = {c.name for c in BENCH_CASES if "label_smoothing" in inspect.signature(c.fn).parameters}
    got = {name for name, path, _ in rows if path in ("dense", "chunked")}
    assert got == want and len(want) >= 5
    assert {(name, path) for name, path, _ in rows if name == "gist"} == {("gist", "merged")}
    for name, _, steps in rows:
        takes_tau = "tau_plus" in inspect.signature(
            {c.name: c.fn for c in BENCH_CASES}.get(name, lambda: None)).parameters
        assert ("tau_plus=0.1" in steps) == takes_tau, name
        assert "plain" in steps and "label_smoothing=0.1" in steps


def test_the_script_runs_both_tables_on_a_tiny_problem(capsys):
    oc = _script()
    oc.main(["--n", "32", "--d", "8", "--k", "2", "--repeats", "1", "--only", "info_nce", "siglip"])
    out = capsys.readouterr().out
    assert "info_nce                           dense" in out and "info_nce                           chunked" in out
    assert "info_nce + row_negatives" in out and "siglip + unique groups" in out
    assert "clip " not in out  # --only filters the options table
