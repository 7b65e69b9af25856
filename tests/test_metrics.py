"""alignment / uniformity (seed 002) against the textbook formulas in float64, written here directly:
``(F.normalize(x) - F.normalize(y)).norm(dim=1).pow(alpha).mean()`` and
``torch.pdist(F.normalize(x)).pow(2).mul(-t).exp().mean().log()`` (pdist lists the pairs i < j once;
the mean over ordered pairs i != j is the same number)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_memory import LargestTensor

import fused_contrastive as fc
from fused_contrastive.core.triton_shared import launch as TL


def _x(n, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * 3).to(dtype)


def _align_direct(x, y, alpha, normalize=True):
    if normalize:
        x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
    return (x - y).norm(dim=1).pow(alpha).mean()


def _unif_direct(x, t, normalize=True):
    if normalize:
        x = F.normalize(x, dim=1)
    return torch.pdist(x).pow(2).mul(-t).exp().mean().log()


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs)


@pytest.mark.parametrize("alpha", [2.0, 1.0, 3.0, 0.5])
@pytest.mark.parametrize("normalize", [True, False])
def test_alignment_matches_the_formula(alpha, normalize):
    x, y = _x(37, 11, 1), _x(37, 11, 2)
    got, (gx, gy) = _grads(lambda a, b: fc.alignment(a, b, alpha, normalize=normalize), x, y)
    want, (wx, wy) = _grads(lambda a, b: _align_direct(a, b, alpha, normalize), x, y)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gx, wx, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(gy, wy, rtol=1e-10, atol=1e-14)


def test_alignment_of_coinciding_pairs_is_zero_with_a_finite_gradient():
    x = _x(5, 4)
    for alpha in (0.5, 1.0, 2.0):
        xr = x.clone().requires_grad_(True)
        out = fc.alignment(xr, x.clone(), alpha)
        out.backward()
        assert out.item() == 0.0
        assert torch.equal(xr.grad, torch.zeros_like(x))


def test_alignment_of_antipodal_unit_pairs_is_two_to_the_alpha():
    x = _x(6, 3)
    for alpha in (1.0, 2.0, 3.0):  # ||u - (-u)|| = 2 for a unit u
        assert fc.alignment(x, -x, alpha).item() == pytest.approx(2.0 ** alpha, rel=1e-14)


def test_alignment_low_precision_inputs():
    x, y = _x(64, 32, 1), _x(64, 32, 2)
    want = _align_direct(x, y, 2.0)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        got = fc.alignment(x.to(dt), y.to(dt))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("n", [2, 3, 40, 97])
@pytest.mark.parametrize("normalize", [True, False])
def test_uniformity_matches_the_formula_on_the_torch_backend(n, normalize, path):
    d = 7
    x = _x(n, d, n)
    if not normalize:
        x = x / 4  # distances of order 1, so that exp(-t d^2) stays well inside float64's range
    t = torch.tensor(1.5, dtype=torch.float64)
    for be in ("torch", "reference"):
        got, g = _grads(lambda a, tt, be=be: fc.uniformity(a, tt, normalize=normalize, backend=be), x, t)
        want, w = _grads(lambda a, tt: _unif_direct(a, tt, normalize), x, t)
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_uniformity_default_temperature_is_two():
    x = _x(20, 5)
    torch.testing.assert_close(fc.uniformity(x), _unif_direct(x, 2.0), rtol=1e-12, atol=1e-13)


def test_uniformity_is_finite_where_the_direct_formula_underflows():
    # 4 orthonormal rows: every squared distance is 2, so uniformity = -2t exactly (hand-derived);
    # exp(-2000) is 0 in float64, so the textbook formula returns -inf
    x = torch.eye(4, dtype=torch.float64) * 5
    t = 1000.0
    assert _unif_direct(x, t).item() == -math.inf
    assert fc.uniformity(x, t).item() == pytest.approx(-2 * t, rel=1e-15)
    assert fc.uniformity(x, t, normalize=False).item() == pytest.approx(-t * 50, rel=1e-15)


@pytest.mark.skipif(not TL.interpreted(), reason="the triton kernels run on the CPU only under the interpreter")
@pytest.mark.parametrize("normalize", [True, False])
def test_uniformity_triton_backend(normalize):
    x = _x(70, 20, 3)
    if not normalize:
        x = x / 8
    want, (wx,) = _grads(lambda a: _unif_direct(a, 2.0, normalize), x)
    got, (gx,) = _grads(lambda a: fc.uniformity(a, normalize=normalize, backend="triton"), x.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx.double(), wx, rtol=1e-4, atol=1e-6)


def test_uniformity_low_precision_inputs():
    x = _x(50, 16, 4)
    want = _unif_direct(x, 2.0)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        got = fc.uniformity(x.to(dt), backend="torch")
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_uniformity_allocates_nothing_n_by_n():
    n = 4096
    x = _x(n, 16, 5, torch.float32).requires_grad_(True)
    with LargestTensor() as probe:
        fc.uniformity(x, backend="torch").backward()
    assert probe.largest <= n * n // 8, f"largest tensor {probe.largest} elements from {probe.op}"
    with LargestTensor() as ref_probe:  # the probe does see the reference's N x N distances
        fc.uniformity(x.detach()[:512], backend="reference")
    assert ref_probe.largest >= 512 * 512


@pytest.mark.parametrize("call, match", [
    (lambda: fc.uniformity(torch.randn(1, 3)), "at least 2 rows"),
    (lambda: fc.uniformity(torch.randn(4, 3), t=0.0), "t must be"),
    (lambda: fc.uniformity(torch.randn(4, 3), t=-1.0), "t must be"),
    (lambda: fc.uniformity(torch.randn(4, 3), backend="fast"), "backend"),
    (lambda: fc.uniformity(torch.randn(4, 3), normalize=1), "normalize"),
    (lambda: fc.alignment(torch.randn(4, 3), torch.randn(5, 3)), "as many rows"),
    (lambda: fc.alignment(torch.randn(4, 3), torch.randn(4, 2)), "dimension"),
    (lambda: fc.alignment(torch.randn(4, 3), torch.randn(4, 3), alpha=0), "alpha must be"),
    (lambda: fc.alignment(torch.randn(0, 3), torch.randn(0, 3)), "must not be empty"),
    (lambda: fc.alignment(torch.randn(4, 3), torch.randn(4, 3), backend="fast"), "backend"),
    (lambda: fc.alignment(torch.randn(4, 3), torch.randn(4, 3), backend="triton"), "no Triton kernel"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --- degenerate rows ---------------------------------------------------------------------------------
# A zero row normalises to 0 (as F.normalize), so its squared distance to a unit row is 1, not 2; a row of
# norm below eps normalises to x / eps (norm < 1). The textbook (pdist of F.normalize) and the reference
# see that; the unit-row shortcut 2 - 2 cos did not.


def _unif_pairs(x, t, normalize=True):
    """The textbook on the materialised ordered pairs, written with differences (exact at duplicates)."""
    if normalize:
        x = F.normalize(x, dim=1)
    n = x.shape[0]
    sq = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
    off = ~torch.eye(n, dtype=torch.bool)
    return torch.logsumexp(-t * sq[off], dim=0) - math.log(n * (n - 1))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_uniformity_of_a_zero_row_and_a_tiny_row_is_the_textbook(backend, path):
    # hand-derived: [[1, 0], [0, 0]]: the one distance^2 is 1, so uniformity = log exp(-t) = -t = -2;
    # [[1, 0], [1e-13, 0]]: the tiny row normalises to [0.1, 0], distance^2 0.81, so -1.62
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert fc.uniformity(x, 2.0, backend=backend).item() == pytest.approx(-2.0, rel=1e-6)
    x = torch.tensor([[1.0, 0.0], [1e-13, 0.0]], dtype=torch.float64)
    assert fc.uniformity(x, 2.0, backend=backend).item() == pytest.approx(-1.62, rel=1e-12)


@pytest.mark.parametrize("normalize", [True, False])
def test_uniformity_of_duplicated_rows_in_float32_has_the_textbooks_accuracy(normalize, path):
    """At t = 20 a duplicated row's softmax weight dominates and its pair gradient x_i - x_j is exactly 0;
    the inner-product form recovers it as a difference of terms of size 4t. The torch backend runs in
    float64, so float32 inputs get the gradient to float32 rounding (the float32 textbook's own error
    on these inputs is ~1e-6; the float32 inner-product form's was 2e-3 to 6e-2)."""
    g = torch.Generator().manual_seed(11)
    for n, d in ((8, 4), (64, 16), (150, 32)):
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        if not normalize:
            x = x / (2 * d ** 0.5)
        x[1] = x[0]
        x[5] = x[3]
        t = 20.0 if normalize else 5.0
        want, (wx,) = _grads(lambda a, t=t: _unif_pairs(a, t, normalize), x)
        got, (gx,) = _grads(lambda a, t=t: fc.uniformity(a, t, normalize=normalize, backend="torch"), x.float())
        assert got.dtype == torch.float32
        assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
        rel = ((gx.double() - wx).norm() / wx.norm()).item()
        assert rel < 1e-6, (n, d, rel)
