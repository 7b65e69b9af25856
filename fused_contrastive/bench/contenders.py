"""Benchmark cases and contenders: which implementations run a case, on which inputs, and why a case
is skipped before it runs.

A benchmark *case* is (registry case, contender, N): N is the number of **anchors**, the rows of the
similarity matrix (``testing.cases``: e.g. SupCon at N takes ``[N/2, 2, D]`` features, supervised
SimCSE takes N interleaved triplets). Every contender of a case gets the same input values (a seeded
generator per case, N and D, cast to ``--dtype``).

Contenders: this library's backends (``reference``: the naive backend and the baseline of every
ratio; ``torch``; ``triton``, CUDA only) and the case's baselines from ``testing.baselines``
(``formula``: the textbook formula the loss replaces; ``seed-*``; ``pml-*`` peers when installed).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._backend import triton_usable_on
from ..testing import BASELINES, BENCH_CASES, CASE_BY_NAME, Case
from ..testing.baselines import Baseline, Estimate
from ..testing.baselines import available as baseline_available

MODES = ("forward", "backward", "forward+backward")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "float64": torch.float64}
GiB = 1 << 30
MiB = 1 << 20

#: Throughput of the memory-bound contenders (those with a memory estimate), measured on the 2-core
#: CPU: a step takes ~1 s per 0.5 GB of their estimate. Predicts steps too slow to time.
MEMORY_BOUND_BYTES_PER_S = 5e8


@dataclass(frozen=True)
class Contender:
    """One implementation of a case: ours (``backend`` set) or a baseline (see ``testing.baselines``)."""

    name: str
    kind: str  # "reference", "ours", "formula", "seed" or "peer"
    fn: Callable[[dict[str, Any]], Tensor]
    source: str
    memory_order: int
    time_order: int = 2
    estimate: Estimate | None = None
    requires: str | None = None
    backend: str | None = None
    note: str = ""


def _ours(case: Case, backend: str) -> Callable[[dict[str, Any]], Tensor]:
    return lambda x: case.fn(**x, backend=backend)


def _baseline(b: Baseline) -> Contender:
    return Contender(b.name, b.kind, b.fn, b.source, b.memory_order, b.time_order, b.estimate, b.requires,
                     note=b.note)


def contenders(case: Case) -> list[Contender]:
    """Every contender of ``case``: reference, torch, triton, then the case's baselines."""
    return [
        Contender("reference", "reference", _ours(case, "reference"),
                  'fused_contrastive backend="reference" (naive, materialises the logits)', 2, backend="reference"),
        Contender("torch", "ours", _ours(case, "torch"),
                  'fused_contrastive backend="torch" (one tile when it fits, else chunked: O(N*D) memory)', 1,
                  time_order=2 if case.logits is not None else 1, backend="torch"),  # CoSENT: O(N log N)
        Contender("triton", "ours", _ours(case, "triton"),
                  'fused_contrastive backend="triton" (fused kernels, CUDA)', 1, backend="triton"),
    ] + [_baseline(b) for b in BASELINES.get(case.name, [])] + _compiled_contenders(case)


def _compiled(fn: Callable[[dict[str, Any]], Tensor]) -> Callable[[dict[str, Any]], Tensor]:
    """``torch.compile(fn)`` (Inductor, default options), created on first call."""
    compiled = None

    def run(x: dict[str, Any]) -> Tensor:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(x)
    return run


def _compiled_contenders(case: Case) -> list[Contender]:
    """``bench --compile``: the torch backend and the textbook formula under ``torch.compile``."""
    out = [Contender("torch-compiled", "compiled", _compiled(_ours(case, "torch")),
                     'torch.compile of fused_contrastive backend="torch" (the registered custom ops)', 1,
                     time_order=2 if case.logits is not None else 1, backend="torch")]
    for b in BASELINES.get(case.name, []):
        if b.kind == "formula":
            out.append(Contender("formula-compiled", "compiled", _compiled(b.fn),
                                 f"torch.compile of the textbook formula ({b.source})", b.memory_order, b.time_order,
                                 note=b.note))
    return out


def get_contender(case: str, name: str) -> Contender:
    for c in contenders(CASE_BY_NAME[case]):
        if c.name == name:
            return c
    raise KeyError(f"no contender {name!r} for case {case!r}")


@dataclass
class CaseInputs:
    """Tensors of one case: ``diff`` require grad (their gradients are compared), ``aux`` are the
    other arguments (labels, options)."""

    diff: dict[str, Tensor]
    aux: dict[str, Any] = field(default_factory=dict)

    def as_kwargs(self) -> dict[str, Any]:
        return {**self.diff, **self.aux}

    def nbytes(self) -> int:
        ts = [*self.diff.values(), *(v for v in self.aux.values() if isinstance(v, Tensor))]
        return sum(t.numel() * t.element_size() for t in ts)

    def grads(self) -> list[Tensor | None]:
        return [t.grad for t in self.diff.values()]

    def zero_grad(self) -> None:
        for t in self.diff.values():
            t.grad = None


def make_inputs(case: Case, n: int, d: int, dtype: torch.dtype, device: torch.device) -> CaseInputs:
    """The inputs of ``case`` at N anchors: the same values for every contender (seeded per case, N, D)."""
    tensors, kwargs = case.build(n, d, torch.Generator().manual_seed(zlib.crc32(f"{case.name}:{n}:{d}".encode())))
    return CaseInputs(
        diff={k: v.to(device=device, dtype=dtype if v.dim() > 0 else torch.float32).requires_grad_(True)
              for k, v in tensors.items()},
        aux={k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in kwargs.items()},
    )


@dataclass
class Bound:
    """A contender bound to concrete inputs: ``forward()``, ``step()`` (one training step)."""

    case: Case
    contender: Contender
    n: int
    d: int
    inputs: CaseInputs

    def forward(self) -> Tensor:
        return self.contender.fn(self.inputs.as_kwargs())

    def zero_grad(self) -> None:
        self.inputs.zero_grad()

    def step(self) -> Tensor:
        self.zero_grad()
        loss = self.forward()
        loss.backward()
        return loss.detach()


def bind(case: str, contender: str, n: int, d: int, dtype: torch.dtype, device: torch.device) -> Bound:
    c = CASE_BY_NAME[case]
    return Bound(c, get_contender(case, contender), n, d, make_inputs(c, n, d, dtype, device))


def unavailable(case: Case, con: Contender, device: torch.device) -> str | None:
    """Why ``con`` cannot run on ``device`` (None when it can)."""
    if con.backend == "triton":
        if device.type != "cuda":
            return "no GPU: the triton backend runs on CUDA (the CPU interpreter is for tests only)"
        if not triton_usable_on(device):
            return "triton not installed"
    if con.requires is not None:
        return baseline_available(Baseline(con.name, con.kind, con.fn, con.source, requires=con.requires))
    return None


def skip_reason(case: Case, con: Contender, n: int, d: int, dtype: torch.dtype, device: torch.device,
                mem_cap: float, max_iter_seconds: float | None = None) -> str | None:
    """Why the case is not attempted: unavailable; or its memory estimate exceeds ``mem_cap``; or
    (a memory-bound seed or peer) its step is predicted from that estimate to exceed
    ``max_iter_seconds``."""
    why = unavailable(case, con, device)
    if why is not None or con.estimate is None:
        return why
    need = con.estimate(n, d, torch.empty((), dtype=dtype).element_size())
    if need > mem_cap:
        return f"would need ~{need / GiB:.1f} GiB ({con.note}) > cap {mem_cap / GiB:.1f} GiB"
    step = need / MEMORY_BOUND_BYTES_PER_S
    if max_iter_seconds is not None and con.kind in ("seed", "peer") and step > max_iter_seconds:
        return (f"predicted ~{step:.0f} s per step (~1 s per 0.5 GB of its {con.note}) > "
                f"max {max_iter_seconds:g} s per step")
    return None


@dataclass(frozen=True)
class Planned:
    """One (case, contender, N) of a run: it runs, or is skipped with ``skip``."""

    case: str
    contender: str
    n: int
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.case}-{self.contender}-N{self.n}"


def plan(cases: Sequence[str], sizes: Sequence[int], d: int, dtype: torch.dtype, device: torch.device, *,
         backends: Sequence[str] = ("reference", "torch", "triton"), seeds: bool = True, peers: bool = True,
         mem_cap: float = 16 * GiB, max_iter_seconds: float | None = None,
         extra_sizes: dict[str, Sequence[int]] | None = None) -> list[Planned]:
    """The (case, contender, N) grid of a run in run order (by size, then case, reference first) with
    the static skip reasons of :func:`skip_reason`. ``extra_sizes`` adds sizes for some cases only.
    The ``formula`` contender always runs (the small-batch table compares with it)."""
    extra = extra_sizes or {}
    out = []
    for n in sorted(set(sizes).union(*extra.values())):
        for name in cases:
            if n not in sizes and n not in extra.get(name, ()):
                continue
            case = CASE_BY_NAME[name]
            for con in contenders(case):
                if con.kind in ("ours", "compiled") and con.name not in backends:
                    continue
                if (con.kind == "seed" and not seeds) or (con.kind == "peer" and not peers):
                    continue
                out.append(Planned(name, con.name, n, skip_reason(case, con, n, d, dtype, device, mem_cap,
                                                                  max_iter_seconds)))
    return out


BENCH_NAMES = [c.name for c in BENCH_CASES]
