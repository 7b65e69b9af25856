"""Ahead-of-time compilation of the Triton kernels for GPUs that are not here.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` lowers a kernel to PTX and runs
the ptxas bundled with triton on the host: no GPU and no driver needed. This module records the
launches of one forward + backward of the core op exactly as the runtime builds them (on the meta
device, through ``triton_shared/launch.py``'s launch recorder), and compiles each one for sm_80 / sm_90,
reporting registers, spill bytes, shared memory and the tensor-core instructions of the PTX.

Used by tests/test_triton_compile.py and bench/kernel_report.py; the runtime never imports it.
Triton must be imported with ``TRITON_INTERPRET=0`` (interpreted jit functions cannot be compiled).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator

import torch
from torch import Tensor

from ..core import target_split
from ..core.lse import triton_fused
from ..core.spec import CoreData, CoreSpec
from ..core.triton_shared import launch as TL
from ..core.triton_shared.configs import CONFIGS, DTYPE_NAMES

#: Feature sets of the ahead-of-time checks: "plain" is InfoNCE with keys (the common case; the
#: kernel report's FLOP counts), "full" switches on every optional term of the non-symmetric kernels
#: (the most registers: every shipped config is compiled with it), "sym" is A-is-B with every term of
#: the symmetric backward (compiled for the row kernel's SYM path), "nopos" is "full" without the
#: softmax over positives (the forward's "fwd" config; "full" compiles "fwd_pos"), "wide" is the most
#: the row-statistics forward takes (the "fwd_wide" config: the self column with an offset, no bias,
#: no column term, no positives). "split" / "sym_split" are "nopos" and the symmetric backward with each
#: row's target column split out of the backward's tiles (SPLIT_T: a loss with a target term on the JIT).
VARIANTS = ("plain", "full", "sym", "nopos", "wide", "split", "sym_split")

#: The D of each bucket compiled ahead of time: the largest D_PAD of the bucket (its worst case).
BUCKET_D = {"d64": 64, "d128": 128, "big": 768}

#: (compute capability, arch family) pairs of the AOT checks.
TARGETS = ((80, "sm80"), (90, "sm90"))


@contextlib.contextmanager
def recording(arch: str) -> Iterator[list[TL.Launch]]:
    """Within the block, kernel launches are recorded (with ``arch``'s configs), not run."""
    prev = TL._RECORDER
    TL._RECORDER = TL.Recorder(arch, [])
    try:
        yield TL._RECORDER.launches
    finally:
        TL._RECORDER = prev


def variant_problem(variant: str, n: int, m: int, device="meta") -> tuple[CoreSpec, CoreData, bool, bool, bool]:
    """(spec, data, B given, want_col, want_pos) of an AOT feature set, with meta (or given) tensors."""
    dev = torch.device(device)
    if variant == "plain":
        return CoreSpec(), CoreData(), True, False, False
    if variant == "full":
        spec = CoreSpec(exclude_self=True, offset=3, bias=0.5, grad_cols=m // 2)
        data = CoreData(pos_mask=torch.empty((max(1, n // 2), max(1, m // 2)), device=dev),
                        bias_col=torch.empty(n, dtype=torch.int64, device=dev))
        return spec, data, True, True, True
    if variant == "sym":
        data = CoreData(pos_mask=torch.empty((max(1, n // 2), max(1, n // 2)), device=dev))
        return CoreSpec(exclude_self=True), data, False, True, True
    if variant == "nopos":
        spec = CoreSpec(exclude_self=True, offset=3, bias=0.5, grad_cols=m // 2)
        return spec, CoreData(bias_col=torch.empty(n, dtype=torch.int64, device=dev)), True, True, False
    if variant == "wide":
        return CoreSpec(exclude_self=True, offset=3, grad_cols=m // 2), CoreData(), True, False, False
    tgt = torch.empty(n, dtype=torch.int64, device=dev)
    if variant == "split":  # "nopos" with the target column split out of the backward's tiles
        spec = CoreSpec(exclude_self=True, offset=3, bias=0.5, grad_cols=m // 2)
        return spec, CoreData(bias_col=torch.empty(n, dtype=torch.int64, device=dev), target=tgt), True, True, False
    if variant == "sym_split":  # the symmetric backward with the split, every term it takes with one
        return CoreSpec(exclude_self=True), CoreData(target=tgt), False, True, False
    raise ValueError(f"unknown AOT variant {variant!r}; valid: {VARIANTS}")


def record_core(spec: CoreSpec, data: CoreData, has_b: bool, want_col: bool, want_pos: bool,
                dtype: torch.dtype, n: int, m: int, d: int, arch: str, need_a: bool = True, need_b: bool = True,
                need_s: bool = True, split: bool = False, split_fwd: bool = False,
                exact: bool = False) -> list[TL.Launch]:
    """The launches of one forward + backward of the core op's kernels, recorded on the meta device:
    exactly the argument lists of the runtime launches. The backward gets an upstream gradient for
    every statistic the forward produces. ``split``: the backward leaves each row's target column out
    of its tiles (``core.PiecesFn`` with a target term). ``split_fwd`` (with ``split``): the forward keeps
    the target entries out of its statistics too (``_lse_fwd``'s ``minus_target``, the fp16 / bf16 fused
    route of ``triton_function``; the C API's ``fc_forward_split``), one target vector for both. ``exact`` (with
    ``split_fwd``): the backward takes the target weights formed from the split's statistics (EXACT_T,
    ``target_split.exact_weights``), as ``triton_function`` does (the C library's split does not)."""
    meta = torch.device("meta")
    a = torch.empty((n, d), dtype=dtype, device=meta)
    b = torch.empty((m, d), dtype=dtype, device=meta) if has_b else None
    scale = torch.empty((), dtype=torch.float32, device=meta)
    if split_fwd and not split:
        raise ValueError("record_core: split_fwd needs split (the split forward's backward splits too)")
    if exact and not split_fwd:
        raise ValueError("record_core: exact needs split_fwd (its weights come from the split forward's statistics)")
    # (one target vector: a margin's columns, when ``data`` has them, are the split's targets, as the C API takes them)
    target = (data.target if data.target is not None else torch.empty(n, dtype=torch.int64, device=meta)) if split \
        else None
    with recording(arch) as launches:
        minus: dict = {}
        lse, lse_col, lse_pos, p = triton_fused._lse_fwd(a, b, scale, spec, data, want_col, want_pos,
                                                         target=target if split_fwd else None,
                                                         minus_target=minus if split_fwd else None)
        g = torch.empty(n, device=meta)
        g_col = None if lse_col is None else torch.empty(lse_col.shape, device=meta)
        w = target_split.exact_weights(minus, target, g, g_col, lse_col) if exact else None
        triton_fused._lse_bwd(p, scale, spec, lse, lse_col, lse_pos, g, g_col, None if lse_pos is None else g,
                    need_a, need_b and has_b, need_s, target=target, exact=w)
    return launches


def core_calls(case_name: str, n: int, d: int, dtype: torch.dtype = torch.bfloat16, device: str = "meta",
               seed: int = 0, traced: bool = False) -> list[tuple]:
    """Every call the registry case ``case_name`` makes to ``core.run`` at N anchors, each as ``(a, b,
    scale, spec, data, coef, reduce)``, captured by running the loss with ``core.run`` intercepted (so
    the kernel report, the tracing tests and ``opcheck`` describe the losses exactly as they call the
    core op, from the one registry). The inputs are the case's (embeddings in ``dtype``, requiring grad)
    on ``device``: "meta" (nothing allocated, nothing computed; the default) or a real device (values
    from ``case.build(..., seed)``). The intercepted call returns zeros, so nothing after it is checked.
    ``traced``: the calls as the loss makes them under torch.compile / export (``_tracing.forced``: the
    registered operator's arguments, e.g. weights of 1 with the mean's division outside)."""
    import contextlib

    from .. import core
    from .._tracing import forced
    from ..testing import CASE_BY_NAME

    case = CASE_BY_NAME[case_name]
    if case.op != "core":
        raise ValueError(f"{case_name} does not run on the core op")
    tensors, kwargs = case.build(n, d, torch.Generator().manual_seed(seed))
    if device == "meta":
        inputs = {k: torch.empty(v.shape, dtype=dtype if v.dim() else v.dtype, device="meta", requires_grad=True)
                  for k, v in tensors.items()}
    else:
        inputs = {k: (v.to(device=device, dtype=dtype) if v.dim() else v.to(device)).requires_grad_()
                  for k, v in tensors.items()}
    kw = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in kwargs.items()}
    seen = []

    def capture(backend, a, b, scale, spec, data, coef, reduce, levels=None):
        seen.append((a, b, scale, spec, data, coef, reduce))
        return torch.zeros(() if reduce else (a.shape[0],), device=a.device)

    orig, core.run = core.run, capture
    try:
        with forced() if traced else contextlib.nullcontext():
            case.fn(**inputs, **kw, backend="torch")
    finally:
        core.run = orig
    if len(seen) != case.core_calls:
        raise RuntimeError(f"{case_name}: its Case says core_calls={case.core_calls} but the loss made {len(seen)} "
                           f"core-op call(s): set core_calls=... on its Case in fused_contrastive/testing/cases.py")
    return seen


def core_call(case_name: str, n: int, d: int, dtype: torch.dtype = torch.bfloat16, device: str = "meta") -> tuple:
    """The first (for most cases the only) call of :func:`core_calls`: ``(a, b, scale, spec, data, coef,
    reduce)``, what a kernel is compiled for."""
    return core_calls(case_name, n, d, dtype, device)[0]


def core_problem(case_name: str, n: int, d: int, dtype: torch.dtype = torch.bfloat16):
    """``(spec, data, coef, a, b)`` of :func:`core_call` (what the kernels are compiled for)."""
    a, b, _, spec, data, coef, _ = core_call(case_name, n, d, dtype)
    return spec, data, coef, a, b


def record_case(case_name: str, n: int, d: int, arch: str, dtype: torch.dtype = torch.bfloat16) -> list[TL.Launch]:
    """The kernel launches of one forward + backward of a registry case at N anchors. The problem is
    captured at a small N (:func:`core_problem`: the flags, and M as a multiple of N) and scaled to N
    with meta tensors, so nothing of size N x D is allocated."""
    small = 64
    spec, data, coef, _, b = core_problem(case_name, small, d, dtype)
    m_small = small if b is None else b.shape[0]
    if m_small % small:
        raise ValueError(f"{case_name}: M = {m_small} at N = {small} is not a multiple of N")
    m = m_small // small * n
    meta = torch.device("meta")

    def scaled(t, rows):
        return None if t is None else torch.empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=meta)

    big = CoreData(target=scaled(data.target, n), bias_col=scaled(data.bias_col, n),
                   row_labels=scaled(data.row_labels, n), col_labels=scaled(data.col_labels, m),
                   pos_mask=None if data.pos_mask is None else torch.empty((n, n), device=meta))
    if spec.grad_cols is not None:
        spec = CoreSpec(**{**spec.__dict__, "grad_cols": spec.grad_cols // small * n})
    return record_core(spec, big, b is not None, coef.col is not None, coef.pos is not None, dtype, n,
                       n if b is None else m, d, arch)


def record_variant(variant: str, dtype: torch.dtype, n: int, m: int, d: int, arch: str) -> list[TL.Launch]:
    """:func:`record_core` of an AOT feature set (see :data:`VARIANTS`); "split" / "sym_split" with the
    target column split out of the backward's tiles, as the JIT runs a loss with a target term (never
    beside a softmax over positives: ``triton_function``)."""
    spec, data, has_b, want_col, want_pos = variant_problem(variant, n, m)
    split = variant in ("split", "sym_split")
    # (16-bit: the split forward too, and the backward with its exact target weights, as triton_function runs it)
    sixteen = split and dtype in (torch.float16, torch.bfloat16)
    return record_core(spec, data, has_b, want_col, want_pos, dtype, n, m if has_b else n, d, arch,
                       split=split, split_fwd=sixteen, exact=sixteen)


def record_cosent(dtype: torch.dtype, b: int, d: int, arch: str) -> list[TL.Launch]:
    """The launches of one CoSENT forward + backward on the Triton path (pair form, tensor scale, float32
    labels) with embeddings [B, D] in ``dtype``, recorded on meta tensors."""
    from ..core.cosent.triton_cosent import TritonPairCosentFn

    meta = torch.device("meta")
    u = torch.empty(b, d, dtype=dtype, device=meta, requires_grad=True)
    v = torch.empty(b, d, dtype=dtype, device=meta, requires_grad=True)
    scale = torch.empty((), device=meta, requires_grad=True)
    with recording(arch) as launches:
        TritonPairCosentFn.apply(u, v, torch.empty(b, device=meta), scale, True, 1e-12).backward()
    return list(launches)


def record_siglip(dtype: torch.dtype, n: int, d: int, arch: str) -> list[TL.Launch]:
    """The launches of one SigLIP forward + backward on the Triton path (normalised rows, tensor scale and
    bias, every gradient, a positive offset as under ``gather``) with images [N, D] and texts [2N, D] in
    ``dtype``, recorded on meta tensors."""
    from ..core.siglip.triton_siglip import TritonSigLipFn

    meta = torch.device("meta")
    x = torch.empty(n, d, dtype=dtype, device=meta, requires_grad=True)
    y = torch.empty(2 * n, d, dtype=dtype, device=meta, requires_grad=True)
    scale = torch.empty((), device=meta, requires_grad=True)
    bias = torch.empty((), device=meta, requires_grad=True)
    with recording(arch) as launches:
        TritonSigLipFn.apply(x, y, scale, bias, True, 1e-12, n // 2, True, 1.0 / n).backward()
    return list(launches)


#: The SigLIP kernels (their row-norm prologue launches are the core op's, compiled there).
SIGLIP_KERNELS = ("siglip_fwd", "siglip_bwd_rows", "siglip_bwd_cols")


Job = tuple[int, str, str, int, int, tuple[str, ...]]


def jobs() -> list[Job]:
    """Every distinct kernel compile behind the shipped table: ``(cc, variant, dtype, D, launch index,
    D buckets covered)`` for each kernel x config x dtype x arch, with the heaviest feature set of each
    kernel ("full"; and "sym" for the symmetric backward) at the worst-case D of each D bucket.
    Compiles that would be identical (same constexprs and options, e.g. two D buckets sharing a
    config) are listed once, with every bucket they cover."""
    found: dict[tuple, list] = {}
    for cc, fam in TARGETS:
        for dt, dname in DTYPE_NAMES.items():
            for bucket, d in BUCKET_D.items():
                for variant in ("full", "sym", "nopos", "wide", "split", "sym_split"):
                    for i, launch in enumerate(record_variant(variant, dt, 4096, 4096, d, fam)):
                        if variant in ("sym", "sym_split") and launch.name != "lse_bwd_rows":
                            continue
                        if variant == "split" and not launch.name.startswith("lse_bwd"):
                            continue  # (its forward is "nopos"'s)
                        if variant == "nopos" and (launch.name != "lse_fwd" or CONFIGS[("fwd", fam, dname, bucket)]
                                                   == CONFIGS[("fwd_pos", fam, dname, bucket)]):
                            continue  # "full" compiled the same config with more terms
                        if variant == "wide" and (launch.name != "lse_fwd" or CONFIGS[("fwd_wide", fam, dname, bucket)]
                                                  == CONFIGS[("fwd", fam, dname, bucket)]):
                            continue  # "nopos" (or "full") compiled the same config with more terms
                        key = (cc, launch.name, dname, variant if launch.name.startswith("lse_bwd") else "",
                               tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages)
                        if key not in found:
                            found[key] = [cc, variant, dname, d, i, []]
                        if bucket not in found[key][5]:
                            found[key][5].append(bucket)
        for dt, dname in DTYPE_NAMES.items():  # CoSENT: one config per kernel, D chunks of 128
            for i, launch in enumerate(record_cosent(dt, 4096, 768, fam)):
                key = (cc, launch.name, dname if launch.name.startswith("pair") else "fp32")
                found.setdefault(key, [cc, "cosent", key[2], 768, i, ["-"]])
        for dt, dname in DTYPE_NAMES.items():  # SigLIP: the core table's configs, every D bucket
            for bucket, d in BUCKET_D.items():
                for i, launch in enumerate(record_siglip(dt, 4096, d, fam)):
                    if launch.name not in SIGLIP_KERNELS:
                        continue
                    key = (cc, launch.name, dname, "siglip", tuple(sorted(launch.constexprs.items())),
                           launch.num_warps, launch.num_stages)
                    if key not in found:
                        found[key] = [cc, "siglip", dname, d, i, []]
                    if bucket not in found[key][5]:
                        found[key][5].append(bucket)
    return [(cc, v, dn, d, i, tuple(cov)) for cc, v, dn, d, i, cov in found.values()]


def run_job(job: Job) -> dict[str, object]:
    """Compile one :func:`jobs` entry; the :func:`compile_launch` report plus the job's fields."""
    cc, variant, dname, d, i, covers = job
    dt = {v: k for k, v in DTYPE_NAMES.items()}[dname]
    fam = dict(TARGETS)[cc]
    if variant == "cosent":
        out = compile_launch(record_cosent(dt, 4096, d, fam)[i], cc)
        out.update(variant=variant, dtype=dname, d=d, buckets=list(covers))
        return out
    if variant == "siglip":
        out = compile_launch(record_siglip(dt, 4096, d, fam)[i], cc)
        out.update(variant=variant, dtype=dname, d=d, buckets=list(covers))
        return out
    out = compile_launch(record_variant(variant, dt, 4096, 4096, d, fam)[i], cc)
    out.update(variant=variant, dtype=dname, d=d, buckets=list(covers))
    return out


_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8"}


def _sig_type(v) -> str:
    if isinstance(v, Tensor):
        return "*" + _DTYPES[v.dtype]
    if hasattr(v, "block_shape") and isinstance(getattr(v, "base", None), Tensor):  # a host TensorDescriptor
        if hasattr(v, "layout"):  # Gluon's: its shared-memory layout is part of the type
            return v.__mangle__()
        return f"tensordesc<{_DTYPES[v.base.dtype]}{list(v.block_shape)}>"
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no triton signature type for {type(v).__name__}")


def source(launch: TL.Launch):
    """An ASTSource for ``launch`` (pointer args 16-byte aligned and ints divisible by 16 marked as
    such, as the JIT specialises a real launch on aligned tensors); a Gluon kernel's (``kernels/gluon_epi.py``) is a
    ``GluonASTSource``."""
    from triton.compiler import ASTSource

    fn = launch.fn
    sig = {k: (_sig_type(launch.args[k]) if k in launch.args else "constexpr") for k in fn.arg_names}
    attrs = {}
    for k, v in launch.args.items():
        if isinstance(v, Tensor) or (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0 and v != 0):
            attrs[(fn.arg_names.index(k),)] = [["tt.divisibility", 16]]
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn, sig, dict(launch.constexprs), attrs)
    return ASTSource(fn=fn, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)


#: ptxas_stats by (sha-256 of the PTX, cc), for this process: a recording repeats a kernel once per panel or
#: call, and ptxas is most of a compile survey's time (the panel path's survey compiles 242 launches, 110 distinct).
_PTXAS_SEEN: dict[tuple[str, int], dict[str, int]] = {}


def ptxas_stats(ptx: str, cc: int) -> dict[str, int]:
    """Registers and spill bytes: re-runs the ptxas triton used, with triton's flags plus -v (once per
    distinct PTX and cc in a process)."""
    key = (hashlib.sha256(ptx.encode()).hexdigest(), cc)
    if key not in _PTXAS_SEEN:
        _PTXAS_SEEN[key] = _run_ptxas(ptx, cc)
    return dict(_PTXAS_SEEN[key])


def _run_ptxas(ptx: str, cc: int) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(cc).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(cc)}", src, "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(regs=int(regs[1]), spill_stores=int(spill[1]), spill_loads=int(spill[2]))


def compile_launch(launch: TL.Launch, cc: int, keep: dict[str, object] | None = None) -> dict[str, object]:
    """Compile ``launch`` for GPUTarget("cuda", cc, 32) on the host (ptxas, no driver) and report
    registers, spill bytes, shared memory and the tensor-core instruction kind of its PTX. ``keep``
    receives the compiled kernel (its ``asm`` dict has ttgir, ptx and cubin) when given."""
    import triton
    from triton.backends.compiler import GPUTarget

    ck = triton.compile(source(launch), target=GPUTarget("cuda", cc, 32),
                        options=launch.options())
    if keep is not None:
        keep["kernel"] = ck
    ptx = ck.asm["ptx"]
    n_wgmma = ptx.count("wgmma.mma_async")
    n_mma = ptx.count("mma.sync")
    tc = "wgmma" if n_wgmma else ("mma" if n_mma else "none")
    return dict(kernel=launch.name, cc=cc, num_warps=launch.num_warps, num_stages=launch.num_stages,
                block=" ".join(f"{k[6:]}{v}" for k, v in launch.constexprs.items() if k.startswith("BLOCK_")),
                shared=ck.metadata.shared, tc=tc, n_mma=n_mma, n_wgmma=n_wgmma, **load_widths(ptx),
                **ptxas_stats(ptx, cc))


def load_widths(ptx: str) -> dict[str, int]:
    """How a kernel's PTX reads global memory: ``ld_b16`` scalar 16-bit loads (one element of a 16-bit
    operand each), ``ld_v4`` 16-byte vector loads, ``cp_async_16`` / ``cp_async_small`` asynchronous copies
    to shared memory (the software pipeline's) of 16 bytes and of fewer, ``tma`` bulk tensor copies (TMA,
    sm_90: one instruction per operand tile)."""
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]", ptx)
    n16 = sum(int(x, 0) == 16 for x in sizes)
    return dict(ld_b16=len(re.findall(r"\bld\.global(?:\.[a-zA-Z0-9:_]+)*\.[bsu]16\b", ptx)),
                ld_v4=len(re.findall(r"\bld\.global(?:\.[a-zA-Z0-9:_]+)*\.v4\.[bfu]32\b", ptx)),
                cp_async_16=n16, cp_async_small=len(sizes) - n16,
                tma=len(re.findall(r"\bcp\.async\.bulk\.tensor\.", ptx)))
