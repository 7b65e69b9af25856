"""``python -m fused_contrastive bench``: the options, their defaults per device, and the run.

This module imports only argparse and torch (the command-line parser is built for ``--help`` even
where the ``[bench]`` extra is missing); the run needs tqdm, tabulate, numpy and (for plots)
matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from ..testing import BENCH_CASES, CASE_BY_NAME

# Defaults per device and run length. CPU sizes are small because one 4096 x 4096 x 768 matmul takes
# ~0.6 s on the 2-core reference machine; N <= 1024 makes the small-batch table, 4096 the large-N
# table; info_nce also runs at 8192 (the largest-batch fit needs two sizes whose N x N temporaries
# exceed glibc's 32 MiB mmap threshold). --quick adds 2048 and 4096 for three losses (InfoNCE, CLIP,
# SupCon): at 4096 the textbook's N x N temporaries (64 MiB each) outweigh the inputs (25 MiB), so the
# verdict shows the memory claim, and this library's largest batch is fitted on 1024, 2048, 4096.
# CUDA sizes are the issue's.
QUICK_LARGE = ("info_nce", "clip", "supcon_out")
DEFAULTS = {
    ("cpu", False): dict(sizes=(64, 128, 256, 512, 1024, 2048, 4096), repeats=30, min_repeats=5,
                         max_iter_seconds=10.0, max_case_seconds=6.0, extra_sizes={"info_nce": (8192,)}),
    ("cpu", True): dict(sizes=(64, 256, 1024), repeats=10, min_repeats=3, max_iter_seconds=2.0,
                        max_case_seconds=2.0, extra_sizes={c: (2048, 4096) for c in QUICK_LARGE}),
    ("cuda", False): dict(sizes=(1024, 4096, 16384), repeats=30, min_repeats=10, max_iter_seconds=30.0,
                          max_case_seconds=20.0),
    ("cuda", True): dict(sizes=(1024, 4096), repeats=10, min_repeats=5, max_iter_seconds=5.0, max_case_seconds=5.0),
}
BENCH = [c.name for c in BENCH_CASES]


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _cases(text: str) -> list[str]:
    items = _csv(text)
    bad = [x for x in items if x not in CASE_BY_NAME]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown loss(es) {bad or [text]}; valid: {', '.join(BENCH)} "
                                         "(or any case of `check --list`)")
    return items


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(n < 4 or n % 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"--sizes must be even numbers >= 4 (interleaved pairs, two views), "
                                         f"got {text!r}")
    return sizes


def _backends(text: str) -> list[str]:
    items = _csv(text)
    bad = [x for x in items if x not in ("torch", "triton", "reference")]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad or [text]}; valid: torch, triton")
    return items


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return v
    return parse


def add_parser(sub) -> argparse.ArgumentParser:
    ap = sub.add_parser(
        "bench", help="benchmark every loss against the reference, the textbook formulas and the peers",
        description="Microbenchmarks of every loss: this library's backends next to the reference, the textbook "
                    "formula each loss replaces, the seed documents' formulas and the peer libraries; time "
                    "(fwd, bwd, fwd+bwd; medians over repeats, contenders interleaved), peak memory (a fresh "
                    "process per case), differences under the project's accuracy rule. Prints the verdict, the "
                    "headline, the small-batch table (torch vs formula, N <= 1024) and a table per loss, every "
                    "ratio this library / the other (below 1: this library is faster / holds less); writes "
                    "bench.txt, bench.json, bench_summary.png and a PNG per loss. N is the number of anchors "
                    "(rows of the similarity matrix).")
    ap.add_argument("--losses", type=_cases, default=None, metavar="LOSS,...",
                    help=f"among {', '.join(BENCH)} (default all of these)")
    ap.add_argument("--sizes", type=_sizes, default=None, metavar="N,...",
                    help="even N >= 4; default CPU 64,128,256,512,1024,2048,4096 and 8192 for info_nce "
                         f"(quick 64,256,1024 and 2048,4096 for {','.join(QUICK_LARGE)}), CUDA 1024,4096,16384 "
                         "(quick 1024,4096)")
    ap.add_argument("--dim", type=_positive(int), default=768, help="embedding dimension D (default 768)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    ap.add_argument("--backends", type=_backends, default=["torch", "triton"], metavar="BACKEND,...",
                    help="ours to run among torch, triton (default both; the reference always runs)")
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile (Inductor) of the torch backend and of the textbook formula; "
                         "the report gets a COMPILED table (compiled / eager, and the cold first step)")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                    help="pytorch-metric-learning when installed (default on)")
    ap.add_argument("--seeds", action=argparse.BooleanOptionalAction, default=True,
                    help="the seed documents' formulas besides the textbook one (default on)")
    ap.add_argument("--repeats", type=_positive(int), help="timed repeats per case (default CPU 30, quick 10)")
    ap.add_argument("--min-repeats", type=_positive(int),
                    help="repeats never drop below this for slow steps (default CPU 5, quick 3)")
    ap.add_argument("--warmup", type=_positive(int), default=1, help="untimed steps per contender (default 1)")
    ap.add_argument("--out", default="bench_out", help="output directory (default bench_out)")
    ap.add_argument("--quick", action="store_true",
                    help=f"three small sizes, 2048 and 4096 for {', '.join(QUICK_LARGE)} (the memory claim), 10 "
                         "repeats: a few minutes on CPU")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:i]")
    ap.add_argument("--mem-budget-gb", type=_positive(float), default=16.0,
                    help="budget of the largest-batch extrapolation and memory cap of every case (lowered to "
                         "the memory available on CPU; default 16)")
    ap.add_argument("--max-iter-seconds", type=_positive(float),
                    help="skip a size of a memory-bound seed or peer predicted to take longer per step "
                         "(default CPU 10, quick 2; CUDA 30)")
    ap.add_argument("--max-case-seconds", type=_positive(float),
                    help="fewer repeats (>= --min-repeats) for a case whose repeats would take longer "
                         "(default CPU 6, quick 2; CUDA 20)")
    ap.add_argument("--timeout", type=_positive(float), default=900.0, help="kill a case after this many seconds")
    ap.add_argument("--isolate", choices=("auto", "process", "inline"), default="auto",
                    help="fresh process per case (auto: on CPU, needed for its peak RSS) or inline")
    ap.add_argument("--threads", type=_positive(int),
                    help="torch.set_num_threads in every case (default: torch's, or 1 on CPU when the host is "
                         "loaded: 1-min load average above half the CPUs)")
    ap.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--from-json", metavar="DIR",
                    help="measure nothing: re-render DIR/bench.txt and the plots from DIR/bench.json")
    return ap


def config(a: argparse.Namespace, ap: argparse.ArgumentParser):
    """The suite's Config from parsed options (errors go through ``ap.error``: exit 2, no traceback)."""
    from .harness import Config
    from .memory import mem_available

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: CUDA is not available here")
    if device != "cpu" and not device.startswith("cuda"):
        ap.error(f"--device must be auto, cpu or cuda[:i], got {device!r}")
    dflt = DEFAULTS[("cuda" if device.startswith("cuda") else "cpu", a.quick)]
    cases = a.losses or list(BENCH)
    budget = a.mem_budget_gb * (1 << 30)
    cap = budget
    avail = mem_available() if device == "cpu" else None
    if avail is not None:
        cap = min(cap, max(avail - 2 * (1 << 30), 1 << 30))
    repeats = a.repeats or dflt["repeats"]
    threads, note = threads_for(a.threads, device)
    return Config(
        cases=cases, sizes=sorted(set(a.sizes or dflt["sizes"])), dim=a.dim, dtype=a.dtype, device=device,
        backends=sorted(set(a.backends) | {"reference"} | ({"torch-compiled", "formula-compiled"} if a.compile
                                                           else set())), seeds=a.seeds, peers=a.peers, repeats=repeats,
        min_repeats=min(a.min_repeats or dflt["min_repeats"], repeats), warmup=a.warmup, out=a.out,
        mem_budget=budget, mem_cap=cap, max_iter_seconds=a.max_iter_seconds or dflt["max_iter_seconds"],
        max_case_seconds=a.max_case_seconds or dflt["max_case_seconds"], timeout=a.timeout,
        isolate=(a.isolate == "process") or (a.isolate == "auto" and not device.startswith("cuda")),
        plots=not a.no_plots, progress=not a.no_progress, threads=threads, threads_note=note,
        extra_sizes={} if a.sizes else {k: list(v) for k, v in dflt.get("extra_sizes", {}).items() if k in cases},
    )


def threads_for(threads: int | None, device: str, load: float | None = None,
                cpus: int | None = None) -> tuple[int | None, str]:
    """``(threads per process, note)``: ``--threads`` when given; on CPU with a loaded host
    (``report.loaded``: 1-min load average above half the CPUs) 1, so that no contender's multi-threaded
    regions wait for a core another process holds (on 2 loaded cores, 2 threads made small-batch
    ratios range from 0.00 to 6.84 and the quick run take 8 m 41 s; 1 thread gave sane ratios in
    2 m 54 s); else None (torch's default)."""
    from .report import loadavg, loaded

    if threads is not None or device != "cpu":
        return threads, ""
    load = loadavg() if load is None else load
    cpus = cpus or os.cpu_count() or 1
    if loaded(load, cpus):
        return 1, (f"host loaded (1-min load average {load:.1f} on {cpus} CPUs): 1 thread per process "
                   "(--threads N to override)")
    return None, ""


def run(a: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """Run the suite, print the report, write bench.txt, bench.json and the plots."""
    try:
        import numpy  # noqa: F401
        import tabulate  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as exc:
        ap.error(f"the benchmark needs the [bench] extra ({exc.name} is missing): "
                 'pip install "/path/to/fused-contrastive[bench]" (a checkout of this project)')
    import json

    from . import report
    from .harness import run_suite

    if a.from_json:
        out, plots = a.from_json, not a.no_plots
        json_path = os.path.join(out, "bench.json")
        if not os.path.exists(json_path):
            ap.error(f"--from-json: no {json_path}")
        with open(json_path) as fh:
            rep = json.load(fh)
    else:
        cfg = config(a, ap)
        out, plots = cfg.out, cfg.plots
        os.makedirs(out, exist_ok=True)
        rep = run_suite(cfg)
        json_path = os.path.join(out, "bench.json")
        report.write_json(rep, json_path)  # first: the measurements survive a failure below
    text = report.format_report(rep)
    print(text)
    with open(os.path.join(out, "bench.txt"), "w") as fh:
        fh.write(text + "\n")
    print(f"\nJSON: {json_path}")
    if plots:
        try:
            paths = [report.plot_summary(rep, out)] + report.plot_cases(rep, out)
        except ImportError:
            print("matplotlib not installed: no plots (pip install matplotlib)")
        else:
            print(f"plots: {', '.join(p for p in paths if p)}")
    stop = rep["meta"].get("interrupted")
    if stop:  # the shell's convention for a process stopped by a signal: 128 + its number
        return 128 + {"SIGINT": 2, "SIGTERM": 15}[stop["signal"]]
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fused_contrastive.bench ARGS`` (the same as ``python -m fused_contrastive bench ARGS``)."""
    parser = argparse.ArgumentParser(prog="python -m fused_contrastive")
    sub = parser.add_subparsers(dest="command")
    ap = add_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run(args, ap)
