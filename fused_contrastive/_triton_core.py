"""Triton backend of the core op (see ``_spec.py``): launchers, launch configs, one autograd Function.

The device code is in ``fused_contrastive.kernels.lse`` (the ``kernels/`` directory); its module
docstring has the math, the gradient derivation and the limits. This module

* picks a fixed, documented launch config per (kernel, arch family, dtype, D bucket) from
  :data:`CONFIGS` (no autotuning by default; ``@triton.autotune`` cannot run under the interpreter),
* launches the kernels (``_lse_fwd``, ``_lse_bwd``: tensors in, tensors out),
* wraps them in :class:`TritonCoreFn` and :func:`core`, with the semantics of ``_torch_core.core``.

Work per call in units of one N x M x D matmul (2 N M D FLOPs):

* forward: 1 (row LSE, LSEpos and the column LSE all come from the same tiles);
* backward, A != B: dA kernel (recompute 1 + ``dl @ B`` 1) + dB kernel (recompute 1 + ``dl^T @ A`` 1)
  = 4; without a gradient for B (a queue, a frozen tower) 2;
* backward, B is A (``spec.same``): one kernel, recompute 1 + ``H @ A`` 1 = 2 (see the kernel
  docstring for why the half-triangle scheme is not used).

The same launch plumbing records launches on the meta device instead of running them
(:func:`record_core`): tests/test_triton_compile.py and bench/kernel_report.py compile exactly the
runtime argument lists for sm_80 / sm_90 on a machine without a GPU (:func:`aot_jobs`).

Nothing touches the GPU driver at import time. On CPU tensors the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1`` before triton is imported); ``_dispatch.check_triton`` says so.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
from torch import Tensor

from ._spec import CoreSpec, CoreTensors, weighted_total
from .kernels import lse as K

__all__ = ["CONFIGS", "LaunchConfig", "TritonCoreFn", "core"]


#: Debug hook for the tests: fill every kernel output with NaN before the launch, so an element a
#: kernel forgets to write shows up. Also settable with FUSED_CONTRASTIVE_TRITON_POISON=1.
POISON_OUTPUTS = os.environ.get("FUSED_CONTRASTIVE_TRITON_POISON", "0") not in ("", "0")

#: Programs of the forward kernel when a column LSE is wanted (each owns one row of the [P, M]
#: partial buffer). None: 2 x the number of SMs on a GPU; 2 under the interpreter (so the
#: multi-row-block path of a program is exercised by small test shapes).
COL_PARTIAL_PROGRAMS: Optional[int] = None


def _interpreted() -> bool:
    """True when triton was imported in interpreter mode (the jit functions are interpreted)."""
    return type(K.lse_fwd_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------------------------------------
# launch configs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch options of one kernel. ``block_d`` 0 means D_PAD (resident)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


#: Largest padded D kept resident (whole rows in registers) by the backward kernels.
RESIDENT_MAX_D = 128

# Why these numbers (fixed; tests/test_triton_compile.py checks 0 spill bytes for every entry on
# sm_80 and sm_90 with every optional term switched on):
# * forward, 16-bit: 128 x 64 tiles, 8 warps (two warpgroups on sm_90: wgmma M = 64 each); the
#   fp32 logit tile and each of its exp temporaries is 32 registers per thread. D chunks of 64
#   (128-byte rows); D <= 64 in one chunk of D_PAD. A 128-wide chunk spilled with every term on.
# * backward, 16-bit: 64 x 64 tiles at 8 warps. The backward holds more live tiles than the
#   forward (l, the positive logits, dl and for A-is-B the transposed dl^T) plus the accumulator:
#   4 warps spilled. D_PAD <= 128 keeps the [64, D_PAD] fp32 accumulator in registers (resident);
#   larger D streams 64-wide chunks through the fp32 scratch.
# * fp32 inputs use tf32x3 dots (each operand split in a high and a low tf32 part: 3 MMAs and about
#   twice the operand registers): 16- or 32-wide D chunks, never resident, 8 warps, and every dot
#   with M >= 64 (wgmma needs M = 64 per warpgroup on sm_90). 64-wide chunks or a resident
#   [64, 128] accumulator spilled kilobytes; 64 x 64 x 32 forward tiles spilled 8 bytes on sm_80.
# sm_90 uses the same numbers (the compiler picks wgmma for the same tiles); a measured retune
# belongs here, per family.
_T16 = {
    # (kernel, D bucket): config  (D buckets: "d64" D_PAD <= 64, "d128" <= 128, "big" > 128)
    ("fwd", "d64"): LaunchConfig(128, 64, 0, 8, 3),
    ("fwd", "d128"): LaunchConfig(128, 64, 64, 8, 3),
    ("fwd", "big"): LaunchConfig(128, 64, 64, 8, 3),
    ("bwd_rows", "d64"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_rows", "d128"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_rows", "big"): LaunchConfig(64, 64, 64, 8, 2),
    ("bwd_cols", "d64"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_cols", "d128"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_cols", "big"): LaunchConfig(64, 64, 64, 8, 2),
}
_T32 = {
    ("fwd", "d64"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd", "d128"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd", "big"): LaunchConfig(64, 64, 16, 8, 3),
    ("bwd_rows", "d64"): LaunchConfig(64, 32, 32, 8, 2),
    ("bwd_rows", "d128"): LaunchConfig(64, 32, 32, 8, 2),
    ("bwd_rows", "big"): LaunchConfig(64, 32, 32, 8, 2),
    ("bwd_cols", "d64"): LaunchConfig(64, 64, 16, 8, 2),
    ("bwd_cols", "d128"): LaunchConfig(64, 64, 16, 8, 2),
    ("bwd_cols", "big"): LaunchConfig(64, 64, 16, 8, 2),
}
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
ARCH_FAMILIES = ("sm80", "sm90")
D_BUCKETS = ("d64", "d128", "big")
KERNELS = ("fwd", "bwd_rows", "bwd_cols")

#: The shipped table: (kernel, arch family, dtype name, D bucket) -> LaunchConfig.
CONFIGS: Dict[Tuple[str, str, str, str], LaunchConfig] = {
    (k, arch, dt, db): (_T32 if dt == "fp32" else _T16)[(k, db)]
    for k in KERNELS for arch in ARCH_FAMILIES for dt in ("fp16", "bf16", "fp32") for db in D_BUCKETS
}


def _d_pad(d: int) -> int:
    return max(16, triton.next_power_of_2(max(d, 1)))


def _d_bucket(d: int) -> str:
    p = _d_pad(d)
    return "d64" if p <= 64 else ("d128" if p <= RESIDENT_MAX_D else "big")


@functools.cache
def _cuda_props(index: int) -> Tuple[str, int]:
    major, _ = torch.cuda.get_device_capability(index)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return ("sm90" if major >= 9 else "sm80"), sms


def _arch_family(device: torch.device) -> str:
    if device.type == "cuda":
        return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())[0]
    return "sm80"  # interpreter (and AOT on the meta device): the sm_80 table


def _config(kernel: str, arch: str, dtype: torch.dtype, d: int) -> Tuple[LaunchConfig, int, bool]:
    """(config, BLOCK_D, resident) for a kernel on D-dimensional rows."""
    cfg = CONFIGS[(kernel, arch, _DTYPES[dtype], _d_bucket(d))]
    resident = cfg.block_d == 0
    return cfg, (_d_pad(d) if resident else cfg.block_d), resident


# ------------------------------------------------------------------------------------------------
# launch plumbing
# ------------------------------------------------------------------------------------------------


class Launch(NamedTuple):
    """One kernel launch: also the unit the AOT compile tests and the kernel report compile."""

    name: str
    fn: object
    grid: Tuple[int, ...]
    args: Dict[str, object]  # runtime arguments by parameter name
    constexprs: Dict[str, object]
    num_warps: int
    num_stages: int

    def check(self) -> "Launch":
        """Every kernel parameter given exactly once (runtime args or constexprs)."""
        names = list(self.args) + list(self.constexprs)
        if sorted(names) != sorted(self.fn.arg_names):
            raise TypeError(f"{self.name}: launch arguments {sorted(names)} != kernel parameters "
                            f"{sorted(self.fn.arg_names)}")
        return self

    def run(self):
        self.fn[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps,
                           num_stages=self.num_stages)


class _Runner:
    """Runs launches (default) or records them (``record=True``; the AOT tests / report)."""

    def __init__(self, record: bool = False, arch: Optional[str] = None):
        self.record = record
        self.arch = arch
        self.launches: List[Launch] = []

    def __call__(self, launch: Launch):
        launch.check()
        if self.record:
            self.launches.append(launch)
        else:
            launch.run()

    def arch_of(self, device: torch.device) -> str:
        return self.arch or _arch_family(device)


def _alloc(shape, dtype, device) -> Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 tiles: 3-pass tf32 on tensor cores (~fp32 accuracy); 16-bit tiles ignore the setting
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # the interpreter's bf16 tl.dot is wrong: up-cast bf16 tiles to fp32 there (GPU: native bf16)
    return dtype == torch.bfloat16 and _interpreted()


def _rows_ok(x: Tensor) -> Tensor:
    """Rows with a contiguous inner dimension (any row stride is fine)."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _row_norms(x: Tensor, eps: float, run: _Runner) -> Tuple[Tensor, Tensor]:
    """(max(||x_i||, eps), 1 / that) in fp32, by the prologue kernel."""
    n, d = x.shape
    norm = _alloc((n,), torch.float32, x.device)
    rnorm = _alloc((n,), torch.float32, x.device)
    block_r, block_d = 32, min(_d_pad(d), 128)  # memory-bound: 32 x 128 fp32 = 32 regs at 4 warps
    run(Launch("row_norm", K.row_norm_kernel, (triton.cdiv(n, block_r),),
               dict(X=x, NORM=norm, RNORM=rnorm, N=n, D=d, stride_x=x.stride(0), eps=float(eps)),
               dict(BLOCK_R=block_r, BLOCK_D=block_d), 4, 1))
    return norm, rnorm


class _Prepared(NamedTuple):
    """Kernel-ready inputs of one core-op call (built once in forward, reused by backward)."""

    a: Tensor
    b: Tensor  # a itself when spec.same
    sym: bool  # symmetric backward (B is A and no bias: the logits are symmetric)
    norms: Tuple[Tensor, Tensor, Tensor, Tensor]  # na, ra, nb, rb (dummies without normalisation)
    pos_kind: int  # 0 no positives, 1 label equality, 2 dense mask
    row_lab: Tensor
    col_lab: Tensor
    pos_mask: Tensor
    bias_col: Optional[Tensor]
    dummy: Tensor  # stands in for every absent pointer argument (never dereferenced)


def _prepare(a: Tensor, b: Optional[Tensor], spec: CoreSpec, t: CoreTensors, run: _Runner) -> _Prepared:
    same = b is None
    if same and spec.offset != 0:
        raise ValueError("spec.same needs offset 0 (B is A)")
    dummy = torch.empty(1, dtype=torch.float32, device=a.device)
    a = _rows_ok(a)
    bb = a if same else _rows_ok(b)
    if spec.normalize:
        na, ra = _row_norms(a, spec.eps, run)
        nb, rb = (na, ra) if same else _row_norms(bb, spec.eps, run)
    else:
        na = ra = nb = rb = dummy
    pos_kind, row_lab, col_lab, pos_mask = 0, dummy, dummy, dummy
    if spec.want_pos:
        if t.pos_mask is not None:
            pos_kind, pos_mask = 2, t.pos_mask.to(torch.float32).contiguous()
        else:
            pos_kind, row_lab, col_lab = 1, t.row_labels.contiguous(), t.col_labels.contiguous()
    bias_col = t.bias_col.contiguous() if t.bias_col is not None else None
    return _Prepared(a, bb, same and bias_col is None, (na, ra, nb, rb), pos_kind, row_lab, col_lab,
                     pos_mask, bias_col, dummy)


def _problem_args(p: _Prepared, spec: CoreSpec) -> Dict[str, object]:
    """Pointer and scalar arguments shared by the three main kernels (the kernels' order)."""
    return dict(BIAS_COL=p.bias_col if p.bias_col is not None else p.dummy, ROW_LAB=p.row_lab,
                COL_LAB=p.col_lab, POS_MASK=p.pos_mask)


def _sizes(p: _Prepared, spec: CoreSpec) -> Dict[str, object]:
    return dict(N=p.a.shape[0], M=p.b.shape[0], D=p.a.shape[1], stride_a=p.a.stride(0),
                stride_b=p.b.stride(0))


def _mask_args(p: _Prepared, spec: CoreSpec) -> Dict[str, object]:
    two = p.pos_kind == 2
    return dict(offset=int(spec.offset), bias=float(spec.bias),
                n0=p.pos_mask.shape[0] if two else 1, m0=p.pos_mask.shape[1] if two else 1,
                stride_pm=p.pos_mask.stride(0) if two else 1)


def _flags(p: _Prepared, spec: CoreSpec) -> Dict[str, object]:
    dt = p.a.dtype
    return dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                HAS_BIAS=p.bias_col is not None, POS_KIND=p.pos_kind, UPCAST=_upcast(dt), DOT_PREC=_dot_prec(dt))


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------


def _check_dtypes(a: Tensor, b: Optional[Tensor]) -> torch.dtype:
    """The kernels' input dtype (both inputs are cast to it); TypeError for float64 and others."""
    for x in (a, b):
        if x is not None and x.dtype == torch.float64:
            raise TypeError(
                'backend="triton" supports float32, float16 and bfloat16 embeddings, got float64; '
                'use backend="torch" (or "reference") for float64'
            )
        if x is not None and x.dtype not in _DTYPES:
            raise TypeError(f'backend="triton" needs float32/float16/bfloat16 embeddings, got {x.dtype}')
    return a.dtype if b is None else torch.promote_types(a.dtype, b.dtype)


def _scale32(scale: Tensor) -> Tensor:
    """The scale as a 1-element fp32 device tensor: the kernels load it (a runtime value)."""
    return scale.detach().to(torch.float32).reshape(1)


def _col_programs(n_rb: int, dev: torch.device) -> int:
    """Programs of a forward with a column LSE: at most the cap, balanced (same row blocks each)."""
    if COL_PARTIAL_PROGRAMS is not None:
        cap = COL_PARTIAL_PROGRAMS
    elif dev.type == "cuda":
        cap = 2 * _cuda_props(dev.index if dev.index is not None else torch.cuda.current_device())[1]
    else:
        cap = 2
    per = triton.cdiv(n_rb, max(1, cap))
    return triton.cdiv(n_rb, per)


def _lse_fwd(a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors,
             run: Optional[_Runner] = None):
    """Forward launcher. ``a`` [N, D], ``b`` [M, D] or None (B is A), one dtype (fp32/fp16/bf16).

    Returns ``(lse [N], lse_col [M] or None, lse_pos [N] or None, prepared inputs)``, all fp32.
    """
    run = run or _Runner()
    dev = a.device
    n, d = a.shape
    p = _prepare(a, b, spec, t, run)
    m = p.b.shape[0]
    cfg, block_d, _ = _config("fwd", run.arch_of(dev), p.a.dtype, d)
    lse = _alloc((n,), torch.float32, dev)
    lse_pos = _alloc((n,), torch.float32, dev) if p.pos_kind else None
    n_rb = triton.cdiv(n, cfg.block_m)
    progs, col_part = n_rb, p.dummy
    if spec.want_col:
        progs = _col_programs(n_rb, dev)
        col_part = _alloc((progs, m), torch.float32, dev)  # every element is written by the kernel
    _, ra, _, rb = p.norms
    run(Launch(
        "lse_fwd", K.lse_fwd_kernel, (progs,),
        dict(A=p.a, B=p.b, RA=ra, RB=rb, SCALE=_scale32(scale), **_problem_args(p, spec),
             LSE=lse, LSE_POS=lse_pos if lse_pos is not None else p.dummy, COL_PART=col_part,
             **_sizes(p, spec), **_mask_args(p, spec), n_row_blocks=n_rb),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **_flags(p, spec),
             WANT_COL=bool(spec.want_col)),
        cfg.num_warps, cfg.num_stages))
    # merge the per-program partial column LSEs (fixed order: deterministic)
    lse_col = torch.logsumexp(col_part, dim=0) if spec.want_col else None
    return lse, lse_col, lse_pos, p


def _lse_bwd(p: _Prepared, scale: Tensor, spec: CoreSpec, lse: Tensor, lse_col: Optional[Tensor],
             lse_pos: Optional[Tensor], g: Optional[Tensor], g_col: Optional[Tensor],
             g_pos: Optional[Tensor], need_a: bool, need_b: bool, need_s: bool,
             run: Optional[_Runner] = None):
    """Backward launcher: ``(dA, dB, ds)`` (None where not needed); dA, dB in the kernels' input dtype.

    ``p`` comes from :func:`_lse_fwd`; ``g*`` are fp32 upstream gradients of LSE, LSEcol, LSEpos
    (None when absent). With ``p.sym`` dA holds both roles of A and dB is None. ``ds`` is a 0-dim
    fp32 tensor (no host sync anywhere).
    """
    run = run or _Runner()
    a, b = p.a, p.b
    dev = a.device
    n, d = a.shape
    m = b.shape[0]
    need_b = need_b and not p.sym
    present = [x for x in (g, g_col, g_pos) if x is not None]
    if not present:
        return (torch.zeros_like(a) if need_a else None, torch.zeros_like(b) if need_b else None,
                torch.zeros((), device=dev) if need_s else None)
    # one global scale of the upstream gradients, so the fp16 operand dl / gscale cannot underflow
    gs = torch.stack([x.abs().amax() for x in present]).amax()
    gs = torch.where(gs > 0, gs, torch.ones_like(gs)).reshape(1)
    na, ra, nb, rb = p.norms
    dm = p.dummy
    common = dict(SCALE=_scale32(scale), GSCALE=gs, **_problem_args(p, spec),
                  LSE=lse, G=g if g is not None else dm,
                  LSE_COL=lse_col if lse_col is not None else dm, G_COL=g_col if g_col is not None else dm,
                  LSE_POS=lse_pos if lse_pos is not None else dm, G_POS=g_pos if g_pos is not None else dm)
    flags = dict(**_flags(p, spec), HAS_G=g is not None, HAS_GCOL=g_col is not None, HAS_GPOS=g_pos is not None)
    arch = run.arch_of(dev)
    da = db = ds = None

    if need_a or need_s:
        cfg, block_d, resident = _config("bwd_rows", arch, a.dtype, d)
        n_rb = triton.cdiv(n, cfg.block_m)
        da = _alloc((n, d), a.dtype, dev) if need_a else dm
        acc = dm if (resident or not need_a) else torch.empty((n, d), dtype=torch.float32, device=dev)
        ds_part = _alloc((n_rb,), torch.float32, dev) if need_s else dm
        run(Launch(
            "lse_bwd_rows", K.lse_bwd_rows_kernel, (n_rb,),
            dict(A=a, B=b, RA=ra, RB=rb, NA=na, **common, DA=da, ACC=acc, DS_PART=ds_part,
                 **_sizes(p, spec), stride_da=da.stride(0) if need_a else 0, **_mask_args(p, spec),
                 eps=float(spec.eps)),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, SYM=p.sym,
                 NEED_DX=bool(need_a), NEED_DS=bool(need_s), RESIDENT=resident),
            cfg.num_warps, cfg.num_stages))
        ds = ds_part.sum() * gs.reshape(()) if need_s else None
        da = da if need_a else None

    if need_b:
        gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
        cfg, block_d, resident = _config("bwd_cols", arch, b.dtype, d)
        db = _alloc((m, d), b.dtype, dev)
        if gcols < m:
            db[gcols:].zero_()  # queue columns get no gradient
        if gcols > 0:
            acc = dm if resident else torch.empty((gcols, d), dtype=torch.float32, device=dev)
            run(Launch(
                "lse_bwd_cols", K.lse_bwd_cols_kernel, (triton.cdiv(gcols, cfg.block_n),),
                dict(A=a, B=b, RA=ra, RB=rb, NB=nb, **common, DB=db, ACC=acc, **_sizes(p, spec),
                     stride_db=db.stride(0), **_mask_args(p, spec), eps=float(spec.eps), grad_cols=gcols),
                dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, RESIDENT=resident),
                cfg.num_warps, cfg.num_stages))
    return da, db, ds


# ------------------------------------------------------------------------------------------------
# autograd Function and the core op
# ------------------------------------------------------------------------------------------------


def _present(x: Optional[Tensor]) -> Optional[Tensor]:
    """An upstream gradient as fp32, or None when absent (None or an empty placeholder)."""
    return None if x is None or x.numel() == 0 else x.to(torch.float32).contiguous()


class TritonCoreFn(torch.autograd.Function):
    """Core op (``_spec.py``) in vector mode on the Triton kernels.

    forward(a [N, D], b [M, D] or None, scale 0-dim, spec, t) -> (LSE [N], LSEcol [M] or [0],
    LSEpos [N] or [0]) in float32. Saved for backward: the inputs (alive anyway), the norms
    (O(N + M)) and the LSEs; backward recomputes the tiles. Gradients come back in each input's
    dtype (the scale's in the scale's dtype), None for inputs that do not require grad.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors):
        dt = _check_dtypes(a, b)
        ak = a.to(dt)
        bk = None if b is None else b.to(dt)
        lse, lse_col, lse_pos, p = _lse_fwd(ak, bk, scale, spec, t)
        ctx.set_materialize_grads(False)
        ctx.spec = spec
        # a, b (or their dtype-cast copies) go through save_for_backward (in-place edits are caught);
        # the rest of the prepared inputs (labels, masks, norms: O(N + M)) rides on ctx
        ctx.prep = p._replace(a=None, b=None)
        ctx.dtypes = (a.dtype, None if b is None else b.dtype, scale.dtype, scale.shape)
        ctx.save_for_backward(scale, lse, lse_col, lse_pos, p.a, None if b is None else p.b)
        empty = lse.new_empty(0)
        return lse, (lse_col if lse_col is not None else empty), (lse_pos if lse_pos is not None else empty)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g, g_col, g_pos):
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        scale, lse, lse_col, lse_pos, a, b = ctx.saved_tensors
        spec = ctx.spec
        same = ctx.dtypes[1] is None
        p = ctx.prep._replace(a=a, b=a if same else b)
        g, g_col, g_pos = _present(g), _present(g_col) if lse_col is not None else None, \
            _present(g_pos) if lse_pos is not None else None
        if same and not p.sym:
            # B is A but with a bias (never used by the losses): dA + dB of the plain kernels
            da, db, ds = _lse_bwd(p, scale, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                                  need_a, need_a, need_s)
            da = None if da is None else da + db
        else:
            da, db, ds = _lse_bwd(p, scale, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                                  need_a, need_b and not same, need_s)
        adt, bdt, sdt, sshape = ctx.dtypes
        ga = da.to(adt) if need_a and da is not None else None
        gb = db.to(bdt) if need_b and not same and db is not None else None
        gs = ds.to(sdt).reshape(sshape) if need_s and ds is not None else None
        return ga, gb, gs, None, None


def core(a: Tensor, b: Optional[Tensor], scale: Tensor, spec: CoreSpec, t: CoreTensors):
    """Core op on the Triton kernels, with the semantics of ``_torch_core.core``.

    Vector mode (``t.w_row is None``): ``(LSE [N], LSEcol [M] or empty, LSEpos [N] or empty)``, float32.
    Weighted mode: the 0-dim weighted sum, formed in PyTorch from the vector outputs.
    Raises TypeError for float64 inputs, RuntimeError for CPU tensors outside the interpreter.
    """
    _check_dtypes(a, b)
    for x in (a, b, scale):
        if x is not None and x.device.type == "cpu" and not _interpreted():
            raise RuntimeError(
                'backend="triton" on CPU tensors runs only under the Triton interpreter '
                '(TRITON_INTERPRET=1 before triton is imported); use backend="torch"'
            )
    lse, lse_col, lse_pos = TritonCoreFn.apply(a, b, scale, spec, t)
    if not t.weighted:
        return lse, lse_col, lse_pos
    return weighted_total(lse, lse_col if spec.want_col else None, lse_pos if spec.want_pos else None, t)


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation (tests/test_triton_compile.py, bench/kernel_report.py)
# ------------------------------------------------------------------------------------------------

#: Feature sets of the ahead-of-time checks: "plain" is InfoNCE with keys (the common case; the
#: kernel report's FLOP counts), "full" switches on every optional term of the non-symmetric kernels
#: (the most registers: every shipped config is compiled with it), "sym" is A-is-B with every term of
#: the symmetric backward (compiled for the row kernel's SYM path).
AOT_VARIANTS = ("plain", "full", "sym")

#: The D of each bucket compiled ahead of time: the largest D_PAD of the bucket (its worst case).
AOT_D = {"d64": 64, "d128": 128, "big": 768}

#: (compute capability, arch family) pairs of the AOT checks.
AOT_TARGETS = ((80, "sm80"), (90, "sm90"))


def variant_problem(variant: str, n: int, m: int, device="meta"):
    """(spec, tensors, b is given) of an AOT feature set, with meta (or given device) tensors."""
    dev = torch.device(device)
    if variant == "plain":
        return CoreSpec(), CoreTensors(), True
    if variant == "full":
        spec = CoreSpec(exclude_self=True, offset=3, want_col=True, want_pos=True, bias=0.5, grad_cols=m // 2)
        return spec, CoreTensors(pos_mask=torch.empty((max(1, n // 2), max(1, m // 2)), device=dev),
                                 bias_col=torch.empty(n, dtype=torch.int64, device=dev)), True
    if variant == "sym":
        spec = CoreSpec(exclude_self=True, same=True, want_col=True, want_pos=True)
        return spec, CoreTensors(pos_mask=torch.empty((max(1, n // 2), max(1, n // 2)), device=dev)), False
    raise ValueError(f"unknown AOT variant {variant!r}")


def record_core(spec: CoreSpec, t: CoreTensors, has_b: bool, dtype: torch.dtype, n: int, m: int, d: int,
                arch: str, need_a: bool = True, need_b: bool = True, need_s: bool = True) -> List[Launch]:
    """The launches of one forward + backward of the core op, recorded on the meta device (nothing
    runs, no GPU needed): exactly the argument lists of the runtime launches. The backward gets an
    upstream gradient for every output the spec produces."""
    meta = torch.device("meta")
    a = torch.empty((n, d), dtype=dtype, device=meta)
    b = torch.empty((m, d), dtype=dtype, device=meta) if has_b else None
    scale = torch.empty((), dtype=torch.float32, device=meta)
    run = _Runner(record=True, arch=arch)
    lse, lse_col, lse_pos, p = _lse_fwd(a, b, scale, spec, t, run=run)
    g = torch.empty(n, device=meta)
    g_col = None if lse_col is None else torch.empty(lse_col.shape, device=meta)
    _lse_bwd(p, scale, spec, lse, lse_col, lse_pos, g, g_col, None if lse_pos is None else g,
             need_a, need_b and has_b, need_s, run=run)
    return run.launches


def record_launches(variant: str, dtype: torch.dtype, n: int, m: int, d: int, arch: str) -> List[Launch]:
    """:func:`record_core` of an AOT feature set (see :data:`AOT_VARIANTS`)."""
    spec, t, has_b = variant_problem(variant, n, m)
    return record_core(spec, t, has_b, dtype, n, m if has_b else n, d, arch)


def aot_jobs() -> List[Tuple[int, str, str, int, int, Tuple[str, ...]]]:
    """Every distinct kernel compile behind the shipped table: ``(cc, variant, dtype, D, launch
    index, D buckets covered)`` for each kernel x config x dtype x arch, with the heaviest feature
    set of each kernel ("full"; and "sym" for the symmetric backward) at the worst-case D of each
    D bucket. Compiles that would be identical (same constexprs and options, e.g. two D buckets
    sharing a config) are listed once, with every bucket they cover."""
    jobs: Dict[tuple, list] = {}
    for cc, fam in AOT_TARGETS:
        for dt, dname in _DTYPES.items():
            for bucket, d in AOT_D.items():
                for variant in ("full", "sym"):
                    for i, launch in enumerate(record_launches(variant, dt, 4096, 4096, d, fam)):
                        if variant == "sym" and launch.name != "lse_bwd_rows":
                            continue
                        key = (cc, launch.name, dname, variant if launch.name == "lse_bwd_rows" else "",
                               tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages)
                        if key not in jobs:
                            jobs[key] = [cc, variant, dname, d, i, []]
                        if bucket not in jobs[key][5]:
                            jobs[key][5].append(bucket)
    return [(cc, v, dn, d, i, tuple(cov)) for cc, v, dn, d, i, cov in jobs.values()]


def aot_run_job(job) -> Dict[str, object]:
    """Compile one :func:`aot_jobs` entry; the :func:`compile_launch` report plus the job fields."""
    cc, variant, dname, d, i, covers = job
    dt = {v: k for k, v in _DTYPES.items()}[dname]
    fam = dict(AOT_TARGETS)[cc]
    launch = record_launches(variant, dt, 4096, 4096, d, fam)[i]
    out = compile_launch(launch, cc)
    out.update(variant=variant, dtype=dname, d=d, buckets=list(covers))
    return out


def _sig_type(v) -> str:
    if isinstance(v, Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                      torch.int64: "i64", torch.int32: "i32"}[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no triton signature type for {type(v).__name__}")


def aot_source(launch: Launch):
    """An ASTSource for ``launch`` (pointer args 16-byte aligned and ints divisible by 16 marked as
    such, as the JIT specialises a real launch on aligned tensors)."""
    from triton.compiler import ASTSource

    fn = launch.fn
    sig = {k: (_sig_type(launch.args[k]) if k in launch.args else "constexpr") for k in fn.arg_names}
    attrs = {}
    for k, v in launch.args.items():
        if isinstance(v, Tensor) or (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0 and v != 0):
            attrs[(fn.arg_names.index(k),)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)


def _ptxas_stats(ptx: str, cc: int) -> Dict[str, int]:
    """Registers and spill bytes: re-runs the ptxas triton used, with triton's flags plus -v."""
    import re
    import subprocess
    import tempfile

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


def compile_launch(launch: Launch, cc: int) -> Dict[str, object]:
    """Compile ``launch`` for GPUTarget("cuda", cc, 32) on the host (ptxas, no driver) and report
    registers, spill bytes, shared memory and the tensor-core instruction kind of its PTX."""
    from triton.backends.compiler import GPUTarget

    ck = triton.compile(aot_source(launch), target=GPUTarget("cuda", cc, 32),
                        options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    ptx = ck.asm["ptx"]
    n_wgmma = ptx.count("wgmma.mma_async")
    n_mma = ptx.count("mma.sync")
    tc = "wgmma" if n_wgmma else ("mma" if n_mma else "none")
    return dict(kernel=launch.name, cc=cc, num_warps=launch.num_warps, num_stages=launch.num_stages,
                block=" ".join(f"{k[6:]}{v}" for k, v in launch.constexprs.items() if k.startswith("BLOCK_")),
                shared=ck.metadata.shared, tc=tc, n_mma=n_mma, n_wgmma=n_wgmma, **_ptxas_stats(ptx, cc))
