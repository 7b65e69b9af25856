"""What a loss option costs against the same loss without it, measured on the CPU (torch backend, float32,
forward + backward with every input trained, fresh leaves each step). The contenders of a row alternate in
every repeat and the medians are taken side by side in one process, so drifts of a shared machine hit all of
them alike. The clock is the process's CPU time (``time.process_time``) on one thread by default: on a machine
shared with other jobs wall time measures their load, CPU time the work (``--wall`` for wall time).

Two tables:

* ``options``: ``label_smoothing=`` and ``tau_plus=`` on the benchmark's cases whose function takes them
  (``testing.BENCH_CASES``, built by ``make_inputs`` at N anchors: M and the layouts are each case's), on the
  one-tile path and the chunked path (``routes.override(DENSE=False)``), and the merged-block core's ``gist``
  case (GISTEmbed's four blocks and guide mask: one path, the PyTorch sweep, whose smoothing counts and sums
  the kept logits per row in the same pass). Cells are ratios to the plain loss.
* ``pairs``: issue 59's structural options, each beside the loss it extends: ``info_nce`` with
  ``row_negatives`` [N, K, D]; ``qwen3_embedding_loss`` with and without row negatives, and without them
  against ``info_nce`` (the q-d block alone, no mask); ``siglip_loss`` with unique ``image_groups`` /
  ``text_groups`` (the same loss) against the plain call, and with 5 captions per image (M = 5N texts, each
  image's 5 a group) against the all-negative loss at N x 5N that its kernels run (``text_groups`` none
  shared: the positive correction's cost alone).

Usage: python bench/option_costs.py [--n 1024] [--d 256] [--k 7] [--repeats 15] [--threads 1] [--wall]
                                    [--tables options pairs] [--only WORD ...]
"""

from __future__ import annotations

import argparse
import inspect
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

import fused_contrastive as fc
from fused_contrastive import routes
from fused_contrastive.testing import BENCH_CASES, CASE_BY_NAME, make_inputs

#: the merged-block core's cases (``core/guided/torch_blocks.py``: no dense / chunked switch, one path)
GUIDED = ("gist",)

OPTIONS = {"label_smoothing=0.1": dict(label_smoothing=0.1), "tau_plus=0.1": dict(tau_plus=0.1),
           "both": dict(label_smoothing=0.1, tau_plus=0.1)}

#: a step: one forward + backward on fresh leaves, returning the clock's seconds
Step = Callable[[Callable[[], float]], float]


def _leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def step(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor]) -> Step:
    """A contender: ``fn(*leaves).backward()`` timed by the given clock (leaves cloned outside the clock)."""

    def run(clock: Callable[[], float]) -> float:
        xs = _leaves(tensors)
        t0 = clock()
        fn(*xs).backward()
        return clock() - t0

    return run


def medians(contenders: dict[str, Step], repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    """Seconds per contender: one warm-up step each, then ``repeats`` rounds in which every contender runs once
    (interleaved), the median per contender."""
    for run in contenders.values():
        run(clock)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(repeats):
        for k, run in contenders.items():
            times[k].append(run(clock))
    return {k: statistics.median(v) for k, v in times.items()}


def option_rows(n: int, d: int):
    """``(case, path, {column: Step})`` of the ``options`` table; column ``plain`` is the loss without options."""
    for case in [*BENCH_CASES, *(CASE_BY_NAME[k] for k in GUIDED)]:
        params = inspect.signature(case.fn).parameters
        if "label_smoothing" not in params:
            continue
        tensors, kwargs = make_inputs(case, n, d)
        names = list(tensors)
        opts = {"plain": {}, **{k: v for k, v in OPTIONS.items() if "tau_plus" in params or "tau_plus" not in v}}

        def fn_of(o, fn=case.fn, kwargs=kwargs, names=names):
            return lambda *xs: fn(**dict(zip(names, xs, strict=True)), **kwargs, **o, backend="torch")

        steps = {k: step(fn_of(o), list(tensors.values())) for k, o in opts.items()}
        for path in ("merged",) if case.name in GUIDED else ("dense", "chunked"):
            yield case.name, path, steps


def pair_rows(n: int, d: int, k: int):
    """``(name, Step, base name, base Step)`` of the ``pairs`` table (float32, seeded inputs)."""
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    q, kk, neg = r(n, d), r(n, d), r(n, k, d)
    m5 = 5 * n
    ig, tg5 = torch.arange(n), torch.arange(m5) // 5
    s, bias = torch.tensor(10.0), torch.tensor(-10.0)
    t5 = r(m5, d)
    info = step(lambda a, b: fc.info_nce(a, b, backend="torch"), (q, kk))
    qwen3 = step(lambda a, b: fc.qwen3_embedding_loss(a, b, backend="torch"), (q, kk))
    yield ("info_nce + row_negatives", step(lambda a, b, c: fc.info_nce(a, b, row_negatives=c, backend="torch"),
                                            (q, kk, neg)), "info_nce", info)
    yield ("qwen3 + row_negatives", step(lambda a, b, c: fc.qwen3_embedding_loss(a, b, c, backend="torch"),
                                         (q, kk, neg)), "qwen3", qwen3)
    yield "qwen3 (q-d, q-q, d-d, mask)", qwen3, "info_nce", info
    yield ("siglip + unique groups",
           step(lambda a, b, c, e: fc.siglip_loss(a, b, c, e, image_groups=ig, text_groups=ig, backend="torch"),
                (q, kk, s, bias)),
           "siglip", step(lambda a, b, c, e: fc.siglip_loss(a, b, c, e, backend="torch"), (q, kk, s, bias)))
    yield (f"siglip + groups, M = {m5} (5 per image)",
           step(lambda a, b, c, e: fc.siglip_loss(a, b, c, e, image_groups=ig, text_groups=tg5, backend="torch"),
                (q, t5, s, bias)),
           "siglip all-negative at the same N x M",
           step(lambda a, b, c, e: fc.siglip_loss(a, b, c, e, image_groups=ig, text_groups=tg5 + n,
                                                  backend="torch"), (q, t5, s, bias)))


def _wanted(only, *names: str) -> bool:
    return not only or any(w in name for w in only for name in names)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--k", type=int, default=7, help="row negatives per row (the pairs table)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: PyTorch's default)")
    ap.add_argument("--wall", action="store_true", help="wall time instead of the process's CPU time")
    ap.add_argument("--tables", nargs="+", choices=("options", "pairs"), default=["options", "pairs"])
    ap.add_argument("--only", nargs="*", default=None, help="rows whose loss or name contains one of these words")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.wall else time.process_time
    print(f"# option costs, CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; N = {a.n}, D = {a.d}, K = {a.k}, float32, forward + backward, median of "
          f"{a.repeats} interleaved, {'wall' if a.wall else 'CPU'} time")
    if "options" in a.tables:
        print(f"{'loss':34s} {'path':8s} {'plain ms':>9s} " + " ".join(f"{o:>20s}" for o in OPTIONS))
        for name, path, steps in option_rows(a.n, a.d):
            if not _wanted(a.only, name):
                continue
            with routes.override(DENSE=path != "chunked"):  # the switchboard, not the environment
                med = medians(steps, a.repeats, clock)
            cells = [f"{med[k] / med['plain']:>19.3f}x" if k in med else f"{'-':>20s}" for k in OPTIONS]
            print(f"{name:34s} {path:8s} {med['plain'] * 1e3:9.2f} " + " ".join(cells))
    if "pairs" in a.tables:
        print(f"\n{'with the option':42s} {'ms':>9s}   {'without':40s} {'ms':>9s}  ratio")
        for name, run, base_name, base in pair_rows(a.n, a.d, a.k):
            if not _wanted(a.only, name, base_name):
                continue
            med = medians({"with": run, "without": base}, a.repeats, clock)
            t, t0 = med["with"] * 1e3, med["without"] * 1e3
            print(f"{name:42s} {t:9.2f}   {base_name:40s} {t0:9.2f}  {t / t0:5.2f}x")


if __name__ == "__main__":
    main()
