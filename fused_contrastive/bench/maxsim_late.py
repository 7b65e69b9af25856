"""``python -m fused_contrastive bench-maxsim``: the late-interaction (ColBERT MaxSim) in-batch-negatives
loss forward + backward on the CPU, ``maxsim_info_nce`` next to the materialised computation and
sentence-transformers' own, on the same token embeddings.

Contenders, all on the same float32 inputs: query tokens q [N, Lq, D] and document tokens d [M, Ld, D]
(M = N, requiring grad), a query mask [N, Lq] and a document mask [M, Ld] (bool), scale 1 (the default
of sentence-transformers' and PyLate's MaxSim losses), target ``arange(N)``:

* ``ours``: ``maxsim_info_nce(q, d, query_mask=, doc_mask=, normalize=False, backend="torch")``
  (``fused_contrastive/maxsim.py``): the scores [N, M] and the argmax indices [N, Lq, M] (int16), the
  token similarities one chunk at a time, a backward that gathers the maximising rows;
* ``materialised``: the definition with every token similarity at once: ``einsum("nad,mbd->nmab")``
  [N, M, Lq, Ld], the masked document tokens filled with -inf (``masked_fill``, out of place: in place
  on einsum's output, a view, autograd's copies double the backward's peak), the max over the document
  tokens, the masked sum over the query tokens, ``F.cross_entropy``;
* ``sentence-transformers``: their loss computation (``MultiVectorMultipleNegativesRankingLoss.forward``
  after the embedding): ``colbert_scores(q, d[:, None], queries_mask=, documents_mask=)`` (their
  chunked MaxSim, 100M-element chunks) and ``F.cross_entropy(scores * scale, arange(N))``; run when
  sentence-transformers imports and ``--no-peers`` is not given.

Inputs (seeded by N): unit token vectors (Gaussian, L2-normalised) and padded lengths: each query keeps
its first ``U(Lq/4, Lq)`` tokens, each document its first ``U(Ld/4, Ld)`` (the padded positions hold unit
vectors too, so a contender that ignored a mask would compute another loss; the losses are reported).

Time: the contenders alternate within each repeat (the order reversed every other repeat), medians over
the repeats, after one untimed step each. Peak memory: the memory-measured step is that untimed step,
run under ``bench.memory.LiveBytes`` (the high-water mark of the bytes of the tensors the step creates,
input gradients included, the inputs excluded; deterministic). The materialised contender is predicted
before it runs: N·M·Lq·Ld·4 bytes times its peak factor measured at a small N (calibration); where the
prediction exceeds 60 % of MemAvailable (``/proc/meminfo``) the row says "does not fit" instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..maxsim import EMPTY_DOC_SCORE, maxsim_info_nce
from .helptext import help_text
from .memory import LiveBytes, mem_available
from .outputs import publish, sizes_arg

SCALE = 1.0
NAMES = ("ours", "materialised", "sentence-transformers")
#: the share of MemAvailable a materialised run may be predicted to take
FIT_SHARE = 0.6
#: N of the materialised contender's calibration step (or the smallest size, if smaller)
CALIBRATION_N = 32
#: the issue's CPU targets at N = M = 512, Lq = 32, Ld = 128, D = 128: time ratio and peak-memory ratio
TARGET = {"n": 512, "lq": 32, "ld": 128, "d": 128, "time": 0.7, "peak": 1 / 20}

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _inputs(n: int, lq: int, ld: int, d: int, dtype: torch.dtype = torch.float32) -> Inputs:
    """The module docstring's inputs, seeded by ``n``: (q, docs) requiring grad, (query mask, doc mask)."""
    g = torch.Generator().manual_seed(n)
    q = F.normalize(torch.randn(n, lq, d, generator=g, dtype=torch.float64), dim=-1)
    docs = F.normalize(torch.randn(n, ld, d, generator=g, dtype=torch.float64), dim=-1)
    qlen = torch.randint(max(1, lq // 4), lq + 1, (n, 1), generator=g)
    dlen = torch.randint(max(1, ld // 4), ld + 1, (n, 1), generator=g)
    qm = torch.arange(lq)[None, :] < qlen
    dm = torch.arange(ld)[None, :] < dlen
    return q.to(dtype).requires_grad_(), docs.to(dtype).requires_grad_(), qm, dm


def ours(q, docs, qm, dm) -> torch.Tensor:
    return maxsim_info_nce(q, docs, query_mask=qm, doc_mask=dm, scale=SCALE, normalize=False, backend="torch")


def materialised(q, docs, qm, dm) -> torch.Tensor:
    """The definition with the [N, M, Lq, Ld] token similarities materialised. The mask is applied out of
    place: ``masked_fill_`` on einsum's output (a view) makes autograd keep two more copies of the
    similarities in the backward (a peak of 4 similarity tensors instead of 2)."""
    sims = torch.einsum("nad,mbd->nmab", q, docs).masked_fill(~dm[None, :, None, :], float("-inf"))
    best = sims.max(dim=-1).values  # [N, M, Lq]
    del sims
    scores = (best * qm[:, None, :].to(best.dtype)).sum(dim=-1)
    scores = scores.masked_fill(~dm.any(dim=1)[None, :], EMPTY_DOC_SCORE)
    return F.cross_entropy(SCALE * scores, torch.arange(q.shape[0]))


def sentence_transformers_loss(q, docs, qm, dm) -> torch.Tensor:
    """sentence-transformers' MultiVectorMultipleNegativesRankingLoss on given embeddings (one document
    column: their stacked (N, 1, Ld, D) layout, the positive of query i at column i)."""
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

    scores = colbert_scores(q, docs[:, None], queries_mask=qm, documents_mask=dm[:, None])
    return F.cross_entropy(scores * SCALE, torch.arange(q.shape[0]))


def peers_available() -> bool:
    try:
        import sentence_transformers.multi_vector_encoder.scoring  # noqa: F401
    except ImportError:
        return False
    return True


def contenders(peers: bool = True) -> dict[str, Callable[..., torch.Tensor]]:
    out = {"ours": ours, "materialised": materialised}
    if peers:
        out["sentence-transformers"] = sentence_transformers_loss
    return out


def _step(fn, x: Inputs) -> torch.Tensor:
    for t in x[:2]:
        t.grad = None
    loss = fn(*x)
    loss.backward()
    return loss.detach()


def _measured_step(fn, x: Inputs) -> tuple[float, int]:
    """The loss and the peak of live tensor bytes of one step."""
    for t in x[:2]:
        t.grad = None
    with LiveBytes() as m:
        loss = _step(fn, x)
    return float(loss), m.peak


def similarity_bytes(n: int, m: int, lq: int, ld: int) -> int:
    """Bytes of the float32 token similarities [N, M, Lq, Ld]."""
    return n * m * lq * ld * 4


def _load() -> float | None:
    """The machine's 1-minute load average (recorded beside the timings; a host's contention that the
    guest does not see moves them as well)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _log(msg: str, a: dict[str, Any]) -> None:
    if a.get("progress", True):
        print(msg, file=sys.stderr, flush=True)


def measure(a: dict[str, Any]) -> dict[str, Any]:
    """Calibration, then per N: the fit decision, one memory-measured step each, the alternating repeats."""
    if a.get("threads"):
        torch.set_num_threads(a["threads"])
    fns = contenders(peers=a["peers"])
    lq, ld, d = a["lq"], a["ld"], a["d"]
    load0 = _load()
    avail = mem_available()
    n_cal = min(CALIBRATION_N, min(a["sizes"]))
    _, cal_peak = _measured_step(materialised, _inputs(n_cal, lq, ld, d))
    factor = cal_peak / similarity_bytes(n_cal, n_cal, lq, ld)
    _log(f"bench-maxsim: materialised peak factor {factor:.3f} x N*M*Lq*Ld*4 (calibrated at N = {n_cal}); "
         + (f"MemAvailable {avail / 1e9:.1f} GB" if avail else "MemAvailable unknown"), a)
    rows = []
    for n in a["sizes"]:
        predicted = int(factor * similarity_bytes(n, n, lq, ld))
        skipped: dict[str, str] = {}
        if avail is not None and predicted > FIT_SHARE * avail:
            skipped["materialised"] = (f"does not fit (predicted {predicted / 1e9:.1f} GB > available "
                                       f"{FIT_SHARE * avail / 1e9:.1f} GB, {FIT_SHARE:.0%} of MemAvailable)")
            _log(f"N = {n}: materialised {skipped['materialised']}", a)
        run = {k: f for k, f in fns.items() if k not in skipped}
        x = _inputs(n, lq, ld, d)
        values, peaks = {}, {}
        for name, fn in run.items():  # the untimed step: the loss, the peak, the warm-up
            values[name], peaks[name] = _measured_step(fn, x)
            _log(f"N = {n}: {name} loss {values[name]:.6f}, peak {peaks[name] / 1e6:.1f} MB", a)
        times: dict[str, list[float]] = {name: [] for name in run}
        for r in range(a["repeats"]):
            for name in (list(run) if r % 2 == 0 else list(run)[::-1]):
                t0 = time.perf_counter()
                _step(run[name], x)
                times[name].append(time.perf_counter() - t0)
        del x
        med = {name: statistics.median(v) for name, v in times.items()}
        _log(f"N = {n}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()), a)
        rows.append({"n": n, "median_s": {k: med.get(k) for k in fns}, "times_s": times,
                     "peak_bytes": {k: peaks.get(k) for k in fns}, "loss": {k: values.get(k) for k in fns},
                     "predicted_materialised_bytes": predicted, "skipped": skipped, "loadavg_1min": _load()})
    config = {**a, "scale": SCALE, "dtype": "float32", "device": "cpu", "torch": torch.__version__,
              "threads_used": torch.get_num_threads(), "mem_available_bytes": avail, "calibration_n": n_cal,
              "materialised_factor": factor, "contenders": list(fns), "loadavg_1min_start": load0}
    if a["peers"]:
        import sentence_transformers

        config["sentence_transformers"] = sentence_transformers.__version__
    return {"config": config, "rows": rows}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def _ratio(x: float | None, y: float | None) -> str:
    if x is None or y is None or y <= 0:
        return "-"
    r = x / y
    return f"{r:.2f}x" if r >= 0.1 else f"1/{1 / r:.0f}" if r > 0 else "0"


def loss_spread(row: dict[str, Any]) -> float | None:
    vals = [v for v in row["loss"].values() if v is not None]
    return max(vals) - min(vals) if len(vals) > 1 else None


def render(res: dict[str, Any]) -> str:
    from tabulate import tabulate  # the [bench] extra: imported when the table is made

    a = res["config"]
    st = "sentence-transformers" in a["contenders"]
    head = ["N", "ours ms", "materialised ms", "ST ms", "ours / mat.", "ours / ST", "ours MB", "mat. MB", "ST MB",
            "peak ours / mat.", "peak ours / ST", "max |dloss|"]
    table = []
    for r in res["rows"]:
        med, peak = r["median_s"], r["peak_bytes"]
        spread = loss_spread(r)
        mat_ms = "does not fit" if "materialised" in r["skipped"] else _ms(med["materialised"])
        st_med, st_peak = med.get("sentence-transformers"), peak.get("sentence-transformers")
        table.append([str(r["n"]), _ms(med["ours"]), mat_ms, _ms(st_med),
                      _ratio(med["ours"], med["materialised"]), _ratio(med["ours"], st_med),
                      _mb(peak["ours"]), _mb(peak["materialised"]), _mb(st_peak),
                      _ratio(peak["ours"], peak["materialised"]), _ratio(peak["ours"], st_peak),
                      "-" if spread is None else f"{spread:.1e}"])
    lines = [
        (f"MaxSim in-batch-negatives loss (N = M, Lq = {a['lq']}, Ld = {a['ld']}, D = {a['d']}, scale {a['scale']}, "
         f"float32, padding masks), forward + backward, CPU ({a['threads_used']} threads, torch {a['torch']}"
         + (f", sentence-transformers {a['sentence_transformers']}" if st else ", sentence-transformers not run")
         + f"), medians of {a['repeats']} alternating repeats; peak = live tensor bytes of one step (LiveBytes); "
         "ratios = ours / the other (this library / the other; below 1: this library is faster / holds less)"),
        (f"materialised peak factor {a['materialised_factor']:.3f} x N*M*Lq*Ld*4 bytes (calibrated at N = "
         f"{a['calibration_n']}); it runs where the prediction is <= {FIT_SHARE:.0%} of MemAvailable "
         + (f"({a['mem_available_bytes'] / 1e9:.1f} GB)" if a["mem_available_bytes"] else "(unknown)")),
        tabulate(table, headers=head, tablefmt="simple", disable_numparse=True),
    ]
    for r in res["rows"]:
        for name, why in r["skipped"].items():
            lines.append(f"N = {r['n']}: {name} {why}")
    loads = [x for x in [a.get("loadavg_1min_start"), *(r.get("loadavg_1min") for r in res["rows"])] if x is not None]
    if loads:
        after = ", ".join(f"{x:.2f}" for x in loads[1:])
        lines.append(f"1-minute load average of the machine from {loads[0]:.2f} at the start to {after} after each "
                     f"N (this run's own threads count in it)")
    t = TARGET
    row = next((r for r in res["rows"] if r["n"] == t["n"]), None)
    if (a["lq"], a["ld"], a["d"]) == (t["lq"], t["ld"], t["d"]) and row and row["median_s"]["materialised"]:
        tr = row["median_s"]["ours"] / row["median_s"]["materialised"]
        pr = row["peak_bytes"]["ours"] / row["peak_bytes"]["materialised"]
        lines.append(f"targets at N = M = {t['n']}: time ours / materialised {tr:.2f}x (target <= {t['time']}x: "
                     f"{'met' if tr <= t['time'] else 'NOT met'}), peak ours / materialised 1/{1 / pr:.0f} (target "
                     f"<= 1/{1 / t['peak']:.0f}: {'met' if pr <= t['peak'] else 'NOT met'})")
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-maxsim", help="the fused MaxSim (late-interaction) loss against the materialised "
                                            "token similarities and sentence-transformers' loss (CPU)",
                       description=help_text(__doc__))
    p.add_argument("--sizes", default="128,256,512,1024",
                   help="N = M, comma-separated (default 128,256,512,1024)")
    p.add_argument("--lq", type=int, default=32, help="query tokens Lq (default 32)")
    p.add_argument("--ld", type=int, default=128, help="document tokens Ld (default 128)")
    p.add_argument("--d", type=int, default=128, help="token dimension D (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each contender per N (default 3)")
    p.add_argument("--no-peers", action="store_true", help="do not run sentence-transformers' loss")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="directory for bench_maxsim.txt / .json (default: print only)")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sizes = sizes_arg(parser, args.sizes)
    if min(args.lq, args.ld, args.d, args.repeats) < 1:
        parser.error("--lq, --ld, --d and --repeats must be >= 1")
    peers = not args.no_peers and peers_available()
    if not args.no_peers and not peers:
        print("bench-maxsim: sentence-transformers is not installed; its contender is not run", file=sys.stderr)
    res = measure({"sizes": sizes, "lq": args.lq, "ld": args.ld, "d": args.d, "repeats": args.repeats,
                   "threads": args.threads, "peers": peers})
    text = render(res)
    publish(text, res, args.out, "bench_maxsim")
    return 0
