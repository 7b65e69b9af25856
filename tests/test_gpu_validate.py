"""``check --gpu-validate`` (fused_contrastive/gpu_validate.py), run here on the CPU under the Triton
interpreter at tiny shapes: the same code path the first GPU run takes (parity against the float64
oracle with NaN-filled outputs and scratch, bitwise reruns, fp16 against fp32, timings), and planted
faults (a wrong oracle, a kernel output row left unwritten) that must turn the verdict to FAIL.

Shapes: N = 70 with D = 20 (two row blocks of 64, the second ragged, one D chunk: the resident backward)
and N = 37 with D = 130 (D_PAD = 256: the streaming backward with the fp32 scratch, one ragged row
block); the focused tests take N = 37 with D = 20 (``SMALL``). The bitwise reruns
take the small one: the interpreter runs programs one after another, so here they check the wiring (two
runs compared, a FAIL when they differ: ``test_runs_that_differ_fail_the_determinism_check``), not the GPU's ordering.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fused_contrastive import __main__ as cli
from fused_contrastive import gpu_validate as GV
from fused_contrastive.core.triton_shared import launch as TL

SHAPES = ((70, 20), (37, 130))
SMALL = ((37, 20),)
MULTI = 16  # forced panel height of the multi-panel parity runs: 37 rows -> 3 panels, 70 -> 5


CORE = ("info_nce", "simcse", "clip")


def _plan(**kw) -> GV.Plan:
    base = dict(losses=CORE, parity_shapes=SHAPES, dtypes=(torch.bfloat16,), regimes=("flat",),
                determinism_shape=(37, 20), determinism_runs=2, fp16_shape=(8, 300, 24), timing_sizes=(40,),
                timing_d=16, timing_repeats=1, ncu=False, multi_panel_rows=MULTI, budget_s=None, jobs=1,
                option_losses=(), st_cached=False, secondary_regimes=None, secondary_dtypes=None, gluon_cases=())
    base.update(kw)
    return GV.Plan(**base)


def test_checks_pass_on_the_interpreter(capsys):
    rep = GV.validate("cpu", _plan(), allow_cpu=True)
    out = capsys.readouterr().out
    assert rep.ok, out
    checks = [r.check for r in rep.results]
    # 3 losses x 4 runs (3 triton paths: fused, panel by the epilogue GEMM, panel by cuBLAS products; + the
    # panel path in panels of 16 rows) x shapes x dtypes; reruns per loss and run; fp16 per path; the GEMM
    # route of bf16 (the CPU's: upcast)
    assert sum(c.startswith("parity") for c in checks) == 3 * 4 * len(SHAPES)
    assert {c.split()[2] for c in checks if c.startswith("parity")} == {"fused", "panel", "panel-cublas",
                                                                       f"panel(P={MULTI})"}
    assert sum(c.startswith("determinism") for c in checks) == 3 * 4
    assert [r.detail for r in rep.results if r.check.startswith("cuBLAS")] == ["mm upcast, addmm upcast"]
    assert "verdict table:" in out
    assert sum(c.startswith("fp16 vs fp32") for c in checks) == 3
    assert "verdict: PASS" in out
    # every timing was measured (nothing ran out of memory here) and auto's preference is one of ours
    assert all(v is not None and v > 0 for row in rep.timings.values() for v in row.values())
    assert set(rep.prefer) == set(CORE)
    assert set(rep.prefer.values()) <= {"triton/fused", "triton/panel", "triton/panel-cublas"}
    # each timing row names the textbook ratio (the model has no row for N = 40: said so)
    timing_rows = [r.detail for r in rep.results if r.check.startswith("timing")]
    assert len(timing_rows) == 3 and all("triton / textbook" in d and "no model row" in d for d in timing_rows)


def test_every_kernel_family_in_the_sharp_regime(capsys):
    """Every Triton kernel family (the core op on both paths, SupCon positives, CoSENT, SigLIP, GIST, the
    Matryoshka kernels and their per-level route) at temperature 0.01 with correlated positives in 16 bits,
    each row seeing its own kernels launch."""
    rep = GV.validate("cpu", _plan(losses=GV.LOSSES, parity_shapes=((48, 64),), dtypes=(torch.bfloat16,),
                                   regimes=("sharp",), determinism_runs=0, fp16_shape=None, timing_sizes=()),
                      allow_cpu=True)
    out = capsys.readouterr().out
    assert rep.ok, out
    rows = [r.check for r in rep.results if r.check.startswith("parity")]
    assert {c.split()[1] for c in rows} == set(GV.LOSSES)
    assert all(c.endswith("sharp") for c in rows)
    # the kernels, and the per-level route on both panel forms
    assert sum(c.startswith("parity matryoshka") for c in rows) == 3


def test_the_time_budget_lists_what_did_not_run(capsys):
    rep = GV.validate("cpu", _plan(losses=("info_nce",), budget_s=0.0), allow_cpu=True)
    out = capsys.readouterr().out
    assert rep.not_run > 0 and all(r.ok is None for r in rep.results if "not run" in r.detail)
    assert "verdict table:" in out and "not run (time budget 0 s spent: they prove nothing)" in out


def test_worker_processes_give_the_same_rows():
    plan = _plan(losses=("info_nce",), parity_shapes=SMALL, dtypes=(torch.float32,), determinism_runs=0,
                 fp16_shape=None, timing_sizes=())
    one = GV.validate("cpu", plan, allow_cpu=True)
    two = GV.validate("cpu", dataclasses.replace(plan, jobs=2), allow_cpu=True)
    key = [(r.check, r.ok) for r in one.results]
    assert sorted(key) == sorted((r.check, r.ok) for r in two.results) and one.ok


def test_a_wrong_oracle_fails_the_verdict(capsys):
    def wrong(case, inputs, device):
        loss, grads = GV.float64_oracle(case, inputs, device)
        return loss * 1.01, grads  # a 1 % error in the truth: far outside the fp32 tolerance

    rep = GV.validate("cpu", _plan(losses=("info_nce",), parity_shapes=SMALL, dtypes=(torch.float32,),
                                   determinism_runs=0, fp16_shape=None, timing_sizes=()),
                      oracle=wrong, allow_cpu=True)
    assert not rep.ok
    parity = [r for r in rep.results if r.check.startswith("parity")]
    assert [r.ok for r in parity] == [False] * 4  # every path, and the panel one in 3 panels
    assert all("oracle suspect" in r.detail for r in parity)
    assert "verdict: FAIL" in capsys.readouterr().out


def test_an_unwritten_kernel_output_fails_the_verdict(monkeypatch):
    # kernels that "forget" part of their output (the dA kernel its first row, the panel kernel its first
    # row of DL): the NaN pre-fill must surface as a parity failure on each path
    orig = TL._launch

    def forgetful(lz):
        if lz.name == "panel_dl":
            lz = lz._replace(args={**lz.args, "P": lz.args["P"] - 1, "r0": lz.args["r0"] + 1,
                                   "L": lz.args["L"][1:], "DL": lz.args["DL"][1:], "RSP": lz.args["RSP"][1:]})
        orig(lz)
        if lz.name == "lse_bwd_rows":
            lz.args["DA"][0] = float("nan")

    monkeypatch.setattr(TL, "_launch", forgetful)
    rep = GV.validate("cpu", _plan(losses=("info_nce",), parity_shapes=SHAPES[1:], dtypes=(torch.float32,),
                                   determinism_runs=0, fp16_shape=None, timing_sizes=()), allow_cpu=True)
    rep.results = [r for r in rep.results if r.check.startswith("parity")]
    assert [r.ok for r in rep.results] == [False] * 4
    assert all("inf" in r.detail for r in rep.results), [r.detail for r in rep.results]


def test_an_unwritten_epilogue_gemm_row_fails_the_verdict(monkeypatch):
    # the epilogue GEMM (16-bit panels) "forgets" the first row of its gradient tile: the NaN pre-fill
    # must surface on the panel rows, and only there (the cuBLAS form and the fused kernels pass)
    orig = TL._launch

    def forgetful(lz):
        if lz.name == "epi_gemm":
            lz = lz._replace(args={**lz.args, "P": lz.args["P"] - 1, "r0": lz.args["r0"] + 1,
                                   "X": lz.args["X"][1:], "DL": lz.args["DL"][1:], "RSP": lz.args["RSP"][1:],
                                   **({"ZP": lz.args["ZP"][1:], "TP": lz.args["TP"][1:], "MXP": lz.args["MXP"][1:]}
                                      if lz.args["ZP"].dim() == 2 else {})})
        orig(lz)

    monkeypatch.setattr(TL, "_launch", forgetful)
    rep = GV.validate("cpu", _plan(losses=("info_nce", "clip"), parity_shapes=SMALL, determinism_runs=0,
                                   fp16_shape=None, timing_sizes=()), allow_cpu=True)
    rows = {r.check.split()[2] + " " + r.check.split()[1]: r.ok for r in rep.results if r.check.startswith("parity")}
    assert rows == {f"{p} {loss}": p in ("fused", "panel-cublas") for loss in ("info_nce", "clip")
                    for p in ("fused", "panel", "panel-cublas", f"panel(P={MULTI})")}, rows


def test_an_exception_is_a_fail_row_and_the_table_follows(monkeypatch, capsys):
    """The panel path's GEMM raises (as an unsupported cuBLAS call would on a first GPU): every panel row
    of parity and determinism is a FAIL carrying the error, the fused rows still run and pass, a
    check that raises as a whole (the timings) is a FAIL row too, and the verdict table ends the run."""
    from fused_contrastive import testing
    from fused_contrastive.core.triton_shared import panels

    def boom(x, y):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED (planted)")

    monkeypatch.setattr(panels, "_mm32", boom)
    monkeypatch.setattr(testing.baselines, "BASELINES", {})  # check_timings itself raises (KeyError)
    rep = GV.validate("cpu", _plan(losses=("info_nce",), parity_shapes=SMALL, dtypes=(torch.float32,),
                                   fp16_shape=None, determinism_shape=(37, 20)), allow_cpu=True)
    out = capsys.readouterr().out
    rows = {r.check: r for r in rep.results}
    assert not rep.ok
    for run in ("panel", "panel-cublas", f"panel(P={MULTI})"):
        for name in (f"parity info_nce {run} N=37 D=20 float32 flat", f"determinism info_nce {run} N=37 D=20 float32"):
            assert rows[name].ok is False and "CUBLAS_STATUS_NOT_SUPPORTED (planted)" in rows[name].detail, rows[name]
    assert rows["parity info_nce fused N=37 D=20 float32 flat"].ok is True
    assert rows["determinism info_nce fused N=37 D=20 float32"].ok is True
    assert rows["timings (the check itself)"].ok is False and "KeyError" in rows["timings (the check itself)"].detail
    table = out[out.index("verdict table:"):]
    assert all(c in table for c in rows) and "verdict: FAIL (2 passed, 7 failed" in table, table


def test_runs_that_differ_fail_the_determinism_check(monkeypatch):
    """A path whose second run differs from its first in one gradient element by one ulp (planted: the
    interpreter itself is sequential) is a FAIL naming the difference; the same stand-in returning the same
    bits every time passes, so the check decides on the bits and not on anything else."""
    from fused_contrastive import testing

    calls = []

    def run(case, inputs, backend, dt, device):
        calls.append(backend)
        g = torch.linspace(-1.0, 1.0, 8)
        if flip and len(calls) % 2 == 0:  # every path's second run
            g[3] = torch.nextafter(g[3], torch.tensor(2.0))
        return torch.tensor(0.5), {"query": g, "keys": None}

    monkeypatch.setattr(testing, "run", run)
    plan = _plan(losses=("info_nce",), parity_shapes=(), determinism_runs=2, fp16_shape=None, timing_sizes=())
    for flip in (True, False):
        calls.clear()
        rep = GV.validate("cpu", plan, allow_cpu=True)
        rows = [r for r in rep.results if r.check.startswith("determinism")]
        assert len(rows) == 4 and len(calls) == 8, (rows, calls)
        assert all(r.ok is (not flip) for r in rows), rows
        assert all(("DIFFER bitwise" in r.detail) is flip for r in rows), rows
        assert rep.ok is (not flip)


def test_the_multi_panel_run_must_see_several_panels(monkeypatch):
    """Without the forced panel height (the default budget: one panel at these sizes) the multi-panel
    parity run must fail for want of panels, not pass on a single one."""
    import contextlib

    monkeypatch.setattr(GV, "_panel_height", lambda rows: contextlib.nullcontext())
    rep = GV.validate("cpu", _plan(losses=("info_nce", "simcse"), parity_shapes=SMALL, dtypes=(torch.float32,),
                                   determinism_runs=0, fp16_shape=None, timing_sizes=()), allow_cpu=True)
    rows = {r.check: r for r in rep.results}
    for loss in ("info_nce", "simcse"):
        assert rows[f"parity {loss} panel N=37 D=20 float32 flat"].ok is True
        bad = rows[f"parity {loss} panel(P={MULTI}) N=37 D=20 float32 flat"]
        assert bad.ok is False and "expected at least 3 panels of 16 rows" in bad.detail, bad


def test_the_poison_fills_scratch_and_outputs_with_nan():
    # the wrapper's NaN fill reaches the streaming backward's fp32 scratch (ACC), which the launcher
    # allocates with torch.empty: seen by a launch that records what it was given
    seen = {}
    orig = TL._launch

    def spy(lz):
        if lz.name == "lse_bwd_rows":
            seen["acc_nan"] = bool(torch.isnan(lz.args["ACC"]).all())
        orig(lz)

    TL._launch = spy
    try:
        with GV.kernels_only(), GV.poisoned_launches():
            q = torch.randn(70, 130, requires_grad=True)
            k = torch.randn(70, 130, requires_grad=True)
            import fused_contrastive as fc

            fc.info_nce(q, k, temperature=0.1, backend="triton").backward()
    finally:
        TL._launch = orig
    assert seen == {"acc_nan": True}
    assert math.isfinite(float(q.grad.abs().sum()))


def test_check_gpu_validate_without_cuda_exits_2(capsys):
    assert cli.main(["check", "--gpu-validate", "--device", "cpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_help_documents_the_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    assert "--gpu-validate" in capsys.readouterr().out


def test_paths_switch_the_aot_route(monkeypatch):
    """The JIT paths run with the AOT route off even when the user exported the library; the "aot/..."
    paths turn it on with the plan's library and force the operators' own path; without a library they
    refuse."""
    from fused_contrastive.core.lse import library_route

    monkeypatch.setenv(library_route.ENV, "/some/lib.so")
    monkeypatch.setattr(GV, "_AOT_LIB", "/built/libfused_contrastive_torch.so")
    import os

    with GV.triton_path("fused"):
        assert library_route.ENV not in os.environ and os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] == "fused"
    with GV.triton_path("aot/panel"):
        assert os.environ[library_route.ENV] == "/built/libfused_contrastive_torch.so"
        assert os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] == "panel"
    assert os.environ[library_route.ENV] == "/some/lib.so"
    monkeypatch.setattr(GV, "_AOT_LIB", None)
    with pytest.raises(ValueError, match="aot_lib"), GV.triton_path("aot/fused"):
        pass


def test_help_documents_the_aot_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    assert "--aot-lib" in capsys.readouterr().out


def test_the_fp16_check_grants_the_storage_error_only(monkeypatch):
    """fp16 against fp32 at large M: the fp16 gradients' own storage error is granted (mostly subnormal
    key gradients; the same on every path), a 1 % error of the fp16 key gradient beyond it is not."""
    from fused_contrastive import losses

    plan = _plan(losses=("info_nce",), parity_shapes=(), determinism_runs=0, timing_sizes=(), fp16_shape=(8, 300, 24))
    good = GV.validate("cpu", plan, allow_cpu=True)
    rows = [r for r in good.results if r.check.startswith("fp16 vs fp32")]
    assert len(rows) == 3 and all(r.ok for r in rows), rows
    assert all("fp16 storage" in r.detail for r in rows)

    class Off(torch.autograd.Function):  # identity forward, a 1 % smaller gradient
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 0.99

    orig = losses.info_nce

    def planted(query, keys, *args, **kw):
        return orig(query, Off.apply(keys) if keys.dtype == torch.float16 else keys, *args, **kw)

    monkeypatch.setattr(losses, "info_nce", planted)
    bad = GV.validate("cpu", plan, allow_cpu=True)
    rows = [r for r in bad.results if r.check.startswith("fp16 vs fp32")]
    assert len(rows) == 3 and not any(r.ok for r in rows), rows


def test_the_model_column_ships_in_the_package(monkeypatch):
    """The GPU model's times the verdict sets beside its own come from the package (a regular install has no
    bench/results/): the packaged extract is the committed model output's, and it gives the full file's values."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = root / GV.MODEL_SOURCE
    assert Path(GV.MODEL_FILE).parent == Path(GV.__file__).parent  # inside the package: it ships in the wheel
    assert Path(GV.MODEL_FILE).read_text() == GV.model_extract(str(source)), (
        "fused_contrastive/gpu_model_times.jsonl is stale: regenerate it with gpu_validate.model_extract")
    full = [json.loads(line) for line in source.read_text().splitlines() if line.startswith("{")]
    monkeypatch.delenv("FUSED_CONTRASTIVE_GPU_MODEL", raising=False)
    want = {}
    for kind in GV.MODEL_GPUS:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, kind=kind: f"NVIDIA {kind} 80GB")
        want[kind] = {(loss, r["n"]): (r[route], r[formula]) for loss, (key, route, formula) in GV.MODEL_KEYS.items()
                      for r in full if r["loss"] == key and r["gpu"] == kind and r.get("d", 768) == 768}
        assert GV.model_predictions("cuda:0") == want[kind] and len(want[kind]) >= 12, kind  # 6 losses, 2+ sizes
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setenv("FUSED_CONTRASTIVE_GPU_MODEL", str(source))  # the full file reads the same
    assert GV.model_predictions("cuda:0") == want["H200"]


def test_option_rows_pass_on_the_interpreter(capsys):
    """The options only the interpreter had run (label smoothing on GIST, Qwen3-Embedding, tau_plus and
    row_negatives on info_nce, SigLIP's groups) are parity rows against the float64 definition, in bf16 and
    fp16, their kernels launching; the cached sentence-transformers loss beside them."""
    pytest.importorskip("sentence_transformers")
    rep = GV.validate("cpu", _plan(losses=(), option_losses=GV.OPTION_LOSSES, parity_shapes=SMALL,
                                   dtypes=(torch.bfloat16, torch.float16), determinism_runs=0, fp16_shape=None,
                                   timing_sizes=(), st_cached=True), allow_cpu=True)
    out = capsys.readouterr().out
    assert rep.ok and rep.not_run == 0, out
    rows = [r.check for r in rep.results if r.check.startswith("parity")]
    assert {c.split()[1] for c in rows} == {*GV.OPTION_LOSSES, "st_cached_mnrl"}, rows
    # the core-op options on every path (4 runs), the others on their own kernels; x 2 dtypes; the ST row per dtype
    assert len(rows) == 2 * (4 + 4 + 1 + 1 + 1) + 2, rows


def test_a_planted_wrong_value_fails_its_option_row(monkeypatch):
    """A 1 % error planted in the smoothed GIST loss's kernels' result (its triton run only) fails that row and
    no other; a wrong float64 definition of the sentence-transformers row fails it."""
    pytest.importorskip("sentence_transformers")
    from fused_contrastive import testing

    orig = testing.run

    def run(case, inputs, backend, dt, device, **kw):
        loss, grads = orig(case, inputs, backend, dt, device, **kw)
        return (loss * 1.01 if backend == "triton" and case.name == "gist_smoothed" else loss), grads

    monkeypatch.setattr(testing, "run", run)
    orig_st = GV.st_cached_case

    def st_case(n, d, seed):
        fn, xs, truth = orig_st(n, d, seed)
        return fn, xs, lambda **x: truth(**x) * 1.05

    monkeypatch.setattr(GV, "st_cached_case", st_case)
    rep = GV.validate("cpu", _plan(losses=(), option_losses=("gist_smoothed", "siglip_groups"), parity_shapes=SMALL,
                                   dtypes=(torch.float32,), determinism_runs=0, fp16_shape=None, timing_sizes=(),
                                   st_cached=True), allow_cpu=True)
    rows = {r.check.split()[1]: r.ok for r in rep.results if r.check.startswith("parity")}
    assert rows == {"gist_smoothed": False, "siglip_groups": True, "st_cached_mnrl": False}, rep.results


def test_without_sentence_transformers_the_row_says_so(monkeypatch, capsys):
    import importlib.util

    orig = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentence_transformers" else orig(name, *a))
    rep = GV.validate("cpu", _plan(losses=(), parity_shapes=SMALL, determinism_runs=0, fp16_shape=None,
                                   timing_sizes=(), st_cached=True), allow_cpu=True)
    out = capsys.readouterr().out
    row = next(r for r in rep.results if r.check.startswith("parity st_cached_mnrl"))
    assert row.ok is None and row.detail == "not run: sentence-transformers is not installed"
    assert rep.not_run == 1 and "not proven (not run, 1): parity st_cached_mnrl" in out


def _stand_ins(monkeypatch, cost_s: float, timing_s: float, calls: list):
    """Rows of known cost: every run of a parity or determinism check (``testing.run`` and the oracle) sleeps
    ``cost_s``; every timing row ``timing_s``."""
    import time

    from fused_contrastive import testing

    def run(case, inputs, backend, dt, device, **kw):
        time.sleep(cost_s)
        calls.append(("run", case.name))
        return torch.tensor(0.5), {k: torch.ones_like(v) for k, v in inputs[0].items() if v.dim()}

    def oracle(case, inputs, device):
        time.sleep(cost_s)
        return torch.tensor(0.5, dtype=torch.float64), {k: torch.ones_like(v) for k, v in inputs[0].items() if v.dim()}

    def timing_row(report, plan, device, loss, n, check, share, model):
        time.sleep(timing_s)
        calls.append(("timing", loss, share))
        report.add(check, None, "stand-in")

    monkeypatch.setattr(testing, "run", run)
    monkeypatch.setattr(GV, "_timing_row", timing_row)
    return oracle


def test_a_plan_that_fits_its_budget_runs_every_row_parity_first(monkeypatch, capsys):
    """Stand-in rows of known cost (0.02 s a run, 0.05 s a timing row: about 0.7 s in all) under a 20 s
    budget: every row runs, every parity row before the determinism rows and those before any timing row,
    the plan's estimate is printed, and the timings were given their share of the time left."""
    calls = []
    oracle = _stand_ins(monkeypatch, 0.02, 0.05, calls)
    plan = _plan(losses=("info_nce", "simcse"), parity_shapes=SMALL, dtypes=(torch.float32,), fp16_shape=None,
                 determinism_runs=2, timing_sizes=(40, 80), budget_s=20.0)
    rep = GV.validate("cpu", plan, oracle=oracle, allow_cpu=True)
    out = capsys.readouterr().out
    assert rep.not_run == 0 and not any(r.detail.startswith("not run") for r in rep.results), out
    kinds = [r.check.split()[0] for r in rep.results if not r.check.startswith("cuBLAS")]
    assert kinds == ["parity"] * 8 + ["determinism"] * 8 + ["timing"] * 4, kinds
    assert "plan: 20 rows (parity 8, determinism 8, timing 4); ESTIMATE" in out
    shares = [c[2] for c in calls if c[0] == "timing"]
    assert len(shares) == 4 and all(0 < s <= 20.0 for s in shares)
    assert "not proven" not in out


def test_rows_past_the_budget_are_listed_as_not_proven(monkeypatch, capsys):
    """The same stand-ins at 0.1 s a run under a 0.3 s budget: the first parity unit (6 runs) starts and
    finishes, everything after it is listed as not run, by name, in the verdict: they prove nothing."""
    calls = []
    oracle = _stand_ins(monkeypatch, 0.1, 0.05, calls)
    plan = _plan(losses=("info_nce", "simcse"), parity_shapes=SMALL, dtypes=(torch.float32,), fp16_shape=None,
                 determinism_runs=2, timing_sizes=(40,), budget_s=0.3)
    rep = GV.validate("cpu", plan, oracle=oracle, allow_cpu=True)
    out = capsys.readouterr().out
    ran = [r.check for r in rep.results if not r.detail.startswith("not run") and not r.check.startswith("cuBLAS")]
    assert [c.split()[:2] for c in ran] == [["parity", "info_nce"]] * 4, ran
    unproven = [r.check for r in rep.results if r.detail.startswith("not run")]
    # simcse's parity unit (its first path listed; not_run counts its 4), 8 determinism rows, 2 timing rows
    assert rep.not_run == 4 + 8 + 2 and len(unproven) == 1 + 8 + 2, unproven
    line = next(x for x in out.splitlines() if x.startswith("not proven"))
    assert line.startswith(f"not proven (not run, {len(unproven)}): ") and all(c in line for c in unproven)
    assert "not run (time budget 0 s spent: they prove nothing)" in out


def test_a_timing_row_takes_the_repeats_its_share_holds():
    """A timing row whose share of the time left is 0 takes 1 repeat after the warm-up (not timing_repeats)."""
    rep = GV.Report("cpu")
    plan = _plan(losses=("info_nce",), timing_sizes=(40,), timing_repeats=5)
    with GV.kernels_only():
        GV._timing_row(rep, plan, "cpu", "info_nce", 40, "timing info_nce N=40", 0.0, {})
        GV._timing_row(rep, plan, "cpu", "info_nce", 40, "timing info_nce N=40", None, {})
    assert [r.detail.split(":")[0] for r in rep.results] == ["median of 1", "median of 5"], rep.results


def test_the_smoothed_gist_row_needs_the_smooth_flag(monkeypatch):
    """The smoothed GIST row passes only when the guided forward launched with SMOOTH (the label smoothing
    code): asked for a flag no launch sets, the same row fails saying so."""
    plan = _plan(losses=(), option_losses=("gist_smoothed",), parity_shapes=SMALL, dtypes=(torch.bfloat16,),
                 determinism_runs=0, fp16_shape=None, timing_sizes=())
    good = GV.validate("cpu", plan, allow_cpu=True)
    assert [r.ok for r in good.results if r.check.startswith("parity")] == [True]
    monkeypatch.setattr(GV, "OPTION_FLAGS", {"gist_smoothed": ("guided_fwd", "NOT_A_FLAG")})
    bad = GV.validate("cpu", plan, allow_cpu=True)
    rows = [r for r in bad.results if r.check.startswith("parity")]
    assert [r.ok for r in rows] == [False] and "guided_fwd did not run with NOT_A_FLAG" in rows[0].detail, rows


def test_the_default_plan_fits_its_default_budget_by_its_estimate():
    """The default plan's ESTIMATE (EST_S, from the committed H100 run: not a measurement per row) with 8 jobs
    and the timings at 1 repeat stays within the default budget; the parity units run cheapest N x D first,
    the first shape with every regime and dtype and the option rows, D = 100 in flat bf16."""
    plan = GV.Plan(jobs=8)
    assert GV.plan_seconds(GV.estimate(plan), plan.jobs, 1, plan.timing_repeats) <= plan.budget_s
    units = GV.parity_units(plan)
    assert units[0] == (4099, 100, "flat", torch.bfloat16, False)
    assert units[1:] == [(4099, 768, r, dt, True) for r in plan.regimes for dt in plan.dtypes]


def test_worker_units_cover_the_plan():
    """The worker units: determinism, fp16, one per parity unit (the option rows with the first shape's only)
    and the sentence-transformers rows in every dtype: together the single process's rows."""
    plan = GV.Plan(jobs=8)
    plans = GV._worker_plans(plan, None)
    assert plans[0].determinism_runs == plan.determinism_runs and plans[1].fp16_shape == plan.fp16_shape
    par = [p for p in plans if p.parity_shapes and p.losses]
    assert [(p.parity_shapes[0], p.regimes[0], p.dtypes[0]) for p in par] == \
        [((n, d), r, dt) for n, d, r, dt, _ in GV.parity_units(plan)]
    assert [bool(p.option_losses) for p in par] == [primary for *_, primary in GV.parity_units(plan)]
    st = [p for p in plans if p.st_cached]
    assert len(st) == 1 and st[0].dtypes == plan.dtypes and st[0].parity_shapes == plan.parity_shapes[:1]
    assert sum(GV.estimate(p)["parity"][0] for p in plans) == GV.estimate(plan)["parity"][0]
