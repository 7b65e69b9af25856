"""Shared test helpers: one assert that reports the worst index, and backend runners."""

from __future__ import annotations

import torch
from torch import Tensor


def assert_close(got: Tensor, want: Tensor, *, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Elementwise |got - want| <= atol + rtol * |want| (matching infinities allowed); on failure the
    message names the worst index, both values and the error."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    same_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    both_nan = torch.isnan(got) & torch.isnan(want)
    err = torch.where(same_inf | both_nan, torch.zeros_like(got), (got - want).abs())
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    bound = atol + rtol * want.abs().nan_to_num(posinf=0.0, neginf=0.0)
    excess = err - bound
    if excess.numel() and float(excess.max()) > 0:
        idx = int(excess.flatten().argmax())
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), got.shape)) if got.dim() else ()
        raise AssertionError(
            f"{what}: worst at {pos}: got {got.flatten()[idx].item():.8g}, want {want.flatten()[idx].item():.8g}, "
            f"|err| {err.flatten()[idx].item():.3g} > {bound.flatten()[idx].item():.3g}"
        )


def loss_and_grads(fn, tensors: dict, backend: str, upstream: Tensor | None = None, **kwargs):
    """Run ``fn(**tensors, **kwargs, backend=backend)`` on fresh leaves; returns (loss, {name: grad})."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    loss = fn(**leaves, **kwargs, backend=backend)
    total = loss if loss.dim() == 0 else (loss * (upstream if upstream is not None else 1.0)).sum()
    total.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}
