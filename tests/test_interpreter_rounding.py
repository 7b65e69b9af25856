"""The ``gpu_rounding`` fixture (tests/conftest.py): under it the Triton interpreter's fp32 -> bf16 cast gives
PyTorch's round-to-nearest-even bf16 bit for bit, as the GPU's ``cvt.rn.bf16.f32`` does."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


@triton.jit
def _cast_kernel(X, Y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n).to(tl.bfloat16), mask=i < n)


def _values() -> torch.Tensor:
    """fp32 values on every side of bf16's rounding: random ones, exact halfway ties (even and odd below),
    just above and below a tie, a carry into the exponent, subnormals, the largest finite, infinities."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(400, generator=g) * torch.logspace(-30, 30, 400)
    b16 = torch.randn(64, generator=g).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    tie = (b16 << 16) | 0x8000  # exactly halfway between two bf16 values
    near = torch.cat([tie, tie + 1, tie - 1, (b16 << 16) | 0x7FFF])
    special = torch.tensor([0x3F7FFFFF, 0x00000001, 0x00400000, 0x80008000, 0x7F7FFFFF, 0x7F800000, 0xFF800000],
                           dtype=torch.int64).to(torch.int32)
    return torch.cat([base, near.view(torch.float32), special.view(torch.float32), torch.tensor([0.0, -0.0])])


def test_fp32_to_bf16_rounds_to_nearest_even(gpu_rounding):
    x = _values()
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    # the inputs do tell rounding to nearest from dropping the low bits (what the interpreter does unpatched)
    dropped = ((x.view(torch.int32) >> 16) << 16).view(torch.float32).to(torch.bfloat16)
    assert int((dropped.view(torch.int16) != want.view(torch.int16)).sum()) > 100
