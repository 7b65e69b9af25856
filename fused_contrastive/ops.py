"""The losses as registered PyTorch operators (``torch.ops.fused_contrastive.*``), for ``torch.compile``,
``torch.export`` and CUDA graphs.

Eagerly the losses run their autograd Functions directly (no dispatcher overhead). When Dynamo or
export traces them (:func:`tracing_route`), the same work runs as opaque operators with fake
(shape-only) implementations and registered autograd, so a compiled step has no graph break inside
the loss, traces no Python chunk loop, and never specialises on the batch size:

``fused_contrastive::core``
    The core op of ``core/spec.py`` on the torch backend (dense tile or chunked + linear terms) or on
    the Triton kernels under the interpreter. Returns ``(out, grad_a, grad_b, grad_scale)``: with a
    summed output (``reduce``) the gradients for an upstream gradient of 1 are formed in the same
    pass (as the eager Functions do) and the registered backward scales them; with per-row output
    they are empty and the backward calls ``core_backward``, which recomputes the forward (one extra
    pass over the tiles: the eager path keeps its saved statistics instead).
``fused_contrastive::triton_core``
    The same schema as a :func:`torch.library.triton_op`: on CUDA, Inductor traces its host code and
    sees the Triton kernels (through ``wrap_triton``) instead of an opaque call.
``fused_contrastive::merged_lse``
    The merged-block core of ``core/guided/torch_blocks.py`` (GIST, ``info_nce(guide=, ids=)``): several column
    blocks in one softmax per row with the guide / id masks formed per tile, on the torch sweep or the
    Triton kernels; ``(out, grads of xs, grad_scale)`` like the core op (``merged_lse_backward``
    recomputes for per-row output).
``fused_contrastive::cosent_scores``, ``fused_contrastive::cosent_pairs``
    CoSENT from scores and from embedding pairs, either backend; ``(loss, grads...)`` likewise (the
    loss is a sum over pairs, so its gradients are always formed in the forward). On CUDA the Triton
    path is ``triton_cosent_scores`` / ``triton_cosent_pairs``, the same as ``triton_op`` s.

The implementations call the forward and backward of the autograd Functions in ``core/`` directly
(autograd does not record inside an operator), through ``core.spec.DirectCtx``. Arguments that could change
with the batch size (the offset of the anchors, ``grad_cols``) are ``SymInt``; coefficients that are
the same number for every row are ``float`` and must not depend on N (the losses pass weights 1 and
divide outside the op under compile, or a tensor).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import fields

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import core as _core
from ._amp import autocast_off
from ._tracing import forced, set_traced_core, set_traced_op, tensors_are_traced, tracing_route
from .core.spec import Coeffs, CoreData, CoreSpec, DirectCtx, compute_dtype

__all__ = ["core", "cosent_pairs", "cosent_scores", "forced", "merged_lse", "siglip", "siglip_groups",
           "tensors_are_traced", "tracing_route"]

_NAN = float("nan")
_COEF_NAMES = tuple(f.name for f in fields(Coeffs))


def _run(parts, need: Sequence[bool], go: Tensor | None):
    """Forward of every ``(Function, args, sign)`` part, summed with its sign; with ``go``, also the
    gradients of the first three arguments (a, b, scale) for the upstream gradient ``go``, summed in
    fp32 before one cast to a's and b's dtypes (``core.PiecesFn``)."""
    out, subs = _core.forward_parts(parts, need)
    if go is None:
        return out, [None, None, None]
    a, b = parts[0][1][:2]
    return out, _core.backward_parts(subs, go, (a.dtype, None if b is None else b.dtype))


def _empty(like: Tensor | None, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.float32 if like is None else like.dtype, device=device)


def _grad_or_empty(g: Tensor | None, like: Tensor | None, need: bool, device: torch.device) -> Tensor:
    """The gradient as the operator returns it: contiguous, zeros when ``need`` but no part wrote one
    (the dense path folds the anchors' gradient into B's rows when A is a slice of B), an empty
    tensor on ``device`` when not needed."""
    if like is None or not need:
        return _empty(like, device)
    if g is None:
        return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return g.contiguous()


def _fake_grad(like: Tensor | None, need: bool, device: torch.device) -> Tensor:
    return _empty(like, device) if like is None or not need else like.new_empty(like.shape)


# ------------------------------------------------------------------------------------------------
# the core op
# ------------------------------------------------------------------------------------------------

# The operator's flat arguments, derived from the spec dataclasses (a field added to CoreSpec, CoreData
# or Coeffs reaches the schema, _flatten, _unflatten and triton_core's signature from here):
#   a, b, scale_t, scale_f, <CoreData fields>, coef_t, coef_v, <CoreSpec fields>, reduce, backend, need
# CoreData fields are optional tensors; Coeffs become two lists (the tensor or the number of each
# coefficient, NaN for "absent"); CoreSpec fields by their annotation (_SPEC_TYPES). Integers are
# SymInt (an offset or grad_cols may change with the batch size).
_SPEC_TYPES = {"bool": ("bool", bool), "float": ("float", float), "int": ("SymInt", int),
               "int | None": ("SymInt?", int | None)}


def _layout() -> list[tuple[str, str, object]]:
    """``(name, schema type, Python type)`` of every flat argument, in order."""
    out = [("a", "Tensor", Tensor), ("b", "Tensor?", Tensor | None), ("scale_t", "Tensor?", Tensor | None),
           ("scale_f", "float", float)]
    for f in fields(CoreData):
        if f.type != "Tensor | None":
            raise TypeError(f"CoreData.{f.name}: the core op carries only optional tensors in CoreData, "
                            f"got {f.type!r} (a static option belongs in CoreSpec)")
        out.append((f.name, "Tensor?", Tensor | None))
    out += [("coef_t", "Tensor?[]", list[Tensor | None]), ("coef_v", "float[]", list[float])]
    for f in fields(CoreSpec):
        if f.type not in _SPEC_TYPES:
            raise TypeError(f"CoreSpec.{f.name}: no operator type for {f.type!r}; add it to ops._SPEC_TYPES")
        out.append((f.name, *_SPEC_TYPES[f.type]))
    out += [("reduce", "bool", bool), ("backend", "str", str), ("need", "bool[]", list[bool])]
    return out


_LAYOUT = _layout()
_NAMES = tuple(name for name, _, _ in _LAYOUT)
_POS = {name: i for i, name in enumerate(_NAMES)}
_CORE_ARGS = ", ".join(f"{t} {name}" for name, t, _ in _LAYOUT)
_N_CORE_ARGS = len(_LAYOUT)
_TENSOR_ARGS = tuple(i for i, (_, t, _) in enumerate(_LAYOUT) if t in ("Tensor", "Tensor?"))
_SPEC_FIELDS = tuple(f.name for f in fields(CoreSpec))
_DATA_FIELDS = tuple(f.name for f in fields(CoreData))


def _unflatten(args: tuple):
    """The flat operator arguments back to ``(backend, a, b, scale, spec, data, coef, reduce, need)``."""
    got = dict(zip(_NAMES, args, strict=True))
    scale = got["scale_t"] if got["scale_t"] is not None else got["scale_f"]
    spec = CoreSpec(**{k: got[k] for k in _SPEC_FIELDS})
    data = CoreData(**{k: got[k] for k in _DATA_FIELDS})
    vals = {}
    for name, t, v in zip(_COEF_NAMES, got["coef_t"], got["coef_v"], strict=True):
        vals[name] = t if t is not None else (None if math.isnan(v) else v)
    return got["backend"], got["a"], got["b"], scale, spec, data, Coeffs(**vals), got["reduce"], got["need"]


def _flatten(backend: str, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData,
             coef: Coeffs, reduce: bool, need: Sequence[bool]) -> tuple:
    coefs = [getattr(coef, k) for k in _COEF_NAMES]
    got = {"a": a, "b": b, "scale_t": scale if isinstance(scale, Tensor) else None,
           "scale_f": 0.0 if isinstance(scale, Tensor) else float(scale),
           "coef_t": [c if isinstance(c, Tensor) else None for c in coefs],
           "coef_v": [_NAN if c is None or isinstance(c, Tensor) else float(c) for c in coefs],
           "reduce": reduce, "backend": backend, "need": list(need),
           **{k: getattr(spec, k) for k in _SPEC_FIELDS}, **{k: getattr(data, k) for k in _DATA_FIELDS}}
    return tuple(got[k] for k in _NAMES)


@autocast_off
def _core_impl(*args):
    backend, a, b, scale, spec, data, coef, reduce, need = _unflatten(args)
    parts = _core.pieces(backend, a, b, scale, spec, data, coef, reduce)
    grad = reduce and any(need)
    out, (ga, gb, gs) = _run(parts, need, torch.ones((), dtype=compute_dtype(a, b), device=a.device)
                             if grad else None)
    scale_t = args[_POS["scale_t"]]
    dev = a.device
    return (out, _grad_or_empty(ga, a, need[0] and grad, dev), _grad_or_empty(gb, b, need[1] and grad, dev),
            _grad_or_empty(gs, scale_t, need[2] and grad, dev))


def _core_fake(*args):
    a, b, scale_t, reduce, need = (args[_POS[k]] for k in ("a", "b", "scale_t", "reduce", "need"))
    out = a.new_empty(() if reduce else (a.shape[0],), dtype=compute_dtype(a, b))
    grad = reduce and any(need)
    dev = a.device
    return (out, _fake_grad(a, need[0] and grad, dev), _fake_grad(b, need[1] and grad, dev),
            _fake_grad(scale_t, need[2] and grad, dev))


@autocast_off
def _core_backward_impl(*args):
    *fwd, go = args
    backend, a, b, scale, spec, data, coef, reduce, need = _unflatten(tuple(fwd))
    parts = _core.pieces(backend, a, b, scale, spec, data, coef, reduce)
    _, (ga, gb, gs) = _run(parts, need, go.to(compute_dtype(a, b)))
    dev = a.device
    return (_grad_or_empty(ga, a, need[0], dev), _grad_or_empty(gb, b, need[1], dev),
            _grad_or_empty(gs, fwd[_POS["scale_t"]], need[2], dev))


def _core_backward_fake(*args):
    a, b, scale_t, need = (args[_POS[k]] for k in ("a", "b", "scale_t", "need"))
    dev = a.device
    return _fake_grad(a, need[0], dev), _fake_grad(b, need[1], dev), _fake_grad(scale_t, need[2], dev)


def _core_setup(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1:])
    ctx.reduce = inputs[_POS["reduce"]]
    if ctx.reduce:
        ctx.save_for_backward(*output[1:])
        return
    # per-row output: the backward recomputes from the inputs
    ct = _POS["coef_t"]
    ctx.save_for_backward(*(inputs[i] for i in _TENSOR_ARGS), *inputs[ct])
    ctx.inputs = [None if i in _TENSOR_ARGS or i == ct else v for i, v in enumerate(inputs)]


def _core_backward(ctx, go, *_unused):
    if ctx.reduce:
        ga, gb, gs = ctx.saved_tensors
        need = [x.numel() > 0 for x in (ga, gb, gs)]
    else:
        saved = ctx.saved_tensors
        args = list(ctx.inputs)
        for k, i in enumerate(_TENSOR_ARGS):
            args[i] = saved[k]
        args[_POS["coef_t"]] = list(saved[len(_TENSOR_ARGS):])
        need = args[_POS["need"]]
        ga, gb, gs = torch.ops.fused_contrastive.core_backward(*args, go)
        go = None
    grads = [None] * _N_CORE_ARGS
    for i, (g, nd) in enumerate(zip((ga, gb, gs), need, strict=True)):
        if nd and ctx.needs_input_grad[i]:
            grads[i] = g if go is None else g * go.to(g.dtype)
    return tuple(grads)


_core_op = torch.library.custom_op("fused_contrastive::core", _core_impl, mutates_args=(),
                                   schema=f"({_CORE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")
_core_op.register_fake(_core_fake)
_core_bwd_op = torch.library.custom_op("fused_contrastive::core_backward", _core_backward_impl, mutates_args=(),
                                       schema=f"({_CORE_ARGS}, Tensor go) -> (Tensor, Tensor, Tensor)")
_core_bwd_op.register_fake(_core_backward_fake)
_core_op.register_autograd(_core_backward, setup_context=_core_setup)


def _needs(*xs) -> list[bool]:
    grad = torch.is_grad_enabled()
    return [grad and isinstance(x, Tensor) and x.requires_grad for x in xs]


def core(backend: str, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
         reduce: bool) -> Tensor:
    """``core.run`` as the registered operator (``fused_contrastive::core``, or ``triton_core`` for the
    Triton kernels on CUDA). Same arguments and result."""
    need = _needs(a, b, scale)
    op = torch.ops.fused_contrastive.core
    if backend == "triton" and a.device.type == "cuda":
        op = _triton_core_op()
    return op(*_flatten(backend, a, b, scale, spec, data, coef, reduce, need))[0]


set_traced_core(core)  # core.run reaches the registered operator through this (no core -> ops import)

_TRITON_OP = None


@autocast_off
def _triton_core_impl(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_core_impl`` with a typed signature (``triton_op`` infers its schema from it: the same as
    ``fused_contrastive::core``'s, which a test checks)."""
    return _core_impl(*_TRITON_SIG.bind(*args, **kwargs).args)


_TRITON_SIG = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=py)
                                 for name, _, py in _LAYOUT],
                                return_annotation=tuple[Tensor, Tensor, Tensor, Tensor])
_triton_core_impl.__signature__ = _TRITON_SIG


def _triton_core_op():
    """``fused_contrastive::triton_core``, registered on first use (importing triton is slow)."""
    global _TRITON_OP
    if _TRITON_OP is None:
        op = torch.library.triton_op("fused_contrastive::triton_core", _triton_core_impl, mutates_args=())
        op.register_autograd(_core_backward, setup_context=_core_setup)
        _TRITON_OP = torch.ops.fused_contrastive.triton_core
    return _TRITON_OP


# ------------------------------------------------------------------------------------------------
# CoSENT
# ------------------------------------------------------------------------------------------------


@autocast_off
def _cosent_scores_impl(scores: Tensor, labels: Tensor, scale_t: Tensor | None, scale_f: float, backend: str,
                        need: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    from .core.cosent.torch_cosent import ScoresCosentFn

    fn = ScoresCosentFn
    if backend == "triton":
        from .core.cosent.triton_cosent import TritonScoresCosentFn as fn
    scale = scale_t if scale_t is not None else scale_f
    needs = (need[0], False, need[1])
    out, (gx, _, gs) = _run([(fn, (scores, labels, scale), 1.0)], needs,
                            torch.ones((), dtype=compute_dtype(scores), device=scores.device)
                            if any(need) else None)
    dev = scores.device
    return out, _grad_or_empty(gx, scores, need[0], dev), _grad_or_empty(gs, scale_t, need[1], dev)


@autocast_off
def _cosent_pairs_impl(u: Tensor, v: Tensor, labels: Tensor, scale_t: Tensor | None, scale_f: float,
                       normalize: bool, eps: float, backend: str,
                       need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from .core.cosent.torch_cosent import PairCosentFn

    fn = PairCosentFn
    if backend == "triton":
        from .core.cosent.triton_cosent import TritonPairCosentFn as fn
    scale = scale_t if scale_t is not None else scale_f
    ctx = DirectCtx((need[0], need[1], False, need[2], False, False))
    out = fn.forward(ctx, u, v, labels, scale, normalize, eps)
    gu = gv = gs = None
    if any(need):
        gu, gv, _, gs, _, _ = fn.backward(ctx, torch.ones((), dtype=out.dtype, device=out.device))
    dev = u.device
    return (out, _grad_or_empty(gu, u, need[0], dev), _grad_or_empty(gv, v, need[1], dev),
            _grad_or_empty(gs, scale_t, need[2], dev))


_cosent_scores_op = torch.library.custom_op("fused_contrastive::cosent_scores", _cosent_scores_impl,
                                            mutates_args=())
_cosent_pairs_op = torch.library.custom_op("fused_contrastive::cosent_pairs", _cosent_pairs_impl,
                                           mutates_args=())


@_cosent_scores_op.register_fake
def _(scores, labels, scale_t, scale_f, backend, need):
    dev = scores.device
    return (scores.new_empty((), dtype=compute_dtype(scores)), _fake_grad(scores, need[0], dev),
            _fake_grad(scale_t, need[1], dev))


@_cosent_pairs_op.register_fake
def _(u, v, labels, scale_t, scale_f, normalize, eps, backend, need):
    dev = u.device
    return (u.new_empty((), dtype=compute_dtype(u, v)), _fake_grad(u, need[0], dev), _fake_grad(v, need[1], dev),
            _fake_grad(scale_t, need[2], dev))


def _scaled_grads_setup(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:])


def _scaled_grads(positions: tuple[int, ...], n_args: int):
    """Backward of an operator that returned its gradients for an upstream gradient of 1."""
    def backward(ctx, go, *_unused):
        grads = [None] * n_args
        for i, g in zip(positions, ctx.saved_tensors, strict=True):
            if g.numel() and ctx.needs_input_grad[i]:
                grads[i] = g * go.to(g.dtype)
        return tuple(grads)
    return backward


_cosent_scores_op.register_autograd(_scaled_grads((0, 2), 6), setup_context=_scaled_grads_setup)
_cosent_pairs_op.register_autograd(_scaled_grads((0, 1, 3), 9), setup_context=_scaled_grads_setup)


_TRITON_COSENT: dict[str, object] = {}


def _triton_cosent_op(name: str):
    """``fused_contrastive::triton_cosent_scores`` / ``triton_cosent_pairs``: the CoSENT operators as
    ``triton_op`` s for CUDA (Inductor sees their kernels), registered on first use."""
    if name not in _TRITON_COSENT:
        impl, positions, n = {"scores": (_cosent_scores_impl, (0, 2), 6),
                              "pairs": (_cosent_pairs_impl, (0, 1, 3), 9)}[name]
        op = torch.library.triton_op(f"fused_contrastive::triton_cosent_{name}", impl, mutates_args=())
        op.register_autograd(_scaled_grads(positions, n), setup_context=_scaled_grads_setup)
        _TRITON_COSENT[name] = getattr(torch.ops.fused_contrastive, f"triton_cosent_{name}")
    return _TRITON_COSENT[name]


def cosent_scores(scores: Tensor, labels: Tensor, scale, backend: str = "torch") -> Tensor:
    """CoSENT of ``scores`` [B] as ``fused_contrastive::cosent_scores`` (``triton_cosent_scores`` for the
    kernels on CUDA); 0-dim loss."""
    st = scale if isinstance(scale, Tensor) else None
    op = _triton_cosent_op("scores") if backend == "triton" and scores.device.type == "cuda" else _cosent_scores_op
    return op(scores, labels, st, 0.0 if st is not None else float(scale), backend, _needs(scores, st))[0]


def cosent_pairs(u: Tensor, v: Tensor, labels: Tensor, scale, normalize: bool, eps: float,
                 backend: str = "torch") -> Tensor:
    """CoSENT of the pair cosines of ``u``, ``v`` [B, D] as ``fused_contrastive::cosent_pairs``
    (``triton_cosent_pairs`` for the kernels on CUDA)."""
    st = scale if isinstance(scale, Tensor) else None
    op = _triton_cosent_op("pairs") if backend == "triton" and u.device.type == "cuda" else _cosent_pairs_op
    return op(u, v, labels, st, 0.0 if st is not None else float(scale), normalize, eps, backend,
              _needs(u, v, st))[0]


# ------------------------------------------------------------------------------------------------
# SigLIP
# ------------------------------------------------------------------------------------------------


def _siglip_fn(backend: str):
    if backend == "triton":
        from .core.siglip.triton_siglip import TritonSigLipFn

        return TritonSigLipFn
    from .core.siglip.torch_siglip import SigLipFn

    return SigLipFn


def _siglip_forward(fn, image, text, scale_t, scale_f, bias_t, bias_f, normalize, eps, offset, reduce, weight,
                    need):
    ctx = DirectCtx((need[0], need[1], need[2] and scale_t is not None, need[3] and bias_t is not None) + (False,) * 5)
    out = fn.forward(ctx, image, text, scale_t if scale_t is not None else scale_f,
                     bias_t if bias_t is not None else bias_f, normalize, eps, offset, reduce, weight)
    return ctx, out


def _siglip_grads(grads, image, text, scale_t, bias_t, need) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dev = image.device
    gx, gy, gs, gb = grads
    return (_grad_or_empty(gx, image, need[0], dev), _grad_or_empty(gy, text, need[1], dev),
            _grad_or_empty(gs, scale_t, need[2], dev), _grad_or_empty(gb, bias_t, need[3], dev))


@autocast_off
def _siglip_impl(image: Tensor, text: Tensor, scale_t: Tensor | None, scale_f: float, bias_t: Tensor | None,
                 bias_f: float, normalize: bool, eps: float, offset: int, reduce: bool, weight: float, backend: str,
                 need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SigLIP's loss (``reduce``: ``weight * sum``, 0-dim; else [N]); for ``reduce`` also the gradients
    for an upstream gradient of 1 (the registered backward scales them), for per-row losses empty
    tensors (the backward recomputes through ``siglip_backward``)."""
    fn = _siglip_fn(backend)
    ctx, out = _siglip_forward(fn, image, text, scale_t, scale_f, bias_t, bias_f, normalize, eps, offset, reduce,
                               weight, need)
    grads = (None,) * 4
    if reduce and any(need):
        grads = fn.backward(ctx, torch.ones((), dtype=out.dtype, device=out.device))[:4]
    return (out, *_siglip_grads(grads, image, text, scale_t, bias_t, [n and reduce for n in need]))


@autocast_off
def _siglip_backward_impl(image: Tensor, text: Tensor, scale_t: Tensor | None, scale_f: float, bias_t: Tensor | None,
                          bias_f: float, normalize: bool, eps: float, offset: int, weight: float, backend: str,
                          need: list[bool], go: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the per-row SigLIP losses for the upstream gradients ``go`` [N] (recomputes)."""
    fn = _siglip_fn(backend)
    ctx, _ = _siglip_forward(fn, image, text, scale_t, scale_f, bias_t, bias_f, normalize, eps, offset, False,
                             weight, need)
    return _siglip_grads(fn.backward(ctx, go)[:4], image, text, scale_t, bias_t, need)


_siglip_op = torch.library.custom_op("fused_contrastive::siglip", _siglip_impl, mutates_args=())
_siglip_backward_op = torch.library.custom_op("fused_contrastive::siglip_backward", _siglip_backward_impl,
                                              mutates_args=())


@_siglip_op.register_fake
def _(image, text, scale_t, scale_f, bias_t, bias_f, normalize, eps, offset, reduce, weight, backend, need):
    dev = image.device
    out = image.new_empty(() if reduce else (image.shape[0],), dtype=compute_dtype(image, text))
    return (out, _fake_grad(image, need[0] and reduce, dev), _fake_grad(text, need[1] and reduce, dev),
            _fake_grad(scale_t, need[2] and reduce, dev), _fake_grad(bias_t, need[3] and reduce, dev))


@_siglip_backward_op.register_fake
def _(image, text, scale_t, scale_f, bias_t, bias_f, normalize, eps, offset, weight, backend, need, go):
    dev = image.device
    return (_fake_grad(image, need[0], dev), _fake_grad(text, need[1], dev), _fake_grad(scale_t, need[2], dev),
            _fake_grad(bias_t, need[3], dev))


def _siglip_setup(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1:])
    ctx.args = inputs
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], inputs[4], *output[1:])


def _siglip_autograd_backward(ctx, go, *_unused):
    image, text, scale_t, bias_t, *eager = ctx.saved_tensors
    _, _, _, scale_f, _, bias_f, normalize, eps, offset, reduce, weight, backend, need = ctx.args
    if reduce:
        grads = [g * go.to(g.dtype) if g.numel() else None for g in eager]
    else:
        grads = list(_siglip_backward_op(image, text, scale_t, scale_f, bias_t, bias_f, normalize, eps, offset,
                                         weight, backend, need, go))
    out = [None] * 13
    for i, pos in enumerate((0, 1, 2, 4)):
        if ctx.needs_input_grad[pos] and grads[i] is not None and grads[i].numel():
            out[pos] = grads[i]
    return tuple(out)


_siglip_op.register_autograd(_siglip_autograd_backward, setup_context=_siglip_setup)


def siglip(image: Tensor, text: Tensor, scale, bias, normalize: bool, eps: float, offset: int, reduce: bool,
           weight: float, backend: str = "torch") -> Tensor:
    """SigLIP as ``fused_contrastive::siglip`` (what ``siglip_loss`` calls under torch.compile / export):
    the contract of ``core.siglip.SigLipFn`` on the torch or triton backend."""
    st = scale if isinstance(scale, Tensor) else None
    bt = bias if isinstance(bias, Tensor) else None
    return _siglip_op(image, text, st, 0.0 if st is not None else float(scale), bt,
                      0.0 if bt is not None else float(bias), normalize, eps, offset, reduce, weight, backend,
                      _needs(image, text, st, bt))[0]


@autocast_off
def _siglip_groups_impl(image: Tensor, text: Tensor, scale_t: Tensor | None, scale_f: float, bias_t: Tensor | None,
                        bias_f: float, image_groups: Tensor, text_groups: Tensor, all_image_groups: Tensor,
                        normalize: bool) -> Tensor:
    """SigLIP's group positives' correction per image [N] (``core.siglip.positives_correction``)."""
    from .core.siglip.torch_siglip import correction_forward, group_pairs

    return correction_forward(image, text, scale_t if scale_t is not None else scale_f,
                              bias_t if bias_t is not None else bias_f, normalize,
                              group_pairs(image_groups, text_groups, all_image_groups))


@autocast_off
def _siglip_groups_backward_impl(image: Tensor, text: Tensor, scale_t: Tensor | None, scale_f: float,
                                 bias_t: Tensor | None, bias_f: float, image_groups: Tensor, text_groups: Tensor,
                                 all_image_groups: Tensor, normalize: bool, need: list[bool],
                                 go: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Its gradients for the upstream ``go`` [N] (``core.siglip.correction_grads``, recomputed)."""
    from .core.siglip.torch_siglip import correction_grads, group_pairs

    grads = correction_grads(image, text, scale_t if scale_t is not None else scale_f,
                             bias_t if bias_t is not None else bias_f, normalize,
                             group_pairs(image_groups, text_groups, all_image_groups), go, need)
    dev = image.device
    return tuple(_grad_or_empty(g, x, n, dev) for g, x, n in zip(grads, (image, text, scale_t, bias_t), need,
                                                                  strict=True))


_siglip_groups_op = torch.library.custom_op("fused_contrastive::siglip_groups", _siglip_groups_impl, mutates_args=())
_siglip_groups_backward_op = torch.library.custom_op("fused_contrastive::siglip_groups_backward",
                                                     _siglip_groups_backward_impl, mutates_args=())


@_siglip_groups_op.register_fake
def _(image, text, scale_t, scale_f, bias_t, bias_f, image_groups, text_groups, all_image_groups, normalize):
    return image.new_empty((image.shape[0],), dtype=compute_dtype(image, text))


@_siglip_groups_backward_op.register_fake
def _(image, text, scale_t, scale_f, bias_t, bias_f, image_groups, text_groups, all_image_groups, normalize, need, go):
    dev = image.device
    return tuple(_fake_grad(x, n, dev) for x, n in zip((image, text, scale_t, bias_t), need, strict=True))


def _siglip_groups_setup(ctx, inputs, output) -> None:
    ctx.args = inputs
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], inputs[4])


def _siglip_groups_autograd_backward(ctx, go):
    image, text, scale_t, bias_t = ctx.saved_tensors
    _, _, _, scale_f, _, bias_f, ig, tg, ig_all, normalize = ctx.args
    need = [ctx.needs_input_grad[i] and x is not None for i, x in ((0, image), (1, text), (2, scale_t), (4, bias_t))]
    grads = _siglip_groups_backward_op(image, text, scale_t, scale_f, bias_t, bias_f, ig, tg, ig_all, normalize, need,
                                       go)
    out = [None] * 10
    for g, pos, n in zip(grads, (0, 1, 2, 4), need, strict=True):
        if n:
            out[pos] = g
    return tuple(out)


_siglip_groups_op.register_autograd(_siglip_groups_autograd_backward, setup_context=_siglip_groups_setup)


def siglip_groups(image: Tensor, text: Tensor, scale, bias, normalize: bool, image_groups: Tensor,
                  text_groups: Tensor, all_image_groups: Tensor) -> Tensor:
    """``core.siglip.positives_correction`` as ``fused_contrastive::siglip_groups`` (what ``siglip_loss`` calls
    under torch.compile / export: its pair count is data-dependent, so the operator is opaque)."""
    st = scale if isinstance(scale, Tensor) else None
    bt = bias if isinstance(bias, Tensor) else None
    return _siglip_groups_op(image, text, st, 0.0 if st is not None else float(scale), bt,
                             0.0 if bt is not None else float(bias), image_groups, text_groups, all_image_groups,
                             normalize)


# ------------------------------------------------------------------------------------------------
# the merged-block core (GIST, guide / id masks)
# ------------------------------------------------------------------------------------------------

# xs, guides, ids, target, threshold, weights, scale_t, scale_f, then the blocks column by column
# (Block's fields; exclude as a value and a flag), the rule, n, the _Config options, backend, need
# (need[0]: the scale; need[1:]: xs)
_MERGED_ARGS = ("Tensor[] xs, Tensor?[] guides, Tensor?[] ids, Tensor? target, Tensor? threshold, Tensor? weights, "
                "Tensor? scale_t, float scale_f, int[] rows, int[] cols, SymInt[] row_start, bool[] protect, "
                "SymInt[] exclude, bool[] has_exclude, str strategy, float margin, SymInt n, bool normalize, "
                "float eps, bool minus_target, float smoothing, str backend, bool[] need")


def _merged_flatten(xs, cfg, masks, scale, weights, backend: str) -> tuple:
    from .core.guided.torch_blocks import Masks

    masks = masks or Masks()
    nx = len(xs)

    def per_tensor(seq):
        return [seq[t] if t < len(seq) else None for t in range(nx)]

    blocks = cfg.blocks
    st = scale if isinstance(scale, Tensor) else None
    strategy, margin = masks.rule if masks.rule is not None else ("", 0.0)
    need = _needs(st, *xs)
    return (list(xs), per_tensor(masks.guides), per_tensor(masks.ids), masks.target, masks.threshold, weights, st,
            0.0 if st is not None else float(scale), [b.rows for b in blocks], [b.cols for b in blocks],
            [b.row_start for b in blocks], [b.protect for b in blocks], [b.exclude or 0 for b in blocks],
            [b.exclude is not None for b in blocks], strategy, float(margin), cfg.n, cfg.normalize, float(cfg.eps),
            cfg.minus_target, float(cfg.smoothing), backend, need)


def _merged_unflatten(args: tuple):
    """``(Function, scale, cfg, masks, weights, xs, need)`` from the operator's arguments."""
    from .core.guided.torch_blocks import Block, Masks, _Config, merged_fn

    (xs, guides, ids, target, threshold, weights, scale_t, scale_f, rows, cols, row_start, protect, exclude,
     has_exclude, strategy, margin, n, normalize, eps, minus_target, smoothing, backend, need) = args
    blocks = tuple(Block(r, c, rs, p, e if h else None)
                   for r, c, rs, p, e, h in zip(rows, cols, row_start, protect, exclude, has_exclude, strict=True))
    cfg = _Config(blocks, n, normalize, eps, minus_target, smoothing)
    masks = Masks(tuple(guides), threshold, tuple(ids), target, (strategy, margin) if strategy else None)
    scale = scale_t if scale_t is not None else scale_f
    return merged_fn(backend), scale, cfg, masks, weights, list(xs), list(need)


def _merged_grads(grads, xs, scale_t, need, dev) -> tuple[list[Tensor], Tensor]:
    """The operator's gradient outputs from a Function's backward result ``(d scale, 3 Nones, *d xs)``
    (None: none computed)."""
    gx = [None] * len(xs) if grads is None else list(grads[4:])
    gs = None if grads is None else grads[0]
    return ([_grad_or_empty(g, x, nd, dev) for g, x, nd in zip(gx, xs, need[1:], strict=True)],
            _grad_or_empty(gs, scale_t, need[0], dev))


@autocast_off
def _merged_impl(*args) -> tuple[Tensor, list[Tensor], Tensor]:
    fn, scale, cfg, masks, weights, xs, need = _merged_unflatten(args)
    ctx = DirectCtx((need[0], False, False, False, *need[1:]))
    out = fn.forward(ctx, scale, cfg, masks, weights, *xs)
    grad = weights is not None and any(need)
    grads = fn.backward(ctx, torch.ones((), dtype=out.dtype, device=out.device)) if grad else None
    gx, gs = _merged_grads(grads, xs, args[6], [n and grad for n in need], out.device)
    return out, gx, gs


def _merged_fake(*args):
    xs, weights, scale_t, n, need = args[0], args[5], args[6], args[16], args[-1]
    reduce = weights is not None
    grad = reduce and any(need)
    dev = xs[0].device
    out = xs[0].new_empty(() if reduce else (n,), dtype=compute_dtype(*xs))
    return (out, [_fake_grad(x, nd and grad, dev) for x, nd in zip(xs, need[1:], strict=True)],
            _fake_grad(scale_t, need[0] and grad, dev))


@autocast_off
def _merged_backward_impl(*args) -> tuple[list[Tensor], Tensor]:
    *fwd, go = args
    fn, scale, cfg, masks, weights, xs, need = _merged_unflatten(tuple(fwd))
    ctx = DirectCtx((need[0], False, False, False, *need[1:]))
    out = fn.forward(ctx, scale, cfg, masks, weights, *xs)
    grads = fn.backward(ctx, go.to(out.dtype))
    return _merged_grads(grads, xs, fwd[6], need, go.device)


def _merged_backward_fake(*args):
    xs, scale_t, need = args[0], args[6], args[-2]
    dev = xs[0].device
    return ([_fake_grad(x, nd, dev) for x, nd in zip(xs, need[1:], strict=True)], _fake_grad(scale_t, need[0], dev))


def _merged_setup(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1], output[2])
    # the gradient's structure as autograd checks it: a list for a list argument holding tensors
    ctx.no_grads = [[None] * len(v) if isinstance(v, list | tuple) and any(isinstance(x, Tensor) for x in v)
                    else None for v in inputs]
    ctx.reduce = inputs[5] is not None
    if ctx.reduce:
        ctx.save_for_backward(*output[1], output[2])
        return
    # per-row output: the backward recomputes from the inputs
    flat, ctx.spec = tree_flatten(inputs)
    ctx.pos = [i for i, v in enumerate(flat) if isinstance(v, Tensor)]
    ctx.save_for_backward(*(flat[i] for i in ctx.pos))
    ctx.flat = [None if isinstance(v, Tensor) else v for v in flat]


def _merged_backward(ctx, go, *_unused):
    if ctx.reduce:
        *gx, gs = ctx.saved_tensors
        need = [gs.numel() > 0, *(g.numel() > 0 for g in gx)]
        gx = [g * go.to(g.dtype) for g in gx]
        gs = gs * go.to(gs.dtype)
    else:
        flat = list(ctx.flat)
        for k, i in enumerate(ctx.pos):
            flat[i] = ctx.saved_tensors[k]
        args = tree_unflatten(flat, ctx.spec)
        need = args[-1]
        gx, gs = torch.ops.fused_contrastive.merged_lse_backward(*args, go)
    grads = list(ctx.no_grads)  # the inputs' structure (a list argument's gradient is a list)
    if ctx.needs_input_grad[0]:
        grads[0] = [g if nd else None for g, nd in zip(gx, need[1:], strict=True)]
    if ctx.needs_input_grad[6] and need[0]:
        grads[6] = gs
    return tuple(grads)


_merged_op = torch.library.custom_op("fused_contrastive::merged_lse", _merged_impl, mutates_args=(),
                                     schema=f"({_MERGED_ARGS}) -> (Tensor, Tensor[], Tensor)")
_merged_op.register_fake(_merged_fake)
_merged_bwd_op = torch.library.custom_op("fused_contrastive::merged_lse_backward", _merged_backward_impl,
                                         mutates_args=(), schema=f"({_MERGED_ARGS}, Tensor go) -> (Tensor[], Tensor)")
_merged_bwd_op.register_fake(_merged_backward_fake)
_merged_op.register_autograd(_merged_backward, setup_context=_merged_setup)


def merged_lse(xs, cfg, masks, scale, weights: Tensor | None, backend: str) -> Tensor:
    """``core.blocks.merged_lse`` as the registered operator ``fused_contrastive::merged_lse`` (what it
    calls under torch.compile / export): ``xs`` the tensors, ``cfg`` its ``_Config`` (blocks, N,
    normalize, eps, minus_target), ``masks`` its ``Masks``; [N], or 0-dim with ``weights``."""
    return _merged_op(*_merged_flatten(xs, cfg, masks, scale, weights, backend))[0]


set_traced_op("merged_lse", merged_lse)
