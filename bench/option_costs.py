"""What ``label_smoothing=`` and ``tau_plus=`` cost against the same loss without them, measured on the CPU
(torch backend: the one-tile path and the chunked path, ``FUSED_CONTRASTIVE_DENSE=0``) on the benchmark's cases
whose function takes the option (``testing.BENCH_CASES``, built by ``make_inputs`` at N anchors: M and the
layouts are each case's) and the merged-block core's ``gist`` case (GISTEmbed's four blocks and guide mask: one
path, the PyTorch sweep, whose smoothing counts and sums the kept logits per row in the same pass), forward +
backward of its loss with every input trained, medians over repeats taken side by side in one process (the
contenders of a row alternate in every repeat, so drifts of a shared machine hit all of them alike). The clock is
the process's CPU time (``time.process_time``) on one thread by default: on a machine shared with other jobs
wall time measures their load, CPU time the work (``--wall`` for wall time).

Usage: python bench/option_costs.py [--n 1024] [--d 256] [--repeats 15] [--threads 1] [--wall]

Prints one table: per case and path the plain loss's median time and each option's ratio to it.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import statistics
import time

import torch

from fused_contrastive import routes
from fused_contrastive.testing import BENCH_CASES, CASE_BY_NAME, make_inputs

#: the merged-block core's cases (``core/guided/torch_blocks.py``: no dense / chunked switch, one path)
GUIDED = ("gist",)


def _losses(n: int, d: int):
    """The benchmark's cases (``testing.BENCH_CASES``) whose function takes ``label_smoothing``, then
    :data:`GUIDED`: name -> (tensors, kwargs, function, whether it takes ``tau_plus``)."""
    out = {}
    for case in [*BENCH_CASES, *(CASE_BY_NAME[k] for k in GUIDED)]:
        params = inspect.signature(case.fn).parameters
        if "label_smoothing" in params:
            tensors, kwargs = make_inputs(case, n, d)
            out[case.name] = (tensors, kwargs, case.fn, "tau_plus" in params)
    return out


OPTIONS = {"label_smoothing=0.1": dict(label_smoothing=0.1), "tau_plus=0.1": dict(tau_plus=0.1),
           "both": dict(label_smoothing=0.1, tau_plus=0.1)}


def _step(fn, tensors, kwargs, opts, clock=time.process_time) -> float:
    leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    t0 = clock()
    fn(**leaves, **kwargs, **opts, backend="torch").backward()
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: PyTorch's default)")
    ap.add_argument("--wall", action="store_true", help="wall time instead of the process's CPU time")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.wall else time.process_time
    print(f"# option costs, CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; N = {a.n}, D = {a.d}, float32, forward + backward, median of "
          f"{a.repeats}, {'wall' if a.wall else 'CPU'} time")
    print(f"{'loss':34s} {'path':8s} {'plain ms':>9s} " + " ".join(f"{o:>20s}" for o in OPTIONS))
    for name, (tensors, kwargs, fn, debiased) in _losses(a.n, a.d).items():
        opts = {"plain": {}, **{k: v for k, v in OPTIONS.items() if debiased or "tau_plus" not in v}}
        for path in ("merged",) if name in GUIDED else ("dense", "chunked"):
            with routes.override(DENSE=path != "chunked"):  # the switchboard, not the environment
                for o in opts.values():  # warm-up
                    _step(fn, tensors, kwargs, o)
                times: dict[str, list[float]] = {k: [] for k in opts}
                for _ in range(a.repeats):
                    for k, o in opts.items():
                        times[k].append(_step(fn, tensors, kwargs, o, clock))
            med = {k: statistics.median(v) for k, v in times.items()}
            cells = [f"{med[k] / med['plain']:>19.3f}x" if k in med else f"{'-':>20s}" for k in OPTIONS]
            print(f"{name:34s} {path:8s} {med['plain'] * 1e3:9.2f} " + " ".join(cells))


if __name__ == "__main__":
    main()
