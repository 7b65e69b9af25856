"""SimCSE's loss in the saturated regime on the triangular sweep (``kernels/lse.py`` ``lse_fwd_kernel`` with TRI and
SPLIT_T; host ``core/lse/triton_fused.py`` ``_lse_fwd`` and ``core/lse/triton_panel.py`` ``forward``), on its
statistics forward on the epilogue GEMM (``kernels/panel.py`` ``epi_gemm_kernel`` MODE 3 with TRI and SPLIT_T; host
``triton_panel.stats_forward``: SimCSE's large-N route) and on the fused kernels (the same forward kernel without TRI).

Unsupervised SimCSE (one batch of interleaved views, B is A, each row's target its paired view) in the saturated
regime (``testing.cases.REGIMES["saturated"]``: ``p_t ~ 0.9999``, a row loss of ``~1e-4`` against logits of
``~|s|``) formed as ``LSE_i - l_it`` in fp32 keeps few correct digits (an H200's parity row at N = 4099, D = 768
bf16 missed its bound by 1.6x). The forward kernel instead forms each row's log-sum-exp over every column
but its target, ``LSEx_i``, and the target's logit (an fp32 dot of the row with its target row), and the row's
loss is ``softplus(LSEx_i - l_it)`` (the epilogue GEMM's statistics likewise, ``l_it`` from the row's fp32 cosine
with its target row); the target term's value leaves ``c_i l_it`` out for those rows
(``core.forward_parts``, as for the one pass of ``tests/test_one_pass_loss.py``). Under the CPU interpreter at
256 rows in bf16, against float64 on the same rounded inputs: relative error <= ``REL_TOL`` (measured 3e-8 to
3e-7 summed, 4e-6 per row; the old form missed it on every case but label smoothing, whose loss ~1.75 does not
cancel: 1.9e-2 summed on both routes, 1.2e-1 / 1.9e-2 at a margin of 13 on the triangular / fused route,
2.6e-1 / 1.8e-1 per row)."""

from __future__ import annotations

import warnings

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from fused_contrastive.testing import CASE_BY_NAME
from fused_contrastive.testing import cases as C
from fused_contrastive.testing.accuracy import make_inputs

#: The loss's relative error allowed against float64 (bf16 inputs rounded before both runs).
REL_TOL = 1e-4


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _losses(case: str, tensors: dict, kwargs: dict, dtype=torch.bfloat16):
    """(triton loss in ``dtype``, its gradient; float64 reference loss, its gradient) on the same rounded rows."""
    out = []
    for backend, dt in (("triton", dtype), ("reference", torch.float64)):
        z = tensors["z1"].to(dtype).to(dt).requires_grad_()
        loss = CASE_BY_NAME[case].fn(z, backend=backend, **kwargs)
        out.append((loss.detach().double(), torch.autograd.grad(loss.sum(), z)[0].double()))
    return out


@pytest.mark.parametrize("path", ["panel", "panel-epilogue", "fused"])
@pytest.mark.parametrize("variant", ["plain", "label-smoothing", "per-row", "margin-13"])
def test_saturated_simcse_against_float64(path, variant, monkeypatch, route, launches):
    route(DENSE="0", TRITON_PATH=path.split("-")[0], PANEL_GEMM="epilogue" if path == "panel-epilogue" else None,
          PANEL_ROWS=96 if path == "panel-epilogue" else None)
    if variant == "margin-13":
        monkeypatch.setitem(C.REGIME_MARGIN, "saturated", 13.0)
    case = "simcse_smoothed" if variant == "label-smoothing" else "simcse"
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], 256, 64, seed=3, regime="saturated")
    if variant == "per-row":
        kwargs = dict(kwargs, reduction="none")
    seen = launches
    (got, ggot), (want, gwant) = _losses(case, tensors, kwargs)
    fwd = [x for x in seen if x.name == "lse_fwd"]
    stats = [(x.constexprs["TRI"], x.constexprs["SPLIT_T"]) for x in seen if x.name == "epi_gemm_stats"]
    # the route under test: the triangular forward on the panel path (the fused forward kernel's, or the epilogue
    # GEMM's statistics in 96-row panels), the plain one on the fused kernels, all with the target split out
    if path == "panel-epilogue":
        assert not fwd and stats == [(True, True)] * 3, seen
    else:
        assert [(x.constexprs["TRI"], x.constexprs["SPLIT_T"]) for x in fwd] == [(path == "panel", True)], seen
        assert not stats, seen
    if variant != "label-smoothing":
        assert float(want.mean()) < (3e-4 if variant != "margin-13" else 5e-5), float(want.mean())  # p_t ~ 0.9999
    if variant == "per-row":
        rel = float(((got - want).abs() / want.abs()).max())
    else:
        rel = abs(float(got) - float(want)) / abs(float(want))
    assert rel <= REL_TOL, f"{path} {variant}: loss {got.tolist()!s:.200} vs float64, rel err {rel:.3g}"
    # the gradients as before (the accuracy of the 16-bit tiles, not the loss form)
    assert float((ggot - gwant).abs().max()) <= 2e-2 * float(gwant.abs().max()) + 1e-12


def test_the_statistics_forward_takes_the_tiles_target_logit(monkeypatch, route, launches):
    """The epilogue GEMM's triangular statistics forward with the target split gives the backward an LSE formed from
    the target logit as its tiles round it (MODE 3's TV), not the fp32 dot's: the backward weighs the target entry
    by ``exp(l_it - LSE_i)`` from its own tile against the target term's -1, which at a margin of 13 nearly cancel,
    and an ulp of ``|s|`` between the two roundings was the whole error there. Measured under the interpreter
    (bf16, 256 rows, max |err| / max |grad| against float64): 3.1e-3 with the tiles' value, 1.2e-2 with the dot's
    (planted: ``_add_target`` given an all-NaN ``lt_tile``), 6.3e-3 before the split."""
    route(DENSE="0", TRITON_PATH="panel", PANEL_GEMM="epilogue", PANEL_ROWS=96)
    monkeypatch.setitem(C.REGIME_MARGIN, "saturated", 13.0)
    tensors, kwargs = make_inputs(CASE_BY_NAME["simcse"], 256, 64, seed=3, regime="saturated")
    (got, ggot), (want, gwant) = _losses("simcse", tensors, kwargs)
    stores = [x for x in launches if x.name == "epi_gemm_stats"]
    assert stores and all(x.constexprs["SPLIT_T"] for x in stores), launches
    assert abs(float(got) - float(want)) <= REL_TOL * abs(float(want))
    err = float((ggot - gwant).abs().max() / gwant.abs().max())
    assert err <= 5e-3, err
