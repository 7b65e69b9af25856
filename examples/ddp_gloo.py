"""Negatives across ranks on a CPU: DistributedDataParallel on 2 gloo processes with ``gather=True``,
checked against the same training run in one process over the global batch.

Each step's global batch of (query, key) pairs is split unequally over the ranks (as the last batch of an
epoch may be); every rank's queries are contrasted with every rank's keys. The value each rank returns
averages over the ranks to the single-process loss, and DDP's gradient averaging gives its gradients, so
the two runs end with the same weights. Runs in a few seconds:

    python examples/ddp_gloo.py --world 2 --steps 3

Prints each step's loss (the average over ranks and the single process's) and exits 1 if they or the final
weights differ by more than float32 round-off. On GPUs: ``init_process_group("nccl")``, the encoder and
the rows on ``cuda:rank``, and ``torchrun`` to start the processes; nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_contrastive

D_IN, D_OUT, TEMPERATURE, LR = 64, 32, 0.05, 0.5


def make_encoder(seed: int = 0) -> torch.nn.Module:
    """The encoder every run starts from (the same weights in every process)."""
    torch.manual_seed(seed)
    return torch.nn.Linear(D_IN, D_OUT)


def make_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``batch`` (query, key) input rows; key i is a noisy copy of query i."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        q = torch.randn(batch, D_IN, generator=g)
        out.append((q, q + 2.0 * torch.randn(batch, D_IN, generator=g)))
    return out


def rows_of(rank: int, world: int, batch: int) -> slice:
    """This rank's rows of a global batch: unequal parts (rank 0 takes the remainder)."""
    base = batch // (world + 1)
    sizes = [batch - base * (world - 1)] + [base] * (world - 1)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _worker(rank: int, world: int, init_file: str, steps: int, batch: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = DDP(make_encoder())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loss_fn = fused_contrastive.nn.InfoNCELoss(TEMPERATURE, gather=True)
        losses = []
        for q, k in make_batches(steps, batch):
            mine = rows_of(rank, world, batch)
            loss = loss_fn(model(q[mine]), model(k[mine]))  # negatives: every rank's keys
            loss.backward()  # DDP averages the gradients over the ranks: the global batch's gradients
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        result = {"losses": losses}
        if rank == 0:
            result["weights"] = {n: p.detach().flatten().tolist() for n, p in model.module.named_parameters()}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int = 2, steps: int = 3, batch: int = 48) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Train on ``world`` gloo processes: each rank's loss per step, and the final weights (rank 0's)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), steps, batch, tmp), nprocs=world, join=True)
        res = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as fh:
                res.append(json.load(fh))
    weights = {n: torch.tensor(v) for n, v in res[0]["weights"].items()}
    return [r["losses"] for r in res], weights


def run_single(steps: int = 3, batch: int = 48) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training in one process over each global batch (no gather)."""
    model = make_encoder()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = fused_contrastive.nn.InfoNCELoss(TEMPERATURE)
    losses = []
    for q, k in make_batches(steps, batch):
        loss = loss_fn(model(q), model(k))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().flatten() for n, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--batch", type=int, default=48, help="global batch size (default 48)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write each rank's losses and the final weights of both runs to FILE")
    args = p.parse_args(argv)
    if args.world < 2 or args.batch < 2 * args.world:
        p.error(f"--world must be >= 2 and --batch >= 2 x --world, got {args.world} and {args.batch}")
    per_rank, ddp_weights = run_ranks(args.world, args.steps, args.batch)
    single, weights = run_single(args.steps, args.batch)
    ok = True
    print(f"{'step':>4s} {'average over ' + str(args.world) + ' ranks':>24s} {'one process':>12s}")
    for s in range(args.steps):
        avg = sum(r[s] for r in per_rank) / args.world
        ok &= abs(avg - single[s]) <= 1e-5 * max(1.0, abs(single[s]))
        print(f"{s:4d} {avg:24.6f} {single[s]:12.6f}")
    diff = max((ddp_weights[n] - weights[n]).abs().max().item() for n in weights)
    ok &= diff <= 1e-5
    print(f"final weights: largest difference {diff:.2e}; {'equal' if ok else 'DIFFERENT'} to float32 round-off")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rank_losses": per_rank, "single_losses": single,
                       "ddp_weights": {n: w.tolist() for n, w in ddp_weights.items()},
                       "single_weights": {n: w.tolist() for n, w in weights.items()}}, fh)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
