"""The panel path's fp32-output GEMM fallback (``core/lse/triton_panel.py``): the upcast route runs 16-bit
operands on TF32 (exact: bf16's 8 and fp16's 11 significant bits fit TF32's 11), the global flag
restored; and a first call that is traced or captured, where no probe can run, says once which route
it took."""

from __future__ import annotations

import warnings

import pytest
import torch

from fused_contrastive.core.triton_shared import panels


def _spy(monkeypatch):
    seen = []
    orig_mm, orig_addmm = torch.mm, torch.Tensor.addmm_

    def mm(x, y, *a, **k):
        seen.append(("mm", x.dtype, torch.backends.cuda.matmul.allow_tf32))
        return orig_mm(x, y, *a, **k)

    def addmm_(self, x, y, *a, **k):
        seen.append(("addmm", x.dtype, torch.backends.cuda.matmul.allow_tf32))
        return orig_addmm(self, x, y, *a, **k)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    return seen


@pytest.mark.parametrize("dtype,tf32", [(torch.bfloat16, True), (torch.float16, True)])
def test_the_upcast_route_uses_tf32_for_bf16_only(monkeypatch, dtype, tf32):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 40, generator=g).to(dtype), torch.randn(40, 16, generator=g).to(dtype)
    acc = torch.zeros(24, 16)
    assert panels.gemm_routes(x.device, dtype) == ("upcast", "upcast")  # the CPU has no native route
    before = torch.backends.cuda.matmul.allow_tf32
    seen = _spy(monkeypatch)
    got = panels._mm32(x, y)
    panels._addmm32_(acc, x, y)
    assert [(op, dt, flag) for op, dt, flag in seen] == [("mm", torch.float32, tf32), ("addmm", torch.float32, tf32)]
    assert torch.backends.cuda.matmul.allow_tf32 == before
    want = x.double() @ y.double()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(acc.double(), want, atol=1e-5)


def test_16_bit_values_are_exact_in_tf32():
    # TF32 keeps fp32's exponent and the top 10 of its 23 mantissa bits: a value is exact in TF32 when the
    # low 13 mantissa bits of its fp32 form are 0; every bf16 and fp16 value (fp16 subnormals included,
    # which are normal in fp32) is, a random fp32 value is not
    for dt in (torch.bfloat16, torch.float16):
        x = torch.cat([torch.randn(10000), torch.rand(1000) * 6e-5]).to(dt).float()
        assert bool(((x.view(torch.int32) & 0x1FFF) == 0).all()), dt
    assert not bool(((torch.randn(10000).view(torch.int32) & 0x1FFF) == 0).all())


def test_an_unprobed_traced_first_call_warns_once(monkeypatch):
    monkeypatch.setattr(panels, "GEMM_PROBE_DEVICES", ("cpu",))
    monkeypatch.setattr(panels, "_GEMM_ROUTES", {})
    monkeypatch.setattr(panels, "_UNPROBED_WARNED", set())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    dev = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match="traced or captured.*'upcast' route"):
        assert panels.gemm_routes(dev, torch.bfloat16) == ("upcast", "upcast")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert panels.gemm_routes(dev, torch.bfloat16) == ("upcast", "upcast")  # said once
    assert panels._GEMM_ROUTES == {}  # nothing cached: an eager call probes later
