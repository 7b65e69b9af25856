"""THE accuracy rule of the project (``check``, ``check --gpu-validate``, the test-suite and the
benchmark's difference column all use it).

A backend computing in ``dtype`` is compared with the **float64 ground truth** (the reference backend
run in float64 on the same, dtype-rounded inputs). For every output (the loss and the gradient of
every differentiable input, a tensor temperature included), elementwise::

    |got - truth| <= min(2 * e_same, slack[dtype] * size) + slack[dtype] * size + spacing(truth) + floor
                     (16-bit dtypes; fp32: 2 * e_same + slack[dtype] * size + spacing(truth) + floor)

plus the spacing of the output's own dtype at ``truth`` (:func:`spacing`: its rounding, which no
backend avoids), where ``size`` is **that output's own size**, ``max |truth|`` over its elements, ``slack``
(:data:`SLACK`) a relative error per dtype, and ``e_same`` PyTorch's own error in that dtype: the
largest error of the reference backend computing *in* ``dtype`` (``reference.computing_in``) against
the same truth. So a fused backend may be as inaccurate as PyTorch is in the dtype asked for; in 16 bits
up to twice the slack and never more (in fp32 PyTorch's error is granted whole: it is the output's own
conditioning there, e.g. a zero row's gradient through the norm clamp, amplified by 1 / eps):

* relative, because a mean-reduced loss's gradients are O(1/N): the project's rule until 0.2 had an
  absolute floor, ``slack * max(1, ...)``, and an all-zero 16-bit gradient passed it at N = 4099;
* capped, because PyTorch in 16 bits loses most digits of a peaked softmax's gradient (0.2-0.4 of
  ``max |truth|`` in bf16 at temperature 0.01 with correlated positives, ``cases.REGIMES``), and a
  tolerance built on that could not fail where a 16-bit intermediate in a kernel does harm.

Healthy kernels sit near 5e-3 (bf16) / 5e-4 (fp16) of ``max |truth|``; the tolerance is 1-2e-2 / 2-4e-3.

* An output whose truth is zero up to float64 rounding (``max |truth| <= 1e-10 ref``, ``ref = max(1,
  max |truth loss|)``: a loss constant in its inputs, whose float64 gradient is ~1e-17 of noise) must be
  zero up to the dtype's rounding of the loss's terms: ``|got| <= 0.1 slack[dtype] ref``. Without
  ``ref`` (a caller comparing one output alone) an output of size 0 must come out zero to within its
  dtype's smallest step.
* The gradient of a 0-dim input ``x`` (a temperature, a scale, a bias) is one number summed from
  terms whose size is ``amp = 1 / min(|x|, 1)^2`` (``dL/dt = -dL/ds / t^2`` of O(1) terms ``dL/ds``):
  its size is ``max(|truth|, amp)``, the size of the terms its rounding comes from.

* Every output also gets :func:`rounding_floor`: the rounding of the logits themselves in fp32
  accumulation (``8 2^-24 s`` for the loss, that over the N rows of a mean for a gradient element; s the
  logit scale): a loss of 1e-9 in a saturated softmax is a difference of logits of 20 in every backend
  that forms ``LSE - l_t``. At N = 4099 it is 2.3e-9 against gradients of ~1e-5: no defect hides in it.

Matching infinities count as equal; NaN in the result where the truth is finite fails. A failure
names the output, the worst index, both values, the error and the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core import reference
from .cases import Case, Inputs, make_inputs

#: Relative slack per dtype (times the output's size: max |truth|). float32: 1e-4, since in the
#: peaked regimes (``cases.REGIMES``) a loss of 0.05 is the difference of logits near 100, whose
#: float32 rounding (6e-8 relative) leaves ~6e-6 absolute in every backend that forms ``LSE - l_t``;
#: 16-bit: the rounding of the 16-bit gradients themselves and of the operands of the gradient GEMMs.
SLACK: dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-3,
                                   torch.bfloat16: 1e-2}


def _leaf(v: Tensor, dtype: torch.dtype, device, canary: bool, align: int = 1) -> Tensor:
    """A differentiable input in ``dtype`` (0-dim tensors: float32, or float64 with float64), optionally
    as a view into a NaN-padded buffer (5 extra rows, at least 7 extra columns, as many more as make the
    row stride a multiple of ``align``) to catch out-of-bounds reads."""
    if v.dim() == 0:
        return v.detach().to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32) \
            .clone().requires_grad_(True)
    x = v.detach().to(device=device, dtype=dtype)
    if canary and x.dim() >= 2:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        extra = 7 + (-(flat.shape[1] + 7)) % align
        buf = torch.full((flat.shape[0] + 5, flat.shape[1] + extra), float("nan"), dtype=dtype, device=device)
        buf[: flat.shape[0], : flat.shape[1]] = flat
        x = buf[: flat.shape[0], : flat.shape[1]].unflatten(0, lead)  # row stride D + extra (D + 7 by default)
    else:
        x = x.clone()
    return x.requires_grad_(True)


def run(case: Case, inputs: Inputs, backend: str, dtype: torch.dtype, device="cpu", *, canary: bool = False,
        upstream_seed: int = 1, canary_align: int = 1) -> tuple[Tensor, dict[str, Tensor | None]]:
    """Loss and gradients of ``case`` on ``backend`` with the embeddings in ``dtype``. A per-row loss is
    reduced with random upstream weights, so that every row's gradient is checked. ``canary_align``:
    the padded inputs' row stride is a multiple of it (16 for the ahead-of-time kernels)."""
    tensors, kwargs = inputs
    leaves = {k: _leaf(v, dtype, device, canary, canary_align) for k, v in tensors.items()}
    kw = {k: (v.to(device) if isinstance(v, Tensor) else
              tuple(x.to(device) if isinstance(x, Tensor) else x for x in v) if isinstance(v, tuple) else v)
          for k, v in kwargs.items()}
    loss = case.fn(**leaves, **kw, backend=backend)
    total = loss
    if loss.dim() > 0:
        w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(upstream_seed)).to(loss)
        total = (loss * w).sum()
    total.backward()
    return loss.detach(), {k: (v.grad.detach() if v.grad is not None else None) for k, v in leaves.items()}


@dataclass
class Worst:
    """The output and index closest to (or furthest past) its tolerance."""

    output: str
    index: tuple[int, ...]
    got: float
    want: float
    err: float
    tol: float

    def __str__(self) -> str:
        return (f"{self.output}{list(self.index)}: got {self.got:.8g}, want {self.want:.8g}, "
                f"|err| {self.err:.3g} vs tol {self.tol:.3g}")


@dataclass
class Comparison:
    """Errors of one backend run against the truth (see the module docstring)."""

    loss_err: float
    loss_tol: float
    grad_err: float  # at the gradient closest to its tolerance
    grad_tol: float
    worst: Worst | None  # None when every output is within tolerance by construction (no outputs)
    problems: tuple[str, ...] = ()  # structural mismatches (a gradient present in one run only)

    @property
    def ok(self) -> bool:
        return not self.problems and (self.worst is None or self.worst.err <= self.worst.tol)

    def __str__(self) -> str:
        head = "ok" if self.ok else "FAIL"
        detail = "; ".join(self.problems) if self.problems else str(self.worst)
        return f"{head}: {detail}"


def _finite_max(x: Tensor) -> float:
    fin = x[torch.isfinite(x)]
    return float(fin.abs().max()) if fin.numel() else 0.0


def _error(got: Tensor, want: Tensor) -> Tensor:
    """Elementwise |got - want| in float64: matching infinities 0, NaN (anywhere the truth is not NaN)
    infinite."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    same_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    both_nan = torch.isnan(got) & torch.isnan(want)
    err = torch.where(same_inf | both_nan, torch.zeros_like(got), (got - want).abs())
    return torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)


def same_dtype_error(same: Tensor, truth: Tensor) -> float:
    """PyTorch's own error in the dtype: the largest error over entries where both are finite."""
    e = _error(same, truth)
    fin = torch.isfinite(e)
    return float(e[fin].max()) if fin.any() else 0.0


def amp_of(x: Tensor) -> float:
    """The term size of the gradient of input ``x`` (module docstring): ``1 / min(|x|, 1)^2`` for a
    0-dim input, 0 for a tensor (its size is its own ``max |truth|``)."""
    return 1.0 / min(abs(float(x)), 1.0) ** 2 if x.dim() == 0 else 0.0


def tolerance(truth: Tensor, e_same: float, dtype: torch.dtype, amp: float = 0.0, cap: bool | None = None) -> float:
    """THE rule's tolerance of one output: ``min(2 e_same, slack size) + slack size``, ``size =
    max(max |truth|, amp)`` (module docstring); ``cap`` (default: for 16-bit dtypes) bounds the grant of
    PyTorch's error by the slack, else it is ``2 e_same`` whole."""
    grant = SLACK[dtype] * max(_finite_max(truth.detach().double().cpu()), amp)
    if cap is None:
        cap = dtype in (torch.bfloat16, torch.float16)
    return (min(2 * e_same, grant) if cap else 2 * e_same) + grant


def spacing(truth: Tensor, dtype: torch.dtype) -> Tensor:
    """Elementwise, the gap between ``dtype``'s numbers at ``|truth|`` (float64): what storing the
    output in its dtype costs at least, ``|x| eps`` or, below the smallest normal, the subnormal step (a
    mean-reduced fp16 gradient at N = 4099 and temperature 0.01 is ~1e-7, where fp16 steps by 6e-8)."""
    fi = torch.finfo(dtype)
    t = truth.detach().double().cpu().abs().nan_to_num(posinf=0.0)
    return torch.maximum(t * fi.eps, torch.full_like(t, fi.smallest_normal * fi.eps))


#: An output whose truth is below this fraction of the loss's scale is zero up to float64 rounding
#: (module docstring).
ZERO = 1e-10
#: Roundings of a logit granted by :func:`rounding_floor` (fp32 accumulation, unit roundoff 2^-24).
FLOOR_ROUNDINGS = 8


def rounding_floor(tensors: dict[str, Tensor], kwargs: dict) -> tuple[float, float]:
    """``(loss floor, gradient floor)``: what rounding the logits themselves costs every backend that
    accumulates in fp32. A logit is ``s cos`` (``s`` = 1 / temperature, ``logit_scale`` or ``scale``, plus
    ``|logit_bias|``; 20 when none is given, the default temperature 0.05; times the largest squared row
    norm for raw rows), rounded at ``2^-24 |s|``; a loss formed as ``LSE - l_t`` keeps
    ``FLOOR_ROUNDINGS`` such roundings, and a gradient element sums terms ``p s / N`` (N the rows a mean
    divides by; 1 for "sum" / "none"), whose ``p - 1`` at the target is formed from a rounded ``p``.
    At N = 4099 and temperature 0.05 the gradient floor is 2.3e-9 against gradients of ~1e-5."""
    vals = {**kwargs, **tensors}

    def num(k):
        v = vals.get(k)
        return None if v is None else abs(float(v))
    s = 20.0
    if num("temperature"):
        s = 1.0 / num("temperature")
    elif num("logit_scale") is not None:
        s = num("logit_scale")
    elif num("scale") is not None:
        s = num("scale")
    s += num("logit_bias") or 0.0
    rows = [v for v in tensors.values() if v.dim() >= 2]
    if kwargs.get("normalize") is False and rows:
        s *= max(float(torch.linalg.vector_norm(v.double(), dim=-1).max()) for v in rows) ** 2
    n = rows[0].shape[0] if rows and kwargs.get("reduction", "mean") == "mean" else 1
    unit = FLOOR_ROUNDINGS * 2.0**-24 * s
    return unit, unit / max(n, 1)


def check_output(name: str, got: Tensor, truth: Tensor, same: Tensor | None, dtype: torch.dtype,
                 amp: float = 0.0, e_same: float | None = None, ref: float | None = None,
                 floor: float = 0.0, cap: bool | None = None) -> tuple[Worst, float, float]:
    """(the element nearest to or furthest past its tolerance, its error, its tolerance) of one output
    under THE rule; ``amp``: :func:`amp_of` of the input whose gradient this is (0 for the loss and
    tensor inputs); ``e_same``: PyTorch's same-dtype error when known already (else from ``same``);
    ``ref``: the loss's scale, ``max(1, max |truth loss|)``, against which an output is zero; ``floor``:
    :func:`rounding_floor`'s, for this output; ``cap``: :func:`tolerance`'s (False where the same-dtype
    error is a whole model's in 16 bits, not a loss's, as in the training-step tests)."""
    if got.shape != truth.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(truth.shape)}")
    err = _error(got, truth)
    if e_same is None:
        e_same = same_dtype_error(same, truth) if same is not None else 0.0
    if ref is not None and max(_finite_max(truth.detach().double().cpu()), amp) <= ZERO * ref:
        # zero up to float64 rounding: zero up to the dtype's rounding of the loss's terms
        tol = torch.full(truth.shape, 0.1 * SLACK[dtype] * ref, dtype=torch.float64)
    else:
        tol = tolerance(truth, e_same, dtype, amp, cap) + spacing(truth, got.dtype) + floor
    if err.numel() == 0:
        return Worst(name, (), 0.0, 0.0, 0.0, 0.0), 0.0, 0.0
    ratio = err / tol.clamp_min(1e-300)
    flat = int(ratio.flatten().argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else ()
    g, t = got.detach().double().cpu().flatten()[flat], truth.detach().double().cpu().flatten()[flat]
    e, tl = float(err.flatten()[flat]), float(tol.flatten()[flat])
    return Worst(name, idx, float(g), float(t), e, tl), e, tl


def _ratio(err: float, tol: float) -> float:
    """err / tol, with 0 / 0 = 0 (an exactly-zero output computed exactly) and e / 0 = inf."""
    if err == 0:
        return 0.0
    return err / tol if tol > 0 else float("inf")


def compare(case: Case, n: int, d: int, dtype: torch.dtype, backend: str, device="cpu", *, seed: int = 0,
            canary: bool = False, inputs: Inputs | None = None, regime: str = "flat") -> Comparison:
    """``backend`` on ``case`` at (N, D) in ``dtype`` under THE rule (module docstring), on the inputs
    of ``regime`` (``cases.REGIMES``) unless ``inputs`` are given."""
    tensors, kwargs = inputs if inputs is not None else make_inputs(case, n, d, seed, regime)
    rounded = {k: (v.to(dtype).double() if v.dim() > 0 else v.double()) for k, v in tensors.items()}
    truth_loss, truth_grads = run(case, (rounded, kwargs), "reference", torch.float64)
    got_loss, got_grads = run(case, (tensors, kwargs), backend, dtype, device, canary=canary)
    if dtype == torch.float64:
        same_loss, same_grads = truth_loss, truth_grads
    else:
        with reference.computing_in(dtype):
            same_loss, same_grads = run(case, (tensors, kwargs), "reference", dtype)
    problems = []
    worst: Worst | None = None
    ref = max(1.0, _finite_max(truth_loss.detach().double().cpu()))
    f_loss, f_grad = rounding_floor(tensors, kwargs)
    loss_w, loss_err, loss_tol = check_output("loss", got_loss, truth_loss, same_loss, dtype, ref=ref, floor=f_loss)
    worst = loss_w
    grad_err, grad_tol, ratio = 0.0, 0.0, -1.0
    for k, tg in truth_grads.items():
        gg = got_grads.get(k)
        if (tg is None) != (gg is None):
            problems.append(f"gradient of {k}: {'missing' if gg is None else 'unexpected'}")
            continue
        if tg is None:
            continue
        if gg.dtype != (dtype if tensors[k].dim() > 0 else gg.dtype):
            problems.append(f"gradient of {k} has dtype {gg.dtype}, want {dtype}")
        w, e, t = check_output(f"grad {k}", gg, tg, same_grads.get(k), dtype, amp_of(tensors[k]), ref=ref,
                               floor=0.0 if tensors[k].dim() == 0 else f_grad)
        if _ratio(e, t) > ratio:
            ratio, grad_err, grad_tol = _ratio(e, t), e, t
        if _ratio(e, t) > _ratio(worst.err, worst.tol):
            worst = w
    return Comparison(loss_err, loss_tol, grad_err, grad_tol, worst, tuple(problems))


def assert_close(got: Tensor, want: Tensor, *, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Elementwise ``|got - want| <= atol + rtol * |want|`` (matching infinities and NaNs equal); on
    failure the message names the worst index, both values and the error. For tests that compare with
    an independent computation of their own (hand-derived values, peer formulas)."""
    got_d, want_d = got.detach().double().cpu(), want.detach().double().cpu()
    if got_d.shape != want_d.shape:
        raise AssertionError(f"{what}: shape {tuple(got_d.shape)} != {tuple(want_d.shape)}")
    err = _error(got_d, want_d)
    bound = atol + rtol * want_d.abs().nan_to_num(posinf=0.0, neginf=0.0)
    excess = err - bound
    if excess.numel() and float(excess.max()) > 0:
        flat = int(excess.flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got_d.shape)) if got_d.dim() else ()
        raise AssertionError(f"{what}: worst at {idx}: got {float(got_d.flatten()[flat]):.8g}, want "
                             f"{float(want_d.flatten()[flat]):.8g}, |err| {float(err.flatten()[flat]):.3g} > "
                             f"{float(bound.flatten()[flat]):.3g}")


def loss_and_grads(fn, tensors: dict[str, Tensor], backend: str, upstream: Tensor | None = None, **kwargs):
    """``fn(**tensors, **kwargs, backend=backend)`` on fresh leaves (floating tensors require grad); a
    per-row loss is reduced with ``upstream`` weights (ones by default). Returns (loss, {name: grad})."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    loss = fn(**leaves, **kwargs, backend=backend)
    total = loss if loss.dim() == 0 else (loss * (upstream if upstream is not None else 1.0)).sum()
    total.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


__all__ = ["SLACK", "Comparison", "Worst", "amp_of", "assert_close", "check_output", "compare", "loss_and_grads", "run",
           "rounding_floor", "spacing", "tolerance"]
