"""The ahead-of-time kernel library as a route of the Triton backend: no JIT compile on first call.

Set ``FUSED_CONTRASTIVE_AOT_LIB`` to a built ``libfused_contrastive_torch.so`` (README, "C++ /
ahead-of-time kernels"). Then ``backend="triton"`` runs each core-op call the library covers on its
operators ``torch.ops.fused_contrastive_aot.lse`` / ``lse_backward`` instead of the Triton JIT kernels.
Those operators choose between the fused kernels and the panel path by the same rule as
:mod:`.triton_panel`, and launch the cubins compiled at build time.

Covered (everything else takes the JIT route as before, with the same results):

* normalised rows, no bias, no softmax over positives (the target term and label terms are O(N D)
  and stay in Python, as on every path);
* the library's modes: B given with a row LSE ("info_nce", e.g. InfoNCE / MNRL, SimCSE with two
  views) or with a row and a column LSE ("clip"), or B is A with the own column excluded ("self",
  e.g. InfoNCE of a batch against itself);
* a target margin (``CoreSpec.margin`` at ``CoreData.target``: AM-softmax, its row form as "info_nce"
  and its symmetric form as "clip") where the library was built with the feature set
  "info_nce_margin" / "clip_margin" (``build_info()["modes"]``);
* the target split (``core.PiecesFn`` with a target term asks, ``ctx.split_target``): in fp16 / bf16, modes
  "info_nce" / "clip" / "self", where the library was built with "<mode>_split" (with a target margin
  "<mode>_margin_split", "info_nce" / "clip" only) and the operators take the fused kernels (not the panel path),
  the split operators ``lse_split`` / ``lse_backward_split`` run as the JIT's fused route does
  (``target_split.merge_split``: the loss as ``softplus(LSEx - l_t)``, ``ctx.minus_target``; the exact target
  weights ``target_split.exact_weights`` in, ``ctx.moved_target`` / ``ctx.moved_less`` out). Elsewhere the call
  runs without the split, as before;
* CUDA tensors whose arch (sm_80 for 8.x, sm_90 for 9.0), dtype and D class the library was built for
  (``build_info()``); D and the row strides multiples of 16, 16-byte aligned rows, N, M < 2^31;
* eager mode (under ``torch.compile`` the registered Triton op runs).

A library that cannot be loaded is an error (the variable asks for it); a problem it does not cover is
not. ``FUSED_CONTRASTIVE_AOT_FAKE_CPU=1`` (the library's test hook) lets CPU tensors take the route, on
a mock driver: nothing is computed then, only launches are recorded.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ...routes import setting
from .. import target_split
from ..spec import Coeffs, CoreData, CoreSpec, coef_grad, combine
from ..triton_shared import panels
from ..triton_shared.configs import DTYPE_NAMES, d_pad
from . import triton_fused

__all__ = ["CALLS", "ENV", "backward", "build_info", "forward", "route"]

#: The environment variable that names the library (unset: the route is off).
ENV = "FUSED_CONTRASTIVE_AOT_LIB"
#: Core-op calls this process has run on the library (the first-GPU check reads it to tell a covered
#: call from one that fell back to the JIT kernels).
CALLS = 0


@functools.cache
def build_info(path: str) -> dict[str, frozenset[str]]:
    """Load the library at ``path`` once and return what it was built with: ``archs``, ``dtypes``,
    ``dclasses``, ``modes`` (each a set of names, from ``fused_contrastive_aot::build_info``)."""
    try:
        torch.ops.load_library(path)
        text = torch.ops.fused_contrastive_aot.build_info()
    except (OSError, RuntimeError, AttributeError) as e:
        raise RuntimeError(f"{ENV}={path!r}: cannot load libfused_contrastive_torch ({e})") from e
    out = {}
    for item in text.split():
        key, _, vals = item.partition("=")
        out[key] = frozenset(v for v in vals.split(";") if v)
    missing = {"archs", "dtypes", "dclasses", "modes"} - set(out)
    if missing:
        raise RuntimeError(f"{ENV}={path!r}: unexpected build info {text!r} (no {sorted(missing)})")
    return out


#: How the library's route treats every field of the core op's contract (``tests/test_core.py`` checks
#: that each field of CoreSpec, CoreData and Coeffs is listed): a field added to the spec must be decided
#: here (passed to the C API, required at its default by :func:`_mode`, or applied outside the Triton
#: Function) before the route can take calls that set it.
FIELDS = {
    "CoreSpec.normalize": "_mode requires True (the library normalises)",
    "CoreSpec.eps": "passed to the library",
    "CoreSpec.exclude_self": "_mode: FC_MODE_SELF (B is A, offset 0) or not routed",
    "CoreSpec.offset": "_mode requires 0 (FC_MODE_SELF)",
    "CoreSpec.bias": "_mode requires 0.0",
    "CoreSpec.grad_cols": "passed to the library (rows of dB written)",
    "CoreSpec.exclude_target": "turned into a -inf bias column before the Triton Function (core.pieces), which "
                               "_mode does not route",
    "CoreSpec.margin": "passed to the library (fc_problem.margin) in modes info_nce / clip, where route finds the "
                       "'<mode>_margin' kernels built (with the split, '<mode>_margin_split'); _mode does not route "
                       "it with B is A",
    "CoreData.target": "passed to the library as the margin's columns (fc_problem.target) when margin != 0, and as "
                       "the split's targets where _split_target takes the split (the target term is linear_terms.py's, "
                       "in PyTorch)",
    "CoreData.bias_col": "_mode requires None",
    "CoreData.row_labels": "read only for coefficient pos, which _mode requires None",
    "CoreData.col_labels": "read only for coefficient pos, which _mode requires None",
    "CoreData.pos_mask": "read only for coefficient pos, which _mode requires None",
    "Coeffs.lse": "applied in PyTorch to the library's LSE (combine)",
    "Coeffs.col": "_mode: FC_MODE_CLIP computes the column LSE",
    "Coeffs.pos": "_mode requires None",
    "Coeffs.tgt": "not seen by the Triton Function (linear_terms.py)",
    "Coeffs.set": "not seen by the Triton Function (linear_terms.py)",
}


def _mode(b: Tensor | None, spec: CoreSpec, data: CoreData, coef: Coeffs) -> str | None:
    """The library's mode ("info_nce", "clip", "self") of a core-op call, or None where its kernels do
    not cover the call (a margin needs B given and a target; :func:`route` then also needs the
    "<mode>_margin" kernels built)."""
    if coef.pos is not None or not spec.normalize or spec.bias != 0.0 or data.bias_col is not None:
        return None
    if spec.margin != 0.0 and (b is None or data.target is None):
        return None
    if b is None:
        return "self" if spec.exclude_self and spec.offset == 0 and coef.col is None else None
    if spec.exclude_self:
        return None
    return "clip" if coef.col is not None else "info_nce"


def _arch(dev: torch.device) -> str | None:
    major, minor = torch.cuda.get_device_capability(dev)
    return "80" if major == 8 else "90" if (major, minor) == (9, 0) else None


def _rows_fit(x: Tensor) -> bool:
    if x.shape[0] >= 2**31 or x.shape[1] % 16:
        return False
    if x.stride(1) != 1 and x.shape[1] > 1:
        return True  # the operator copies such rows contiguously: stride D, an aligned allocation
    return x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0


def route(a: Tensor, b: Tensor | None, spec: CoreSpec, data: CoreData, coef: Coeffs) -> str | None:
    """The library's mode for this call (``a``, ``b`` in the kernel dtype), or None: take the JIT route."""
    path = setting("AOT_LIB")
    if not path or torch.compiler.is_compiling():
        return None
    info = build_info(path)
    mode = _mode(b, spec, data, coef)
    if mode is None or (mode + "_margin" if spec.margin != 0.0 else mode) not in info["modes"]:
        return None
    if a.device.type == "cuda":
        if _arch(a.device) not in info["archs"]:
            return None
    elif not (a.device.type == "cpu" and setting("AOT_FAKE_CPU")):
        return None
    if DTYPE_NAMES[a.dtype] not in info["dtypes"]:
        return None
    dp = d_pad(a.shape[1])
    if (str(dp) if dp <= 128 else "big") not in info["dclasses"]:
        return None
    if not all(_rows_fit(x) for x in (a, b) if x is not None):
        return None
    return mode


def _scale_tensor(scale) -> Tensor:
    return scale.detach() if isinstance(scale, Tensor) else torch.tensor(float(scale), dtype=torch.float32)


def _margin_args(spec: CoreSpec, data: CoreData) -> tuple[float, Tensor | None]:
    """The operators' ``margin`` (cosine units) and ``target`` ([N] int64, the margin's columns; None
    without a margin)."""
    if spec.margin == 0.0:
        return 0.0, None
    return float(spec.margin), data.target


def _split_target(ctx, a: Tensor, b: Tensor | None, spec: CoreSpec, data: CoreData, coef: Coeffs,
                  mode: str) -> Tensor | None:
    """The targets to keep out of the statistics and the 16-bit tiles (the JIT's fused split, ``triton_function``:
    ``core.PiecesFn`` asks with a target term, no softmax over positives, a row LSE term, fp16 / bf16), where the
    library has the "<mode>_split" kernels (with a target margin "<mode>_margin_split": the margin's targets are the
    split's) and its operators take the fused kernels; else None."""
    if not getattr(ctx, "split_target", False) or data.target is None or coef.pos is not None or coef.lse is None:
        return None
    if a.dtype not in (torch.float16, torch.bfloat16):
        return None
    m = a.shape[0] if b is None else b.shape[0]
    want = mode + ("_margin_split" if spec.margin != 0.0 else "_split")
    if want not in build_info(setting("AOT_LIB"))["modes"] or panels.use_panel(a, a.shape[0], m):
        return None
    return data.target


def forward(ctx, a: Tensor, b: Tensor | None, dtypes, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
            reduce: bool, mode: str) -> Tensor:
    """TritonCoreFn.forward on the library's operators (``a``, ``b`` in the kernel dtype; ``data``: the
    margin's targets, when ``spec.margin != 0``, and the split's, see :func:`_split_target`)."""
    global CALLS
    CALLS += 1
    ctx.split = _split_target(ctx, a, b, spec, data, coef, mode)
    if ctx.split is not None:
        return _forward_split(ctx, a, b, dtypes, scale, spec, coef, reduce, mode)
    margin, target = _margin_args(spec, data)
    lse, lse_col, ws = torch.ops.fused_contrastive_aot.lse(a, b, _scale_tensor(scale), mode, float(spec.eps), margin,
                                                           target)
    clip = mode == "clip"
    ctx.path, ctx.mode, ctx.spec, ctx.coef, ctx.dtypes = "aot", mode, spec, coef, dtypes
    ctx.margin, ctx.target = margin, target
    ctx.scale = None if isinstance(scale, Tensor) else scale
    ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col if clip else None, a, b, ws)
    return combine(coef.to(torch.float32), reduce, lse, lse_col if clip else None)


def _forward_split(ctx, a: Tensor, b: Tensor | None, dtypes, scale, spec: CoreSpec, coef: Coeffs, reduce: bool,
                   mode: str) -> Tensor:
    """:func:`forward` with the target split: the operators' ``LSEx``, ``LSEcolx`` and ``LT``, merged on the host as
    the JIT's ``triton_fused._lse_fwd`` does."""
    clip = mode == "clip"
    lse_x, lse_col_x, lt, ws = torch.ops.fused_contrastive_aot.lse_split(a, b, _scale_tensor(scale), mode,
                                                                         float(spec.eps), ctx.split, float(spec.margin))
    minus: dict = {}
    lse, lse_col = target_split.merge_split(lse_x, lse_col_x if clip else None, lt, ctx.split, False, minus)
    ctx.path, ctx.mode, ctx.spec, ctx.coef, ctx.dtypes = "aot", mode, spec, coef, dtypes
    ctx.margin, ctx.target = float(spec.margin), None  # (a margin's targets are the split's, ctx.split)
    ctx.scale = None if isinstance(scale, Tensor) else scale
    ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col, a, b, ws)
    ctx.minus_target = target_split.minus_coefficients(coef, minus, a.shape[0])
    # the statistics of the backward's exact target weights and their coefficients (no library mode is B is A with
    # a column term)
    triton_fused.keep_exact(ctx, minus, ctx.minus_target, False, False)
    return combine(coef.to(torch.float32), reduce, minus["loss"], minus.get("col_loss", lse_col))


def backward(ctx, go: Tensor):
    """TritonCoreFn.backward on the library's operators."""
    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    scale_in, lse, lse_col, a, b, ws = ctx.saved_tensors
    scale = _scale_tensor(scale_in if scale_in is not None else ctx.scale)
    go = go.to(torch.float32)
    n = lse.shape[0]
    g = coef_grad(ctx.coef.lse, go, n, lse)
    if g is None:
        g = torch.zeros(n, dtype=torch.float32, device=lse.device)
    g_col = coef_grad(ctx.coef.col, go, lse_col.shape[0], lse_col) if lse_col is not None else None
    if getattr(ctx, "split", None) is not None:
        # each row's weight at its target combined with the target term's share (without the cancellation of p_t - 1)
        w = triton_fused.backward_exact(ctx, ctx.split, g, g_col, lse_col)
        da, db, ds, ctx.moved_target = torch.ops.fused_contrastive_aot.lse_backward_split(
            a, b, scale, ctx.mode, float(ctx.spec.eps), ws, lse, lse_col, g, g_col, bool(need_b and b is not None),
            ctx.spec.grad_cols, ctx.split, w, ctx.margin)  # moved_target: what core.PiecesFn applies with the target
        ctx.moved_less = ctx.exact_less  # (the target term leaves these coefficients out: core.backward_parts)
    else:
        da, db, ds = torch.ops.fused_contrastive_aot.lse_backward(
            a, b, scale, ctx.mode, float(ctx.spec.eps), ws, lse, lse_col, g, g_col, bool(need_b and b is not None),
            ctx.spec.grad_cols, ctx.margin, ctx.target)
    adt, bdt, sdt, sshape = ctx.dtypes
    return (da.to(adt) if need_a else None,
            db.to(bdt) if need_b and b is not None and db.numel() else None,
            ds.to(sdt).reshape(sshape) if need_s and scale_in is not None else None,
            None, None, None, None)
