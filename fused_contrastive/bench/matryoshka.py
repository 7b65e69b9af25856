"""``python -m fused_contrastive bench-matryoshka``: the Matryoshka loss over in-batch negatives (MNRL /
InfoNCE, target i, temperature 0.05) at dims 768/512/256/128/64 in one pass, next to the single plain
loss, the textbook K-loss formula and sentence-transformers' MatryoshkaLoss computation, on the same
embeddings, forward + backward.

Contenders, all on the same q, k [N, D] (float32, requires grad):

* ``plain``: ``info_nce(q, k)`` on the torch backend at the full dimension: one loss, the cost the levels
  add is measured against;
* ``one-pass``: ``info_nce(q, k, matryoshka_dims=dims)`` on the torch backend (every level in one pass
  over D, ``core/matryoshka/torch_levels.py``);
* ``formula``: ``sum_k CE(normalize(q[:, :d_k]) @ normalize(k[:, :d_k]).T / t, arange(N))``: K dense
  N x N matrices;
* ``sentence-transformers``: what their ``MatryoshkaLoss`` does for a ``MultipleNegativesRankingLoss``
  (``shrink`` then their loss per dim, ``compute_loss_from_embeddings``), when installed.

Time: the contenders alternate within each repeat (the order reversed every other repeat), medians
over the repeats, so the ratios come from one run on one machine state. Peak memory: each contender
in a fresh process, the resident-set high-water mark over the baseline after the inputs exist (CPU;
``max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import info_nce
from ..losses._levels import shrink
from .helptext import help_text
from .memory import step_peak
from .outputs import publish

TEMPERATURE = 0.05


def _formula(q, k, dims):
    t = torch.arange(q.shape[0], device=q.device)
    return sum(F.cross_entropy(F.normalize(q[:, :d], dim=-1) @ F.normalize(k[:, :d], dim=-1).T / TEMPERATURE, t)
               for d in dims)


def _st_loss():
    """sentence-transformers' MultipleNegativesRankingLoss (scale 1 / 0.05 = 20), or None."""
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        return None
    return losses.MultipleNegativesRankingLoss(torch.nn.Identity(), scale=1.0 / TEMPERATURE)


def contenders(dims: list[int], only: str | None = None, backend: str = "torch") -> dict[
        str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Name -> loss of (q, k) ("plain" and "one-pass" on ``backend``); ``only``: just that one (a
    peak-memory process imports nothing else)."""
    out = {
        "plain": lambda q, k: info_nce(q, k, temperature=TEMPERATURE, backend=backend),
        "one-pass": lambda q, k: info_nce(q, k, temperature=TEMPERATURE, backend=backend, matryoshka_dims=dims),
        "formula": lambda q, k: _formula(q, k, dims),
    }
    if only is not None and only != "sentence-transformers":
        return {only: out[only]}
    st = _st_loss()
    if only is not None:
        out = {}
    if st is not None:
        out["sentence-transformers"] = lambda q, k: sum(
            st.compute_loss_from_embeddings([shrink(q, d), shrink(k, d)], None) for d in dims)
    return out


def _inputs(n: int, d: int, device: str, dtype: str = "float32"):
    g = torch.Generator().manual_seed(n)
    dt = getattr(torch, dtype)
    q = torch.randn(n, d, generator=g).to(device=device, dtype=dt).requires_grad_()
    k = torch.randn(n, d, generator=g).to(device=device, dtype=dt).requires_grad_()
    return q, k


def _step(fn, q, k) -> torch.Tensor:
    q.grad = k.grad = None
    loss = fn(q, k)
    loss.backward()
    return loss.detach()


def _peak(args: tuple[dict[str, Any], int, str]) -> int:
    a, n, name = args
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    fn = contenders(a["dims"], only=name, backend=a.get("backend", "torch"))[name]
    q, k = _inputs(min(n, 256), a["d"], a["device"], a.get("dtype", "float32"))
    _step(fn, q, k)  # warm-up at a small size (allocator, code paths)
    q, k = _inputs(n, a["d"], a["device"], a.get("dtype", "float32"))
    return step_peak(a["device"], lambda: _step(fn, q, k))


def measure(a: dict[str, Any]) -> dict[str, Any]:
    """Times (alternating, medians) and fresh-process peaks of every contender at every N."""
    import tqdm  # the [bench] extra

    if a["threads"]:
        torch.set_num_threads(a["threads"])
    fns = contenders(a["dims"], backend=a.get("backend", "torch"))
    sync = torch.cuda.synchronize if a["device"].startswith("cuda") else (lambda: None)
    rows = []
    ctx = mp.get_context("spawn")
    for n in tqdm.tqdm(a["sizes"], desc="bench-matryoshka (sizes)", disable=not a.get("progress", True)):
        q, k = _inputs(n, a["d"], a["device"], a.get("dtype", "float32"))
        values = {name: float(_step(fn, q, k)) for name, fn in fns.items()}  # warm-up, and the values
        times: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(a["repeats"]):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                sync()
                t0 = time.perf_counter()
                _step(fns[name], q, k)
                sync()
                times[name].append(time.perf_counter() - t0)
        del q, k
        peaks = {}
        for name in fns:
            with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as ex:
                peaks[name] = ex.submit(_peak, (a, n, name)).result()
        rows.append({"n": n, "median_s": {k: statistics.median(v) for k, v in times.items()}, "times_s": times,
                     "peak_bytes": peaks, "loss": values})
    return {"config": a, "rows": rows}


def render(res: dict[str, Any]) -> str:
    from tabulate import tabulate  # the [bench] extra: imported when the table is made
    a = res["config"]
    names = list(res["rows"][0]["median_s"])
    others = [x for x in names if x != "one-pass"]
    head = ["N"] + [f"{x} ms" for x in names] + [f"one-pass / {x}" for x in others]
    table = []
    for r in res["rows"]:
        med = r["median_s"]
        table.append([str(r["n"])] + [f"{med[x] * 1e3:.0f}" for x in names]
                     + [f"{med['one-pass'] / med[x]:.2f}x" for x in others])
    mem_head = ["N"] + [f"{x} MiB" for x in names] + [f"one-pass / {x}" for x in others]
    mem = [[str(r["n"])] + [f"{r['peak_bytes'][x] / (1 << 20):.0f}" for x in names]
           + [f"{r['peak_bytes']['one-pass'] / max(r['peak_bytes'][x], 1):.2f}x" for x in others] for r in res["rows"]]
    dims = "/".join(str(d) for d in a["dims"])
    return "\n".join([
        (f"Matryoshka InfoNCE / MNRL, dims {dims}, D = {a['d']}, {a.get('dtype', 'float32')}, plain and one-pass "
         f"on backend {a.get('backend', 'torch')}, forward + backward, {a['device']}, "
         f"medians of {a['repeats']} alternating repeats; ratios = this library's one-pass loss / the other "
         "(below 1: it is faster / holds less)"),
        tabulate(table, headers=head, tablefmt="simple", disable_numparse=True),
        "",
        "peak memory over the inputs (a fresh process per contender)",
        tabulate(mem, headers=mem_head, tablefmt="simple", disable_numparse=True),
    ])


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-matryoshka", help="the one-pass Matryoshka loss against one plain loss, the K-loss "
                                                "formula and sentence-transformers' MatryoshkaLoss",
                       description=help_text(__doc__))
    p.add_argument("--sizes", default="1024,2048,4096,8192", help="N, comma-separated (default 1024,2048,4096,8192)")
    p.add_argument("--dims", default="768,512,256,128,64", help="matryoshka dims (default 768,512,256,128,64)")
    p.add_argument("--d", type=int, default=768, help="embedding dimension (default 768)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each contender per N (default 5)")
    p.add_argument("--device", default="cpu", help="a torch device (default cpu)")
    p.add_argument("--backend", default="torch", choices=("torch", "triton", "auto"),
                   help="backend of the plain and one-pass losses (default torch; triton: the Matryoshka kernels "
                        "or the per-level route, whichever the code takes at the size)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="embedding dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="directory for bench_matryoshka.txt / .json (default: print only)")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        dims = [int(x) for x in args.dims.split(",") if x.strip()]
    except ValueError:
        parser.error("--sizes and --dims must be comma-separated integers")
    if not sizes or min(sizes) < 2:
        parser.error("--sizes must hold integers >= 2")
    if args.d < 1 or args.repeats < 1:
        parser.error("--d and --repeats must be >= 1")
    if not dims or min(dims) < 1 or max(dims) > args.d or len(set(dims)) != len(dims):
        parser.error(f"--dims must be distinct integers in [1, --d={args.d}]")
    res = measure({"sizes": sizes, "dims": dims, "d": args.d, "repeats": args.repeats, "device": args.device,
                   "threads": args.threads, "backend": args.backend, "dtype": args.dtype})
    text = render(res)
    publish(text, res, args.out, "bench_matryoshka")
    return 0
