"""Where the GPU time of the panel path goes: a kernel-time breakdown (``torch.profiler``) of one
forward + backward per loss and panel-GEMM form, and the epilogue GEMM's launch configurations timed
side by side. Needs a CUDA device; prints plain text (commit it under ``bench/results/``).

    python bench/gpu_profile.py --n 65536 --losses info_nce,simcse,clip
    python bench/gpu_profile.py --n 65536 --losses siglip --siglip-forms --configs siglip_eager
    python bench/gpu_profile.py --n 2048 --losses "" --no-profile --matryoshka-loads
    python bench/gpu_profile.py --n 65536 --losses info_nce,clip,siglip --no-profile --epi-forms
    python bench/gpu_profile.py --n 65536 --losses "" --no-profile --configs one_pass,stats

Every figure is measured in this run, on this device (CUDA events and the profiler's device times,
medians over ``--repeats``); nothing here is modelled. The inputs are the ``check --gpu-validate``
timing rows' (``gpu_validate.parity_case``, regime "flat", D = 768, bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

import torch

from fused_contrastive.core.triton_shared import configs as CFG
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.core.triton_shared.configs import LaunchConfig
from fused_contrastive.gpu_validate import _env, _timer, kernels_only, parity_case, triton_path

#: Launch configurations of the epilogue GEMM tried by ``--configs`` (BLOCK_M, BLOCK_N, BLOCK_K, warps,
#: stages), per mode; the first of each is the shipped one (``CFG.EPI_GEMM``).
CONFIGS = {
    "one_pass": [CFG.EPI_GEMM["one_pass"], LaunchConfig(128, 128, 64, 8, 3), LaunchConfig(64, 128, 64, 4, 4),
                 LaunchConfig(64, 128, 64, 4, 3), LaunchConfig(128, 64, 64, 4, 4), LaunchConfig(64, 256, 64, 8, 3),
                 LaunchConfig(64, 64, 64, 4, 4),
                 # 128 x 256 at 16 warps (128 registers, no spills on sm_90): the H200 timed it 1.00-1.03x the
                 # shipped one (bench/results/h200-bench-gpu-2, fused_contrastive[one_pass=128x256w16])
                 LaunchConfig(128, 256, 64, 16, 3)],
    "known": [CFG.EPI_GEMM["known"], LaunchConfig(64, 128, 64, 4, 4), LaunchConfig(64, 64, 64, 4, 4),
              LaunchConfig(128, 128, 64, 8, 3), LaunchConfig(128, 64, 64, 8, 3)],
    "stats": [CFG.EPI_GEMM["stats"], LaunchConfig(128, 128, 64, 8, 4), LaunchConfig(64, 128, 64, 8, 3),
              LaunchConfig(128, 64, 64, 4, 4), LaunchConfig(128, 256, 64, 16, 3)],
    # SigLIP's one pass (MODE 5): both epilogues live; 128 x 128 spilled at compile time (kept to measure it)
    "siglip_eager": [CFG.EPI_GEMM["siglip_eager"], LaunchConfig(128, 64, 64, 8, 4),
                     LaunchConfig(64, 128, 64, 8, 3), LaunchConfig(64, 128, 64, 4, 4),
                     LaunchConfig(128, 128, 64, 8, 4)],
}
#: The loss whose epilogue GEMM runs in each mode (InfoNCE: the one-pass sweep; CLIP: known statistics; SigLIP's
#: mean: its one pass).
MODE_LOSS = {"one_pass": "info_nce", "known": "clip", "stats": "clip", "siglip_eager": "siglip"}


def _setup(loss: str, n: int, d: int, dt: torch.dtype, device: str = "cuda", per_row: bool = False):
    """One fwd + bwd of the ``check --gpu-validate`` timing row of ``loss`` as a closure. ``per_row``: the
    per-row losses (``reduction="none"``), summed and divided by N by the caller (the same value as the
    mean; for SigLIP the two-sweep form where the mean takes the one pass)."""
    case, (tensors, kwargs) = parity_case(loss, n, d, 7, "flat")
    kwargs = {k: (v.to(device=device, dtype=dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else
                  v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    if per_row:
        kwargs["reduction"] = "none"
    leaves = {k: (v.to(device=device, dtype=dt) if v.dim() else v.to(device)).clone().requires_grad_(True)
              for k, v in tensors.items()}

    def step():
        for v in leaves.values():
            v.grad = None
        out = case.fn(**leaves, **kwargs, backend="triton")
        (out.sum() / out.shape[0] if per_row else out).backward()

    step.leaves = tuple(leaves.values())
    return step


def _kernel_ms(step, rows: int = 0, title: str = "") -> dict[str, float]:
    """Device time per kernel name of one ``step()`` under the profiler (printed, ``rows`` of them)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    out = {e.key: e.self_device_time_total / 1e3 for e in events}
    if rows:
        print(f"\n## {title}: kernels sum to {sum(out.values()):.2f} ms (device time)")
        for e in events[:rows]:
            print(f"  {e.self_device_time_total / 1e3:9.2f} ms  {e.count:5d} calls  {e.key[:110]}")
    return out


def profile(loss: str, n: int, d: int, path: str, rows: int) -> None:
    """One fwd + bwd under the profiler: the kernels by device time, and their sum."""
    step = _setup(loss, n, d, torch.bfloat16)
    with triton_path(path):
        step()
        _kernel_ms(step, rows, f"{loss} N={n} D={d} bf16, path {path}")
    del step
    torch.cuda.empty_cache()


def time_paths(loss: str, n: int, d: int, paths: list[str], repeats: int) -> None:
    """Medians of fwd + bwd (CUDA events) per path, side by side in this run."""
    measure = _timer("cuda")
    step = _setup(loss, n, d, torch.bfloat16)
    cells = []
    for path in paths:
        with triton_path(path):
            step()
            cells.append(f"{path} {statistics.median(measure(step) for _ in range(repeats)):.2f} ms")
    print(f"timing {loss} N={n} D={d} bf16 median of {repeats}: " + ", ".join(cells), flush=True)
    del step
    torch.cuda.empty_cache()


def time_siglip_forms(n: int, d: int, repeats: int) -> None:
    """SigLIP's two forms on the epilogue GEMM, fwd + bwd medians side by side in this run: the mean's one
    pass (MODE 5, the losses and the gradient tile together: 3 matmul units) and per-row losses summed by
    the caller (MODE 4, a losses sweep then a gradient sweep: 4 units). The route takes the one pass where
    ``bench/gpu_model.py --siglip`` models it faster; this is the measurement to check that against."""
    measure = _timer("cuda")
    cells = []
    for label, per_row in (("one pass (mean)", False), ("two sweeps (per-row losses)", True)):
        step = _setup("siglip", n, d, torch.bfloat16, per_row=per_row)
        with triton_path("panel"):
            step()
            cells.append(f"{label} {statistics.median(measure(step) for _ in range(repeats)):.2f} ms")
        del step
        torch.cuda.empty_cache()
    print(f"timing siglip N={n} D={d} bf16 median of {repeats}: " + ", ".join(cells), flush=True)


def time_epi_forms(loss: str, n: int, d: int, repeats: int, device: str = "cuda") -> None:
    """The epilogue GEMM's tile-loop forms (``panels.EPI_FORMS``: one program per tile, persistent,
    persistent with TMA operand tiles) on ``loss``'s panel route, fwd + bwd medians alternating in this run,
    the epilogue GEMMs' device time of each (profiler) and whether its gradients equal the tiles form's
    bitwise (they compute the same tiles in the same order)."""
    measure = _timer(device)
    step = _setup(loss, n, d, torch.bfloat16, device=device)
    times = {f: [] for f in panels.EPI_FORMS}
    grads, epi = {}, {}
    with triton_path("panel"):
        for form in panels.EPI_FORMS:
            with _env(panels.EPI_FORM_ENV, form):
                step()  # compile
                grads[form] = [t.grad.clone() for t in step.leaves if t.grad is not None]
                epi[form] = sum(v for k, v in _kernel_ms(step).items() if k.startswith("epi_gemm"))
        for _ in range(repeats):
            for form in panels.EPI_FORMS:
                with _env(panels.EPI_FORM_ENV, form):
                    times[form].append(measure(step))
    base = statistics.median(times["tiles"])
    cells = []
    for form in panels.EPI_FORMS:
        ms = statistics.median(times[form])
        same = all(torch.equal(a, b) for a, b in zip(grads[form], grads["tiles"], strict=True))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads[form], grads["tiles"],
                                                                              strict=True))
        cells.append(f"{form} {ms:.2f} ms ({base / ms:.2f}x tiles; epi_gemm {epi[form]:.2f} ms device; gradients "
                     f"{'bitwise equal' if same else f'differ by up to {diff:.3g}'})")
    print(f"timing epi forms {loss} N={n} D={d} bf16 median of {repeats}: " + ", ".join(cells), flush=True)
    del step
    torch.cuda.empty_cache()


#: The Matryoshka levels of ``--matryoshka-loads`` (every boundary a multiple of 16: the kernels' ALIGNED form).
MATRYOSHKA_DIMS = (768, 512, 256, 128, 64)


@contextlib.contextmanager
def matryoshka_aligned(on: bool):
    """The Matryoshka kernels with their 16-byte operand loads (``on``, what the code takes for boundaries that
    are multiples of 16) or with the scalar loads of boundaries the compiler cannot prove aligned (``ALIGNED``
    forced off: the form before 16-byte loads, the same results)."""
    from fused_contrastive.core.matryoshka import triton_levels as TM

    orig = TM._flags

    def flags(levels, spec):
        f = orig(levels, spec)
        return dict(f, ALIGNED=f["ALIGNED"] and on)

    TM._flags = flags
    try:
        yield
    finally:
        TM._flags = orig


def _matryoshka_setup(n: int, d: int, device: str = "cuda"):
    """One fwd + bwd of Matryoshka InfoNCE (``MATRYOSHKA_DIMS`` cut to D) on the triton backend, bf16."""
    import fused_contrastive as fc

    g = torch.Generator(device="cpu").manual_seed(7)
    q, k = (torch.randn(n, d, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(True)
            for _ in range(2))
    dims = [x * d // 768 for x in MATRYOSHKA_DIMS]

    def step():
        q.grad = k.grad = None
        fc.info_nce(q, k, temperature=0.05, backend="triton", matryoshka_dims=dims).backward()

    step.leaves = (q, k)
    return step


def matryoshka_route(route: str):
    """``FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE`` = ``route`` within the block (the environment put back after)."""
    return mock.patch.dict(os.environ, {"FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE": route})


#: The forms --matryoshka-loads times side by side: (label, route, 16-byte loads).
MATRYOSHKA_FORMS = (("16-byte loads", "kernels", True), ("scalar loads", "kernels", False),
                    ("suffix backward", "suffix", True))


def time_matryoshka_loads(n: int, d: int, repeats: int) -> None:
    """The Matryoshka kernels (what the triton backend runs for levels below the panel path's size): their
    own backward with 16-byte operand loads and with the scalar ones, and the suffix backward (what "auto"
    takes for 16-bit inputs from N x M = 2^20), fwd + bwd medians alternating in this run, and how far the
    suffix backward's gradients are from the kernels' (max |difference| / max |gradient|)."""
    measure = _timer("cuda")
    step = _matryoshka_setup(n, d)
    times = {label: [] for label, _, _ in MATRYOSHKA_FORMS}
    grads = {}
    for label, route, on in MATRYOSHKA_FORMS:
        with matryoshka_route(route), matryoshka_aligned(on):
            step()  # compile
            grads[label] = torch.cat([t.grad.float().flatten() for t in step.leaves])
    for _ in range(repeats):
        for label, route, on in MATRYOSHKA_FORMS:
            with matryoshka_route(route), matryoshka_aligned(on):
                times[label].append(measure(step))
    med = {label: statistics.median(v) for label, v in times.items()}
    ref = grads["16-byte loads"]
    rel = float((grads["suffix backward"] - ref).abs().max() / ref.abs().max())
    print(f"timing matryoshka5 info_nce N={n} D={d} bf16 median of {repeats}: "
          + ", ".join(f"{label} {ms:.2f} ms" for label, ms in med.items())
          + f"; scalar / 16-byte {med['scalar loads'] / med['16-byte loads']:.2f}x, suffix / kernels' backward "
          f"{med['suffix backward'] / med['16-byte loads']:.2f}x; suffix gradients off the kernels' by {rel:.1e} "
          "of max |grad|", flush=True)
    del step
    torch.cuda.empty_cache()


def sweep_configs(mode: str, n: int, d: int, repeats: int) -> None:
    """The epilogue GEMM's configurations of ``mode``, each timed on its loss (fwd + bwd, median)."""
    measure = _timer("cuda")
    loss = MODE_LOSS[mode]
    step = _setup(loss, n, d, torch.bfloat16)
    shipped = CFG.EPI_GEMM[mode]
    try:
        for cfg in CONFIGS[mode]:
            CFG.EPI_GEMM[mode] = cfg  # the dict the host code reads (shared object)
            try:
                with triton_path("panel"):
                    step()
                    ms = statistics.median(measure(step) for _ in range(repeats))
                    kern = _kernel_ms(step)
                epi = sum(v for k, v in kern.items() if k.startswith("epi_gemm"))
                print(f"config {mode} {loss} N={n}: {cfg.block_m}x{cfg.block_n}x{cfg.block_d} w{cfg.num_warps} "
                      f"s{cfg.num_stages}: step {ms:.2f} ms (wall), epi_gemm {epi:.2f} ms, all kernels "
                      f"{sum(kern.values()):.2f} ms (device)", flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not compile / fit: say so, go on
                print(f"config {mode} {cfg}: raised {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    finally:
        CFG.EPI_GEMM[mode] = shipped
    del step
    torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="65536", help="comma-separated batch sizes (default 65536)")
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--losses", default="info_nce,simcse,clip")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=10, help="kernels listed per profile")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--configs", default="", help="time the epilogue GEMM's configurations of these modes "
                    "(comma-separated: one_pass, known, stats, siglip_eager)")
    ap.add_argument("--siglip-forms", action="store_true",
                    help="time SigLIP's one pass (the mean) against its two sweeps (per-row losses) side by side")
    ap.add_argument("--epi-forms", action="store_true",
                    help="time the epilogue GEMM's tile-loop forms (tiles, persistent, tma) on each of --losses")
    ap.add_argument("--matryoshka-loads", action="store_true",
                    help="time the Matryoshka kernels with 16-byte operand loads against scalar ones, and their "
                    "suffix backward (use an N "
                    "below the panel path's, N * N < 2^24, where the triton backend runs these kernels)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_profile.py needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    sizes = [int(x) for x in args.n.split(",")]
    losses = [x for x in args.losses.split(",") if x]
    with kernels_only():
        for n in sizes:
            for loss in losses:
                time_paths(loss, n, args.d, ["panel", "panel-cublas"], args.repeats)
        if not args.no_profile:
            for loss in losses:
                for path in ("panel", "panel-cublas"):
                    with contextlib.suppress(torch.cuda.OutOfMemoryError):
                        profile(loss, max(sizes), args.d, path, args.rows)
        if args.siglip_forms:
            for n in sizes:
                time_siglip_forms(n, args.d, args.repeats)
        if args.epi_forms:
            for n in sizes:
                for loss in losses:
                    time_epi_forms(loss, n, args.d, args.repeats)
        if args.matryoshka_loads:
            for n in sizes:
                time_matryoshka_loads(n, args.d, args.repeats)
        for mode in filter(None, args.configs.split(",")):
            sweep_configs(mode, max(sizes), args.d, args.repeats)
    print(f"\nwall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
