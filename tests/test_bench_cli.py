"""End-to-end run of ``python -m fused_contrastive bench`` at tiny sizes (about 40 s on 2 CPU cores), over
the losses that together have every contender and problem kind (``LOSSES``).

It asserts what the benchmark promises rather than any timing: one JSON row per planned case and
mode, the reference, torch and formula contenders ran everywhere, every contender that ran agrees with
the float64 truth under the accuracy rule, the summary tables (headline, small batches) are there,
and the table and the plots are written.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from fused_contrastive.bench import contenders as C

SIZES = [64, 128]


def _covering_losses() -> list[str]:
    """The benchmarked losses that together have every contender (the seed and peer formulas) and every
    kind of problem (the core op, CoSENT, SigLIP): what the end-to-end run needs to exercise every
    code path of the benchmark. The other losses' contenders are the same code with another function
    (their formulas and agreement are tests/test_small_problems.py's)."""
    from fused_contrastive.testing import CASE_BY_NAME

    facts = {n: {con.name for con in C.contenders(CASE_BY_NAME[n])} | {("op", CASE_BY_NAME[n].op)}
             for n in C.BENCH_NAMES}
    left, chosen = set().union(*facts.values()), []
    while left:
        best = max(C.BENCH_NAMES, key=lambda n: (len(facts[n] & left), -C.BENCH_NAMES.index(n)))
        chosen.append(best)
        left -= facts[best]
    return chosen


LOSSES = _covering_losses()


def test_bench_quick_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "fused_contrastive", "bench", "--quick", "--sizes", ",".join(map(str, SIZES)),
           "--losses", ",".join(LOSSES), "--repeats", "3", "--out", str(tmp_path), "--no-progress"]
    # one thread: no timing is asserted, and on a busy shared machine two-thread OpenMP regions of
    # millisecond ops can stall for a scheduler slice each, which makes the run several times slower
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, f"bench exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    assert len(LOSSES) < len(C.BENCH_NAMES) and "info_nce" in LOSSES
    planned = C.plan(LOSSES, SIZES, 768, torch.float32, torch.device("cpu"))
    expected = {(p.case, p.contender, p.n, mode) for p in planned for mode in C.MODES}
    got = [(r["loss"], r["contender"], r["n"], r["mode"]) for r in rows]
    assert len(got) == len(set(got)), "duplicate rows"
    assert set(got) == expected, (f"missing {sorted(expected - set(got))[:5]}, "
                                  f"unexpected {sorted(set(got) - expected)[:5]}")
    for r in rows:
        where = f"{r['loss']} {r['contender']} N={r['n']} {r['mode']}"
        if r["contender"] in ("reference", "torch", "formula"):
            assert r["status"] == "ok", (where, r["status"], r["reason"])
        if r["status"] != "ok":
            assert r["reason"], f"{where}: status {r['status']} without a reason"
        else:
            assert r["time_ms"] > 0 and r["peak_bytes"] is not None, where
        if r["peak_bytes"] is not None:  # it ran: the difference columns are filled and within the rule
            assert r["max_abs_diff_loss"] is not None and r["max_abs_diff_grad"] is not None, where
            assert r["within_tolerance"], f"{where}: {r['worst']}"
        if r["contender"] == "reference" and r["time_ms"] is not None:
            assert r["time_ratio_vs_reference"] == 1.0, where

    summary = report["summary"]
    assert {(s["loss"], s["n"]) for s in summary["small_batch"]} == {(c, n) for c in LOSSES for n in SIZES}
    assert {h["loss"] for h in summary["headline"]} == set(LOSSES)
    meta = report["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["versions"]["torch"] == torch.__version__
    # the ETA's record: one prediction per (loss, N) group, at increasing times; after the last group
    # all the weight is done, so the prediction is the elapsed time itself
    trace = meta["eta_trace"]
    assert len(trace) == len({(p.case, p.n) for p in planned})
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(trace))
    assert abs(trace[-1][1] - trace[-1][0]) <= 0.02 * trace[-1][0] + 0.02
    assert "ETA check:" in proc.stdout and "interrupted" not in meta
    assert {e["loss"] for e in report["largest_batch"]} == set(LOSSES)
    for section in ("HEADLINE", "SMALL BATCHES", "== info_nce"):
        assert section in proc.stdout, section
    assert (tmp_path / "bench.txt").exists()
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(["bench_summary.png"] + [f"bench_{c}.png" for c in LOSSES])


def test_williams_orders_balance_who_runs_before_whom():
    """The timing pass's round orders: every contender appears once per round and, over the rows,
    immediately follows every other contender equally often (a step after a memory-heavy one runs
    cold, so an unbalanced order would bias the ratios)."""
    from collections import Counter
    from itertools import pairwise

    from fused_contrastive.bench.harness import williams_orders

    for k in range(1, 8):
        rows = williams_orders(k)
        assert all(sorted(r) == list(range(k)) for r in rows)
        pairs = Counter(p for r in rows for p in pairwise(r))
        assert len(pairs) == k * (k - 1) and len(set(pairs.values())) <= 1, (k, pairs)


@pytest.mark.parametrize("sig, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-to-the-process-group", "sigterm-to-the-main-process"])
def test_bench_stops_on_a_signal_and_writes_what_it_measured(tmp_path, sig, whole_group):
    """Ctrl-C in a terminal (SIGINT to the whole process group, the worker included) or a SIGTERM to the
    main process, after the first (loss, N) group finished: exit 128 + the signal within seconds, the
    report and bench.json with the finished groups marked as interrupted, no traceback, no leaked
    semaphores, no process of the run left over."""
    cmd = [sys.executable, "-m", "fused_contrastive", "bench", "--losses", "info_nce", "--sizes",
           "8,16,32,64,128,256,512", "--repeats", "3", "--no-peers", "--no-seeds", "--out", str(tmp_path),
           "--no-plots"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    err: list[str] = []
    first_group = threading.Event()

    def read_stderr():
        for chunk in iter(lambda: proc.stderr.read(64), ""):
            err.append(chunk)
            if "N=8:" in "".join(err[-4:]):  # the bar's label after the first group
                first_group.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert first_group.wait(240), "no group finished in 240 s: " + "".join(err)[-2000:]
        t0 = time.monotonic()
        if whole_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        rc = proc.wait(timeout=60)  # a hang fails here (the finally kills the group), not in a read
        took = time.monotonic() - t0
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    stderr = "".join(err)
    assert rc == 128 + int(sig), (rc, out[-2000:], stderr[-2000:])
    assert took < 30, took
    assert "Traceback" not in stderr and "leaked" not in stderr, stderr[-2000:]
    name = signal.Signals(sig).name
    assert f"INTERRUPTED by {name}" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    stop = report["meta"]["interrupted"]
    assert stop["signal"] == name and 1 <= stop["groups_done"] < stop["groups_planned"] == 7
    ns = {r["n"] for r in report["rows"]}
    assert 8 in ns and len(ns) == stop["groups_done"]
    assert all(r["status"] == "ok" for r in report["rows"] if r["n"] == 8 and r["contender"] in ("reference", "torch"))
    # nothing of the run's session is left (worker, forkserver: it exits when its parent's pipe closes)
    deadline = time.monotonic() + 10
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a process of the bench run outlived it"
        time.sleep(0.2)


def test_bench_matryoshka_end_to_end(tmp_path):
    # tiny sizes: every contender runs, computes the same loss (one pass, the K-loss formula,
    # sentence-transformers' per-level MNRL: three independent computations), and the files are written
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    out = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-matryoshka", "--sizes", "48",
                          "--dims", "32,8,16", "--d", "32", "--repeats", "2", "--out", str(tmp_path)],
                         check=True, capture_output=True, text=True, env=env, timeout=300)
    assert "one-pass / plain" in out.stdout and "one-pass / formula" in out.stdout and "peak memory" in out.stdout
    assert "formula / plain" not in out.stdout  # one direction: this library's one-pass loss / the other
    res = json.loads((tmp_path / "bench_matryoshka.json").read_text())
    (row,) = res["rows"]
    names = set(row["loss"])
    assert {"plain", "one-pass", "formula"} <= names
    import importlib.util
    if importlib.util.find_spec("sentence_transformers") is not None:
        assert "sentence-transformers" in names
    for name in names - {"plain"}:
        assert abs(row["loss"][name] - row["loss"]["formula"]) < 1e-4 * abs(row["loss"]["formula"]), name
        assert row["median_s"][name] > 0 and len(row["times_s"][name]) == 2
    assert (tmp_path / "bench_matryoshka.txt").read_text().startswith("Matryoshka InfoNCE")
    bad = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-matryoshka", "--dims", "800"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dims" in bad.stderr


def test_bench_gist_end_to_end(tmp_path):
    # tiny sizes: both contenders run, the fused loss equals the textbook one (float32 in the JSON; loss
    # and gradients in float64 here), the guide drops some but not all negatives, and the files are written
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    out = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-gist", "--sizes", "64,96", "--dim", "32",
                          "--guide-dim", "16", "--repeats", "1", "--out", str(tmp_path)],
                         check=True, capture_output=True, text=True, env=env, timeout=300)
    for col in ("textbook ms", "fused ms", "fused / textbook", "textbook MiB", "fused MiB", "negatives masked"):
        assert col in out.stdout, col
    res = json.loads((tmp_path / "bench_gist.json").read_text())
    assert [r["n"] for r in res["rows"]] == [64, 96]
    assert (res["config"]["dim"], res["config"]["guide_dim"]) == (32, 16)
    for row in res["rows"]:
        loss = row["loss"]
        assert set(loss) == {"textbook", "fused"}
        assert abs(loss["fused"] - loss["textbook"]) < 1e-4 * abs(loss["textbook"]), (row["n"], loss)
        for name in loss:
            assert row["median_s"][name] > 0 and len(row["times_s"][name]) == 1
            assert row["peak_bytes"][name] >= 0
        assert 0 < row["masked"]["in-batch negatives"] < 0.5, row["masked"]
        assert 0 < row["masked"]["own hard negative"] < 1, row["masked"]
    assert (tmp_path / "bench_gist.txt").read_text().startswith("GISTEmbed loss")

    from fused_contrastive.bench import gist

    x = gist._inputs(40, 24, 12, "cpu", torch.float64)
    got = {}
    for name, fn in gist.contenders().items():
        got[name] = (gist._step(fn, x), [t.grad.clone() for t in x[:3]])
    (l_t, g_t), (l_f, g_f) = got["textbook"], got["fused"]
    assert torch.allclose(l_f, l_t, rtol=1e-12, atol=0)
    for a, b in zip(g_f, g_t, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)

    bad = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-gist", "--guide-dim", "0"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--guide-dim" in bad.stderr


def test_quick_defaults_show_the_memory_claim(monkeypatch):
    """``bench --quick`` runs three losses at 2048 and 4096, where one N x N float32 logit matrix
    (64 MiB at 4096) outweighs the inputs (two [N, 768] float32: 24 MiB), and this library's largest
    batch is fitted on three sizes >= 1024; under load it takes one thread per process."""
    import argparse

    from fused_contrastive.bench import cli
    from fused_contrastive.bench.report import MIN_FIT_SIZES

    parser = argparse.ArgumentParser()
    ap = cli.add_parser(parser.add_subparsers())
    monkeypatch.setattr("fused_contrastive.bench.report.loadavg", lambda: 0.0)
    cfg = cli.config(ap.parse_args(["--quick"]), ap)
    assert cfg.sizes == [64, 256, 1024] and cfg.threads is None and cfg.threads_note == ""
    assert cfg.extra_sizes == {"info_nce": [2048, 4096], "clip": [2048, 4096], "supcon_out": [2048, 4096]}
    n, d = max(cfg.extra_sizes["info_nce"]), cfg.dim
    assert n * n * 4 > 2 * n * d * 4 * 2.5
    sizes = sorted(set(cfg.sizes) | set(cfg.extra_sizes["clip"]))
    assert len([x for x in sizes if x >= 1024]) >= MIN_FIT_SIZES
    monkeypatch.setattr("fused_contrastive.bench.report.loadavg", lambda: 64.0 * (os.cpu_count() or 1))
    cfg = cli.config(ap.parse_args(["--quick"]), ap)
    assert cfg.threads == 1 and "1 thread per process" in cfg.threads_note
    assert cli.config(ap.parse_args(["--quick", "--threads", "2"]), ap).threads == 2
    assert cli.config(ap.parse_args(["--quick", "--sizes", "64,128"]), ap).extra_sizes == {}
