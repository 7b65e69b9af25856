"""``python -m fused_contrastive bench-gather``: what ``gather=`` costs each rank per step, COMPUTED from the
shapes (no communication is run).

For a global batch split evenly over ``world`` ranks, every tensor a loss gathers ([N_global, D] per
gathered input) is an all-gather forward and a reduce-scatter of its gradient backward. With NCCL's
ring algorithms each rank sends (world - 1) / world of the gathered tensor's bytes in each of the two
(the same for what it receives). The memory column is the gathered tensor(s) plus their gradient
buffer in the backward (the only O(N_global * D) additions; nothing N_local x N_global is kept).
"""

from __future__ import annotations

import argparse

from .helptext import help_text

#: gathered [N_global, D] tensors per loss (per anchor row of the global batch): info_nce gathers the
#: keys; clip both towers; simcse (two views) z2; supcon every view (2 here); dscl both views;
#: cosent both sides (and the labels, negligible).
GATHERED = {"info_nce": 1, "clip": 2, "simcse_2view": 1, "simcse_sup": 2, "supcon": 2, "dscl": 2, "cosent": 2}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def per_rank(loss: str, n: int, d: int, dtype: str, world: int) -> dict[str, float]:
    gathered = GATHERED[loss] * n * d * BYTES[dtype]
    ring = (world - 1) / world
    return {"gathered_bytes": gathered, "sent_forward": ring * gathered, "sent_backward": ring * gathered,
            "memory": 2 * gathered}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-gather", help="bytes each rank sends and gathered memory under gather= (computed)",
                       description=help_text(__doc__))
    p.add_argument("--n", type=int, default=65536, help="global batch (anchor rows), default 65536")
    p.add_argument("--d", type=int, default=768, help="embedding dimension, default 768")
    p.add_argument("--dtype", choices=sorted(BYTES), default="bfloat16")
    p.add_argument("--world", type=int, default=8, help="ranks, default 8")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tabulate import tabulate  # the [bench] extra: imported when the table is made

    if args.world < 1 or args.n < 1 or args.d < 1:
        parser.error("--n, --d and --world must be >= 1")
    mb = 1 << 20
    rows = []
    for loss in GATHERED:
        r = per_rank(loss, args.n, args.d, args.dtype, args.world)
        rows.append([loss, f"{r['sent_forward'] / mb:.0f}", f"{r['sent_backward'] / mb:.0f}",
                     f"{r['memory'] / mb:.0f}"])
    print(f"COMPUTED from the shapes (not measured): global N = {args.n}, D = {args.d}, {args.dtype}, "
          f"{args.world} ranks, ring all-gather / reduce-scatter")
    print(tabulate(rows, headers=["loss", "sent fwd MiB/rank", "sent bwd MiB/rank", "gathered + grad MiB/rank"],
                   tablefmt="simple", disable_numparse=True))
    return 0
