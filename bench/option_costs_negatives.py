"""CPU cost of a loss option beside the same loss without it: the median wall time of one forward + backward
(float32, ``backend="torch"``, fresh leaves each repeat), side by side, with the ratio.

    python bench/option_costs_negatives.py [--n 1024] [--d 256] [--k 7] [--repeats 7] [--threads 1] [--only NAME ...]

Rows (issue 59's options): ``info_nce`` with ``row_negatives`` [N, K, D] against ``info_nce``;
``qwen3_embedding_loss`` with and without row negatives, and without them against ``info_nce`` (the q-d block
alone, no mask); ``siglip_loss`` with unique ``image_groups`` / ``text_groups`` (the same loss) against the
plain call, and with 5 captions per image (M = 5N texts, every image's 5 a group) against the all-negative
loss at N x 5N that its kernels run (``text_groups`` none shared: the positive correction's cost alone).
Timings on a shared machine are noisy: the medians of ``--repeats`` runs, one process, one intra-op thread by
default (on an oversubscribed machine a thread pool's synchronisation, not the arithmetic, dominates small ops).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fused_contrastive as fc


def _median_ms(fn, leaves, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        t0 = time.perf_counter()
        fn(*xs).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def rows(n: int, d: int, k: int):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    q, kk, neg = r(n, d), r(n, d), r(n, k, d)
    m5 = 5 * n
    ig, tg5 = torch.arange(n), torch.arange(m5) // 5
    yield ("info_nce + row_negatives", lambda a, b, c: fc.info_nce(a, b, row_negatives=c, backend="torch"),
           (q, kk, neg), "info_nce", lambda a, b: fc.info_nce(a, b, backend="torch"), (q, kk))
    yield ("qwen3 + row_negatives", lambda a, b, c: fc.qwen3_embedding_loss(a, b, c, backend="torch"), (q, kk, neg),
           "qwen3", lambda a, b: fc.qwen3_embedding_loss(a, b, backend="torch"), (q, kk))
    yield ("qwen3 (q-d, q-q, d-d, mask)", lambda a, b: fc.qwen3_embedding_loss(a, b, backend="torch"), (q, kk),
           "info_nce", lambda a, b: fc.info_nce(a, b, backend="torch"), (q, kk))
    s, bias = torch.tensor(10.0), torch.tensor(-10.0)
    yield ("siglip + unique groups",
           lambda a, b, c, e: fc.siglip_loss(a, b, c, e, image_groups=ig, text_groups=ig, backend="torch"),
           (q, kk, s, bias), "siglip", lambda a, b, c, e: fc.siglip_loss(a, b, c, e, backend="torch"), (q, kk, s, bias))
    t5 = r(m5, d)
    yield (f"siglip + groups, M = {m5} (5 per image)",
           lambda a, b, c, e: fc.siglip_loss(a, b, c, e, image_groups=ig, text_groups=tg5, backend="torch"),
           (q, t5, s, bias), "siglip all-negative at the same N x M",
           lambda a, b, c, e: fc.siglip_loss(a, b, c, e, image_groups=ig, text_groups=tg5 + n, backend="torch"),
           (q, t5, s, bias))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--k", type=int, default=7, help="row negatives per row")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--only", nargs="*", default=None, help="row names containing one of these words")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, float32, N = {a.n}, D = {a.d}, "
          f"K = {a.k}; median of {a.repeats} forward + backward")
    print(f"{'with the option':42s} {'ms':>9s}   {'without':40s} {'ms':>9s}  ratio")
    for name, fn, leaves, base_name, base_fn, base_leaves in rows(a.n, a.d, a.k):
        if a.only and not any(w in name for w in a.only):
            continue
        t = _median_ms(fn, leaves, a.repeats)
        t0 = _median_ms(base_fn, base_leaves, a.repeats)
        print(f"{name:42s} {t:9.2f}   {base_name:40s} {t0:9.2f}  {t / t0:5.2f}x")


if __name__ == "__main__":
    main()
