"""Static report of the Triton kernels: resources per kernel and launch config, and a FLOP model.

Runs on a machine without a GPU: every kernel of ``fused_contrastive.kernels.lse`` is compiled ahead
of time for sm_80 (A100) and sm_90 (H100) with each shipped launch config
(``fused_contrastive.core.triton_shared.configs.CONFIGS``; the same compiles as tests/test_triton_compile.py,
through ``fused_contrastive.tools.compile_survey``),
and ptxas reports registers and spills. Printed per kernel and config: registers per thread, spill
bytes (stores + loads), shared memory, the tensor-core instruction kind in the PTX, and the
tensor-core FLOPs of one launch at the given N, M, D. "blocks" are the block sizes (M rows, N
columns, D chunk; R rows of the norm prologue); "variant" is the feature set compiled ("full":
every optional term of the kernel on; "sym": the A-is-B backward; "nopos": every term but the
softmax over positives, the forward's "fwd" config; "wide": the row-statistics forward's "fwd_wide"
config, 128 x 256 tiles on sm_90).

FLOP model (matmul FLOPs only, 2 per multiply-add; exp / masks / norms are O(N*M) or O(N*D)):

    unit            = 2 N M D                    one N x M x D matmul
    lse_fwd         = 1 unit                     cosine tiles (row, positive and column LSE share them)
    lse_bwd_rows    = 2 units                    recompute + dl @ B_hat   (1 unit when only ds is needed)
    lse_bwd_cols    = 2 units * grad_cols / M    recompute + dl^T @ A_hat (only columns with a gradient)
    row_norm        = 2 N D                      (not a matmul; listed for completeness)

Per loss (forward + backward, gradients for every embedding), for every benchmark loss of the case
registry, recorded from the loss's own call: e.g. info_nce with keys and CLIP = 1 + 2 + 2 = 5 units,
symmetric SimCSE (A is B) = 1 + 2 = 3 units. Time floor = FLOPs / peak
(default 790 TFLOP/s, dense bf16 on H100 SXM as this project models it).

Usage: python bench/kernel_report.py [--n 65536] [--d 768] [--peak-tflops 790] [--jobs 2]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, do not interpret

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from fused_contrastive.tools import compile_survey


def launch_flops(launch) -> int:
    """Tensor-core FLOPs of one recorded launch (see the module docstring)."""
    a = launch.args
    if launch.name == "row_norm":
        return 2 * a["N"] * a["D"]
    unit = 2 * a["N"] * a["M"] * a["D"]
    if launch.name == "lse_fwd":
        return unit
    if launch.name == "lse_bwd_rows":
        return unit * (2 if launch.constexprs["NEED_DX"] else 1)
    if launch.name == "lse_bwd_cols":
        return 2 * unit * a["grad_cols"] // a["M"]
    raise ValueError(launch.name)


def _si(x: float) -> str:
    for unit, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= f:
            return f"{x / f:.2f} {unit}"
    return f"{x:.0f} "


def resource_table(jobs: int, n: int, m: int, d: int):
    todo = compile_survey.jobs()
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        results = list(ex.map(compile_survey.run_job, todo))
    # FLOPs of one launch of each kernel at (n, m, d), from a recorded "full"/"sym" problem with
    # all columns needing a gradient (the kernel's cost does not depend on the config)
    flops = {}
    for variant in ("plain", "sym"):
        spec, data, has_b, want_col, want_pos = compile_survey.variant_problem(variant, n, m)
        for launch in compile_survey.record_core(spec, data, has_b, want_col, want_pos, torch.float16, n,
                                                 m if has_b else n, d,
                                      "sm90"):
            flops.setdefault((launch.name, variant == "sym"), launch_flops(launch))
    hdr = (f"{'kernel':13s} {'arch':5s} {'dtype':5s} {'D buckets':14s} {'variant':7s} {'blocks':14s} "
           f"{'warps':>5s} {'stages':>6s} {'regs':>4s} {'spill B':>7s} {'smem B':>7s} {'tensor core':11s} "
           f"{'FLOPs/launch':>13s}")
    print(hdr)
    print("-" * len(hdr))
    results.sort(key=lambda r: (r["kernel"], r["cc"], r["dtype"], r["buckets"], r["variant"]))
    for r in results:
        fl = flops.get((r["kernel"], r["variant"] == "sym"), flops.get((r["kernel"], False)))
        tc = {"mma": "mma.sync", "wgmma": "wgmma", "none": "-"}[r["tc"]]
        print(f"{r['kernel']:13s} sm_{r['cc']:<2d} {r['dtype']:5s} {','.join(r['buckets']):14s} "
              f"{r['variant'] if r['kernel'] != 'row_norm' else '-':7s} {r['block']:14s} "
              f"{r['num_warps']:5d} {r['num_stages']:6d} "
              f"{r['regs']:4d} {r['spill_stores'] + r['spill_loads']:7d} {r['shared']:7d} {tc:11s} "
              f"{(_si(fl) + 'FLOP') if fl is not None else '-':>13s}")
    return results


def loss_totals(n: int, d: int, peak_tflops: float):
    """FLOPs of every benchmark loss that runs on the kernels, from the registry (``tools.compile_survey.record_case``:
    the launches the loss itself makes), at N anchors."""
    from fused_contrastive.testing import BENCH_CASES

    unit = 2 * n * n * d
    print(f"\nForward + backward FLOPs of the benchmark losses at N = {n} anchors, D = {d} (unit = 2 N N D = "
          f"{_si(unit)}FLOP), time floor at {peak_tflops:g} TFLOP/s:")
    print(f"{'loss':13s} {'launches (FLOPs)':64s} {'total':>12s} {'units':>6s} {'floor':>10s}")
    for case in BENCH_CASES:
        if case.op != "core":
            continue
        launches = compile_survey.record_case(case.name, n, d, "sm90")
        parts = [(lz.name, launch_flops(lz)) for lz in launches]
        total = sum(f for _, f in parts)
        mm = [f"{k}={_si(f)}" for k, f in parts if k != "row_norm"]
        floor_ms = total / (peak_tflops * 1e12) * 1e3
        print(f"{case.name:13s} {' + '.join(mm):64s} {_si(total) + 'FLOP':>12s} {total / unit:6.2f} {floor_ms:8.2f} ms")
        print(f"{'':13s} ({case.inputs})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile processes")
    args = ap.parse_args(argv)
    print(f"fused-contrastive Triton kernels, triton {__import__('triton').__version__}, "
          f"torch {torch.__version__}; AOT targets sm_80 and sm_90 (no GPU needed)\n")
    results = resource_table(args.jobs, args.n, args.n, args.d)
    loss_totals(args.n, args.d, args.peak_tflops)
    spills = [r for r in results if r["spill_stores"] or r["spill_loads"]]
    print(f"\n{len(results)} compiles, {len(spills)} with spills.")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
