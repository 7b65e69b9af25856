"""Running the benchmark: one memory pass per case in a fresh process, one interleaved timing pass per
(case, N), a progress bar whose ETA comes from a fixed cost model, and the suite loop (which stops
cleanly on SIGINT / SIGTERM and returns what was measured).

* **Memory pass** (:func:`measure`, a fresh process per case on CPU): warm-up at a small N, then the
  inputs, one forward and one backward with the peak of each over the baseline (``memory.py``), and
  the differences to the reference under THE accuracy rule (``testing.accuracy``): the reference's
  pass also computes the float64 ground truth and PyTorch's same-dtype error and hands them to the
  other contenders through a file.
* **Timing pass** (:func:`time_interleaved`, one process per (case, N)): every contender that passed
  its memory pass is built side by side and warmed up, then the repeats go round-robin, one step of
  each contender per round, so the drift of a shared machine hits all of them alike; the order of
  the rounds follows a Williams design (:func:`williams_orders`), because a step right after a
  memory-heavy contender runs with cold caches (measured here: 25% slower, up to 3x), so every
  contender must follow every other equally often; and the memory-bound contenders (the broadcast
  seeds, pml-ntxent: 100 MB per step) are timed in a block of their own after the others. Forward (the loss
  call with inputs that require grad), backward and their sum come from the same repeats; host clock
  on CPU (CPU ops are synchronous), CUDA events on GPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import math
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import reference
from ..testing.accuracy import amp_of, check_output, rounding_floor, same_dtype_error
from .contenders import DTYPES, MEMORY_BOUND_BYTES_PER_S, CaseInputs, Contender, Planned, bind, get_contender, plan
from .memory import is_oom, meter


@dataclass(frozen=True)
class MemoryJob:
    """The memory pass of one case (plain values: it crosses a process boundary)."""

    case: str
    contender: str
    n: int
    dim: int
    dtype: str
    device: str
    mem_cap: float
    ref_path: str  # the reference saves the truth here; the others compare against it
    isolated: bool = True
    threads: int | None = None


@dataclass(frozen=True)
class TimingJob:
    """The timing pass of one (case, N): every contender that passed its memory pass, interleaved."""

    case: str
    contenders: tuple[str, ...]
    repeats: tuple[int, ...]  # per contender
    n: int
    dim: int
    dtype: str
    device: str
    warmup: int
    threads: int | None = None


def _error(exc: BaseException) -> dict[str, str]:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return {"status": "oom" if is_oom(exc) else "error", "reason": f"{type(exc).__name__}: {text}"}


def _warm_n(n: int) -> int:
    return min(n, 32)


def _truth(job: MemoryJob, inputs: CaseInputs) -> dict[str, Any]:
    """Float64 ground truth of the case on the same (dtype-rounded) inputs, and PyTorch's own error in
    the dtype (the reference computing in it), per output: what THE accuracy rule needs."""
    con = get_contender(job.case, "reference")

    def run(dt, forced: bool):
        x = {k: v.detach().to(dt).requires_grad_(True) for k, v in inputs.diff.items()}
        kw = {**x, **inputs.aux}
        if forced:
            with reference.computing_in(dt):
                loss = con.fn(kw)
        else:
            loss = con.fn(kw)
        loss.backward()
        return loss.detach().cpu(), [None if v.grad is None else v.grad.detach().cpu() for v in x.values()]

    truth_loss, truth_grads = run(torch.float64, False)
    dtype = DTYPES[job.dtype]
    same_loss, same_grads = run(dtype, dtype != torch.float32)
    return {"loss": truth_loss, "grads": truth_grads,
            "e_same": [same_dtype_error(same_loss, truth_loss)]
            + [0.0 if s is None or t is None else same_dtype_error(s, t)
               for s, t in zip(same_grads, truth_grads, strict=True)]}


def _compare(loss, grads, truth: dict[str, Any], dtype: torch.dtype, inputs: CaseInputs) -> dict[str, Any]:
    """The differences of one contender from the truth, and whether THE rule accepts them."""
    outs = [("loss", loss, truth["loss"], 0.0)] + [
        (f"grad {k}", g, t, amp_of(x))
        for (k, x), g, t in zip(inputs.diff.items(), grads, truth["grads"], strict=True)]
    ok, d_loss, d_grad, worst = True, 0.0, 0.0, ""
    # THE rule as compare() applies it: the loss's scale for zero outputs, the logits' rounding floor
    ref = max(1.0, float(truth["loss"].detach().double().abs().nan_to_num(posinf=0.0).max()))
    f_loss, f_grad = rounding_floor(inputs.diff, inputs.aux)
    for (name, got, want, amp), e_same in zip(outs, truth["e_same"], strict=True):
        if got is None or want is None:
            if (got is None) != (want is None):
                ok, worst = False, f"{name}: missing"
            continue
        # the same-dtype error enters as a precomputed number
        floor = f_loss if name == "loss" else (0.0 if amp else f_grad)
        w, err, tol = check_output(name, got.detach().cpu(), want, None, dtype, amp, e_same=e_same, ref=ref,
                                   floor=floor)
        if name == "loss":
            d_loss = err
        else:
            d_grad = max(d_grad, err)
        if err > tol:
            ok, worst = False, f"{w} (tol {tol:.3g})"
    return {"max_abs_diff_loss": d_loss, "max_abs_diff_grad": d_grad, "within_tolerance": ok, "worst": worst}


def measure(job: MemoryJob) -> dict[str, Any]:
    """The memory pass of one case (see the module docstring). Returns ``status`` ("ok", "oom",
    "error"), ``reason``, ``peaks`` {mode: bytes}, ``input_bytes``, ``first_seconds`` (the cold step),
    ``loss_value`` and the difference fields."""
    device = torch.device(job.device)
    dtype = DTYPES[job.dtype]
    m = meter(device, job.isolated)
    res: dict[str, Any] = {"status": "ok", "reason": "", "memory_method": m.method}
    bound = None
    if job.threads:
        torch.set_num_threads(job.threads)
    try:
        bind(job.case, job.contender, _warm_n(job.n), job.dim, dtype, device).step()
        bound = bind(job.case, job.contender, job.n, job.dim, dtype, device)
        res["input_bytes"] = bound.inputs.nbytes()
        m.start(job.mem_cap)
        t0 = time.perf_counter()
        loss = bound.forward()
        m.sync()
        peak_f = m.peak()
        m.next_phase()
        loss.backward()
        m.sync()
        res["first_seconds"] = time.perf_counter() - t0
        peak_b = m.peak()
        res["peaks"] = {"forward": peak_f, "backward": peak_b, "forward+backward": max(peak_f, peak_b)}
        res["loss_value"] = float(loss.detach())
        if job.contender == "reference":
            torch.save(_truth(job, bound.inputs), job.ref_path)
        if os.path.exists(job.ref_path):
            res.update(_compare(loss, bound.inputs.grads(), torch.load(job.ref_path), dtype, bound.inputs))
        del loss
    except Exception as exc:  # noqa: BLE001 - a case must never crash the run
        res.update(_error(exc))
    finally:
        del bound
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def _time_step(bound, device: torch.device) -> tuple[float, float]:
    """Seconds of one forward and one backward."""
    bound.zero_grad()
    if device.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        loss = bound.forward()
        ev[1].record()
        loss.backward()
        ev[2].record()
        torch.cuda.synchronize(device)
        return ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3
    t0 = time.perf_counter()
    loss = bound.forward()
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def williams_orders(k: int) -> list[list[int]]:
    """Orders of k contenders for consecutive rounds such that, over the rows, every contender runs
    immediately after every other one equally often (a Williams design, balanced for first-order
    carry-over: a step right after a memory-heavy contender runs with cold caches and a sleeping
    thread pool, measured here 25% slower and up to 3x). k rows for even k, 2k for odd k."""
    if k <= 1:
        return [list(range(k))]
    first, lo, hi = [0], 1, k - 1
    while len(first) < k:
        first.append(lo)
        lo += 1
        if len(first) < k:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % k for x in first] for i in range(k)]
    return rows if k % 2 == 0 else rows + [row[::-1] for row in rows]


def time_interleaved(job: TimingJob) -> dict[str, dict[str, Any]]:
    """The timing pass of one (case, N) (module docstring). Returns {contender: {"times": {mode: [s]},
    "repeats": r}} or {contender: {"status", "reason"}} for one that failed here."""
    device = torch.device(job.device)
    dtype = DTYPES[job.dtype]
    if job.threads:
        torch.set_num_threads(job.threads)
    out: dict[str, dict[str, Any]] = {}
    bound: dict[str, Any] = {}
    fwd: dict[str, list[float]] = {}
    bwd: dict[str, list[float]] = {}
    todo = dict(zip(job.contenders, job.repeats, strict=True))
    first: dict[str, float] = {}
    for name in job.contenders:
        try:
            bound[name] = bind(job.case, name, job.n, job.dim, dtype, device)
            for i in range(job.warmup):
                t0 = time.perf_counter()
                bound[name].step()
                if i == 0:  # the cold step (for a compiled contender: dynamo + inductor compile)
                    _sync(device)
                    first[name] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            out[name] = _error(exc)
            bound.pop(name, None)
        fwd[name], bwd[name] = [], []
    # the memory-bound contenders (a memory estimate: broadcast seeds, pml-ntxent; 100 MB steps) are
    # timed in a block of their own after the others, so their steps never precede a light one
    blocks = [[n for n in bound if get_contender(job.case, n).estimate is None],
              [n for n in bound if get_contender(job.case, n).estimate is not None]]
    for names in blocks:
        rows = williams_orders(len(names))
        for r in range(max((todo[n] for n in names), default=0)):
            for i in rows[r % len(rows)] if names else []:
                name = names[i]
                b = bound.get(name)
                if b is None or r >= todo[name]:
                    continue
                try:
                    f, bk = _time_step(b, device)
                except Exception as exc:  # noqa: BLE001
                    out[name] = _error(exc)
                    del bound[name]
                    continue
                fwd[name].append(f)
                bwd[name].append(bk)
    for name in bound:
        out[name] = {"repeats": len(fwd[name]), "first_step_seconds": first.get(name), "times": {
            "forward": fwd[name], "backward": bwd[name],
            "forward+backward": [a + b for a, b in zip(fwd[name], bwd[name], strict=True)]}}
    bound.clear()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return out


def matmul_peak(arg: tuple[str, str, int]) -> dict[str, Any]:
    """Best FLOP/s of one matmul on the device: CPU [4096, D] @ [D, 4096] (the shape of the largest
    default case's logits), CUDA 8192^3; the best of several runs."""
    device, dtype, dim = arg
    dev = torch.device(device)
    dt = DTYPES[dtype]
    m, k, n, reps = (8192, 8192, 8192, 20) if dev.type == "cuda" else (4096, max(dim, 256), 4096, 3)
    a = torch.randn(m, k, device=dev).to(dt)
    b = torch.randn(k, n, device=dev).to(dt)
    best = math.inf
    for _ in range(reps + 1):  # the first is a warm-up that can only lose the min
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            a @ b
            e1.record()
            torch.cuda.synchronize(dev)
            best = min(best, e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return {"flops_per_s": 2.0 * m * k * n / best, "shape": [m, k, n], "dtype": dtype}


# ------------------------------------------------------------------------------------------------
# fresh processes
# ------------------------------------------------------------------------------------------------


def _alarm(signum, frame):  # pragma: no cover - runs in a worker
    raise TimeoutError("case exceeded --timeout")


def _guarded(fn: Callable[[Any], dict[str, Any]], arg: Any, timeout: float) -> dict[str, Any]:
    """Worker entry: ``fn(arg)`` with a SIGALRM deadline; any exception becomes an error row."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(timeout)))
    try:
        return fn(arg)
    except TimeoutError as exc:
        return {"status": "timeout", "reason": str(exc)}
    except BaseException as exc:  # noqa: BLE001
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        signal.alarm(0)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during the suite (``signal_name`` says which)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Runner:
    """Runs a task inline, or in a fresh process (``ProcessPoolExecutor(max_tasks_per_child=1)`` on a
    forkserver that has imported torch and this package), so each case's memory is its own and a crash
    or an OOM kill only loses that case."""

    PRELOAD = ("fused_contrastive.bench._no_sigint", "torch", "fused_contrastive", "fused_contrastive.bench.harness")

    def __init__(self, isolate: bool) -> None:
        self.isolate = isolate
        self._ex: cf.ProcessPoolExecutor | None = None
        #: the name of a signal that asked the suite to stop ("SIGINT" / "SIGTERM"), set by the handler
        #: of :meth:`stopping`; acted on by the main thread between polls of the running task, never
        #: inside a worker's start (an exception there leaves a half-spawned worker that the pool's
        #: shutdown waits for forever)
        self.stop: str | None = None

    @contextlib.contextmanager
    def stopping(self):
        """SIGINT and SIGTERM ask the suite to stop: isolated, by setting :attr:`stop` (the wait for the
        running task sees it within 0.2 s and raises :class:`Interrupted`); inline, by raising at once."""

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.isolate:
                self.stop = self.stop or name
            else:
                raise Interrupted(name)

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _check_stop(self) -> None:
        if self.stop is not None:
            raise Interrupted(self.stop)

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._ex is None:
            ctx = mp.get_context("forkserver")
            preload = list(self.PRELOAD)
            try:
                import pytorch_metric_learning.losses  # noqa: F401
                preload.append("pytorch_metric_learning.losses")
            except ImportError:
                pass
            ctx.set_forkserver_preload(preload)
            self._ex = cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1)
        return self._ex

    def _reset(self) -> None:
        if self._ex is not None:
            for p in mp.active_children():  # the worker that hung or died
                p.kill()
            self._ex.shutdown(wait=False, cancel_futures=True)
            self._ex = None

    def __call__(self, fn: Callable[[Any], dict[str, Any]], arg: Any, timeout: float) -> dict[str, Any]:
        if not self.isolate:
            return fn(arg)
        self._check_stop()
        fut = self._executor().submit(_guarded, fn, arg, timeout)
        deadline = time.monotonic() + timeout + 60
        try:
            while True:
                try:
                    return fut.result(timeout=0.2)
                except cf.TimeoutError:
                    self._check_stop()
                    if time.monotonic() > deadline:
                        raise
        except cf.TimeoutError:
            self._reset()
            return {"status": "timeout", "reason": f"no result within {timeout:.0f} s (worker killed)"}
        except BrokenProcessPool:
            self._reset()
            return {"status": "oom", "reason": "the worker died (SIGKILL: likely the kernel's OOM killer)"}

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None

    def abort(self, within: float = 20.0) -> None:
        """Kill the running worker and shut the pool down, joined (its queues and semaphores released:
        nothing for the resource tracker to report as leaked). A signal can land just as a task ends, while
        the pool (one task per worker) starts the next worker: one started after the first kill would
        keep the joined shutdown waiting, so the shutdown runs in a thread and every child the pool
        starts meanwhile is killed too, for at most ``within`` seconds."""
        if self._ex is None:
            return
        ex, self._ex = self._ex, None
        for p in mp.active_children():
            p.kill()
        closing = threading.Thread(target=ex.shutdown, kwargs=dict(wait=True, cancel_futures=True), daemon=True)
        closing.start()
        deadline = time.monotonic() + within
        while closing.is_alive() and time.monotonic() < deadline:
            closing.join(0.5)
            for p in mp.active_children():
                p.kill()


# ------------------------------------------------------------------------------------------------
# the suite
# ------------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One run of the suite (built by ``cli.py``)."""

    cases: list[str]
    sizes: list[int]
    dim: int
    dtype: str
    device: str
    backends: list[str]
    seeds: bool
    peers: bool
    repeats: int
    min_repeats: int
    warmup: int
    out: str
    mem_budget: float
    mem_cap: float
    max_iter_seconds: float
    max_case_seconds: float
    timeout: float
    isolate: bool
    plots: bool
    progress: bool = True
    threads: int | None = None
    extra_sizes: dict[str, list[int]] = field(default_factory=dict)
    #: why ``threads`` was chosen when the user did not say (the report prints it)
    threads_note: str = ""


#: Seconds a fresh process costs before the case runs (fork from the forkserver, imports done there).
PROCESS_SECONDS = 0.6


class Costs:
    """Predicted seconds of each case, refined as steps are measured: a contender's step at N is its
    last measured step scaled by ``(N / N_last)^time_order``; before any measurement, the textbook
    FLOPs at the measured matmul peak (or, for memory-bound contenders, their memory estimate at
    ``MEMORY_BOUND_BYTES_PER_S``)."""

    def __init__(self, cfg: Config, flops_per_s: float) -> None:
        self.cfg, self.flops = cfg, max(flops_per_s, 1e9)
        self.last: dict[tuple[str, str], tuple[int, float]] = {}

    def step(self, p: Planned) -> float:
        from ..testing import CASE_BY_NAME

        con = get_contender(p.case, p.contender)
        if (p.case, p.contender) in self.last:
            n0, t0 = self.last[(p.case, p.contender)]
            return t0 * (p.n / n0) ** con.time_order
        fl = CASE_BY_NAME[p.case].flops(p.n, self.cfg.dim, "forward+backward") or 6.0 * p.n * p.n
        t = max(fl / self.flops, 1e-3)
        if con.estimate is not None:
            isz = torch.empty((), dtype=DTYPES[self.cfg.dtype]).element_size()
            t = max(t, con.estimate(p.n, self.cfg.dim, isz) / MEMORY_BOUND_BYTES_PER_S)
        return t

    def repeats(self, step: float) -> int:
        """``--repeats``, or fewer (never below ``--min-repeats``) when they would take longer than
        ``--max-case-seconds``."""
        c = self.cfg
        if step * (c.repeats + c.warmup) <= c.max_case_seconds:
            return c.repeats
        return max(min(c.min_repeats, c.repeats), min(c.repeats, int(c.max_case_seconds / max(step, 1e-9)) - c.warmup))

    def memory_pass(self, p: Planned) -> float:
        return 0.0 if p.skip else PROCESS_SECONDS + 2 * self.step(p)

    def timing_pass(self, p: Planned) -> float:
        if p.skip:
            return 0.0
        step = self.step(p)
        return step * (self.repeats(step) + self.cfg.warmup)

    def observe(self, p: Planned, seconds: float) -> None:
        self.last[(p.case, p.contender)] = (p.n, seconds)


class Progress:
    """A tqdm bar over the suite's work in model seconds: each (case, N) weighs what :class:`Costs`
    predicts for it before anything is measured (the textbook FLOPs at the measured matmul peak, a
    memory-bound contender's bytes, a fresh process per pass), and the weights never change. The ETA
    is then tqdm's ``elapsed * remaining weight / done weight``: one ratio, measured from the start,
    that does not swing when a measurement re-predicts the cost of a single case. The model is wrong in
    absolute terms (one step is not its FLOPs at peak), about alike for every case; its ratio is what
    the ETA uses."""

    def __init__(self, total: float, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=max(total, 1e-9), disable=not enabled, unit="s", unit_scale=False, dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| [{elapsed}<{remaining}] {desc}", mininterval=0.5)
        self.total, self.done, self.t0 = max(total, 1e-9), 0.0, time.perf_counter()
        #: (elapsed seconds, predicted wall seconds of the whole run) after each (case, N): what the ETA
        #: said, kept in bench.json so that its accuracy is on record
        self.trace: list[tuple[float, float]] = []

    def advance(self, weight: float, label: str) -> None:
        self.bar.set_description_str(label, refresh=False)
        self.bar.update(weight)
        self.done += weight
        elapsed = time.perf_counter() - self.t0
        self.trace.append((round(elapsed, 2), round(elapsed * self.total / max(self.done, 1e-12), 2)))

    def close(self) -> None:
        self.bar.close()


def _time_skippable(con: Contender) -> bool:
    """A memory-bound seed or peer (one with a memory estimate): the only contenders the time budget
    may skip; ours, the reference and the matmul-bound formulas always run."""
    return con.kind in ("seed", "peer") and con.estimate is not None


def run_suite(cfg: Config) -> dict[str, Any]:
    """Run every case of ``cfg``; returns ``{"meta", "rows", "largest_batch"}`` (see ``report.py``).

    SIGINT (Ctrl-C) or SIGTERM stops the run: the worker is killed, the pool shut down and joined, and
    the report holds every (case, N) that finished, with ``meta["interrupted"]`` = ``{"signal",
    "groups_done", "groups_planned"}``."""
    from . import report

    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    planned = plan(cfg.cases, cfg.sizes, cfg.dim, dtype, device, backends=cfg.backends, seeds=cfg.seeds,
                   peers=cfg.peers, mem_cap=cfg.mem_cap, max_iter_seconds=cfg.max_iter_seconds,
                   extra_sizes=cfg.extra_sizes)
    runner = Runner(cfg.isolate)
    load_start = report.loadavg()
    tmp = tempfile.mkdtemp(prefix="fc-bench-ref-")
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    peak: dict[str, Any] = {}
    interrupted: str | None = None
    done = total = 0

    prog = None
    signals = contextlib.ExitStack()
    signals.enter_context(runner.stopping())
    try:
        peak = runner(matmul_peak, (cfg.device, cfg.dtype, cfg.dim), cfg.timeout)
        costs = Costs(cfg, peak.get("flops_per_s", 1e11))
        model = Costs(cfg, peak.get("flops_per_s", 1e11))  # never observes: the progress weights
        groups: dict[tuple[int, str], list[Planned]] = {}
        for p in planned:
            groups.setdefault((p.n, p.case), []).append(p)
        pending = list(groups.items())
        total = len(pending)
        weight = {key: sum(model.memory_pass(p) + model.timing_pass(p) for p in g) for key, g in pending}
        prog = Progress(sum(weight.values()), cfg.progress)
        while pending:
            (n, case), group = pending.pop(0)
            results: dict[str, dict[str, Any]] = {}
            for p in group:  # memory pass: one fresh process per case, the reference first
                results[p.contender] = res = _memory_pass(p, cfg, runner, costs, tmp)
                first = res.get("first_seconds")
                con = get_contender(case, p.contender)
                if res["status"] == "ok" and _time_skippable(con) and first > cfg.max_iter_seconds:
                    costs.observe(p, first)
                    res.update(status="skipped", reason=(
                        f"not timed: its cold step took {first:.1f} s > --max-iter-seconds {cfg.max_iter_seconds:g} "
                        "(peak memory and differences were measured)"))
            ran = [p for p in group if results[p.contender]["status"] == "ok"]
            reps = tuple(costs.repeats(results[p.contender]["first_seconds"]) for p in ran)
            job = TimingJob(case, tuple(p.contender for p in ran), reps, n, cfg.dim, cfg.dtype, cfg.device,
                            cfg.warmup, cfg.threads)
            timed = runner(time_interleaved, job, cfg.timeout) if ran else {}
            for p in ran:
                got = timed.get(p.contender, {"status": timed.get("status", "error"),
                                              "reason": timed.get("reason", "timing pass returned nothing")})
                results[p.contender].update(got)
                if "times" in got:
                    costs.observe(p, statistics.median(got["times"]["forward+backward"]))
            for p in group:
                rows.extend(report.rows_of(p, cfg, results[p.contender]))
            done += 1
            prog.advance(weight[(n, case)], f"{case} N={n}: {len(ran)}/{len(group)} contenders timed")
        prog.close()
        # measured again at the end: on a shared machine the best of the two is the better estimate
        peak = report.best_peak(peak, runner(matmul_peak, (cfg.device, cfg.dtype, cfg.dim), cfg.timeout))
    except KeyboardInterrupt as exc:  # Ctrl-C (SIGINT) or SIGTERM: stop, keep every (case, N) finished
        interrupted = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
        if prog is not None:
            prog.close()
        runner.abort()
    finally:
        signals.close()
        runner.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    rep = report.assemble(cfg, rows, peak, load_start, time.perf_counter() - t_start)
    rep["meta"]["eta_trace"] = prog.trace if prog is not None else []
    if interrupted:
        rep["meta"]["interrupted"] = {"signal": interrupted, "groups_done": done, "groups_planned": total}
    return rep


def _memory_pass(p: Planned, cfg: Config, runner: Runner, costs: Costs, tmp: str) -> dict[str, Any]:
    """Skip the case (with the reason) or run its memory pass in a fresh process."""
    if p.skip:
        return {"status": "skipped", "reason": p.skip}
    con = get_contender(p.case, p.contender)
    if _time_skippable(con) and (p.case, p.contender) in costs.last:
        step = costs.step(p)
        if step > cfg.max_iter_seconds:
            n0, t0 = costs.last[(p.case, p.contender)]
            return {"status": "skipped", "reason": (
                f"predicted ~{step:.0f} s per step (N^{con.time_order} from {t0:.1f} s at N={n0}) > "
                f"--max-iter-seconds {cfg.max_iter_seconds:g}")}
    job = MemoryJob(p.case, p.contender, p.n, cfg.dim, cfg.dtype, cfg.device, cfg.mem_cap,
                    os.path.join(tmp, f"{p.case}-{p.n}.pt"), cfg.isolate, cfg.threads)
    t0 = time.perf_counter()
    res = runner(measure, job, cfg.timeout)
    res["memory_pass_seconds"] = time.perf_counter() - t0
    if res.get("status") == "ok":
        costs.observe(p, res["first_seconds"])
    return res
