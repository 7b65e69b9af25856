"""Command line: ``python -m fused_contrastive [check|bench] ...`` (``check`` is the default).

``check`` runs every loss on every backend available on this device against the reference backend
(float64 ground truth) on random data and prints one row per (loss, backend, shape, dtype): the max
abs error of the loss and of the gradients, the tolerance (twice PyTorch's own same-dtype error plus
a small slack) and PASS/FAIL. It exits 1 if any row fails. ``bench`` runs the benchmark suite
(see ``fused_contrastive.bench``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def available_backends(device: str) -> List[str]:
    """Backends to check besides the reference on ``device``."""
    from . import _dispatch

    out = ["torch"]
    if _dispatch.triton_available() and (device.startswith("cuda") or _dispatch.interpreter_on()):
        out.append("triton")
    return out


def check(argv: Optional[List[str]] = None) -> int:
    from ._cases import CASES, compare

    p = argparse.ArgumentParser(prog="python -m fused_contrastive check",
                                description="Every loss on every available backend against the reference.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="1x3,97x64,256x768",
                   help="comma-separated NxD (N rows of anchors, D dims); default %(default)s")
    p.add_argument("--dtypes", default="float32,bfloat16,float16", help="default %(default)s")
    p.add_argument("--backends", default=None, help="default: every backend available on the device")
    p.add_argument("--losses", default=None, help="comma-separated case names; default all")
    args = p.parse_args(argv)

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dtypes = [_DTYPES[d] for d in args.dtypes.split(",")]
    backends = args.backends.split(",") if args.backends else available_backends(args.device)
    cases = [c for c in CASES if args.losses is None or c.name in args.losses.split(",")]
    print(f"fused-contrastive check on {args.device} (torch {torch.__version__}); "
          f"backends: {', '.join(backends)}; errors against float64 ground truth")
    head = f"{'loss':17s} {'backend':8s} {'N x D':>9s} {'dtype':9s} {'loss err':>9s} {'tol':>8s} {'grad err':>9s} {'tol':>8s}  result"
    print(head)
    print("-" * len(head))
    failures = 0
    t0 = time.perf_counter()
    for case in cases:
        for be in backends:
            if be == "triton" and not case.infonce_family:
                continue
            for n, d in shapes:
                for dt in dtypes:
                    try:
                        c = compare(case, n, d, dt, be, device=args.device)
                        ok = c.ok
                        cols = f"{c.loss_err:9.2e} {c.loss_tol:8.1e} {c.grad_err:9.2e} {c.grad_tol:8.1e}"
                    except Exception as e:  # a crash is a failure, reported, not fatal to the table
                        ok = False
                        cols = f"error: {type(e).__name__}: {e}"[:38].ljust(38)
                    failures += not ok
                    name = str(dt).replace("torch.", "")
                    print(f"{case.name:17s} {be:8s} {f'{n}x{d}':>9s} {name:9s} {cols}  {'PASS' if ok else 'FAIL'}",
                          flush=True)
    print(f"{'all passed' if not failures else f'{failures} FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] == "bench":
        from . import bench

        return bench.main(argv[1:])
    if argv and argv[0] == "check":
        argv = argv[1:]
    return check(argv)


if __name__ == "__main__":
    sys.exit(main())
