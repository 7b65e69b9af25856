"""Spawned ``torch.distributed`` ranks for the tests: one process per rank on the gloo backend, a
``file://`` store under the test's tmp_path, one report (a dict) per rank through a queue."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest


def run_ranks(worker: Callable, world: int, tmp_path: Path, *args, timeout: float = 180.0) -> list[dict]:
    """Run ``worker(rank, world, init_method, *args, out)`` in ``world`` spawned processes and return the
    dict each put on ``out``, sorted by its ``"rank"``. A report with an ``"error"`` (the worker's
    traceback) fails the test at once; so does a rank that does not report within ``timeout`` seconds (a
    hang or a crash). Every process is joined or killed before returning."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, f"file://{tmp_path}/store", *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(world):
            results.append(out.get(timeout=timeout))
            if "error" in results[-1]:
                pytest.fail(f"rank {results[-1].get('rank')} failed:\n{results[-1]['error']}")
    except queue_mod.Empty:
        pytest.fail(f"a rank did not report within {timeout:g} s (hang or crash)")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return sorted(results, key=lambda r: r.get("rank", -1))


def timed_calls(calls: Iterable[tuple[str, Callable[[], object]]]) -> dict[str, tuple[tuple[str, str, str] | None,
                                                                                       float]]:
    """Run each ``(name, call)`` in order inside a rank: ``{name: (None or (exception type, message,
    notes), seconds it took)}`` (what the fault tests check: who raised what, and how promptly)."""
    out = {}
    for name, call in calls:
        t0 = time.perf_counter()
        try:
            call()
            err = None
        except Exception as e:  # noqa: BLE001 - the type and text are what the tests check
            err = (type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", [])))
        out[name] = (err, time.perf_counter() - t0)
    return out


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, init: str, out, timeout: float | None = None):
    """A worker's body as rank ``rank`` of a gloo group (``init`` from :func:`run_ranks`; ``timeout`` seconds
    for its collectives, None: gloo's default). An exception in the block is put on ``out`` as the rank's
    report, with its traceback, so the parent fails at once instead of waiting for a hang; the group is
    destroyed after the block either way."""
    import torch.distributed as dist

    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, **kw)
    try:
        yield
    except Exception:  # noqa: BLE001 - reported: the parent fails at once
        out.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        dist.destroy_process_group()
