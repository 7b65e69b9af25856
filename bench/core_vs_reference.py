"""Torch backend against the reference backend, side by side in one run (issue 2's acceptance table).

    python bench/core_vs_reference.py [--n 8192] [--dim 768] [--repeats 3] [--cosent-b 16384]

For each loss: forward+backward wall time (median of ``--repeats`` after one warm-up, both backends
interleaved in the same run so machine noise hits both alike) and peak memory (each backend in a fresh
subprocess: peak RSS (VmHWM) minus the RSS once the inputs exist). CoSENT compares the O(B log B)
sorted formula with the B x B pair matrix. Prints the table and the ratios; the targets are those of
the issue (info_nce time <= 1.1x; symmetric losses time <= 0.85x; memory <= 1/4; CoSENT >= 20x faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import fused_contrastive as fc


def make_case(name: str, n: int, d: int, seed: int = 0):
    """(function, tensors needing grad, kwargs) of one case on float32 CPU inputs."""
    g = torch.Generator().manual_seed(seed)
    if name == "info_nce":
        return fc.info_nce, [torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)], {}
    if name == "simcse_interleaved":
        return fc.simcse_loss, [torch.randn(n, d, generator=g)], {}
    if name == "supcon":
        feats = torch.randn(n // 2, 2, d, generator=g)
        return fc.supcon_loss, [feats], {"labels": torch.randint(0, 100, (n // 2,), generator=g)}
    if name == "cosent":
        scores = torch.randn(n, generator=g)
        return fc.cosent_loss_from_scores, [scores], {"labels": torch.randint(0, 6, (n,), generator=g).float()}
    raise ValueError(name)


def run_once(fn, tensors, kwargs, backend: str) -> float:
    xs = [t.detach().requires_grad_() for t in tensors]
    t0 = time.perf_counter()
    fn(*xs, backend=backend, **kwargs).backward()
    return time.perf_counter() - t0


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def peak_child(name: str, n: int, d: int, backend: str) -> None:
    """Subprocess body: print the peak RSS growth (bytes) of one forward+backward."""
    fn, tensors, kwargs = make_case(name, n, d)
    base = _rss_kb("VmRSS")
    run_once(fn, tensors, kwargs, backend)
    print(json.dumps({"peak_bytes": (_rss_kb("VmHWM") - base) * 1024}))


def peak_bytes(name: str, n: int, d: int, backend: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, str(n), str(d), backend],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cosent-b", type=int, default=16384)
    p.add_argument("--losses", default="info_nce,simcse_interleaved,supcon,cosent",
                   help="comma-separated subset of: info_nce, simcse_interleaved, supcon, cosent")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        name, n, d, be = args.child
        peak_child(name, int(n), int(d), be)
        return 0

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, forward+backward")
    header = f"{'loss':20s} {'shape':>14s} {'ref s':>8s} {'torch s':>8s} {'time x':>7s} {'ref MB':>8s} {'torch MB':>9s} {'mem x':>7s} target"
    print(header)
    cases = [("info_nce", args.n, "time<=1.1x mem<=0.25x"),
             ("simcse_interleaved", args.n, "time<=0.85x mem<=0.25x"),
             ("supcon", args.n, "time<=0.85x mem<=0.25x"),
             ("cosent", args.cosent_b, "time<=0.05x")]
    wanted = set(args.losses.split(","))
    for name, n, target in cases:
        if name not in wanted:
            continue
        fn, tensors, kwargs = make_case(name, n, args.dim)
        times = {"reference": [], "torch": []}
        for be in times:  # warm-up
            run_once(fn, tensors, kwargs, be)
        for _ in range(args.repeats):
            for be in times:
                times[be].append(run_once(fn, tensors, kwargs, be))
        tr, tt = statistics.median(times["reference"]), statistics.median(times["torch"])
        mem = {be: peak_bytes(name, n, args.dim, be) for be in times}
        shape = f"B={n}" if name == "cosent" else f"N=M={n},D={args.dim}"
        print(f"{name:20s} {shape:>14s} {tr:8.3f} {tt:8.3f} {tt / tr:7.3f} {mem['reference'] / 2**20:8.1f} "
              f"{mem['torch'] / 2**20:9.1f} {mem['torch'] / max(mem['reference'], 1):7.3f} {target}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
