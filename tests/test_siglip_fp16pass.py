"""SigLIP's fp16 pass form (``FUSED_CONTRASTIVE_SIGLIP_EPILOGUE=fp16pass``: ``core/siglip/triton_fp16pass.py``,
``kernels/logit_pass.py`` ``siglip_pass_kernel``): cuBLAS fp16 cosines of the unit rows, then one in-place Triton
pass per panel that writes the loss partials, the 16-bit gradient tile and the ds / db partials, each positive
pair's cosine its fp32 one.

Under the CPU interpreter in 40-row panels (97 rows: 40 + 40 + 17), outputs poisoned, against the float64
definition (``tests/test_siglip.py`` ``_truth``): bf16 and fp16, flat logits, SigLIP's initialisation, saturated
logits (|z| up to ~1000) and saturated positives (every positive pair's loss ~e^-4.5 and the negatives' ~e^-40:
the loss is the positives', where a rounded cosine shows), fixed and learnable scale and bias, summed losses (the
one pass) and per-row losses (the forward and the gradient sweep); positives at an offset of a wider text set;
group positives (no positive inside the kernels). The tolerances are the exact epilogue's
(``tests/test_siglip_lean.py``: loss 2e-3 relative, gradients 2e-2 of their largest entry). The planted defect,
each positive's cosine taken from the rounded fp16 tile instead of its fp32 one, must fail them; raw rows and
fp32 rows take MODE 4 / 5 under the setting."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_siglip import _truth, triton_against_truth  # tests/ is on sys.path (rootdir-relative imports, no package)

import fused_contrastive as fc
from fused_contrastive.testing import assert_close

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
from fused_contrastive.core.siglip import triton_fp16pass, triton_sweep  # noqa: E402
from fused_contrastive.core.triton_shared import launch as TL  # noqa: E402
from fused_contrastive.core.triton_shared.logit_pass import unit_rows_fp16  # noqa: E402


@pytest.fixture
def pass_route(monkeypatch, route, launches):
    """The panel route in 40-row panels with the fp16 pass asked for, outputs poisoned; the recorded launches."""
    route(DENSE="0", PANEL_ROWS=40, TRITON_PATH="panel", PANEL_GEMM="epilogue", SIGLIP_EPILOGUE="fp16pass")
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield launches


#: (scale, bias, learnable, positives' noise): flat logits, SigLIP's initialisation, saturated logits (random
#: pairs at s = 1000), saturated positives (texts = images + 0.1 noise: cos_ii ~ 0.995, z_ii ~ 4.5 at s = 100,
#: b = -95; a negative's z ~ -95 +- 50)
REGIMES = {"flat": (1.0, 0.0, False, None), "siglip_init": (10.0, -10.0, True, None),
           "saturated": (1000.0, -10.0, True, None), "positives": (100.0, -95.0, True, 0.1)}


def _case(regime, reduction, dtype, seed=3, n=97, d=40):
    s0, b0, learn, noise = REGIMES[regime]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, d, generator=g, dtype=torch.float64)
    if noise is not None:
        y = x + noise * y
    x64, y64 = x.to(dtype).double(), y.to(dtype).double()
    return triton_against_truth(x64, y64, dtype, s0, b0, learn, reduction, seed)


#: gradients' tolerance (of their largest entry) per regime: 2e-2 (the exact epilogue's tests), 3e-2 for saturated
#: positives, where the default route itself (MODE 4 / 5, exact) is 2.15e-2 off in the texts' gradient in bf16 (the
#: 16-bit gradient tile's rounding, then the normalisation backward's cancellation: each text is nearly its image)
GRAD_TOL = {"positives": 3e-2}


def _check(got, want, got_g, want_g, what="", grad_tol=2e-2):
    assert_close(got.double(), want, rtol=2e-3, atol=0, what=f"{what} loss")
    for name, gg, ww in zip(("image", "text", "scale", "bias"), got_g, want_g, strict=False):
        assert torch.isfinite(gg).all(), f"{what} grad {name}"
        assert_close(gg.double(), ww, rtol=0, atol=grad_tol * float(ww.abs().max()), what=f"{what} grad {name}")


def _names(seen):
    return [(x.name, x.constexprs.get("WANT_LOSS", x.constexprs.get("MODE")), x.constexprs.get("HAS_G"))
            for x in seen if x.name in ("siglip_pass", "epi_gemm_siglip")]


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp16_pass_against_the_definition(dtype, regime, reduction, pass_route):
    """A summed loss: one pass per panel (losses and the gradient tile); per-row losses: the forward's passes
    (losses only), then the gradient sweep's (the tile only). No epilogue GEMM launch."""
    _check(*_case(regime, reduction, dtype), f"{dtype} {regime} {reduction}", GRAD_TOL.get(regime, 2e-2))
    want = [("siglip_pass", True, True)] * 3 if reduction == "sum" else \
        [("siglip_pass", True, False)] * 3 + [("siglip_pass", False, True)] * 3
    assert _names(pass_route) == want
    learn = REGIMES[regime][2]
    assert all(x.constexprs["NEED_DS"] == (learn and x.constexprs["HAS_G"]) for x in pass_route
               if x.name == "siglip_pass")
    assert all(x.constexprs["FOLD_RB"] == (dtype == torch.bfloat16) and x.constexprs["PRESCALE"] ==
               (8192.0 if dtype == torch.float16 else 1.0) for x in pass_route if x.name == "siglip_pass" and
               x.constexprs["HAS_G"])


def _planted_positives(self, r0, r1):
    """The planted defect: each positive's cosine as the rounded tile holds it (fp16 unit rows, fp32 dot,
    rounded to fp16) instead of its fp32 cosine."""
    m = self.y.shape[0]
    ct = torch.zeros(r1 - r0, dtype=torch.float32)
    lo, hi = max(r0, -self.offset), min(r1, m - self.offset)
    if hi > lo:
        a = unit_rows_fp16(self.x[lo:hi], self.eps).float()
        b = unit_rows_fp16(self.y[lo + self.offset:hi + self.offset], self.eps).float()
        ct[lo - r0:hi - r0] = (a * b).sum(1).half().float()
    return ct


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_planted_rounded_positive_fails(dtype, pass_route, monkeypatch):
    monkeypatch.setattr(triton_fp16pass.SigLipFp16Pass, "positives", _planted_positives)
    with pytest.raises(AssertionError, match="loss"):
        _check(*_case("positives", "none", dtype), "rounded positives", GRAD_TOL["positives"])


def test_offset_wider_texts_learnable(pass_route):
    """Positives at column offset + i of a wider text set (what ``gather=`` hands the sweep; rows 0-18 and
    131-149 of the texts are negatives only), learnable scale and bias, a summed loss."""
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn

    g = torch.Generator().manual_seed(11)
    x = torch.randn(100, 24, generator=g, dtype=torch.float64)
    y = torch.randn(150, 24, generator=g, dtype=torch.float64)
    y[19:119] = x + 0.2 * y[19:119]
    x64, y64 = x.to(torch.bfloat16).double(), y.to(torch.bfloat16).double()
    leaves64 = [x64.requires_grad_(), y64.requires_grad_(), torch.tensor(30.0, dtype=torch.float64, requires_grad=True),
                torch.tensor(-20.0, dtype=torch.float64, requires_grad=True)]
    want = _truth(*leaves64, reduction="sum", offset=19) / 100
    want_g = torch.autograd.grad(want, leaves64)
    leaves = [x64.detach().to(torch.bfloat16).requires_grad_(), y64.detach().to(torch.bfloat16).requires_grad_(),
              torch.tensor(30.0, requires_grad=True), torch.tensor(-20.0, requires_grad=True)]
    got = TritonSigLipFn.apply(*leaves, True, 1e-12, 19, True, 1.0 / 100)
    _check(got, want, torch.autograd.grad(got, leaves), want_g, "offset")
    assert _names(pass_route) == [("siglip_pass", True, True)] * 3


def test_group_positives(pass_route):
    """Group positives: the kernels see every pair as a negative (the offset past the texts, no positive inside
    them: the fp32 cosines are not taken) and ``siglip.py`` adds the positives' correction; against the
    reference backend's float64 definition."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(97, 32, generator=g).to(torch.bfloat16)
    y = torch.randn(80, 32, generator=g).to(torch.bfloat16)
    ig = torch.randint(0, 30, (97,), generator=g)
    tg = torch.randint(0, 30, (80,), generator=g)
    s64 = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(-10.0, dtype=torch.float64, requires_grad=True)
    x64, y64 = x.double().requires_grad_(), y.double().requires_grad_()
    want = fc.siglip_loss(x64, y64, s64, b64, image_groups=ig, text_groups=tg, backend="reference")
    want_g = torch.autograd.grad(want, (x64, y64, s64, b64))
    leaves = [x.clone().requires_grad_(), y.clone().requires_grad_(), torch.tensor(10.0, requires_grad=True),
              torch.tensor(-10.0, requires_grad=True)]
    got = fc.siglip_loss(*leaves, image_groups=ig, text_groups=tg, backend="triton")
    _check(got, want, torch.autograd.grad(got, leaves), want_g, "groups")
    assert _names(pass_route) == [("siglip_pass", True, True)] * 3
    assert "target_rows" not in {x.name for x in pass_route}


def test_raw_and_fp32_rows_take_the_epilogue_gemm(pass_route):
    """Raw rows (a raw dot product may overflow fp16) and fp32 rows (the sweep called itself: CUDA gives it
    only 16-bit rows) take MODE 5 with the exact math under the setting, and match the definition."""
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn

    g = torch.Generator().manual_seed(2)
    x64 = (torch.randn(97, 24, generator=g, dtype=torch.float64) * 0.3).to(torch.bfloat16).double().requires_grad_()
    y64 = (torch.randn(97, 24, generator=g, dtype=torch.float64) * 0.3).to(torch.bfloat16).double().requires_grad_()
    want = _truth(x64, y64, 3.0, -2.0, normalize=False, reduction="sum")
    want_g = torch.autograd.grad(want, (x64, y64))
    leaves = [x64.detach().to(torch.bfloat16).requires_grad_(), y64.detach().to(torch.bfloat16).requires_grad_()]
    got = TritonSigLipFn.apply(*leaves, 3.0, -2.0, False, 1e-12, 0, True, 1.0)
    _check(got, want, torch.autograd.grad(got, leaves), want_g, "raw rows")
    assert _names(pass_route) == [("epi_gemm_siglip", 5, True)] * 3
    assert all(not x.constexprs["LEAN"] for x in pass_route if x.name == "epi_gemm_siglip")
    pass_route.clear()
    one = triton_sweep.siglip_sweep(TL._launch, x64.detach().float(), y64.detach().float(), torch.tensor([3.0]),
                                    torch.tensor([-2.0]), True, 1e-12, 0, None, False, False, False)
    assert_close(one[0].double(), _truth(x64.detach(), y64.detach(), 3.0, -2.0, reduction="none"), rtol=2e-5,
                 atol=0, what="fp32 loss")
    assert _names(pass_route) == [("epi_gemm_siglip", 4, False)] * 3


def test_setting_and_predicate(route):
    for form in ("exact", "lean", "lean128"):
        route(SIGLIP_EPILOGUE=form)
        assert not triton_fp16pass.use_fp16_pass(torch.bfloat16, True)
    route(SIGLIP_EPILOGUE="fp16pass")
    assert triton_sweep.epilogue() == (False, False)  # the exact math
    use = triton_fp16pass.use_fp16_pass
    assert use(torch.bfloat16, True) and use(torch.float16, True)
    assert not use(torch.float32, True) and not use(torch.bfloat16, False)
