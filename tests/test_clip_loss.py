"""CLIP's loss in the saturated regime on the fused kernels (``kernels/lse.py`` ``lse_fwd_kernel`` with WANT_COL and
SPLIT_T; host ``core/lse/triton_fused.py`` ``_lse_fwd`` and ``core/lse/triton_function.py``).

CLIP's per-pair loss is ``(LSE_i - l_ii + LSEcol_i - l_ii) / 2``. In the saturated regime
(``testing.cases.REGIMES["saturated"]``: ``p_t ~ 0.9999``, a loss of ``~1e-4`` against logits of ``~|s|``) either
difference formed in fp32 keeps few correct digits. The forward kernel keeps each row's target entry out of its row
statistics and, where column j's target is row j (CLIP's pairs), the entry ``(j, j)`` out of column j's, and writes
the target's logit apart; the host forms both halves as ``softplus(LSEx - l_t)`` and the target term's value leaves
``c_i l_it`` out for those rows (``core.forward_parts``). The backward's LSEs are the merged ones, formed from the
tile's own rounding of the target logit (the row's max where the target is it: ``target_split.tile_target``), so
the gradients keep their accuracy. Under the CPU interpreter at 256 rows in bf16 and fp16, against float64 on the
same rounded inputs: relative error <= ``REL_TOL`` summed and per pair (measured 3e-8 to 1.1e-7 summed, 4e-6 to
6e-6 per pair; the old form: 3.8e-3 / 4.0e-3 summed at a margin of 9 in bf16 / fp16, 8.3e-3 / 7.4e-2 at 13, 0.14 /
0.52 per pair), gradients within ``GRAD_TOL`` of the largest (measured 4e-3 to 1.2e-2, the old code 4e-3 to
1.3e-2; the merged LSEs from the dot's target logit gave 1.8e-2 / 3.3e-2 at a margin of 13). fp16's mean loss at a
margin of 13 has gradients of ~3e-7, subnormal in fp16: there the bound adds fp16's own rounding of the float64
gradient (0.11 / 0.10 for a and b, which the kernels' error equals; tests/test_exact_target.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

# (_fused: the fused kernels, not the dense one-tile path, quiet numpy; tests/ is on sys.path: rootdir-relative imports)
from test_exact_target import _fused, own_rounding  # noqa: F401

from fused_contrastive.testing import CASE_BY_NAME
from fused_contrastive.testing import cases as C
from fused_contrastive.testing.accuracy import make_inputs

#: The loss's relative error allowed against float64 (16-bit inputs rounded before both runs).
REL_TOL = 1e-4
#: The gradients' largest error over the largest true gradient (plus the gradient dtype's own rounding of the float64
#: gradient, which exceeds it only where the gradients are subnormal: fp16's mean loss at a margin of 13).
GRAD_TOL = 1.5e-2


def _losses(case: str, tensors: dict, kwargs: dict, dtype):
    """(triton loss in ``dtype``, its gradients; float64 reference loss, its gradients) on the same rounded rows."""
    out = []
    for backend, dt in (("triton", dtype), ("reference", torch.float64)):
        xs = {k: v.to(dtype).to(dt).requires_grad_() for k, v in tensors.items()}
        loss = CASE_BY_NAME[case].fn(**xs, backend=backend, **kwargs)
        grads = torch.autograd.grad(loss.sum(), list(xs.values()))
        out.append((loss.detach().double(), [g.double() for g in grads]))
    return out


def _check(case: str, dtype, margin: float, reduction: str | None, monkeypatch, launches, col: bool = True,
           saturated: bool = True):
    monkeypatch.setitem(C.REGIME_MARGIN, "saturated", margin)
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], 256, 64, seed=3, regime="saturated")
    if reduction is not None:
        kwargs = dict(kwargs, reduction=reduction)
    (got, ggot), (want, gwant) = _losses(case, tensors, kwargs, dtype)
    # the route under test: the fused forward with the column term and the target split out
    fwd = [x for x in launches if x.name == "lse_fwd"]
    assert [(x.constexprs["WANT_COL"], x.constexprs["SPLIT_T"], x.constexprs["TRI"]) for x in fwd] == [
        (col, True, False)], fwd
    if saturated:
        assert float(want.mean()) < (3e-4 if margin < 13 else 5e-5), float(want.mean())  # p_t ~ 0.9999
    rel = float(((got - want).abs() / want.abs()).max())
    assert rel <= REL_TOL, f"{case} {dtype} margin {margin}: loss {got.tolist()!s:.200} vs float64, rel err {rel:.3g}"
    for g, w in zip(ggot, gwant, strict=True):
        err = float((g - w).abs().max()) / float(w.abs().max())
        floor = own_rounding(w, dtype)
        assert err <= GRAD_TOL + floor, f"{case} {dtype} margin {margin}: gradient rel err {err:.3g} (own {floor:.3g})"


@pytest.mark.parametrize("reduction", [None, "none"])
@pytest.mark.parametrize("margin", [9.0, 13.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saturated_clip_against_float64(dtype, margin, reduction, monkeypatch, launches):
    _check("clip", dtype, margin, reduction, monkeypatch, launches)


def test_saturated_clip_b_is_a(monkeypatch, launches):
    # info_nce(symmetric=True) of a batch against itself: B is A, the column term on the symmetric logits
    _check("clip_self", torch.bfloat16, 9.0, None, monkeypatch, launches, saturated=False)


@pytest.mark.parametrize("case", ["am_softmax", "clip_smoothed"])
def test_clip_forms_with_target_terms(case, monkeypatch, launches):
    # LaBSE's symmetric additive margin (the margin's bias column, in the column statistics and the target logit)
    # and label smoothing (its SET term beside the target term: core.forward_parts takes only c_i l_it out)
    _check(case, torch.bfloat16, 9.0, None, monkeypatch, launches, saturated=False)


@pytest.mark.parametrize("margin", [9.0, 13.0])
@pytest.mark.parametrize("gemm", ["cublas", "epilogue"])
@pytest.mark.parametrize("case,reduction", [("clip", None), ("clip", "none"), ("info_nce", "none"),
                                            ("am_softmax", None), ("am_softmax", "none")])
def test_saturated_losses_on_the_panel_path(case, reduction, gemm, margin, monkeypatch, route, launches):
    # the panel path's statistics forward with the target split: the fused forward kernel's (cuBLAS form) or the
    # epilogue GEMM's MODE 3 in 96-row panels (CLIP's column (j, j) out of column j's statistics too); per-row
    # InfoNCE takes it as well (its summed form takes the one pass, tests/test_one_pass_loss.py). The old form was
    # 0.13 to 0.51 off per pair / row at these margins. LaBSE's symmetric margin (its bias column: the host's target
    # logit takes the margin where the tiles do) was not split there until now: 3.1e-4 summed and 4.6e-3 per pair off
    route(TRITON_PATH="panel", PANEL_GEMM=gemm, PANEL_ROWS=96)
    monkeypatch.setitem(C.REGIME_MARGIN, "saturated", margin)
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], 256, 64, seed=3, regime="saturated")
    if reduction is not None:
        kwargs = dict(kwargs, reduction=reduction)
    (got, ggot), (want, gwant) = _losses(case, tensors, kwargs, torch.bfloat16)
    col = case in ("clip", "am_softmax")
    if gemm == "epilogue":
        stats = [(x.constexprs["WANT_COL"], x.constexprs["SPLIT_T"]) for x in launches if x.name == "epi_gemm_stats"]
        assert stats == [(col, True)] * 3, launches  # (256 rows: three panels)
    else:
        fwd = [(x.constexprs["WANT_COL"], x.constexprs["SPLIT_T"]) for x in launches if x.name == "lse_fwd"]
        assert fwd == [(col, True)], launches
    assert any(x.name in ("panel_dl", "epi_gemm") for x in launches), launches  # the panel sweep's backward
    rel = float(((got - want).abs() / want.abs()).max())
    assert rel <= REL_TOL, f"{case} {gemm} margin {margin}: loss rel err {rel:.3g}"
    for g, w in zip(ggot, gwant, strict=True):
        err = float((g - w).abs().max()) / float(w.abs().max())
        assert err <= GRAD_TOL, f"{case} {gemm} margin {margin}: gradient rel err {err:.3g}"


def test_the_gluon_option_keeps_the_statistics_forward_unsplit(route, launches):
    # FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws asks for the Gluon statistics forward, which has no target split: CLIP's
    # statistics then run without it (the option's documented trade: the old loss form), so that a GPU with the
    # Gluon kernel takes it (here, on the CPU, the gate refuses it and the Triton kernel runs the same launch)
    route(TRITON_PATH="panel", PANEL_GEMM="epilogue", PANEL_ROWS=96, EPI_GEMM="gluon-ws")
    tensors, kwargs = make_inputs(CASE_BY_NAME["clip"], 128, 64, seed=3, regime="saturated")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _losses("clip", tensors, kwargs, torch.bfloat16)
    stats = [x.constexprs["SPLIT_T"] for x in launches if x.name == "epi_gemm_stats"]
    assert stats == [False, False], launches
