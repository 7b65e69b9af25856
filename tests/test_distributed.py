"""fused_contrastive.distributed.gather_rows on real processes: gloo on loopback, 2 and 3 ranks with
unequal local sizes. The oracle is the single-process computation over the concatenated rows."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod

import pytest
import torch
import torch.distributed as dist

from fused_contrastive.distributed import gather_rows, process_group

D = 6


def _worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        n = sum(sizes)
        full = torch.randn(n, D, generator=g, dtype=torch.float64)
        w = torch.randn(n, D, generator=g, dtype=torch.float64)
        off = sum(sizes[:rank])
        x = full[off:off + sizes[rank]].clone().requires_grad_()
        rows, offset, got_sizes = gather_rows(x)
        res = {"rank": rank, "rows": torch.equal(rows.detach(), full), "offset": offset == off,
               "sizes": got_sizes == sizes}
        # a loss that couples every rank's rows; every rank computes it, so the gather's backward sums
        # world copies of the single-process gradient into each rank's rows
        ((rows * w).sum() ** 2 / 7).backward()
        ref = full.clone().requires_grad_()
        ((ref * w).sum() ** 2 / 7).backward()
        res["grad"] = torch.allclose(x.grad, world * ref.grad[off:off + sizes[rank]], rtol=1e-12, atol=1e-12)
        try:  # the last rank passes another embedding dimension: every rank must get the error
            gather_rows(torch.randn(2, D + (rank == world - 1)), name="query")
            res["dim_error"] = None
        except ValueError as e:
            res["dim_error"] = str(e)
        try:
            gather_rows(torch.randn(2, D, dtype=torch.float64 if rank == 0 else torch.float32), name="keys")
            res["dtype_error"] = None
        except ValueError as e:
            res["dtype_error"] = str(e)
        out.put(res)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [[5, 3], [4, 0, 7]], ids=["2ranks", "3ranks_one_empty"])
def test_gather_rows_values_gradients_and_errors(sizes, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    world = len(sizes)
    procs = [ctx.Process(target=_worker, args=(r, world, f"file://{tmp_path}/store", sizes, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(world):
            results.append(out.get(timeout=120))
    except queue_mod.Empty:
        pytest.fail("a rank did not report within 120 s (hang)")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted(r["rank"] for r in results) == list(range(world))
    for r in results:
        assert r["rows"] and r["offset"] and r["sizes"] and r["grad"], r
        assert r["dim_error"] is not None and "query" in r["dim_error"] and "same dtype and trailing shape" \
            in r["dim_error"], r
        assert r["dtype_error"] is not None and "keys" in r["dtype_error"], r


def test_process_group_arguments():
    assert process_group(False) is None
    with pytest.raises(ValueError, match="init_process_group"):
        process_group(True)
    with pytest.raises(TypeError, match="gather"):
        process_group("yes")
