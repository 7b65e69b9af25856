"""The core op of every InfoNCE-family loss (contract in ``spec.py``) and its implementations, one folder per
family (``docs/layout.md`` has the tree):

* ``lse/torch_dense.py``: one materialised tile, for problems that fit the tile budget (``tiles.py``; any device);
* ``lse/torch_chunked.py`` + ``linear_terms.py``: the O(N*D)-memory PyTorch path;
* ``lse/triton_function.py`` (the fused kernels, the panel path or the ahead-of-time library; launch runtime in
  ``triton_shared/``, device code in ``fused_contrastive.kernels``) + ``linear_terms.py``: the Triton path;
* ``matryoshka/``: every Matryoshka level in one pass (:func:`run` with ``levels``);
* ``reference.py``: every loss written naively from its definition, the test oracle (it does not go
  through :func:`run`).

:func:`run` is the only entry the losses call; the backend name comes resolved from
``fused_contrastive._backend.resolve``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .._first_order import first_order
from .._tracing import traced_core, tracing_route
from ..routes import setting
from . import linear_terms
from .lse import torch_chunked, torch_dense
from .spec import Coeffs, CoreData, CoreSpec, DirectCtx, check_problem, compute_dtype, graph_free
from .tiles import tile_elements, tile_elements_set

__all__ = ["Coeffs", "CoreData", "CoreSpec", "PiecesFn", "backward_parts", "dense_path", "forward_parts", "pieces",
           "run", "tile_elements"]


#: The one-tile path's size limit (N x M) on CUDA for a problem without a column term, when
#: ``FUSED_CONTRASTIVE_TILE_ELEMENTS`` is unset (the CPU's limit is :func:`tiles.tile_elements`, 2^21). Evidence:
#: ``routes.ROUTES`` ("one-tile path on CUDA"); the measurements: docs/gpu-measurements.md.
CUDA_DENSE_ELEMENTS = 1 << 24


def dense_path(n: int, m: int, device: torch.device | None = None, col: bool = False) -> bool:
    """Whether an N x M problem takes the one-tile path: the whole logit tile fits the tile budget
    (``N * M <= tile_elements()``; on CUDA without a column term, ``col``, up to :data:`CUDA_DENSE_ELEMENTS` unless
    ``FUSED_CONTRASTIVE_TILE_ELEMENTS`` sets the budget), unless ``FUSED_CONTRASTIVE_DENSE=0`` turns the path off."""
    if not setting("DENSE"):
        return False
    limit = tile_elements()
    if device is not None and device.type == "cuda" and not col and not tile_elements_set():
        limit = max(limit, CUDA_DENSE_ELEMENTS)
    return n * m <= limit


def pieces(backend: str, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData,
           coef: Coeffs, reduce: bool) -> list[tuple[type[torch.autograd.Function], tuple, float]]:
    """The autograd Functions whose signed sum is the core op on ``backend``, as ``(Function, args,
    sign)`` in the order they are to be applied: the dense one-tile Function when the problem fits
    (:func:`dense_path`), else the O(N*D) linear positive terms (sign -1) and the log-sum-exp terms of
    the chunked or Triton path (sign +1). The eager path (:func:`run`) applies them; the custom ops of
    ``fused_contrastive.ops`` call their forward and backward directly."""
    n = a.shape[0]
    m = n if b is None else b.shape[0]
    check_problem(n, m, spec, data, coef, reduce)
    if dense_path(n, m, a.device, coef.col is not None):
        return [(torch_dense.DenseCoreFn, (a, b, scale, spec, data, coef, reduce), 1.0)]
    if backend not in ("torch", "triton"):
        raise ValueError(f"core.run: backend must be 'torch' or 'triton', got {backend!r}")
    # The O(N*D) positive terms first: autograd runs backward nodes newest first, so their gradients
    # are formed after the log-sum-exp backward has freed its tiles (not held beside them).
    out = []
    if coef.tgt is not None or coef.set is not None:
        dt = torch.float32 if backend == "triton" else compute_dtype(a, b)
        # the target term's row kernels (kernels/target.py) on the triton backend, unless the ahead-of-time
        # library is in use (its calls are meant to compile nothing at run time)
        kernel = backend == "triton" and not setting("AOT_LIB")
        out.append((linear_terms.LinearTermsFn, (a, b, scale, spec, data, coef, reduce, dt, kernel), -1.0))
    lse_terms = Coeffs(lse=coef.lse, col=coef.col, pos=coef.pos)
    if spec.exclude_target:  # the streaming paths leave the target column out as a -inf bias on it
        spec = dataclasses.replace(spec, exclude_target=False, bias=float("-inf"))
        data = dataclasses.replace(data, bias_col=data.target)
    if backend == "triton":
        from .lse.triton_function import TritonCoreFn as lse_fn
    else:
        lse_fn = torch_chunked.ChunkedCoreFn
    out.append((lse_fn, (a, b, scale, spec, data, lse_terms, reduce), 1.0))
    return out


def run(backend: str, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
        reduce: bool, levels: tuple[tuple[int, ...], tuple[float, ...]] | None = None) -> Tensor:
    """The core op on ``backend`` ("torch" or "triton"): the per-row loss [N] or its sum (0-dim).

    ``levels = (dims, weights)`` (dims ascending): the op at every Matryoshka level in one pass over D
    (``core/matryoshka/torch_levels.py``), one value per level ([K, N] or [K]); the weights are those the caller
    multiplies the levels by. The triton backend runs the Matryoshka kernels (``TM.py``), or
    one plain call per level where the plain op would take the panel path.

    ``a`` [N, D] anchors, ``b`` [M, D] contrast set or None (B is A), ``scale`` a number or a 0-dim
    tensor (gradients flow to tensors that require them). Both backends take the dense one-tile path
    when it fits (:func:`dense_path`). Under ``torch.compile`` / ``torch.export`` the same work runs
    as the registered custom op ``fused_contrastive::core`` (``fused_contrastive.ops``).
    """
    a, b, scale = graph_free(a, b, scale)
    if levels is not None:
        return _leveled(backend, a, b, scale, spec, data, coef, reduce, levels)
    if tracing_route():
        return traced_core()(backend, a, b, scale, spec, data, coef, reduce)
    parts = pieces(backend, a, b, scale, spec, data, coef, reduce)
    if len(parts) == 1:
        fn, args, _ = parts[0]
        return fn.apply(*args)
    return PiecesFn.apply(a, b, scale, parts)


def forward_parts(parts, need) -> tuple[Tensor, list]:
    """The forward of every ``(Function, args, sign)`` of :func:`pieces`, called directly (through
    ``spec.DirectCtx``), summed with its sign: ``(out, subs)``, ``subs`` what :func:`backward_parts`
    takes. ``need``: whether a, b and the scale need gradients. With more than one piece each is asked
    for gradients of at least fp32 (``ctx.wide``; every piece casts its gradients to ``ctx.dtypes``)."""
    out, subs = None, []
    # a target term beside the log-sum-exp terms: the latter leave the target column out of their
    # 16-bit tiles where their path can, and report its fp32 weight (``ctx.moved_target``)
    split = any(fn is linear_terms.LinearTermsFn and args[5].tgt is not None for fn, args, _ in parts)
    # a SET term beside them: the Triton piece may form its gradient inside its 16-bit tiles, in fp32, where it
    # meets p_ij (``ctx.set_coef``: SET's coefficients; it reports ``ctx.took_set`` in backward)
    set_coef = next((args[5].set for fn, args, _ in parts if fn is linear_terms.LinearTermsFn), None)
    values = []
    for fn, args, sign in parts:
        ctx = DirectCtx(tuple(need) + (False,) * (len(args) - 3))
        ctx.wide = len(parts) > 1
        ctx.split_target = split and fn is not linear_terms.LinearTermsFn
        if fn is not linear_terms.LinearTermsFn:
            ctx.set_coef = set_coef
        ctx.keep_rows = split and fn is linear_terms.LinearTermsFn
        values.append(fn.forward(ctx, *args))
        if ctx.wide and hasattr(ctx, "dtypes"):  # (float64 stays float64)
            adt, bdt, sdt, sshape = ctx.dtypes
            ctx.dtypes = (torch.promote_types(adt, torch.float32),
                          None if bdt is None else torch.promote_types(bdt, torch.float32), sdt, sshape)
        subs.append((fn, ctx, sign))
    # a log-sum-exp piece whose value already subtracts c_i l_it (the one pass's log1p(zx_i / e_it), formed without
    # the cancellation of LSE_i - l_it): the target term's value leaves those out (its gradient does not change)
    minus = [ctx.minus_target for _, ctx, _ in subs if getattr(ctx, "minus_target", None) is not None]
    for i, (fn, ctx, _) in enumerate(subs):
        if minus and fn is linear_terms.LinearTermsFn:
            values[i] = linear_terms.value_less_target(ctx, sum(minus[1:], minus[0]), parts[i][1][6])
        if hasattr(ctx, "rows"):
            del ctx.rows
        if hasattr(ctx, "minus_target"):
            del ctx.minus_target
    for (_, _, sign), y in zip(parts, values, strict=True):
        out = signed_sum(out, y, sign)
    return out, subs


def backward_parts(subs, go: Tensor, dtypes) -> list[Tensor | None]:
    """The gradients of a, b and the scale for the upstream gradient ``go`` from the pieces that
    :func:`forward_parts` ran (newest first, as autograd would), summed in fp32 and cast once to
    ``dtypes`` (a's and b's; the scale's comes in its own dtype)."""
    grads: list[Tensor | None] = [None, None, None]
    moved = less = None
    took_set = False
    for fn, ctx, sign in reversed(subs):
        if fn is linear_terms.LinearTermsFn:
            ctx.target_extra = moved  # added to its target coefficient: the two meet in fp32
            # the coefficients c_i whose share of the target's weight is in ``moved`` already (formed from the split
            # statistics, exactly: target_split.exact_weights); the target term leaves them out, as its value does
            ctx.target_less = less
            ctx.grads_in = grads  # fp32 gradients of the pieces before it, which it may add to in place
            ctx.set_taken = took_set  # its SET gradient already formed in the log-sum-exp piece's tiles
        gs = fn.backward(ctx, go if sign > 0 else -go)
        if getattr(ctx, "moved_target", None) is not None:
            moved = ctx.moved_target if moved is None else moved + ctx.moved_target
            ctx.moved_target = None
            if getattr(ctx, "moved_less", None) is not None:
                less = ctx.moved_less if less is None else less + ctx.moved_less
        if getattr(ctx, "took_set", False):
            took_set = True
            ctx.took_set = False
        for i in range(3):
            if gs[i] is not None:
                grads[i] = gs[i] if grads[i] is None else grads[i] + gs[i]
    for i in range(2):
        if grads[i] is not None and dtypes[i] is not None:
            grads[i] = grads[i].to(dtypes[i])
    return grads


class PiecesFn(torch.autograd.Function):
    """The core op's pieces (:func:`pieces`: the linear target / positive terms and the log-sum-exp
    terms) as one autograd node, so that their gradients are summed in fp32 before one rounding to
    the inputs' dtype. Apart they would not be: autograd rounds each piece's gradient to a 16-bit
    input's dtype, and with a softmax peaked on the target (``p_t -> 1``, a small loss) the two
    nearly cancel (their sum is ``(p_t - 1)`` times the target's row), leaving the rounding of
    each, ``~2^-9`` of the row, as the whole error (docs/panel-path.md, "16-bit gradients of a peaked
    softmax"). ``a`` [N, D], ``b`` [M, D] or None, ``scale`` a number or a 0-dim tensor; ``parts``
    the list :func:`pieces` returned for them."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor | None, scale, parts) -> Tensor:
        out, ctx.subs = forward_parts(parts, ctx.needs_input_grad[:3])
        ctx.dtypes = (a.dtype, None if b is None else b.dtype)
        # the inputs through save_for_backward: in-place edits between forward and backward are caught
        ctx.save_for_backward(a, b, scale if isinstance(scale, Tensor) else None)
        return out

    @staticmethod
    @first_order("PiecesFn")
    def backward(ctx, go: Tensor):
        ctx.saved_tensors  # noqa: B018 (the version check of the inputs)
        return (*backward_parts(ctx.subs, go, ctx.dtypes), None)


#: The most levels the Matryoshka kernels take (compiled without spills at 1, 5 and 8 levels); more run as
#: one plain Triton call per level.
MAX_KERNEL_LEVELS = 8


def _leveled(backend, a, b, scale, spec, data, coef, reduce, levels):
    n = a.shape[0]
    check_problem(n, n if b is None else b.shape[0], spec, data, coef, reduce)
    if tracing_route():
        raise NotImplementedError("core.run: Matryoshka levels are not traced (the losses run the definition, "
                                  "one plain call per level, under torch.compile)")
    if spec.margin != 0.0:  # a target margin: the plain op per level (truncated rows, normalised by the op)
        return torch.stack([run(backend, a[:, :d], None if b is None else b[:, :d], scale, spec, data, coef, reduce)
                            for d in levels[0]])
    if backend == "triton":
        from .matryoshka import triton_levels as TM
        from .triton_shared import panels
        route = TM.route()  # env FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE (TM.ROUTES)
        m = n if b is None else b.shape[0]
        if (route == "calls" or len(levels[0]) > MAX_KERNEL_LEVELS
                or (route == "auto" and panels.use_panel(a, n, m)
                    and not (coef.col is not None and n * m <= TM.COL_KERNELS_MAX_ELEMENTS))):
            # where the plain loss takes the panel path (cuBLAS GEMMs on row panels: CUDA, N * M >= 2^24),
            # K of its calls on the truncated, re-normalised rows are modelled faster than the Matryoshka
            # kernels, whose backward streams like the fused kernels' (bench/gpu_model.py --matryoshka); and
            # past MAX_KERNEL_LEVELS levels (the kernels are compiled and checked up to 8)
            # Each level is the plain op on the truncated rows with the caller's own ``normalize``: the
            # op normalises them itself (in fp32, and on the panel path in its one-pass row kernel),
            # which is the truncate-then-normalise of a Matryoshka level
            return torch.stack([run("triton", a[:, :d], None if b is None else b[:, :d], scale, spec, data, coef,
                                    reduce) for d in levels[0]])
        return TM.run(a, b, scale, spec, data, coef, reduce, levels[0])
    if backend != "torch":
        raise ValueError(f"core.run: backend must be 'torch' or 'triton', got {backend!r}")
    from .matryoshka import torch_levels
    return torch_levels.run(a, b, scale, spec, data, coef, reduce, *levels)


def signed_sum(acc: Tensor | None, y: Tensor, sign: float) -> Tensor:
    """``acc + sign * y`` (``sign * y`` when ``acc`` is None), sign +1 or -1."""
    if acc is None:
        return y if sign > 0 else -y
    return acc + y if sign > 0 else acc - y


def positive_counts(spec: CoreSpec, data: CoreData, n: int, m: int, like: Tensor) -> Tensor:
    """``|P_i|`` per row in the compute dtype of ``like`` (see ``linear_terms.positive_counts``)."""
    return linear_terms.positive_counts(spec, data, n, m, compute_dtype(like))
