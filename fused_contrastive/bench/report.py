"""What a benchmark run reports: rows, ratios, the largest batch within a memory budget, the tables,
the JSON and the plots.

* **Ratios** are measured in the same run and printed in one direction: **this library / the other**
  (this library's backend, triton where it ran, else torch, over the other contender), time and peak
  memory, same mode and N; below 1 this library is faster / holds less. ``bench.json`` also keeps each
  row's ratios to the reference and the formula (``*_ratio_vs_reference`` / ``*_vs_formula``: that
  row / that base) and to this library (``ours_*_ratio``: this library / that row).
* **Throughput**: every contender is credited with the FLOPs of the textbook formula's matmuls
  (``Case.flops``: forward ``2 R C D``, backward ``4 R C D``, forward+backward ``6 R C D`` with R x C the
  logits' shape); TFLOP/s = FLOPs / median time, and the fraction of the matmul peak measured at the
  start and end of the run. It can exceed 100% where a backend does less work than the formula.
* **Largest batch within a budget** (:func:`largest_batches`): total memory = inputs + peak over
  the baseline. The peaks of a contender's three largest measured sizes are fitted (least squares) by
  ``a + b N^k`` with ``k`` its declared memory order (1 for ours, 2 for quadratic contenders, 3 for
  pml-ntxent) and solved for the budget: these N are **extrapolated from measured points** and labelled
  so. No fit, no N ("-" with the reason): fewer than three sizes, a negative intercept ``a`` (memory at
  N = 0 below zero is not a physical fit) or a non-positive ``b``.
* **Verdict** (:func:`verdicts`): per loss, this library's backend (triton where it ran, else torch)
  against the textbook formula it replaces, forward+backward time and peak memory at the largest N
  both ran, and against the peer library where one ran there (pytorch-metric-learning).
* **Noise** (:func:`noise_band`): a time ratio ``a / b`` is *within noise* (marked ``~``) when its noise
  band includes 1. The band is a distribution-free interval (sign test, >= 90 % where the repeats allow
  it; the whole range below 5 repeats) of the median of the per-round ratios ``a_r / b_r``: the two
  contenders run in the same rounds, so a round that the machine slowed down slows both. A row without
  its per-repeat times (a ``bench.json`` of an older version) falls back to the two contenders'
  quartiles, ``p25_a / p75_b .. p75_a / p25_b``.
* **Small-batch table**: N <= 1024, the torch backend's forward+backward time over the textbook
  formula's (the ``formula`` contender), medians measured side by side; a cell over the target
  (:data:`SMALL_BATCH_TARGET`, 1.05) is marked ``!`` and listed under the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from typing import Any

import torch

from .. import __version__
from ..testing import CASE_BY_NAME
from .contenders import MODES, GiB, MiB, Planned, get_contender

SMALL_N = 1024  # the small-batch table: N <= this
#: the small-batch table's target: this library's torch backend / the textbook formula <= this
SMALL_BATCH_TARGET = 1.05
#: the smallest coverage of the noise band's interval where the repeats allow it
NOISE_COVERAGE = 0.90
LARGE_N = 4096  # the large-N table: N >= this


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def loaded(load: float | None, cpus: int | None = None) -> bool:
    """Whether a 1-min load average means a busy host: above half the logical CPUs (another process
    then competes with this run's threads; 2-thread OpenMP regions of millisecond ops stall for a
    scheduler slice each, which made small-batch ratios run from 0.00 to 6.84 at load 4-7 on 2 CPUs)."""
    return load is not None and load > 0.5 * (cpus or os.cpu_count() or 1)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str | None]:
    def ver(mod: str) -> str | None:
        try:
            m = __import__(mod)
        except ImportError:
            return None
        return str(getattr(m, "__version__", "?"))

    return {"fused_contrastive": __version__, "torch": torch.__version__, "triton": ver("triton"),
            "numpy": ver("numpy"), "pytorch_metric_learning": ver("pytorch_metric_learning"),
            "matplotlib": ver("matplotlib"), "python": platform.python_version()}


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def best_peak(*runs: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in runs if "flops_per_s" in r]
    if not ok:
        return {"error": "; ".join(str(r.get("reason")) for r in runs)}
    best = max(ok, key=lambda r: r["flops_per_s"])
    return dict(best, runs_flops_per_s=[r.get("flops_per_s") for r in runs])


def rows_of(p: Planned, cfg, res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mode for a (case, contender, N) result."""
    case = CASE_BY_NAME[p.case]
    con = get_contender(p.case, p.contender)
    shape = case.logits(p.n) if case.logits is not None else (p.n, p.n)
    rows = []
    for mode in MODES:
        row: dict[str, Any] = {
            "loss": p.case, "inputs": case.inputs, "contender": p.contender, "kind": con.kind,
            "source": con.source, "n": p.n, "rows": shape[0], "cols": shape[1], "dim": cfg.dim, "dtype": cfg.dtype,
            "device": cfg.device, "version": __version__, "mode": mode, "status": res.get("status", "error"),
            "reason": res.get("reason", ""), "repeats": res.get("repeats"), "time_ms": None, "time_ms_p25": None,
            "time_ms_p75": None, "time_ms_min": None, "time_ms_max": None, "peak_bytes": None,
            "input_bytes": res.get("input_bytes"), "time_ratio_vs_reference": None,
            "memory_ratio_vs_reference": None, "time_ratio_vs_formula": None, "memory_ratio_vs_formula": None,
            "ours_time_ratio": None, "ours_memory_ratio": None,
            "loss_value": res.get("loss_value"), "max_abs_diff_loss": res.get("max_abs_diff_loss"),
            "max_abs_diff_grad": res.get("max_abs_diff_grad"), "within_tolerance": res.get("within_tolerance"),
            "worst": res.get("worst", ""), "flops": case.flops(p.n, cfg.dim, mode), "tflops": None,
            "fraction_of_matmul_peak": None, "memory_order": con.memory_order, "time_order": con.time_order,
            "memory_method": res.get("memory_method"), "memory_pass_seconds": res.get("memory_pass_seconds"),
            "first_step_seconds": res.get("first_step_seconds"),
        }
        if "peaks" in res:  # the memory pass ran (also for a seed or peer then left untimed)
            row["peak_bytes"] = res["peaks"][mode]
        if res.get("status") == "ok":
            ms = [t * 1e3 for t in res["times"][mode]]
            q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
            row.update(time_ms=statistics.median(ms), time_ms_p25=q[0], time_ms_p75=q[2], time_ms_min=min(ms),
                       time_ms_max=max(ms), times_ms=ms)
            if row["flops"] is not None:
                row["tflops"] = row["flops"] / (row["time_ms"] / 1e3) / 1e12
        rows.append(row)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Time and peak ratios of every row to the reference's and the formula's (that row / the base), and this
    library's to every row (``ours_time_ratio`` / ``ours_memory_ratio``: this library / that row), same case,
    N and mode."""
    for case in dict.fromkeys(r["loss"] for r in rows):
        ours = backend_of(rows, case)
        by = {(r["n"], r["mode"]): r for r in rows if r["loss"] == case and r["contender"] == ours}
        for r in rows:
            o = by.get((r["n"], r["mode"])) if r["loss"] == case else None
            if o is None:
                continue
            if o["time_ms"] is not None and r["time_ms"]:
                r["ours_time_ratio"] = o["time_ms"] / r["time_ms"]
            if o["peak_bytes"] is not None and r["peak_bytes"]:
                r["ours_memory_ratio"] = o["peak_bytes"] / r["peak_bytes"]
    for base in ("reference", "formula"):
        by = {(r["loss"], r["n"], r["mode"]): r for r in rows if r["contender"] == base}
        for r in rows:
            b = by.get((r["loss"], r["n"], r["mode"]))
            if b is None:
                continue
            if r["time_ms"] is not None and b["time_ms"]:
                r[f"time_ratio_vs_{base}"] = r["time_ms"] / b["time_ms"]
            if r["peak_bytes"] is not None and b["peak_bytes"]:
                r[f"memory_ratio_vs_{base}"] = r["peak_bytes"] / b["peak_bytes"]


# ------------------------------------------------------------------------------------------------
# largest batch within a memory budget (extrapolated from the measured peaks)
# ------------------------------------------------------------------------------------------------

#: the fewest measured sizes a memory fit is made from
MIN_FIT_SIZES = 3


def fit_memory(points: Sequence[Sequence[float]], order: int):
    """``(powers, coefficients), ""`` of ``a + b N^order`` fitted by least squares through the
    ``MIN_FIT_SIZES`` largest (N, bytes) points, or ``None, why`` (``why`` starts with a short kind:
    ``"fewer than 3 sizes"``, ``"negative intercept"``, ``"peaks did not grow"``). The largest sizes
    only: smaller ones are not asymptotic (glibc serves blocks under its 32 MiB mmap threshold from a
    reused heap). Two parameters through three points, so a noisy point shows as a bad fit rather than
    being interpolated, and the intercept ``a`` (the memory at N = 0) must be >= 0: a fit that needs a
    negative one does not describe the memory and is not extrapolated."""
    import numpy as np

    pts = sorted((float(n), float(v)) for n, v in points)
    ns = ",".join(str(int(n)) for n, _ in pts)
    if len(pts) < MIN_FIT_SIZES:
        return None, f"fewer than {MIN_FIT_SIZES} sizes: measured at N={ns or 'none'}"
    use = pts[-MIN_FIT_SIZES:]
    ns = ",".join(str(int(n)) for n, _ in use)
    powers = [0, order]
    a = np.array([[n ** k for k in powers] for n, _ in use])
    y = np.array([v for _, v in use])
    c = [float(v) for v in np.linalg.lstsq(a, y, rcond=None)[0]]
    model = "a + b N" + ("" if order == 1 else f"^{order}")
    if c[1] <= 0:
        return None, f"peaks did not grow: {model} over N={ns} has b = {c[1]:.3g}"
    if c[0] < 0:
        return None, f"negative intercept: {model} over N={ns} has a = {c[0]:.3g} B < 0"
    return (powers, c), ""


def _solve(powers: list[int], coef: list[float], per_n: float, budget: float) -> float:
    """The largest N with ``sum coef * N^powers + per_n * N <= budget`` (the polynomial's largest real root)."""
    import numpy as np

    deg = max(max(powers), 1)
    poly = np.zeros(deg + 1)
    for p, c in zip(powers, coef, strict=True):
        poly[deg - p] += c
    poly[deg - 1] += per_n
    poly[deg] -= budget
    roots = [r.real for r in np.roots(poly) if abs(r.imag) < 1e-6 * max(1.0, abs(r)) and r.real > 0]
    return max(roots) if roots else float("nan")


def largest_batches(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """Per (case, contender): the largest N whose inputs + forward+backward peak fit in ``budget``,
    EXTRAPOLATED (see the module docstring); the time there is the largest timed size's median scaled
    by ``(N / N_timed)^time_order``."""
    out = []
    keys = sorted({(r["loss"], r["contender"]) for r in rows}, key=lambda k: (list(CASE_BY_NAME).index(k[0]), k[1]))
    for case, cname in keys:
        if get_contender(case, cname).kind == "compiled":
            # their measured peak holds the compiler's own memory (the first step compiles): no model of
            # the step's memory can be fitted through it
            out.append({"loss": case, "contender": cname, "budget_bytes": budget, "n_max": None,
                        "reason": "compiled: the measured peak holds the compiler's own memory"})
            continue
        mine = [r for r in rows if r["loss"] == case and r["contender"] == cname and r["mode"] == "forward+backward"]
        pts = sorted((r["n"], r["peak_bytes"], r["input_bytes"]) for r in mine if r["peak_bytes"] is not None)
        timed = sorted((r["n"], r["time_ms"]) for r in mine if r["time_ms"] is not None)
        con = get_contender(case, cname)
        used = pts[-MIN_FIT_SIZES:]
        entry: dict[str, Any] = {"loss": case, "contender": cname, "budget_bytes": budget,
                                 "measured_n": [p[0] for p in pts], "fit_n": [p[0] for p in used],
                                 "memory_order": con.memory_order, "n_max": None,
                                 "method": "extrapolated from measured points"}
        out.append(entry)
        if not used:
            entry["reason"] = "no measured size"
            continue
        fit, why = fit_memory([(p[0], float(p[1])) for p in pts], con.memory_order)
        if fit is None:
            entry["reason"] = why
            continue
        per_n = used[-1][2] / used[-1][0]
        n_max = _solve(fit[0], fit[1], per_n, budget)
        if not math.isfinite(n_max):
            entry["reason"] = "no positive solution"
            continue
        entry.update(n_max=int(n_max), fit_powers=fit[0], fit_coefficients=fit[1], input_bytes_per_n=per_n)
        if timed:
            n_big, t_big = timed[-1]
            entry.update(time_ms_at_n_max=t_big * (n_max / n_big) ** con.time_order,
                         time_model=f"t({n_big}) * (N / {n_big})^{con.time_order}")
    return out


# ------------------------------------------------------------------------------------------------
# summaries
# ------------------------------------------------------------------------------------------------


def _fb(rows, case, contender, n) -> dict[str, Any] | None:
    for r in rows:
        if r["loss"] == case and r["contender"] == contender and r["n"] == n and r["mode"] == "forward+backward":
            return r
    return None


def sign_test_rank(n: int, coverage: float = NOISE_COVERAGE) -> int:
    """The largest ``k >= 1`` such that the ``k``-th smallest and ``k``-th largest of ``n`` samples enclose
    their median with probability >= ``coverage`` (``1 - 2 P(Bin(n, 1/2) <= k - 1)``, the sign test's
    interval); 1 (the whole range) where even that falls short (n < 5 at 90 %)."""
    best, below = 1, 0.0
    for k in range(1, (n + 1) // 2 + 1):
        below += math.comb(n, k - 1) / 2.0 ** n  # P(Bin(n, 1/2) <= k - 1)
        if 1.0 - 2.0 * below < coverage:
            break
        best = k
    return best


def noise_band(a: dict[str, Any] | None, b: dict[str, Any] | None) -> tuple[float, float] | None:
    """The noise band of the time ratio ``a / b`` of two rows (module docstring): from the per-round
    ratios ``times_ms[r]`` of both (same rounds), their sign-test interval (:func:`sign_test_rank`);
    without per-repeat times, ``p25_a / p75_b .. p75_a / p25_b``. None when the times are missing."""
    if a is None or b is None or a is b:
        return None
    ta, tb = a.get("times_ms"), b.get("times_ms")
    if ta and tb and all(x > 0 for x in tb):
        ratios = sorted(x / y for x, y in zip(ta, tb, strict=False))
        k = sign_test_rank(len(ratios))
        return ratios[k - 1], ratios[len(ratios) - k]
    q = [x.get(k) for x in (a, b) for k in ("time_ms_p25", "time_ms_p75")]
    if any(v is None for v in q) or not q[2] or not q[3]:
        return None
    return q[0] / q[3], q[1] / q[2]


def within_noise(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool | None:
    """Whether the time ratio ``a / b`` of two rows is within noise: its :func:`noise_band` includes 1.
    None when there is no band (a time missing, a row against itself)."""
    band = noise_band(a, b)
    return None if band is None else band[0] <= 1.0 <= band[1]


def backend_of(rows: list[dict[str, Any]], case: str) -> str:
    """This library's backend for ``case`` in a run: triton where it ran (CUDA), else torch."""
    ran = {r["contender"] for r in rows if r["loss"] == case and r["time_ms"] is not None}
    return "triton" if "triton" in ran else "torch"


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per loss: this library's backend against the textbook formula it replaces, forward+backward time
    and peak-memory ratios at the largest N both ran (``n`` None where there is none)."""
    out = []
    for case in dict.fromkeys(r["loss"] for r in rows):
        ours = backend_of(rows, case)
        both = [n for n in {r["n"] for r in rows if r["loss"] == case}
                if all((x := _fb(rows, case, c, n)) and x["time_ms"] for c in (ours, "formula"))]
        entry: dict[str, Any] = {"loss": case, "backend": ours, "n": None, "time_ratio": None, "time_noise": None,
                                 "memory_ratio": None}
        out.append(entry)
        if not both:
            continue
        n = max(both)
        a, b = _fb(rows, case, ours, n), _fb(rows, case, "formula", n)
        entry.update(n=n, time_ratio=a["time_ms"] / b["time_ms"], time_noise=within_noise(a, b),
                     memory_ratio=(a["peak_bytes"] / b["peak_bytes"]) if a["peak_bytes"] and b["peak_bytes"]
                     else None, backend_ms=a["time_ms"], formula_ms=b["time_ms"], backend_peak=a["peak_bytes"],
                     formula_peak=b["peak_bytes"])
        entry["peers"] = [
            {"contender": p["contender"], "time_ratio": a["time_ms"] / p["time_ms"], "time_noise": within_noise(a, p),
             "memory_ratio": (a["peak_bytes"] / p["peak_bytes"]) if a["peak_bytes"] and p["peak_bytes"] else None}
            for p in rows if p["loss"] == case and p["n"] == n and p["mode"] == "forward+backward"
            and p["kind"] == "peer" and p["time_ms"]]
    return out


def small_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch / formula (and reference / formula) forward+backward time at every N <= SMALL_N."""
    out = []
    for case in dict.fromkeys(r["loss"] for r in rows):
        for n in sorted({r["n"] for r in rows if r["loss"] == case and r["n"] <= SMALL_N}):
            t, f, ref = (_fb(rows, case, c, n) for c in ("torch", "formula", "reference"))
            if not (t and f and t["time_ms"] and f["time_ms"]):
                continue
            out.append({"loss": case, "n": n, "torch_ms": t["time_ms"], "formula_ms": f["time_ms"],
                        "torch_vs_formula": t["time_ms"] / f["time_ms"], "repeats": min(t["repeats"], f["repeats"]),
                        "torch_vs_formula_noise": within_noise(t, f),
                        "reference_vs_formula": (ref["time_ms"] / f["time_ms"]) if ref and ref["time_ms"] else None})
    return out


def large_n(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch / formula time and peak memory (forward+backward) at every N >= LARGE_N."""
    out = []
    for case in dict.fromkeys(r["loss"] for r in rows):
        for n in sorted({r["n"] for r in rows if r["loss"] == case and r["n"] >= LARGE_N}):
            t, f = _fb(rows, case, "torch", n), _fb(rows, case, "formula", n)
            if not (t and f and t["time_ms"] and f["time_ms"]):
                continue
            out.append({"loss": case, "n": n, "torch_vs_formula_time": t["time_ms"] / f["time_ms"],
                        "torch_vs_formula_time_noise": within_noise(t, f),
                        "torch_vs_formula_peak": (t["peak_bytes"] / f["peak_bytes"]) if f["peak_bytes"] else None,
                        "torch_ms": t["time_ms"], "formula_ms": f["time_ms"], "torch_peak": t["peak_bytes"],
                        "formula_peak": f["peak_bytes"]})
    return out


def compiled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``bench --compile``: per case and N, compiled / eager forward+backward time of the torch backend
    and of the formula, compiled torch / compiled formula, and the cold first step of each compiled
    contender (compile included)."""
    out = []
    for case in dict.fromkeys(r["loss"] for r in rows):
        for n in sorted({r["n"] for r in rows if r["loss"] == case}):
            t, tc, f, fc = (_fb(rows, case, c, n) for c in ("torch", "torch-compiled", "formula", "formula-compiled"))
            if not (tc and tc["time_ms"]):
                continue

            def ratio(x, y):
                return x["time_ms"] / y["time_ms"] if x and y and x["time_ms"] and y["time_ms"] else None
            out.append({"loss": case, "n": n, "torch_compiled_vs_eager": ratio(tc, t),
                        "torch_compiled_vs_eager_noise": within_noise(tc, t),
                        "formula_compiled_vs_eager_noise": within_noise(fc, f),
                        "torch_compiled_vs_formula_compiled_noise": within_noise(tc, fc),
                        "formula_compiled_vs_eager": ratio(fc, f), "torch_compiled_vs_formula_compiled": ratio(tc, fc),
                        "torch_compiled_ms": tc["time_ms"], "formula_compiled_ms": fc["time_ms"] if fc else None,
                        "torch_first_step_s": tc["first_step_seconds"],
                        "formula_first_step_s": fc["first_step_seconds"] if fc else None})
    return out


def headline(rows: list[dict[str, Any]], largest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, at the largest N the reference ran: this library's time and peak over every contender's
    (``ours_time_vs`` / ``ours_memory_vs``: this library / that contender; 1 on this library's own row), and
    each contender's largest batch within the budget (extrapolated)."""
    out = []
    for case in dict.fromkeys(r["loss"] for r in rows):
        ns = [r["n"] for r in rows if r["loss"] == case and r["contender"] == "reference" and r["time_ms"]]
        if not ns:
            continue
        n = max(ns)
        for r in rows:
            if r["loss"] != case or r["n"] != n or r["mode"] != "forward+backward" or r["time_ms"] is None:
                continue
            lb = next((e for e in largest if e["loss"] == case and e["contender"] == r["contender"]), None)
            ours = _fb(rows, case, backend_of(rows, case), n)
            out.append({"loss": case, "n": n, "contender": r["contender"], "kind": r["kind"],
                        "ours_time_vs": r["ours_time_ratio"],
                        "time_noise": bool(ours) and ours is not r and within_noise(ours, r),
                        "ours_memory_vs": r["ours_memory_ratio"],
                        "largest_batch": lb["n_max"] if lb else None,
                        "largest_batch_reason": (lb.get("reason") if lb else "no entry") or ""})
    return out


def assemble(cfg, rows: list[dict[str, Any]], peak: dict[str, Any], load_start: float | None,
             wall: float) -> dict[str, Any]:
    import time as _time

    for r in rows:
        if r["tflops"] is not None and peak.get("flops_per_s"):
            r["fraction_of_matmul_peak"] = r["tflops"] * 1e12 / peak["flops_per_s"]
    from .memory import CpuMeter, CudaMeter

    meta = {
        "device": cfg.device, "device_name": device_name(cfg.device), "dtype": cfg.dtype, "dim": cfg.dim,
        "loadavg_1min": {"start": load_start, "end": loadavg()},
        "sizes": sorted(set(cfg.sizes).union(*cfg.extra_sizes.values())), "extra_sizes": cfg.extra_sizes,
        "losses": cfg.cases, "repeats": cfg.repeats, "min_repeats": cfg.min_repeats, "warmup": cfg.warmup,
        "torch_threads": cfg.threads or torch.get_num_threads(), "threads_note": getattr(cfg, "threads_note", ""),
        "versions": versions(), "git_commit": git_commit(),
        "matmul_peak": peak, "mem_cap_bytes": cfg.mem_cap, "mem_budget_bytes": cfg.mem_budget,
        "max_iter_seconds": cfg.max_iter_seconds, "max_case_seconds": cfg.max_case_seconds,
        "isolated_processes": cfg.isolate,
        "accuracy_rule": "|err| <= 2 x PyTorch's same-dtype error + slack x max(1, max|truth|) against the "
                         "float64 truth (fused_contrastive.testing.accuracy)",
        "flops_formula": "forward 2*R*C*D, backward 4*R*C*D, forward+backward 6*R*C*D (R x C = logits)",
        "n_meaning": "N = anchors = rows of the similarity matrix (see 'inputs' of each row)",
        "memory_method": CpuMeter(cfg.isolate).method if cfg.device == "cpu" else CudaMeter.method,
        "wall_seconds": wall, "date_utc": _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime()),
    }
    return derive({"meta": meta, "rows": rows})


def derive(report: dict[str, Any]) -> dict[str, Any]:
    """(Re)compute what a report derives from its rows and ``meta``: ``largest_batch`` and ``summary``
    (verdicts, headline, small batches, large N, compiled), in place; returns ``report``. Rendering
    calls it, so a report read back from an older ``bench.json`` is shown by the current rules."""
    rows = report["rows"]
    add_ratios(rows)
    largest = largest_batches(rows, report["meta"]["mem_budget_bytes"])
    report["largest_batch"] = largest
    report["summary"] = {"verdict": verdicts(rows), "small_batch": small_batch(rows), "large_n": large_n(rows),
                         "compiled": compiled(rows), "headline": headline(rows, largest)}
    return report


# ------------------------------------------------------------------------------------------------
# text
# ------------------------------------------------------------------------------------------------


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / GiB:.2f}G" if b >= 10 * GiB else f"{b / MiB:.1f}M"


def _ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 10 else f"{x:.0f}")


def _xn(x: float | None, noise: bool | None) -> str:
    """A time ratio, with ``~`` when it is within noise (see :func:`within_noise`)."""
    return _x(x) + ("~" if x is not None and noise else "")


def _target(s: dict[str, Any]) -> str:
    """A small-batch cell: the ratio, ``~`` within noise, ``!`` over :data:`SMALL_BATCH_TARGET`."""
    x = s["torch_vs_formula"]
    return _xn(x, s.get("torch_vs_formula_noise")) + ("!" if x is not None and x > SMALL_BATCH_TARGET else "")


NOISE_LEGEND = ("~ after a time ratio: within noise (its noise band includes 1: the sign-test interval, >= 90 % "
                "where the repeats allow it, else their whole range, of the per-round ratios of the two contenders "
                "timed in the same rounds)")


def verdict_line(v: dict[str, Any]) -> str:
    """One loss's verdict: the backend against the textbook formula (time, peak memory)."""
    if v["n"] is None:
        return f"{v['loss']}: no size where both {v['backend']} and the textbook formula ran"
    t = v["time_ratio"]
    speed = "within noise" if v["time_noise"] else ("faster" if t < 1 else "slower" if t > 1 else "same time")
    m = v["memory_ratio"]
    mem = "-" if m is None else f"{_x(m)}x ({'less' if m < 1 else 'more' if m > 1 else 'same'})"
    mark = "~" if v["time_noise"] else ""
    peers = "".join(f"; / {p['contender']}: time {_xn(p['time_ratio'], p['time_noise'])}x, peak memory "
                    f"{_x(p['memory_ratio'])}x" for p in v.get("peers") or ())
    return (f"{v['loss']}: {v['backend']} / textbook formula at N={v['n']}: time {_x(t)}x{mark} ({speed}), "
            f"peak memory {mem}{peers}")


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _n(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else f"{n:.0f}"


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


def format_report(report: dict[str, Any]) -> str:
    """The terminal report: the headline and small-batch tables first, then one table per case, the
    large-N table and the largest batches."""
    from tabulate import tabulate

    derive(report)
    meta, rows = report["meta"], report["rows"]
    out = [(f"fused_contrastive bench - {meta['device_name']} ({meta['device']}), dtype {meta['dtype']}, "
            f"D={meta['dim']}, {meta['torch_threads']} threads, torch {meta['versions']['torch']}; medians of up to "
            f"{meta['repeats']} repeats (at least {meta['min_repeats']}), contenders interleaved in one process")]
    trace = meta.get("eta_trace") or []
    if trace and not meta.get("interrupted"):
        at = next((t for t in trace if t[0] >= 60), trace[-1])
        out.append(f"ETA check: after {at[0]:.0f} s the progress bar predicted {at[1] / 60:.1f} min in all; the run "
                   f"took {meta['wall_seconds'] / 60:.1f} min")
    stop = meta.get("interrupted")
    if stop:
        out.append(f"INTERRUPTED by {stop['signal']} after {meta['wall_seconds']:.0f} s: partial results, "
                   f"{stop['groups_done']} of {stop['groups_planned']} (loss, N) groups measured")
    load = (meta.get("loadavg_1min") or {}).get("start")
    if meta.get("threads_note"):
        out.append(meta["threads_note"])
    if load is not None and loaded(load):
        fix = ("" if meta["torch_threads"] == 1 else
               f"; with {meta['torch_threads']} threads per process the ratios are noise too: rerun with --threads 1")
        out.append(f"WARNING: 1-min load average {load:.1f} on {os.cpu_count()} CPUs when the run started: absolute "
                   f"times are noisy (ratios less so: contenders are interleaved, ~ marks those within noise){fix}")
    pk = meta.get("matmul_peak") or {}
    if pk.get("flops_per_s"):
        out.append(f"matmul peak measured: {pk['flops_per_s'] / 1e9:.0f} GFLOP/s ({'x'.join(map(str, pk['shape']))} "
                   f"{pk['dtype']}); eff% = textbook FLOPs (6*R*C*D) / median time / peak")
    out.append(NOISE_LEGEND)
    summ = report["summary"]
    if summ["verdict"]:
        out += ["", ("VERDICT: this library's backend / the textbook formula it replaces (and / the peer library "
                     "where one ran), forward+backward at the largest N both ran (ratio < 1: this library is faster "
                     "/ holds less)")]
        out += ["  " + verdict_line(v) for v in summ["verdict"]]  # one line per loss
    if summ["headline"]:
        out += ["", ("HEADLINE: this library / each contender, forward+backward time and peak memory at the largest "
                     "N the reference ran (ratio < 1: this library is faster / holds less); each contender's "
                     f"largest batch within {meta['mem_budget_bytes'] / GiB:.0f} GiB EXTRAPOLATED from measured "
                     "peaks")]
        tab = [[h["loss"], h["n"], h["contender"], _xn(h["ours_time_vs"], h.get("time_noise")),
                _x(h["ours_memory_vs"]), _n(h["largest_batch"]) if h["largest_batch"] else "-"]
               for h in summ["headline"]]
        out.append(tabulate(tab, headers=["loss", "N", "contender", "time: ours / it", "peak: ours / it",
                                          "its largest N"], tablefmt="simple", disable_numparse=True))
        why: dict[str, list[str]] = {}
        for h in summ["headline"]:
            if not h["largest_batch"]:
                kind = (h.get("largest_batch_reason") or "not fitted").split(":", 1)[0]
                why.setdefault(kind, []).append(f"{h['loss']} {h['contender']}")
        if why:
            out.append("largest N '-': no fit that justifies one (" + "; ".join(f"{k}: {', '.join(v)}"
                                                                         for k, v in why.items())
                       + "); each reason in full: largest_batch in bench.json")
    if summ["small_batch"]:
        ns = sorted({s["n"] for s in summ["small_batch"]})
        by = {(s["loss"], s["n"]): s for s in summ["small_batch"]}
        tab = [[case] + [_target(by[(case, n)]) if (case, n) in by else "-" for n in ns]
               for case in dict.fromkeys(s["loss"] for s in summ["small_batch"])]
        reps = min(s["repeats"] for s in summ["small_batch"])
        out += ["", (f"SMALL BATCHES: this library (torch backend) / the textbook formula, forward+backward time, "
                     f"D={meta['dim']}, {meta['dtype']}, medians of >= {reps} repeats side by side "
                     f"(target <= {SMALL_BATCH_TARGET}; ! misses it, ~ within noise)"),
                tabulate(tab, headers=["loss"] + [f"N={n}" for n in ns], tablefmt="simple", disable_numparse=True)]
        miss = [s for s in summ["small_batch"] if s["torch_vs_formula"] > SMALL_BATCH_TARGET]
        if miss:
            real = [s for s in miss if not s.get("torch_vs_formula_noise")]
            out.append(f"{len(miss)} of {len(summ['small_batch'])} cells miss the target <= {SMALL_BATCH_TARGET} "
                       f"({len(real)} beyond noise): "
                       + ", ".join(f"{s['loss']} N={s['n']} {_target(s)}" for s in miss))
        else:
            out.append(f"every cell meets the target <= {SMALL_BATCH_TARGET}")
    if summ["large_n"]:
        tab = [[s["loss"], s["n"], _xn(s["torch_vs_formula_time"], s.get("torch_vs_formula_time_noise")),
                _x(s["torch_vs_formula_peak"]), _ms(s["torch_ms"]),
                _ms(s["formula_ms"]), _bytes(s["torch_peak"]), _bytes(s["formula_peak"])] for s in summ["large_n"]]
        out += ["", f"LARGE N (>= {LARGE_N}): this library (torch backend) / textbook formula, forward+backward",
                tabulate(tab, headers=["loss", "N", "time x", "peak x", "torch ms", "formula ms", "torch peak",
                                       "formula peak"], tablefmt="simple", disable_numparse=True)]
    if summ.get("compiled"):
        def sec(v):
            return f"{v:.1f} s" if v is not None else "-"
        tab = [[s["loss"], s["n"], _xn(s["torch_compiled_vs_eager"], s.get("torch_compiled_vs_eager_noise")),
                _xn(s["formula_compiled_vs_eager"], s.get("formula_compiled_vs_eager_noise")),
                _xn(s["torch_compiled_vs_formula_compiled"], s.get("torch_compiled_vs_formula_compiled_noise")),
                _ms(s["torch_compiled_ms"]),
                _ms(s["formula_compiled_ms"]), sec(s["torch_first_step_s"]), sec(s["formula_first_step_s"])]
               for s in summ["compiled"]]
        out += ["", ("COMPILED (torch.compile, Inductor defaults): forward+backward time ratios, medians side by "
                     "side: compiled / eager of each, and this library compiled / the formula compiled; first step "
                     "= cold step incl. compile"),
                tabulate(tab, headers=["loss", "N", "torch c/e", "formula c/e", "torch c / formula c", "torch c ms",
                                       "formula c ms", "torch 1st", "formula 1st"], tablefmt="simple",
                         disable_numparse=True)]
    skipped: dict[tuple, list[int]] = {}
    for case in meta["losses"]:
        lines = []
        names = list(dict.fromkeys(r["contender"] for r in rows if r["loss"] == case))
        for cname in names:
            for n in meta["sizes"]:
                fb = _fb(rows, case, cname, n)
                if fb is None:
                    continue
                if fb["status"] == "skipped" and fb["reason"].startswith(("no GPU", "peer not", "no triton")):
                    skipped.setdefault((cname, fb["reason"]), []).append(n)
                    continue
                if fb["peak_bytes"] is None:
                    lines.append([cname, n] + ["-"] * 10 + [f"{fb['status']}: {fb['reason'][:100]}"])
                    continue
                f = next(r for r in rows if r["loss"] == case and r["contender"] == cname and r["n"] == n
                         and r["mode"] == "forward")
                b = next(r for r in rows if r["loss"] == case and r["contender"] == cname and r["n"] == n
                         and r["mode"] == "backward")
                spread = (f"{100 * (fb['time_ms_p75'] - fb['time_ms_p25']) / fb['time_ms']:.0f}"
                          if fb["time_ms"] else "-")
                eff = f"{100 * fb['fraction_of_matmul_peak']:.0f}" if fb["fraction_of_matmul_peak"] else "-"
                tol = "" if fb["within_tolerance"] is None else ("ok" if fb["within_tolerance"] else "DIFF!")
                status = fb["status"] if fb["status"] == "ok" else f"{fb['status']}: {fb['reason'][:50]}"
                ours = _fb(rows, case, backend_of(rows, case), n)
                noise = bool(ours) and ours is not fb and within_noise(ours, fb)
                lines.append([cname, n, _ms(f["time_ms"]), _ms(b["time_ms"]), _ms(fb["time_ms"]), spread,
                              _xn(fb["ours_time_ratio"], noise), eff, _bytes(fb["peak_bytes"]),
                              _x(fb["ours_memory_ratio"]), _e(fb["max_abs_diff_loss"]),
                              _e(fb["max_abs_diff_grad"]), f"{status} {tol}".strip()])
        out += ["", f"== {case}: {CASE_BY_NAME[case].inputs} (ours / it: this library's {backend_of(rows, case)} "
                    "over that contender)",
                tabulate(lines, headers=["contender", "N", "fwd ms", "bwd ms", "fwd+bwd", "±%", "ours / it", "eff%",
                                         "peak", "ours / it", "|dloss|", "|dgrad|", "status"],
                         tablefmt="simple", disable_numparse=True)]
    if skipped:
        out += ["", "not run:"] + [f"  {c} ({len(ns)} cases): {why}" for (c, why), ns in skipped.items()]
    budget = meta["mem_budget_bytes"]
    tab = []
    for e in report["largest_batch"]:
        if e["loss"] != "info_nce":
            continue
        if e["n_max"] is None:
            tab.append([e["contender"], "-", "-", "-", e.get("reason", "")])
            continue
        model = " + ".join(f"{c:.3g}" + ("" if p == 0 else f" N^{p}" if p > 1 else " N")
                           for p, c in zip(e["fit_powers"], e["fit_coefficients"], strict=True))
        there = _dur(e["time_ms_at_n_max"] / 1e3) if e.get("time_ms_at_n_max") is not None else "(not timed)"
        tab.append([e["contender"], _n(e["n_max"]), there, model, ",".join(map(str, e["fit_n"]))])
    if tab:
        out += ["", (f"largest info_nce batch within {budget / GiB:.0f} GiB at D={meta['dim']}: inputs + peak, "
                     f"EXTRAPOLATED by a + b N^k (k: the contender's memory order) fitted on its {MIN_FIT_SIZES} "
                     "largest measured sizes; no fit with fewer sizes or a negative intercept a"),
                tabulate(tab, headers=["contender", "N max", "fwd+bwd there", "peak model (bytes)",
                                       "fitted on N / why not"], tablefmt="simple", disable_numparse=True)]
    out += ["", f"wall time {_dur(meta['wall_seconds'])}"]
    return "\n".join(out)


def write_json(report: dict[str, Any], path: str) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as fh:
        json.dump(clean(report), fh, indent=1)


# ------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------

_STYLE = {  # contender -> (color, marker, linestyle); the reference is a black dashed line on top
    "reference": ("black", "s", "--"), "formula": ("tab:gray", "D", "-"), "torch": ("tab:blue", "o", "-"),
    "triton": ("tab:green", "^", "-"), "seed-broadcast": ("tab:red", "v", ":"), "pml-ntxent": ("tab:purple", "P", ":"),
    "pml-supcon": ("tab:purple", "P", ":"),
}


def _style(name: str, i: int):
    return _STYLE.get(name, (f"C{(i + 4) % 10}", "x", "-."))


def _why(row: dict[str, Any]) -> str:
    """A short reason why a case was not timed (the plots' footnote)."""
    reason = row["reason"]
    if reason.startswith("would need"):
        return "memory estimate over the cap"
    if reason.startswith(("predicted", "not timed")):
        return "step predicted or measured over --max-iter-seconds"
    return row["status"]


def plot_cases(report: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per case: forward+backward time and peak memory against N (log-log), one line per
    contender (distinct color, marker and dash; the reference on top); what did not run is listed by
    contender and N under the plots, not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = report["meta"], report["rows"]
    paths = []
    for case in meta["losses"]:
        lrows = [r for r in rows if r["loss"] == case and r["mode"] == "forward+backward"]
        names = list(dict.fromkeys(r["contender"] for r in lrows))
        fig, axes = plt.subplots(1, 2, figsize=(13, 5.4))
        notes: dict[str, list[str]] = {}
        for i, cname in enumerate(sorted(names, key=lambda c: c == "reference")):  # reference drawn last
            color, marker, ls = _style(cname, i)
            mine = sorted((r for r in lrows if r["contender"] == cname), key=lambda r: r["n"])
            ok = [r for r in mine if r["time_ms"] is not None]
            mem = [r for r in mine if r["peak_bytes"] is not None]
            for r in mine:
                if r["time_ms"] is None and not r["reason"].startswith(("no GPU", "no triton")):
                    notes.setdefault(cname, {}).setdefault(_why(r), []).append(r["n"])
            kw = dict(color=color, marker=marker, linestyle=ls, label=cname, markersize=5, linewidth=1.4,
                      zorder=3 if cname == "reference" else 2)
            if ok:
                xs = [r["n"] for r in ok]
                ys = [r["time_ms"] / 1e3 for r in ok]
                err = [[(r["time_ms"] - r["time_ms_p25"]) / 1e3 for r in ok],
                       [(r["time_ms_p75"] - r["time_ms"]) / 1e3 for r in ok]]
                axes[0].errorbar(xs, ys, yerr=err, capsize=2, **kw)
            if mem:
                axes[1].plot([r["n"] for r in mem], [max(r["peak_bytes"] / MiB, 1e-2) for r in mem], **kw)
        if case == "info_nce":
            budget = meta["mem_budget_bytes"]
            for i, cname in enumerate(names):
                e = next((e for e in report["largest_batch"] if e["loss"] == case and e["contender"] == cname
                          and e["n_max"]), None)
                if e is None:
                    continue
                n0 = min(e["fit_n"])
                xs = [n0 * (e["n_max"] / n0) ** (k / 40) for k in range(41)]
                total = [(sum(c * x ** p for p, c in zip(e["fit_powers"], e["fit_coefficients"], strict=True))
                          + e["input_bytes_per_n"] * x) / MiB for x in xs]
                axes[1].plot(xs, total, color=_style(cname, i)[0], linestyle=":", linewidth=1)
            axes[1].axhline(budget / MiB, color="0.4", linestyle="--", linewidth=0.8)
            axes[1].text(0.01, budget / MiB, f" {budget / GiB:.0f} GiB budget; dotted: inputs + fitted peak, "
                         "EXTRAPOLATED", transform=axes[1].get_yaxis_transform(), va="bottom", fontsize=8)
        axes[0].set_ylabel("forward+backward time [s] (median, p25-p75)")
        axes[1].set_ylabel("peak memory over baseline [MiB]")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (anchors)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8, loc="lower right")
        fig.suptitle(f"{case}: {CASE_BY_NAME[case].inputs}\n{meta['device_name']}, {meta['dtype']}, D={meta['dim']}",
                     fontsize=9)
        if notes:
            text = "not timed: " + "; ".join(
                f"{c} at N={','.join(map(str, ns))} ({why})" for c, d in notes.items() for why, ns in d.items())
            fig.text(0.01, 0.01, text[:400], fontsize=7, wrap=True)
        fig.tight_layout(rect=(0, 0.05 if notes else 0, 1, 1))
        path = os.path.join(out_dir, f"bench_{case}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_summary(report: dict[str, Any], out_dir: str) -> str | None:
    """The one-glance figure: for every case, each contender's time and peak memory relative to the
    reference at the largest N, and its largest batch within the budget (extrapolated); each bar
    carries its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter
    from matplotlib.transforms import blended_transform_factory

    head = report["summary"]["headline"]
    if not head:
        return None
    cases = list(dict.fromkeys(h["loss"] for h in head))
    names = list(dict.fromkeys(h["contender"] for h in head))
    by = {(h["loss"], h["contender"]): h for h in head}
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.5 * len(cases) * max(1, len(names) / 2.5) + 2.2), sharey=True)
    height = 0.8 / len(names)
    keys = ("ours_time_vs", "ours_memory_vs", "largest_batch")
    fmt = (lambda v: f"{v:.2f}x", lambda v: f"{v:.2f}x", lambda v: _n(v))
    for j, cname in enumerate(names):
        color = _style(cname, j)[0]
        ys = [i + (j - (len(names) - 1) / 2) * height for i in range(len(cases))]
        for ax, key, f in zip(axes, keys, fmt, strict=True):
            heads = [(y, by.get((c, cname))) for y, c in zip(ys, cases, strict=True)]
            pts = [(y, h[key], h) for y, h in heads if h and h.get(key)]
            if key == "largest_batch":  # ran, but no fit justifies an extrapolation: say so, draw no bar
                for y, h in heads:
                    if h and not h.get(key):
                        ax.text(0.01, y, f"- {cname}: no justified fit", va="center", fontsize=6.5, color=color,
                                transform=blended_transform_factory(ax.transAxes, ax.transData))
            if not pts:
                continue
            ax.barh([p[0] for p in pts], [p[1] for p in pts], height=height * 0.9, color=color,
                    label=cname if ax is axes[0] else None)
            for y, v, h in pts:
                noise = "~" if key == "ours_time_vs" and h.get("time_noise") else ""
                ax.text(v, y, " " + f(v) + noise, va="center", fontsize=6.5)
    axes[0].set_yticks(range(len(cases)))
    axes[0].set_yticklabels([f"{c} (N={by[(c, 'reference')]['n']})" if (c, "reference") in by else c for c in cases])
    axes[0].invert_yaxis()
    titles = ("forward+backward time: this library / it (largest N; ~ within noise)",
              "peak memory: this library / it",
              f"largest N within {report['meta']['mem_budget_bytes'] / GiB:.0f} GiB (EXTRAPOLATED)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="x", which="major", alpha=0.3)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_formatter(FuncFormatter((lambda v, _: _n(v)) if ax is axes[2] else (lambda v, _: f"{v:g}")))
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, hi * 4)  # room for the value labels
    for ax in axes[:2]:
        ax.axvline(1.0, color="k", linewidth=0.8)
    meta = report["meta"]
    fig.legend(loc="upper center", ncol=len(names), fontsize=8, bbox_to_anchor=(0.5, 0.955), frameon=False)
    fig.suptitle(f"fused-contrastive: every loss at a glance - {meta['device_name']}, {meta['dtype']}, D={meta['dim']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = os.path.join(out_dir, "bench_summary.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
