"""The benchmark report's judgements on hand-made rows whose answers are derived by hand: the verdict
line per loss (our backend against the textbook formula), the largest-batch extrapolation (only from a
fit on at least three sizes with a non-negative intercept) and the noise mark on time ratios.
Nothing here measures: the rows are written out below, so every expected number is arithmetic."""

from __future__ import annotations

import math

import pytest

from fused_contrastive.bench import report as R
from fused_contrastive.bench.contenders import MODES, GiB

BUDGET = 16 * GiB
D = 768


def _rows(loss, contender, n, ms, spread=0.02, peak=None, input_bytes=None, status="ok", kind=None):
    """One (loss, contender, N) result as its three report rows: forward+backward ``ms`` with quartiles
    ``ms * (1 -/+ spread)``; forward and backward split 1:2 with the same relative spread."""
    out = []
    for mode, part in zip(MODES, (1 / 3, 2 / 3, 1.0), strict=True):
        t = None if ms is None else ms * part
        out.append({
            "loss": loss, "contender": contender, "n": n, "mode": mode, "status": status, "reason": "" if status ==
            "ok" else "skipped: predicted over --max-iter-seconds", "repeats": 30, "kind": kind or contender,
            "time_ms": t, "time_ms_p25": None if t is None else t * (1 - spread),
            "time_ms_p75": None if t is None else t * (1 + spread), "peak_bytes": peak,
            "input_bytes": 2 * n * D * 4 if input_bytes is None else input_bytes, "time_ratio_vs_reference": None,
            "memory_ratio_vs_reference": None, "time_ratio_vs_formula": None, "memory_ratio_vs_formula": None,
            "ours_time_ratio": None, "ours_memory_ratio": None, "max_abs_diff_loss": 1e-7, "max_abs_diff_grad": 1e-9,
            "within_tolerance": True, "worst": "",
            "fraction_of_matmul_peak": None, "first_step_seconds": None})
    return out


def _report(rows, losses):
    R.add_ratios(rows)
    meta = {"device": "cpu", "device_name": "test CPU", "dtype": "float32", "dim": D, "torch_threads": 2,
            "versions": {"torch": "x"}, "repeats": 30, "min_repeats": 5, "loadavg_1min": {"start": None},
            "matmul_peak": {}, "mem_budget_bytes": BUDGET, "losses": losses,
            "sizes": sorted({r["n"] for r in rows}), "wall_seconds": 1.0}
    return R.derive({"meta": meta, "rows": rows})


# ------------------------------------------------------------------------------------------------
# noise
# ------------------------------------------------------------------------------------------------


def _t(median, p25, p75):
    return {"time_ms": median, "time_ms_p25": p25, "time_ms_p75": p75}


def test_within_noise_by_hand():
    # 10 [9, 11] over 10.5 [10, 11]: the ratio's range 9/11 = 0.82 .. 11/10 = 1.10 includes 1
    assert R.within_noise(_t(10, 9, 11), _t(10.5, 10, 11)) is True
    # 5 [4.9, 5.1] over 10 [9.9, 10.1]: 4.9/10.1 = 0.485 .. 5.1/9.9 = 0.515: clearly 0.5, not noise
    assert R.within_noise(_t(5, 4.9, 5.1), _t(10, 9.9, 10.1)) is False
    # the small-batch cell: 13x with a spread of +-31360% on one side: 0.1 [0.05, 31.46] over
    # 0.0077 [0.0076, 0.0078]: the range 0.05/0.0078 = 6.4 .. 31.46/0.0076 = 4139 does not include 1,
    # but the same numerator over a denominator of 1 [0.9, 1.1] gives 0.045 .. 35: noise
    assert R.within_noise(_t(0.1, 0.05, 31.46), _t(0.0077, 0.0076, 0.0078)) is False
    assert R.within_noise(_t(0.1, 0.05, 31.46), _t(1, 0.9, 1.1)) is True
    # 1.2 [1.19, 1.21] over 1 [0.99, 1.01]: 1.178 .. 1.222, a real 20 %
    assert R.within_noise(_t(1.2, 1.19, 1.21), _t(1, 0.99, 1.01)) is False
    # a missing quartile, a missing row, a row against itself: no judgement
    assert R.within_noise(_t(1, None, 1), _t(1, 1, 1)) is None
    assert R.within_noise(None, _t(1, 1, 1)) is None
    row = _t(1, 0.5, 2)
    assert R.within_noise(row, row) is None
    assert R._xn(0.98, True) == "0.98~" and R._xn(0.5, False) == "0.50" and R._xn(None, True) == "-"


def test_sign_test_rank_by_hand():
    # coverage of [k-th smallest, k-th largest] = 1 - 2 P(Bin(n, 1/2) <= k - 1):
    # n = 4: k = 1 gives 1 - 2/16 = 0.875 < 0.90: the whole range (k = 1) all the same
    assert R.sign_test_rank(3) == R.sign_test_rank(4) == 1
    # n = 5: k = 1: 1 - 2/32 = 0.9375; k = 2: 1 - 2 * 6/32 = 0.625
    assert R.sign_test_rank(5) == 1
    # n = 10: k = 2: 1 - 2 * 11/1024 = 0.9785; k = 3: 1 - 2 * 56/1024 = 0.8906
    assert R.sign_test_rank(10) == 2
    # n = 30: P(X <= 9) = 0.02139 (k = 10: coverage 0.957), P(X <= 10) = 0.04937 (k = 11: 0.901),
    # P(X <= 11) = 0.10024 (k = 12: 0.800); the sums of C(30, j) / 2^30 written out
    assert R.sign_test_rank(30) == 11
    assert R.sign_test_rank(10, coverage=0.99) == 1  # k = 2 gives 0.9785 < 0.99


def _times(ms):
    return {"time_ms": sorted(ms)[len(ms) // 2], "time_ms_p25": None, "time_ms_p75": None, "times_ms": ms}


def test_noise_band_pairs_the_rounds():
    # a machine that slows down round after round slows both: every per-round ratio is 0.5, a real 2x,
    # which the quartile rule (2/8 = 0.25 .. 4/4 = 1.0) would call noise
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    assert R.noise_band(_times(a), _times(b)) == pytest.approx((0.5, 0.5))
    assert R.within_noise(_times(a), _times(b)) is False
    quart = {"time_ms": 3.0, "time_ms_p25": 2.0, "time_ms_p75": 4.0}
    assert R.within_noise(quart, {"time_ms": 6.0, "time_ms_p25": 4.0, "time_ms_p75": 8.0}) is True
    # ten rounds with ratios 0.8 0.9 0.95 0.97 0.98 0.99 1.01 1.02 1.2 1.5 (k = 2): band 0.9 .. 1.2, noise
    ratios = [1.01, 0.8, 1.5, 0.97, 0.9, 1.2, 0.98, 1.02, 0.95, 0.99]
    b = [2.0 + i for i in range(10)]
    a = [r * x for r, x in zip(ratios, b, strict=True)]
    assert R.noise_band(_times(a), _times(b)) == pytest.approx((0.9, 1.2))
    assert R.within_noise(_times(a), _times(b)) is True
    # one round under 1 among ten over 1.02 is an outlier the band leaves out (k = 2): not noise
    ratios = [0.95, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.09, 1.10]
    a = [r * x for r, x in zip(ratios, b, strict=True)]
    assert R.noise_band(_times(a), _times(b)) == pytest.approx((1.02, 1.09))
    assert R.within_noise(_times(a), _times(b)) is False


def test_small_batch_table_marks_the_target_misses():
    rows = []
    # N = 64: 1.04 (meets 1.05); N = 256: 1.2 beyond noise (misses); N = 1024: 0.9 (meets)
    for n, ms in ((64, 1.04), (256, 1.2), (1024, 0.9)):
        rows += _rows("simcse", "torch", n, ms, spread=0.01, peak=1e6, kind="ours")
        rows += _rows("simcse", "formula", n, 1.0, spread=0.01, peak=2e6)
    text = R.format_report(_report(rows, ["simcse"])).splitlines()
    i = next(i for i, x in enumerate(text) if x.startswith("SMALL BATCHES"))
    assert "this library (torch backend) / the textbook formula" in text[i] and "target <= 1.05" in text[i]
    assert text[i + 3].split() == ["simcse", "1.04", "1.20!", "0.90"]
    assert text[i + 4] == "1 of 3 cells miss the target <= 1.05 (1 beyond noise): simcse N=256 1.20!"


def test_load_warning_names_one_thread():
    rows = _rows("simcse", "torch", 64, 1.0, peak=1e6, kind="ours") + _rows("simcse", "formula", 64, 1.0, peak=2e6)
    rep = _report(rows, ["simcse"])
    rep["meta"]["loadavg_1min"] = {"start": 1000.0}
    text = R.format_report(rep)
    assert "WARNING: 1-min load average 1000.0" in text and "rerun with --threads 1" in text
    rep["meta"].update(torch_threads=1, threads_note="host loaded (...): 1 thread per process")
    text = R.format_report(rep)
    assert "WARNING: 1-min load average" in text and "--threads 1" not in text
    assert "host loaded (...): 1 thread per process" in text.splitlines()
    rep["meta"]["loadavg_1min"] = {"start": 0.0}
    assert "WARNING" not in R.format_report(rep)


def test_threads_for_a_loaded_host():
    from fused_contrastive.bench.cli import threads_for

    n, note = threads_for(None, "cpu", load=3.0, cpus=2)  # load 3 > half of 2 CPUs
    assert n == 1 and "1-min load average 3.0 on 2 CPUs" in note and "--threads" in note
    assert threads_for(None, "cpu", load=1.0, cpus=2) == (None, "")  # exactly half: not loaded
    assert threads_for(2, "cpu", load=9.0, cpus=2) == (2, "")  # the user's choice stands
    assert threads_for(None, "cuda", load=9.0, cpus=2) == (None, "")


# ------------------------------------------------------------------------------------------------
# largest batch within the budget
# ------------------------------------------------------------------------------------------------


def test_fit_memory_by_hand():
    # a + b N exactly, a = 1e6, b = 1000, at N = 1000, 2000, 4000; a fourth, smaller size far off the line
    # is not used (the three largest only)
    pts = [(100, 5e7), (1000, 2e6), (2000, 3e6), (4000, 5e6)]
    (powers, coef), why = R.fit_memory(pts, 1)
    assert powers == [0, 1] and why == ""
    assert coef[0] == pytest.approx(1e6, rel=1e-9) and coef[1] == pytest.approx(1000, rel=1e-12)
    # a + c N^2, a = 5e6, c = 10
    (powers, coef), _ = R.fit_memory([(n, 5e6 + 10 * n * n) for n in (1024, 2048, 4096)], 2)
    assert powers == [0, 2] and coef == pytest.approx([5e6, 10], rel=1e-9)
    # two sizes: no fit, whatever they say (the torch fit through two sizes had a = -2.37e6)
    fit, why = R.fit_memory([(256, 1e6), (1024, 2e7)], 1)
    assert fit is None and why.startswith("fewer than 3 sizes") and "N=256,1024" in why
    # 1e6, 3e6, 7e6 at 1000, 2000, 4000: the least-squares line through the three points
    # (N mean 7000/3, peak mean 11e6/3) has b = 2000 and a = 11e6/3 - 2000 * 7000/3 = -1e6 < 0
    fit, why = R.fit_memory([(1000, 1e6), (2000, 3e6), (4000, 7e6)], 1)
    assert fit is None and why.startswith("negative intercept") and "-1e+06" in why
    # peaks that fall with N
    fit, why = R.fit_memory([(1000, 3e6), (2000, 2e6), (4000, 1e6)], 1)
    assert fit is None and why.startswith("peaks did not grow")


def test_largest_batches_by_hand():
    rows = []
    ns = (1024, 2048, 4096)
    for n in ns:
        # torch (order 1): peak 1e6 + 1000 N; inputs 2 N D 4 bytes = 6144 N
        rows += _rows("info_nce", "torch", n, 10.0 * (n / 1024) ** 2, peak=1e6 + 1000 * n, kind="ours")
        # formula (order 2): peak 5e6 + 10 N^2
        rows += _rows("info_nce", "formula", n, 12.0 * (n / 1024) ** 2, peak=5e6 + 10 * n * n)
    for n in ns[1:]:  # the reference at two sizes only
        rows += _rows("info_nce", "reference", n, 12.0 * (n / 1024) ** 2, peak=6e6 + 11 * n * n)
    rep = _report(rows, ["info_nce"])
    by = {e["contender"]: e for e in rep["largest_batch"]}
    # torch: 1e6 + 1000 N + 6144 N <= 16 GiB  ->  N = (16 GiB - 1e6) / 7144
    assert by["torch"]["n_max"] == int((BUDGET - 1e6) / 7144) == 2404656
    # its time there: the largest timed size's median scaled by (N / 4096)^2 (time order 2)
    assert by["torch"]["time_ms_at_n_max"] == pytest.approx(160.0 * (by["torch"]["n_max"] / 4096) ** 2, rel=1e-6)
    # formula: 10 N^2 + 6144 N + 5e6 = 16 GiB  ->  the positive root of the quadratic
    root = (-6144 + math.sqrt(6144 ** 2 - 4 * 10 * (5e6 - BUDGET))) / (2 * 10)
    assert by["formula"]["n_max"] == int(root) == 41136
    assert by["formula"]["fit_n"] == list(ns)
    # the reference ran at two sizes: "-" with the reason, in the headline too
    assert by["reference"]["n_max"] is None and by["reference"]["reason"].startswith("fewer than 3 sizes")
    head = {h["contender"]: h for h in rep["summary"]["headline"]}
    assert head["reference"]["largest_batch"] is None
    assert head["reference"]["largest_batch_reason"].startswith("fewer than 3 sizes")
    assert head["torch"]["largest_batch"] == 2404656
    # the headline's ratios are this library / each contender at N = 4096 (the reference's largest):
    # time 160 / 192 (12 x 4^2), peak (1e6 + 1000 x 4096) / (6e6 + 11 x 4096^2); 160 / 192 against the formula
    assert head["reference"]["ours_time_vs"] == pytest.approx(160 / 192)
    assert head["reference"]["ours_memory_vs"] == pytest.approx((1e6 + 1000 * 4096) / (6e6 + 11 * 4096 ** 2))
    assert head["formula"]["ours_time_vs"] == pytest.approx(160 / 192)
    assert head["formula"]["ours_memory_vs"] == pytest.approx((1e6 + 1000 * 4096) / (5e6 + 10 * 4096 ** 2))
    assert head["torch"]["ours_time_vs"] == 1.0
    text = R.format_report(rep)
    assert "largest N '-': no fit that justifies one (fewer than 3 sizes: info_nce reference)" in text
    line = next(x for x in text.splitlines() if x.startswith("torch ") and "2048,4096" in x)
    assert "2.40M" in line and "1e+06 + 1e+03 N" in line and "1024,2048,4096" in line


def test_negative_intercept_is_not_extrapolated():
    """The issue's case: a line that needs a negative memory at N = 0 gives no N, and says why."""
    rows = []
    # the peaks lie on 2000 N - 1.048e6: 2.048e6 - 1.048e6 = 1e6 at 1024, 3.048e6 at 2048, 7.144e6 at 4096
    for n, peak in ((1024, 1e6), (2048, 3.048e6), (4096, 7.144e6)):
        rows += _rows("info_nce", "torch", n, 1.0, peak=peak, kind="ours")
    entry = R.largest_batches(rows, BUDGET)[0]
    assert entry["n_max"] is None and entry["reason"].startswith("negative intercept")
    assert "-1.05e+06" in entry["reason"]


# ------------------------------------------------------------------------------------------------
# the verdict line per loss
# ------------------------------------------------------------------------------------------------


def test_verdict_by_hand():
    rows = []
    # info_nce: torch and the formula both ran at 1024 and 4096; at 8192 only the formula ran (torch was
    # skipped), so the verdict is at N = 4096: time 50 / 100 = 0.50, peak 20e6 / 80e6 = 0.25
    rows += _rows("info_nce", "torch", 1024, 5.0, peak=4e6, kind="ours")
    rows += _rows("info_nce", "formula", 1024, 6.0, peak=9e6)
    rows += _rows("info_nce", "torch", 4096, 50.0, peak=20e6, kind="ours")
    rows += _rows("info_nce", "formula", 4096, 100.0, peak=80e6)
    rows += _rows("info_nce", "torch", 8192, None, peak=None, status="skipped", kind="ours")
    rows += _rows("info_nce", "formula", 8192, 400.0, peak=320e6)
    # a peer library at 4096: 50 / 200 = 0.25 of its time, 20e6 / 40e6 = 0.5 of its peak
    rows += _rows("info_nce", "pml-ntxent", 4096, 200.0, peak=40e6, kind="peer")
    # clip: 9.8 [9.604, 9.996] over 10 [9.8, 10.2]: range 9.604/10.2 = 0.94 .. 9.996/9.8 = 1.02: noise;
    # peak 1.2x: more memory
    rows += _rows("clip", "torch", 1024, 9.8, peak=12e6, kind="ours")
    rows += _rows("clip", "formula", 1024, 10.0, peak=10e6)
    # simcse: triton ran (on CUDA): it is the backend judged, torch is not; 3 / 2 = 1.50x: slower
    rows += _rows("simcse", "torch", 1024, 1.0, peak=1e6, kind="ours")
    rows += _rows("simcse", "triton", 1024, 3.0, peak=1e6, kind="ours")
    rows += _rows("simcse", "formula", 1024, 2.0, peak=4e6)
    # cosent: no formula ran
    rows += _rows("cosent", "torch", 1024, 1.0, peak=1e6, kind="ours")
    rep = _report(rows, ["info_nce", "clip", "simcse", "cosent"])
    v = {x["loss"]: x for x in rep["summary"]["verdict"]}
    assert (v["info_nce"]["n"], v["info_nce"]["backend"]) == (4096, "torch")
    assert v["info_nce"]["time_ratio"] == pytest.approx(0.5) and v["info_nce"]["memory_ratio"] == pytest.approx(0.25)
    assert v["info_nce"]["time_noise"] is False
    assert v["clip"]["time_noise"] is True and v["clip"]["memory_ratio"] == pytest.approx(1.2)
    assert v["simcse"]["backend"] == "triton" and v["simcse"]["time_ratio"] == pytest.approx(1.5)
    assert v["cosent"]["n"] is None
    text = R.format_report(rep)
    lines = [x.strip() for x in text.splitlines()]
    assert ("info_nce: torch / textbook formula at N=4096: time 0.50x (faster), peak memory 0.25x (less); "
            "/ pml-ntxent: time 0.25x, peak memory 0.50x") in lines
    assert "clip: torch / textbook formula" in text and not v["clip"]["peers"]
    assert "clip: torch / textbook formula at N=1024: time 0.98x~ (within noise), peak memory 1.20x (more)" in lines
    assert "simcse: triton / textbook formula at N=1024: time 1.50x (slower), peak memory 0.25x (less)" in lines
    assert "cosent: no size where both torch and the textbook formula ran" in lines
    assert text.index("VERDICT") < text.index("SMALL BATCHES") and R.NOISE_LEGEND in lines


def test_tables_mark_noisy_ratios():
    """The small-batch, large-N and per-loss tables carry ``~`` exactly on the cells within noise."""
    rows = []
    # N = 64: 1.3 [0.65, 1.95] (spread +-50 %) over 1 [0.98, 1.02]: 0.64 .. 1.99: noise
    rows += _rows("info_nce", "torch", 64, 1.3, spread=0.5, peak=1e6, kind="ours")
    rows += _rows("info_nce", "formula", 64, 1.0, peak=2e6)
    rows += _rows("info_nce", "reference", 64, 1.0, peak=2e6)
    # N = 4096: 0.5 [0.49, 0.51] over 1 [0.98, 1.02]: 0.48 .. 0.52: not noise
    rows += _rows("info_nce", "torch", 4096, 0.5, peak=1e6, kind="ours")
    rows += _rows("info_nce", "formula", 4096, 1.0, peak=2e6)
    rows += _rows("info_nce", "reference", 4096, 1.0, peak=2e6)
    rep = _report(rows, ["info_nce"])
    sb = {s["n"]: s for s in rep["summary"]["small_batch"]}
    assert sb[64]["torch_vs_formula_noise"] is True
    ln = rep["summary"]["large_n"]
    assert [(s["n"], s["torch_vs_formula_time_noise"]) for s in ln] == [(4096, False)]
    text = R.format_report(rep).splitlines()
    small = text[next(i for i, x in enumerate(text) if x.startswith("SMALL BATCHES")) + 3]
    assert small.split() == ["info_nce", "1.30~!"]  # over the target 1.05, within noise
    large = text[next(i for i, x in enumerate(text) if x.startswith("LARGE N")) + 3]
    assert large.split()[:3] == ["info_nce", "4096", "0.50"]
    case = text[next(i for i, x in enumerate(text) if x.startswith("== info_nce")) + 1:]
    assert "ours / it" in case[0]  # the direction, in the header
    ref64 = next(x for x in case if x.startswith("reference ") and x.split()[1] == "64").split()
    assert ref64[6] == "1.30~" and ref64[9] == "0.50"  # ours / it: torch's 1.3 [0.65, 1.95] over 1 [0.98, 1.02]
    torch64 = next(x for x in case if x.startswith("torch ") and x.split()[1] == "64").split()
    assert torch64[6] == "1.00"  # this library against itself: no mark
    ref4096 = next(x for x in case if x.startswith("reference ") and x.split()[1] == "4096").split()
    assert ref4096[6] == "0.50"  # 0.5 [0.49, 0.51] over 1 [0.98, 1.02]: not noise


def test_summary_plot_draws_the_unfitted(tmp_path):
    """The one-glance figure renders a report whose largest-N panel has a contender without a fit (it is
    labelled there, not drawn as a bar) and a time ratio within noise."""
    pytest.importorskip("matplotlib")
    rows = []
    for n in (1024, 2048, 4096):
        rows += _rows("info_nce", "torch", n, 10.0, spread=0.5, peak=1e6 + 1000 * n, kind="ours")
        rows += _rows("info_nce", "reference", n, 10.0, peak=5e6 + 10 * n * n)
    rows = [r for r in rows if not (r["contender"] == "reference" and r["n"] == 1024)]  # two sizes: no fit
    rep = _report(rows, ["info_nce"])
    head = {h["contender"]: h for h in rep["summary"]["headline"]}
    assert head["reference"]["largest_batch"] is None and head["reference"]["time_noise"] is True
    assert head["torch"]["time_noise"] is False  # this library against itself
    path = R.plot_summary(rep, str(tmp_path))
    assert path and (tmp_path / "bench_summary.png").stat().st_size > 0
