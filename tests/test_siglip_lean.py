"""SigLIP's lean epilogue (``FUSED_CONTRASTIVE_SIGLIP_EPILOGUE`` = ``lean`` / ``lean128``: ``kernels/common.py``
``_log1p_unit``, ``_softplus_lean`` and ``_dz_lean`` in the epilogue GEMM's MODE 4 / 5) against float64.

1. The log1p polynomial's coefficients in float64 over a dense grid of (0, 1] (its math error, and the error of
   its fp32 Horner steps), against ``numpy.log1p``.
2. The device helpers under the interpreter on a dense grid of logits in fp32, against float64 softplus and
   sigmoid (``logaddexp``, ``torch.sigmoid``). The interpreter divides exactly where the GPU takes
   ``div.approx.f32`` (2 ulp), and its exp2 has no ``ex2.approx`` error: the GPU's two approximations are
   not seen here.
3. The loss and every gradient of the panel route with the lean epilogue (bf16 through ``siglip_loss``; fp32
   through ``triton_sweep.siglip_sweep`` itself, which CUDA gives only 16-bit operands: the kernel's math at
   fp32 precision), flat and saturated logits, with and without a learnable scale and bias, positives at an
   offset of a wider text set, against the float64 definition (``tests/test_siglip.py`` ``_truth``), with the
   tolerances of the exact epilogue's tests (``tests/test_triton_panel.py``: loss 2e-3 relative, gradients
   2e-2 of their largest entry in bf16; ``tests/test_siglip.py``: 2e-5 in fp32, 2e-3 at huge scales).
4. The planted defects these checks must catch: a wrong polynomial coefficient, the sigmoid's two branches
   swapped.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_siglip import _truth, triton_against_truth  # tests/ is on sys.path (rootdir-relative imports, no package)

from fused_contrastive import routes
from fused_contrastive.testing import assert_close

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
import triton.language as tl  # noqa: E402
from fused_contrastive.kernels import common as KC  # noqa: E402
from fused_contrastive.kernels import panel as KP  # noqa: E402

from fused_contrastive.core.siglip import triton_sweep  # noqa: E402
from fused_contrastive.core.triton_shared import launch as TL  # noqa: E402

#: the polynomial's max relative error over (0, 1], evaluated in float64 (its coefficients as the kernel's fp32
#: constants) and in fp32 Horner steps (the kernel's arithmetic); kernels/common.py states both
POLY_MATH_BOUND = 2.3e-7
POLY_FP32_BOUND = 4.0e-7
#: the helpers' relative error in fp32: the polynomial, the last roundings, and exp2's argument
#: ``-|w| log2(e)`` rounded to fp32 (2^-24 |w| relative in e; tl.exp rounds the same product on a GPU)
HELPER_REL = 5e-7
HELPER_PER_W = 7e-8
FP32_TINY = 1.2e-38  # below fp32's smallest normal number: values compare absolutely


def _grid() -> np.ndarray:
    return np.unique(np.concatenate([np.linspace(0.0, 1.0, 2**21 + 1)[1:], np.logspace(-40, 0, 100_001)]))


def _poly_error(coeffs, fp32_steps: bool = False) -> float:
    """Max |e p(e) / log1p(e) - 1| over :func:`_grid` (float64; ``fp32_steps``: each Horner step and the
    product rounded to fp32, on fp32 arguments, as the kernel computes)."""
    x = _grid()
    c = [float(np.float32(v)) for v in coeffs]
    if fp32_steps:
        x = np.unique(x.astype(np.float32).astype(np.float64))
        x = x[x > 0]
    p = np.full_like(x, c[-1])
    for v in c[-2::-1]:
        p = p * x + v
        if fp32_steps:
            p = p.astype(np.float32).astype(np.float64)
    r = x * p
    if fp32_steps:
        r = r.astype(np.float32).astype(np.float64)
    return float(np.max(np.abs(r / np.log1p(x) - 1.0)))


def test_log1p_polynomial_max_error_float64():
    assert all(float(np.float32(c)) == c for c in KC.LOG1P_COEFFS), "the coefficients are the kernel's fp32 constants"
    assert [getattr(KC, f"_L1P{i}").value for i in range(8)] == list(KC.LOG1P_COEFFS)
    math_err = _poly_error(KC.LOG1P_COEFFS)
    fp32_err = _poly_error(KC.LOG1P_COEFFS, fp32_steps=True)
    assert math_err <= POLY_MATH_BOUND, math_err
    assert fp32_err <= POLY_FP32_BOUND, fp32_err
    # the stated bounds are the measured ones, not loose: a degree-7 fit cannot do much better
    assert math_err > 0.8 * POLY_MATH_BOUND and fp32_err > 0.75 * POLY_FP32_BOUND, (math_err, fp32_err)


def test_planted_wrong_coefficient_fails_the_float64_check():
    for i, delta in ((3, 1e-4), (7, -1e-5), (0, 3e-7)):
        bad = list(KC.LOG1P_COEFFS)
        bad[i] += delta
        assert _poly_error(bad) > POLY_MATH_BOUND, (i, delta)


# ------------------------------------------------------------------------------------------------
# the device helpers under the interpreter
# ------------------------------------------------------------------------------------------------


@triton.jit
def _lean_terms_kernel(W, G, POS, VALID, SP, DZ, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """SP = _softplus_lean(W), DZ = _dz_lean(W, VALID, POS, G) on [R, C] (row-major), one column block per
    program."""
    rows = tl.arange(0, BLOCK_R)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    w = tl.load(W + off, mask=m, other=0.0)
    pos = tl.load(POS + off, mask=m, other=0) != 0
    valid = tl.load(VALID + off, mask=m, other=0) != 0
    g = tl.load(G + rows, mask=rows < R, other=0.0)
    tl.store(SP + off, KC._softplus_lean(w), mask=m)
    tl.store(DZ + off, KC._dz_lean(w, valid, pos, g), mask=m)


def _helper_values():
    """(w [R, C] fp32, g, pos, valid, softplus, dz) from the kernel: w dense over [-90, 90], log-spaced down to
    1e-30 on both sides, 0, and +-1e4 (logits past exp's range)."""
    w = torch.cat([torch.linspace(-90, 90, 180_001), torch.logspace(-30, 1.95, 10_000),
                   -torch.logspace(-30, 1.95, 10_000),
                   torch.tensor([0.0, 1e4, -1e4, 87.0, -87.0, 88.7, -88.7, 104.0, -104.0])]).float()
    r = 16
    c = -(-w.numel() // r)
    w = torch.cat([w, torch.zeros(r * c - w.numel())]).reshape(r, c)
    gen = torch.Generator().manual_seed(5)
    g = (torch.rand(r, generator=gen) + 0.25).float()
    pos = (torch.rand(r, c, generator=gen) < 0.3).to(torch.int8)
    valid = (torch.rand(r, c, generator=gen) < 0.9).to(torch.int8)
    sp, dz = torch.full_like(w, float("nan")), torch.full_like(w, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _lean_terms_kernel[(triton.cdiv(c, 2048),)](w, g, pos, valid, sp, dz, r, c, BLOCK_R=r, BLOCK_C=2048)
    return w, g, pos, valid, sp, dz


def _check_helpers():
    w, g, pos, valid, sp, dz = _helper_values()
    wd = w.double()
    want_sp = torch.logaddexp(torch.zeros_like(wd), wd)
    sig = torch.sigmoid(wd)
    want_dz = torch.where(valid.bool(), g.double()[:, None] * torch.where(pos.bool(), -sig, sig), 0.0)
    tol = HELPER_REL + HELPER_PER_W * wd.abs()
    for name, got, want in (("softplus", sp, want_sp), ("dz", dz, want_dz)):
        got = got.double()
        assert torch.isfinite(got).all(), name
        err = (got - want).abs()
        normal = want.abs() > FP32_TINY
        excess = torch.where(normal, err / want.abs().clamp_min(FP32_TINY) - tol, err - FP32_TINY)
        i = int(excess.flatten().argmax())
        assert float(excess.flatten()[i]) <= 0, (name, float(wd.flatten()[i]), float(got.flatten()[i]),
                                                 float(want.flatten()[i]))
    assert bool((dz[~valid.bool()] == 0).all())


def test_lean_helpers_against_float64():
    _check_helpers()


def test_planted_wrong_coefficient_fails_the_helpers(monkeypatch):
    monkeypatch.setattr(KC, "_L1P3", tl.constexpr(KC.LOG1P_COEFFS[3] + 1e-4))
    with pytest.raises(AssertionError, match="softplus"):
        _check_helpers()


# ------------------------------------------------------------------------------------------------
# the panel route with the lean epilogue
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def lean_route(monkeypatch, route, launches):
    """The panel route's epilogue GEMM in panels of 40 rows (97 rows: 40 + 40 + 17), launches recorded while
    they run, outputs poisoned; returns the recorded launches."""
    route(DENSE="0", PANEL_ROWS=40, TRITON_PATH="panel", PANEL_GEMM="epilogue")
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield launches


#: (scale, bias, learnable): flat logits (|w| <= 1, cosines times 1: the polynomial's whole range, e in
#: [0.37, 1]; no temperature or bias to learn), SigLIP's initialisation, and saturated logits (|w| up to 1010:
#: most exps flush to 0, the sigmoid is 0 or 1)
REGIMES = {"flat": (1.0, 0.0, False), "siglip_init": (10.0, -10.0, True), "saturated": (1000.0, -10.0, True)}


def _sweeps(seen):
    return [(x.constexprs["MODE"], x.constexprs["LEAN"], x.constexprs["BLOCK_M"]) for x in seen
            if x.name == "epi_gemm_siglip"]


def _bf16_case(regime, reduction, seed=3, n=97, d=40, dtype=torch.bfloat16):
    s0, b0, learn = REGIMES[regime]
    g = torch.Generator().manual_seed(seed)
    x64 = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).double()
    y64 = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).double()
    return triton_against_truth(x64, y64, dtype, s0, b0, learn, reduction, seed)


def _check_bf16(got, want, got_g, want_g, what=""):
    assert_close(got.double(), want, rtol=2e-3, atol=0, what=f"{what} loss")
    names = ("image", "text", "scale", "bias")
    for name, gg, ww in zip(names, got_g, want_g, strict=False):
        assert torch.isfinite(gg).all(), f"{what} grad {name}"
        assert_close(gg.double(), ww, rtol=0, atol=2e-2 * float(ww.abs().max()), what=f"{what} grad {name}")


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("form", ["lean", "lean128"])
def test_lean_epilogue_bf16_against_the_definition(form, regime, reduction, lean_route, route):
    """A summed loss takes the one pass (MODE 5: 128-row tiles with lean128), per-row losses the forward and
    the gradient sweeps (MODE 4, 128-row tiles in every form), every launch with LEAN."""
    route(SIGLIP_EPILOGUE=form)
    got, want, got_g, want_g = _bf16_case(regime, reduction)
    _check_bf16(got, want, got_g, want_g, f"{form} {regime} {reduction}")
    bm5 = 128 if form == "lean128" else 64
    want_sweeps = [(5, True, bm5)] * 3 if reduction == "sum" else [(4, True, 128)] * 6
    assert _sweeps(lean_route) == want_sweeps


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_lean_epilogue_fp16_against_the_definition(reduction, lean_route, route):
    """fp16 operands: the gradient tile pre-scaled by 2^13 before its fp16 cast (a negative pair's sigmoid at
    the bias -10 is below fp16's smallest normal number), as the exact epilogue's."""
    route(SIGLIP_EPILOGUE="lean")
    _check_bf16(*_bf16_case("siglip_init", reduction, dtype=torch.float16), f"fp16 {reduction}")
    assert all(lean for _, lean, _ in _sweeps(lean_route))


def test_default_is_the_exact_epilogue(lean_route):
    got, want, got_g, want_g = _bf16_case("siglip_init", "sum")
    _check_bf16(got, want, got_g, want_g, "exact")
    assert _sweeps(lean_route) == [(5, False, 64)] * 3
    assert routes.setting("SIGLIP_EPILOGUE") == "exact"


def test_setting_rejects_an_unknown_form(monkeypatch):
    monkeypatch.setenv("FUSED_CONTRASTIVE_SIGLIP_EPILOGUE", "fast")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_SIGLIP_EPILOGUE must be one of 'exact', 'lean', 'lean128'"):
        triton_sweep.epilogue()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lean_one_pass_offset_wider_texts_raw_rows(dtype, lean_route, route):
    """The one pass (MODE 5) with positives at column offset + i of a wider text set (what ``gather=`` hands it),
    raw rows (no normalisation), learnable scale and bias; fp32 through the Function on the panel route is
    not CUDA's route (fp32 takes the fused kernels there): here the sweep is called itself."""
    route(SIGLIP_EPILOGUE="lean128")
    g = torch.Generator().manual_seed(11)
    x64 = (torch.randn(100, 24, generator=g, dtype=torch.float64) * 0.3).to(dtype).double()
    y64 = (torch.randn(150, 24, generator=g, dtype=torch.float64) * 0.3).to(dtype).double()
    leaves64 = [x64.requires_grad_(), y64.requires_grad_(), torch.tensor(3.0, dtype=torch.float64, requires_grad=True),
                torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)]
    want = _truth(*leaves64, normalize=False, reduction="sum", offset=19) / 100
    want_g = torch.autograd.grad(want, leaves64)
    if dtype == torch.bfloat16:
        from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn

        leaves = [x64.detach().to(dtype).requires_grad_(), y64.detach().to(dtype).requires_grad_(),
                  torch.tensor(3.0, requires_grad=True), torch.tensor(-2.0, requires_grad=True)]
        got = TritonSigLipFn.apply(*leaves, False, 1e-12, 19, True, 1.0 / 100)
        got_g = torch.autograd.grad(got, leaves)
        _check_bf16(got, want, got_g, want_g, "bf16 offset")
    else:
        loss, dx, dy, ds, db = triton_sweep.siglip_sweep(
            TL._launch, x64.float(), y64.float(), torch.tensor([3.0]), torch.tensor([-2.0]), False, 1e-12, 19,
            torch.full((100,), 0.01), True, True, True, with_loss=True)
        assert_close(loss.sum().double() / 100, want, rtol=2e-5, atol=0, what="fp32 offset loss")
        for name, gg, ww in zip(("image", "text", "scale", "bias"), (dx, dy, ds, db), want_g, strict=True):
            assert_close(gg.double(), ww, rtol=2e-5, atol=2e-5, what=f"fp32 offset grad {name}")
    assert _sweeps(lean_route) == [(5, True, 128)] * 3


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("form", ["lean", "lean128"])
def test_lean_sweeps_fp32_against_the_definition(form, regime, lean_route, route):
    """The sweep itself on fp32 rows (the kernel's math at fp32 precision: fp32 products, fp32 gradient tile),
    per-row upstream gradients: the one pass (MODE 5), and the forward then the gradient sweep (MODE 4), each
    against float64 autograd of the definition; tolerance 2e-5 (tests/test_siglip.py's fp32 Triton tests),
    2e-3 at the saturated scale (theirs at huge scales)."""
    route(SIGLIP_EPILOGUE=form)
    s0, b0, _ = REGIMES[regime]
    tol = 2e-3 if regime == "saturated" else 2e-5
    gen = torch.Generator().manual_seed(7)
    x64 = torch.randn(97, 40, generator=gen, dtype=torch.float64).float().double().requires_grad_()
    y64 = torch.randn(97, 40, generator=gen, dtype=torch.float64).float().double().requires_grad_()
    s64 = torch.tensor(s0, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(b0, dtype=torch.float64, requires_grad=True)
    gr = (torch.rand(97, generator=gen, dtype=torch.float64) + 0.5)
    want = _truth(x64, y64, s64, b64, reduction="none")
    want_g = torch.autograd.grad((want * gr).sum(), (x64, y64, s64, b64))
    args = (TL._launch, x64.detach().float(), y64.detach().float(), torch.tensor([s0]), torch.tensor([b0]), True,
            1e-12, 0)
    one = triton_sweep.siglip_sweep(*args, gr.float(), True, True, True, with_loss=True)
    fwd = triton_sweep.siglip_sweep(*args, None, False, False, False)
    bwd = triton_sweep.siglip_sweep(*args, gr.float(), True, True, True)
    for what, loss, grads in (("one pass", one[0], one[1:]), ("two sweeps", fwd[0], bwd[1:])):
        assert_close(loss.double(), want.detach(), rtol=tol, atol=tol, what=f"{form} {regime} {what} loss")
        for name, gg, ww in zip(("image", "text", "scale", "bias"), grads, want_g, strict=True):
            assert_close(gg.double(), ww, rtol=tol, atol=tol, what=f"{form} {regime} {what} grad {name}")
    bm5 = 128 if form == "lean128" else 64
    assert _sweeps(lean_route) == [(5, True, bm5)] * 3 + [(4, True, 128)] * 6


@triton.jit
def _dz_lean_swapped(w, valid, pos, g_r):
    """A planted defect: the sigmoid's two branches swapped (sigmoid(-w) for sigmoid(w))."""
    e = tl.exp2(tl.abs(w) * -1.4426950408889634)
    r = tl.fdiv(1.0, 1.0 + e, approx=True)
    p = tl.where(w >= 0, e * r, r)
    p = tl.where(pos, -p, p) * g_r[:, None]
    return tl.where(valid, p, 0.0)


def test_planted_defects_fail_the_route_checks(lean_route, route, monkeypatch):
    route(SIGLIP_EPILOGUE="lean")
    with monkeypatch.context() as mp:
        mp.setattr(KP, "_dz_lean", _dz_lean_swapped)
        with pytest.raises(AssertionError, match="grad"):
            _check_bf16(*_bf16_case("siglip_init", "sum"), "swapped sigmoid")
    with monkeypatch.context() as mp:  # a wrong coefficient: flat logits put e in [0.37, 1], where it shows
        mp.setattr(KC, "_L1P1", tl.constexpr(KC.LOG1P_COEFFS[1] + 1e-2))
        with pytest.raises(AssertionError, match="loss"):
            _check_bf16(*_bf16_case("flat", "none"), "wrong coefficient")
