"""``python -m fused_contrastive bench-maxsim`` at tiny sizes: well-formed JSON rows and table, the three
contenders' losses equal (they compute one loss); the contenders' losses and input gradients against the
float64 MaxSim oracle; the materialised contender's "does not fit" rule; the LiveBytes meter on
hand-counted allocations."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fused_contrastive import maxsim
from fused_contrastive.bench import maxsim_late as bm
from fused_contrastive.bench.memory import LiveBytes

ROOT = Path(__file__).resolve().parents[1]
HAVE_ST = importlib.util.find_spec("sentence_transformers") is not None


def test_bench_maxsim_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-maxsim", "--sizes", "8,16", "--lq", "4",
                          "--ld", "6", "--d", "8", "--repeats", "2", "--out", str(tmp_path)],
                         check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "bench_maxsim.json").read_text())
    names = ["ours", "materialised"] + (["sentence-transformers"] if HAVE_ST else [])
    cfg = res["config"]
    assert cfg["contenders"] == names and (cfg["lq"], cfg["ld"], cfg["d"], cfg["repeats"]) == (4, 6, 8, 2)
    assert cfg["materialised_factor"] > 0 and cfg["calibration_n"] == 8
    assert [r["n"] for r in res["rows"]] == [8, 16]
    for r in res["rows"]:
        assert r["skipped"] == {}
        for name in names:
            assert len(r["times_s"][name]) == 2 and all(t > 0 for t in r["times_s"][name])
            assert r["median_s"][name] > 0 and r["peak_bytes"][name] > 0
        losses = [r["loss"][name] for name in names]
        assert all(v > 0.1 for v in losses)
        assert max(losses) - min(losses) < 1e-5, r["loss"]
        assert r["predicted_materialised_bytes"] > 0
    text = (tmp_path / "bench_maxsim.txt").read_text()
    assert text.startswith("MaxSim in-batch-negatives loss") and "ours / mat." in text
    assert text == out.stdout


def test_bad_options_exit_2():
    bad = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-maxsim", "--lq", "0"],
                         check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--lq, --ld, --d and --repeats must be >= 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_contenders_against_the_float64_oracle():
    x = bm._inputs(12, 5, 7, 6, torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in x[:2]]
    want = maxsim.reference(*leaves, query_mask=x[2], doc_mask=x[3], scale=bm.SCALE, normalize=False)
    want.backward()
    assert (~x[2]).any() and (~x[3]).any()  # padded queries and documents
    for name, fn in bm.contenders(peers=HAVE_ST).items():
        loss = bm._step(fn, x)
        # sentence-transformers' scores are float32 whatever the input dtype
        tol = dict(rtol=1e-5, atol=1e-6) if name == "sentence-transformers" else dict(rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(loss.double(), want.detach(), **tol, msg=name)
        for t, ref in zip(x[:2], leaves, strict=True):
            torch.testing.assert_close(t.grad, ref.grad, **tol, msg=name)


def test_materialised_does_not_run_when_predicted_not_to_fit(monkeypatch):
    monkeypatch.setattr(bm, "mem_available", lambda: 10e6)  # 10 MB: N = 12 fits, N = 96 does not
    ran = []

    def counted(*x):
        ran.append(1)
        return bm.materialised(*x)

    monkeypatch.setattr(bm, "contenders", lambda peers: {"ours": bm.ours, "materialised": counted})
    res = bm.measure({"sizes": [12, 96], "lq": 4, "ld": 64, "d": 8, "repeats": 1, "peers": False, "progress": False})
    small, big = res["rows"]
    assert small["skipped"] == {} and small["median_s"]["materialised"] > 0
    assert big["median_s"]["materialised"] is None and big["peak_bytes"]["materialised"] is None
    why = big["skipped"]["materialised"]
    assert why.startswith("does not fit (predicted ") and "> available 0.0 GB" in why, why
    assert big["predicted_materialised_bytes"] > 0.6 * 10e6 >= small["predicted_materialised_bytes"]
    assert len(ran) == 2  # N = 12: the measured step and one repeat; N = 96: never
    assert big["median_s"]["ours"] > 0
    assert "does not fit" in bm.render(res)


def test_live_bytes_counts_what_the_ops_create():
    x = torch.ones(1000, 100, requires_grad=True)  # before the block: not counted
    with LiveBytes() as m:
        y = x * 2  # 400 kB
        v = y[:10]  # a view: nothing new
        z = v.sum()
        del y  # v keeps the storage alive
        assert m.live >= 400_000
        del v
        assert m.live < 1000  # the storage died with its last view
        z.backward()  # x.grad: 400 kB, kept
    assert m.peak >= 400_000 and m.live == pytest.approx(400_000, abs=1000)
    with LiveBytes() as m2:
        a = torch.empty(256, 256)  # 256 kB
        b = torch.empty(128, 256)  # 128 kB
        del a
        c = torch.empty(64, 256)  # 64 kB
    assert m2.peak == 256 * 256 * 4 + 128 * 256 * 4 and m2.live == (128 + 64) * 256 * 4
    del b, c
    assert m2.live == 0
