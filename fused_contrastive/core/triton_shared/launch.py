"""What every family's Triton host shares: the launch record and its one entry point (:func:`_launch`, which
``fused_contrastive.tools.compile_survey`` switches to recording through :data:`_RECORDER`, so the ahead-of-time
compiles see exactly the runtime argument lists), the CUDA properties, allocation (NaN-poisoned under
:data:`POISON_OUTPUTS`), the prepared problem of the core op's fields (``_prepare``: masks, labels, targets and
their kernel arguments), the row-norm prologue (``_row_norms``), the temperature and upstream-gradient scalars.

Nothing touches the GPU driver at import time. On CPU tensors the kernels run only under the Triton interpreter
(``TRITON_INTERPRET=1`` before triton is imported); backend resolution checks that.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ..._tracing import tensors_are_traced
from ...kernels import common as KC
from ...kernels import target as _target_kernels  # noqa: F401 (decorated with the others: interpreted or compiled alike)
from ...routes import setting
from ..spec import CoreData, CoreSpec, coef_grad
from .configs import DTYPE_NAMES, ROW_NORM_BLOCK_R, ROW_NORM_MAX_BLOCK_D, ROW_NORM_WARPS, d_pad

__all__ = ["Launch", "interpreted", "kernel_dtype"]

#: Debug hook for the tests: fill every kernel output with NaN before the launch, so an element a
#: kernel forgets to write shows up. Also settable with FUSED_CONTRASTIVE_TRITON_POISON=1.
POISON_OUTPUTS = bool(setting("TRITON_POISON"))


def interpreted() -> bool:
    """True when triton was imported in interpreter mode (its jit functions are interpreted)."""
    return type(KC.row_norm_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------------------------------------
# launches
# ------------------------------------------------------------------------------------------------


class Launch(NamedTuple):
    """One kernel launch: also the unit the ahead-of-time compiles and the kernel report compile."""

    name: str
    fn: object
    grid: tuple[int, ...]
    args: dict[str, object]  # runtime arguments by parameter name
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    # ptxas's register ceiling (``.maxnreg``); None: its own choice. Without it ptxas settles some kernels
    # at 128 registers (two CTAs of 8 warps per SM) and spills rather than use more (kernels/matryoshka.py)
    maxnreg: int | None = None

    def options(self) -> dict[str, int]:
        """The launch / compile options: warps, stages and the register ceiling when set."""
        out = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            out["maxnreg"] = self.maxnreg
        return out

    def check(self) -> Launch:
        """Every kernel parameter given exactly once (runtime args or constexprs)."""
        names = list(self.args) + list(self.constexprs)
        if sorted(names) != sorted(self.fn.arg_names):
            raise TypeError(f"{self.name}: launch arguments {sorted(names)} != kernel parameters "
                            f"{sorted(self.fn.arg_names)}")
        return self

    def run(self) -> None:
        self.fn[self.grid](**self.args, **self.constexprs, **self.options())


class Recorder(NamedTuple):
    """Where launches go instead of running (set by ``tools.compile_survey.recording``), and the arch family
    whose configs to use (the tensors are on the meta device, which has none)."""

    arch: str
    launches: list[Launch]


_RECORDER: Recorder | None = None


def _launch(launch: Launch) -> None:
    launch.check()
    if _RECORDER is not None:
        _RECORDER.launches.append(launch)
    elif tensors_are_traced():
        # make_fx / Inductor tracing the host code (fake tensors): the launch becomes a
        # triton_kernel_wrapper node of the graph. Eagerly the kernel is called directly (wrap_triton
        # outside a trace costs a higher-order-op dispatch per launch).
        from torch.library import wrap_triton

        wrap_triton(launch.fn)[launch.grid](**launch.args, **launch.constexprs, **launch.options())
    else:
        launch.run()


@functools.cache
def _cuda_props(index: int) -> tuple[str, int]:
    if not torch.cuda.is_available():
        # fake CUDA tensors on a machine without a GPU (tracing the host code): the sm_80 table, A100
        return "sm80", 108
    major, _ = torch.cuda.get_device_capability(index)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return ("sm90" if major >= 9 else "sm80"), sms


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _arch(device: torch.device) -> str:
    if _RECORDER is not None:
        return _RECORDER.arch
    if device.type == "cuda":
        return _cuda_props(_index(device))[0]
    return "sm80"  # the interpreter runs the sm_80 table


def _alloc(shape, dtype, device) -> Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 tiles: 3-pass tf32 on tensor cores (~fp32 accuracy); 16-bit tiles ignore the setting
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # the interpreter's bf16 tl.dot is wrong: up-cast bf16 tiles to fp32 there (GPU: native bf16)
    return dtype == torch.bfloat16 and interpreted()


def _rows_ok(x: Tensor) -> Tensor:
    """Rows with a contiguous inner dimension (any row stride is fine)."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _row_norms(x: Tensor, eps: float, norm: Tensor | None = None,
               rnorm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(copy of x scaled by a power of two per row, in x's dtype; max(||x_i||, eps); 1 / that; the
    inverse clamped norm of the scaled row) by the prologue kernel; ``norm`` / ``rnorm``: [N] fp32
    outputs to write into (e.g. slices of a longer vector) instead of new ones."""
    n, d = x.shape
    xs = _alloc((n, d), x.dtype, x.device)
    norm = _alloc((n,), torch.float32, x.device) if norm is None else norm
    rnorm = _alloc((n,), torch.float32, x.device) if rnorm is None else rnorm
    rs = _alloc((n,), torch.float32, x.device)
    _launch(Launch("row_norm", KC.row_norm_kernel, (triton.cdiv(n, ROW_NORM_BLOCK_R),),
                   dict(X=x, XS=xs, NORM=norm, RNORM=rnorm, RS=rs, N=n, D=d, stride_x=x.stride(0),
                        stride_xs=xs.stride(0), eps=float(eps)),
                   dict(BLOCK_R=ROW_NORM_BLOCK_R, BLOCK_D=min(d_pad(d), ROW_NORM_MAX_BLOCK_D)),
                   ROW_NORM_WARPS, 1))
    return xs, norm, rnorm, rs


class _Prepared(NamedTuple):
    """Kernel-ready inputs of one core-op call (built once in forward, reused by backward)."""

    a: Tensor  # raw rows (the normalisation backward reads them)
    b: Tensor  # a itself when B is A
    sa: Tensor  # the rows scaled by a power of two (the raw rows without normalisation): the tiles'
    sb: Tensor
    sym: bool  # symmetric backward (B is A and no bias: the logits are symmetric)
    norms: tuple[Tensor, ...]  # na, ra, nb, rb, rsa, rsb (dummies without normalisation)
    pos_kind: int  # 0 no positives, 1 label equality, 2 dense mask
    row_lab: Tensor
    col_lab: Tensor
    pos_mask: Tensor
    bias_col: Tensor | None
    dummy: Tensor  # stands in for every absent pointer argument (never dereferenced)


def _compact_mask(mask: Tensor) -> Tensor:
    """The dense positive mask as the kernels read it, chosen by dtype: bool / uint8 (0/1 weights) stay
    1 byte per entry (bool viewed as uint8, no copy); any other dtype holds general non-negative
    weights and is read as float32 (4 bytes per entry; no copy when it already is float32)."""
    if mask.dtype == torch.bool:
        return mask.contiguous().view(torch.uint8)
    if mask.dtype == torch.uint8:
        return mask.contiguous()
    return mask.to(torch.float32).contiguous()


def _prepare_data(a: Tensor, b: Tensor | None, spec: CoreSpec, data: CoreData, want_pos: bool) -> _Prepared:
    """The non-embedding inputs (labels, mask, bias columns) of :func:`_prepare`, without the row-norm
    prologue (``sa``, ``sb`` None, norms dummies): what the panel path needs."""
    same = b is None
    if same and spec.offset != 0:
        raise ValueError("core: B is A needs offset 0")
    dummy = torch.empty(1, dtype=torch.float32, device=a.device)
    a = _rows_ok(a)
    bb = a if same else _rows_ok(b)
    pos_kind, row_lab, col_lab, pos_mask = 0, dummy, dummy, dummy
    if want_pos:
        if data.pos_mask is not None:
            pos_kind, pos_mask = 2, _compact_mask(data.pos_mask)
        else:
            pos_kind, row_lab, col_lab = 1, data.row_labels.contiguous(), data.col_labels.contiguous()
    bias_col = data.bias_col.contiguous() if data.bias_col is not None and spec.bias != 0.0 else None
    if spec.margin != 0.0:  # the target margin rides on the bias column, in cosine units (BIAS_COS)
        bias_col = data.target.contiguous()
    return _Prepared(a, bb, None, None, same and bias_col is None, (dummy,) * 6, pos_kind, row_lab,
                     col_lab, pos_mask, bias_col, dummy)


def _prepare(a: Tensor, b: Tensor | None, spec: CoreSpec, data: CoreData, want_pos: bool) -> _Prepared:
    p = _prepare_data(a, b, spec, data, want_pos)
    if spec.normalize:
        sa, na, ra, rsa = _row_norms(p.a, spec.eps)
        sb, nb, rb, rsb = (sa, na, ra, rsa) if b is None else _row_norms(p.b, spec.eps)
        return p._replace(sa=sa, sb=sb, norms=(na, ra, nb, rb, rsa, rsb))
    return p._replace(sa=p.a, sb=p.b)


def _problem_args(p: _Prepared) -> dict[str, object]:
    """Pointer arguments shared by the three main kernels."""
    return dict(BIAS_COL=p.bias_col if p.bias_col is not None else p.dummy, ROW_LAB=p.row_lab,
                COL_LAB=p.col_lab, POS_MASK=p.pos_mask)


def _sizes(p: _Prepared) -> dict[str, object]:
    return dict(N=p.a.shape[0], M=p.b.shape[0], D=p.a.shape[1], stride_sa=p.sa.stride(0),
                stride_sb=p.sb.stride(0))


def _mask_args(p: _Prepared, spec: CoreSpec) -> dict[str, object]:
    two = p.pos_kind == 2
    return dict(offset=int(spec.offset), bias=-float(spec.margin) if spec.margin != 0.0 else float(spec.bias),
                n0=p.pos_mask.shape[0] if two else 1, m0=p.pos_mask.shape[1] if two else 1,
                stride_pm=p.pos_mask.stride(0) if two else 1)


def _flags(p: _Prepared, spec: CoreSpec) -> dict[str, object]:
    dt = p.a.dtype
    return dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                HAS_BIAS=p.bias_col is not None, BIAS_COS=spec.margin != 0.0, POS_KIND=p.pos_kind, UPCAST=_upcast(dt),
                DOT_PREC=_dot_prec(dt))


def prescale(dtype: torch.dtype) -> float:
    """The power of two the gradient tile is multiplied by before its cast to the operand dtype (see
    kernels/lse.py, "Numerics"): 2^13 for fp16, 1 for bf16 / fp32 (their exponent range is fp32's)."""
    return 8192.0 if dtype == torch.float16 else 1.0


def kernel_dtype(a: Tensor, b: Tensor | None) -> torch.dtype:
    """The kernels' input dtype (both inputs are cast to it); TypeError for float64 and others."""
    for x in (a, b):
        if x is not None and x.dtype not in DTYPE_NAMES:
            raise TypeError(f'backend="triton" takes float32, float16 or bfloat16 embeddings, got {x.dtype}; '
                            'use backend="torch" (or "reference") for float64')
    return a.dtype if b is None else torch.promote_types(a.dtype, b.dtype)


def _scale32(scale, device) -> Tensor:
    """The scale as a 1-element fp32 device tensor: the kernels load it (a runtime value)."""
    if isinstance(scale, Tensor):
        return scale.detach().to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def _gscale(*grads: Tensor | None) -> Tensor | None:
    """One global scale of the upstream gradients, ``max |g|`` ([1] fp32; 1 when they are all 0), so that
    the 16-bit operand ``dl / gscale`` cannot underflow; None when no gradient is present."""
    present = [x for x in grads if x is not None]
    if not present:
        return None
    gs = torch.stack([x.abs().amax() for x in present]).amax()
    return torch.where(gs > 0, gs, torch.ones_like(gs)).reshape(1)


_coef_grad = coef_grad  # the name the Triton paths use


def _col_programs(n_rb: int, dev: torch.device) -> int:
    """Programs of a forward with a column LSE (each owns one row of the [P, M] partial buffer): at most the cap,
    balanced (same row blocks each). The cap: the switchboard's hook ``COL_PARTIAL_PROGRAMS`` when set, else 2 x
    the number of SMs on a GPU, 2 under the interpreter (so the multi-row-block path of a program is exercised
    by small test shapes)."""
    if setting("COL_PARTIAL_PROGRAMS") is not None:
        cap = setting("COL_PARTIAL_PROGRAMS")
    elif dev.type == "cuda":
        cap = 2 * _cuda_props(_index(dev))[1]
    else:
        cap = 2
    per = triton.cdiv(n_rb, max(1, cap))
    return triton.cdiv(n_rb, per)


def _no_grads(a: Tensor, b: Tensor, need_a: bool, need_b: bool, need_s: bool):
    """``(dA, dB, ds)`` of a backward without upstream gradients: zeros where needed."""
    return (torch.zeros_like(a) if need_a else None, torch.zeros_like(b) if need_b else None,
            torch.zeros((), device=a.device) if need_s else None)


def with_positives(p: _Prepared, a: Tensor, b: Tensor | None, spec: CoreSpec, data: CoreData) -> _Prepared:
    """``p`` with the positives' fields (labels or mask) prepared, for a backward that forms SET's weights
    while its forward (no softmax over positives) ran without them."""
    q = _prepare_data(a, b, spec, data, True)
    return p._replace(pos_kind=q.pos_kind, row_lab=q.row_lab, col_lab=q.col_lab, pos_mask=q.pos_mask)
