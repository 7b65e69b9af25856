"""Run on a GPU: ``python -m fused_contrastive check --gpu-validate``.

Everything the Triton kernels need a GPU to confirm, in one command, with a pass/fail verdict:

* **parity** of every kernel family (``LOSSES``: the core op on both paths of the triton backend, "fused" =
  ``kernels/lse.py`` and "panel" = cuBLAS GEMMs on row panels + ``kernels/panel.py``, which ``auto`` picks on
  CUDA for N M >= 2^24; SupCon's positives; CoSENT, SigLIP and GIST's guided kernels, each run once on its own
  kernels, path "own"; the Matryoshka kernels on "fused" and the per-level route on "panel") against the
  float64 oracle (the reference backend in float64 on the same dtype-rounded inputs) under THE accuracy rule
  of ``testing.accuracy`` (relative to each output's size), at N = 4099 (ragged against every block), D = 768
  (bf16 / fp16 / fp32) and D = 100 (the ragged D chunk: flat bf16, ``Plan.secondary_regimes`` /
  ``secondary_dtypes``), in the input regimes ``flat``, ``sharp`` (``testing.cases.REGIMES``: temperature 0.01
  / logit scale 100 with correlated positives) and ``saturated`` (p_t ~ 0.9999, a loss of ~1e-4 per row:
  16-bit gradient pieces that cancel), with every kernel output and scratch buffer filled with NaN before each
  launch and the inputs as views into NaN-padded buffers (an unwritten element or an out-of-bounds read shows
  up as NaN), a row failing also when its family's kernels did not launch; the panel path once more with a
  forced panel height (``Plan.multi_panel_rows``, default 1000: 5 panels at N = 4099); in fp32, where the rule
  grants PyTorch's error against the oracle whole, the oracle must agree with the fp32 reference to
  ``ORACLE_SANITY`` x the slack;
* **the Gluon statistics kernel** (``kernels/gluon_epi.py``, the option ``FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws``:
  sm_90 with a tested Triton, ``core/triton_shared/gluon_epi.py``): the epilogue GEMM's statistics forward
  (``stats_forward``: row LSEs, with the column LSEs, and the triangular frame) through it, against the float64
  log-sum-exps of the same bf16 inputs, with its outputs NaN-filled, each row in a child process with a time
  limit (no GPU has run the kernel: a hang is a FAIL row, not the end of the run), after the fp16 rows and before
  the timings; where the gate refuses it (another arch or Triton version) the row says why and counts as not run:
  it proves nothing there;
* **cuBLAS fp32-output GEMMs**: which route ``core/triton_shared/panels.gemm_routes`` chose per 16-bit dtype
  (its probe of ``torch.mm`` / ``torch.addmm`` with ``out_dtype``, or the fallback: information);
* **determinism**: 10 forward + backward runs bitwise identical per family and path (bf16, D = 768);
* **fp16 at M = 65536**: fp16 loss and gradients against the fp32 run of the same kernels;
* **timings** (CUDA events, medians, fwd + bwd, bf16, N = 16384 and 65536): the triton route of every
  family (and each path forced for the core op) against the textbook formula it replaces ("does not
  fit" on out-of-memory), each beside the GPU model's prediction (``bench/gpu_model.py``'s committed
  JSON lines, extracted into the package, or ``FUSED_CONTRASTIVE_GPU_MODEL``), and which path ``auto`` should
  prefer there;
* **the ahead-of-time library** (``--aot-lib`` or ``FUSED_CONTRASTIVE_AOT_LIB``: a built
  ``libfused_contrastive_torch.so``, which has not run on a GPU yet): parity, determinism, fp16 and
  timings also on its operators, forced to either path ("aot/fused", "aot/panel"); its buffers are its
  own (not NaN-filled), and a shape it does not cover (D = 100) is reported as not covered;
* **ncu** (``Plan.ncu``, off by default; when ``ncu`` is on PATH): the metrics that would calibrate the
  model for the main kernels. Informational.

Bounded (``--budget``, default 420 s; the H100 runs took 264 and 310 s at 300). Every correctness row
comes before any timing row: parity (the cheap shapes first, smallest N x D; the option rows of
``OPTION_LOSSES`` and the sentence-transformers row with them), determinism and fp16, in ``--jobs`` worker
processes when J > 1 (a first run compiles every kernel variant, CPU-bound with the GPU idle; nothing is
timed meanwhile) within the budget less the timings' ESTIMATE (at most 40 % of it); then the timings alone,
each row's repeats bounded by its share of the time left (``Plan.timing_repeats`` at most, 1 at least). The
run first prints the plan: its rows per kind and an ESTIMATE of its wall time (``EST_S`` per row: not a
measurement; a line says when it exceeds the budget) and ends with each kind's measured wall time, which
calibrates EST_S. A row that would start past the budget is listed as not run, and the verdict names every
such row ("not proven"): a row never run proves nothing. Every check runs on its own: an
exception in one is a FAIL row carrying the error, and the run always ends with the verdict table of
every row; the exit status is 0 (all pass) or 1 (any FAIL). Without a CUDA device the command exits
with status 2 and a message. The machinery takes the device and the sizes as parameters
(:class:`Plan`, :func:`validate`), so the test-suite runs the same code on the CPU under the Triton
interpreter at tiny shapes, including a planted wrong oracle and unwritten outputs that must fail.
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

from . import routes

#: Every Triton kernel family, by a registry case that runs it ("matryoshka": info_nce with
#: ``matryoshka_dims``, see :func:`parity_case`).
LOSSES = ("info_nce", "simcse", "clip", "supcon_in", "cosent", "siglip", "gist", "matryoshka")
#: Parity rows of options whose kernel code only the CPU interpreter had run (registry cases, each against the
#: reference backend's float64 definition like every parity row): label smoothing on GIST (the guided kernels'
#: SMOOTH flag; a mean bf16 loss, which bypasses the guided panel route), Qwen3-Embedding in 16 bits, tau_plus
#: (debiased) and row_negatives on info_nce, SigLIP's image / text groups. Not timed (no textbook formula).
OPTION_LOSSES = ("gist_smoothed", "qwen3", "info_nce_debiased", "info_nce_rowneg", "siglip_groups")
#: Option rows whose kernels must launch with a compile-time flag set: ``{case: (kernel, flag)}`` (the guided
#: forward's SMOOTH: label smoothing's kept-column count and sum)
OPTION_FLAGS = {"gist_smoothed": ("guided_fwd", "SMOOTH")}
#: The Gluon statistics kernel's rows (:func:`check_gluon_stats`): (label, N, M or None for B = A (the triangular
#: frame, the self column excluded), D, scale, the column statistics, forced panel height). 16-byte aligned rows
#: (D a multiple of 8: TMA); D = 72 is ragged against the kernel's 64 columns per step (TMA's zero fill).
GLUON_CASES = (("rows", 4099, 5000, 768, 20.0, False, 1000), ("cols", 4099, 5000, 768, 100.0, True, None),
               ("tri", 4099, None, 768, 20.0, False, 1000), ("rows", 4099, 3001, 72, 20.0, False, None))
#: Per-row cost ESTIMATES for the printed plan estimate and the timings' reserve, not measured per row: the
#: committed H100 run bench/results/h100-epilogue/gpu_validate.txt (--budget 326 --jobs 8) ran 191 correctness
#: rows (parity, determinism, fp16; first compiles included) in its workers' 196 s, 8.2 worker-seconds a row, and
#: its 16 timing rows (5 repeats) in the remaining 130 s, 8.1 s a row (6 steps per contender). ``validate``
#: prints each kind's measured wall time at the end, for the next run to correct these.
EST_S = {"row": 8.2, "timing_row": 8.1}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: In fp32 the float64 oracle must agree with PyTorch computing in fp32 to this many times the slack of
#: THE accuracy rule (a sanity bound on the oracle itself; see _parity_one).
ORACLE_SANITY = 10.0
NCU_METRICS = ("lts__t_sector_hit_rate.pct", "dram__bytes_read.sum", "dram__bytes_write.sum",
               "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
NCU_KERNELS = {"lse_fwd_kernel": "fused", "lse_bwd_rows_kernel": "fused", "lse_bwd_cols_kernel": "fused",
               "panel_dl_kernel": "panel", "epi_gemm_kernel": "panel"}

#: Outputs of each kernel that it must write completely (filled with NaN before the launch): the
#: scratch ACC and the column partials included. DB only when every column gets a gradient (the
#: launcher zeroes queue rows before the launch).
_OUTPUTS = {"row_norm": ("XS", "NORM", "RNORM", "RS"), "lse_fwd": ("LSE", "LSE_POS", "COL_PART"),
            "lse_bwd_rows": ("DA", "ACC", "DS_PART"), "lse_bwd_cols": ("DB", "ACC"),
            "panel_dl": ("DL", "DS_PART"), "epi_gemm": ("DL",), "epi_gemm_stats": ("ZP", "MXP", "CZ", "CM"),
            "epi_stats_gluon": ("ZP", "MXP", "CZ", "CM")}
# (panel_dl's LSE_OUT is [N]: each panel writes its own rows only; the triangular forward's COL_PART is
# pre-filled with -inf by the launcher, its programs write only the columns their rows reach)
#: The two paths of the triton backend (``core/lse/triton_panel.py``; env FUSED_CONTRASTIVE_TRITON_PATH) and
#: the kernels each must launch, per kernel family; families with kernels of their own run once, on
#: the path "own" (the path variable does not choose their kernels).
PATHS = {"fused": {"lse_fwd", "lse_bwd_rows"}, "panel": {"panel_rows"}, "panel-cublas": {"panel_dl", "panel_rows"}}
#: The kernel that forms a panel's gradient tile on the panel path: the epilogue GEMM (16-bit operands,
#: the default on CUDA) or the cuBLAS products' panel kernel ("panel-cublas" forces it; fp32 takes it)
PANEL_TILE_KERNELS = ("epi_gemm", "panel_dl")
#: Registry cases whose bf16 panels the epilogue GEMM must form (the one-pass sweep or known statistics;
#: a softmax over positives, supcon_in's, keeps the two-pass panel kernel in its eager sweep)
EPILOGUE_CASES = ("info_nce", "simcse", "clip")
EXPECT = {("core", "fused"): PATHS["fused"], ("core", "panel"): PATHS["panel"],
          ("core", "panel-cublas"): PATHS["panel-cublas"],
          # the Matryoshka kernels where the plain op takes the fused kernels (their own backward, or the
          # suffix backward: 16-bit on CUDA from N x M = 2^20, core/matryoshka/triton_levels.use_suffix); one plain
          # call per level (its one-pass panel kernel) where it takes the panel path (core._leveled)
          ("matryoshka", "fused"): ({"mat_fwd", "mat_bwd_rows"}, {"mat_fwd", "mat_epi"}),
          ("matryoshka", "panel"): {"panel_rows"},
          ("matryoshka", "panel-cublas"): {"panel_dl"},
          ("cosent", "own"): {"pair_cos_fwd", "cosent_scan_fwd", "cosent_scan_bwd"},
          # SigLIP: its fused kernels, or (16-bit, CUDA, N x M >= 2^24) the panel path's epilogue GEMM
          ("siglip", "own"): ({"siglip_fwd", "siglip_bwd_rows"}, {"epi_gemm_siglip", "panel_rows"}),
          # the guided blocks: their fused kernels, or (a summed bf16 loss on CUDA, N x sum M >= 2^24) the
          # epilogue GEMM of core/guided/triton_panel.py
          ("guided", "own"): ({"guided_fwd", "guided_bwd_rows"}, {"guided_epi", "panel_rows"})}


def _alternatives(want) -> tuple[set, ...]:
    """An EXPECT entry as its alternative kernel sets (a set, or a tuple of sets any one of which must run)."""
    return want if isinstance(want, tuple) else (want,)


@dataclass
class Plan:
    """What to check, and at which sizes (defaults: the first-GPU run)."""

    losses: tuple[str, ...] = LOSSES
    #: parity rows of the options only the interpreter had run (:data:`OPTION_LOSSES`; no determinism or timing)
    option_losses: tuple[str, ...] = OPTION_LOSSES
    #: the cached sentence-transformers drop-ins' loss (``mnrl_from_embeddings``) against the float64 InfoNCE
    #: definition, when sentence-transformers is installed (else a row saying it is not: not run)
    st_cached: bool = True
    #: "panel" takes the epilogue GEMM for 16-bit operands on CUDA, "panel-cublas" the cuBLAS products
    #: and the panel kernel (the form before the epilogue GEMM): both are measured side by side
    paths: tuple[str, ...] = ("fused", "panel", "panel-cublas")
    #: (N, D) of the parity rows: the first with every regime and dtype and the option rows, the others with
    #: ``secondary_regimes`` and ``secondary_dtypes`` (run cheapest N x D first, see :func:`parity_units`)
    parity_shapes: tuple[tuple[int, int], ...] = ((4099, 768), (4099, 100))
    #: regimes / dtypes of the parity shapes after the first (None: those of the first): D = 100 checks the
    #: ragged D chunk and the small-D path, which the regime and the dtype do not change; the full matrix there
    #: doubled the rows past what the default budget holds (the plan's ESTIMATE)
    secondary_regimes: tuple[str, ...] | None = ("flat",)
    secondary_dtypes: tuple[torch.dtype, ...] | None = (torch.bfloat16,)
    dtypes: tuple[torch.dtype, ...] = DTYPES
    #: input regimes of the parity rows (``testing.cases.REGIMES``): "sharp" is temperature 0.01 (logit
    #: scale 100) with correlated positives, where a 16-bit intermediate shows; "saturated" a softmax at
    #: p_t ~ 0.9999, where the core op's two pieces cancel (their 16-bit rounding would swamp the gradient)
    regimes: tuple[str, ...] = ("flat", "sharp", "saturated")
    determinism_shape: tuple[int, int] = (4099, 768)
    determinism_runs: int = 10  # < 2: skip
    fp16_shape: tuple[int, int, int] | None = (4096, 65536, 768)  # N anchors, M keys, D (None: skip)
    timing_sizes: tuple[int, ...] = (16384, 65536)  # (): skip
    timing_d: int = 768
    timing_dtype: torch.dtype = torch.bfloat16
    #: at most this many timed repeats per contender (the median is reported); fewer where the time left, shared
    #: among the timing rows still to run, does not hold them (at least one after the warm-up)
    timing_repeats: int = 5
    ncu: bool = False
    ncu_shape: tuple[int, int] = (16384, 768)
    #: the panel path's parity once more with this many rows per panel (None: skip), so several panels
    #: meet the oracle (the switchboard's hook ``PANEL_ROWS``)
    multi_panel_rows: int | None = 1000
    #: rows of the Gluon statistics kernel (:data:`GLUON_CASES`; (): skip)
    gluon_cases: tuple[tuple[str, int, int | None, int, float, bool, int | None], ...] = GLUON_CASES
    #: a built libfused_contrastive_torch.so: the checks also run on its operators (paths "aot/fused",
    #: "aot/panel"); a problem the library does not cover is reported as such (information)
    aot_lib: str | None = None
    #: wall-clock seconds for the whole run: a row that would start later is listed as not run (the
    #: verdict table always comes); None: no limit
    budget_s: float | None = 420.0
    #: processes for parity, determinism and fp16 (the timings always run alone, after them): > 1 shares
    #: the first run's kernel compiles among the CPU cores
    jobs: int = 1
    #: an absolute deadline (``time.time()``) besides ``budget_s``: the worker processes share one
    until: float | None = None


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
    deadline: float | None = None  # time.monotonic() past which rows are not started
    not_run: int = 0

    def over_budget(self, check: str) -> bool:
        """True (and the row listed as not run) when the time budget is spent."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        self.not_run += 1
        self.results.append(Result(check, None, "not run: over the time budget"))
        return True

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
    """Force the triton backend's path: "fused" (the fused kernels), "panel" (row panels; the epilogue
    GEMM forms 16-bit gradient tiles) or "panel-cublas" (row panels; cuBLAS products and the panel
    kernel) on the JIT kernels, with the AOT route off; "aot/fused" / "aot/panel": the ahead-of-time
    library (``FUSED_CONTRASTIVE_AOT_LIB`` = ``Plan.aot_lib``), whose operators take that path."""
    from .core.lse import library_route

    aot = path.startswith("aot/")
    if aot and not _AOT_LIB:
        raise ValueError(f"path {path!r} needs the library: Plan.aot_lib / --aot-lib")
    base = path.removeprefix("aot/")
    gemm = {"panel": "epilogue", "panel-cublas": "cublas"}.get(base)  # forced also on the interpreter
    with _env("FUSED_CONTRASTIVE_TRITON_PATH", base.removesuffix("-cublas")), \
            _env("FUSED_CONTRASTIVE_PANEL_GEMM", gemm), _env(library_route.ENV, _AOT_LIB if aot else None):
        yield


def kernels_only():
    """Turn off the one-tile PyTorch path small problems take (``FUSED_CONTRASTIVE_DENSE=0``), so that
    ``backend="triton"`` runs the kernels at every size."""
    return _env("FUSED_CONTRASTIVE_DENSE", "0")


@contextlib.contextmanager
def poisoned_launches(seen: list[str] | None = None, flags: list[tuple[str, dict]] | None = None) -> Iterator[None]:
    """Every Triton launch first fills the outputs and scratch buffers it must write with NaN (and
    appends its kernel name to ``seen``, its name and compile-time flags to ``flags``)."""
    from .core.triton_shared import launch as TL

    orig = TL._launch

    def launch(lz):
        if TL._RECORDER is None:
            if seen is not None:
                seen.append(lz.name)
            if flags is not None:
                flags.append((lz.name, dict(lz.constexprs)))
            for name in _OUTPUTS.get(lz.name, ()):
                t = lz.args.get(name)
                if name == "DB" and lz.args.get("grad_cols") != lz.args.get("M"):
                    continue
                if name == "COL_PART" and lz.constexprs.get("TRI"):
                    continue
                if isinstance(t, Tensor) and t.numel() > 1 and t.is_floating_point():
                    t.fill_(float("nan"))
        orig(lz)

    prev_flag = TL.POISON_OUTPUTS
    TL._launch, TL.POISON_OUTPUTS = launch, True
    try:
        yield
    finally:
        TL._launch, TL.POISON_OUTPUTS = orig, prev_flag


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
    """The switchboard's ``PANEL_ROWS = rows`` within the block (None: leave it)."""
    if rows is None:
        yield
        return
    with routes.override(PANEL_ROWS=rows):
        yield


def family(loss: str) -> str:
    """The kernel family a parity case runs: "core", "matryoshka", "cosent", "siglip" or "guided"."""
    from .testing import CASE_BY_NAME

    return "matryoshka" if loss == "matryoshka" else CASE_BY_NAME[loss].op


def matryoshka_dims(d: int) -> list[int]:
    """The levels of the "matryoshka" parity case at D: 768/512/256/128/64 at D = 768 (those of the model),
    else D, D/2, D/4 (ragged where D is odd)."""
    return [768, 512, 256, 128, 64] if d == 768 else sorted({d, max(1, d // 2), max(1, d // 4)}, reverse=True)


def parity_case(loss: str, n: int, d: int, seed: int, regime: str):
    """``(case, inputs)`` of a parity row: the registry case ``loss`` at (N, D) in ``regime``, or for
    "matryoshka" info_nce's with :func:`matryoshka_dims` levels."""
    from .testing import CASE_BY_NAME, make_inputs

    if loss != "matryoshka":
        case = CASE_BY_NAME[loss]
        return case, make_inputs(case, n, d, seed, regime)
    case = dataclasses.replace(CASE_BY_NAME["info_nce"], name="matryoshka")
    tensors, kwargs = make_inputs(case, n, d, seed, regime)
    return case, (tensors, {**kwargs, "matryoshka_dims": matryoshka_dims(d)})


def _parity_paths(plan: Plan, loss: str = "info_nce") -> list[tuple[str, str, int | None]]:
    """``(label, path, forced panel height)`` of the parity runs of ``loss``: every path of the plan, and
    the panel path once more with :attr:`Plan.multi_panel_rows` rows per panel, for the core op; the
    Matryoshka levels on every path; once ("own") for the families with kernels of their own."""
    fam = family(loss)
    if fam not in ("core", "matryoshka"):
        return [("own", "own", None)]
    out = [(p, p, None) for p in plan.paths]
    if fam == "core" and "panel" in plan.paths and plan.multi_panel_rows:
        out.append((f"panel(P={plan.multi_panel_rows})", "panel", plan.multi_panel_rows))
    return out


def parity_units(plan: Plan) -> list[tuple[int, int, str, torch.dtype, bool]]:
    """``(N, D, regime, dtype, primary)`` of the parity rows' units, cheapest N x D first (stable: the plan's
    order within a size): the first shape of the plan (primary: every regime and dtype, and the option rows),
    then the others with ``secondary_regimes`` / ``secondary_dtypes``."""
    units = []
    for i, (n, d) in enumerate(plan.parity_shapes):
        regs = plan.regimes if i == 0 or plan.secondary_regimes is None else plan.secondary_regimes
        dts = plan.dtypes if i == 0 or plan.secondary_dtypes is None else plan.secondary_dtypes
        units += [(n, d, regime, dt, i == 0) for regime in regs for dt in dts]
    return sorted(units, key=lambda u: u[0] * u[1])


def check_parity(report: Report, plan: Plan, device: str, oracle: Oracle) -> None:
    """Parity rows per unit of :func:`parity_units` (cheapest first), then loss and path."""
    from .core import reference
    from .testing import run

    for n, d, regime, dt, primary in parity_units(plan):
        for loss in (*plan.losses, *(plan.option_losses if primary else ())):
            rows = [(f"parity {loss} {label} N={n} D={d} {_dname(dt)} {regime}", path, prow)
                    for label, path, prow in _parity_paths(plan, loss)]
            if report.over_budget(rows[0][0]):
                report.not_run += len(rows) - 1
                continue
            try:
                case, (tensors, kwargs) = parity_case(loss, n, d, 0, regime)
                rounded = {k: (v.to(dt).double() if v.dim() > 0 else v.double()) for k, v in tensors.items()}
                truth_loss, truth_grads = oracle(case, (rounded, kwargs), device)
                with reference.computing_in(dt):
                    same_loss, same_grads = run(case, (tensors, kwargs), "reference", dt, device)
            except Exception as e:  # noqa: BLE001 - a FAIL row per path, and on to the next case
                for check, _, _ in rows:
                    report.add(check, False, f"the oracle or the {_dname(dt)} reference raised {_err(e)}")
                continue
            for check, path, prow in rows:
                try:
                    _parity_one(report, check, case, family(loss), tensors, kwargs, truth_loss, truth_grads,
                                same_loss, same_grads, path, prow, n, dt, device)
                except Exception as e:  # noqa: BLE001
                    report.add(check, False, f"raised {_err(e)}")


def _parity_one(report: Report, check: str, case, fam: str, tensors, kwargs, truth_loss, truth_grads, same_loss,
                same_grads, path: str, rows: int | None, n: int, dt, device: str) -> None:
    """One parity row: the triton backend on ``path`` (``rows``: forced panel height) against the oracle
    under THE rule (``testing.accuracy``: relative to each output's size, PyTorch's same-dtype error
    granted up to the slack)."""
    from .core.lse import library_route
    from .testing import run
    from .testing.accuracy import SLACK, amp_of, check_output, rounding_floor, same_dtype_error

    worst_ratio, worst = 0.0, "no outputs"
    problems: list[str] = []
    seen: list[str] = []
    flags: list[tuple[str, dict]] = []
    calls = library_route.CALLS
    forced = triton_path(path) if path != "own" else contextlib.nullcontext()
    with poisoned_launches(seen, flags), forced, _panel_height(rows):
        # the library takes 16-element row strides: NaN padding to the next such stride
        got_loss, got_grads = run(case, (tensors, kwargs), "triton", dt, device, canary=True,
                                  canary_align=16 if path.startswith("aot/") else 1)
    if path.startswith("aot/"):
        # the library's buffers are its own (not NaN-filled); a call it does not cover
        # ran on the JIT kernels: information, not a check of the library
        if library_route.CALLS == calls:
            report.add(check, None, "not covered by the library (the JIT kernels ran)")
            return
        jit = set(seen) & set().union(*PATHS.values())
        if jit:
            problems.append(f"JIT kernels ran beside the library: {sorted(jit)}")
    elif not any(want <= set(seen) for want in _alternatives(EXPECT[(fam, path)])):
        wants = " or ".join(str(sorted(w)) for w in _alternatives(EXPECT[(fam, path)]))
        problems.append(f"the kernels did not run (want {wants}, launches: {sorted(set(seen))})")
    elif case.name in OPTION_FLAGS and not any(
            name == OPTION_FLAGS[case.name][0] and fl.get(OPTION_FLAGS[case.name][1]) for name, fl in flags):
        problems.append(f"{OPTION_FLAGS[case.name][0]} did not run with {OPTION_FLAGS[case.name][1]} "
                        f"(launches: {sorted(set(seen))})")
    elif path == "panel" and dt == torch.bfloat16 and case.name in EPILOGUE_CASES and "epi_gemm" not in seen:
        problems.append(f"the epilogue GEMM did not run (launches: {sorted(set(seen))})")
    elif path == "panel-cublas" and "epi_gemm" in seen:
        problems.append("the epilogue GEMM ran on the forced cuBLAS form")
    elif rows is not None and sum(map(seen.count, PANEL_TILE_KERNELS)) < math.ceil(n / rows):
        problems.append(f"{sum(map(seen.count, PANEL_TILE_KERNELS))} panel launches, expected at least "
                        f"{math.ceil(n / rows)} panels of {rows} rows")
    outs = [("loss", got_loss, truth_loss, same_loss, 0.0)]
    for k, tg in truth_grads.items():
        gg = got_grads.get(k)
        if (tg is None) != (gg is None):
            problems.append(f"gradient of {k} {'missing' if gg is None else 'unexpected'}")
            continue
        if tg is not None:
            outs.append((f"grad {k}", gg, tg, same_grads.get(k), amp_of(tensors[k])))
    ref = max(1.0, _finite_max(truth_loss))
    f_loss, f_grad = rounding_floor(tensors, kwargs)
    for name, got, truth, same, amp in outs:
        floor = f_loss if name == "loss" else (0.0 if amp else f_grad)
        if dt == torch.float32 and same is not None:
            # in fp32 THE rule grants PyTorch's error against the oracle whole, so a wrong oracle would
            # widen its own tolerance: the fp32 reference must agree with it to ORACLE_SANITY x the slack
            e_same = same_dtype_error(same, truth)
            bound = ORACLE_SANITY * SLACK[dt] * max(_finite_max(truth), amp) + floor
            if not e_same <= bound:
                problems.append(f"oracle suspect: the float32 reference differs from it by {e_same:.3g} on "
                                f"{name} (> {bound:.3g})")
        w, e, tol = check_output(name, got, truth, same, dt, amp, ref=ref, floor=floor)
        ratio = 0.0 if e == 0 else (e / tol if tol > 0 else math.inf)
        ratio = math.inf if math.isnan(ratio) else ratio
        if ratio >= worst_ratio:
            worst_ratio, worst = ratio, str(w)
    ok = not problems and worst_ratio <= 1.0
    report.add(check, ok, "; ".join(problems) or f"err/tol {worst_ratio:.3f} ({worst})")


def gluon_stats_case(n: int, m: int | None, d: int, scale: float, want_col: bool, panel_rows: int | None,
                     device: str, seed: int = 7) -> dict:
    """One problem of the epilogue GEMM's statistics forward (``core/lse/triton_panel.py`` ``stats_forward``) with
    the Gluon kernel asked for (``EPI_GEMM=gluon-ws``) and its outputs NaN-filled: bf16 rows ``a`` [N, D] and ``b``
    [M, D] (None: B is A, the triangular frame with the self column excluded), normalised, at ``scale``; with
    ``panel_rows`` that panel height. Returns ``{"got": (lse, lse_col), "want": the float64 log-sum-exps of the
    same bf16 values (rows; columns with ``want_col``), "kernels": the launches' names, "why": the gate's reason
    when the Gluon kernel was refused (else None)}``."""
    from .core.lse import triton_panel
    from .core.spec import CoreData, CoreSpec
    from .core.triton_shared import gluon_epi
    from .core.triton_shared import launch as TL

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g).to(torch.bfloat16).to(device)
    b = None if m is None else torch.randn(m, d, generator=g).to(torch.bfloat16).to(device)
    tri = b is None
    spec = CoreSpec(normalize=True, exclude_self=tri)
    seen: list[str] = []
    gluon_epi.last_reason = None
    with routes.override(EPI_GEMM=gluon_epi.GLUON_WS, PANEL_ROWS=panel_rows), poisoned_launches(seen), \
            torch.no_grad():
        prep = TL._prepare_data(a, b, spec, CoreData(), False)
        lse, lse_col = triton_panel.stats_forward(TL._launch, prep, prep.a, prep.b, TL._scale32(scale, a.device), spec,
                                                  want_col, tri=tri)
    an = torch.nn.functional.normalize(a.double(), dim=1)
    bn = an if tri else torch.nn.functional.normalize(b.double(), dim=1)
    lg = scale * an @ bn.T
    if tri:
        lg.fill_diagonal_(float("-inf"))
    want = (torch.logsumexp(lg, dim=1), torch.logsumexp(lg, dim=0) if want_col else None)
    return {"got": (lse, lse_col), "want": want, "kernels": seen, "why": gluon_epi.last_reason}


#: Seconds one Gluon validation row may take on CUDA, in a child process (its first compile included): a kernel that
#: never finishes (a barrier protocol that deadlocks on the GPU) is then a FAIL row instead of the end of the run.
GLUON_ROW_TIMEOUT_S = 180.0


def gluon_row(case: tuple, device: str) -> tuple[bool | None, str]:
    """``(ok, detail)`` of one Gluon validation row (:data:`GLUON_CASES`, :func:`gluon_stats_case`): PASS when the
    kernel ran and every LSE is within ``1e-5 |LSE| + 4 |s| D 2^-24`` of the float64 value (the fp32 accumulation
    over D of exact bf16 products of unit rows: at most ``D 2^-24`` per cosine, times the scale; 4 for the norms
    and the exps); ``(None, "not run: ...")`` where the gate refused it, with its reason."""
    from .core.triton_shared import gluon_epi

    _label, n, m, d, scale, want_col, rows = case
    r = gluon_stats_case(n, m, d, scale, want_col, rows, device)
    if gluon_epi.NAME not in r["kernels"]:
        return None, f"not run: the Gluon kernel did not launch ({r['why'] or 'no reason given'})"
    tol_abs = 4 * abs(scale) * d * 2.0 ** -24
    worst, what = 0.0, ""
    for name, got, want in (("LSE", r["got"][0], r["want"][0]), ("LSEcol", r["got"][1], r["want"][1])):
        if want is None:
            continue
        tol = 1e-5 * want.abs() + tol_abs
        err = (got.double() - want).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
        ratio = float((err / tol).max())
        if ratio >= worst:
            worst, what = ratio, f"{name} max err {float(err.max()):.3g}"
    return worst <= 1.0, f"err/tol {worst:.3f} ({what}); kernels {sorted(set(r['kernels']))}"


def gluon_row_child(case: tuple, device: str) -> tuple[bool | None, str]:
    """:func:`gluon_row` in a child process (``python -m fused_contrastive.gpu_validate --gluon-child``), killed
    after :data:`GLUON_ROW_TIMEOUT_S` seconds: no GPU has run the kernel, and a hang must not stop the run."""
    import json

    cmd = [sys.executable, "-m", "fused_contrastive.gpu_validate", "--gluon-child", json.dumps(list(case)), device]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=GLUON_ROW_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return False, f"no result within {GLUON_ROW_TIMEOUT_S:.0f} s (child killed: a hang?)"
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return False, f"child exited {r.returncode}: {(r.stderr or r.stdout)[-300:]!r}"
    ok, detail = json.loads(lines[-1])
    return ok, detail


def check_gluon_stats(report: Report, plan: Plan, device: str) -> None:
    """The Gluon statistics kernel's rows (:func:`gluon_row`; on CUDA each in a child process with a time limit,
    :func:`gluon_row_child`); a row whose kernel the gate refused is counted as not run."""
    for case in plan.gluon_cases:
        label, n, m, d, scale = case[:5]
        check = f"gluon-ws statistics {label} N={n} M={m or n} D={d} s={scale:g}"
        if report.over_budget(check):
            continue
        try:
            ok, detail = (gluon_row_child if torch.device(device).type == "cuda" else gluon_row)(case, device)
        except Exception as e:  # noqa: BLE001 - a FAIL row, and on to the next
            report.add(check, False, f"raised {_err(e)}")
            continue
        if ok is None and detail.startswith("not run"):
            report.not_run += 1
        report.add(check, ok, detail)


def check_gemm_routes(report: Report, plan: Plan, device: str) -> None:
    """Information: the route of the panel path's fp32-output GEMMs per 16-bit dtype of the plan
    (``core/triton_shared/panels.gemm_routes``: "native" = ``out_dtype`` cuBLAS call proven by its probe on this
    device; otherwise the fallback, correct but with more memory traffic)."""
    from .core.triton_shared import panels

    for dt in (x for x in plan.dtypes if x != torch.float32):
        mm, addmm = panels.gemm_routes(torch.device(device), dt)
        report.add(f"cuBLAS fp32-output GEMMs {_dname(dt)}", None, f"mm {mm}, addmm {addmm}")


def check_determinism(report: Report, plan: Plan, device: str) -> None:
    from .testing import run

    n, d = plan.determinism_shape
    dt = plan.dtypes[0]
    for loss, (label, path, rows) in ((lo, pa) for lo in plan.losses for pa in _parity_paths(plan, lo)):
        check = f"determinism {loss} {label} N={n} D={d} {_dname(dt)}"
        if report.over_budget(check):
            continue
        try:
            case, inputs = parity_case(loss, n, d, 3, "flat")
            first = None
            same = True
            for _ in range(plan.determinism_runs):
                with triton_path(path) if path != "own" else contextlib.nullcontext(), _panel_height(rows):
                    lo, grads = run(case, inputs, "triton", dt, device)
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
    loss to 1e-3 relative, each gradient to 4e-3 relative (Frobenius) beyond the error of storing the
    fp32 gradient itself in fp16 (``_rel(g32.half(), g32)``: the keys' gradients at M = 65536 are mostly
    fp16 subnormals, whose storage alone was 5.8e-3 of the Frobenius norm on an H100, equal on every path
    to three digits): a few fp16 roundings (eps 4.9e-4) of a sum of M terms accumulated in fp32; the
    un-scaled subnormal tile measured 4.0e-3 in the review."""
    n, m, d = plan.fp16_shape
    g = torch.Generator().manual_seed(5)
    q = torch.randn(n, d, generator=g)
    k = torch.randn(m, d, generator=g)
    for path in plan.paths:
        if report.over_budget(f"fp16 vs fp32 info_nce {path} N={n} M={m} D={d}"):
            continue
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
    # the error of storing the fp32 gradients in fp16, which no fp16 result can avoid
    sq = _rel(out[torch.float32][1].half().float(), out[torch.float32][1])
    sk = _rel(out[torch.float32][2].half().float(), out[torch.float32][2])
    finite = all(bool(torch.isfinite(t).all()) for t in out[torch.float16])
    ok = finite and el <= 1e-3 and eq <= 4e-3 + sq and ek <= 4e-3 + sk
    report.add(f"fp16 vs fp32 info_nce {path} N={n} M={m} D={d}", ok,
               f"rel err loss {el:.2e} (<= 1e-3), grad q {eq:.2e} (<= 4e-3 + fp16 storage {sq:.2e}), grad k "
               f"{ek:.2e} (<= 4e-3 + {sk:.2e})" + ("" if finite else "; NON-FINITE fp16 output"))


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


#: The model's record (``bench/gpu_model.py``'s JSON lines) of each timed loss: its name there and the
#: keys of its route's and its textbook formula's time.
MODEL_KEYS = {"info_nce": ("info_nce", "ms", "naive_ms"), "simcse": ("simcse", "ms", "naive_ms"),
              "clip": ("clip", "ms", "naive_ms"), "siglip": ("siglip", "ms", "naive_ms"),
              "gist": ("gist", "ms", "naive_ms"),
              "matryoshka": ("matryoshka5", "ms", "naive_ms")}
#: The GPU model's records that the verdict sets beside its timings, as the package ships them (package data, so
#: that a regular install has the column): the records of MODEL_KEYS' losses at D = 768 for MODEL_GPUS, with
#: only the keys read here, extracted by :func:`model_extract` from the model's committed output (MODEL_SOURCE,
#: ``bench/gpu_model.py``'s JSON lines). tests/test_gpu_validate.py keeps the two equal;
#: FUSED_CONTRASTIVE_GPU_MODEL names another output of the model (the full file or such an extract).
MODEL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_model_times.jsonl")
MODEL_SOURCE = "bench/results/gpu_model/gpu_model.txt"
MODEL_GPUS = ("H200", "H100", "A100")


def _model_lines(path: str) -> list[dict]:
    import json

    with open(path) as fh:
        return [json.loads(line) for line in fh if line.startswith("{")]


def model_extract(path: str) -> str:
    """The JSON lines :data:`MODEL_FILE` holds, extracted from the GPU model's output at ``path``: one record
    per (loss, GPU kind, N) of :data:`MODEL_KEYS` at D = 768, with the keys :func:`model_predictions` reads."""
    import json

    keep = {key: (route, formula) for key, route, formula in MODEL_KEYS.values()}
    out = []
    for r in _model_lines(path):
        if r.get("gpu") in MODEL_GPUS and r.get("d", 768) == 768 and r.get("loss") in keep:
            fields = ("loss", "gpu", "n", "d", *keep[r["loss"]])
            out.append(json.dumps({k: r[k] for k in fields if k in r}, sort_keys=True))
    return "".join(line + "\n" for line in out)


def model_predictions(device: str) -> dict[tuple[str, int], tuple[float | None, float | None]]:
    """``{(loss, N): (route ms, formula ms)}`` of the GPU model for this device's kind (H100 / H200 /
    A100), read from the model's records (:data:`MODEL_FILE`, or ``FUSED_CONTRASTIVE_GPU_MODEL``); empty
    where the file or the kind is missing."""
    path = routes.setting("GPU_MODEL") or MODEL_FILE
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    kind = next((k for k in MODEL_GPUS if k in name), None)
    if kind is None or not os.path.exists(path):
        return {}
    recs = {(r["loss"], r["n"]): r for r in _model_lines(path) if r.get("gpu") == kind and r.get("d", 768) == 768}
    out = {}
    for loss, (key, route, formula) in MODEL_KEYS.items():
        for (name_, n), r in recs.items():
            if name_ == key:
                out[(loss, n)] = (r.get(route), r.get(formula))
    return out


def _textbook(loss: str, case, kwargs):
    """The textbook computation ``loss`` replaces, as ``fn(leaves) -> loss``."""
    from .bench import gist as bench_gist
    from .bench import matryoshka as bench_matryoshka
    from .testing.baselines import formula_of

    if loss == "matryoshka":
        dims = kwargs["matryoshka_dims"]
        return lambda x: bench_matryoshka._formula(x["query"], x["keys"], dims)
    if loss == "gist":
        ga, gp, gn = kwargs["guide"]
        return lambda x: bench_gist.textbook(x["anchors"], x["positives"], x["negatives"], ga, gp, gn,
                                             kwargs["temperature"], kwargs["margin"])
    formula = formula_of(case.name)
    return lambda x: formula.fn({**x, **kwargs})


def check_timings(report: Report, plan: Plan, device: str) -> None:
    """Fwd + bwd times (CUDA events, medians of ``timing_repeats``) of the triton backend's route, each
    triton path forced for the core op, and the textbook formula, with the model's prediction beside."""
    model = model_predictions(device)
    todo = [(loss, n) for loss in plan.losses for n in plan.timing_sizes]
    for i, (loss, n) in enumerate(todo):
        check = f"timing {loss} N={n} D={plan.timing_d} {_dname(plan.timing_dtype)}"
        if report.over_budget(check):
            continue
        # the time left, shared among the timing rows still to run, bounds this row's repeats
        share = None if report.deadline is None else max(report.deadline - time.monotonic(), 0.0) / (len(todo) - i)
        _timing_row(report, plan, device, loss, n, check, share, model)
    for loss in plan.losses:
        if family(loss) == "core" and plan.timing_sizes and (loss, max(plan.timing_sizes)) in report.timings:
            row = report.timings[(loss, max(plan.timing_sizes))]
            cands = {k: v for k, v in row.items() if k.startswith("triton/") and v is not None}
            if cands:
                report.prefer[loss] = min(cands, key=cands.get)


def _timing_row(report: Report, plan: Plan, device: str, loss: str, n: int, check: str, share: float | None,
                model) -> None:
    """One timing row: each contender warmed up once, then timed ``repeats`` times (median), ``repeats`` at most
    ``plan.timing_repeats`` and, with ``share`` (seconds this row may take), as many as the warm-up's time says
    fit in the contender's part of it (at least 1)."""
    measure = _timer(device)
    dt = plan.timing_dtype
    fam = family(loss)
    try:
        case, (tensors, kwargs) = parity_case(loss, n, plan.timing_d, 7, "flat")
    except Exception as e:  # noqa: BLE001
        report.add(check, False, f"raised {_err(e)}")
        return
    kwargs = {k: (v.to(device=device, dtype=dt) if isinstance(v, Tensor) and v.is_floating_point() else
                  tuple(g.to(device=device, dtype=dt) for g in v) if k == "guide" else
                  v.to(device) if isinstance(v, Tensor) else v) for k, v in kwargs.items()}
    leaves = {k: (v.to(device=device, dtype=dt) if v.dim() else v.to(device)).clone()
              .requires_grad_(True) for k, v in tensors.items()}
    textbook = _textbook(loss, case, kwargs)
    names = ["triton", *(f"triton/{p}" for p in plan.paths if fam == "core"), "naive"]
    row: dict[str, float | None] = {}
    reps: list[int] = []
    for name in names:
        def step(name=name, leaves=leaves, kwargs=kwargs, case=case, textbook=textbook):
            for v in leaves.values():
                v.grad = None
            if name == "naive":
                out = textbook(leaves)
            else:
                with triton_path(name.split("/", 1)[1]) if "/" in name else contextlib.nullcontext():
                    out = case.fn(**leaves, **kwargs, backend="triton")
                    out.backward()
                return
            out.backward()
        try:
            t0 = time.monotonic()
            step()  # warm-up (compiles, cuBLAS heuristics)
            took = time.monotonic() - t0
            r = plan.timing_repeats if share is None else \
                max(1, min(plan.timing_repeats, int(share / len(names) / max(took, 1e-6)) - 1))
            reps.append(r)
            row[name] = statistics.median(measure(step) for _ in range(r))
        except Exception as e:  # noqa: BLE001 - out of memory: "does not fit"; else a FAIL row
            row[name] = None
            if not _is_oom(e):
                report.add(f"timing {loss} {name} N={n} D={plan.timing_d} {_dname(dt)}", False,
                           f"raised {_err(e)}")
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    report.timings[(loss, n)] = row
    cells = ", ".join(f"{k} {'does not fit' if v is None else f'{v:.2f} ms'}" for k, v in row.items())
    pred = model.get((loss, n))
    mcell = (f"; MODEL triton {pred[0]:.2f} ms, textbook {pred[1]:.2f} ms" if pred and pred[0] and pred[1]
             else f"; MODEL triton {pred[0]:.2f} ms" if pred and pred[0] else "; no model row")
    tri, naive = row.get("triton"), row.get("naive")
    ratio = f"; triton / textbook {tri / naive:.2f}x" if tri and naive else ""
    nrep = f"{min(reps)}" if reps and min(reps) == max(reps) else \
        f"{min(reps)}-{max(reps)}" if reps else f"{plan.timing_repeats}"
    report.add(check, None, f"median of {nrep}: {cells}{ratio}{mcell}")
    del leaves
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


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


def _worker(device: str, plan: Plan, oracle: Oracle) -> tuple[list[Result], int]:
    """One worker process of :func:`_checks_in_workers`: its share of the checks, quietly."""
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        rep = validate(device, dataclasses.replace(plan, jobs=1), oracle, allow_cpu=True)
    return [r for r in rep.results if not r.check.startswith("cuBLAS")], rep.not_run


def _checks_in_workers(report: Report, plan: Plan, device: str, oracle: Oracle, reserve: float = 0.0) -> None:
    """Parity, determinism and fp16 in ``plan.jobs`` processes, before the timings run alone: the first
    run on a machine compiles every kernel variant (CPU-bound, seconds each, the GPU idle), so the
    correctness checks share the CPU cores; nothing is timed while they run. The units (determinism,
    fp16, parity per (shape, regime, dtype)) go to whichever worker is free, all under one wall-clock
    deadline: the budget left less ``reserve`` (the timings' ESTIMATE, at most 40 % of it), which the timings get.
    The sentence-transformers rows are a unit of their own (:func:`_worker_plans`)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    left = None if report.deadline is None else max(report.deadline - time.monotonic(), 0.0)
    until = None if left is None else time.time() + left - min(reserve, 0.4 * left)
    plans = _worker_plans(plan, until)
    with cf.ProcessPoolExecutor(plan.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_worker, device, p, oracle) for p in plans]
        for fut in futures:
            try:
                results, not_run = fut.result()
            except Exception as e:  # noqa: BLE001 - a worker that died is a FAIL row; the table follows
                report.add("a check worker", False, f"raised {_err(e)}")
                continue
            report.not_run += not_run
            for r in results:
                report.add(r.check, r.ok, r.detail)


def _worker_plans(plan: Plan, until: float | None) -> list[Plan]:
    """The units of :func:`_checks_in_workers`, one plan each, under the deadline ``until``: determinism, fp16,
    each parity unit of :func:`parity_units` (the option rows with the first shape's), the sentence-transformers
    rows."""
    base = dataclasses.replace(plan, timing_sizes=(), ncu=False, budget_s=None, until=until, jobs=1,
                               parity_shapes=(), determinism_runs=0, fp16_shape=None, st_cached=False,
                               gluon_cases=())
    # one task per unit, the long ones first, handed to whichever worker is free: determinism, fp16,
    # then parity per (shape, regime, dtype) in the plan's order of priority
    plans = []
    if plan.determinism_runs > 1:
        plans.append(dataclasses.replace(base, determinism_runs=plan.determinism_runs))
    if plan.fp16_shape is not None:
        plans.append(dataclasses.replace(base, fp16_shape=plan.fp16_shape))
    plans += [dataclasses.replace(base, parity_shapes=((n, d),), regimes=(regime,), dtypes=(dt,),
                                  option_losses=plan.option_losses if primary else ())
              for n, d, regime, dt, primary in parity_units(plan)]
    if plan.gluon_cases:  # the Gluon statistics kernel's rows, one unit
        plans.append(dataclasses.replace(base, gluon_cases=plan.gluon_cases))
    if plan.st_cached and plan.parity_shapes:  # the sentence-transformers rows: every dtype, the first shape
        plans.append(dataclasses.replace(base, parity_shapes=plan.parity_shapes[:1], losses=(), option_losses=(),
                                         st_cached=True))
    return plans


def estimate(plan: Plan) -> dict[str, tuple[int, float]]:
    """``{kind: (rows, ESTIMATED seconds of one process)}`` of ``plan`` from :data:`EST_S` (per row, not
    measured per row); the timings' at ``plan.timing_repeats`` repeats (:func:`plan_seconds` also gives them
    at 1, as the time left may bound them)."""
    n_par = sum(len(_parity_paths(plan, lo)) for n, d, _, _, primary in parity_units(plan)
                for lo in (*plan.losses, *(plan.option_losses if primary else ())))
    n_st = len(plan.dtypes) if plan.st_cached and plan.parity_shapes else 0
    n_det = sum(len(_parity_paths(plan, lo)) for lo in plan.losses) if plan.determinism_runs > 1 else 0
    n_fp16 = len(plan.paths) if plan.fp16_shape is not None else 0
    n_tim = len(plan.losses) * len(plan.timing_sizes)
    n_gl = len(plan.gluon_cases)
    return {"parity": (n_par, n_par * EST_S["row"]), "sentence-transformers": (n_st, n_st * EST_S["row"]),
            "gluon": (n_gl, n_gl * EST_S["row"]),
            "determinism": (n_det, n_det * EST_S["row"]), "fp16": (n_fp16, n_fp16 * EST_S["row"]),
            "timing": (n_tim, n_tim * EST_S["timing_row"] * (1 + plan.timing_repeats) / 6)}


def plan_seconds(est: dict[str, tuple[int, float]], jobs: int, repeats: int | None = None,
                 plan_repeats: int = 5) -> float:
    """The wall-clock ESTIMATE of a plan: the correctness rows over ``jobs`` processes, then the timings alone
    (at ``repeats`` repeats instead of the plan's ``plan_repeats``, when given)."""
    tim = est["timing"][1] if repeats is None else est["timing"][1] * (1 + repeats) / (1 + plan_repeats)
    return sum(s for k, (_, s) in est.items() if k != "timing") / max(1, jobs) + tim


def st_cached_case(n: int, d: int, seed: int):
    """``(fn, inputs, truth)`` of the sentence-transformers row: ``mnrl_from_embeddings`` (the loss the
    cached drop-ins compute from their embeddings; scale 20, query to doc, one positive and one hard
    negative column) and its float64 definition, InfoNCE of each query against every doc column
    (the reference backend: core/reference.py)."""
    from .integrations.sentence_transformers import mnrl_from_embeddings
    from .losses import info_nce

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g)
    pos = q + 0.5 * torch.randn(n, d, generator=g)
    neg = torch.randn(n, d, generator=g)

    def fn(q, pos, neg, backend):
        return mnrl_from_embeddings(q, [pos, neg], scale=20.0, backend=backend)

    def truth(q, pos, neg):
        return info_nce(q, torch.cat([pos, neg]), temperature=1 / 20.0, backend="reference")
    return fn, {"q": q, "pos": pos, "neg": neg}, truth


def check_st_cached(report: Report, plan: Plan, device: str) -> None:
    """The cached sentence-transformers drop-ins' loss on the triton backend in each dtype of the plan against
    its float64 definition (:func:`st_cached_case`) at the plan's first parity shape, under THE accuracy rule
    of ``testing.accuracy`` as every parity row (PyTorch's error in the dtype: the definition computed in it).
    Without sentence-transformers: a row saying so, counted as not run (it proves nothing)."""
    import importlib.util

    from .core import reference
    from .testing.accuracy import check_output, rounding_floor

    n, d = plan.parity_shapes[0]
    for dt in plan.dtypes:
        check = f"parity st_cached_mnrl own N={n} D={d} {_dname(dt)}"
        if importlib.util.find_spec("sentence_transformers") is None:
            report.not_run += 1
            report.add(check, None, "not run: sentence-transformers is not installed")
            continue
        if report.over_budget(check):
            continue
        try:
            fn, xs, truth = st_cached_case(n, d, 11)

            def grads(f, dtype, xs=xs, dt=dt, **kw):
                leaves = {k: v.to(dt).to(device=device, dtype=dtype).requires_grad_() for k, v in xs.items()}
                out = f(**leaves, **kw)
                out.backward()
                return out.detach(), {k: v.grad for k, v in leaves.items()}

            want_l, want_g = grads(truth, torch.float64)
            with reference.computing_in(dt):
                same_l, same_g = grads(truth, dt)
            with poisoned_launches():
                got_l, got_g = grads(fn, dt, backend="triton")
            f_loss, f_grad = rounding_floor(xs, {"scale": 20.0})
            ref = max(1.0, abs(float(want_l)))
            worst_ratio, worst = 0.0, ""
            for name, got, want, same, floor in [("loss", got_l, want_l, same_l, f_loss)] + [
                    (f"grad {k}", got_g[k], want_g[k], same_g[k], f_grad) for k in xs]:
                w, e, tol = check_output(name, got, want, same, dt, 0.0, ref=ref, floor=floor)
                ratio = 0.0 if e == 0 else (e / tol if tol > 0 else math.inf)
                ratio = math.inf if math.isnan(ratio) else ratio
                if ratio >= worst_ratio:
                    worst_ratio, worst = ratio, str(w)
            report.add(check, worst_ratio <= 1.0, f"err/tol {worst_ratio:.3f} ({worst})")
        except Exception as e:  # noqa: BLE001 - a FAIL row, and on to the next
            report.add(check, False, f"raised {_err(e)}")


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
    ends = [time.monotonic() + plan.budget_s] if plan.budget_s is not None else []
    if plan.until is not None:
        ends.append(time.monotonic() + (plan.until - time.time()))
    report = Report(device, deadline=min(ends) if ends else None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"fused-contrastive GPU validation on {device} ({name}), torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}", flush=True)
    est = estimate(plan)
    budget = "none" if plan.budget_s is None else f"{plan.budget_s:.0f} s"
    low = plan_seconds(est, plan.jobs, 1, plan.timing_repeats)
    high = plan_seconds(est, plan.jobs)
    print(f"plan: {sum(r for r, _ in est.values())} rows ("
          + ", ".join(f"{k} {r}" for k, (r, _) in est.items() if r)
          + f"); ESTIMATE {low:.0f} to {high:.0f} s with {plan.jobs} job(s) (timings at 1 to {plan.timing_repeats} "
          f"repeats; EST_S per row, not a measurement) against the budget {budget}", flush=True)
    if plan.budget_s is not None and low > plan.budget_s:
        print(f"  the ESTIMATE exceeds the budget: rows past it will be listed as not run (--budget {low:.0f} or "
              "more, or more --jobs)", flush=True)
    walls: dict[str, float] = {}
    if plan.jobs > 1:
        t0 = time.monotonic()
        _checks_in_workers(report, plan, device, oracle, reserve=est["timing"][1] * 2 / (1 + plan.timing_repeats))
        walls["correctness (workers)"] = time.monotonic() - t0
        plan = dataclasses.replace(plan, parity_shapes=(), determinism_runs=0, fp16_shape=None, st_cached=False,
                                   gluon_cases=())
    # in order (the time budget stops the run in this order): every correctness row, parity first (cheap
    # shapes first), then determinism and fp16 at large M; the timings last, their repeats bounded by the
    # time left
    steps = [("parity", lambda: check_parity(report, plan, device, oracle), bool(plan.parity_shapes)),
             ("sentence-transformers", lambda: check_st_cached(report, plan, device),
              plan.st_cached and bool(plan.parity_shapes)),
             ("cuBLAS GEMM routes", lambda: check_gemm_routes(report, plan, device), True),
             ("determinism", lambda: check_determinism(report, plan, device), plan.determinism_runs > 1),
             ("fp16 vs fp32", lambda: check_fp16_large_m(report, plan, device), plan.fp16_shape is not None),
             ("gluon statistics", lambda: check_gluon_stats(report, plan, device), bool(plan.gluon_cases)),
             ("timings", lambda: check_timings(report, plan, device), bool(plan.timing_sizes)),
             ("ncu", lambda: check_ncu(report, plan, device), plan.ncu)]
    for what, step, wanted in steps:
        if not wanted:
            continue
        t0 = time.monotonic()
        try:
            with kernels_only() if what != "ncu" else contextlib.nullcontext():
                step()
        except Exception as e:  # noqa: BLE001 - whatever escapes a check is a FAIL row; the table follows
            report.add(f"{what} (the check itself)", False, f"raised {_err(e)}")
        walls[what] = walls.get(what, 0.0) + time.monotonic() - t0
    fails = [r.check for r in report.results if r.ok is False]
    print("\nverdict table:")
    for r in report.results:
        print(f"  {({True: 'PASS', False: 'FAIL', None: 'info'})[r.ok]:4s}  {r.check:44s} {r.detail}")
    skipped = (f", {report.not_run} not run (time budget {plan.budget_s or 0:.0f} s spent: they prove nothing)"
               if report.not_run else "")
    print(f"\nverdict: {'PASS' if report.ok else 'FAIL'} ({sum(r.ok is True for r in report.results)} passed, "
          f"{len(fails)} failed{skipped}{': ' + ', '.join(fails) if fails else ''})")
    unproven = [r.check for r in report.results if r.ok is None and r.detail.startswith("not run")]
    if unproven:
        print(f"not proven (not run, {len(unproven)}): " + ", ".join(unproven))
    print("measured wall time (for EST_S): " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))
    for loss, be in report.prefer.items():
        print(f"auto should prefer on this device for {loss} (measured at N = {max(plan.timing_sizes)}): {be}")
    return report


def main(device: str, aot_lib: str | None = None, budget_s: float | None = 420.0, jobs: int = 1) -> int:
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

    aot_lib = aot_lib or routes.setting("AOT_LIB")
    return 0 if validate(device, Plan(aot_lib=aot_lib, budget_s=budget_s, jobs=jobs)).ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--gluon-child":
        import json

        print(json.dumps(gluon_row(tuple(json.loads(sys.argv[2])), sys.argv[3])))
        sys.exit(0)
    if len(sys.argv) == 5 and sys.argv[1] == "--ncu-child":
        ncu_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
