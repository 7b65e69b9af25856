"""One registry of loss cases on random data, shared by ``python -m fused_contrastive check``, the
test-suite and the benchmarks, plus the comparison of a backend against the reference.

A case builds its inputs on the CPU from a seeded generator (float32), then casts them to the
dtype and device asked for. ``grad_inputs`` are the tensors whose gradients are compared (a tensor
temperature / scale included); ``kwargs`` are the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .cosent import cosent_loss, cosent_loss_from_scores
from .losses import clip_loss, dscl_loss, info_nce, simcse_loss, simcse_sup_loss, supcon_loss

Inputs = Tuple[Dict[str, Tensor], Dict[str, object]]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Tensor]
    build: Callable[[int, int, torch.Generator], Inputs]
    infonce_family: bool = True  # runs on the core op (so on the triton backend too)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _temp(v: float = 0.1) -> Tensor:
    return torch.tensor(v)


def _info_nce(n, d, g):
    m = n + 3  # M != N on purpose
    tgt = torch.randint(0, m, (n,), generator=g)
    return {"query": _randn(g, n, d), "keys": _randn(g, m, d), "temperature": _temp(0.07)}, {"target": tgt}


def _info_nce_self(n, d, g):
    tgt = (torch.arange(n) + torch.randint(1, max(n, 2), (n,), generator=g)) % max(n, 1)
    if n == 1:
        return {"query": _randn(g, n, d)}, {"target": tgt, "exclude_self": False}
    return {"query": _randn(g, n, d)}, {"target": tgt, "temperature": 0.05}


def _info_nce_ignore(n, d, g):
    tgt = torch.randint(0, n, (n,), generator=g)
    tgt[::3] = -100
    if n > 1:
        tgt[1] = 0
    return {"query": _randn(g, n, d), "keys": _randn(g, n, d)}, {"target": tgt, "reduction": "sum"}


def _clip(n, d, g):
    return {"a": _randn(g, n, d), "b": _randn(g, n, d), "logit_scale": torch.tensor(14.3)}, {}


def _simcse(n, d, g):
    return {"z1": _randn(g, 2 * max(1, n // 2), d)}, {"temperature": 0.05}


def _simcse_two_view(n, d, g):
    return {"z1": _randn(g, n, d), "z2": _randn(g, n, d), "temperature": _temp(0.05)}, {}


def _simcse_sup(n, d, g):
    return ({"anchor": _randn(g, n, d), "positive": _randn(g, n, d), "negative": _randn(g, n, d)},
            {"hard_negative_weight": 0.5})


def _labels(bsz, g):
    return torch.randint(0, max(1, bsz // 3), (bsz,), generator=g)


def _supcon(variant):
    def build(n, d, g):
        bsz = max(1, n // 2)
        return ({"features": _randn(g, bsz, 2, d), "temperature": _temp(0.1)},
                {"labels": _labels(bsz, g), "variant": variant})
    return build


def _supcon_mask(n, d, g):
    bsz = max(1, n // 2)
    mask = (torch.rand(bsz, bsz, generator=g) < 0.3).float()
    return {"features": _randn(g, bsz, 2, d)}, {"mask": mask, "variant": "in", "reduction": "none"}


def _supcon_one(n, d, g):
    bsz = max(1, n // 3)
    return {"features": _randn(g, bsz, 3, d)}, {"labels": _labels(bsz, g), "contrast_mode": "one"}


def _supcon_queue(n, d, g):
    bsz = max(1, n // 2)
    k = 7
    return ({"features": _randn(g, bsz, 2, d)},
            {"labels": _labels(bsz, g), "queue": _randn(g, k, d),
             "queue_labels": torch.randint(0, max(1, bsz // 3), (k,), generator=g)})


def _dscl(queue: bool):
    def build(n, d, g):
        bsz = max(1, n // 2)
        kw: Dict[str, object] = {"labels": _labels(bsz, g)}
        if queue:
            kw["queue"] = _randn(g, 5, d)
            kw["queue_labels"] = torch.randint(0, max(1, bsz // 3), (5,), generator=g)
        return {"features": _randn(g, bsz, 2, d), "temperature": _temp(0.1)}, kw
    return build


def _cosent(n, d, g):
    return ({"u": _randn(g, n, d), "v": _randn(g, n, d)},
            {"labels": torch.randint(0, 5, (n,), generator=g).float()})


def _cosent_scores(n, d, g):
    return {"scores": _randn(g, n), "scale": torch.tensor(20.0)}, {"labels": torch.randn(n, generator=g)}


CASES: List[Case] = [
    Case("info_nce", info_nce, _info_nce),
    Case("info_nce_self", info_nce, _info_nce_self),
    Case("info_nce_ignore", info_nce, _info_nce_ignore),
    Case("clip", clip_loss, _clip),
    Case("simcse", simcse_loss, _simcse),
    Case("simcse_two_view", simcse_loss, _simcse_two_view),
    Case("simcse_sup", simcse_sup_loss, _simcse_sup),
    Case("supcon_out", supcon_loss, _supcon("out")),
    Case("supcon_in", supcon_loss, _supcon("in")),
    Case("supcon_mask_in", supcon_loss, _supcon_mask),
    Case("supcon_one", supcon_loss, _supcon_one),
    Case("supcon_queue", supcon_loss, _supcon_queue),
    Case("dscl", dscl_loss, _dscl(False)),
    Case("dscl_queue", dscl_loss, _dscl(True)),
    Case("cosent", cosent_loss, _cosent, infonce_family=False),
    Case("cosent_scores", cosent_loss_from_scores, _cosent_scores, infonce_family=False),
]
CASE_BY_NAME = {c.name: c for c in CASES}


def make_inputs(case: Case, n: int, d: int, seed: int = 0) -> Inputs:
    return case.build(n, d, torch.Generator().manual_seed(seed))


def run(case: Case, inputs: Inputs, backend: str, dtype: torch.dtype, device="cpu",
        upstream_seed: int = 1) -> Tuple[Tensor, Dict[str, Optional[Tensor]]]:
    """Loss and gradients of ``case`` on ``backend``. Embeddings are cast to ``dtype`` (0-dim
    temperature-like tensors stay float32, or float64 with float64); a per-row loss is reduced with
    random upstream weights so that every row's gradient is checked."""
    tensors, kwargs = inputs
    leaves = {}
    for k, v in tensors.items():
        dt = dtype if v.dim() > 0 else (torch.float64 if dtype == torch.float64 else torch.float32)
        leaves[k] = v.detach().to(device=device, dtype=dt).clone().requires_grad_(True)
    kw = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in kwargs.items()}
    loss = case.fn(**leaves, **kw, backend=backend)
    total = loss
    if loss.dim() > 0:
        w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(upstream_seed)).to(loss)
        total = (loss * w).sum()
    total.backward()
    return loss.detach(), {k: (v.grad.detach() if v.grad is not None else None) for k, v in leaves.items()}


def _max_err(x: Tensor, y: Tensor) -> float:
    x, y = x.double().cpu(), y.double().cpu()
    both_inf = torch.isinf(x) & torch.isinf(y) & (torch.sign(x) == torch.sign(y))
    d = torch.where(both_inf, torch.zeros_like(x), (x - y).abs())
    return float(d.max()) if d.numel() else 0.0


@dataclass
class Comparison:
    loss_err: float
    grad_err: float
    loss_tol: float
    grad_tol: float

    @property
    def ok(self) -> bool:
        return self.loss_err <= self.loss_tol and self.grad_err <= self.grad_tol


# absolute slack per dtype, scaled by (1 + max |truth|)
_ATOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def compare(case: Case, n: int, d: int, dtype: torch.dtype, backend: str, device="cpu", seed: int = 0) -> Comparison:
    """Errors of ``backend`` in ``dtype`` against float64 ground truth (the reference backend on the
    same, dtype-rounded inputs, computed in float64), with a tolerance of twice the error of the
    reference backend run on the ``dtype`` inputs, plus a slack of ``_ATOL[dtype] * (1 + max|truth|)``.

    The reference accumulates half inputs in float32, so for float16/bfloat16 the tolerance is
    mostly the slack, which is below PyTorch's own half-precision error (tests/test_triton.py
    measures that error by forcing the reference to compute in the half dtype)."""
    tensors, kwargs = make_inputs(case, n, d, seed)
    rounded = {k: (v.to(dtype).double() if v.dim() > 0 else v.double()) for k, v in tensors.items()}
    truth_loss, truth_grads = run(case, (rounded, kwargs), "reference", torch.float64)
    got_loss, got_grads = run(case, (tensors, kwargs), backend, dtype, device)
    if dtype == torch.float64:
        same_loss, same_grads = truth_loss, truth_grads
    else:
        same_loss, same_grads = run(case, (tensors, kwargs), "reference", dtype)
    loss_err = _max_err(got_loss, truth_loss)
    atol = _ATOL[dtype]
    grad_err, grad_tol = 0.0, 0.0
    worst = -1.0
    for k, tg in truth_grads.items():
        gg = got_grads[k]
        if tg is None or gg is None:
            if (tg is None) != (gg is None):
                grad_err, grad_tol, worst = float("inf"), 0.0, float("inf")
            continue
        finite = tg[torch.isfinite(tg)]
        gmax = float(finite.abs().max()) if finite.numel() else 0.0
        if tensors[k].dim() == 0:
            # a temperature's gradient is -s^2 dL/ds: rounding in dL/ds is amplified by 1/t^2
            gmax = max(gmax, 1.0 / min(abs(float(tensors[k])), 1.0) ** 2)
        err = _max_err(gg, tg)
        tol = 2 * _max_err(same_grads[k], tg) + atol * (1 + gmax)
        if err / tol > worst:  # report the input closest to (or furthest past) its tolerance
            worst, grad_err, grad_tol = err / tol, err, tol
    finite_loss = truth_loss[torch.isfinite(truth_loss)]
    lmax = float(finite_loss.abs().max()) if finite_loss.numel() else 0.0
    return Comparison(
        loss_err=loss_err,
        grad_err=grad_err,
        loss_tol=2 * _max_err(same_loss, truth_loss) + atol * (1 + lmax),
        grad_tol=grad_tol,
    )
