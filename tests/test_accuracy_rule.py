"""THE accuracy rule (``fused_contrastive/testing/accuracy.py``) can fail: planted defects in the
backward (a gradient zeroed, scaled by 0.9, one row dropped, an intermediate 30 times the gradient's
size rounded to bf16 before the cancellation that forms it, the Matryoshka kernels' defect of 0.2) fail
``compare`` at every dtype, also at N = 4099 where a mean-reduced loss's gradients are ~1e-5, while
the healthy torch backend passes at the same shapes; and the rule's parts against hand-derived values.

Each defect is an identity autograd Function on every embedding input whose backward alters the
gradient it passes on, so the loss's own code is untouched and the defect is exactly what is named.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fused_contrastive.testing import CASE_BY_NAME, compare
from fused_contrastive.testing.accuracy import SLACK, check_output, spacing, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _zeroed(g):
    return torch.zeros_like(g)


def _scaled(g):
    return g * 0.9


def _row_dropped(g):
    g = g.clone()
    g.reshape(g.shape[0], -1)[g.shape[0] // 2] = 0
    return g


def _bf16_intermediate(g):
    # the gradient formed as (big + g) - big with the sum rounded to bf16 first: the target term of
    # p - y subtracted after the softmax part was rounded (what the Matryoshka kernels did)
    big = 30.0 * g.detach().abs().max()
    return ((big + g.float()).to(torch.bfloat16).float() - big).to(g.dtype)


DEFECTS = {"zeroed": _zeroed, "scaled 0.9": _scaled, "one row dropped": _row_dropped,
           "bf16-rounded intermediate": _bf16_intermediate}


class _Planted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, defect):
        ctx.defect = defect
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.defect(g), None


def _planted(case, defect):
    """``case`` whose backend under test (not the reference, which the truth and PyTorch's same-dtype
    error come from) passes its gradients through ``defect``."""
    def fn(**kw):
        if kw["backend"] != "reference":
            kw = {k: (_Planted.apply(v, defect) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.requires_grad
                      else v) for k, v in kw.items()}
        return case.fn(**kw)
    return dataclasses.replace(case, fn=fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("defect", DEFECTS)
def test_a_planted_defect_fails_at_n_4099(defect, dtype):
    case = CASE_BY_NAME["info_nce"]
    c = compare(_planted(case, DEFECTS[defect]), 4099, 32, dtype, "torch")
    assert not c.ok, f"{defect} {dtype} passed: {c}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_healthy_backend_passes_at_n_4099(dtype):
    c = compare(CASE_BY_NAME["info_nce"], 4099, 32, dtype, "torch")
    assert c.ok, str(c)


@pytest.mark.parametrize("regime", ["peaked", "sharp"])
@pytest.mark.parametrize("name", ["clip", "supcon_in", "siglip", "cosent", "gist", "simcse_sup"])
def test_defects_fail_and_health_passes_in_the_peaked_regimes(name, regime):
    case = CASE_BY_NAME[name]
    for dtype in (torch.bfloat16, torch.float16):
        healthy = compare(case, 97, 64, dtype, "torch", regime=regime)
        assert healthy.ok, f"{name} {regime} {dtype}: {healthy}"
        for defect in ("scaled 0.9", "bf16-rounded intermediate"):
            if defect == "bf16-rounded intermediate" and dtype == torch.bfloat16:
                continue  # a bf16 gradient is rounded to bf16 anyway: the defect is at fp16 and fp32
            c = compare(_planted(case, DEFECTS[defect]), 97, 64, dtype, "torch", regime=regime)
            assert not c.ok, f"{name} {regime} {dtype} {defect} passed: {c}"


def test_the_rule_by_hand():
    truth = torch.tensor([1e-5, -2e-5, 0.0], dtype=torch.float64)
    # relative to the output's size: bf16 slack 1e-2 of max|truth| = 2e-7, no floor of 1
    assert tolerance(truth, 0.0, torch.bfloat16) == pytest.approx(2e-7)
    # PyTorch's same-dtype error is granted up to the slack, never more: 2 x 1 = 2 is capped at 2e-7
    assert tolerance(truth, 1.0, torch.bfloat16) == pytest.approx(4e-7)
    assert tolerance(truth, 5e-8, torch.bfloat16) == pytest.approx(3e-7)
    # a 0-dim input's gradient: its terms' size 1 / t^2 (t = 0.05: 400)
    assert tolerance(torch.tensor(3.0, dtype=torch.float64), 0.0, torch.float32, 400.0) == pytest.approx(4e-2)
    # the output dtype's own step: fp16 steps by 2^-24 below 2^-14
    assert float(spacing(torch.tensor([1e-7]), torch.float16)[0]) == pytest.approx(2.0**-24)
    assert float(spacing(torch.tensor([1.0]), torch.float16)[0]) == pytest.approx(2.0**-10)
    # an exactly-zero output must come out zero to within its dtype's smallest step
    z = torch.zeros(3, dtype=torch.float64)
    _, e, tol = check_output("g", torch.tensor([0.0, 1e-3, 0.0]), z, None, torch.float32)
    assert e == pytest.approx(1e-3) and e > tol
    _, e, tol = check_output("g", torch.zeros(3), z, None, torch.float32)
    assert e == 0 and e <= tol
    assert SLACK[torch.bfloat16] == 1e-2 and SLACK[torch.float16] == 2e-3 and SLACK[torch.float32] == 1e-4
