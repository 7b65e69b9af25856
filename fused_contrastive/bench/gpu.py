"""``python -m fused_contrastive bench-gpu``: every loss's default route on a CUDA device beside the textbook
formula (eager and under ``torch.compile``), this library's optional forms and the GPU-only peer libraries
installed here, on the same inputs, with each contender's loss checked against the float64 definition.

What runs, per (loss, N, D) (``gpu_losses``: InfoNCE, SimCSE, CLIP, SigLIP, SupCon L_in, GIST, Matryoshka
InfoNCE and CLIP at five levels at N = 4096, 16384, 65536 (GIST 4096 and 16384), D = 768 (and 256 for InfoNCE
and CLIP); MaxSim at N = M = 1024 and 4096, Lq 32, Ld 180, D 128), bf16 inputs, one forward + backward:

* ``fused_contrastive``: the public loss function with its defaults (``backend="auto"``: the route a user
  gets);
* ``fused_contrastive[FORM]``: the same with one route option set (:data:`FORMS`: the epilogue GEMM's tile
  loops, the panel GEMM's form, the path, the panel budget, the Matryoshka routes, launch configurations),
  where it applies: the measurements that decide the defaults;
* ``textbook``: the formula as a user writes it (``F.cross_entropy(F.normalize(q) @ F.normalize(k).T / t,
  arange)`` and its kin), under ``torch.autocast`` bf16;
* ``textbook+compile``: the same under ``torch.compile`` (static shapes; compiled per shape, after the
  eager rows, while the budget lasts);
* every peer of ``gpu_peers`` that imports here and computes that loss (one that does not import is a row
  "not installed").

Each contender: one untimed step (compiles; its loss value is checked against the float64 definition of
``gpu_losses`` under THE accuracy rule of ``testing.accuracy``, PyTorch's own bf16 error being the
textbook's), one step under a peak-memory meter (CUDA: the allocator's peak above what was allocated
before the step, i.e. above the inputs; the gradients the step creates included), then the timed steps:
the contenders alternate in a Williams order within each round (every contender follows every other
equally often), CUDA events around each step, the median over the rounds. A contender whose loss
disagrees is shown, marked DISAGREES, and not ranked. An out-of-memory step is "does not fit".

Budget (``--budget``, seconds): the groups run in priority order while time is left, the compiled
textbook only where the eager rows still to come leave room for it; what is left is listed "not run
(budget)", and the run always ends with the table. Each row is appended to ``DIR/bench_gpu.jsonl`` as it is
measured (a run killed from outside keeps its rows; ``--from-jsonl`` renders the table and plot of such a
file). The table is ``DIR/bench_gpu.txt``, the plot ``DIR/bench_gpu.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import Tensor

from . import gpu_losses as GL
from . import gpu_peers as GP
from .harness import _sync, williams_orders
from .helptext import help_text
from .memory import LiveBytes, is_oom
from .report import device_name

OURS = "fused_contrastive"
TEXTBOOK = "textbook"
COMPILED = "textbook+compile"
KINDS = ("ours", "form", "textbook", "compiled", "peer")
#: the core op's losses (the InfoNCE family on the panel path: its GEMM forms and tile loops apply)
CORE = ("info_nce", "simcse", "clip", "supcon_in", "matryoshka5", "matryoshka5_clip")
#: the losses whose default route at these sizes runs the epilogue GEMM (its tile loops apply)
EPILOGUE = ("info_nce", "simcse", "clip", "siglip", "gist", "matryoshka5", "matryoshka5_clip")


@dataclass(frozen=True)
class Form:
    """A route option of this library, timed as the contender ``fused_contrastive[name]`` where ``applies``
    (loss, N, D): ``env`` is set (``FUSED_CONTRASTIVE_*``, read by the routes per call) and ``patch`` entered
    around the forward and backward."""

    name: str
    why: str
    applies: Callable[[str, int, int], bool]
    env: dict[str, str] = field(default_factory=dict)
    patch: Callable[[], contextlib.AbstractContextManager] | None = None

    def context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.dict(os.environ, self.env))
        if self.patch is not None:
            stack.enter_context(self.patch())
        return stack


def _config(mode: str, cfg_args: tuple[int, int, int, int, int]):
    """A patch of the epilogue GEMM's launch configuration of ``mode`` (``CFG.EPI_GEMM``)."""
    def patch():
        from ..core.triton_shared import configs as CFG
        from ..core.triton_shared.configs import LaunchConfig

        return mock.patch.dict(CFG.EPI_GEMM, {mode: LaunchConfig(*cfg_args)})
    return patch


def _env(key: str, value: str) -> dict[str, str]:
    return {f"FUSED_CONTRASTIVE_{key}": value}


FORMS: tuple[Form, ...] = (
    Form("epi=tiles", "the epilogue GEMM's one-program-per-tile loop (SigLIP's default on sm_90 is TMA)",
         lambda loss, n, d: loss == "siglip", _env("EPI_FORM", "tiles")),
    Form("epi=persistent", "the epilogue GEMM's persistent tile loop (default: one program per tile)",
         lambda loss, n, d: loss in EPILOGUE and d == 768
         and (n == 65536 or (loss in ("gist", "siglip") and n == 16384)), _env("EPI_FORM", "persistent")),
    Form("epi=tma", "the persistent tile loop with TMA operand tiles",
         lambda loss, n, d: loss in EPILOGUE and d == 768 and (n == 65536 or (loss == "gist" and n == 16384)),
         _env("EPI_FORM", "tma")),
    Form("gemm=epilogue", "the epilogue GEMM forms every 16-bit panel (auto: by N x M and form)",
         lambda loss, n, d: loss in CORE + ("gist",), _env("PANEL_GEMM", "epilogue")),
    Form("gemm=cublas", "cuBLAS fp32 products and the panel kernel form every panel",
         lambda loss, n, d: loss in CORE, _env("PANEL_GEMM", "cublas")),
    # (the benchmark's SimCSE, one batch of interleaved views with B = A, takes the triangular sweep: no one pass,
    # so this form would time the default route again there)
    Form("gemm=fp16pass", "the one pass's tiles from cuBLAS fp16 cosines of normalised fp16 copies and one in-place "
         "Triton pass (core/triton_shared/logit_pass.py; ESTIMATE 14-15 ms against 18.9 at InfoNCE N = 65536)",
         lambda loss, n, d: loss in ("info_nce", "matryoshka5") and n in (16384, 65536) and d in (768, 256),
         _env("PANEL_GEMM", "fp16pass")),
    Form("tile=2^24", "the one-tile dense path (PyTorch ops on the whole N x M tile) up to N x M = 2^24 "
         "(default 2^21)", lambda loss, n, d: loss in CORE and n == 4096, _env("TILE_ELEMENTS", str(1 << 24))),
    Form("path=fused", "the fused kernels instead of the panel path (auto: panels from N x M = 2^24)",
         lambda loss, n, d: loss != "maxsim" and n == 4096 and d == 768, _env("TRITON_PATH", "fused")),
    Form("budget=2GB", "a panel budget of 2 GB (default 0.7 GB): taller panels, less dB traffic",
         lambda loss, n, d: loss in ("info_nce", "simcse", "clip", "siglip", "matryoshka5") and n == 65536
         and d == 768, _env("PANEL_BUDGET", str(2_000_000_000))),
    Form("budget=6GB", "a panel budget of 6 GB",
         lambda loss, n, d: loss == "info_nce" and n == 65536 and d == 768, _env("PANEL_BUDGET", str(6_000_000_000))),
    Form("matryoshka=suffix", "the Matryoshka kernels' forward and the suffix backward (auto: one call per level)",
         lambda loss, n, d: loss.startswith("matryoshka5") and n <= 16384, _env("MATRYOSHKA_ROUTE", "suffix")),
    Form("matryoshka=kernels", "the Matryoshka kernels, forward and backward",
         lambda loss, n, d: loss.startswith("matryoshka5") and n <= 16384, _env("MATRYOSHKA_ROUTE", "kernels")),
    Form("one_pass=128x256w16", "the one-pass epilogue GEMM at 128 x 256 tiles, 16 warps, 3 stages",
         lambda loss, n, d: loss == "info_nce" and n >= 16384 and d == 768,
         patch=_config("one_pass", (128, 256, 64, 16, 3))),
    Form("siglip=lean", "SigLIP's lean epilogue: one exp, a log1p polynomial and one approximate reciprocal per "
         "logit (default: exact)", lambda loss, n, d: loss == "siglip" and n in (16384, 65536) and d == 768,
         _env("SIGLIP_EPILOGUE", "lean")),
    Form("siglip=lean128", "the lean epilogue with the one pass at 128 x 128 tiles (default: exact, 64 x 128)",
         lambda loss, n, d: loss == "siglip" and n in (16384, 65536) and d == 768, _env("SIGLIP_EPILOGUE", "lean128")),
    Form("siglip=fp16pass", "SigLIP's sweeps from cuBLAS fp16 cosines of normalised fp16 copies and one in-place "
         "Triton pass per panel (loss, dz and the ds / db partials; core/siglip/triton_fp16pass.py) instead of the "
         "epilogue GEMM's MODE 4 / 5 (ESTIMATE: 48.8 ms for such a form of siglip-kernel at N = 65536 on an H100; "
         "MODE 5 measured 59.0 on an H200)", lambda loss, n, d: loss == "siglip" and n in (16384, 65536) and d == 768,
         _env("SIGLIP_EPILOGUE", "fp16pass")),
    Form("siglip=lean128+tiles", "the lean 128 x 128 one pass in the one-program-per-tile loop (its compile spills "
         "20 bytes there, 116-176 in the default TMA loop)",
         lambda loss, n, d: loss == "siglip" and n in (16384, 65536) and d == 768,
         {**_env("SIGLIP_EPILOGUE", "lean128"), **_env("EPI_FORM", "tiles")}),
    # (the statistics forward runs the epilogue GEMM by default on sm_90 where these rows do: CLIP's column term
    # and SimCSE's triangular sweep at N = 65536, EPILOGUE_MIN_ELEMENTS)
    Form("epi=gluon-ws", "the statistics forward by the persistent warp-specialised Gluon kernel "
         "(kernels/gluon_epi.py: a TMA loader warp, two ping-pong wgmma consumer warpgroups; sm_90 and a tested "
         "Triton, else the Triton kernel with a warning)",
         lambda loss, n, d: loss in ("clip", "simcse") and n == 65536 and d == 768,
         _env("EPI_GEMM", "gluon-ws")),
    Form("epi=hoist", "the epilogue GEMM's per-row loads issued before its D loop (EPI_HOIST; default after it)",
         lambda loss, n, d: loss in ("info_nce", "simcse", "clip", "matryoshka5") and n in (16384, 65536)
         and d == 768, _env("EPI_HOIST", "1")),
    Form("maxsim=overlap", "MaxSim's forward over pairs of token chunks, the next chunk's matmul in flight during "
         "the pair's max / argmax (default: the flat loop, one chunk per step)",
         lambda loss, n, d: loss == "maxsim", _env("MAXSIM_FWD", "overlap")),
    Form("maxsim=dd-regs", "MaxSim's dd with its one-hot operand built in the accumulator's layout (no shared-memory "
         "round trip on sm_90; default: through shared memory)",
         lambda loss, n, d: loss == "maxsim", _env("MAXSIM_DD", "regs")),
    Form("one_pass=128x256w16+hoist", "the 128 x 256 one pass (16 warps, 3 stages) with its loads hoisted",
         lambda loss, n, d: loss == "info_nce" and n >= 16384 and d == 768, _env("EPI_HOIST", "1"),
         patch=_config("one_pass", (128, 256, 64, 16, 3))),
)
FORM_BY_NAME = {f.name: f for f in FORMS}


@dataclass(frozen=True)
class Contender:
    """One way to compute a problem's loss: ``make(problem) -> fn(problem) -> loss`` (bound once per
    problem: peers build their modules, the compiled textbook its graph), run inside ``context()``."""

    name: str
    kind: str
    make: Callable[[GL.Problem], Callable[[GL.Problem], Tensor]]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    autocast: bool = False
    #: why it cannot run here (None: it can)
    missing: str | None = None


def _compiled(loss: str) -> Callable[[GL.Problem], Callable[[GL.Problem], Tensor]]:
    def make(p: GL.Problem):
        f = GL._textbook(loss)
        torch._dynamo.reset()  # a fresh graph per problem (static shapes; no recompile limit across groups)

        def body(*args):
            with torch.autocast(p.device.type, dtype=torch.bfloat16):
                return f(*args)
        c = torch.compile(body, dynamic=False)
        return lambda q: c(*GL.textbook_args(q))
    return make


def contenders(loss: str, n: int, d: int, *, forms: Sequence[str] | None = None, peers: bool = True,
               compile: bool = True) -> list[Contender]:
    """The contenders of (loss, N, D) in the order they run: this library's route, its forms that apply,
    the peers, the textbook, the compiled textbook (last: the costliest first step)."""
    spec = GL.SPECS[loss]
    out = [Contender(OURS, "ours", lambda p: spec.ours)]
    for f in FORMS:
        if (forms is None or f.name in forms) and f.applies(loss, n, d):
            out.append(Contender(f"{OURS}[{f.name}]", "form", lambda p: spec.ours, f.context))
    if peers:
        for peer in GP.peers_of(loss):
            out.append(Contender(peer.package, "peer", peer.losses[loss], missing=peer.missing()))
    out.append(Contender(TEXTBOOK, "textbook", lambda p: spec.textbook, autocast=True))
    if compile:
        out.append(Contender(COMPILED, "compiled", _compiled(loss)))
    return out


@dataclass(frozen=True)
class Group:
    loss: str
    n: int
    d: int


def default_plan(losses: Sequence[str] = GL.LOSSES, sizes: Sequence[int] | None = None,
                 dims: Sequence[int] | None = None) -> list[Group]:
    """The (loss, N, D) groups in priority order: N = 16384, then 65536, then 4096 (every loss at D = 768, in
    :data:`gpu_losses.LOSSES` order), then the other D, then MaxSim; ``sizes`` / ``dims`` restrict the Ns and
    Ds each loss runs at (default: its own)."""
    out: list[Group] = []
    main = [x for x in losses if x != "maxsim"]
    order = (16384, 65536, 4096)
    for loss in main:
        GL.SPECS[loss]  # KeyError for an unknown loss
    all_n = sorted({n for x in main for n in (sizes or GL.SPECS[x].sizes)},
                   key=lambda n: (order.index(n) if n in order else len(order), n))
    for first_d in (True, False):
        for n in all_n:
            for loss in main:
                spec = GL.SPECS[loss]
                ds = list(dims or spec.dims)
                for d in (ds[:1] if first_d else ds[1:]):
                    if n in (sizes or spec.sizes):
                        out.append(Group(loss, n, d))
    if "maxsim" in losses:
        spec = GL.SPECS["maxsim"]
        for n in (sizes or spec.sizes):
            for d in (dims or spec.dims):
                out.append(Group("maxsim", n, d))
    return out


@dataclass
class Config:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    repeats: int = 5
    budget: float = 330.0
    #: seconds kept back for the table and the plot
    reserve: float = 15.0
    out: str | None = None
    forms: Sequence[str] | None = None  # None: every form where it applies; () none
    peers: bool = True
    compile: bool = True
    #: first-step seconds assumed for a compiled textbook until one has been measured
    compile_estimate: float = 40.0
    seed: int = 0
    #: rows per chunk of the float64 definitions (None: by CHUNK_ELEMENTS)
    truth_chunk: int | None = None
    print_fn: Callable[[str], None] = print


class Clock:
    def __init__(self, budget: float) -> None:
        self.t0, self.budget = time.monotonic(), budget

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_step(c: Contender, fn: Callable[[GL.Problem], Tensor], p: GL.Problem) -> Tensor:
    """One forward + backward of ``fn`` on ``p`` inside the contender's context; returns the loss."""
    p.zero_grad()
    with c.context():
        with torch.autocast(p.device.type, dtype=torch.bfloat16) if c.autocast else contextlib.nullcontext():
            loss = fn(p)
        loss.backward()
    return loss.detach()


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """``measure(step) -> ms``: CUDA events around the step (the device idle before it), else wall time
    (``check --gpu-validate``'s timer)."""
    from ..gpu_validate import _timer

    return _timer(str(device))


def peak_bytes(device: torch.device, step: Callable[[], Any]) -> int:
    """Peak memory of ``step()`` above what was allocated before it: the CUDA allocator's peak, or (CPU) the
    bytes of the live tensors it creates (``LiveBytes``)."""
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    with LiveBytes() as m:
        step()
    return m.peak


def _err(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:200] if msg else ''}"


def agreement(value: float, truth: float, e_same: float, spec: GL.LossSpec) -> tuple[bool, float, float]:
    """(agrees, |error|, tolerance) of a bf16 loss value against its float64 definition under THE rule
    (``testing.accuracy.check_output`` for the 0-dim loss: the slack relative to the loss, twice PyTorch's
    own bf16 error ``e_same`` granted up to the slack, the bf16 spacing, the logits' rounding floor)."""
    from ..testing.accuracy import FLOOR_ROUNDINGS, check_output

    if value != value:  # NaN
        return False, float("nan"), 0.0
    floor = FLOOR_ROUNDINGS * 2.0**-24 * spec.scale
    got, want = (torch.tensor(x, dtype=torch.float64) for x in (value, truth))
    _, err, tol = check_output("loss", got, want, None, torch.bfloat16, e_same=e_same, ref=max(1.0, abs(truth)),
                               floor=floor)
    return err <= tol, err, tol


def _versions() -> dict[str, str | None]:
    """The benchmark report's versions and commit, and each peer's (None: not installed)."""
    from .report import git_commit, versions

    out = dict(versions(), commit=git_commit())
    for peer in GP.PEERS:
        out[peer.package] = getattr(importlib.import_module(peer.module), "__version__", "?") \
            if peer.missing() is None else None
    return out


class Recorder:
    """The rows of a run: kept, printed as they come, appended to ``DIR/bench_gpu.jsonl``."""

    def __init__(self, out: str | None, print_fn: Callable[[str], None], meta: dict[str, Any]) -> None:
        self.rows: list[dict[str, Any]] = []
        self.print = print_fn
        self.meta = meta
        self.path = None
        if out:
            os.makedirs(out, exist_ok=True)
            self.path = os.path.join(out, "bench_gpu.jsonl")
            with open(self.path, "w") as fh:
                fh.write(json.dumps({"meta": meta}) + "\n")

    def add(self, row: dict[str, Any]) -> None:
        row = {"gpu": self.meta.get("gpu"), **row}
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        self.print(row_line(row))


def row_line(r: dict[str, Any]) -> str:
    head = f"{r['loss']} N={r['n']} D={r['d']} {r['contender']}"
    if r["status"] != "ok":
        return f"{head}: {r['status']}"
    agree = "agrees" if r.get("agrees") else f"DISAGREES (err {r.get('err', 0):.2e} > tol {r.get('tol', 0):.2e})"
    return (f"{head}: {r['ms']:.3f} ms (median of {r['repeats']}), peak {r['peak_mb']:.0f} MB, loss "
            f"{r['loss_value']:.6g} vs {r['truth']:.6g}: {agree}")


def run_group(g: Group, cfg: Config, clock: Clock, rec: Recorder,
              cons: list[Contender] | None = None) -> dict[str, float]:
    """Measure every contender of one group; returns {contender: first-step seconds} of those that ran."""
    device = torch.device(cfg.device)
    spec = GL.SPECS[g.loss]
    cons = cons if cons is not None else contenders(g.loss, g.n, g.d, forms=cfg.forms, peers=cfg.peers,
                                                    compile=cfg.compile)
    base = {"loss": g.loss, "n": g.n, "d": g.d, "dtype": str(cfg.dtype).replace("torch.", "")}
    p = GL.build(g.loss, g.n, g.d, device, cfg.dtype, cfg.seed)
    t0 = time.monotonic()
    truth = spec.truth(p, cfg.truth_chunk)
    truth_s = time.monotonic() - t0
    results: dict[str, dict[str, Any]] = {}
    bound: dict[str, Callable[[GL.Problem], Tensor]] = {}
    first: dict[str, float] = {}
    for c in cons:
        row = dict(base, contender=c.name, kind=c.kind, truth=truth, input_mb=p.input_bytes() / 1e6)
        results[c.name] = row
        if c.missing is not None:
            row["status"] = c.missing
            continue
        if clock.left() < cfg.reserve:
            row["status"] = "not run (budget)"
            continue
        try:
            t1 = time.monotonic()
            fn = c.make(p)
            value = float(run_step(c, fn, p))
            _sync(device)
            first[c.name] = time.monotonic() - t1
            peak = peak_bytes(device, lambda c=c, fn=fn: run_step(c, fn, p))
            bound[c.name] = fn
            row.update(status="ok", loss_value=value, peak_mb=peak / 1e6, first_s=round(first[c.name], 3))
        except Exception as exc:  # noqa: BLE001 - any failure is this contender's row, the run goes on
            row["status"] = "does not fit" if is_oom(exc) else f"error: {_err(exc)}"
            p.zero_grad()
            _free(device)
    measure = timer(device)
    names = list(bound)
    samples: dict[str, list[float]] = {k: [] for k in names}
    orders = williams_orders(len(names)) if names else [[]]
    by_name = {c.name: c for c in cons}
    for r in range(cfg.repeats):
        if r >= 3 and clock.left() < cfg.reserve:
            break
        for i in orders[r % len(orders)]:
            name = names[i]
            if name not in bound:
                continue
            c, fn = by_name[name], bound[name]
            try:
                samples[name].append(measure(lambda c=c, fn=fn: run_step(c, fn, p)))
            except Exception as exc:  # noqa: BLE001
                results[name].update(status="does not fit" if is_oom(exc) else f"error: {_err(exc)}")
                del bound[name]
                p.zero_grad()
                _free(device)
    key = (g.loss, g.n, g.d)
    tb = results.get(TEXTBOOK) or next((r for r in rec.rows if (r["loss"], r["n"], r["d"]) == key
                                        and r["contender"] == TEXTBOOK), {})
    e_same = abs(tb["loss_value"] - truth) if tb.get("status") == "ok" else 0.0
    for name, row in results.items():
        if row.get("status") == "ok" and samples.get(name):
            ok, err, tol = agreement(row["loss_value"], truth, e_same, spec)
            row.update(ms=statistics.median(samples[name]), ms_samples=[round(x, 4) for x in samples[name]],
                       repeats=len(samples[name]), agrees=ok, err=err, tol=tol, truth_s=round(truth_s, 3))
        elif row.get("status") == "ok":
            row["status"] = "not run (budget)"
        if name.startswith(f"{OURS}[") and name[len(OURS) + 1:-1] in FORM_BY_NAME:
            row["form_env"] = FORM_BY_NAME[name[len(OURS) + 1:-1]].env
        rec.add(row)
    bound.clear()
    p.leaves.clear()
    p.extra.clear()
    _free(device)
    return first


def _not_run(rec: Recorder, cfg: Config, g: Group, cons: Sequence[Contender]) -> None:
    for c in cons:
        rec.add({"loss": g.loss, "n": g.n, "d": g.d, "dtype": str(cfg.dtype).replace("torch.", ""),
                 "contender": c.name, "kind": c.kind, "status": "not run (budget)"})


def compile_order(plan: Sequence[Group]) -> list[Group]:
    """The groups of the compiled-textbook pass: the largest N first (where the textbook's N x M tensors
    cost the most and a compiler could save the most), in plan order within an N."""
    return sorted(plan, key=lambda g: -g.n)


def run(cfg: Config, plan: Sequence[Group] | None = None,
        contenders_of: Callable[[Group], list[Contender]] | None = None) -> list[dict[str, Any]]:
    """Run ``plan`` (default :func:`default_plan`) within ``cfg.budget``: every group's eager contenders first,
    then the compiled textbook group by group (:func:`compile_order`) while a compile's first step (the
    largest measured so far, ``cfg.compile_estimate`` before any) fits in what is left. Returns the rows (also
    written to ``cfg.out``, with the table and the plot). ``contenders_of``: the contenders of a group (tests
    use stand-ins; default :func:`contenders`)."""
    device = torch.device(cfg.device)
    plan = list(plan if plan is not None else default_plan())
    clock = Clock(cfg.budget)
    meta = {"gpu": device_name(str(device)), "device": str(device), "budget_s": cfg.budget, "repeats": cfg.repeats,
            "versions": _versions(), "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rec = Recorder(cfg.out, cfg.print_fn, meta)
    cfg.print_fn(f"bench-gpu on {meta['gpu']}: {len(plan)} groups, budget {cfg.budget:.0f} s; versions "
                 + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))

    def cons_of(g: Group) -> list[Contender]:
        if contenders_of is not None:
            return contenders_of(g)
        return contenders(g.loss, g.n, g.d, forms=cfg.forms, peers=cfg.peers, compile=cfg.compile)

    def one(g: Group, cons: list[Contender]) -> dict[str, float]:
        cfg.print_fn(f"[{clock.elapsed():6.1f} s] {g.loss} N={g.n} D={g.d}: {', '.join(c.name for c in cons)}")
        try:
            return run_group(g, cfg, clock, rec, cons=cons)
        except Exception as exc:  # noqa: BLE001 - a group that cannot even build its inputs: one row says why
            rec.add({"loss": g.loss, "n": g.n, "d": g.d, "dtype": str(cfg.dtype).replace("torch.", ""),
                     "contender": "(inputs)", "kind": "inputs",
                     "status": "does not fit" if is_oom(exc) else f"error: {_err(exc)}"})
            _free(device)
            return {}

    later: list[tuple[Group, list[Contender]]] = []
    for g in plan:
        cons = cons_of(g)
        eager = [c for c in cons if c.kind != "compiled"]
        later += [(g, [c for c in cons if c.kind == "compiled"])]
        if clock.left() < cfg.reserve + 5:
            _not_run(rec, cfg, g, eager)
            continue
        one(g, eager)
    compile_s = [cfg.compile_estimate]
    by_group = dict(later)
    for g in compile_order([g for g, cons in later if cons]):
        cons = by_group[g]
        if clock.left() - cfg.reserve < max(compile_s):
            _not_run(rec, cfg, g, cons)
            continue
        first = one(g, cons)
        compile_s += [v for k, v in first.items() if k == COMPILED]
    summary = dict(meta, wall_s=round(clock.elapsed(), 1))
    text = format_table(rec.rows, summary)
    cfg.print_fn(text)
    if cfg.out:
        with open(os.path.join(cfg.out, "bench_gpu.txt"), "w") as fh:
            fh.write(text + "\n")
        plot(rec.rows, os.path.join(cfg.out, "bench_gpu.png"), cfg.print_fn)
    return rec.rows


# --- the report -------------------------------------------------------------------------------------------


def _ms(r: dict[str, Any] | None) -> float | None:
    return r["ms"] if r and r.get("status") == "ok" and r.get("agrees") and "ms" in r else None


def summary_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (loss, D, N): this library's route, the textbook, the compiled textbook, the best peer (ranked
    contenders only: measured and agreeing), the ratios this library / the other, and the peaks."""
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["loss"], r["d"], r["n"]), {})[r["contender"]] = r
    out = []
    for (loss, d, n), cons in groups.items():
        ours, tb, cp = cons.get(OURS), cons.get(TEXTBOOK), cons.get(COMPILED)
        peers = [r for r in cons.values() if r.get("kind") == "peer" and _ms(r) is not None]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        forms = [r for r in cons.values() if r.get("kind") == "form" and _ms(r) is not None]
        fastest_form = min(forms, key=lambda r: r["ms"]) if forms else None
        o = _ms(ours)
        faster = fastest_form if fastest_form and o and fastest_form["ms"] < o else None
        out.append({"loss": loss, "d": d, "n": n, "ours_ms": o, "textbook_ms": _ms(tb), "compiled_ms": _ms(cp),
                    "peer": best["contender"] if best else None, "peer_ms": _ms(best),
                    "vs_textbook": o / _ms(tb) if o and _ms(tb) else None,
                    "vs_compiled": o / _ms(cp) if o and _ms(cp) else None,
                    "vs_peer": o / _ms(best) if o and best else None,
                    "ours_peak_mb": ours.get("peak_mb") if ours else None,
                    "textbook_peak_mb": tb.get("peak_mb") if tb else None,
                    "peer_peak_mb": best.get("peak_mb") if best else None,
                    "fastest_form": faster["contender"] if faster else None,
                    "fastest_form_ms": faster["ms"] if faster else None})
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# bench-gpu: {meta.get('gpu')}, bf16, forward + backward, ms = median over rounds of CUDA-event "
             "times; ratio = fused_contrastive / the other (< 1: this library is faster); peak = memory above "
             "the inputs",
             "# " + ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
             + (f"; wall {meta['wall_s']} s of a {meta['budget_s']:.0f} s budget" if "wall_s" in meta else ""),
             "", "## Summary (ranked: measured and agreeing with the float64 definition)", "",
             f"{'loss':<17} {'D':>4} {'N':>6} {'ours ms':>9} {'textbook':>9} {'ratio':>6} {'compiled':>9} "
             f"{'ratio':>6} {'best peer':<25} {'ms':>9} {'ratio':>6} {'peak MB ours / textbook / peer':>32}  "
             "faster form"]
    for s in summary_rows(rows):
        peaks = " / ".join(_f(s[k], "{:.0f}") for k in ("ours_peak_mb", "textbook_peak_mb", "peer_peak_mb"))
        form = f"{s['fastest_form']} {s['fastest_form_ms']:.2f}" if s["fastest_form"] else ""
        lines.append(f"{s['loss']:<17} {s['d']:>4} {s['n']:>6} {_f(s['ours_ms']):>9} {_f(s['textbook_ms']):>9} "
                     f"{_f(s['vs_textbook']):>6} {_f(s['compiled_ms']):>9} {_f(s['vs_compiled']):>6} "
                     f"{s['peer'] or '-':<25} {_f(s['peer_ms']):>9} {_f(s['vs_peer']):>6} {peaks:>32}  {form}")
    lines += ["", "## Every contender", "",
              f"{'loss':<17} {'D':>4} {'N':>6} {'contender':<42} {'ms':>9} {'ratio':>6} {'peak MB':>9} "
              f"{'first s':>8}  loss vs float64"]
    ours_ms = {(r["loss"], r["d"], r["n"]): _ms(r) for r in rows if r["contender"] == OURS}
    for r in rows:
        key = (r["loss"], r["d"], r["n"])
        if r.get("status") != "ok" or "ms" not in r:
            lines.append(f"{r['loss']:<17} {r['d']:>4} {r['n']:>6} {r['contender']:<42} {r.get('status')}")
            continue
        o = ours_ms.get(key)
        ratio = o / r["ms"] if o and r.get("agrees") else None
        check = (f"ok (|err| {r['err']:.1e} <= {r['tol']:.1e})" if r.get("agrees")
                 else f"DISAGREES, not ranked (|err| {r['err']:.1e} > {r['tol']:.1e}; loss {r['loss_value']:.6g}, "
                      f"float64 {r['truth']:.6g})")
        lines.append(f"{r['loss']:<17} {r['d']:>4} {r['n']:>6} {r['contender']:<42} {r['ms']:>9.3f} {_f(ratio):>6} "
                     f"{r.get('peak_mb', 0):>9.0f} {r.get('first_s', 0):>8.1f}  {check}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str, print_fn: Callable[[str], None] = print) -> str | None:
    """Time against N per (loss, D), one line per contender (forms thin and dashed); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print_fn("bench-gpu: matplotlib is not installed, no plot")
        return None
    panels = sorted({(r["loss"], r["d"]) for r in rows}, key=lambda k: (GL.LOSSES.index(k[0]) if k[0] in GL.LOSSES
                                                                       else 99, -k[1]))
    if not panels:
        return None
    cols = 4
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (loss, d) in zip(axes.flat, panels, strict=False):
        series: dict[str, list[tuple[int, float]]] = {}
        kinds: dict[str, str] = {}
        for r in rows:
            if (r["loss"], r["d"]) == (loss, d) and _ms(r) is not None:
                series.setdefault(r["contender"], []).append((r["n"], r["ms"]))
                kinds[r["contender"]] = r.get("kind", "")
        for name, pts in sorted(series.items()):
            pts.sort()
            style = {"ours": dict(lw=2.4, color="C3"), "textbook": dict(lw=1.8, color="k"),
                     "compiled": dict(lw=1.5, color="0.5"), "form": dict(lw=0.8, ls="--")}
            style = style.get(kinds[name], dict(lw=1.5))
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{loss}, D={d}", fontsize=9)
        ax.set_xlabel("N", fontsize=8)
        ax.set_ylabel("ms (fwd + bwd)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=5)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def read_jsonl(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    meta, rows = {}, []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            obj = json.loads(line)
            if "meta" in obj:
                meta = obj["meta"]
            else:
                rows.append(obj)
    return meta, rows


# --- the measured table (docs/gpu-measurements.md) ---------------------------------------------------------

#: The committed bench-gpu runs docs/gpu-measurements.md's table quotes, newest first: a row (loss, N, D,
#: contender) comes from the first run that measured it (the second H200 run; the first for MaxSim and the
#: compiled textbook).
README_RUNS = ("bench/results/h200-bench-gpu-2/bench_gpu.jsonl", "bench/results/h200-bench-gpu-1/bench_gpu.jsonl")


def current_rows(root: str, files: Sequence[str] = README_RUNS) -> list[dict[str, Any]]:
    """The rows of ``files`` merged (the first file's row of a (loss, N, D, contender) wins), with this library's
    row at each (loss, N, D) being that of the form its default takes now: where ``fused_contrastive.routes``
    quotes another contender's row of that run as the default's evidence (a default changed after the run),
    that row, marked ``"form"``."""
    from .. import routes

    merged: dict[tuple, dict[str, Any]] = {}
    for f in files:
        _, rows = read_jsonl(os.path.join(root, f))
        by = {(r["loss"], r["n"], r["d"], r["contender"]): r for r in rows}
        for ev in (e for rt in routes.ROUTES for e in rt.evidence if getattr(e, "file", None) == f):
            if ev.chosen != OURS and (ev.loss, ev.n, ev.d, ev.chosen) in by:
                by[(ev.loss, ev.n, ev.d, OURS)] = dict(by[(ev.loss, ev.n, ev.d, ev.chosen)], contender=OURS,
                                                      form=ev.chosen)
        for key, r in by.items():
            merged.setdefault(key, r)
    return list(merged.values())


def readme_table(root: str, files: Sequence[str] = README_RUNS) -> str:
    """docs/gpu-measurements.md's Markdown table of the committed runs (:func:`current_rows`): per loss, D and N this
    library's default route, the textbook (eager and compiled) and the fastest agreeing peer, with the ratios
    this library / the other and the peak memory above the inputs."""
    rows = current_rows(root, files)
    forms = {(r["loss"], r["d"], r["n"]): r.get("form") for r in rows if r["contender"] == OURS}
    textbook = {(r["loss"], r["d"], r["n"]): r.get("status") for r in rows if r["contender"] == TEXTBOOK}
    out = ["| loss | D | N | this library ms | textbook ms | ratio | compiled ms | ratio | fastest peer | peer ms "
           "| ratio | peak MB: this library / textbook / peer |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(GL.LOSSES)}
    for srow in sorted(summary_rows(rows), key=lambda s: (order.get(s["loss"], 99), -s["d"], s["n"])):
        mark = " †" if forms.get((srow["loss"], srow["d"], srow["n"])) else ""
        peaks = " / ".join(_f(srow[k], "{:.0f}") for k in ("ours_peak_mb", "textbook_peak_mb", "peer_peak_mb"))
        status = textbook.get((srow["loss"], srow["d"], srow["n"]))
        tb = _f(srow["textbook_ms"]) if srow["textbook_ms"] is not None or status != "does not fit" else status
        out.append(f"| {srow['loss']} | {srow['d']} | {srow['n']} | {_f(srow['ours_ms'])}{mark} | {tb} | "
                   f"{_f(srow['vs_textbook'])} | {_f(srow['compiled_ms'])} | {_f(srow['vs_compiled'])} | "
                   f"{srow['peer'] or '-'} | {_f(srow['peer_ms'])} | {_f(srow['vs_peer'])} | {peaks} |")
    return "\n".join(out)


# --- command line -----------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-gpu", help="time every default route beside the textbook and the GPU-only peers (CUDA)",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--losses", default=",".join(GL.LOSSES),
                   help=f"comma-separated (default all: {', '.join(GL.LOSSES)})")
    p.add_argument("--sizes", default=None, help="comma-separated N for every loss (default: each loss's own)")
    p.add_argument("--dims", default=None, help="comma-separated D for every loss (default: each loss's own)")
    p.add_argument("--forms", default="all",
                   help="this library's route options to time beside its defaults: all (default), none, or a "
                        f"comma-separated list of {', '.join(FORM_BY_NAME)}")
    p.add_argument("--no-peers", action="store_true", help="leave the peer libraries out")
    p.add_argument("--no-compile", action="store_true", help="leave the compiled textbook out")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per group (default 5)")
    p.add_argument("--budget", type=float, default=330.0, metavar="SECONDS",
                   help="wall clock for the measurements; the table always follows (default 330)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write bench_gpu.jsonl, bench_gpu.txt and bench_gpu.png here")
    p.add_argument("--from-jsonl", default=None, metavar="FILE",
                   help="render the table (and, with --out, the plot) of a saved bench_gpu.jsonl; measure nothing")
    p.add_argument("--list", action="store_true", help="print the plan (groups and contenders) and exit")
    return p


def config_from(a: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[Config, list[Group]]:
    losses = _csv(a.losses)
    bad = [x for x in losses if x not in GL.SPECS]
    if bad or not losses:
        ap.error(f"--losses: unknown {bad or [a.losses]}; valid: {', '.join(GL.LOSSES)}")

    def ints(text, flag):
        try:
            vals = [int(x) for x in _csv(text)]
        except ValueError:
            ap.error(f"{flag} must be comma-separated integers")
        if not vals or min(vals) < 2:
            ap.error(f"{flag} must hold integers >= 2")
        return vals
    sizes = ints(a.sizes, "--sizes") if a.sizes else None
    dims = ints(a.dims, "--dims") if a.dims else None
    if a.forms == "all":
        forms = None
    elif a.forms == "none":
        forms = ()
    else:
        forms = _csv(a.forms)
        bad = [x for x in forms if x not in FORM_BY_NAME]
        if bad:
            ap.error(f"--forms: unknown {bad}; valid: all, none, {', '.join(FORM_BY_NAME)}")
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    if a.budget <= 0:
        ap.error("--budget must be > 0")
    cfg = Config(repeats=a.repeats, budget=a.budget, out=a.out, forms=forms, peers=not a.no_peers,
                 compile=not a.no_compile)
    return cfg, default_plan(losses, sizes, dims)


def run_cli(a: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    if a.from_jsonl:
        meta, rows = read_jsonl(a.from_jsonl)
        print(format_table(rows, meta))
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            plot(rows, os.path.join(a.out, "bench_gpu.png"))
        return 0
    cfg, plan = config_from(a, ap)
    if a.list:
        for g in plan:
            names = [c.name for c in contenders(g.loss, g.n, g.d, forms=cfg.forms, peers=cfg.peers,
                                                compile=cfg.compile)]
            print(f"{g.loss} N={g.n} D={g.d}: {', '.join(names)}")
        return 0
    if not torch.cuda.is_available():
        print("bench-gpu needs a CUDA device (torch.cuda.is_available() is False here); "
              "on the CPU use `python -m fused_contrastive bench`", file=sys.stderr)
        return 2
    run(cfg, plan)
    return 0


__all__ = ["FORMS", "Config", "Contender", "Form", "Group", "contenders", "default_plan", "format_table", "plot",
           "read_jsonl", "run", "summary_rows"]
