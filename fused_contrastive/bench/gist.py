"""``python -m fused_contrastive bench-gist``: the GISTEmbed loss (guided in-batch negatives, temperature
0.01, absolute margin 0) forward + backward, the fused ``gist_loss`` next to the textbook computation
with B x B matrices, on the same embeddings.

Contenders, all on the same model embeddings a, p, n [B, D] (float32, requires grad) and frozen guide
embeddings ga, gp, gn [B, Dg] (no grad):

* ``fused``: ``gist_loss(a, p, n, guide=(ga, gp, gn), temperature=0.01, backend="torch")``
  (``losses/guided.py``): one merged-softmax pass over the four column blocks, the guide mask computed
  per tile and never stored, O(B*D) memory;
* ``textbook``: the sentence-transformers-style computation written with matrix products: for each of
  the blocks anchor-positive, anchor-anchor, positive-positive and anchor-negative the model cosine
  matrix (``F.normalize`` + ``mm``) and the guide cosine matrix; the entries whose guide cosine is
  ``> gpos_i - margin`` (``gpos`` = the diagonal of the guide's anchor-positive matrix) set to -inf,
  the anchor-positive diagonal protected; ``torch.cat`` of the four blocks, divided by the temperature,
  ``F.cross_entropy`` with target ``arange(B)``. sentence-transformers' own ``GISTEmbedLoss`` computes
  the same scores with a broadcasting ``nn.CosineSimilarity`` (``x.unsqueeze(1)`` against
  ``y.unsqueeze(0)``), which materialises B x B x D tensors (48 GiB per block at B = 4096, D = 768 in
  float32): it cannot run at these sizes, so the matrix-product form stands in for it (same scores,
  same mask, same loss).

Inputs (seeded by B, ``_inputs``): a noisy, correlated view, so that the guide drops some but not all
in-batch negatives. 16 topic centres c_t ~ N(0, I_D) and a topic t(i) per row;
``a_i = c_t(i) + z_i`` (same-topic anchors have cosine about 0.5); ``p_i = a_i + s_i e_i`` with
``s_i ~ U(0.5, 3)`` (close and loose paraphrases: positive cosines from about 0.94 down to 0.43);
``n_i = c_t(i) + z'_i`` (a hard negative: same topic, another text); z, z', e ~ N(0, I_D). The guide
of any text x is ``x W + 0.5 xi`` with one random projection W ~ N(0, 1/D) [D, Dg] and fresh noise
xi ~ N(0, I_Dg) per text. Rows with loose positives then drop their same-topic columns and their own
hard negative (about 0.6% of the in-batch negatives and 17% of the rows' own hard negatives at D = 768,
Dg = 384); the table reports both fractions.

Time: the contenders alternate within each repeat (the order reversed every other repeat), medians
over the repeats. Peak memory: each contender in a fresh process, the resident-set high-water mark
over the baseline after the inputs exist (CPU; ``max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..losses.guided import gist_loss
from .helptext import help_text
from .memory import step_peak
from .outputs import publish, sizes_arg

TEMPERATURE = 0.01
MARGIN = 0.0
TOPICS = 16
PARAPHRASE_NOISE = (0.5, 3.0)
GUIDE_NOISE = 0.5
NAMES = ("textbook", "fused")

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1) @ F.normalize(y, dim=-1).T


def guide_masks(ga: torch.Tensor, gp: torch.Tensor, gn: torch.Tensor, margin: float = MARGIN) -> list[torch.Tensor]:
    """The dropped entries of the blocks anchor-positive, anchor-anchor, positive-positive and
    anchor-negative ([B, B] bool each): guide cosine ``> gpos_i - margin``, the anchor-positive diagonal
    kept."""
    with torch.no_grad():
        g_ap = _cos(ga, gp)
        theta = g_ap.diagonal().view(-1, 1) - margin
        keep = torch.eye(ga.shape[0], dtype=torch.bool, device=ga.device)
        return [(g_ap > theta) & ~keep, _cos(ga, ga) > theta, _cos(gp, gp) > theta, _cos(ga, gn) > theta]


def textbook(a, p, n, ga, gp, gn, temperature: float = TEMPERATURE, margin: float = MARGIN) -> torch.Tensor:
    """GISTEmbed with the four B x B blocks materialised (model and guide cosine matrices, masks)."""
    masks = guide_masks(ga, gp, gn, margin)
    blocks = [_cos(x, y).masked_fill_(m, float("-inf")) for (x, y), m in zip(((a, p), (a, a), (p, p), (a, n)), masks,
                                                                                  strict=True)]
    scores = torch.cat(blocks, dim=1) / temperature
    return F.cross_entropy(scores, torch.arange(a.shape[0], device=a.device))


def contenders(only: str | None = None, backend: str = "torch") -> dict[str, Callable[..., torch.Tensor]]:
    """Name -> loss of (a, p, n, ga, gp, gn) ("fused" on ``backend``); ``only``: just that one."""
    out = {
        "textbook": textbook,
        "fused": lambda a, p, n, ga, gp, gn: gist_loss(a, p, n, guide=(ga, gp, gn), temperature=TEMPERATURE,
                                                       margin=MARGIN, backend=backend),
    }
    return out if only is None else {only: out[only]}


def _inputs(b: int, d: int, dg: int, device: str, dtype: torch.dtype = torch.float32) -> Inputs:
    """The module docstring's construction, seeded by ``b``: (a, p, n) requiring grad, (ga, gp, gn) not."""
    g = torch.Generator().manual_seed(b)
    topic = torch.randint(TOPICS, (b,), generator=g)
    centres = torch.randn(TOPICS, d, generator=g, dtype=torch.float64)
    a = centres[topic] + torch.randn(b, d, generator=g, dtype=torch.float64)
    lo, hi = PARAPHRASE_NOISE
    s = lo + (hi - lo) * torch.rand(b, 1, generator=g, dtype=torch.float64)
    p = a + s * torch.randn(b, d, generator=g, dtype=torch.float64)
    n = centres[topic] + torch.randn(b, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, dg, generator=g, dtype=torch.float64) / math.sqrt(d)
    guides = [x @ w + GUIDE_NOISE * torch.randn(b, dg, generator=g, dtype=torch.float64) for x in (a, p, n)]
    model = [x.to(device=device, dtype=dtype).requires_grad_() for x in (a, p, n)]
    return (*model, *(x.to(device=device, dtype=dtype) for x in guides))  # type: ignore[return-value]


def masked_fractions(x: Inputs) -> dict[str, float]:
    """What the guide drops: the fraction of the in-batch negatives (every column but the row's
    positive and, in the anchor-anchor and positive-positive blocks, the row itself), per block, and
    the fraction of rows whose own hard negative is dropped."""
    b = x[0].shape[0]
    masks = guide_masks(*x[3:])
    eye = torch.eye(b, dtype=torch.bool, device=x[0].device)
    counts = [int((m & ~eye).sum()) if k in (1, 2) else int(m.sum()) for k, m in enumerate(masks)]
    sizes = [b * b - b, b * b - b, b * b - b, b * b]
    blocks = ("anchor-positive", "anchor-anchor", "positive-positive", "anchor-negative")
    out = {k: c / s for k, c, s in zip(blocks, counts, sizes, strict=True)}
    out["in-batch negatives"] = sum(counts) / sum(sizes)
    out["own hard negative"] = float(masks[3].diagonal().float().mean())
    return out


def _step(fn, x: Inputs) -> torch.Tensor:
    for t in x[:3]:
        t.grad = None
    loss = fn(*x)
    loss.backward()
    return loss.detach()


def _peak(args: tuple[dict[str, Any], int, str]) -> int:
    a, n, name = args
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    fn = contenders(only=name, backend=a.get("backend", "torch"))[name]
    dt = getattr(torch, a.get("dtype", "float32"))
    _step(fn, _inputs(min(n, 256), a["dim"], a["guide_dim"], a["device"], dt))  # warm-up at a small size
    x = _inputs(n, a["dim"], a["guide_dim"], a["device"], dt)
    return step_peak(a["device"], lambda: _step(fn, x))


def measure(a: dict[str, Any]) -> dict[str, Any]:
    """Times (alternating, medians), fresh-process peaks, the losses and the masked fractions at every B."""
    import tqdm  # the [bench] extra

    if a["threads"]:
        torch.set_num_threads(a["threads"])
    fns = contenders(backend=a.get("backend", "torch"))
    sync = torch.cuda.synchronize if a["device"].startswith("cuda") else (lambda: None)
    rows = []
    ctx = mp.get_context("spawn")
    for n in tqdm.tqdm(a["sizes"], desc="bench-gist (sizes)", disable=not a.get("progress", True)):
        x = _inputs(n, a["dim"], a["guide_dim"], a["device"], getattr(torch, a.get("dtype", "float32")))
        masked = masked_fractions(x)
        values = {name: float(_step(fn, x)) for name, fn in fns.items()}  # warm-up, and the values
        times: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(a["repeats"]):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                sync()
                t0 = time.perf_counter()
                _step(fns[name], x)
                sync()
                times[name].append(time.perf_counter() - t0)
        del x
        peaks = {}
        for name in fns:
            with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as ex:
                peaks[name] = ex.submit(_peak, (a, n, name)).result()
        rows.append({"n": n, "median_s": {k: statistics.median(v) for k, v in times.items()}, "times_s": times,
                     "peak_bytes": peaks, "loss": values, "masked": masked})
    return {"config": a, "rows": rows}


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y > 0 else "-"


def render(res: dict[str, Any]) -> str:
    from tabulate import tabulate  # the [bench] extra: imported when the table is made
    a = res["config"]
    head = ["N", "textbook ms", "fused ms", "fused / textbook", "textbook MiB", "fused MiB", "fused / textbook peak",
            "negatives masked", "own hard neg. masked"]
    table = []
    for r in res["rows"]:
        med, peak = r["median_s"], r["peak_bytes"]
        table.append([str(r["n"]), f"{med['textbook'] * 1e3:.0f}", f"{med['fused'] * 1e3:.0f}",
                      _ratio(med["fused"], med["textbook"]), f"{peak['textbook'] / (1 << 20):.0f}",
                      f"{peak['fused'] / (1 << 20):.0f}", _ratio(peak["fused"], peak["textbook"]),
                      f"{100 * r['masked']['in-batch negatives']:.2f}%",
                      f"{100 * r['masked']['own hard negative']:.1f}%"])
    return "\n".join([
        (f"GISTEmbed loss (blocks a-p, a-a, p-p, a-n; temperature {TEMPERATURE}, absolute margin {MARGIN}), "
         f"D = {a['dim']}, guide D = {a['guide_dim']}, {a.get('dtype', 'float32')}, fused on backend "
         f"{a.get('backend', 'torch')}, forward + backward, {a['device']}, medians of "
         f"{a['repeats']} alternating repeats; peak memory over the inputs, a fresh process per contender; ratios = "
         "fused / textbook (this library / the other; below 1: this library is faster / holds less)"),
        tabulate(table, headers=head, tablefmt="simple", disable_numparse=True),
    ])


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-gist", help="the fused GISTEmbed loss (guide mask per tile) against the textbook "
                                          "computation with B x B matrices",
                       description=help_text(__doc__))
    p.add_argument("--sizes", default="1024,2048,4096,8192", help="B, comma-separated (default 1024,2048,4096,8192)")
    p.add_argument("--dim", type=int, default=768, help="model embedding dimension D (default 768)")
    p.add_argument("--guide-dim", type=int, default=384, help="guide embedding dimension Dg (default 384)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each contender per B (default 5)")
    p.add_argument("--device", default="cpu", help="a torch device (default cpu)")
    p.add_argument("--backend", default="torch", choices=("torch", "triton", "auto"),
                   help="backend of the fused loss (default torch; triton: the guided kernels)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="embedding and guide dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="directory for bench_gist.txt / .json (default: print only)")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sizes = sizes_arg(parser, args.sizes)
    if args.dim < 1 or args.guide_dim < 1 or args.repeats < 1:
        parser.error("--dim, --guide-dim and --repeats must be >= 1")
    res = measure({"sizes": sizes, "dim": args.dim, "guide_dim": args.guide_dim, "repeats": args.repeats,
                   "device": args.device, "threads": args.threads, "temperature": TEMPERATURE, "margin": MARGIN,
                   "backend": args.backend, "dtype": args.dtype})
    text = render(res)
    publish(text, res, args.out, "bench_gist")
    return 0
