"""Every route decision the Triton backend makes by default, with the measurement that shows it wins.

A route is a choice between forms of the same computation (the one-tile path or the kernels, the panel path or
the fused kernels, cuBLAS products or the epilogue GEMM, a tile loop, a launch configuration...): :data:`ROUTES`
lists each one that a default takes, its condition, the setting that encodes it, and its evidence: rows of a
committed ``bench-gpu`` run (``bench/results/*/bench_gpu.jsonl``) in which the chosen form was timed beside each
alternative in one run, or a quoted line of a committed measurement, or :attr:`Route.unmeasured` saying that no
GPU has timed it (then it is the default only where no measured form exists). ``tests/test_routes.py`` reads
the evidence: every quoted row must exist and agree with its float64 definition, and no alternative may be
faster than the chosen form by more than :data:`TIE` (these runs' spread between repeats of one contender).

``python -m fused_contrastive.routes`` prints the table (docs/gpu-measurements.md's "Routes" section quotes it).

It is also the switchboard: the only reader of the ``FUSED_CONTRASTIVE_*`` environment variables.
:data:`SETTINGS` lists each with its kind, allowed values, default and meaning; :func:`setting` reads one
through one parser (an invalid value raises ``ValueError`` naming the variable and what it takes), and
:func:`override` sets them for the current process within a block (what tests use instead of the environment
or a module's globals).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "FUSED_CONTRASTIVE_"


@dataclass(frozen=True)
class Setting:
    """One ``FUSED_CONTRASTIVE_<name>`` variable. ``kind``: "choice" (one of ``choices``), "int" (an integer >=
    ``minimum``), "flag" (unset or "" gives ``default``, "0" off, anything else on) or "text" (a path or a name;
    "" counts as unset). ``reader``: where its value is used (a module of the package, or the C library's
    launcher for the variables only it reads)."""

    name: str
    kind: str
    default: object
    meaning: str
    reader: str
    choices: tuple[str, ...] = ()
    minimum: int = 1
    #: False for a hook of :data:`HOOKS`: no variable, only :func:`override` sets it
    env: bool = True

    @property
    def var(self) -> str:
        return PREFIX + self.name if self.env else f"the switchboard's hook {self.name}"

    def allowed(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(map(repr, self.choices))
        if self.kind == "int":
            return f"a positive integer (>= {self.minimum})" if self.minimum == 1 else f"an integer >= {self.minimum}"
        if self.kind == "flag":
            return "'0' or '1'"
        return "a path or a name"

    def parse(self, raw: str | None) -> object:
        """The value of the raw string ``raw`` (None: unset), or ``ValueError`` naming the variable."""
        if raw is None or (raw.strip() == "" and self.kind != "flag"):
            return self.default
        raw = raw.strip()
        if self.kind == "choice":
            if raw not in self.choices:
                raise ValueError(f"environment variable {self.var} must be {self.allowed()}, got {raw!r}")
            return raw
        if self.kind == "int":
            try:
                v = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {self.var} must be {self.allowed()}, got {raw!r}") from None
            if v < self.minimum:
                raise ValueError(f"environment variable {self.var} must be {self.allowed()}, got {raw!r}")
            return v
        if self.kind == "flag":
            return self.default if raw == "" else raw != "0"
        return raw


#: Every ``FUSED_CONTRASTIVE_*`` variable; names and meanings are part of the public interface.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("BACKEND", "choice", "auto", "the backend of a loss called with backend=\"auto\"", "_backend.resolve",
            ("auto", "torch", "triton", "reference")),
    Setting("DENSE", "flag", True, "'0' turns the one-tile path off (every problem takes the chunked path or the "
            "kernels)", "core.dense_path"),
    Setting("TILE_ELEMENTS", "int", None, "elements of one materialised tile of the PyTorch paths (unset: 2^21; "
            "set, it also holds the CUDA one-tile path to it)", "core.tiles.tile_elements"),
    Setting("AOT_LIB", "text", None, "the ahead-of-time C library the triton backend routes to (unset: off)",
            "core.lse.library_route"),
    Setting("AOT_FAKE_CPU", "flag", False, "the ahead-of-time route accepts CPU tensors (the mock driver's tests)",
            "core.lse.library_route; csrc/fc_torch.cpp"),
    Setting("AOT_PROBE_CPU", "flag", False, "the C library's GEMM probes run on the CPU (the mock driver's tests)",
            "csrc (the C library)"),
    Setting("LIBCUDA", "text", None, "the CUDA driver library the C launcher opens (the mock driver in tests)",
            "csrc (the C library)"),
    Setting("TRITON_PATH", "choice", "auto", "the triton backend's path: the panel path or the fused kernels",
            "core.triton_shared.panels.use_panel; csrc/fc_torch.cpp", ("auto", "panel", "fused")),
    Setting("PANEL_GEMM", "choice", "auto", "what forms a panel's gradient tile: the epilogue GEMM or cuBLAS "
            "(fp16pass: the one pass's bf16 tiles from cuBLAS fp16 cosines and one in-place pass, untimed; "
            "elsewhere auto)", "core.triton_shared.panels.use_epilogue; core.triton_shared.logit_pass",
            ("auto", "epilogue", "cublas", "fp16pass")),
    Setting("PANEL_BUDGET", "int", None, "bytes of workspace a panel route may allocate (unset: "
            "core.triton_shared.panels.BUDGET_BYTES)", "core.triton_shared.panels.panel_rows; csrc/fc_torch.cpp"),
    Setting("EPI_FORM", "choice", None, "the epilogue GEMM's tile loop (unset: EPI_FORM_DEFAULT, else tiles)",
            "core.triton_shared.panels.epi_form", ("tiles", "persistent", "tma")),
    Setting("EPI_HOIST", "flag", False, "'1' issues the epilogue GEMM's per-row loads before its products' loop "
            "(MODE 0 / 1 / 2; same results; untimed, off by default)", "core.triton_shared.panels._epi_panel"),
    Setting("EPI_GEMM", "choice", "triton", "the kernel of the epilogue GEMM's statistics forward (MODE 3): triton "
            "(kernels/panel.py) or gluon-ws (kernels/gluon_epi.py: persistent, warp-specialised, sm_90 and a tested "
            "Triton only, elsewhere the Triton kernel with a warning; untimed, no GPU has run it)",
            "core.triton_shared.gluon_epi.requested", ("triton", "gluon-ws")),
    Setting("MATRYOSHKA_ROUTE", "choice", "auto", "the Matryoshka route on the triton backend",
            "core.matryoshka.triton_levels.route", ("auto", "calls", "kernels", "suffix")),
    Setting("TRITON_POISON", "flag", False, "fill every kernel output with NaN before its launch (read at import)",
            "core.triton_shared.launch.POISON_OUTPUTS"),
    Setting("GPU_MODEL", "text", None, "the GPU model's results file check --gpu-validate compares with",
            "gpu_validate"),
    Setting("SIGLIP_EPILOGUE", "choice", "exact", "SigLIP's per-logit math on the epilogue GEMM: exact (libdevice "
            "log, IEEE divisions), lean (one exp, a log1p polynomial, one approximate reciprocal), lean128 (lean, "
            "the one pass at 128 x 128 tiles) or fp16pass (no epilogue GEMM: cuBLAS fp16 cosines of the unit rows "
            "and one in-place Triton pass with the exact math; normalised 16-bit rows, else exact); the lean forms "
            "and fp16pass are untimed", "core.siglip.triton_sweep.epilogue; core.siglip.triton_fp16pass.use_fp16_pass",
            ("exact", "lean", "lean128", "fp16pass")),
    Setting("MAXSIM_FWD", "choice", "flat", "MaxSim's forward loop: flat (one token chunk per step, max / argmax "
            "after each matmul) or overlap (pairs of chunks, the next chunk's matmul issued before the pair's "
            "reductions; untimed)", "core.maxsim.triton_maxsim.fwd_overlap", ("flat", "overlap")),
    Setting("MAXSIM_DD", "choice", "smem", "MaxSim's dd operand: smem (the one-hot operand built in a blocked layout, "
            "through shared memory into the matmul's) or regs (built in the accumulator's layout: the sm_90 wgmma "
            "reads it from registers; untimed)", "core.maxsim.triton_maxsim.dd_p_regs", ("smem", "regs")),
)}

#: In-process hooks without a variable: sizes a test (or the GPU model, recording what a CUDA device would run)
#: fixes through :func:`override`; None leaves the choice to the code.
HOOKS: dict[str, Setting] = {s.name: s for s in (
    Setting("PANEL_ROWS", "int", None, "a fixed panel height of the panel routes (None: from the byte budget)",
            "core.triton_shared.panels.panel_rows; core.matryoshka.triton_levels.suffix_rows", env=False),
    Setting("GUIDED_PANEL_ROWS", "int", None, "a fixed panel height of the guided panel route (rounded to its row "
            "tile; None: from the byte budget)", "core.guided.triton_panel", env=False),
    Setting("PANEL_PROGRAMS", "int", None, "programs of the panel kernel (None: 2 per SM on CUDA, 1 on the "
            "interpreter)", "core.triton_shared.panels._programs", env=False),
    Setting("EPI_PROGRAMS", "int", None, "the persistent epilogue GEMM's grid (None: one program per SM on CUDA, "
            "the recorded GPU's, 3 on the interpreter)", "core.triton_shared.panels.persistent_programs", env=False),
    Setting("COL_PARTIAL_PROGRAMS", "int", None, "programs of the fused forward with a column LSE (None: 2 per SM "
            "on CUDA, 2 on the interpreter)", "core.triton_shared.launch._col_programs", env=False),
)}

_OVERRIDES: dict[str, object] = {}


def _get(name: str) -> Setting:
    try:
        return SETTINGS[name] if name in SETTINGS else HOOKS[name]
    except KeyError:
        raise KeyError(f"{PREFIX}{name} is not a setting of the switchboard ({', '.join(SETTINGS)}; hooks: "
                       f"{', '.join(HOOKS)})") from None


def raw(name: str) -> str:
    """The variable's text as the environment holds it ("" when unset); an override's value as text."""
    if name in _OVERRIDES:
        return str(_OVERRIDES[name])
    s = _get(name)
    return os.environ.get(s.var, "") if s.env else ""


def setting(name: str) -> object:
    """The value of ``FUSED_CONTRASTIVE_<name>``: an :func:`override` in force, else the environment parsed by
    its :class:`Setting`, else its default."""
    s = _get(name)
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    return s.parse(os.environ.get(s.var)) if s.env else s.default


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Within the block, ``setting(name)`` returns ``values[name]`` (given as its text, e.g. ``TRITON_PATH="panel"``,
    ``PANEL_BUDGET="4096"``, or as the value, ``DENSE=False``; None: its default), whatever the environment says;
    the previous overrides come back after. Values are checked as the environment's are. An override is this
    process's Python only: the C library's operators (``csrc/fc_torch.cpp``) read the environment themselves."""
    parsed = {}
    for name, v in values.items():
        s = _get(name)
        if v is None:
            parsed[name] = s.default
        elif isinstance(v, str):
            parsed[name] = s.parse(v)
        else:
            parsed[name] = s.parse(("1" if v else "0") if isinstance(v, bool) else str(v))
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(parsed)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)

#: An alternative within this factor of the chosen form's time is a tie: one H200 run measured two contenders
#: that run the same code 5.6 % apart (SimCSE at N = 16384: the default and ``fused_contrastive[gemm=cublas]``,
#: both the cuBLAS form, 6.68 and 7.06 ms).
TIE = 1.05

RUN1 = "bench/results/h200-bench-gpu-1/bench_gpu.jsonl"
RUN2 = "bench/results/h200-bench-gpu-2/bench_gpu.jsonl"


@dataclass(frozen=True)
class Rows:
    """The rows of one bench-gpu run at (loss, N, D): ``chosen`` (the contender that ran the default form; at
    the time of the run the default may have been another form, then ``chosen`` names the form's row) against
    each of ``alternatives``."""

    file: str
    loss: str
    n: int
    d: int
    chosen: str
    alternatives: tuple[str, ...]


@dataclass(frozen=True)
class Quote:
    """A line of a committed measurement (not a bench-gpu row) that the route rests on."""

    file: str
    line: str


@dataclass(frozen=True)
class Route:
    family: str
    decision: str
    default: str
    condition: str
    #: where the code encodes it (module and constant)
    setting: str
    evidence: tuple[Rows | Quote, ...] = ()
    #: why no GPU measurement backs it (then ``evidence`` is empty)
    unmeasured: str | None = None
    note: str = ""


def _rows(file: str, loss: str, ns: tuple[int, ...], chosen: str, *alts: str, d: int = 768) -> tuple[Rows, ...]:
    return tuple(Rows(file, loss, n, d, chosen, tuple(alts)) for n in ns)


OURS = "fused_contrastive"

ROUTES: tuple[Route, ...] = (
    Route("core", "one-tile path on CUDA", "one materialised N x M tile (PyTorch ops)",
          "CUDA, no column term, N x M <= 2^24 (2^21 elsewhere; FUSED_CONTRASTIVE_TILE_ELEMENTS overrides)",
          "core.CUDA_DENSE_ELEMENTS",
          _rows(RUN2, "info_nce", (4096,), f"{OURS}[tile=2^24]", OURS)
          + _rows(RUN2, "info_nce", (4096,), f"{OURS}[tile=2^24]", OURS, d=256)
          + _rows(RUN2, "simcse", (4096,), f"{OURS}[tile=2^24]", OURS)
          + _rows(RUN2, "supcon_in", (4096,), f"{OURS}[tile=2^24]", OURS)
          + _rows(RUN2, "matryoshka5", (4096,), f"{OURS}[tile=2^24]", OURS, f"{OURS}[matryoshka=suffix]"),
          note="between 2^21 and 2^24 untimed; the textbook is still faster at 4096 (1.42x for InfoNCE)"),
    Route("core", "kernels for a column term at N x M = 2^24", "the panel path's kernels",
          "CUDA, a column term (CLIP), N x M = 2^24", "core.dense_path (col)",
          _rows(RUN2, "clip", (4096,), OURS, f"{OURS}[tile=2^24]")
          + _rows(RUN2, "clip", (4096,), OURS, f"{OURS}[tile=2^24]", d=256)),
    Route("core", "panel path or fused kernels", "the panel path (row panels, cuBLAS / epilogue GEMMs)",
          "CUDA, N x M >= 2^24", "core.triton_shared.panels.MIN_ELEMENTS",
          _rows(RUN1, "clip", (4096,), OURS, f"{OURS}[path=fused]")
          + _rows(RUN1, "supcon_in", (4096,), OURS, f"{OURS}[path=fused]"),
          note="SimCSE measured the fused kernels 7 % faster at 4096 (3.86 / 4.16 ms): it now takes the "
               "one-tile path there (2.26 ms)"),
    Route("core", "gradient tiles of a summed loss without column term (one pass)", "the epilogue GEMM",
          "16-bit operands on CUDA, every N x M",
          "core.triton_shared.panels.EPILOGUE_MIN_ELEMENTS[('one_pass', cc)]",
          _rows(RUN2, "info_nce", (16384, 65536), OURS, f"{OURS}[gemm=cublas]")
          + _rows(RUN2, "info_nce", (16384, 65536), OURS, f"{OURS}[gemm=cublas]", d=256)
          + _rows(RUN2, "matryoshka5", (16384, 65536), OURS, f"{OURS}[gemm=cublas]")),
    Route("core", "gradient tiles with a column term (known statistics)", "cuBLAS products below 2^30, the "
          "epilogue GEMM from 2^30 (sm_90)", "16-bit operands on CUDA",
          "core.triton_shared.panels.EPILOGUE_MIN_ELEMENTS[('known', 90)]",
          _rows(RUN2, "clip", (4096, 16384), OURS, f"{OURS}[gemm=epilogue]")
          + _rows(RUN2, "clip", (16384,), OURS, f"{OURS}[gemm=epilogue]", d=256)
          + _rows(RUN2, "clip", (65536,), OURS, f"{OURS}[gemm=cublas]")
          + _rows(RUN2, "clip", (65536,), OURS, f"{OURS}[gemm=cublas]", d=256),
          note="Matryoshka CLIP at N = 16384 measured the epilogue GEMM 1.43x faster on its levels (21.1 / 30.2 "
               "ms, both runs): which level widths gain is not measured, so the rule is unchanged"),
    Route("core", "gradient tiles of the triangular sweep (B is A: SimCSE)", "cuBLAS products below 2^32, "
          "the epilogue GEMM from 2^32 (sm_90)", "16-bit operands on CUDA",
          "core.triton_shared.panels.EPILOGUE_MIN_ELEMENTS[('tri', 90)]",
          _rows(RUN2, "simcse", (16384,), OURS, f"{OURS}[gemm=epilogue]")
          + _rows(RUN2, "simcse", (65536,), OURS, f"{OURS}[gemm=cublas]")),
    Route("core", "the epilogue GEMM's tile loop", "one program per tile", "every config but SigLIP's one pass "
          "on sm_90", "core.triton_shared.panels.EPI_FORM_DEFAULT",
          _rows(RUN2, "info_nce", (65536,), OURS, f"{OURS}[epi=persistent]", f"{OURS}[epi=tma]")
          + _rows(RUN2, "simcse", (65536,), OURS, f"{OURS}[epi=persistent]", f"{OURS}[epi=tma]")
          + _rows(RUN2, "clip", (65536,), OURS, f"{OURS}[epi=persistent]", f"{OURS}[epi=tma]")
          + _rows(RUN2, "matryoshka5", (65536,), OURS, f"{OURS}[epi=persistent]", f"{OURS}[epi=tma]")
          + _rows(RUN2, "matryoshka5_clip", (65536,), OURS, f"{OURS}[epi=persistent]", f"{OURS}[epi=tma]")
          + _rows(RUN2, "gist", (16384,), OURS, f"{OURS}[epi=persistent]", f"{OURS}[epi=tma]"),
          note="the persistent loop ties within 5 % for InfoNCE, Matryoshka and GIST (1.01-1.05x) and loses for "
               "CLIP (0.83x); TMA loses everywhere but SigLIP"),
    Route("core", "the one pass's launch configuration", "128 x 128 x 64 tiles, 8 warps, 4 stages",
          "sm_90", "core.triton_shared.configs.EPI_GEMM['one_pass']",
          _rows(RUN2, "info_nce", (16384, 65536), OURS, f"{OURS}[one_pass=128x256w16]")),
    Route("core", "the epilogue GEMM's per-row loads", "after the D loop, as the epilogue reaches them",
          "MODE 0 / 1 / 2 (FUSED_CONTRASTIVE_EPI_HOIST=1: before the D loop, once; bitwise the same results)",
          "core.triton_shared.panels._epi_panel (EPI_HOIST)",
          unmeasured="no GPU has timed the two side by side: the default is the form every measurement ran, the "
                     "hoisted one is new (bench-gpu forms epi=hoist and one_pass=128x256w16+hoist, the first step of "
                     "bench/gpu_session.py)"),
    Route("core", "the one pass's tile producer", "the epilogue GEMM (MODE 1)",
          "bf16 one-pass sweeps on CUDA (FUSED_CONTRASTIVE_PANEL_GEMM=fp16pass: cuBLAS fp16 cosines and one in-place "
          "pass)", "core.triton_shared.logit_pass.use_fp16_pass",
          unmeasured="no GPU has timed the two side by side: the default is the form every measurement ran, the fp16 "
                     "pass is new (bench-gpu form gemm=fp16pass)"),
    Route("core", "the statistics forward's kernel (MODE 3)", "the Triton epilogue GEMM (kernels/panel.py)",
          "16-bit statistics forwards on the epilogue GEMM (FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws: the Gluon kernel "
          "where sm_90 and a tested Triton allow it)", "core.triton_shared.gluon_epi.TESTED_TRITON",
          unmeasured="no GPU has run the Gluon kernel: compiled for sm_90 only (tests/test_gluon_epi.py); "
                     "check --gpu-validate's gluon-ws rows prove it against float64, the bench-gpu form "
                     "epi=gluon-ws times it"),
    Route("siglip", "the per-logit math of the epilogue", "exact (libdevice log, IEEE divisions)",
          "SigLIP's sweeps on the epilogue GEMM (FUSED_CONTRASTIVE_SIGLIP_EPILOGUE=lean|lean128)",
          "core.siglip.triton_sweep.epilogue",
          unmeasured="no GPU has timed the two side by side: the default is the form every measurement ran, the lean "
                     "epilogue is new (bench-gpu forms siglip=lean, siglip=lean128, siglip=lean128+tiles)"),
    Route("siglip", "the sweeps' tile producer", "the epilogue GEMM (MODE 4 / 5)",
          "normalised 16-bit SigLIP sweeps on CUDA (FUSED_CONTRASTIVE_SIGLIP_EPILOGUE=fp16pass: cuBLAS fp16 cosines "
          "and one in-place pass)", "core.siglip.triton_fp16pass.use_fp16_pass",
          unmeasured="no GPU has timed the two side by side: the default is the form every measurement ran, the fp16 "
                     "pass is new (bench-gpu form siglip=fp16pass)"),
    Route("core", "the panel budget", "0.7 GB", "every panel route", "core.triton_shared.panels.BUDGET_BYTES",
          _rows(RUN2, "info_nce", (65536,), OURS, f"{OURS}[budget=2GB]", f"{OURS}[budget=6GB]")
          + _rows(RUN2, "simcse", (65536,), OURS, f"{OURS}[budget=2GB]")
          + _rows(RUN2, "clip", (65536,), OURS, f"{OURS}[budget=2GB]")
          + _rows(RUN2, "siglip", (65536,), OURS, f"{OURS}[budget=2GB]")
          + _rows(RUN2, "matryoshka5", (65536,), OURS, f"{OURS}[budget=2GB]"),
          note="2 GB is 2-4 % faster for four losses (a tie) at 2.8x the memory (1.85 against 0.66 GB), 6 % "
               "slower for SimCSE"),
    Route("siglip", "the one pass's tile loop", "persistent, TMA operand tiles", "sm_90",
          "core.triton_shared.panels.EPI_FORM_DEFAULT[('siglip_eager', 'sm90')]",
          _rows(RUN2, "siglip", (4096, 16384), OURS, f"{OURS}[epi=tiles]")
          + _rows(RUN2, "siglip", (16384, 65536), OURS, f"{OURS}[epi=tiles]", f"{OURS}[epi=persistent]")),
    Route("siglip", "panel route or fused kernels", "the panel path's epilogue GEMM (one pass)",
          "16-bit on CUDA, N x M >= 2^24", "core.siglip.triton_siglip.use_panel_route",
          _rows(RUN1, "siglip", (4096, 16384, 65536), OURS, f"{OURS}[gemm=cublas]")),
    Route("matryoshka", "levels above the panel threshold without a column term", "one plain call per level",
          "CUDA, N x M >= 2^24 (then each call's own route: the one-tile path at 2^24)",
          "core._leveled, core.matryoshka.triton_levels.route",
          _rows(RUN2, "matryoshka5", (16384,), OURS, f"{OURS}[matryoshka=suffix]")
          + _rows(RUN1, "matryoshka5", (16384,), f"{OURS}[gemm=cublas]", f"{OURS}[matryoshka=kernels]")),
    Route("matryoshka", "levels with a column term up to 2^24", "the Matryoshka kernels, suffix backward",
          "CUDA, a column term, N x M <= 2^24", "core.matryoshka.triton_levels.COL_KERNELS_MAX_ELEMENTS",
          _rows(RUN2, "matryoshka5_clip", (4096,), f"{OURS}[matryoshka=suffix]", OURS, f"{OURS}[tile=2^24]")
          + _rows(RUN2, "matryoshka5_clip", (16384,), OURS, f"{OURS}[matryoshka=suffix]")),
    Route("matryoshka", "the suffix backward below the panel threshold", "the suffix backward",
          "16-bit on CUDA, 2^20 <= N x M < 2^24, at most 5 levels",
          "core.matryoshka.triton_levels.SUFFIX_MIN_ELEMENTS",
          unmeasured="no GPU has timed N x M below 2^24; chosen by bench/gpu_model.py, which is 1.3x optimistic "
                     "for this library's routes (the kernels' own backward measured 3.5x slower than the suffix "
                     "route at 4096 and 4.1x at 16384)"),
    Route("guided", "GIST's route", "the guided epilogue GEMM on row panels", "summed bf16 loss on CUDA, "
          "N x sum M >= 2^24", "core.guided.triton_panel.use_guided_panel",
          _rows(RUN2, "gist", (16384,), OURS, f"{OURS}[epi=tma]"),
          note="its fused kernels took 189.2 ms at N = 16384 and 24.1 at 4096 in the first run, where the "
               "default could not compile (the second run: 20.4 and 6.8)"),
    Route("maxsim", "MaxSim's kernels", "r256t32 forward, gathered dq", "CUDA",
          "core.maxsim.triton_maxsim.DQ_GATHER", (Quote("bench/results/h100-maxsim/sweep2.txt", "r256t32-dd1"),),
          note="an H100 sweep; on the H200 the kernels beat late-interaction-kernels (0.76-0.88x) and "
               "flash-maxsim (0.69-0.75x)"),
    Route("maxsim", "the forward's tile loop and dd's one-hot operand", "flat loop; one-hot through shared memory",
          "CUDA (FUSED_CONTRASTIVE_MAXSIM_FWD=overlap, FUSED_CONTRASTIVE_MAXSIM_DD=regs)",
          "core.maxsim.triton_maxsim.FWD_OVERLAP",
          unmeasured="no GPU has timed them: the defaults are the forms every measurement ran, the overlap forward "
                     "and the register one-hot are new (bench-gpu forms maxsim=overlap and maxsim=dd-regs; sweep "
                     "settings fwd-overlap and dd-regs); compile figures in docs/maxsim.md"),
    Route("core", "every sm_80 threshold", "as sm_90 or the model's", "sm_80 (A100)",
          "core.triton_shared.panels.EPILOGUE_MIN_ELEMENTS[(form, 80)], triton_shared.configs sm_80 tables",
          unmeasured="no A100 has been lent; bench/gpu_model.py chose them"),
)


def table() -> str:
    """The routes as a Markdown table (family, decision, default, condition, evidence)."""
    lines = ["| family | decision | default | condition | evidence |", "|---|---|---|---|---|"]
    for r in ROUTES:
        if r.unmeasured:
            ev = f"unmeasured: {r.unmeasured}"
        else:
            files = sorted({e.file for e in r.evidence})
            ev = ", ".join(f"`{f}`" for f in files)
            if r.note:
                ev += f"; {r.note}"
        lines.append(f"| {r.family} | {r.decision} | {r.default} | {r.condition} | {ev} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
