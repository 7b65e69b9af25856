"""A MODEL (not a measurement) of the GPU time of the core-op losses: a roofline of every kernel launch
from its compiled artefacts, next to the matmul floor, the naive formula and the torch backend.

No GPU is used. For InfoNCE (keys, gradients to both), SimCSE (interleaved, B is A: the symmetric
kernels) and CLIP at N = M = 16384 and 65536, D = 768, bf16, on A100, H100 and H200:

* **triton backend.** The launches of one forward + backward are recorded exactly as the runtime
  builds them (``fused_contrastive.tools.compile_survey.record_case`` on the meta device; the column-LSE program
  count set to 2 x the GPU's SMs, as the launcher does on CUDA) and each one is compiled for the GPU's
  arch (sm_80 / sm_90) with ``triton.compile``. From the compile: registers (ptxas -v), shared memory
  (the kernel metadata), hence CTAs per SM (register file and shared-memory limits); and from its
  TTGIR, walked with the trip count of every ``scf.for`` (the loops over column tiles, row tiles and
  D chunks, from the launch's N, M, D and block sizes): tensor-core FLOPs (``tt.dot`` /
  ``warp_group_dot``), global loads and stores (L2 -> SM bytes), shared-memory bytes (async copies
  into shared memory, ``local_alloc`` / ``local_load``, layout conversions, and the MMA's operand
  reads from shared memory with the replication of its ``warpsPerCTA``), and exp / log elements
  (the MUFU work of the softmax). HBM bytes: the compulsory traffic (every input once, every output
  once) plus the streamed operand once per wave of CTAs plus, for the streaming backward, the misses
  of the L2 re-read: its working set (resident CTAs x (fp32 scratch rows + anchor rows)) against the
  L2 size, hit fraction ``min(1, L2 / working set)``, or 0 once it exceeds the L2 in the
  worst-data figure (cyclic LRU).
  Kernel time = max(tensor cores at peak, shared memory, L2, HBM) x wave-tail factor + the softmax
  time not hidden (all of it with 1 CTA/SM, half with 2: no warp specialisation, no ping-pong); the
  softmax time is the slower of its exp / log on the MUFU and its elementwise ops (arith ops on tensors,
  only the float ones inside a D loop, reductions, one issue slot per exp / log) on the FP32 lanes.
* **panel path** (``core/lse/triton_panel.py``, the default of ``backend="triton"`` on CUDA for N M >= 2^24):
  the same meta-device run with ``FUSED_CONTRASTIVE_TRITON_PATH=panel``: its Triton launches (the
  epilogue GEMM ``epi_gemm`` that forms 16-bit gradient tiles, or ``panel_dl`` on the cuBLAS form)
  modelled as above from their compile, its cuBLAS GEMMs and elementwise ops as below. Both Triton
  paths are in the tables; ``fused`` is the old fused backward, kept for comparison.
* **naive formula** (``F.normalize``, a bf16 cuBLAS GEMM, logits up-cast to fp32 as bf16 autocast does
  for ``cross_entropy``, ``cross_entropy``; CLIP adds the transposed CE; SimCSE masks the diagonal with
  an ``eye`` mask as the seeds do) and **torch backend** (``backend="torch"``: fp32 cuBLAS GEMMs on row
  chunks of ``tile_elements()`` plus elementwise passes, and the float64 overflow-safe norms of
  ``core/norms.py``): forward + backward run on the meta device under a dispatch mode; every ATen
  op is one launch; GEMMs at the assumed cuBLAS efficiency (times rows / 128 for a dimension under
  128: tile quantisation) or at HBM speed for their operand + output bytes, whichever is slower;
  other ops move their input + output bytes at L2 bandwidth when they fit in half the L2, else HBM;
  plus a fixed cost per launch. Peak live bytes decide whether the naive formula fits the GPU memory.

Achievable bandwidths and GEMM efficiencies are assumptions (:data:`ASSUMED`), each with an optimistic,
a central and a pessimistic value and its source; every time is printed as the central figure with the
range from all assumptions at their optimistic to all at their pessimistic end.

Every assumption is printed with the tables; this is a model, the numbers need a GPU to be checked
(``python -m fused_contrastive check --gpu-validate`` prints the ncu metrics that would calibrate it).

Usage: python bench/gpu_model.py [--sizes 16384,65536] [--d 768] [--gpus A100,H100,H200] [--no-compare]
[--matryoshka] [--gist] [--siglip] [--maxsim]
Output: the tables (labelled MODEL), then one JSON object per line for every (loss, gpu, n).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, do not interpret

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import re
import subprocess
import sys
import weakref
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fused_contrastive import core, routes
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.tools import compile_survey

LOSSES = ("info_nce", "simcse", "clip")
#: Matmul units (one unit = 2 N M D FLOPs) a loss cannot avoid with gradients to every input:
#: the logits once, and one GEMM per gradient side; symmetric SimCSE (B is A) computes S = A A^T as
#: half a product and both gradient roles from one H = G + G^T (the symmetric blocks of the core op).
FLOOR_UNITS = {"info_nce": 3.0, "simcse": 2.0, "clip": 3.0}


@dataclass(frozen=True)
class GPU:
    name: str
    cc: int
    sms: int
    bf16_tflops: float  # dense tensor-core peak
    tf32_tflops: float  # dense
    fp32_tflops: float  # non-tensor FMA peak
    hbm_tbs: float
    mem_gb: float
    l2_mb: float
    l2_tbs: float  # L2 -> SM
    smem_sm_kb: float  # shared memory per SM usable by CTAs
    cublas_eff: float  # fraction of peak a large cuBLAS GEMM reaches (assumed)
    source: str

    @property
    def arch(self) -> str:
        return "sm90" if self.cc >= 90 else "sm80"

    @property
    def clock_ghz(self) -> float:
        """The clock implied by the dense bf16 peak: 1024 FLOP/clk per tensor core on sm_80 (4 per SM)
        and 2048 on sm_90 (4 per SM)."""
        per_sm_clk = 4096 if self.cc >= 90 else 2048
        return self.bf16_tflops * 1e12 / (self.sms * per_sm_clk) / 1e9


GPUS = {
    "A100": GPU("A100", 80, 108, 312.0, 156.0, 19.5, 2.039, 80.0, 40.0, 5.5, 164.0, 0.80,
                "NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOP/s bf16 dense, 156 tf32, 19.5 fp32, 2.039 TB/s "
                "HBM2e, 80 GB) and A100 whitepaper (108 SMs, 40 MB L2, 164 KB shared memory/SM); L2 -> SM "
                "5.5 TB/s is the upper end of the l2_frac assumption's range (no vendor figure)"),
    "H100": GPU("H100", 90, 132, 989.4, 494.7, 66.9, 3.35, 80.0, 50.0, 10.0, 228.0, 0.72,
                "NVIDIA H100 datasheet (SXM5 80GB: 989 TFLOP/s bf16 dense, 495 tf32, 67 fp32, 3.35 TB/s "
                "HBM3, 80 GB) and Hopper whitepaper (132 SMs, 50 MB L2, 228 KB shared memory/SM); L2 -> SM "
                "10 TB/s is the upper end of the l2_frac assumption's range (no vendor figure)"),
    "H200": GPU("H200", 90, 132, 989.4, 494.7, 66.9, 4.8, 141.0, 50.0, 10.0, 228.0, 0.72,
                "NVIDIA H200 datasheet (SXM 141GB: same SM count, clocks and peaks as H100 SXM, 4.8 TB/s "
                "HBM3e, 141 GB); L2 as H100 (50 MB; 10 TB/s at the upper end of l2_frac's range)"),
}


@dataclass(frozen=True)
class Assumption:
    """A modelling assumption with the value used by each figure the model prints: ``optimistic`` (the
    low end of the time range), ``central`` and ``pessimistic`` (its high end). ``source`` says where
    the numbers come from, and quotes all three (a test checks it, so a value cannot change silently)."""

    name: str
    optimistic: float
    central: float
    pessimistic: float
    meaning: str
    source: str


#: The assumptions that turn counted work into time and are not datasheet figures. The time range the
#: model prints runs every one of them at its optimistic value, then at its pessimistic value.
ASSUMED = {a.name: a for a in (
    Assumption("hbm_stream", 0.92, 0.87, 0.82,
               "fraction of the datasheet HBM bandwidth that a pipelined stream reaches (cuBLAS operands "
               "and outputs, ATen elementwise ops, Triton kernels with num_stages > 1)",
               "published copy/stream microbenchmarks (BabelStream-style triad and copy kernels) sustain "
               "about 82-92 % of the datasheet figure on A100 and H100 HBM; 0.82 / 0.87 / 0.92 "
               "(pessimistic / central / optimistic)"),
    Assumption("hbm_unpipelined", 0.85, 0.78, 0.70,
               "fraction of the datasheet HBM bandwidth for a streaming kernel compiled without software "
               "pipelining (num_stages = 1: the panel kernel, one chunk of loads in flight per CTA and a "
               "barrier per chunk)",
               "Little's law: bytes in flight = bandwidth x latency; about 8 KB per CTA and 2-3 resident "
               "CTAs per SM at a loaded DRAM latency of 600-900 ns cover 70-85 % of 3.35 TB/s on H100; "
               "0.7 / 0.78 / 0.85 (pessimistic / central / optimistic)"),
    Assumption("l2_frac", 1.0, 0.85, 0.70,
               "L2 -> SM bandwidth as a fraction of the upper figure listed per GPU (10 TB/s H100/H200, "
               "5.5 TB/s A100)",
               "no vendor figure; published L2 load-bandwidth microbenchmarks of A100 and H100 spread over "
               "roughly 70-100 % of those upper figures; 0.7 / 0.85 / 1 (pessimistic / central / "
               "optimistic)"),
    Assumption("cublas_spread", 1.06, 1.0, 0.92,
               "multiplier on the GPU's large-GEMM cuBLAS efficiency (A100 0.80, H100/H200 0.72 of the "
               "dense peak for all of M, N, K >= 8192)",
               "vendor and community GEMM benchmarks put large bf16 cuBLAS GEMMs at roughly 66-76 % of the "
               "H100 SXM dense peak and 74-85 % of A100's; 0.92 / 1 / 1.06 (pessimistic / central / "
               "optimistic), around 0.72 and 0.80"),
    Assumption("gemm_k0", 64.0, 128.0, 192.0,
               "short-K cost: each output tile pays a fixed pipeline fill and epilogue (its output store, "
               "4 B per element for an fp32 output) equal to K0 more steps of its K loop, so a GEMM of "
               "depth K runs at K / (K + K0) of the large-GEMM efficiency (normalised to K = 8192)",
               "a 128 x 256 output tile's fp32 epilogue (128 KB) and a 3-4 stage pipeline fill take about "
               "as long as 64-192 steps of K on H100 / A100 tensor cores; 192 / 128 / 64 (pessimistic / "
               "central / optimistic)"),
    Assumption("splitk", 0.95, 0.90, 0.82,
               "efficiency factor of a GEMM with fewer 128 x 256 output tiles than 2 x SMs (long K: cuBLAS "
               "splits K or uses stream-K, then reduces the partial tiles)",
               "split-K / stream-K pay a reduction of the partial fp32 tiles and uneven work per SM: "
               "5-18 % below an equally large GEMM with enough output tiles; 0.82 / 0.9 / 0.95 "
               "(pessimistic / central / optimistic)"),
)}

SCENARIOS = ("optimistic", "central", "pessimistic")
_scenario = "central"


def assumed(name: str) -> float:
    """The value of assumption ``name`` in the scenario being modelled (see :func:`scenario`)."""
    return getattr(ASSUMED[name], _scenario)


@contextlib.contextmanager
def scenario(name: str):
    """Model with every assumption of :data:`ASSUMED` at its ``name`` value ("optimistic", "central" or
    "pessimistic")."""
    global _scenario
    if name not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {name!r}")
    prev, _scenario = _scenario, name
    try:
        yield
    finally:
        _scenario = prev


def hbm_tbs(gpu: GPU, pipelined: bool = True) -> float:
    """Achievable HBM bandwidth in the current scenario (TB/s)."""
    return gpu.hbm_tbs * assumed("hbm_stream" if pipelined else "hbm_unpipelined")


def l2_tbs(gpu: GPU) -> float:
    """L2 -> SM bandwidth in the current scenario (TB/s)."""
    return gpu.l2_tbs * assumed("l2_frac")


# Per-SM constants of sm_80 and sm_90 (CUDA C Programming Guide, compute capability tables)
REGS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
SMEM_RESERVED_PER_CTA = 1024  # bytes the driver reserves per CTA (cc >= 8.0)
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_BYTES_PER_CLK = 128  # per SM: 32 banks x 4 B per clock (CUDA C Programming Guide, shared memory, cc 8.x / 9.0)
# exp2 / log2 results per SM per clock (CUDA C Programming Guide, arithmetic instruction throughput, cc 8.x / 9.0)
MUFU_PER_CLK = 16
#: FP32 lanes per SM (one elementwise op per lane per clock): 64 on sm_80, 128 on sm_90 (the datasheets'
#: fp32 peaks: 108 x 64 x 2 x 1.41 GHz = 19.5 TFLOP/s, 132 x 128 x 2 x 1.98 GHz boost = 66.9)
ALU_LANES = {80: 64, 90: 128}
LAUNCH_US = 4.0  # fixed cost per kernel launch (host + GPU front end), as bench/cosent_model.py
GEMM_TILE = 64  # cuBLAS tile edge assumed for the quantisation of small GEMM dimensions (its smallest common one)

ASSUMPTIONS = [
    "tensor-core peaks, HBM bandwidth and memory: vendor datasheets (per GPU below); dense, no sparsity",
    "clock = bf16 peak / (SMs x 4096 FLOP/clk on sm_90, 2048 on sm_80): the clock the datasheet peak implies",
    f"shared memory {SMEM_BYTES_PER_CLK} B/clk/SM; exp/log (MUFU) {MUFU_PER_CLK}/clk/SM (CUDA C Programming Guide, "
    "throughput tables of cc 8.x / 9.0)",
    (f"softmax ALU work: every elementwise arith op on a tensor, every element a reduction "
     f"reads, and each exp / log take one issue slot of an FP32 lane ({ALU_LANES[80]} lanes/clk/SM on sm_80, "
     f"{ALU_LANES[90]} on sm_90); the integer address and mask arithmetic of a D loop (one address per 16-byte "
     "vector) is not counted; softmax time = max(MUFU time, ALU issue time)"),
    (f"CTAs/SM = min(regs: {REGS_PER_SM} / (ceil(regs x 32 / {REG_ALLOC_UNIT}) x {REG_ALLOC_UNIT} x warps), "
    f"shared: SM capacity / (kernel shared + {SMEM_RESERVED_PER_CTA} B), {MAX_THREADS_PER_SM} threads, "
    f"{MAX_CTAS_PER_SM} CTAs)"),
    ("kernel time = (max(tensor cores at peak, shared-memory bytes, L2->SM bytes, HBM bytes) "
    "+ softmax time x (1 / CTAs per SM)) x wave spread (no warp specialisation: the softmax of one CTA overlaps only "
    "another CTA's MMAs); latency (pipeline fill per column tile) is not modelled: an optimistic bound "
    "for the forward whose ring drains at every column tile"),
    ("wave spread: a grid runs in waves of SMs x CTAs/SM CTAs; a wave's work is done by the SMs holding one of "
     "its CTAs at their full rates (a grid smaller than the SM count leaves SMs idle; a lone CTA per SM is "
     "assumed to reach its SM's rates: optimistic, latency not modelled)"),
    ("layout conversions (ttg.convert_layout) go through shared memory (a write and a read); reductions "
    "across warps are not counted"),
    ("HBM bytes: inputs and outputs once, the streamed operand once per wave of resident CTAs (CTAs advance in "
    "lockstep), streaming-backward re-reads missed with fraction 1 - min(1, L2 / working set), or 1 once the "
    "working set exceeds the L2 in the worst-data figure; moved at the achievable bandwidth (hbm_stream, "
    "hbm_unpipelined for kernels compiled with num_stages = 1)"),
    ("panel kernel: when its [P, M] fp32 logits panel exceeds the L2, every pass over the panel and over "
     "its gradient tile is HBM traffic, the O(M) column vectors it re-reads per row block are L2 hits; the "
     "one-pass sweep's two-pass fallback (a row block whose sum underflows) is not taken in the range and "
     "taken for every block in the worst-data figure"),
    ("cuBLAS: efficiency = cublas_eff (A100 0.80, H100/H200 0.72) x cublas_spread x short-K factor "
    "K / (K + gemm_k0) (normalised to K = 8192) x splitk when it has fewer 128 x 256 output tiles than 2 x SMs; "
    f"a dimension d < {GEMM_TILE} costs a factor d / {GEMM_TILE}; time = max(FLOPs at that efficiency, operand "
    "+ output bytes (+ the accumulator's read for addmm) at hbm_stream)"),
    ("torch backend: fp32 GEMMs (its compute dtype for bf16 inputs) on the fp32 FMA pipes, PyTorch's "
    "default (torch.backends.cuda.matmul.allow_tf32 = False); torch_tf32_ms: the same with TF32 allowed"),
    (f"non-GEMM ATen ops: input + output bytes at the L2 bandwidth (l2_frac) when they fit in half the L2, "
    "else at hbm_stream; "
    f"{LAUNCH_US:g} us per launch"),
    ("naive formula: bf16 GEMM, logits up-cast to fp32 for cross_entropy (bf16 autocast's rule); "
    "'does not fit' when its peak live bytes exceed the GPU memory"),
]


# ------------------------------------------------------------------------------------------------
# compiled artefacts: registers, shared memory, and a walk of the TTGIR
# ------------------------------------------------------------------------------------------------

_DT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "i32": 4, "i64": 8}
_TENSOR = re.compile(r"tensor<([0-9x]+)x(!tt\.ptr<)?([a-z0-9]+)>?")
_MEMDESC = re.compile(r"!ttg\.memdesc<([0-9x]+)x([a-z0-9]+),")
_MMA = re.compile(r"^#(mma\d*) = #ttg\.nvidia_mma<\{versionMajor = (\d), .*warpsPerCTA = \[(\d+), (\d+)\]")
_FOR = re.compile(r"scf\.for %\S+ = %(\S+) to %(\w+) step %(\w+)")
_REDUCE_END = re.compile(r"^\}\) : \(tensor<([0-9x]+)x")  # the closing line of a tt.reduce region


def _trip(fm, trips: dict[str, int]) -> int:
    """Iterations of a loop ``to %bound step %step`` (a constant step ``%cS_i32``, or the persistent
    row-block loop ``to %n_row_blocks step %nprog``: trips["n_row_blocks"] is then per program)."""
    start, bound, step = fm[1], fm[2], fm[3]
    const = re.fullmatch(r"c(\d+)_i32", bound)
    if const and start == "c0_i32" and step == "c1_i32":  # a constant trip count (the Matryoshka level loops)
        return int(const[1])
    if bound not in trips and re.fullmatch(r"n_pn(_\d+)?", bound) and "__n_pn__" in trips:
        return trips["__n_pn__"]  # the epilogue GEMM's redo: its walk over the column tiles
    if bound not in trips:
        # the Matryoshka kernels' D walks end at a boundary loaded from DIMS: a walk from 0 over a level's
        # prefix, or over its segment; their trip counts summed over the K levels are exact when each loop
        # gets the mean (the level loop multiplies it by K)
        key = "__prefix_walk__" if start == "c0_i32" else "__segment_walk__"
        if key in trips:
            return trips[key]
        raise ValueError(f"loop bound %{bound} has no trip count")
    c = re.fullmatch(r"c(\d+)_i32", step)
    return math.ceil(trips[bound] / int(c[1])) if c else trips[bound]


def _elems(shape: str) -> int:
    return math.prod(int(x) for x in shape.split("x"))


def _tensor_bytes(text: str) -> tuple[int, int]:
    """(elements, bytes) of the first ``tensor<...>`` type in ``text`` (pointer tensors: the pointee)."""
    m = _TENSOR.search(text)
    if not m:
        return 0, 0
    n = _elems(m[1])
    return n, n * _DT_BYTES.get(m[3], 4)


def _memdesc_bytes(text: str) -> int:
    m = _MEMDESC.search(text)
    return _elems(m[1]) * _DT_BYTES.get(m[2], 4) if m else 0


def _is_if(line: str) -> bool:
    """The opening line of a runtime branch region (``scf.if ... {`` or its ``} else {``)."""
    return "scf.if" in line or line.startswith("} else")


_SSA = re.compile(r"%([\w#]+)")
#: Ops that take an integer tensor as a pointer offset or a mask: the address and mask arithmetic of memory
#: accesses, issued once per vector by the compiled code, not once per element.
_ADDRESS_USERS = ("tt.addptr", "tt.load", "ttg.async_copy_global_to_local")
#: Integer ops that pass an address / mask value on (the value's users decide).
_INT_PASS = ("tt.splat", "tt.broadcast", "tt.expand_dims", "ttg.convert_layout")


def _address_only(ttgir: str) -> set[str]:
    """The SSA names of integer tensors that only feed memory accesses' offsets and masks (directly or
    through other integer ops): ``tt.addptr`` offsets, load / copy masks, store masks and pointers. Their
    arithmetic is per 16-byte vector, not per element (the software pipeliner's prologue copies, outside
    the D loop, compute their masks this way). A value that reaches anything else (a select of data, a
    float conversion, a loop's yield) is counted."""
    defs: dict[str, tuple[str, bool]] = {}
    users: dict[str, list[tuple[str, str | None, int]]] = {}
    for raw in ttgir.splitlines():
        line = raw.strip()
        if line.startswith("//"):
            continue
        if "=" in line and line.startswith("%") and not line.startswith("%", 1):
            lhs, rhs = line.split("=", 1)
            name = lhs.strip()[1:].split(":")[0]
            op = rhs.strip().split(" ", 1)[0]
            m_t = _TENSOR.search(_result_type(line))
            defs[name] = (op, bool(m_t and m_t[2] is None and m_t[3][0] == "i"))
            body, res = rhs.split(":", 1)[0], name
        else:
            op = line.split(" ", 1)[0]
            body, res = line.split(":", 1)[0], None
        for pos, u in enumerate(_SSA.findall(body.split(" ", 1)[1] if " " in body.strip() else "")):
            users.setdefault(u, []).append((op, res, pos))
    memo: dict[str, bool] = {}

    def only(name: str) -> bool:
        if name in memo:
            return memo[name]
        memo[name] = False  # a cycle (loop-carried) counts
        ok = bool(users.get(name))
        for op, res, pos in users.get(name, ()):
            if op in _ADDRESS_USERS or (op == "tt.store" and pos != 1):
                continue
            if res is not None and res in defs and defs[res][1] and (op.startswith("arith.") or op in _INT_PASS):
                if only(res):
                    continue
            ok = False
            break
        memo[name] = ok
        return ok

    return {n for n, (_, is_int) in defs.items() if is_int and only(n)}


def _result_type(line: str) -> str:
    return line.rsplit("->", 1)[-1] if "->" in line else line.rsplit(":", 1)[-1]


def walk_ttgir(ttgir: str, trips: dict[str, int], if_weight: float = 1.0) -> dict[str, float]:
    """Per-program totals of one kernel from its TTGIR: every op counted once per iteration of its
    enclosing ``scf.for`` loops (trip count of a loop ``to %X step S`` = ceil(trips[X] / S)), and
    ``if_weight`` times inside a runtime ``scf.if`` (1: the branch is taken; the panel kernel's
    fallback branch is weighted 0 in the central figure, 1 in the pessimistic one).

    Returns flops (2 M N K per dot), gload / gstore bytes (global loads incl. async copies, stores),
    smem bytes (async copies in, local_alloc of a value, local_load, convert_layout x 2, the MMA's
    shared-memory operands times the warps (sm_80) / warpgroups (sm_90) that read them), exp and log
    elements (MUFU), alu elements (elementwise arith ops on tensors, only float ones inside a D loop,
    and the elements reductions read: the work of the FP32 lanes)."""
    mmas = {}
    for line in ttgir.splitlines():
        m = _MMA.match(line.strip())
        if m:
            mmas[m[1]] = (int(m[2]), int(m[3]), int(m[4]))
    out = dict(flops=0.0, gload=0.0, gload_vec=0.0, gstore=0.0, smem=0.0, exp=0.0, log=0.0, alu=0.0)
    addr = _address_only(ttgir)
    stack: list[float] = []
    in_d_loop: list[bool] = []
    prologue_copies: list[tuple[float, int]] = []  # pipeliner prologue copies (outside a D loop)
    d_loop_copy_sizes: set[int] = set()
    for raw in ttgir.splitlines():
        line = raw.strip()
        if line.startswith("}") and stack:
            stack.pop()
            in_d_loop.pop()
        mult = math.prod(stack) if stack else 1.0
        red = _REDUCE_END.match(line)
        if red:  # a reduction reads every element of its operand
            out["alu"] += mult * _elems(red[1])
        fm = _FOR.search(line)
        if line.endswith("{"):
            if fm:
                stack.append(_trip(fm, trips))
                # a D loop: to %D, the guide dot's walk to %Dg (kernels/guided.py: without it the guide
                # tiles' pipelined copies, as large as the model tiles', were taken for the D loop's
                # prologue and dropped), or a Matryoshka walk along D (its bound a boundary loaded from DIMS)
                in_d_loop.append(fm[2] in ("D", "Dg")
                                 or (fm[2] not in trips and not re.fullmatch(r"c\d+_i32", fm[2])))
            else:
                stack.append(if_weight if _is_if(line) else 1.0)
                in_d_loop.append(in_d_loop[-1] if in_d_loop else False)
        if "=" not in line or line.startswith("//"):
            continue
        op = line.split("=", 1)[1].strip().split(" ", 1)[0]
        if op == "ttg.async_copy_global_to_local":
            b = _memdesc_bytes(line.split("->")[-1]) or _tensor_bytes(line)[1]
            if in_d_loop and in_d_loop[-1]:
                d_loop_copy_sizes.add(b)
                out["gload"] += mult * b
                out["smem"] += mult * b
            else:
                prologue_copies.append((mult, b))
        elif op == "tt.load":
            res = _result_type(line)
            b = _tensor_bytes(res)[1]
            out["gload"] += mult * b
            m1 = _TENSOR.search(res)
            if m1 and "x" not in m1[1]:  # a rank-1 load: a row / column vector
                out["gload_vec"] += mult * b
        elif op == "ttg.local_alloc" and "%" in line.split("local_alloc", 1)[1].split(":")[0]:
            out["smem"] += mult * _tensor_bytes(line.split("local_alloc", 1)[1])[1]
        elif op == "ttg.local_load":
            res = _result_type(line)
            b = _tensor_bytes(res)[1]
            dm = re.search(r"dot_op<\{opIdx = (\d), parent = #(mma\d*)", res)
            if dm and dm[2] in mmas:
                ver, w0, w1 = mmas[dm[2]]
                b *= (w1 if dm[1] == "0" else (w0 if ver == 2 else max(1, w0 // 4)))
            out["smem"] += mult * b
        elif op == "ttg.convert_layout":
            out["smem"] += mult * 2 * _tensor_bytes(_result_type(line))[1]
        elif op in ("tt.dot", "ttng.warp_group_dot"):
            res = _result_type(line)
            m_n = _TENSOR.search(res)
            mm = re.search(r"#(mma\d*)", res)
            ops_txt = line.split(":", 1)[1].split("->")[0]
            a_txt, b_txt = ops_txt.split(" * ")
            k = int((_MEMDESC.search(a_txt) or _TENSOR.search(a_txt))[1].split("x")[-1])
            mr, nc = (int(x) for x in m_n[1].split("x"))
            out["flops"] += mult * 2 * mr * nc * k
            ver, w0, w1 = mmas.get(mm[1], (2, 1, 1)) if mm else (2, 1, 1)
            if op == "ttng.warp_group_dot":  # operands read by the MMA straight from shared memory
                if "memdesc" in a_txt:
                    out["smem"] += mult * _memdesc_bytes(a_txt) * w1
                if "memdesc" in b_txt:
                    out["smem"] += mult * _memdesc_bytes(b_txt) * max(1, w0 // 4)
        elif op == "tt.store" or line.startswith("tt.store"):
            pass
        elif op in ("math.exp", "math.exp2"):
            out["exp"] += mult * _tensor_bytes(_result_type(line))[0]
        elif op in ("math.log", "math.log2"):
            out["log"] += mult * _tensor_bytes(_result_type(line))[0]
        elif op.startswith("arith.") and op != "arith.constant":
            m_t = _TENSOR.search(_result_type(line))
            # inside a D loop only the float work (the streaming accumulator, the row epilogues); its
            # integer ops are address and mask arithmetic, one per 16-byte vector, not counted; nor,
            # anywhere, the integer ops that only feed memory accesses' offsets and masks (_address_only)
            name = line.split("=", 1)[0].strip()[1:].split(":")[0]
            if m_t and not (in_d_loop and in_d_loop[-1] and m_t[3][0] == "i") and name not in addr:
                out["alu"] += mult * _elems(m_t[1])
    # tt.store has no result: counted here with its enclosing loops
    stack, mult = [], 1.0
    for raw in ttgir.splitlines():
        line = raw.strip()
        if line.startswith("}") and stack:
            stack.pop()
        fm = _FOR.search(line)
        if line.endswith("{"):
            stack.append(_trip(fm, trips) if fm else (if_weight if _is_if(line) else 1.0))
        if line.startswith("tt.store"):
            out["gstore"] += (math.prod(stack) if stack else 1.0) * _tensor_bytes(line.split(":", 1)[1])[1]
    # the software pipeliner issues the first stages' copies before the D loop and predicates the
    # last ones off inside it: the in-loop count already covers every chunk once
    for mult, b in prologue_copies:
        if b not in d_loop_copy_sizes:
            out["gload"] += mult * b
            out["smem"] += mult * b
    return out


@functools.cache
def _compile(key, cc: int, launch_holder: tuple) -> dict:
    launch = launch_holder[0]
    keep: dict = {}
    info = compile_survey.compile_launch(launch, cc, keep)
    info["ttgir"] = keep["kernel"].asm["ttgir"]
    return info


class _Holder(tuple):
    """A launch carried through functools.cache without hashing its tensors."""

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return True


def compile_info(launch: TL.Launch, cc: int) -> dict:
    key = (launch.name, tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages,
           tuple(sorted((k, str(v.dtype)) for k, v in launch.args.items() if isinstance(v, torch.Tensor))))
    return _compile(key, cc, _Holder((launch,)))


def ctas_per_sm(regs: int, warps: int, shared: int, gpu: GPU) -> int:
    per_warp = math.ceil(regs * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = int(gpu.smem_sm_kb * 1024) // (shared + SMEM_RESERVED_PER_CTA)
    return max(0, min(by_regs, by_smem, MAX_THREADS_PER_SM // (32 * warps), MAX_CTAS_PER_SM))


# ------------------------------------------------------------------------------------------------
# the triton backend, launch by launch
# ------------------------------------------------------------------------------------------------


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def run_triton(loss: str, n: int, d: int, gpu: GPU, path: str) -> tuple[list[TL.Launch], list]:
    """One forward + backward of ``loss``'s core op through ``TritonCoreFn`` on the meta device, as the
    runtime would issue it on ``gpu`` (its arch's configs; the column-LSE program count of a CUDA device)
    on ``path`` ("fused": the fused kernels; "panel": row panels in the form CUDA takes; "panel-epilogue":
    the 16-bit gradient tiles (and the statistics) from the epilogue GEMM, cuBLAS for dA / dB;
    "panel-cublas": the logits by cuBLAS too, then the panel kernel (the fused forward for statistics);
    "panel-fp16pass": the one pass's tiles from cuBLAS fp16 cosines and one in-place pass, the rest as "panel").
    Returns the Triton launches (recorded, not run) and the ATen ops around them (:class:`OpCounter`).
    The arguments are the loss's own core-op call (``tools.compile_survey.core_call``), run as ``core.run`` runs it
    (the log-sum-exp terms and the O(N D) linear target / positive terms as one ``core.PiecesFn``; the
    one-tile dense path off, as at every size the model is asked for)."""
    a, b, scale, spec, data, coef, reduce = compile_survey.core_call(loss, n, d, torch.bfloat16)
    # "panel": the panel form CUDA takes ("auto": panels.use_epilogue's rule); "panel-epilogue" /
    # "panel-cublas": that form forced; the program counts a CUDA device gives _col_programs and the panel kernel
    gemm = {"panel-epilogue": "epilogue", "panel-cublas": "cublas", "panel-fp16pass": "fp16pass"}.get(path, "auto")
    with routes.override(DENSE=False, TRITON_PATH=path.split("-")[0], PANEL_GEMM=gemm,
                         COL_PARTIAL_PROGRAMS=2 * gpu.sms, PANEL_PROGRAMS=2 * gpu.sms), \
            compile_survey.recording(gpu.arch) as launches, OpCounter() as ops, norms_tagged(ops):
        out = core.run("triton", a, b, scale, spec, data, coef, reduce)
        torch.autograd.grad(out if reduce else out.sum(), [x for x in (a, b) if x is not None and x.requires_grad])
        del out
    return list(launches), ops.ops


def wave_spread(grid: int, slots: int, sms: int) -> float:
    """Time of a grid relative to the same work spread over every SM: waves of ``slots`` CTAs, each
    wave's work done by the SMs that hold one of its CTAs (an SM with a resident CTA runs at its full
    rates: optimistic for a lone CTA, whose latency is not modelled)."""
    if grid <= 0:
        return 1.0
    full, last = divmod(grid, slots)
    waves = [slots] * full + ([last] if last else [])
    return sum(c / grid * sms / min(sms, c) for c in waves)


@functools.cache
def _loop_bounds(ttgir: str) -> frozenset[str]:
    """The loop-bound names of a TTGIR (``scf.for ... to %X``)."""
    return frozenset(m[2] for m in _FOR.finditer(ttgir))


@functools.lru_cache(maxsize=8192)
def _walk_items(ttgir: str, items: tuple, if_weight: float) -> dict[str, float]:
    return walk_ttgir(ttgir, dict(items), if_weight)


def _walk_cached(ttgir: str, trips: dict, if_weight: float) -> dict[str, float]:
    """:func:`walk_ttgir` memoised on the trip counts its loops read (the panel routes launch one kernel per
    panel with the same loops and another row offset: thousands of identical walks at N = 65536)."""
    bounds = _loop_bounds(ttgir)
    items = tuple(sorted((k, v) for k, v in trips.items() if k in bounds or k.startswith("__")))
    return dict(_walk_items(ttgir, items, if_weight))


def kernel_model(launch: TL.Launch, gpu: GPU) -> dict:
    """Roofline of one launch on ``gpu`` (see the module docstring)."""
    if launch.constexprs.get("PERSIST"):
        # the persistent epilogue GEMMs (panels.EPI_FORMS): one flattened loop over tiles x D steps
        # whose bound the TTGIR walk cannot read, and what they change (pipeline latency) is not modelled
        raise NotImplementedError(f"{launch.name}: the model does not price the persistent tile loop "
                                  "(FUSED_CONTRASTIVE_EPI_FORM=tiles); time it with bench/gpu_profile.py --epi-forms")
    info = compile_info(launch, gpu.cc)
    a, c = launch.args, launch.constexprs
    grid = math.prod(launch.grid)
    n, d = a.get("N", 0), a.get("D", 0)
    m = a.get("M", n)
    # loop trip counts from the launch's integer arguments (N, M, D, grad_cols, P, ...); the forward's
    # row-block loop runs from pid to n_row_blocks in steps of P = grid: n_rb % P programs make
    # ceil(n_rb / P) iterations, the others floor(n_rb / P)
    trips = {k: v for k, v in a.items() if isinstance(v, int) and not isinstance(v, bool)}
    if launch.name.startswith("mat_"):
        trips.update(matryoshka_trips(MATRYOSHKA_DIMS[tuple(a["DIMS"].shape)], c["BLOCK_D"]))
    if launch.name.startswith(("epi_gemm", "guided_epi")):
        # the redo's walk over the column tiles (epi_gemm_redo, guided_epi_redo: tl.cdiv(M, BLOCK_N))
        trips["__n_pn__"] = math.ceil(m / c["BLOCK_N"])
    if launch.name == "theta_guided":
        # kernels/guided.py guided_theta_kernel: each row tile visits the column tiles from its smallest to
        # its largest target (a runtime bound); GIST's targets are arange (row i's positive is column i),
        # so a row tile of BLOCK_M rows spans these column tiles of BLOCK_N, on average over the row tiles
        bm, bn = c["BLOCK_M"], c["BLOCK_N"]
        spans = [(min(n, r + bm) - 1) // bn - r // bn + 1 for r in range(0, n, bm)]
        trips["__segment_walk__"] = sum(spans) / len(spans)
    if launch.name.startswith("maxsim_"):
        # loops with computed bounds: the forward's walk over its split's documents (from j_lo to j_hi),
        # the document kernel's walk over all N * Lq query-token rows (from 0)
        # (these keys are iteration counts: the step is not applied to them). The forward's flat loop
        # (FWD_FLAT) runs from 0 over its split's (document, token chunk) pairs; dd's from 0 over the
        # N * Lq query-token rows in steps of ROWS
        if launch.name == "maxsim_fwd":
            per = a.get("docs_per_split", m)
            trips.update(__segment_walk__=per, __prefix_walk__=per * max(1, math.ceil(a["LD"] / c["BLOCK_T"])))
        else:
            trips.update(__prefix_walk__=math.ceil(n * a.get("LQ", 1) / c.get("ROWS", 1)))
    q, rem = divmod(a.get("n_row_blocks", grid), grid)

    def walk(if_weight: float) -> dict[str, float]:
        lo = _walk_cached(info["ttgir"], dict(trips, n_row_blocks=q), if_weight)
        hi = _walk_cached(info["ttgir"], dict(trips, n_row_blocks=q + 1), if_weight) if rem else lo
        return {k: rem * hi[k] + (grid - rem) * lo[k] for k in lo}

    # the one-pass panel kernel's two-pass fallback (a row block whose logits all sit far below the
    # bound; never for |s| + bias <= 50) is not taken in the central figure, always in the worst-data one
    # (likewise the epilogue GEMM's redo launch: its row tiles without a redone row return at once)
    # (and the guided panel route's redo, core/guided/triton_panel.py: the same MODE 2 of guided_epi_kernel)
    redo = launch.name in ("epi_gemm_redo", "guided_epi_redo")
    one_pass = (launch.name == "panel_dl" and bool(c.get("ONE_PASS"))) or redo
    tot = walk(0.0 if one_pass else 1.0)
    tot_p = walk(1.0) if one_pass else tot
    if launch.name == "lse_fwd" and c.get("TRI"):
        # the triangular forward: the walk counts every column block of every row block (its column
        # loop starts at the row block's diagonal, a runtime bound); the triangle's share of the tiles
        bm, bn = c["BLOCK_M"], c["BLOCK_N"]
        n_cb = math.ceil(m / bn)
        tiles = sum(max(0, n_cb - (r * bm) // bn) for r in range(math.ceil(n / bm)))
        frac = tiles / (a["n_row_blocks"] * n_cb)
        tot = {k: v * frac for k, v in tot.items()}
        tot_p = {k: v * frac for k, v in tot_p.items()}
    ctas = ctas_per_sm(info["regs"], launch.num_warps, info["shared"], gpu)
    slots = max(1, ctas) * gpu.sms
    tail = wave_spread(grid, slots, gpu.sms)
    clk = gpu.clock_ghz * 1e9
    operand = next((v for k, v in a.items() if k in ("SA", "X", "DL", "Q", "DOC", "GA")), a.get("L", a.get("A")))
    if operand is None:  # the row kernels without a matmul (their element size sets no tensor-core peak)
        operand = next(v for v in a.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    es = operand.element_size()
    # HBM: every tensor argument once (inputs read, outputs written), the streamed operand per wave
    hbm = float(sum(_nbytes(v) for v in a.values() if isinstance(v, torch.Tensor) and v.numel() > 1))
    if launch.name == "target_rows" and c["ACC"]:
        hbm += _nbytes(a["DA"])  # the gradient it adds to is read, then written
    if launch.name == "stats_merge" and c["ACC"]:
        hbm += _nbytes(a["OUT"])  # the statistics so far are read, then written
    if launch.name == "guided_acc":
        # C is read at the P target rows only (none without HAS_T); the accumulator is read, then written
        c_rows = a["P"] * a["D"] * a["C"].element_size() if c["HAS_T"] else 0
        hbm += c_rows - _nbytes(a["C"]) + _nbytes(a["ACC"])
    l2_b = gpu.l2_mb * 1e6
    hbm_pess = hbm
    ws = 0.0
    if launch.name in ("lse_fwd", "lse_bwd_rows", "lse_bwd_cols", "mat_fwd", "mat_bwd_rows", "mat_bwd_cols"):
        cols_kernel = launch.name.endswith("bwd_cols")
        streamed = m if not cols_kernel else n  # rows of the operand every program sweeps
        hbm += max(0.0, math.ceil(grid / slots) - 1) * streamed * d * es
        hbm_pess = hbm
        if not launch.name.endswith("fwd") and not c.get("RESIDENT", False) and c.get("NEED_DX", True):
            bo = c["BLOCK_N"] if cols_kernel else c["BLOCK_M"]
            bi = c["BLOCK_M"] if cols_kernel else c["BLOCK_N"]
            tiles = grid * math.ceil(streamed / bi)
            reuse = tiles * (2 * bo * d * 4 + bo * d * es)  # scratch read + write, own rows reloaded
            ws = min(grid, slots) * (bo * d * 4 + bo * d * es)
            hit = min(1.0, l2_b / ws) if ws else 1.0
            hbm += (1.0 - hit) * reuse
            hbm_pess += reuse if ws > l2_b else 0.0
    if redo:
        # the redo's programs read their BAD flags and return (central); the worst data redoes every row
        hbm = float(_nbytes(a["BAD"]))
    l2 = tot["gload"] + tot["gstore"]
    l2_p = tot_p["gload"] + tot_p["gstore"]
    if launch.name == "panel_dl" and _nbytes(a["L"]) > l2_b:
        # the [P, M] panel does not fit the L2: every pass over it is HBM; the O(M) column vectors
        # (inverse norms, column statistics, labels) each program re-reads stay in the L2
        hbm = max(hbm, l2 - tot["gload_vec"])
        hbm_pess = max(hbm_pess, l2_p - tot_p["gload_vec"])
    peak = gpu.bf16_tflops * 1e12 if es == 2 else gpu.tf32_tflops * 1e12 / 3  # tf32x3: 3 MMAs per product
    t = dict(tc=tot["flops"] / peak, smem=tot["smem"] / (SMEM_BYTES_PER_CLK * gpu.sms * clk),
             l2=l2 / (l2_tbs(gpu) * 1e12), hbm=hbm / (hbm_tbs(gpu, launch.num_stages > 1) * 1e12))
    bound = max(t, key=t.get)
    lanes = ALU_LANES[90 if gpu.cc >= 90 else 80] * gpu.sms * clk

    def softmax(w: dict[str, float]) -> tuple[float, float]:
        mufu_s = (w["exp"] + w["log"]) / (MUFU_PER_CLK * gpu.sms * clk)
        return mufu_s, max(mufu_s, (w["alu"] + w["exp"] + w["log"]) / lanes)

    mufu, soft = softmax(tot)
    exposed = soft / max(1, ctas)
    sec = (max(t.values()) + exposed) * tail + LAUNCH_US * 1e-6
    exposed_p = softmax(tot_p)[1] / max(1, ctas)
    sec_pess = (max(t["tc"], t["smem"], l2_p / (l2_tbs(gpu) * 1e12),
                    hbm_pess / (hbm_tbs(gpu, launch.num_stages > 1) * 1e12)) + exposed_p) \
        * tail + LAUNCH_US * 1e-6
    return dict(kernel=launch.name, grid=grid, block=info["block"], warps=launch.num_warps,
                stages=launch.num_stages, regs=info["regs"], spills=info["spill_stores"] + info["spill_loads"],
                shared=info["shared"], ctas_sm=ctas, tc=info["tc"], flops=tot["flops"], l2_bytes=l2,
                hbm_bytes=hbm, hbm_bytes_pess=hbm_pess, smem_bytes=tot["smem"], exps=tot["exp"] + tot["log"],
                working_set=ws, t_tc=t["tc"], t_smem=t["smem"], t_l2=t["l2"], t_hbm=t["hbm"], t_mufu=mufu,
                alu=tot["alu"], t_softmax=soft,
                bound=bound if launch.name != "row_norm" else "hbm", ms=sec * 1e3, ms_pess=sec_pess * 1e3)


# ------------------------------------------------------------------------------------------------
# ATen-level paths: the naive formula and the torch backend, counted on the meta device
# ------------------------------------------------------------------------------------------------

_FREE = {"aten.view", "aten._unsafe_view", "aten.expand", "aten.t", "aten.detach", "aten.alias", "aten.slice",
         "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.as_strided", "aten.transpose", "aten.permute",
         "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.lift_fresh", "aten.reshape", "aten.diagonal",
         "aten.unbind", "aten.split", "aten.chunk", "aten._to_copy" + "_never"}


class OpCounter(TorchDispatchMode):
    """Every ATen op: (name, bytes in + out, GEMM (m, n, k, dtype, accumulates) or None), and the peak
    of live bytes of the tensors created inside the mode (storages tracked until collected)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, tuple | None]] = []
        self.live: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0
        self.in_norms = 0  # > 0 inside core/norms.py's clamped_norms (see norms_tagged)

    def _track(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key not in self.live:
            self.live[key] = t.untyped_storage().nbytes()
            self.refs[key] = 0
            self.now += self.live[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.live.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        for o in outs:
            self._track(o)
        if name in _FREE:
            return out
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        gemm = None
        if name in ("aten.mm", "aten.addmm", "aten.addmm_"):  # addmm_: the chunked path's dB, the segments
            x, y = (args[0], args[1]) if name == "aten.mm" else (args[1], args[2])
            gemm = (x.shape[0], y.shape[1], x.shape[1], x.dtype, name != "aten.mm", outs[0].element_size())
        if name == "aten.index_put_":  # writes only the indexed elements: the values and the indices move
            moved = 2 * _nbytes(args[2]) + sum(_nbytes(t) for t in args[1] if isinstance(t, torch.Tensor))
        elif name.endswith("_") or "out" in (kwargs or {}):  # in place: the output is one of the inputs
            moved = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        else:
            moved = sum(_nbytes(t) for t in ins + outs)
        self.ops.append((name, moved, gemm, self.in_norms > 0))
        return out


def _meta(shape, dtype=torch.bfloat16, grad=True):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def matryoshka_dims(d: int) -> list[int]:
    """The Matryoshka levels of the model: 768/512/256/128/64 at D = 768 (D, 2D/3, D/3, D/6, D/12)."""
    return sorted({d, 2 * d // 3, d // 3, d // 6, d // 12} - {0}, reverse=True)


#: The level boundaries of the recorded Matryoshka launches, by the shape of their DIMS tensor ([K + 1];
#: the model records one level set at a time): the D walks' trip counts come from them.
MATRYOSHKA_DIMS: dict[tuple[int, ...], list[int]] = {}


def matryoshka_trips(dims: list[int], block_d: int) -> dict[str, float]:
    """Mean trip counts of the Matryoshka kernels' D walks over the K levels (``walk_ttgir``): a walk from 0
    over level k's prefix [0, d_k), and a walk over its segment [d_{k-1}, d_k) whose first chunk starts at
    the D chunk holding d_{k-1} (a straddled chunk is read once per segment)."""
    bounds = sorted(dims)
    lo = [0] + bounds[:-1]
    prefix = [math.ceil(hi / block_d) for hi in bounds]
    segment = [math.ceil((hi - (a // block_d) * block_d) / block_d) for a, hi in zip(lo, bounds, strict=True)]
    return {"__prefix_walk__": sum(prefix) / len(bounds), "__segment_walk__": sum(segment) / len(bounds)}


def run_matryoshka_triton(n: int, d: int, gpu: GPU) -> tuple[list[TL.Launch], list]:
    """The launches (recorded) and ATen ops of InfoNCE at the levels ``matryoshka_dims(d)`` on the
    Matryoshka kernels (``core/matryoshka/triton_levels.py``), forward + backward, bf16 embeddings, as
    :func:`run_triton` records the plain core op (its O(N D) linear target term left out likewise)."""
    from fused_contrastive.core.matryoshka import triton_levels as TM

    a, b, scale, spec, data, coef, reduce = compile_survey.core_call("info_nce", n, d, torch.bfloat16)
    coef = dataclasses.replace(coef, tgt=None, set=None)
    dims = sorted(matryoshka_dims(d))
    MATRYOSHKA_DIMS[(len(dims) + 1,)] = dims
    with compile_survey.recording(gpu.arch) as launches, OpCounter() as ops, norms_tagged(ops):
        out = TM.TritonLevelsFn.apply(a, b, scale, spec, data, coef, reduce, tuple(dims)).sum()
        torch.autograd.grad(out, [x for x in (a, b) if x is not None and x.requires_grad])
        del out
    return list(launches), ops.ops


def naive_formula(loss: str, n: int, d: int):
    """Forward + backward of the textbook formula with bf16 embeddings (fp32 cross-entropy)."""
    if loss == "info_nce_matryoshka":  # the K-loss formula: one dense logits matrix per level
        a, b = _meta((n, d)), _meta((n, d))
        tgt = torch.arange(n, device="meta")
        out = sum(F.cross_entropy((F.normalize(a[:, :k], dim=1) @ F.normalize(b[:, :k], dim=1).T).float() * 20.0, tgt)
                  for k in matryoshka_dims(d))
        return out, (a, b)
    if loss == "simcse":
        z = _meta((n, d))
        zn = F.normalize(z, dim=1)
        logits = (zn @ zn.T).float() * 20.0
        eye = torch.eye(n, dtype=torch.bool, device="meta")
        logits = logits.masked_fill(eye, float("-inf"))
        idx = torch.arange(n, device="meta")
        out = F.cross_entropy(logits, idx + 1 - idx % 2 * 2)
        return out, (z,)
    a, b = _meta((n, d)), _meta((n, d))
    logits = (F.normalize(a, dim=1) @ F.normalize(b, dim=1).T).float() * 20.0
    tgt = torch.arange(n, device="meta")
    if loss == "clip":
        out = (F.cross_entropy(logits, tgt) + F.cross_entropy(logits.T, tgt)) / 2
    else:
        out = F.cross_entropy(logits, tgt)
    return out, (a, b)


def torch_backend(loss: str, n: int, d: int):
    """Forward + backward of ``loss`` on ``backend="torch"`` with bf16 [n, d] embeddings (the options
    of the registry's benchmark case)."""
    from fused_contrastive import losses as L

    if loss == "simcse":
        z = _meta((n, d))
        return L.simcse_loss(z, temperature=0.05, backend="torch"), (z,)
    a, b = _meta((n, d)), _meta((n, d))
    if loss == "clip":
        return L.clip_loss(a, b, logit_scale=1 / 0.07, backend="torch"), (a, b)
    if loss == "info_nce_matryoshka":  # every level in one pass over D (core/matryoshka/torch_levels.py)
        return L.info_nce(a, b, temperature=0.05, backend="torch", matryoshka_dims=matryoshka_dims(d)), (a, b)
    return L.info_nce(a, b, temperature=0.05, backend="torch"), (a, b)


@functools.cache
def count_ops(path: str, loss: str, n: int, d: int) -> tuple[list, int]:
    with OpCounter() as c, norms_tagged(c):
        out, leaves = (naive_formula if path == "naive" else torch_backend)(loss, n, d)
        torch.autograd.grad(out, leaves)
        del out
    return c.ops, c.peak


def gemm_efficiency(m: int, nn: int, k: int, gpu: GPU) -> float:
    """Fraction of the dtype's peak a cuBLAS GEMM [m, k] @ [k, nn] reaches in the current scenario: the
    large-GEMM efficiency, its spread, the short-K factor (normalised to K = 8192), split-K when the
    output has fewer 128 x 256 tiles than 2 x SMs, and the quantisation of a dimension under 64."""
    k0 = assumed("gemm_k0")
    eff = gpu.cublas_eff * assumed("cublas_spread") * (k / (k + k0)) / (8192 / (8192 + k0))
    if math.ceil(m / 128) * math.ceil(nn / 256) < 2 * gpu.sms:
        eff *= assumed("splitk")
    return min(1.0, eff) * min(1.0, m / GEMM_TILE) * min(1.0, nn / GEMM_TILE)


def gemm_seconds(m: int, nn: int, k: int, dtype, acc: bool, out_es: int, gpu: GPU, tf32: bool = False) -> float:
    if dtype in (torch.bfloat16, torch.float16):
        peak = gpu.bf16_tflops
    elif dtype == torch.float32:
        peak = gpu.tf32_tflops if tf32 else gpu.fp32_tflops
    else:
        peak = gpu.fp32_tflops / 2  # float64 (not used by these paths)
    eff = gemm_efficiency(m, nn, k, gpu)
    es = torch.empty((), dtype=dtype).element_size()
    moved = (m * k + k * nn) * es + m * nn * (2 if acc else 1) * out_es
    return max(2 * m * nn * k / (peak * 1e12 * eff), moved / (hbm_tbs(gpu) * 1e12))


def aten_model(ops: list, gpu: GPU, tf32: bool = False) -> dict:
    gemm_s = other_s = 0.0
    flops = other_bytes = 0
    for _name, moved, gemm, _ in ops:
        if gemm is not None:
            m, nn, k, dt, acc, out_es = gemm
            gemm_s += gemm_seconds(m, nn, k, dt, acc, out_es, gpu, tf32)
            flops += 2 * m * nn * k
        else:
            bw = l2_tbs(gpu) if moved <= gpu.l2_mb * 1e6 / 2 else hbm_tbs(gpu)
            other_s += moved / (bw * 1e12)
            other_bytes += moved
    launches = len(ops)
    total = gemm_s + other_s + launches * LAUNCH_US * 1e-6
    return dict(ms=total * 1e3, gemm_ms=gemm_s * 1e3, other_ms=other_s * 1e3, launches=launches,
                launch_ms=launches * LAUNCH_US * 1e-3, gemm_flops=flops, other_bytes=other_bytes)


def norm_launches(ops: list) -> int:
    """Launches issued inside ``core/norms.py``'s ``clamped_norms`` (its float64 route on CUDA: four ops
    per block of 2^18 elements)."""
    return sum(1 for op in ops if op[3])


@contextlib.contextmanager
def norms_tagged(counter: OpCounter):
    """Within the block, the ops ``clamped_norms`` issues are tagged in ``counter`` (the function is
    wrapped in every module that imported it)."""
    import sys as _sys

    from fused_contrastive.core import norms

    orig = norms.clamped_norms

    def wrapped(*args, **kwargs):
        counter.in_norms += 1
        try:
            return orig(*args, **kwargs)
        finally:
            counter.in_norms -= 1

    mods = [m for m in list(_sys.modules.values())
            if getattr(m, "__name__", "").startswith("fused_contrastive") and getattr(m, "clamped_norms", None) is orig]
    for m in mods:
        m.clamped_norms = wrapped
    try:
        yield
    finally:
        for m in mods:
            m.clamped_norms = orig


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------

#: An outside reading of the compiled panel path (November 2026, no GPU used: an ESTIMATE, not a
#: measurement): H100 SXM, bf16, N = M = 65536, D = 768, fwd + bwd, ms as (central, low, high).
OUTSIDE_ESTIMATE = {"info_nce": (44.5, 39.0, 50.0), "simcse": (31.0, 27.0, 35.0), "clip": (60.0, 53.0, 68.0)}
#: The same reading's estimate of the epilogue-GEMM design (the logits GEMM forms the 16-bit tile, cuBLAS
#: dA / dB; for CLIP a statistics forward first), ms (central): the design the panel path now takes.
OUTSIDE_ESTIMATE_EPILOGUE = {"info_nce": 32.0, "simcse": 23.0, "clip": 43.0}
#: The project's goals for the same problem (ms, on the central model).
GOALS = {"info_nce": 34.0, "simcse": 25.0, "clip": 45.0}


def _fmt_b(x: float) -> str:
    for u, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= f:
            return f"{x / f:.1f} {u}"
    return f"{x:.0f} B"


def triton_path(loss: str, n: int, d: int, gpu: GPU, path: str) -> dict:
    """The triton backend on ``path``: its Triton launches (each modelled by :func:`kernel_model`) plus
    the ATen ops around them (GEMMs and elementwise work, :func:`aten_model`)."""
    launches, ops = _recorded(loss, n, d, gpu.name, path)
    kernels = [kernel_model(lz, gpu) for lz in launches]
    aten = aten_model(ops, gpu)
    ms = sum(k["ms"] for k in kernels) + aten["ms"]
    ms_pess = sum(k["ms_pess"] for k in kernels) + aten["ms"]
    return dict(kernels=kernels, grouped=_group(kernels), aten=aten, ms=ms, ms_pess=ms_pess, ops=ops)


def _group(kernels: list[dict]) -> list[dict]:
    """Launches of the same kernel and config summed (the panel path launches its kernel per panel)."""
    out: dict[tuple, dict] = {}
    for k in kernels:
        key = (k["kernel"], k["block"], k["regs"])
        g = out.setdefault(key, dict(k, launches=0, ms=0.0, ms_pess=0.0, flops=0.0, l2_bytes=0.0, hbm_bytes=0.0,
                                     smem_bytes=0.0, grid=0, exps=0.0, alu=0.0, t_mufu=0.0, t_softmax=0.0))
        g["launches"] += 1
        for f in ("ms", "ms_pess", "flops", "l2_bytes", "hbm_bytes", "smem_bytes", "grid", "exps", "alu", "t_mufu",
                  "t_softmax"):
            g[f] += k[f]
    return list(out.values())


def _kernel_json(k: dict) -> dict:
    return dict(kernel=k["kernel"], launches=k["launches"], ms=round(k["ms"], 4), flops=k["flops"],
                l2_bytes=k["l2_bytes"], hbm_bytes=k["hbm_bytes"], bound=k["bound"], regs=k["regs"],
                ctas_sm=k["ctas_sm"], block=k["block"], grid=k["grid"], exps=k["exps"], alu=k["alu"],
                mufu_ms=round(k["t_mufu"] * 1e3, 4), softmax_ms=round(k["t_softmax"] * 1e3, 4))


@functools.cache
def _recorded(loss: str, n: int, d: int, gpu_name: str, path: str) -> tuple[list[TL.Launch], list]:
    """:func:`run_triton` once per problem (the scenarios reuse its launches and ATen ops)."""
    return run_triton(loss, n, d, GPUS[gpu_name], path)


_RANGED = ("ms", "fused_ms", "panel_ms", "panel_cublas_ms", "panel_epilogue_ms", "naive_ms_if_memory", "torch_ms")
#: Relative band within which the model calls the panel path's two forms even ("either"): its own
#: resolution between two routes that share most of their work (cuBLAS dA / dB GEMMs).
PANEL_FORM_BAND = 0.05


def model_loss(loss: str, n: int, d: int, gpu: GPU, with_torch: bool = True) -> dict:
    """The model of ``loss`` at its central assumptions, each time in ``_RANGED`` with its range
    (``<key>_range``: [optimistic, pessimistic], every assumption of :data:`ASSUMED` at that end)."""
    ends = {}
    for scn in ("optimistic", "pessimistic"):
        with scenario(scn):
            ends[scn] = _model_loss(loss, n, d, gpu, with_torch)["rec"]
    with scenario("central"):
        res = _model_loss(loss, n, d, gpu, with_torch)
    for key in _RANGED:
        if res["rec"][key] is not None:
            res["rec"][f"{key}_range"] = [ends["optimistic"][key], ends["pessimistic"][key]]
    return res


def _model_loss(loss: str, n: int, d: int, gpu: GPU, with_torch: bool = True) -> dict:
    fused = triton_path(loss, n, d, gpu, "fused")
    panel = triton_path(loss, n, d, gpu, "panel")
    cublas = triton_path(loss, n, d, gpu, "panel-cublas")
    epilogue = triton_path(loss, n, d, gpu, "panel-epilogue")
    taken = "epilogue" if any(k["kernel"].startswith("epi_gemm") for k in panel["kernels"]) else "cublas"
    # the model's preference, "either" within its 5 % band (PANEL_FORM_BAND)
    prefer = ("epilogue" if epilogue["ms"] * (1 + PANEL_FORM_BAND) < cublas["ms"] else
              "cublas" if cublas["ms"] * (1 + PANEL_FORM_BAND) < epilogue["ms"] else "either")
    # what backend="triton" runs on a CUDA device ("auto" path of panels.use_panel)
    default = "panel" if n * n >= panels.MIN_ELEMENTS else "fused"
    cur = panel if default == "panel" else fused
    unit = 2 * n * n * d
    floor_ms = FLOOR_UNITS[loss] * unit / (gpu.bf16_tflops * 1e12) * 1e3
    nops, npeak = count_ops("naive", loss, n, d)
    naive = aten_model(nops, gpu)
    inputs = (1 if loss == "simcse" else 2) * n * d * 2
    fits = npeak + inputs <= gpu.mem_gb * 1e9
    tops = count_ops("torch", loss, n, d)[0] if with_torch else []
    tb = aten_model(tops, gpu) if with_torch else dict(ms=math.inf, gemm_ms=math.inf, other_ms=math.inf, launches=0,
                                                        launch_ms=0.0)
    tb32 = aten_model(tops, gpu, tf32=True) if with_torch else tb
    r3 = functools.partial(round, ndigits=3)
    rec = dict(loss=loss, gpu=gpu.name, n=n, d=d, dtype="bf16", path=default, ms=r3(cur["ms"]),
               ms_worst_data=r3(cur["ms_pess"]), pct_peak=round(100 * floor_ms / cur["ms"], 2),
               floor_ms=round(floor_ms, 4), floor_units=FLOOR_UNITS[loss], peak_tflops=gpu.bf16_tflops,
               fused_ms=r3(fused["ms"]), fused_ms_worst_data=r3(fused["ms_pess"]),
               fused_pct_peak=round(100 * floor_ms / fused["ms"], 2),
               panel_ms=r3(panel["ms"]), panel_ms_worst_data=r3(panel["ms_pess"]),
               panel_pct_peak=round(100 * floor_ms / panel["ms"], 2),
               panel_gemm_ms=r3(panel["aten"]["gemm_ms"]), panel_gemm_flops=panel["aten"]["gemm_flops"],
               panel_launches=panel["aten"]["launches"] + len(panel["kernels"]),
               panel_norm_launches=norm_launches(panel["ops"]),
               panel_cublas_ms=r3(cublas["ms"]), panel_cublas_gemm_ms=r3(cublas["aten"]["gemm_ms"]),
               panel_cublas_kernels=[_kernel_json(k) for k in cublas["grouped"]],
               panel_epilogue_ms=r3(epilogue["ms"]),
               # the panel form the model prefers, and the one panels.use_epilogue takes (they must agree
               # outside the band: tests/test_gpu_model.py)
               panel_form_should_prefer=prefer, panel_form_taken=taken,
               naive_ms=r3(naive["ms"]) if fits else None, naive_fits=fits,
               naive_ms_if_memory=r3(naive["ms"]), naive_peak_bytes=npeak + inputs,
               naive_logits_bytes=n * n * 4, naive_launches=naive["launches"],
               naive_gemm_ms=round(naive["gemm_ms"], 4), naive_gemm_flops=naive["gemm_flops"],
               torch_ms=r3(tb["ms"]) if with_torch else None, torch_tf32_ms=r3(tb32["ms"]) if with_torch else None,
               torch_launches=tb["launches"], torch_norm_launches=norm_launches(tops),
               torch_gemm_ms=r3(tb["gemm_ms"]) if with_torch else None,
               kernels=[_kernel_json(k) for k in cur["grouped"]], aten_ms=round(cur["aten"]["ms"], 4),
               aten_launches=cur["aten"]["launches"],
               fused_kernels=[_kernel_json(k) for k in fused["grouped"]],
               model="MODEL, not a measurement")
    paths = {"triton/fused": fused["ms"], "triton/panel": panel["ms"]}
    if with_torch:
        paths["torch"] = tb["ms"]
    rec["triton_path_should_prefer"] = min(("fused", "panel"), key=lambda p: (fused if p == "fused" else panel)["ms"])
    rec["auto_should_prefer"] = min(paths, key=paths.get)
    return dict(rec=rec, fused=fused, panel=panel, cublas=cublas, naive=naive, torch=tb, torch_tf32=tb32,
                naive_peak=npeak + inputs)


def _print_kernels(title: str, res: dict, gpu: GPU) -> None:
    print(f"  {title}")
    print(f"    {'kernel':14s} {'launch':>6s} {'grid':>6s} {'blocks':13s} {'regs':>4s} {'smem':>6s} {'CTA/SM':>6s} "
          f"{'TFLOP':>7s} {'L2->SM':>9s} {'HBM':>9s} {'shared':>9s} {'FLOP/B L2':>9s} {'bound':6s} {'%peak':>6s} "
          f"{'ms':>8s}")
    for k in res["grouped"]:
        fpb = k["flops"] / k["l2_bytes"] if k["l2_bytes"] else 0
        pct = 100 * k["flops"] / (gpu.bf16_tflops * 1e12) / (k["ms"] * 1e-3) if k["flops"] else 0
        print(f"    {k['kernel']:14s} {k['launches']:6d} {k['grid']:6d} {k['block']:13s} {k['regs']:4d} "
              f"{k['shared']:6d} {k['ctas_sm']:6d} {k['flops'] / 1e12:7.2f} {_fmt_b(k['l2_bytes']):>9s} "
              f"{_fmt_b(k['hbm_bytes']):>9s} {_fmt_b(k['smem_bytes']):>9s} {fpb:9.1f} {k['bound']:6s} {pct:6.1f} "
              f"{k['ms']:8.2f}")
        if k["working_set"]:
            print(f"    {'':14s} streaming re-read working set {_fmt_b(k['working_set'])} per wave vs L2 "
                  f"{gpu.l2_mb:g} MB; worst data (0 % hits) {k['ms_pess']:.2f} ms")
    at = res["aten"]
    print(f"    {'ATen ops':14s} {at['launches']:6d} launches: GEMMs {at['gemm_flops'] / 1e12:.2f} TFLOP in "
          f"{at['gemm_ms']:.2f} ms, other {_fmt_b(at['other_bytes'])} in {at['other_ms']:.2f} ms, launches "
          f"{at['launch_ms']:.2f} ms")
    print(f"    total {res['ms']:.2f} ms (worst data {res['ms_pess']:.2f})")


def print_report(results: list[dict], d: int, compare: bool) -> None:
    print("=" * 100)
    print(f"MODEL - not a measurement. Predicted GPU times of the core-op losses, bf16, D = {d}, forward + "
          "backward with gradients to every embedding. No GPU was used.")
    print("=" * 100)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    print(f"triton {__import__('triton').__version__}, torch {torch.__version__}, kernels and host code at "
          f"commit {rev} (fused kernels: kernels/lse.py; panel path: core/lse/triton_panel.py + kernels/panel.py)\n")
    print("Assumptions:")
    for a in ASSUMPTIONS:
        print(f"  - {a}")
    print("Assumed values (optimistic / central / pessimistic; the ranges below run all of them at one end):")
    for a in ASSUMED.values():
        print(f"  - {a.name} = {a.optimistic:g} / {a.central:g} / {a.pessimistic:g}: {a.meaning}.\n"
              f"      source: {a.source}")
    print("GPUs:")
    for g in dict.fromkeys(r["rec"]["gpu"] for r in results):
        gp = GPUS[g]
        print(f"  - {g}: sm_{gp.cc}, {gp.sms} SMs, clock {gp.clock_ghz:.2f} GHz, bf16 {gp.bf16_tflops:g} / tf32 "
              f"{gp.tf32_tflops:g} / fp32 {gp.fp32_tflops:g} TFLOP/s, HBM {gp.hbm_tbs:g} TB/s {gp.mem_gb:g} GB, "
              f"L2 {gp.l2_mb:g} MB {gp.l2_tbs:g} TB/s, shared {gp.smem_sm_kb:g} KB/SM, cuBLAS eff {gp.cublas_eff:g}."
              f"\n      source: {gp.source}")
    print()
    for r in results:
        rec = r["rec"]
        gpu = GPUS[rec["gpu"]]
        print(f"--- MODEL {rec['loss']} on {rec['gpu']}, N = M = {rec['n']}, D = {d}; floor {rec['floor_ms']:.2f} ms "
              f"({rec['floor_units']:g} units at {rec['peak_tflops']:g} TFLOP/s)")
        _print_kernels(f"triton backend, fused kernels ({rec['fused_pct_peak']:.1f} % of peak):", r["fused"], gpu)
        _print_kernels(f"triton backend, panel path as taken ({rec['panel_pct_peak']:.1f} % of peak):", r["panel"],
                       gpu)
        print(f"  the panel path's forms: epilogue GEMM {rec['panel_epilogue_ms']:.2f} ms, cuBLAS (logits GEMM + panel "
              f"kernel) {rec['panel_cublas_ms']:.2f} ms; the model prefers {rec['panel_form_should_prefer']}, the "
              f"code takes {rec['panel_form_taken']}")
        nv = r["naive"]
        fit = "" if rec["naive_fits"] else f"  DOES NOT FIT ({_fmt_b(r['naive_peak'])} > {gpu.mem_gb:g} GB)"
        print(f"  naive formula {nv['ms']:.2f} ms (GEMMs {nv['gemm_ms']:.2f}, elementwise {nv['other_ms']:.2f}, "
              f"{nv['launches']} launches), peak live {_fmt_b(r['naive_peak'])}{fit}")
        tb = r["torch"]
        if tb["launches"]:
            print(f"  torch backend {tb['ms']:.2f} ms with fp32 GEMMs (TF32 allowed: {r['torch_tf32']['ms']:.2f}); "
                  f"GEMMs {tb['gemm_ms']:.2f}, elementwise {tb['other_ms']:.2f}, {tb['launches']} launches "
                  f"({tb['launch_ms']:.1f} ms), of which {rec['torch_norm_launches']} in the overflow-safe norms")
        print(f"  backend=\"triton\" runs the {rec['path']} path here; faster triton path: "
              f"{rec['triton_path_should_prefer']}; fastest of all: {rec['auto_should_prefer']}\n")
    print("--- MODEL summary (ms, central [optimistic - pessimistic]; % of peak = floor / central ms; triton = the "
          "path backend=\"triton\" takes on CUDA; worst data: the central assumptions with the one-pass fallback "
          "in every block and no L2 hits for the streaming re-reads)")
    print(f"  {'loss':9s} {'gpu':5s} {'N':>6s} {'floor':>7s} {'fused':>8s} {'panel':>8s} {'triton':>24s} {'%peak':>6s} "
          f"{'worst':>8s} {'naive':>8s} {'torch':>8s} {'tf32':>8s} {'fastest':13s}")
    for r in results:
        rec = r["rec"]
        nv = f"{rec['naive_ms']:.1f}" if rec["naive_fits"] else "no fit"
        lo, hi = rec["ms_range"]
        tri = f"{rec['ms']:.2f} [{lo:.2f} - {hi:.2f}]"
        print(f"  {rec['loss']:9s} {rec['gpu']:5s} {rec['n']:6d} {rec['floor_ms']:7.2f} {rec['fused_ms']:8.2f} "
              f"{rec['panel_ms']:8.2f} {tri:>24s} {rec['pct_peak']:6.1f} {rec['ms_worst_data']:8.2f} {nv:>8s} "
              f"{r['torch']['ms']:8.1f} {r['torch_tf32']['ms']:8.1f} {rec['auto_should_prefer']:13s}")
    prefs: dict[str, set] = {}
    for r in results:
        prefs.setdefault(r["rec"]["gpu"], set()).add(r["rec"]["triton_path_should_prefer"])
    for g, p in prefs.items():
        print(f"  {g}: the model prefers the {'/'.join(sorted(p))} path of the triton backend for these problems")
    if compare:
        print("\n--- this MODEL next to an outside reading's ESTIMATE of the panel path (H100, N = M = 65536, D = 768, "
              "bf16, fwd+bwd; ms, central [range]; neither is a measurement) and the project's goals")
        for r in results:
            rec = r["rec"]
            est = OUTSIDE_ESTIMATE.get(rec["loss"])
            if rec["gpu"] != "H100" or rec["n"] != 65536 or est is None:
                continue
            lo, hi = rec["ms_range"]
            goal = GOALS[rec["loss"]]
            print(f"  {rec['loss']:9s} model {rec['ms']:6.1f} [{lo:.1f} - {hi:.1f}] (cuBLAS form "
                  f"{rec['panel_cublas_ms']:.1f})   outside estimate: cuBLAS form {est[0]:.1f} [{est[1]:.0f} - "
                  f"{est[2]:.0f}], epilogue design {OUTSIDE_ESTIMATE_EPILOGUE[rec['loss']]:.0f}   goal <= {goal:g}: "
                  f"{'met' if rec['ms'] <= goal else 'NOT met'} on the central model")
    print()


def matryoshka_report(sizes: list[int], d: int, gpus: list[str]) -> list[dict]:
    """MODEL of Matryoshka InfoNCE (``matryoshka_dims(d)``) on a GPU: the Matryoshka kernels (what
    ``backend="auto"`` runs on CUDA; ``kernels/matryoshka.py``, modelled from their compile like the core
    op's fused kernels) next to the plain loss on the fused kernels, the torch backend's one-pass path next
    to the plain loss on that path (ATen ops), and the K-loss formula."""
    dims = "/".join(str(k) for k in matryoshka_dims(d))
    print(f"--- MODEL Matryoshka InfoNCE, dims {dims}, D = {d}, bf16 inputs, fwd + bwd: the Matryoshka kernels "
          "against the plain loss on the fused kernels (the triton backend), the torch backend's one-pass path "
          "against the plain loss on that backend, and the K-loss formula (ms, central [optimistic - pessimistic]; "
          "no GPU used)")
    print("  triton: 'plain' the plain loss on the triton backend's path for the size ('path': fused kernels, or "
          "the panel path where N * M >= 2^24), 'kernels' the Matryoshka kernels (their forward, and the backward "
          "auto takes: the suffix backward for 16-bit inputs from N * M = 2^20, "
          "core/matryoshka/triton_levels.py), 'K calls' "
          "one plain call per level on that path; 'ratio' what the backend runs (K calls on the panel path, the "
          "kernels otherwise) / plain")
    print(f"  {'gpu':5s} {'N':>6s} {'path':>5s} {'plain triton':>22s} {'Matryoshka kernels':>22s} "
          f"{'K triton calls':>22s} {'ratio':>6s} {'plain torch':>22s} {'one-pass torch':>22s} {'ratio':>6s} "
          f"{'K-loss formula':>22s} {'formula peak':>12s}")
    recs = []
    for g in gpus:
        gpu = GPUS[g]
        for n in sizes:
            got = {}
            for key, path, loss in (("plain", "torch", "info_nce"), ("one_pass", "torch", "info_nce_matryoshka"),
                                    ("formula", "naive", "info_nce_matryoshka")):
                ops, peak = count_ops(path, loss, n, d)
                ends = {}
                for sc in SCENARIOS:
                    with scenario(sc):
                        ends[sc] = aten_model(ops, gpu)
                got[key] = (ends["central"]["ms"], ends["optimistic"]["ms"], ends["pessimistic"]["ms"],
                            peak + 2 * n * d * 2, ends["central"]["gemm_flops"], ends["central"]["launches"])
            fits = got["formula"][3] <= gpu.mem_gb * 1e9
            # the triton backend's route: the panel path's K plain calls where the plain op takes it (CUDA,
            # N * M >= 2^24), the Matryoshka kernels otherwise (core._leveled)
            path = "panel" if n * n >= panels.MIN_ELEMENTS else "fused"
            levels = run_matryoshka_triton(n, d, gpu)  # the Matryoshka kernels with the backward "auto" takes
            suffix = any(lz.name == "mat_epi" for lz in levels[0])
            with mock.patch.dict(os.environ, {"FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE": "kernels" if suffix else "suffix"}):
                other = run_matryoshka_triton(n, d, gpu)  # and with the other backward, for comparison
            runs = [("plain", [_recorded("info_nce", n, d, g, path)]),
                    ("levels", [levels]),
                    ("calls", [_recorded("info_nce", n, dk, g, path) for dk in matryoshka_dims(d)]),
                    ("other", [other])]
            tri = {}
            for key, recs_ in runs:
                ends = {}
                for sc in SCENARIOS:
                    with scenario(sc):
                        ks = [kernel_model(lz, gpu) for launches, _ in recs_ for lz in launches]
                        ends[sc] = (sum(k["ms"] for k in ks) + sum(aten_model(ops, gpu)["ms"] for _, ops in recs_),
                                    sum(k["flops"] for k in ks),
                                    sorted({(k["kernel"], k["regs"], k["spills"]) for k in ks}))
                tri[key] = (ends["central"][0], ends["optimistic"][0], ends["pessimistic"][0], ends["central"][1],
                            ends["central"][2])
            route = "calls" if path == "panel" else "levels"
            # the K calls level by level (central): where the route's time goes
            by_level = [round(sum(kernel_model(lz, gpu)["ms"] for lz in launches) + aten_model(ops, gpu)["ms"], 3)
                        for launches, ops in runs[2][1]]

            def cell(v):
                return f"{v[0]:.1f} [{v[1]:.1f} - {v[2]:.1f}]"
            print(f"  {g:5s} {n:6d} {path:>5s} {cell(tri['plain']):>22s} {cell(tri['levels']):>22s} "
                  f"{cell(tri['calls']):>22s} {tri[route][0] / tri['plain'][0]:5.2f}x {cell(got['plain']):>22s} "
                  f"{cell(got['one_pass']):>22s} "
                  f"{got['one_pass'][0] / got['plain'][0]:5.2f}x {cell(got['formula']):>22s} "
                  f"{_fmt_b(got['formula'][3]):>12s}{'' if fits else ' DOES NOT FIT'}")
            print("         K calls by level (central ms): " + ", ".join(
                f"d={dk} {ms:.2f}" for dk, ms in zip(matryoshka_dims(d), by_level, strict=True)))
            names = ("the kernels' own backward", "the suffix backward")
            print(f"         Matryoshka kernels with {names[suffix]} (what auto takes for them): "
                  f"{cell(tri['levels'])}; with {names[not suffix]}: {cell(tri['other'])}")
            recs.append(dict(loss="info_nce_matryoshka", gpu=g, n=n, d=d, dims=matryoshka_dims(d),
                             plain_torch_ms=round(got["plain"][0], 3), one_pass_torch_ms=round(got["one_pass"][0], 3),
                             one_pass_range=[round(got["one_pass"][1], 3), round(got["one_pass"][2], 3)],
                             formula_ms=round(got["formula"][0], 3), formula_peak_bytes=got["formula"][3],
                             formula_fits=fits, plain_gemm_flops=got["plain"][4],
                             one_pass_gemm_flops=got["one_pass"][4], formula_gemm_flops=got["formula"][4],
                             one_pass_launches=got["one_pass"][5],
                             triton_path=path, triton_route=("one plain call per level" if route == "calls" else
                                                             "Matryoshka kernels" + (", suffix backward" if suffix
                                                                                     else "")),
                             suffix_backward=suffix,
                             other_backward_ms=round(tri["other"][0], 3),
                             other_backward_range=[round(tri["other"][1], 3), round(tri["other"][2], 3)],
                             k_calls_triton_ms=round(tri["calls"][0], 3), k_calls_by_level_ms=by_level,
                             k_calls_triton_range=[round(tri["calls"][1], 3), round(tri["calls"][2], 3)],
                             plain_triton_ms=round(tri["plain"][0], 3),
                             plain_triton_range=[round(tri["plain"][1], 3), round(tri["plain"][2], 3)],
                             triton_ms=round(tri["levels"][0], 3),
                             triton_range=[round(tri["levels"][1], 3), round(tri["levels"][2], 3)],
                             plain_triton_tc_flops=tri["plain"][3], triton_tc_flops=tri["levels"][3],
                             triton_kernels=[dict(kernel=k, regs=r, spills=sp) for k, r, sp in tri["levels"][4]],
                             model="MODEL, not a measurement"))
            # the same in the form of the other losses' records: "ms" the route backend="triton" takes (one
            # plain call per level on the panel path, the Matryoshka kernels on the fused path), the floor of
            # one plain loss (the levels' segment products sum to one product per GEMM: 3 units of 2 N^2 D
            # at the bf16 peak), "naive_ms" the K-loss formula (None where it does not fit)
            floor = 3 * 2 * n * n * d / (gpu.bf16_tflops * 1e12) * 1e3
            recs.append(dict(loss=f"matryoshka{len(matryoshka_dims(d))}", gpu=g, n=n, d=d, dims=matryoshka_dims(d),
                             route=recs[-1]["triton_route"], ms=round(tri[route][0], 3),
                             ms_range=[round(tri[route][1], 3), round(tri[route][2], 3)], floor_ms=round(floor, 4),
                             naive_ms=round(got["formula"][0], 3) if fits else None,
                             naive_ms_if_memory=round(got["formula"][0], 3), model="MODEL, not a measurement"))
    print()
    return recs


GIST_TEMPERATURE = 0.01


def gist_dims(d: int) -> int:
    """The guide model's dimension of the GIST model: D / 2 (384 for D = 768, as bench-gist)."""
    return max(16, d // 2)


def _gist_inputs(n: int, d: int, grad: bool = True):
    a, p, neg = (_meta((n, d), grad=grad) for _ in range(3))
    ga, gp, gn = (_meta((n, gist_dims(d)), grad=False) for _ in range(3))
    return a, p, neg, ga, gp, gn


def gist_textbook(n: int, d: int):
    """Forward + backward of the textbook GISTEmbed computation (bench-gist's "textbook"): four bf16
    model cosine GEMMs, four guide cosine GEMMs, the masks, one concatenated fp32 cross-entropy."""
    a, p, neg, ga, gp, gn = _gist_inputs(n, d)

    def cos(x, y):
        return F.normalize(x, dim=1) @ F.normalize(y, dim=1).T

    with torch.no_grad():
        g_ap = cos(ga, gp)
        theta = g_ap.diagonal().view(-1, 1)
        eye = torch.eye(n, dtype=torch.bool, device="meta")
        masks = [(g_ap > theta) & ~eye, cos(ga, ga) > theta, cos(gp, gp) > theta, cos(ga, gn) > theta]
    blocks = [cos(a, p), cos(a, a), cos(p, p), cos(a, neg)]
    scores = torch.cat([b.masked_fill(m, float("-inf")) for b, m in zip(blocks, masks, strict=True)], dim=1)
    out = F.cross_entropy(scores.float() / GIST_TEMPERATURE, torch.arange(n, device="meta"))
    return out, (a, p, neg)


def gist_torch(n: int, d: int):
    """Forward + backward of ``gist_loss(backend="torch")`` (the eager merged-block sweep)."""
    from fused_contrastive.losses.guided import gist_loss

    a, p, neg, ga, gp, gn = _gist_inputs(n, d)
    return gist_loss(a, p, neg, guide=(ga, gp, gn), temperature=GIST_TEMPERATURE, backend="torch"), (a, p, neg)


def run_gist_triton(n: int, d: int, gpu: GPU) -> tuple[list[TL.Launch], list]:
    """The launches (recorded) and ATen ops of ``gist_loss`` on backend="triton": one ``GuidedBlockFn``
    per block (anchor-positive with the protected target, anchor-anchor, positive-positive,
    anchor-negative), merged by log-sum-exp, forward + backward, bf16 model and guide embeddings."""
    from fused_contrastive.core.guided.triton_blocks import BlockMasks, GuidedBlockFn

    a, p, neg, ga, gp, gn = _gist_inputs(n, d)  # the guide's embeddings in bf16, as its forward under autocast
    theta = _meta((n,), torch.float32, grad=False)
    tgt = torch.empty(n, dtype=torch.int64, device="meta")
    with compile_survey.recording(gpu.arch) as launches, OpCounter() as ops:
        parts = []
        for rows, cols, gr, gc, protect in ((a, p, ga, gp, True), (a, a, ga, ga, False), (p, p, gp, gp, False),
                                            (a, neg, ga, gn, False)):
            mk = BlockMasks(ga=gr, gb=gc, theta=theta, tgt=tgt if protect else None)
            parts.append(GuidedBlockFn.apply(rows, cols, 1.0 / GIST_TEMPERATURE, mk, True, 1e-12))
        out = (torch.logsumexp(torch.stack([lse for lse, _ in parts]), dim=0) - parts[0][1]).mean()
        torch.autograd.grad(out, [a, p, neg])
        del out, parts
    return list(launches), ops.ops


#: The launch names of the per-block fused kernels (core/guided/triton_blocks.py's GuidedBlockFn).
GIST_FUSED_KERNELS = ("guided_fwd", "guided_bwd_rows", "guided_bwd_cols")


def gist_blocks():
    """``(blocks, tensors)`` of ``gist_loss`` with one hard negative, local (no gather): anchors (tensor 0)
    against positives (1, the protected target), anchors, positives (row_start 0) and negatives (2), as
    ``losses/guided.py`` builds them."""
    from fused_contrastive.core.guided.torch_blocks import Block

    return [Block(rows=0, cols=1, protect=True), Block(rows=0, cols=0), Block(rows=1, cols=1, row_start=0),
            Block(rows=0, cols=2)]


def gist_floor_units(d: int, dg: int) -> float:
    """GIST's matmul floor in units of 2 N^2 D FLOPs (every block N x N), counted from :func:`gist_blocks`:
    the logits once per block, the anchor-anchor and positive-positive blocks (X X^T) as half a product:
    1 + 1/2 + 1/2 + 1 = 3; the guide cosines likewise at Dg / D of a unit: 3 Dg / D (1.5 at Dg = D / 2);
    the gradients, one GEMM per side of an a-p / a-n block (dR = G C, dC = G^T R: 2 each) and one for a
    symmetric block (dX = (G + G^T) X: 1 each): 2 + 1 + 1 + 2 = 6. 10.5 units at Dg = D / 2."""
    return 3.0 + 3.0 * dg / d + 6.0


def run_gist_panel(n: int, d: int, gpu: GPU, learnable_scale: bool = False) -> tuple[list[TL.Launch], list]:
    """The launches (recorded) and ATen ops of ``gist_loss``'s summed bf16 loss on backend="triton" as CUDA
    runs it for N x 4N >= 2^24 (``panels.use_panel``): ``core.blocks.merged_lse(..., weights=w,
    minus_target=True)`` with the blocks, masks and weights ``gist_loss`` builds (:func:`gist_blocks`; guide
    rule ("absolute", 0.0); target arange; w = 1 / N), through ``TritonMergedFn`` on the guided panel route
    (``core/guided/triton_panel.py``: per panel and block the epilogue GEMM ``guided_epi`` and its redo, cuBLAS
    for the gradients, ``panel_rows``), forward + backward, bf16 model and guide embeddings, scale
    1 / GIST_TEMPERATURE (a Python float as ``temperature=0.01`` gives, or a learnable 0-dim tensor).
    On the meta device ``use_panel``'s "auto" sees no CUDA tensor: the path is set to "panel" here (what
    "auto" takes on CUDA at these sizes); the panel form stays "auto" (``use_epilogue``'s rule for the
    guided blocks, meta being one of its devices)."""
    from fused_contrastive.core.guided.torch_blocks import Masks, merged_lse

    a, p, neg, ga, gp, gn = _gist_inputs(n, d)
    masks = Masks(guides=(ga, gp, gn), target=torch.arange(n, device="meta"), rule=("absolute", 0.0))
    w = torch.full((n,), 1.0 / n, dtype=torch.float32, device="meta")
    scale = _meta((), torch.float32) if learnable_scale else 1.0 / GIST_TEMPERATURE
    env = {"FUSED_CONTRASTIVE_TRITON_PATH": "panel", "FUSED_CONTRASTIVE_PANEL_GEMM": "auto"}
    with mock.patch.dict(os.environ, env), compile_survey.recording(gpu.arch) as launches, OpCounter() as ops, \
            norms_tagged(ops):
        out = merged_lse([a, p, neg], gist_blocks(), n, scale, masks, normalize=True, eps=1e-12, weights=w,
                         minus_target=True, backend="triton")
        torch.autograd.grad(out, [a, p, neg] + ([scale] if learnable_scale else []))
        del out
    names = {lz.name for lz in launches}
    if "guided_epi" not in names or names & set(GIST_FUSED_KERNELS):
        raise AssertionError(f"GIST did not take the guided panel route on the meta device: launches {sorted(names)} "
                             "(core/guided/triton_panel.py use_guided_panel)")
    return list(launches), ops.ops


@functools.cache
def count_gist(path: str, n: int, d: int) -> tuple[list, int]:
    with OpCounter() as c, norms_tagged(c):
        out, leaves = (gist_textbook if path == "naive" else gist_torch)(n, d)
        torch.autograd.grad(out, leaves)
        del out
    return c.ops, c.peak


@functools.cache
def _gist_panel_recorded(n: int, d: int, arch: str) -> tuple[list[TL.Launch], list]:
    """:func:`run_gist_panel` once per problem and arch (H100 and H200 share sm_90's launches)."""
    return run_gist_panel(n, d, next(g for g in GPUS.values() if g.arch == arch))


def _gist_kernel_rows(ks: list[dict]) -> list[dict]:
    """Per kernel name: launches, central ms, TFLOP, the bound of its slowest launch config, and every
    compiled config's registers / spills."""
    out: dict[str, dict] = {}
    for k in ks:
        g = out.setdefault(k["kernel"], dict(kernel=k["kernel"], launches=0, ms=0.0, flops=0.0, l2_bytes=0.0,
                                             regs=set(), spills=0, bound={}))
        g["launches"] += 1
        g["ms"] += k["ms"]
        g["flops"] += k["flops"]
        g["l2_bytes"] += k["l2_bytes"]
        g["regs"].add(k["regs"])
        g["spills"] = max(g["spills"], k["spills"])
        g["bound"][k["bound"]] = g["bound"].get(k["bound"], 0.0) + k["ms"]
    return [dict(g, regs=sorted(g["regs"]), bound=max(g["bound"], key=g["bound"].get), ms=round(g["ms"], 4))
            for g in out.values()]


def gist_report(sizes: list[int], d: int, gpus: list[str]) -> list[dict]:
    """MODEL of the GISTEmbed loss (anchor, positive, one hard negative; guide dimension D / 2; the four
    blocks) on a GPU: the route ``backend="triton"`` takes on CUDA for the summed bf16 loss (the guided panel
    route, :func:`run_gist_panel`: the epilogue GEMM ``guided_epi`` per panel and block, cuBLAS gradients),
    the per-block fused kernels (``kernels/guided.py``: a forward and two recomputing backward kernels per
    block, :func:`run_gist_triton`; the route of per-row output, fp16 / fp32 and ``normalize=False``), the
    torch backend's eager sweep and the textbook computation, all modelled as the core op's, beside the
    floor of :func:`gist_floor_units`."""
    dg = gist_dims(d)
    units = gist_floor_units(d, dg)
    print(f"--- MODEL GISTEmbed loss (a-p, a-a, p-p, a-n blocks), D = {d}, guide D = {dg}, bf16 model and guide "
          "embeddings, fwd + bwd (ms, central [optimistic - pessimistic]; no GPU used)")
    print("  route: what backend=\"triton\" runs on CUDA for the summed (mean / sum) bf16 loss with normalize=True "
          "where N x 4N >= 2^24: the guided panel route (core/guided/triton_panel.py: per panel and block the "
          "epilogue GEMM guided_epi, 1 unit + the guide tile, then cuBLAS dR and dC, 2 units); fused kernels: the "
          "per-block kernels (core/guided/triton_blocks.py: 5 units + 3 guide tiles per block), the route of per-row "
          "output, fp16 / fp32 and normalize=False")
    print(f"  assumption, floor: {units:g} units of 2 N^2 D FLOPs at the bf16 peak, from the blocks: logits 3 (a-p 1, "
          f"a-a 1/2 and p-p 1/2 as X X^T, a-n 1) + guide cosines 3 x Dg / D = {3 * dg / d:g} + gradients 6 (2 per "
          "a-p / a-n block: dR and dC; 1 per symmetric block: (G + G^T) X)")
    print(f"  {'gpu':5s} {'N':>6s} {'floor':>7s} {'route (panel)':>24s} {'fused kernels':>24s} {'torch backend':>24s} "
          f"{'textbook':>24s} {'textbook peak':>13s} {'fused kernels: regs / spills':>28s}")
    recs = []
    for g in gpus:
        gpu = GPUS[g]
        for n in sizes:
            launches, ops = run_gist_triton(n, d, gpu)
            # what CUDA runs: the panel route from N x sum_k M_k = 4 N^2 >= 2^24 (panels.use_panel "auto")
            panel = n * 4 * n >= panels.MIN_ELEMENTS
            r_launches, r_ops = _gist_panel_recorded(n, d, gpu.arch) if panel else (launches, ops)
            got = {}
            tops, _ = count_gist("torch", n, d)
            nops, npeak = count_gist("naive", n, d)
            for sc in SCENARIOS:
                with scenario(sc):
                    ks = [kernel_model(lz, gpu) for lz in launches]
                    rks = [kernel_model(lz, gpu) for lz in r_launches] if panel else ks
                    r_aten = aten_model(r_ops, gpu)
                    tri = sum(k["ms"] for k in ks) + aten_model(ops, gpu)["ms"]
                    route = sum(k["ms"] for k in rks) + r_aten["ms"]
                    got[sc] = (tri, aten_model(tops, gpu)["ms"], aten_model(nops, gpu)["ms"], route)
                    if sc == "central":
                        route_pess = sum(k["ms_pess"] for k in rks) + r_aten["ms"]
                        rows, aten_c = _gist_kernel_rows(rks), r_aten
            flops = dict(triton=sum(k["flops"] for k in ks), torch=aten_model(tops, gpu)["gemm_flops"],
                         textbook=aten_model(nops, gpu)["gemm_flops"])
            peak = npeak + 3 * n * (d + dg) * 2
            fits = peak <= gpu.mem_gb * 1e9
            regs = sorted({(k["kernel"], k["regs"], k["spills"]) for k in ks})
            floor = units * 2 * n * n * d / (gpu.bf16_tflops * 1e12) * 1e3

            def cell(i, got=got):
                return f"{got['central'][i]:.1f} [{got['optimistic'][i]:.1f} - {got['pessimistic'][i]:.1f}]"
            print(f"  {g:5s} {n:6d} {floor:7.2f} {cell(3):>24s} {cell(0):>24s} {cell(1):>24s} {cell(2):>24s} "
                  f"{_fmt_b(peak):>13s}{'' if fits else ' DOES NOT FIT'} "
                  f"{' '.join(f'{r}/{sp}' for _, r, sp in regs):>28s}")
            if panel:
                p_rows = next(lz.args["P"] for lz in r_launches if lz.name == "guided_epi")
                print(f"  {'':12s} route ({n} rows in panels of {p_rows}), central ms: "
                      + ", ".join(f"{k['kernel']} {k['launches']}x {k['ms']:.2f} ({k['bound']}, regs "
                                  f"{'/'.join(str(x) for x in k['regs'])}, spills {k['spills']})" for k in rows)
                      + f", cuBLAS GEMMs {aten_c['gemm_ms']:.2f} ({aten_c['gemm_flops'] / 1e12:.2f} TFLOP), other ATen "
                      f"ops {aten_c['other_ms']:.2f} + launches {aten_c['launch_ms']:.2f} ({aten_c['launches']} ops); "
                      f"worst data (every row redone) {route_pess:.1f}")
            c = got["central"]
            recs.append(dict(loss="gist", gpu=g, n=n, d=d, guide_d=dg, path="panel" if panel else "fused",
                             ms=round(c[3], 3), ms_range=[round(got["optimistic"][3], 3),
                                                          round(got["pessimistic"][3], 3)],
                             ms_worst_data=round(route_pess, 3), pct_peak=round(100 * floor / c[3], 2),
                             floor_ms=round(floor, 4), floor_units=units, peak_tflops=gpu.bf16_tflops,
                             fused_ms=round(c[0], 3),
                             naive_ms=round(c[2], 3) if fits else None, naive_ms_if_memory=round(c[2], 3),
                             naive_peak_bytes=peak,
                             route_tc_flops=sum(k["flops"] for k in rows), route_gemm_flops=aten_c["gemm_flops"],
                             route_launches=len(r_launches) + aten_c["launches"], route_aten_ms=round(aten_c["ms"], 4),
                             route_panel_rows=p_rows if panel else None,
                             route_kernels=[dict(kernel=k["kernel"], launches=k["launches"], ms=k["ms"],
                                                 flops=k["flops"], bound=k["bound"], regs=k["regs"],
                                                 spills=k["spills"]) for k in rows],
                             # the fused kernels (the keys before the panel route; gpu_validate reads triton_ms)
                             triton_ms=round(c[0], 3),
                             triton_range=[round(got["optimistic"][0], 3), round(got["pessimistic"][0], 3)],
                             torch_ms=round(c[1], 3), textbook_ms=round(c[2], 3),
                             textbook_peak_bytes=peak, textbook_fits=fits, triton_tc_flops=flops["triton"],
                             torch_gemm_flops=flops["torch"], textbook_gemm_flops=flops["textbook"],
                             kernels=[dict(kernel=k, regs=r, spills=sp) for k, r, sp in regs],
                             model="MODEL, not a measurement"))
    print()
    return recs


def run_siglip_triton(n: int, d: int, gpu: GPU, path: str) -> tuple[list[TL.Launch], list]:
    """The launches (recorded) and ATen ops of ``siglip_loss``'s Triton Function, forward + backward with
    gradients to both towers, the scale and the bias, bf16, on ``path``: "fused" (its fused kernels),
    "panel" (the panel path's epilogue GEMM: what CUDA runs at these sizes; the mean loss, whose one pass,
    MODE 5, forms the losses and the gradient tile together) or "panel_rows" (the same path for per-row
    losses, summed by the caller: a losses sweep, MODE 4, then a gradient sweep)."""
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn

    x, y = _meta((n, d)), _meta((n, d))
    sc, bi = _meta((), torch.float32), _meta((), torch.float32)
    # the tiles form: the model prices one program per tile (SigLIP's one pass takes TMA tiles on sm_90 by
    # default, panels.EPI_FORM_DEFAULT, from a measurement the model cannot reproduce: it has no latency)
    env = {"FUSED_CONTRASTIVE_TRITON_PATH": "fused" if path == "fused" else "panel",
           "FUSED_CONTRASTIVE_PANEL_GEMM": "epilogue", "FUSED_CONTRASTIVE_EPI_FORM": "tiles"}
    with mock.patch.dict(os.environ, env), compile_survey.recording(gpu.arch) as launches, OpCounter() as ops:
        if path == "panel_rows":
            out = TritonSigLipFn.apply(x, y, sc, bi, True, 1e-12, 0, False, 1.0).sum()
        else:
            out = TritonSigLipFn.apply(x, y, sc, bi, True, 1e-12, 0, True, 1.0 / n)
        torch.autograd.grad(out, [x, y, sc, bi])
        del out
    return list(launches), ops.ops


@functools.cache
def count_siglip_textbook(n: int, d: int) -> tuple[list, int]:
    """ATen ops of the textbook SigLIP (``testing.baselines.siglip_formula``: open_clip's SigLipLoss on one
    device), bf16 features, forward + backward."""
    from fused_contrastive.testing.baselines import siglip_formula

    x, y = _meta((n, d)), _meta((n, d))
    sc, bi = _meta((), torch.float32), _meta((), torch.float32)
    with OpCounter() as c, norms_tagged(c):
        out = siglip_formula(x, y, sc, bi)
        torch.autograd.grad(out, [x, y, sc, bi])
        del out
    return c.ops, c.peak


def siglip_report(sizes: list[int], d: int, gpus: list[str]) -> list[dict]:
    """MODEL of SigLIP's sigmoid loss (N images against N texts, learnable scale and bias) on a GPU: the
    route CUDA takes for the mean loss (the panel path's epilogue GEMM, ``triton_sweep.siglip_sweep``: one pass,
    MODE 5, that forms the losses and the gradient tile, then the cuBLAS GEMMs: 3 matmul units), the same
    path for per-row losses (a losses sweep and a gradient sweep: 4 units), its fused kernels
    (``kernels/siglip.py``: 5, the backward streaming through an fp32 scratch) and the textbook formula,
    modelled as the core op's; floor 3 units (logits, dX, dY)."""
    paths = ("panel", "panel_rows", "fused")
    print(f"--- MODEL SigLIP (sigmoid loss, learnable scale and bias), D = {d}, bf16, fwd + bwd (ms, central "
          "[optimistic - pessimistic]; no GPU used)")
    print(f"  {'gpu':5s} {'N':>6s} {'floor':>7s} {'one pass (route)':>24s} {'two sweeps':>24s} "
          f"{'fused kernels':>24s} {'textbook':>24s}")
    recs = []
    for g in gpus:
        gpu = GPUS[g]
        for n in sizes:
            runs = {p: run_siglip_triton(n, d, gpu, p) for p in paths}
            nops, npeak = count_siglip_textbook(n, d)
            got = {}
            for sc in SCENARIOS:
                with scenario(sc):
                    got[sc] = tuple(sum(kernel_model(lz, gpu)["ms"] for lz in runs[p][0])
                                    + aten_model(runs[p][1], gpu)["ms"] for p in paths) \
                        + (aten_model(nops, gpu)["ms"],)
            floor = 3 * 2 * n * n * d / (gpu.bf16_tflops * 1e12) * 1e3
            peak = npeak + 2 * n * d * 2

            def cell(i, got=got):
                return f"{got['central'][i]:.1f} [{got['optimistic'][i]:.1f} - {got['pessimistic'][i]:.1f}]"
            print(f"  {g:5s} {n:6d} {floor:7.2f} {cell(0):>24s} {cell(1):>24s} {cell(2):>24s} {cell(3):>24s}")
            recs.append(dict(loss="siglip", gpu=g, n=n, d=d, ms=round(got["central"][0], 3),
                             ms_range=[round(got["optimistic"][0], 3), round(got["pessimistic"][0], 3)],
                             two_sweeps_ms=round(got["central"][1], 3),
                             fused_ms=round(got["central"][2], 3), floor_ms=round(floor, 4),
                             naive_ms=round(got["central"][3], 3) if peak <= gpu.mem_gb * 1e9 else None,
                             naive_ms_if_memory=round(got["central"][3], 3), naive_peak_bytes=peak,
                             route_kernels=sorted({(lz.name, lz.constexprs.get("MODE")) for lz in runs["panel"][0]
                                                   if lz.name.startswith("epi_gemm")}),
                             model="MODEL, not a measurement"))
    print()
    return recs


def run_maxsim_triton(n: int, lq: int, ld: int, d: int, gpu: GPU) -> tuple[list[TL.Launch], list]:
    """The launches (recorded) and ATen ops of ``maxsim_info_nce``'s Triton route (``maxsim.MaxSimCEFn``
    on ``core/maxsim/triton_maxsim.py``'s kernels), forward + backward to both towers, bf16, unit tokens, every
    token valid, N queries of Lq tokens against N documents of Ld tokens."""
    from fused_contrastive import maxsim as MS

    q, docs = _meta((n, lq, d)), _meta((n, ld, d))
    w = torch.ones(n, lq, device="meta")
    valid = torch.ones(n, ld, dtype=torch.bool, device="meta")
    t = torch.arange(n, device="meta")
    keep = torch.ones(n, dtype=torch.bool, device="meta")
    scale = torch.ones((), device="meta")
    with compile_survey.recording(gpu.arch) as launches, OpCounter() as ops:
        out = MS.MaxSimCEFn.apply(q, docs, scale, w, valid, t, keep, MS.empty_scores(w, False), False, "triton")
        torch.autograd.grad(out.sum(), [q, docs])
        del out
    return list(launches), ops.ops


@functools.cache
def count_maxsim_textbook(n: int, lq: int, ld: int, d: int) -> tuple[list, int]:
    """ATen ops of the textbook late-interaction loss (sentence-transformers' MaxSim scoring in one chunk:
    ``einsum`` of every token similarity in bf16, the masked maximum, the fp32 sum over query tokens,
    ``cross_entropy``), forward + backward."""
    q, docs = _meta((n, lq, d)), _meta((n, ld, d))
    dmask = torch.ones(n, ld, dtype=torch.bool, device="meta")
    with OpCounter() as c:
        sims = torch.einsum("nad,mbd->nmab", q, docs)
        sims = sims.masked_fill(~dmask[None, :, None, :], -3e38)
        s = sims.max(dim=-1).values.float().sum(-1)
        out = torch.nn.functional.cross_entropy(s, torch.arange(n, device="meta"))
        torch.autograd.grad(out, [q, docs])
        del out, sims, s
    return c.ops, c.peak


def maxsim_report(sizes: list[int], lq: int, ld: int, d: int, gpus: list[str]) -> list[dict]:
    """MODEL of late interaction (``maxsim_info_nce``, in-batch negatives) on a GPU: the Triton kernels
    (forward: the token-tile GEMM with the maximum, the sum over query tokens and the online LSE; backward:
    dq by a gather of the maximising rows, dd by the weighted one-hot matmul) against the textbook; floor 2
    units of the token matmul (2 N Lq N Ld D FLOPs each: the similarities, dd; dq is a gather)."""
    print(f"--- MODEL late interaction (MaxSim InfoNCE), Lq = {lq}, Ld = {ld}, D = {d}, bf16, fwd + bwd (ms, "
          "central [optimistic - pessimistic]; no GPU used)")
    print(f"  {'gpu':5s} {'N':>6s} {'floor':>7s} {'triton (route)':>24s} {'textbook':>24s}  kernels (central ms)")
    recs = []
    for g in gpus:
        gpu = GPUS[g]
        for n in sizes:
            launches, ops = run_maxsim_triton(n, lq, ld, d, gpu)
            nops, npeak = count_maxsim_textbook(n, lq, ld, d)
            got, per = {}, {}
            for sc in SCENARIOS:
                with scenario(sc):
                    ks = [kernel_model(lz, gpu) for lz in launches]
                    got[sc] = (sum(k["ms"] for k in ks) + aten_model(ops, gpu)["ms"], aten_model(nops, gpu)["ms"])
                    if sc == "central":
                        per = {k["kernel"]: (round(k["ms"], 2), k["bound"]) for k in ks}
            floor = 2 * 2 * n * lq * n * ld * d / (gpu.bf16_tflops * 1e12) * 1e3
            fits = npeak <= gpu.mem_gb * 1e9

            def cell(i, got=got):
                return f"{got['central'][i]:.1f} [{got['optimistic'][i]:.1f} - {got['pessimistic'][i]:.1f}]"
            naive = cell(1) if fits else f"(needs {npeak / 1e9:.0f} GB)"
            print(f"  {g:5s} {n:6d} {floor:7.2f} {cell(0):>24s} {naive:>24s}  "
                  + ", ".join(f"{k} {v[0]} ({v[1]})" for k, v in per.items()))
            recs.append(dict(loss="maxsim", gpu=g, n=n, lq=lq, ld=ld, d=d, ms=round(got["central"][0], 3),
                             ms_range=[round(got["optimistic"][0], 3), round(got["pessimistic"][0], 3)],
                             floor_ms=round(floor, 4), naive_ms=round(got["central"][1], 3) if fits else None,
                             naive_ms_if_memory=round(got["central"][1], 3), naive_peak_bytes=npeak,
                             kernels={k: v[0] for k, v in per.items()}, model="MODEL, not a measurement"))
    print()
    return recs


#: The H100's timings of the one-pass epilogue GEMM's launch configurations (``bench/gpu_profile.py
#: --configs one_pass``, InfoNCE at N = 65536, bf16, D = 768; triton 3.6, an earlier form of the kernel), which
#: ``--epi-configs`` sets the model beside.
EPI_CONFIGS_MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h100-epilogue",
                                    "profile_configs.txt")
_CONFIG_LINE = re.compile(r"^config one_pass info_nce N=(\d+): (\d+)x(\d+)x(\d+) w(\d+) s(\d+): step [\d.]+ ms "
                          r"\(wall\), epi_gemm ([\d.]+) ms")
#: Configurations no GPU has timed yet, modelled beside the measured ones (BLOCK_M, BLOCK_N, warps, stages;
#: BLOCK_K 64): 128 x 256 tiles at 16 warps compile for sm_90 with 128 registers and no spills.
EPI_CONFIG_CANDIDATES = ((128, 256, 16, 3),)


def measured_epi_configs(path: str = EPI_CONFIGS_MEASURED) -> list[dict]:
    """The measured rows of ``path``: ``n``, the configuration (``block_m``, ``block_n``, ``block_k``,
    ``warps``, ``stages``) and ``epi_ms``, the device time of every epilogue-GEMM launch of one step."""
    out = []
    with open(path) as f:
        for line in f:
            m = _CONFIG_LINE.match(line)
            if m:
                n, bm, bn, bk, w, st = (int(x) for x in m.groups()[:6])
                out.append(dict(n=n, block_m=bm, block_n=bn, block_k=bk, warps=w, stages=st, epi_ms=float(m[7])))
    return out


def _one_pass_epi_ms(n: int, d: int, gpu: GPU, cfg) -> tuple[float, int]:
    """MODEL (central) of the epilogue-GEMM launches of one InfoNCE step with the one-pass config ``cfg``
    (what the profiler's "epi_gemm" sums: the one pass and its redo), and the one pass's CTAs per SM."""
    from fused_contrastive.core.triton_shared import configs as CFG

    shipped = CFG.EPI_GEMM["one_pass"]
    CFG.EPI_GEMM["one_pass"] = cfg  # the dict the host code reads (shared object)
    try:
        launches, _ = run_triton("info_nce", n, d, gpu, "panel-epilogue")
    finally:
        CFG.EPI_GEMM["one_pass"] = shipped
    with scenario("central"):
        ks = [(lz, kernel_model(lz, gpu)) for lz in launches if lz.name.startswith("epi_gemm")]
    ctas = min(k["ctas_sm"] for lz, k in ks if lz.constexprs["MODE"] == 1)
    return sum(k["ms"] for _, k in ks), ctas


def epi_configs_report(d: int = 768, gpu_name: str = "H100") -> list[dict]:
    """The model's time for the one-pass epilogue GEMM in each launch configuration an H100 timed
    (:data:`EPI_CONFIGS_MEASURED`) beside that measurement, and for the untimed :data:`EPI_CONFIG_CANDIDATES`:
    whether the model ranks the configurations as the GPU did, before it is trusted to choose one."""
    from fused_contrastive.core.triton_shared.configs import EPI_GEMM, LaunchConfig

    gpu = GPUS[gpu_name]
    rows = measured_epi_configs()
    print(f"--- MODEL beside MEASURED: the one-pass epilogue GEMM's launch configurations, InfoNCE, {gpu_name}, "
          f"bf16, D = {d} (ms of epi_gemm per fwd + bwd; measured: {os.path.relpath(EPI_CONFIGS_MEASURED)}, an "
          "earlier form of the kernel)")
    print(f"  {'N':>6s} {'config':>18s} {'CTAs/SM':>7s} {'MODEL':>8s} {'measured':>9s} {'measured/MODEL':>15s}")
    recs = []
    cands = [dict(n=rows[0]["n"] if rows else 65536, block_m=bm, block_n=bn, block_k=64, warps=w, stages=st,
                  epi_ms=None) for bm, bn, w, st in EPI_CONFIG_CANDIDATES]
    for r in rows + cands:
        cfg = LaunchConfig(r["block_m"], r["block_n"], r["block_k"], r["warps"], r["stages"])
        ms, ctas = _one_pass_epi_ms(r["n"], d, gpu, cfg)
        label = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_d} w{cfg.num_warps} s{cfg.num_stages}"
        label += " *" if cfg == EPI_GEMM["one_pass"] else ""
        meas = r["epi_ms"]
        ratio = f"{meas / ms:15.2f}" if meas is not None else f"{'(not timed)':>15s}"
        print(f"  {r['n']:6d} {label:>18s} {ctas:7d} {ms:8.2f} {meas if meas is not None else '-':>9} {ratio}")
        recs.append(dict(kind="epi_config", loss="info_nce", gpu=gpu_name, n=r["n"], d=d, config=label.rstrip(" *"),
                         ctas_sm=ctas, model_ms=round(ms, 3), measured_ms=meas,
                         model="MODEL beside a measurement" if meas is not None else "MODEL, not a measurement"))
    timed = [x for x in recs if x["measured_ms"] is not None]
    if timed:
        by_model = [x["config"] for x in sorted(timed, key=lambda x: x["model_ms"])]
        by_gpu = [x["config"] for x in sorted(timed, key=lambda x: x["measured_ms"])]
        print(f"  ranked by the MODEL: {', '.join(by_model)}")
        print(f"  ranked by the GPU:   {', '.join(by_gpu)}")
        print("  (* the shipped configuration)")
    print()
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16384,65536", help="N = M values (comma-separated)")
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--gpus", default="A100,H100,H200")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--no-compare", action="store_true",
                    help="omit the comparison with the outside estimate and the goals")
    ap.add_argument("--matryoshka", action="store_true",
                    help="also model Matryoshka InfoNCE (5 levels) on the torch backend's one-pass path")
    ap.add_argument("--gist", action="store_true",
                    help="also model the GISTEmbed loss (four guided blocks) on the route CUDA takes (the guided "
                         "panel route: epilogue GEMM + cuBLAS), the fused Triton kernels, the torch backend and the "
                         "textbook computation")
    ap.add_argument("--siglip", action="store_true",
                    help="also model SigLIP's sigmoid loss on the panel path's epilogue GEMM, its fused kernels and "
                         "the textbook formula")
    ap.add_argument("--maxsim", action="store_true",
                    help="also model late interaction (maxsim_info_nce) at N = 1024 and 4096, Lq = 32, Ld = 180, "
                         "D = 128 on its Triton kernels and the textbook computation")
    ap.add_argument("--epi-configs", action="store_true",
                    help="also model the one-pass epilogue GEMM in each launch configuration an H100 timed, beside "
                         "that measurement (and the untimed candidates)")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip the torch backend (its op count on the meta device takes ~1 s per 10k launches)")
    args = ap.parse_args(argv)
    results = []
    for loss in filter(None, args.losses.split(",")):  # --losses "": only the reports asked for below
        for g in args.gpus.split(","):
            for n in (int(x) for x in args.sizes.split(",")):
                results.append(model_loss(loss, n, args.d, GPUS[g], with_torch=not args.no_torch))
    if results:
        print_report(results, args.d, not args.no_compare)
    extra = []
    if args.matryoshka:
        # and N = 2048, below the panel path's threshold (N * M < 2^24): there the Matryoshka kernels run
        extra = matryoshka_report(sorted({2048, *(int(x) for x in args.sizes.split(","))}), args.d,
                                  args.gpus.split(","))
    if args.gist:
        extra += gist_report([int(x) for x in args.sizes.split(",")], args.d, args.gpus.split(","))
    if args.siglip:
        extra += siglip_report([int(x) for x in args.sizes.split(",")], args.d, args.gpus.split(","))
    if args.maxsim:
        extra += maxsim_report([1024, 4096], 32, 180, 128, args.gpus.split(","))
    if args.epi_configs:
        extra += epi_configs_report(args.d)
    for r in results:
        print(json.dumps(r["rec"]))
    for r in extra:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
