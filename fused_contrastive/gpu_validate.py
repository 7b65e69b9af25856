"""First run on a GPU: ``python -m fused_contrastive check --gpu-validate``.

Everything the Triton kernels still need a GPU to confirm, in one command, with a pass/fail verdict,
on both paths of the triton backend ("fused": the fused kernels of ``kernels/lse.py``; "panel": cuBLAS
GEMMs on row panels + ``kernels/panel.py``, which ``auto`` picks on CUDA for N M >= 2^24, so N = 4099
alone would test only the panel path):

* **parity**: the triton backend against the float64 oracle (the reference backend in float64 on the
  same dtype-rounded inputs, THE accuracy rule of ``testing.accuracy``) for info_nce, simcse (A is B:
  the symmetric kernel) and clip at ragged shapes (N = M = 4099, D = 100 and 768) in bf16 / fp16 / fp32,
  with every kernel output and scratch buffer (the fp32 accumulator rows of the streaming backward,
  the column-LSE partials) filled with NaN before each launch and the inputs as views into NaN-padded
  buffers: an element a kernel forgets to write, or a read out of bounds, shows up as NaN; the panel
  path also with a forced panel height (``Plan.multi_panel_rows``, default 1000: 5 panels at N = 4099),
  so the fp32 accumulation across panels, the triangular sweep's offsets r0 > 0 and its off-diagonal
  update meet the oracle too (the default budget gives one panel at these sizes);
* **cuBLAS fp32-output GEMMs**: which route ``core/triton_panel.gemm_routes`` chose per 16-bit dtype
  (its probe of ``torch.mm`` / ``torch.addmm`` with ``out_dtype``, or the fallback: information);
* **determinism**: 20 backward runs bitwise identical (bf16, D = 768);
* **fp16 at M = 65536**: fp16 loss and gradients against the fp32 run of the same kernels (the subnormal
  softmax weights p ~ 1/M of the fp16 gradient tile);
* **timings** (CUDA events, medians): triton (its default path, and each path forced) vs torch backend
  vs the naive formula (the textbook
  formula of ``testing.baselines``; "does not fit" on out-of-memory), and from them which backend
  ``auto`` should prefer on this device;
* **the ahead-of-time library** (``--aot-lib`` or ``FUSED_CONTRASTIVE_AOT_LIB``: a built
  ``libfused_contrastive_torch.so``, which has never run on a GPU here): parity, determinism, fp16 and
  timings also on its operators, forced to either path ("aot/fused", "aot/panel"); its buffers are its
  own (not NaN-filled), and a shape it does not cover (D = 100) is reported as not covered;
* **ncu** (when ``ncu`` is on PATH): for each of the main kernels, a child process of this module runs
  one forward + backward under ``ncu`` and reports the metrics that calibrate ``bench/gpu_model.py``
  (L2 hit rate, DRAM bytes read / written, tensor-pipe active). Informational, not a pass/fail check.

Every check runs on its own: an exception in one is a FAIL row carrying the error, and the run goes on
to the end, where the verdict table lists every row; the exit status is 0 (all pass) or 1 (any FAIL).
Without a CUDA device the command exits with status 2 and a message. The machinery takes the device
and the sizes as parameters (:class:`Plan`, :func:`validate`), so the test-suite runs the same code on
the CPU under the Triton interpreter at tiny shapes, including a planted wrong oracle that must fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

LOSSES = ("info_nce", "simcse", "clip")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NCU_METRICS = ("lts__t_sector_hit_rate.pct", "dram__bytes_read.sum", "dram__bytes_write.sum",
               "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
#: The float64 oracle must agree with PyTorch computing in the dtype to this many times the dtype's
#: slack of THE accuracy rule (a sanity bound on the oracle itself; see check_parity).
ORACLE_SANITY = 10.0
NCU_KERNELS = {"lse_fwd_kernel": "fused", "lse_bwd_rows_kernel": "fused", "lse_bwd_cols_kernel": "fused",
               "panel_dl_kernel": "panel"}

#: Outputs of each kernel that it must write completely (filled with NaN before the launch): the
#: scratch ACC and the column partials included. DB only when every column gets a gradient (the
#: launcher zeroes queue rows before the launch).
_OUTPUTS = {"row_norm": ("XS", "NORM", "RNORM", "RS"), "lse_fwd": ("LSE", "LSE_POS", "COL_PART"),
            "lse_bwd_rows": ("DA", "ACC", "DS_PART"), "lse_bwd_cols": ("DB", "ACC"),
            "panel_dl": ("DL", "DS_PART")}
# (panel_dl's LSE_OUT is [N]: each panel writes its own rows only; the triangular forward's COL_PART is
# pre-filled with -inf by the launcher, its programs write only the columns their rows reach)
#: The two paths of the triton backend (``core/triton_panel.py``; env FUSED_CONTRASTIVE_TRITON_PATH) and
#: the kernels each must launch.
PATHS = {"fused": {"lse_fwd", "lse_bwd_rows"}, "panel": {"panel_dl"}}


@dataclass
class Plan:
    """What to check, and at which sizes (defaults: the first-GPU run)."""

    losses: tuple[str, ...] = LOSSES
    paths: tuple[str, ...] = ("fused", "panel")
    parity_shapes: tuple[tuple[int, int], ...] = ((4099, 100), (4099, 768))
    dtypes: tuple[torch.dtype, ...] = DTYPES
    determinism_shape: tuple[int, int] = (4099, 768)
    determinism_runs: int = 20  # < 2: skip
    fp16_shape: tuple[int, int, int] | None = (4096, 65536, 768)  # N anchors, M keys, D (None: skip)
    timing_sizes: tuple[int, ...] = (16384, 65536)  # (): skip
    timing_d: int = 768
    timing_dtype: torch.dtype = torch.bfloat16
    timing_repeats: int = 5
    ncu: bool = True
    ncu_shape: tuple[int, int] = (16384, 768)
    #: the panel path's parity once more with this many rows per panel (None: skip), so several panels
    #: meet the oracle (``core/triton_panel.PANEL_ROWS``)
    multi_panel_rows: int | None = 1000
    #: a built libfused_contrastive_torch.so: the checks also run on its operators (paths "aot/fused",
    #: "aot/panel"); a problem the library does not cover is reported as such (information)
    aot_lib: str | None = None


@dataclass
class Result:
    check: str
    ok: bool | None  # None: informational
    detail: str


@dataclass
class Report:
    device: str
    results: list[Result] = field(default_factory=list)
    timings: dict[tuple[str, int], dict[str, float | None]] = field(default_factory=dict)
    prefer: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok is not False for r in self.results)

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        self.results.append(Result(check, ok, detail))
        mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
        print(f"  {mark:4s}  {check:44s} {detail}", flush=True)


Oracle = Callable[..., tuple[Tensor, dict[str, Tensor | None]]]


def float64_oracle(case, inputs, device) -> tuple[Tensor, dict[str, Tensor | None]]:
    """The ground truth: the reference backend in float64 on ``device`` (inputs already rounded)."""
    from .testing import run

    return run(case, inputs, "reference", torch.float64, device)


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` within the block (None: unset)."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


#: The ahead-of-time library the "aot/..." paths run (``Plan.aot_lib``; set by :func:`validate`).
_AOT_LIB: str | None = None


@contextlib.contextmanager
def triton_path(path: str) -> Iterator[None]:
    """Force the triton backend's path: "fused" (the fused kernels) or "panel" (cuBLAS GEMMs + the panel
    kernels) on the JIT kernels, with the AOT route off; "aot/fused" / "aot/panel": the ahead-of-time
    library (``FUSED_CONTRASTIVE_AOT_LIB`` = ``Plan.aot_lib``), whose operators take that path."""
    from .core import triton_aot

    aot = path.startswith("aot/")
    if aot and not _AOT_LIB:
        raise ValueError(f"path {path!r} needs the library: Plan.aot_lib / --aot-lib")
    with _env("FUSED_CONTRASTIVE_TRITON_PATH", path.removeprefix("aot/")), \
            _env(triton_aot.ENV, _AOT_LIB if aot else None):
        yield


def kernels_only():
    """Turn off the one-tile PyTorch path small problems take (``FUSED_CONTRASTIVE_DENSE=0``), so that
    ``backend="triton"`` runs the kernels at every size."""
    return _env("FUSED_CONTRASTIVE_DENSE", "0")


@contextlib.contextmanager
def poisoned_launches(seen: list[str] | None = None) -> Iterator[None]:
    """Every Triton launch first fills the outputs and scratch buffers it must write with NaN (and
    appends its kernel name to ``seen``)."""
    from .core import triton_backend as TB

    orig = TB._launch

    def launch(lz):
        if TB._RECORDER is None:
            if seen is not None:
                seen.append(lz.name)
            for name in _OUTPUTS.get(lz.name, ()):
                t = lz.args.get(name)
                if name == "DB" and lz.args.get("grad_cols") != lz.args.get("M"):
                    continue
                if name == "COL_PART" and lz.constexprs.get("TRI"):
                    continue
                if isinstance(t, Tensor) and t.numel() > 1 and t.is_floating_point():
                    t.fill_(float("nan"))
        orig(lz)

    prev_flag = TB.POISON_OUTPUTS
    TB._launch, TB.POISON_OUTPUTS = launch, True
    try:
        yield
    finally:
        TB._launch, TB.POISON_OUTPUTS = orig, prev_flag


def _finite_max(x: Tensor) -> float:
    fin = x.detach().double()[torch.isfinite(x.detach())]
    return float(fin.abs().max()) if fin.numel() else 0.0


def _dname(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _err(e: BaseException) -> str:
    """An exception as a FAIL row's detail: its type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


@contextlib.contextmanager
def _panel_height(rows: int | None) -> Iterator[None]:
    """``core/triton_panel.PANEL_ROWS = rows`` within the block (None: leave it)."""
    from .core import triton_panel

    old = triton_panel.PANEL_ROWS
    if rows is not None:
        triton_panel.PANEL_ROWS = rows
    try:
        yield
    finally:
        triton_panel.PANEL_ROWS = old


def _parity_paths(plan: Plan) -> list[tuple[str, str, int | None]]:
    """``(label, path, forced panel height)`` of the parity runs: every path of the plan, and the panel
    path once more with :attr:`Plan.multi_panel_rows` rows per panel."""
    out = [(p, p, None) for p in plan.paths]
    if "panel" in plan.paths and plan.multi_panel_rows:
        out.append((f"panel(P={plan.multi_panel_rows})", "panel", plan.multi_panel_rows))
    return out


def check_parity(report: Report, plan: Plan, device: str, oracle: Oracle) -> None:
    from .core import reference
    from .testing import CASE_BY_NAME, make_inputs, run

    for loss in plan.losses:
        case = CASE_BY_NAME[loss]
        for n, d in plan.parity_shapes:
            tensors, kwargs = make_inputs(case, n, d, seed=0)
            for dt in plan.dtypes:
                try:
                    rounded = {k: (v.to(dt).double() if v.dim() > 0 else v.double()) for k, v in tensors.items()}
                    truth_loss, truth_grads = oracle(case, (rounded, kwargs), device)
                    with reference.computing_in(dt):
                        same_loss, same_grads = run(case, (tensors, kwargs), "reference", dt, device)
                except Exception as e:  # noqa: BLE001 - a FAIL row per path, and on to the next case
                    for label, _, _ in _parity_paths(plan):
                        report.add(f"parity {loss} {label} N={n} D={d} {_dname(dt)}", False,
                                   f"the oracle or the {_dname(dt)} reference raised {_err(e)}")
                    continue
                for label, path, rows in _parity_paths(plan):
                    check = f"parity {loss} {label} N={n} D={d} {_dname(dt)}"
                    try:
                        _parity_one(report, check, case, tensors, kwargs, truth_loss, truth_grads, same_loss,
                                    same_grads, path, rows, n, dt, device)
                    except Exception as e:  # noqa: BLE001
                        report.add(check, False, f"raised {_err(e)}")


def _parity_one(report: Report, check: str, case, tensors, kwargs, truth_loss, truth_grads, same_loss, same_grads,
                path: str, rows: int | None, n: int, dt, device: str) -> None:
    """One parity row: the triton backend on ``path`` (``rows``: forced panel height) against the oracle."""
    from .core import triton_aot
    from .testing import run
    from .testing.accuracy import SLACK, check_output, same_dtype_error

    worst_ratio, worst = 0.0, "no outputs"
    problems: list[str] = []
    seen: list[str] = []
    calls = triton_aot.CALLS
    with poisoned_launches(seen), triton_path(path), _panel_height(rows):
        # the library takes 16-element row strides: NaN padding to the next such stride
        got_loss, got_grads = run(case, (tensors, kwargs), "triton", dt, device, canary=True,
                                  canary_align=16 if path.startswith("aot/") else 1)
    if path.startswith("aot/"):
        # the library's buffers are its own (not NaN-filled); a call it does not cover
        # ran on the JIT kernels: information, not a check of the library
        if triton_aot.CALLS == calls:
            report.add(check, None, "not covered by the library (the JIT kernels ran)")
            return
        jit = set(seen) & set().union(*PATHS.values())
        if jit:
            problems.append(f"JIT kernels ran beside the library: {sorted(jit)}")
    elif not PATHS[path] <= set(seen):
        problems.append(f"the kernels did not run (launches: {sorted(set(seen))})")
    elif rows is not None and seen.count("panel_dl") < math.ceil(n / rows):
        problems.append(f"{seen.count('panel_dl')} panel launches, expected at least "
                        f"{math.ceil(n / rows)} panels of {rows} rows")
    outs = [("loss", got_loss, truth_loss, same_loss, 1.0)]
    for k, tg in truth_grads.items():
        gg = got_grads.get(k)
        if (tg is None) != (gg is None):
            problems.append(f"gradient of {k} {'missing' if gg is None else 'unexpected'}")
            continue
        if tg is not None:
            amp = 1.0 / min(abs(float(tensors[k])), 1.0) ** 2 if tensors[k].dim() == 0 else 1.0
            outs.append((f"grad {k}", gg, tg, same_grads.get(k), amp))
    for name, got, truth, same, amp in outs:
        # THE rule's tolerance grows with PyTorch's own same-dtype error against the
        # oracle, so a wrong oracle would widen its own tolerance: the oracle must agree
        # with the same-dtype reference to ORACLE_SANITY x the dtype's slack
        e_same = same_dtype_error(same, truth) if same is not None else 0.0
        bound = ORACLE_SANITY * SLACK[dt] * max(1.0, _finite_max(truth), amp)
        if not e_same <= bound:
            problems.append(f"oracle suspect: {_dname(dt)} reference differs from it by "
                            f"{e_same:.3g} on {name} (> {bound:.3g})")
        w, e, tol = check_output(name, got, truth, same, dt, amp)
        ratio = e / tol if tol > 0 else math.inf
        ratio = math.inf if math.isnan(ratio) else ratio
        if ratio >= worst_ratio:
            worst_ratio, worst = ratio, str(w)
    ok = not problems and worst_ratio <= 1.0
    report.add(check, ok, "; ".join(problems) or f"err/tol {worst_ratio:.3f} ({worst})")


def check_gemm_routes(report: Report, plan: Plan, device: str) -> None:
    """Information: the route of the panel path's fp32-output GEMMs per 16-bit dtype of the plan
    (``core/triton_panel.gemm_routes``: "native" = ``out_dtype`` cuBLAS call proven by its probe on this
    device; otherwise the fallback, correct but with more memory traffic)."""
    from .core import triton_panel

    for dt in (x for x in plan.dtypes if x != torch.float32):
        mm, addmm = triton_panel.gemm_routes(torch.device(device), dt)
        report.add(f"cuBLAS fp32-output GEMMs {_dname(dt)}", None, f"mm {mm}, addmm {addmm}")


def _loss_and_grads(loss: str, tensors, kwargs, backend: str, dtype, device, upstream_seed: int = 1):
    from .testing import CASE_BY_NAME, run

    return run(CASE_BY_NAME[loss], (tensors, kwargs), backend, dtype, device, upstream_seed=upstream_seed)


def check_determinism(report: Report, plan: Plan, device: str) -> None:
    from .testing import CASE_BY_NAME, make_inputs

    n, d = plan.determinism_shape
    dt = plan.dtypes[0]
    for loss, (label, path, rows) in ((lo, pa) for lo in plan.losses for pa in _parity_paths(plan)):
        check = f"determinism {loss} {label} N={n} D={d} {_dname(dt)}"
        try:
            tensors, kwargs = make_inputs(CASE_BY_NAME[loss], n, d, seed=3)
            first = None
            same = True
            for _ in range(plan.determinism_runs):
                with triton_path(path), _panel_height(rows):
                    lo, grads = _loss_and_grads(loss, tensors, kwargs, "triton", dt, device)
                cur = [lo] + [g for g in grads.values() if g is not None]
                if first is None:
                    first = cur
                elif not all(torch.equal(a, b) for a, b in zip(first, cur, strict=True)):
                    same = False
        except Exception as e:  # noqa: BLE001 - a FAIL row, and on to the next check
            report.add(check, False, f"raised {_err(e)}")
            continue
        report.add(check, same, f"{plan.determinism_runs} forward + backward runs "
                   + ("bitwise identical" if same else "DIFFER bitwise"))


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


def check_fp16_large_m(report: Report, plan: Plan, device: str) -> None:
    """info_nce with N anchors against M keys: fp16 against fp32 on the same kernels. Tolerances: the
    loss to 1e-3 relative, each gradient to 4e-3 relative (Frobenius): a few fp16 roundings (eps 4.9e-4)
    of a sum of M terms accumulated in fp32; the un-scaled subnormal tile measured 4.0e-3 in the review."""
    n, m, d = plan.fp16_shape
    g = torch.Generator().manual_seed(5)
    q = torch.randn(n, d, generator=g)
    k = torch.randn(m, d, generator=g)
    for path in plan.paths:
        try:
            with triton_path(path):
                _fp16_one(report, path, q, k, n, m, d, device)
        except Exception as e:  # noqa: BLE001 - a FAIL row, and on to the next check
            report.add(f"fp16 vs fp32 info_nce {path} N={n} M={m} D={d}", False, f"raised {_err(e)}")


def _fp16_one(report: Report, path: str, q: Tensor, k: Tensor, n: int, m: int, d: int, device: str) -> None:
    from .losses import info_nce

    out = {}
    for dt in (torch.float32, torch.float16):
        qq = q.to(device=device, dtype=dt).clone().requires_grad_(True)
        kk = k.to(device=device, dtype=dt).clone().requires_grad_(True)
        loss = info_nce(qq, kk, target=torch.arange(n, device=device), temperature=0.05, backend="triton")
        loss.backward()
        out[dt] = (loss.detach().float(), qq.grad.float(), kk.grad.float())
    el = _rel(out[torch.float16][0], out[torch.float32][0])
    eq = _rel(out[torch.float16][1], out[torch.float32][1])
    ek = _rel(out[torch.float16][2], out[torch.float32][2])
    finite = all(bool(torch.isfinite(t).all()) for t in out[torch.float16])
    ok = finite and el <= 1e-3 and eq <= 4e-3 and ek <= 4e-3
    report.add(f"fp16 vs fp32 info_nce {path} N={n} M={m} D={d}", ok,
               f"rel err loss {el:.2e} (<= 1e-3), grad q {eq:.2e}, grad k {ek:.2e} (<= 4e-3)"
               + ("" if finite else "; NON-FINITE fp16 output"))


def _timer(device: str):
    if device.startswith("cuda"):
        def measure(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        return measure

    def measure_cpu(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return measure_cpu


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def check_timings(report: Report, plan: Plan, device: str) -> None:
    from .testing import CASE_BY_NAME, make_inputs
    from .testing.baselines import formula_of

    measure = _timer(device)
    dt = plan.timing_dtype
    for loss in plan.losses:
        case = CASE_BY_NAME[loss]
        formula = formula_of(loss)
        for n in plan.timing_sizes:
            tensors, kwargs = make_inputs(case, n, plan.timing_d, seed=7)
            leaves = {k: (v.to(device=device, dtype=dt) if v.dim() else v.to(device)).clone()
                      .requires_grad_(v.dim() > 0) for k, v in tensors.items()}
            row: dict[str, float | None] = {}
            for name in ("triton", *(f"triton/{p}" for p in plan.paths), "torch", "naive"):
                def step(name=name, leaves=leaves, kwargs=kwargs, case=case, formula=formula):
                    for v in leaves.values():
                        v.grad = None
                    if name == "naive":
                        out = formula.fn({**leaves, **kwargs})
                    elif name.startswith("triton/"):
                        with triton_path(name.split("/", 1)[1]):
                            out = case.fn(**leaves, **kwargs, backend="triton")
                            out.backward()
                        return
                    else:
                        out = case.fn(**leaves, **kwargs, backend=name)
                    out.backward()
                try:
                    step()  # warm-up (compiles, cuBLAS heuristics)
                    row[name] = statistics.median(measure(step) for _ in range(plan.timing_repeats))
                except Exception as e:  # noqa: BLE001 - out of memory: "does not fit"; else a FAIL row
                    row[name] = None
                    if not _is_oom(e):
                        report.add(f"timing {loss} {name} N={n} D={plan.timing_d} {_dname(dt)}", False,
                                   f"raised {_err(e)}")
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
            report.timings[(loss, n)] = row
            cells = ", ".join(f"{k} {'does not fit' if v is None else f'{v:.2f} ms'}" for k, v in row.items())
            report.add(f"timing {loss} N={n} D={plan.timing_d} {_dname(dt)}", None,
                       f"median of {plan.timing_repeats}: {cells}")
        largest = max(plan.timing_sizes)
        row = report.timings[(loss, largest)]
        cands = {k: v for k, v in row.items() if (k.startswith("triton/") or k == "torch") and v is not None}
        if cands:
            report.prefer[loss] = min(cands, key=cands.get)


def ncu_child(loss: str, n: int, d: int) -> None:
    """One forward + backward of ``loss`` on the triton backend (bf16): the process ncu profiles."""
    from .testing import CASE_BY_NAME, make_inputs

    tensors, kwargs = make_inputs(CASE_BY_NAME[loss], n, d, seed=9)
    leaves = {k: (v.to("cuda", torch.bfloat16) if v.dim() else v.cuda()).requires_grad_(v.dim() > 0)
              for k, v in tensors.items()}
    CASE_BY_NAME[loss].fn(**leaves, **kwargs, backend="triton").backward()
    torch.cuda.synchronize()


def check_ncu(report: Report, plan: Plan, device: str) -> None:
    ncu = shutil.which("ncu")
    if not ncu or not device.startswith("cuda"):
        report.add("ncu metrics", None, "ncu not on PATH: skipped (install Nsight Compute to calibrate the model)")
        return
    n, d = plan.ncu_shape
    for kernel, path in NCU_KERNELS.items():
        env = dict(os.environ, FUSED_CONTRASTIVE_TRITON_PATH=path)
        cmd = [ncu, "--csv", "--kernel-name", kernel, "--launch-count", "1", "--metrics", ",".join(NCU_METRICS),
               sys.executable, "-m", "fused_contrastive.gpu_validate", "--ncu-child", "info_nce", str(n), str(d)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800, env=env)
        vals = {}
        for line in r.stdout.splitlines():
            cells = [c.strip('"') for c in line.split('","')]
            for metric in NCU_METRICS:
                if metric in cells:
                    vals[metric] = cells[-1].strip('"')
        detail = ", ".join(f"{k} = {v}" for k, v in vals.items()) or f"no metrics (exit {r.returncode}): " \
            f"{(r.stderr or r.stdout)[-300:]!r}"
        report.add(f"ncu {kernel} ({path}) info_nce N={n} D={d}", None, detail)


def validate(device: str = "cuda", plan: Plan | None = None, oracle: Oracle = float64_oracle,
             allow_cpu: bool = False) -> Report:
    """Run every check of ``plan`` on ``device`` and print them; returns the :class:`Report`.
    ``allow_cpu`` lets the test-suite run the same code on the CPU under the Triton interpreter."""
    global _AOT_LIB
    plan = plan or Plan()
    if plan.aot_lib and not any(p.startswith("aot/") for p in plan.paths):
        plan = dataclasses.replace(plan, paths=(*plan.paths, "aot/fused", "aot/panel"))
    _AOT_LIB = plan.aot_lib
    dev = torch.device(device)
    if dev.type != "cuda" and not allow_cpu:
        raise RuntimeError("--gpu-validate needs a CUDA device")
    report = Report(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"fused-contrastive GPU validation on {device} ({name}), torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}", flush=True)
    steps = [("parity", lambda: check_parity(report, plan, device, oracle), True),
             ("cuBLAS GEMM routes", lambda: check_gemm_routes(report, plan, device), True),
             ("determinism", lambda: check_determinism(report, plan, device), plan.determinism_runs > 1),
             ("fp16 vs fp32", lambda: check_fp16_large_m(report, plan, device), plan.fp16_shape is not None),
             ("timings", lambda: check_timings(report, plan, device), bool(plan.timing_sizes)),
             ("ncu", lambda: check_ncu(report, plan, device), plan.ncu)]
    for what, step, wanted in steps:
        if not wanted:
            continue
        try:
            with kernels_only() if what != "ncu" else contextlib.nullcontext():
                step()
        except Exception as e:  # noqa: BLE001 - whatever escapes a check is a FAIL row; the table follows
            report.add(f"{what} (the check itself)", False, f"raised {_err(e)}")
    fails = [r.check for r in report.results if r.ok is False]
    print("\nverdict table:")
    for r in report.results:
        print(f"  {({True: 'PASS', False: 'FAIL', None: 'info'})[r.ok]:4s}  {r.check:44s} {r.detail}")
    print(f"\nverdict: {'PASS' if report.ok else 'FAIL'} ({sum(r.ok is True for r in report.results)} passed, "
          f"{len(fails)} failed{': ' + ', '.join(fails) if fails else ''})")
    for loss, be in report.prefer.items():
        print(f"auto should prefer on this device for {loss} (measured at N = {max(plan.timing_sizes)}): {be}")
    return report


def main(device: str, aot_lib: str | None = None) -> int:
    """``check --gpu-validate``: exit status 0 when every check passes, 1 otherwise, 2 without CUDA.
    ``aot_lib`` (default: ``FUSED_CONTRASTIVE_AOT_LIB``): also check the ahead-of-time library."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        print(f"--gpu-validate needs a CUDA device (got --device {device}; torch.cuda.is_available() = "
              f"{torch.cuda.is_available()}). Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("--gpu-validate: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)",
              file=sys.stderr)
        return 2
    from .core import triton_aot

    aot_lib = aot_lib or os.environ.get(triton_aot.ENV) or None
    return 0 if validate(device, Plan(aot_lib=aot_lib)).ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--ncu-child":
        ncu_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
