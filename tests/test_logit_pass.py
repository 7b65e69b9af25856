"""The one pass's third tile producer, ``FUSED_CONTRASTIVE_PANEL_GEMM=fp16pass`` (``core/triton_shared/logit_pass.py``,
``kernels/logit_pass.py``): cuBLAS cosines in fp16 from normalised fp16 copies, then one in-place Triton pass that
writes the bf16 tile ``e_ij rb_j`` and MODE 1's partials; the one pass's row bookkeeping, redo and gradient GEMMs
are shared with the epilogue GEMM's form.

Under the CPU interpreter in 40-row panels (outputs poisoned): every core case of the registry in bf16 against
float64 (THE accuracy rule), the pass replacing every MODE 1 launch and running wherever the one pass does; the
loss and gradients against the epilogue GEMM's one pass within the bf16 tolerance; a softmax peaked on the target
(the loss of a row ~1e-3, the target's logit from its fp32 cosine, not the rounded tile); rows that the one pass
redoes (every cosine negative at |s| = 100); Matryoshka's levels; and the fallback where the one pass does not
apply (fp16 operands, a column term): the default route's launches and results, bitwise."""

from __future__ import annotations

import warnings

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

import fused_contrastive as fc
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.testing import CASES, compare

CORE_CASES = [c for c in CASES if c.op == "core"]
#: the registry's cases whose eager sweep is the one pass (a summed loss, no column term, no softmax over
#: positives, unit rows: the epilogue GEMM's MODE 1 runs for exactly these): the pass must run for each
ONE_PASS_CASES = {"info_nce", "info_nce_target", "info_nce_ignore", "info_nce_smoothed", "simcse_2view", "simcse_sup",
                  "simcse_sup_hard", "simcse_sup_smoothed", "supcon_one", "supcon_queue", "dscl", "dscl_queue", "dcl",
                  "dclw"}


@pytest.fixture(autouse=True)
def _panels(monkeypatch, route):
    """The panel path in 40-row panels, the fp16 pass asked for, outputs poisoned, quiet fallbacks."""
    route(DENSE="0", TRITON_PATH="panel", PANEL_GEMM="fp16pass", PANEL_ROWS=40)
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _modes(seen) -> set:
    return {(x.name, x.constexprs.get("MODE")) for x in seen if x.name.startswith(("epi", "panel_dl", "logit"))}


@pytest.mark.parametrize("case", CORE_CASES, ids=[c.name for c in CORE_CASES])
def test_registry_case_bf16(case, launches):
    c = compare(case, 97, 100, torch.bfloat16, "triton", canary=True)
    assert c.ok, c
    modes = _modes(launches)
    assert ("epi_gemm", 1) not in modes, modes  # the pass replaces every MODE 1 launch
    if ("logit_pass", None) in modes:  # ... and is followed by the one pass's shared bookkeeping
        assert {("epi_rows", None), ("epi_gemm_redo", 2)} <= modes, modes
    assert (("logit_pass", None) in modes) == (case.name in ONE_PASS_CASES), modes


def _info_nce(dtype, gemm, route, scale=20.0, noise=1.0, n=97, m=110, d=72, seed=0, **kw):
    """InfoNCE's loss and (dq, dk) in fp64 with ``gemm`` as the panel GEMM setting; the bf16 / fp16 inputs'
    float64 reference alongside."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(m, d, generator=g)
    q = k[:n] + noise * torch.randn(n, d, generator=g)
    out = []
    for be, dt in (("triton", dtype), ("reference", torch.float64)):
        a, b = q.to(dtype).to(dt).requires_grad_(), k.to(dtype).to(dt).requires_grad_()
        with route_ctx(route, gemm):
            loss = fc.info_nce(a, b, torch.arange(n), temperature=1 / scale, backend=be, **kw)
            out.append([x.detach().double() for x in (loss, *torch.autograd.grad(loss, (a, b)))])
    return out


def route_ctx(route, gemm):  # noqa: ARG001
    from fused_contrastive import routes

    return routes.override(PANEL_GEMM=gemm)


def _rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


AGREE = {
    "info_nce": lambda a, b, be: fc.info_nce(a, b, torch.arange(90), backend=be),
    # two views against each other, each row's self and partner out of its softmax (EXCLUDE_SELF with an offset)
    "dcl": lambda a, b, be: fc.dcl_loss(a, b, backend=be),
    "simcse_2view": lambda a, b, be: fc.simcse_loss(a, b, backend=be),
    # the target margin: the bias column in cosine units (BIAS_COS)
    "am_softmax_margin": lambda a, b, be: fc.am_softmax_loss(a, b, margin=0.2, symmetric=False, backend=be),
}


@pytest.mark.parametrize("which", list(AGREE))
def test_agrees_with_the_epilogue_one_pass(which, route, launches):
    """The fp16 pass against the epilogue GEMM's one pass (within the bf16 tolerance) and float64."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(90, 64, generator=g)
    q = k + torch.randn(90, 64, generator=g)

    def run(dt, gemm, be="triton"):
        a, b = q.bfloat16().to(dt).requires_grad_(), k.bfloat16().to(dt).requires_grad_()
        with route_ctx(route, gemm):
            loss = AGREE[which](a, b, be)
            return [x.detach().double() for x in (loss, *torch.autograd.grad(loss, (a, b)))]

    res = {}
    for gemm in ("epilogue", "fp16pass"):
        launches.clear()
        res[gemm] = run(torch.bfloat16, gemm)
        assert (("logit_pass", None) in _modes(launches)) == (gemm == "fp16pass"), _modes(launches)
        assert (("epi_gemm", 1) in _modes(launches)) == (gemm == "epilogue"), _modes(launches)
    ref = run(torch.float64, "auto", "reference")
    for i, (x, y, r) in enumerate(zip(res["fp16pass"], res["epilogue"], ref, strict=True)):
        # the two forms differ by the logits' fp16 cosines (|s| 2^-11) and the bf16 outputs' rounding
        assert _rel(x, y) < 1e-2, (which, i, _rel(x, y))
        assert _rel(x, r) < 1e-2, (which, i, _rel(x, r))


def test_peaked_softmax_takes_the_target_from_its_fp32_cosine(route, launches):
    """Near-duplicate pairs at temperature 0.05 in 32-row panels: every row's softmax is peaked on its target
    (loss ~1e-3 a row), so ``z_i`` is almost all ``e_it``. Its logit from the rounded fp16 cosine would move the
    loss by up to |s| 2^-11 = 0.01 a row (several times the loss itself); from its fp32 cosine the loss keeps
    the epilogue GEMM's accuracy (measured: 5.3e-4 relative, the epilogue GEMM's one pass 4.0e-4)."""
    route(PANEL_ROWS=32)
    (lt, dq, dk), (lw, dqw, dkw) = _info_nce(torch.bfloat16, "fp16pass", route, scale=20.0, noise=0.6, n=96, m=96,
                                             d=32)
    assert ("logit_pass", None) in _modes(launches)
    assert float(lw) < 5e-3, float(lw)  # the regime this test is about
    assert abs(float(lt) - float(lw)) < 0.01 * float(lw), (float(lt), float(lw))
    assert _rel(dq, dqw) < 0.02 and _rel(dk, dkw) < 0.02, (_rel(dq, dqw), _rel(dk, dkw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flat_logits_against_float64(dtype, route, launches):
    """Unrelated rows (cosines ~N(0, 1/D)) at |s| = 20: a flat softmax over every column."""
    (lt, dq, dk), (lw, dqw, dkw) = _info_nce(dtype, "fp16pass", route, scale=20.0, noise=10.0)
    assert (("logit_pass", None) in _modes(launches)) == (dtype == torch.bfloat16)
    assert abs(float(lt) - float(lw)) < 1e-2 * abs(float(lw))
    assert _rel(dq, dqw) < 1e-2 and _rel(dk, dkw) < 1e-2, (_rel(dq, dqw), _rel(dk, dkw))


def test_redone_rows_against_float64(route, launches):
    """|s| = 100 and rows whose every cosine is below -0.5: their ``z_i < 2^-64`` under the fixed shift, so the
    one pass's MODE 2 redo rewrites them (from the exact bf16 operands, over the pass's tile) and the rest keep
    the pass's values."""
    g = torch.Generator().manual_seed(5)
    n, d = 90, 48
    k = torch.randn(n, d, generator=g) * 0.3
    k[:, 0] = 4.0  # every key leans on the first axis
    q = k + 0.3 * torch.randn(n, d, generator=g)
    q[::3, 0] = -4.0  # every third query points away from every key
    res = []
    for be, dt in (("triton", torch.bfloat16), ("reference", torch.float64)):
        a, b = q.bfloat16().to(dt).requires_grad_(), k.bfloat16().to(dt).requires_grad_()
        loss = fc.info_nce(a, b, torch.arange(n), temperature=0.01, backend=be)
        res.append([x.detach().double() for x in (loss, *torch.autograd.grad(loss, (a, b)))])
    bad = [x.args["BAD"] for x in launches if x.name == "epi_gemm_redo"]
    assert ("logit_pass", None) in _modes(launches) and bad
    assert int(sum(int(x.sum()) for x in bad)) == 30, [int(x.sum()) for x in bad]  # exactly the planted rows
    for what, x, w in zip(("loss", "dq", "dk"), *res, strict=True):
        assert _rel(x, w) < 1e-2, (what, _rel(x, w))


@pytest.mark.parametrize("what", ["fp16", "clip"])
def test_falls_back_to_the_default_where_the_one_pass_does_not_apply(what, route, launches):
    """fp16 operands (no one pass) and CLIP (a column term): ``fp16pass`` takes the default route, bitwise."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(70, 40, generator=g), torch.randn(70, 40, generator=g)
    dt = torch.float16 if what == "fp16" else torch.bfloat16
    res = {}
    for gemm in ("auto", "fp16pass"):
        launches.clear()
        a, b = q.to(dt).requires_grad_(), k.to(dt).requires_grad_()
        with route_ctx(route, gemm):
            if what == "fp16":
                loss = fc.info_nce(a, b, torch.arange(70), backend="triton")
            else:
                loss = fc.clip_loss(a, b, 10.0, backend="triton")
            res[gemm] = ([loss.detach(), *torch.autograd.grad(loss, (a, b))], _modes(launches))
    assert ("logit_pass", None) not in res["fp16pass"][1]
    assert res["fp16pass"][1] == res["auto"][1]
    for x, y in zip(res["fp16pass"][0], res["auto"][0], strict=True):
        assert torch.equal(x, y)
    c = compare(next(c for c in CASES if c.name == ("info_nce" if what == "fp16" else "clip")), 70, 40,
                dt, "triton", canary=True)
    assert c.ok, c


def test_matryoshka_levels_against_float64(route, launches):
    """Matryoshka InfoNCE (one core-op call per level on prefixes of D, the bench form's third loss): every level's
    one pass through the fp16 pass, loss and gradients against float64."""
    g = torch.Generator().manual_seed(6)
    k = torch.randn(70, 64, generator=g)
    q = k + torch.randn(70, 64, generator=g)
    res = []
    for be, dt in (("triton", torch.bfloat16), ("reference", torch.float64)):
        a, b = q.bfloat16().to(dt).requires_grad_(), k.bfloat16().to(dt).requires_grad_()
        loss = fc.info_nce(a, b, torch.arange(70), matryoshka_dims=[16, 32, 64], backend=be)
        res.append([x.detach().double() for x in (loss, *torch.autograd.grad(loss, (a, b)))])
    # three levels of two 40-row panels each
    assert sum(x.name == "logit_pass" for x in launches) == 6, [x.name for x in launches]
    for what, x, w in zip(("loss", "dq", "dk"), *res, strict=True):
        assert _rel(x, w) < 1e-2, (what, _rel(x, w))
