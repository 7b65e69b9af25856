"""Every loss under ``torch.autocast`` (CPU, bfloat16): forward and backward run, and give exactly what
the same call gives outside the autocast region on the same tensors (the losses accumulate in float32
themselves; autocast must not re-type their matmuls). Before ``_amp.autocast_off`` the backward raised
``expected m1 and m2 to have the same dtype`` on every InfoNCE-family loss.

Independent checks: the call outside autocast (itself checked against float64 by test_losses.py), and
the float64 reference on the same bf16-rounded embeddings within bf16's accuracy."""

from __future__ import annotations

import pytest
import torch
from conftest import set_path

import fused_contrastive as fc
from fused_contrastive.testing import CASES

BACKENDS = ["torch-dense", "torch-chunked", "triton"]
# alignment is elementwise PyTorch with no kernel (backend="triton" raises): its torch rows cover it
TRITON_CASES = [c for c in CASES if c.has_triton]
CASE_BACKENDS = [(c, b) for c in CASES for b in BACKENDS if b != "triton" or c in TRITON_CASES]


def _run(case, tensors, kwargs, backend, amp: bool = False):
    """Forward and backward under autocast when ``amp`` (backward inside the region too: the autograd
    functions must disable it in their backward as well, not only in their forward)."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = case.fn(**leaves, **kwargs, backend=backend)
        loss.sum().backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


def _embed(tensors: dict, dtype: torch.dtype) -> dict:
    # an upstream Linear under autocast makes bf16 activations, as an encoder does; "float32" keeps the
    # raw float32 tensors (autocast leaves a loss's own inputs alone)
    out = {}
    for k, v in tensors.items():
        out[k] = v.to(dtype) if (v.is_floating_point() and v.dim() >= 2) else v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-in", "bf16-in"])
@pytest.mark.parametrize("case,backend", CASE_BACKENDS, ids=[f"{c.name}-{b}" for c, b in CASE_BACKENDS])
def test_loss_under_autocast_equals_the_call_outside_it(case, backend, dtype, monkeypatch):
    if backend.startswith("torch"):
        set_path(monkeypatch, backend.split("-")[1])
    n, d = (24, 16) if backend == "triton" else (37, 24)
    g = torch.Generator().manual_seed(7)
    tensors, kwargs = case.build(n, d, g)
    tensors = _embed(tensors, dtype)
    be = backend.split("-")[0]
    want_loss, want_grads = _run(case, tensors, kwargs, be)
    loss, grads = _run(case, tensors, kwargs, be, amp=True)
    assert loss.dtype == want_loss.dtype and torch.equal(loss, want_loss), (loss, want_loss)
    for k, gr in grads.items():
        if want_grads[k] is None:
            assert gr is None, k
            continue
        assert gr.dtype == tensors[k].dtype, (k, gr.dtype)
        assert torch.equal(gr, want_grads[k]), k
    # and the float64 truth of the same rounded inputs, within bf16 accuracy where the inputs are bf16
    truth, _ = _run(case, {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}, kwargs,
                    "reference")
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-3
    assert torch.allclose(loss.double(), truth, rtol=tol, atol=tol), (loss, truth)


def test_metrics_encode_and_modules_train_under_autocast():
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8))
    x = torch.randn(10, 12)
    clip = fc.nn.CLIPLoss()
    steps = {
        "uniformity": lambda z: fc.uniformity(z),
        "alignment": lambda z: fc.alignment(z[:5], z[5:]),
        "clip_module": lambda z: clip(z[:5], z[5:]),
        "info_nce_module": lambda z: fc.nn.InfoNCELoss(0.1)(z[:5], z[5:]),
        "chunked_encode": lambda z: fc.info_nce(z[:5], z[5:]),
    }
    for name, f in steps.items():
        grads = []
        for amp in (True, False):
            enc.zero_grad(set_to_none=True)
            clip.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                z = fc.encode_in_chunks(enc, x, 3) if name == "chunked_encode" else enc(x)
                loss = f(z)
            loss.backward()  # outside the region, as PyTorch's AMP recipe does
            grads.append([p.grad.clone() for p in enc.parameters()])
            assert torch.isfinite(loss), name
        # autocast changes the encoder's precision, not the loss's: the gradients agree to bf16 accuracy
        for ga, gf in zip(grads[0], grads[1], strict=True):
            assert torch.allclose(ga, gf, rtol=0.1, atol=5e-2 * gf.abs().max().item() + 1e-6), name


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c.name for c in TRITON_CASES])
def test_triton_interpreter_takes_no_log_of_zero(case):
    """Masked lanes, excluded self columns and rows without positives make sums of exponentials of 0,
    whose log is -inf; the kernels give it without evaluating log(0) (numpy's 'divide by zero
    encountered in log' under the interpreter, one per such launch), and the result is unchanged:
    it equals the float64 reference."""
    import warnings

    g = torch.Generator().manual_seed(3)
    tensors, kwargs = case.build(13, 8, g)  # 13: partial blocks, so padded lanes exist
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss, _ = _run(case, tensors, kwargs, "triton")
    logs = [str(w.message) for w in seen if "encountered in log" in str(w.message)]
    assert not logs, logs
    truth, _ = _run(case, {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}, kwargs,
                    "reference")
    assert torch.allclose(loss.double(), truth, rtol=2e-3, atol=2e-3), (loss, truth)
