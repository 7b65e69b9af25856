"""``python -m fused_contrastive bench-encode``: one SimCSE training step of a small transformer encoder
with and without :func:`fused_contrastive.encode_in_chunks`, side by side.

Time: the two steps alternate in one process (ABBA rounds, so neither always runs first), medians
over the repeats. Peak memory: each step in a fresh process, the resident-set high-water mark over
the baseline after the model and inputs exist (``bench/memory.py``'s CPU meter; on CUDA
``max_memory_allocated``). The cached step does one more encoder forward than the plain one (the
recompute), so its floor is about 4/3 of the plain step's time.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from torch import nn

from .. import simcse_loss
from ..encode import encode_in_chunks
from .helptext import help_text
from .memory import step_peak


class SmallTransformer(nn.Module):
    """Token features [n, L, F] -> mean-pooled [n, D]: 2 post-norm layers, 4 heads, dropout 0.1."""

    def __init__(self, features: int = 64, width: int = 128, ffn: int = 512, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(features, width)
        layer = nn.TransformerEncoderLayer(width, 4, ffn, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.inp(x)).mean(1)


def _setup(a: dict[str, Any]):
    torch.manual_seed(0)
    dev = torch.device(a["device"])
    model = SmallTransformer().to(dev)
    # the SimCSE batch: every sentence twice (interleaved), two dropout views
    x = torch.randn(a["batch"] // 2, a["seq"], 64, device=dev).repeat_interleave(2, 0)
    return model, x


def _step(model, x, how: str, chunk: int) -> None:
    model.zero_grad(set_to_none=True)
    z = model(x) if how == "plain" else encode_in_chunks(model, x, chunk)
    simcse_loss(z).backward()


def _peak(args: tuple[dict[str, Any], str]) -> int:
    a, how = args
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    model, x = _setup(a)
    _step(model, x[: 2 * a["chunk"]], how, a["chunk"])  # warm-up at a small size (allocator, kernels)
    model.zero_grad(set_to_none=True)
    return step_peak(a["device"], lambda: _step(model, x, how, a["chunk"]))


def measure(a: dict[str, Any]) -> dict[str, Any]:
    """Times and peaks of the plain and the cached step (see the module docstring)."""
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    model, x = _setup(a)
    sync = torch.cuda.synchronize if a["device"].startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {"plain": [], "cached": []}
    for how in times:  # warm-up
        _step(model, x, how, a["chunk"])
    for r in range(a["repeats"]):
        for how in (("plain", "cached") if r % 2 == 0 else ("cached", "plain")):
            sync()
            t0 = time.perf_counter()
            _step(model, x, how, a["chunk"])
            sync()
            times[how].append(time.perf_counter() - t0)
    peaks = {}
    ctx = mp.get_context("spawn")
    for how in times:
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as ex:
            peaks[how] = ex.submit(_peak, (a, how)).result()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"config": a, "median_s": med, "times_s": times, "peak_bytes": peaks,
            "time_ratio": med["cached"] / med["plain"], "peak_ratio": peaks["cached"] / max(peaks["plain"], 1)}


def render(res: dict[str, Any]) -> str:
    from tabulate import tabulate  # the [bench] extra: imported when the table is made
    a = res["config"]
    rows = [[how, f"{res['median_s'][how] * 1e3:.0f}", f"{res['peak_bytes'][how] / (1 << 20):.0f}"]
            for how in ("plain", "cached")]
    return "\n".join([
        (f"SimCSE step of a 2-layer transformer (width 128, FFN 512, L={a['seq']}), batch {a['batch']}, "
         f"chunk {a['chunk']}, {a['device']}, medians of {a['repeats']} alternating repeats"),
        tabulate(rows, headers=["step", "time ms", "peak MiB"], tablefmt="simple", disable_numparse=True),
        (f"cached / plain: time {res['time_ratio']:.2f}x, peak memory {res['peak_ratio']:.2f}x (this library's "
         "encode_in_chunks step / the plain step; below 1: it is faster / holds less)"),
    ])


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-encode", help="time and memory of encode_in_chunks against a plain step",
                       description=help_text(__doc__))
    p.add_argument("--batch", type=int, default=1024, help="examples per step (default 1024)")
    p.add_argument("--chunk", type=int, default=64, help="chunk size of the cached step (default 64)")
    p.add_argument("--seq", type=int, default=32, help="tokens per example (default 32)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps of each (default 10)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for name in ("batch", "chunk", "seq", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.batch % 2:
        parser.error("--batch must be even (two dropout views per sentence)")
    res = measure({k: getattr(args, k) for k in ("batch", "chunk", "seq", "repeats", "device", "threads")})
    print(render(res))
    return 0
