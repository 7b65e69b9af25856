"""End-to-end smoke test of ``python -m fused_contrastive bench`` (tiny sizes; 30-55 s on 2 CPU cores).

It asserts what the benchmark promises rather than any timing: one JSON row per planned case and
mode, the reference and torch backends ran everywhere, every contender that ran agrees with the
reference within tolerance, and the table and the plots are written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import torch

from fused_contrastive import bench as B

SIZES = [64, 128]


def test_bench_quick_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "fused_contrastive", "bench", "--quick", "--sizes", ",".join(map(str, SIZES)),
           "--out", str(tmp_path)]
    # one thread: no timing is asserted, and on a busy shared machine two-thread OpenMP regions of
    # millisecond ops can stall for a scheduler slice each, which makes the run several times slower
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"bench exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    planned = B.plan_params(list(B.LOSSES), SIZES, 768, torch.float32, torch.device("cpu"))
    expected = {(p.loss, p.contender, p.n, mode) for p in planned for mode in B.MODES}
    got = [(r["loss"], r["contender"], r["n"], r["mode"]) for r in rows]
    assert len(got) == len(set(got)), "duplicate rows"
    assert set(got) == expected, (f"missing {sorted(expected - set(got))[:5]}, "
                                  f"unexpected {sorted(set(got) - expected)[:5]}")

    for r in rows:
        where = f"{r['loss']} {r['contender']} N={r['n']} {r['mode']}"
        if r["contender"] in ("reference", "torch"):
            assert r["status"] == "ok", (where, r["status"], r["reason"])
        if r["status"] != "ok":
            assert r["reason"], f"{where}: status {r['status']} without a reason"
        else:
            assert r["time_ms"] > 0 and r["peak_bytes"] is not None, where
        if r["contender"] == "reference":
            assert r["time_ratio_vs_reference"] == 1.0 and r["max_abs_diff_loss"] is None, where
        elif r["peak_bytes"] is not None:  # it ran: every difference column is filled and within tolerance
            assert r["max_abs_diff_loss"] is not None and r["max_abs_diff_grad"] is not None, where
            assert r["within_tolerance"], (
                f"{where}: |dloss| {r['max_abs_diff_loss']:.2e}, |dgrad| {r['max_abs_diff_grad']:.2e} "
                f"(max |grad_ref| {r['ref_grad_scale']:.2e})")

    meta = report["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["versions"]["torch"] == torch.__version__
    assert {e["loss"] for e in report["largest_batch"]} == set(B.LOSSES)
    assert "torch backend vs reference" in proc.stdout and (tmp_path / "bench.txt").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f"bench_{loss}.png" for loss in B.LOSSES)
