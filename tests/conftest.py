"""Test-suite setup.

The Triton interpreter must be chosen before triton is first imported, so it is set here, before any
test module imports the package (CPU-only machines and CI have no GPU).

``path`` runs a test on both implementations of the torch backend: "dense" (the one-tile path every
test-sized problem takes by default) and "chunked" (``FUSED_CONTRASTIVE_DENSE=0`` with a small tile
budget, so the problem is split into many row chunks and symmetric blocks).
"""

import contextlib
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker is a process with PyTorch's own intra-op thread pool, one thread per core by
# default: with as many workers as cores (the README's -n auto) the pools oversubscribe the machine and the
# tests' many small ops wait on each other's threads (test_autocast, test_siglip and one more loss's file on 2
# workers on 2 cores: 68 s with the default, 41 s with one thread each). Each worker, and what it starts,
# takes cores // workers threads unless OMP_NUM_THREADS is set already; it is read when torch is imported.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _regime_margins():
    """``testing.cases.REGIME_MARGIN`` as it was before the test: tests that set the saturated regime's margin
    (13 in the accuracy probes) leave the next test in the worker its default."""
    from fused_contrastive.testing import cases

    saved = dict(cases.REGIME_MARGIN)
    yield
    cases.REGIME_MARGIN.clear()
    cases.REGIME_MARGIN.update(saved)


@pytest.fixture
def route():
    """The switchboard for the test's duration: ``route(TRITON_PATH="panel", PANEL_GEMM="epilogue")`` is
    ``fused_contrastive.routes.override`` entered until the test ends (None: the setting's default). What tests
    steer routes with in their own process; a child process still takes the environment."""
    from fused_contrastive import routes

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(routes.override(**values))


@pytest.fixture
def launches(monkeypatch):
    """Every Triton launch made through the launcher during the test (``core.triton_shared.launch._launch``),
    recorded as it is made, then run."""
    from fused_contrastive.core.triton_shared import launch as TL

    seen = []
    orig = TL._launch

    def record(x):
        seen.append(x)
        return orig(x)

    monkeypatch.setattr(TL, "_launch", record)
    return seen


@pytest.fixture
def gpu_rounding(monkeypatch):
    """The Triton interpreter's fp32 -> bf16 casts rounded to nearest, ties to even, for the test's duration: as
    Triton defines ``x.to(tl.bfloat16)`` (``fp_downcast_rounding`` defaults to "rtne") and the GPU runs it
    (``cvt.rn.bf16.f32``). The interpreter of the installed Triton (3.9, ``InterpreterBuilder.cast_impl``)
    drops the low 16 bits instead (toward zero: up to 1 unit in the last place, every error of the same sign
    as its value), so a kernel's bf16 output or 16-bit gradient tile measured there carries up to twice the
    GPU's rounding error, biased; a path whose last rounding is PyTorch's (an fp32 kernel output cast by
    ``Tensor.to``) does not. The cast here is PyTorch's (round to nearest even, NaN and infinities kept);
    other casts are the interpreter's own (fp32 -> fp16 already rounds to nearest through numpy).
    tests/test_interpreter_rounding.py checks it bit for bit."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return orig(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def set_path(monkeypatch, path: str, tile: int = 300) -> None:
    if path == "dense":
        monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "1")
        monkeypatch.delenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", raising=False)
    else:
        monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
        monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", str(tile))


#: the backends an option's tests run on: the float64 reference, the torch backend's two paths, triton (interpreter)
EVERY_BACKEND = ["reference", "torch-dense", "torch-chunked", "triton"]


def use_backend(which: str, monkeypatch, tile: int = 20) -> str:
    """``backend=`` for an :data:`EVERY_BACKEND` entry; ``torch-dense`` / ``torch-chunked`` also set that path
    (the chunked one with a ``tile``-element budget: many row chunks at test sizes)."""
    if which.startswith("torch"):
        set_path(monkeypatch, which.split("-")[1], tile=tile)
        return "torch"
    return which


def leaf(x, dtype=None):
    """A fresh leaf: ``x`` detached, cast to ``dtype`` (None: float64), requiring grad."""
    import torch

    return x.detach().to(torch.float64 if dtype is None else dtype).clone().requires_grad_()


@pytest.fixture(params=["dense", "chunked"])
def path(request, monkeypatch):
    set_path(monkeypatch, request.param)
    return request.param


# The ten slowest test files at the end of every run (setup + call + teardown of their tests, summed; under
# pytest-xdist the workers' reports reach the controller, so the sums are the files' own time, not the wall
# time they overlapped with): what a CI budget is spent on, in every CI log.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    f = report.nodeid.split("::")[0]
    _FILE_SECONDS[f] = _FILE_SECONDS.get(f, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"ten slowest test files (of {len(_FILE_SECONDS)}, {total:.0f} s summed)")
    for f, s in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"{s:9.1f} s  {f}")
