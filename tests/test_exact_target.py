"""The target's gradient weight in the saturated regime on the fused kernels: ``p_t - 1`` formed without its
cancellation (``core/lse/triton_fused.py`` ``exact_weights``, ``kernels/lse.py`` ``lse_bwd_rows_kernel`` EXACT_T,
``core.backward_parts`` and ``core/linear_terms.py``'s ``target_less``).

With ``1 - p_t`` near 1e-7 (``testing.cases.REGIMES["saturated"]`` at a margin of 13, D = 112: the embeddings'
gradients are ~3e-8) the log-sum-exp piece's fp32 ``p_t = exp(l_t - LSE_t)`` meets the target term's ``-1`` with
nothing left: ``LSE_i`` and ``l_it`` round alike at ``|s| ~ 20``, whose unit in the last place is ~2e-6. The old form
was 0.19 to 0.41 of the largest gradient off float64 (fp32 ``F.cross_entropy`` is 0.012 to 0.019 off there). The split
forward's statistics give ``1 - p_t = exp(LSEx_i - LSE_i)`` to its relative accuracy; the backward's tile takes the
combined weight at the target, and the target term leaves its coefficient out. Measured under the CPU interpreter,
N = 64 and 128, D = 112, against float64 on the same rounded rows (InfoNCE, CLIP, SimCSE in bf16): the embeddings'
gradients 4.5e-3 to 8.9e-3 of the largest (the old form 0.19 to 0.41), the scale's 6e-8 to 6e-7 (the old form 0.025 to
0.083). fp16 gradients this small are subnormal, so fp16's bound adds fp16's own rounding of the float64 gradient.
The panel path's recomputing backward after a split statistics forward (``kernels/panel.py`` ``_dl_chunk`` EXACT_T:
CLIP, per-row InfoNCE, and SimCSE's triangular sweep with its transposed target entries) does the same, in 48-row
panels on both GEMM forms: 3.6e-3 to 8.9e-3 (the old form 0.044 to 0.33). The one pass (a summed InfoNCE on the panel
path) weighs the target by ``-zx_i`` where the row's loss folds (``kernels/panel.py`` ``_target_weight``) and takes the
target's cosine back into the temperature's sum with it: the temperature's gradient 2.6e-7 to 1.8e-5 where it was
6.2e-3 to 1.2e-2. A summed InfoNCE off the one pass (fp16, raw dot products) takes the split statistics forward and
the recomputing backward instead of the two-pass eager sweep: its loss 0.46-0.51 off at margin 13 before, 4e-7 now."""

from __future__ import annotations

import warnings

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from fused_contrastive.core import target_split
from fused_contrastive.core.lse import triton_fused
from fused_contrastive.testing import CASE_BY_NAME
from fused_contrastive.testing import cases as C
from fused_contrastive.testing.accuracy import make_inputs

#: The gradients' largest error over the largest true gradient (bf16 rounds each gradient entry by up to 2^-9 itself).
GRAD_TOL = 1.5e-2
#: What the old form (the kernel's fp32 ``p_t`` beside the target term's -1) must miss on these inputs by.
OLD_FORM_MISSES = 0.1
#: The temperature's gradient (one number; measured 3e-8 to 1.8e-5, where the old forms were 0.0056 to 0.083).
SCALE_TOL = 1e-4

#: (case, the name of its scale argument)
CASES = {"info_nce": "temperature", "clip": "logit_scale", "simcse": "temperature"}


@pytest.fixture(autouse=True)
def _fused(route):
    """The fused kernels (not the dense one-tile path), quiet numpy."""
    route(DENSE="0", TRITON_PATH="fused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def own_rounding(w: torch.Tensor, dtype) -> float:
    """The largest error of ``dtype``'s own rounding of the float64 gradient ``w``, over its largest entry: the floor
    of any gradient returned in ``dtype``."""
    return float((w.to(dtype).double() - w).abs().max() / w.abs().max())


def errors(case: str, n: int, d: int, dtype, reduction: str | None = None, seed: int = 3) -> list[tuple[float, float]]:
    """``(error, dtype's own rounding)`` of each gradient (the embeddings', then the scale's) of the Triton route
    against float64 on the same rounded rows, at a margin of 13, the scale a tensor that requires grad."""
    C.REGIME_MARGIN["saturated"] = 13.0
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], n, d, seed=seed, regime="saturated")
    if reduction is not None:
        kwargs = dict(kwargs, reduction=reduction)
    key = CASES[case]
    out = []
    for backend, dt in (("triton", dtype), ("reference", torch.float64)):
        xs = [v.to(dtype).to(dt).requires_grad_() for v in tensors.values()]
        sc = torch.tensor(float(kwargs[key]), dtype=torch.float32 if dt != torch.float64 else dt, requires_grad=True)
        loss = CASE_BY_NAME[case].fn(*xs, backend=backend, **dict(kwargs, **{key: sc}))
        out.append([g.double() for g in torch.autograd.grad(loss.sum(), [*xs, sc])])
    got, want = out
    # saturated: 1 - p_t ~ 1e-7, the gradients with it (the mean's; n times that for the rows' sum)
    assert float(want[0].abs().max()) < 3e-6 * (1 if reduction is None else n)
    return [(float((g - w).abs().max() / w.abs().max()), own_rounding(w, dtype) if w.dim() else 0.0)
            for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_saturated_gradients_against_float64(case, n, launches):
    errs = errors(case, n, 112, torch.bfloat16)
    rows = [x for x in launches if x.name == "lse_bwd_rows"]
    assert rows and all(x.constexprs["SPLIT_T"] and x.constexprs["EXACT_T"] for x in rows), rows
    for i, (err, _) in enumerate(errs):
        assert err <= GRAD_TOL, f"{case} N={n}: gradient {i} off float64 by {err:.3g} of its largest entry"
    assert errs[-1][0] <= SCALE_TOL, f"{case} N={n}: the temperature's gradient off by {errs[-1][0]:.3g}"


@pytest.mark.parametrize("gemm", ["cublas", "epilogue"])
@pytest.mark.parametrize("case,reduction", [("clip", None), ("info_nce", "none"), ("simcse", None)])
def test_the_panel_paths_recomputing_backward(case, reduction, gemm, route, launches):
    # the panel path in 48-row panels after a split statistics forward: the recomputing sweep (panel_dl_kernel's
    # second loop, or the epilogue GEMM's MODE 0) for CLIP and per-row InfoNCE, the triangular sweep for SimCSE (its
    # transposed target entries in other panels included); the old form was 0.044 to 0.33 off there
    route(TRITON_PATH="panel", PANEL_GEMM=gemm, PANEL_ROWS=48)
    errs = errors(case, 128, 112, torch.bfloat16, reduction)
    name = "panel_dl" if gemm == "cublas" else "epi_gemm"
    tiles = [x for x in launches if x.name == name]
    assert tiles and all(x.constexprs["SPLIT_T"] and x.constexprs["EXACT_T"] for x in tiles), tiles
    assert all(x.constexprs["TRI"] == (case == "simcse") for x in tiles), tiles
    for i, (err, _) in enumerate(errs):
        assert err <= GRAD_TOL, f"{case} {gemm}: gradient {i} off float64 by {err:.3g} of its largest entry"
    assert errs[-1][0] <= SCALE_TOL, f"{case} {gemm}: the temperature's gradient off by {errs[-1][0]:.3g}"


@pytest.mark.parametrize("gemm", ["cublas", "epilogue", "fp16pass"])
def test_the_panel_paths_one_pass(gemm, route, launches):
    # a summed InfoNCE on the panel path: the one pass (panel_dl_kernel's ONE_PASS, the epilogue GEMM's MODE 1 or the
    # fp16 pass, then epi_rows_kernel), whose target weight is -zx_i where the row's loss folds (_target_weight) and
    # whose temperature partials leave the target out and take it back with that weight; the old form's temperature
    # gradient was 6.2e-3 to 1.2e-2 off here (its embeddings' 4.9e-3 to 9.3e-3)
    route(TRITON_PATH="panel", PANEL_GEMM=gemm, PANEL_ROWS=48)
    errs = errors("info_nce", 128, 112, torch.bfloat16)
    names = {x.name for x in launches}
    assert {"cublas": "panel_dl", "epilogue": "epi_rows", "fp16pass": "logit_pass"}[gemm] in names, names
    assert all(x.constexprs.get("ONE_PASS", True) for x in launches if x.name == "panel_dl"), launches
    for i, (err, _) in enumerate(errs):
        assert err <= GRAD_TOL, f"{gemm}: gradient {i} off float64 by {err:.3g} of its largest entry"
    assert errs[-1][0] <= SCALE_TOL, f"{gemm}: the temperature's gradient off by {errs[-1][0]:.3g}"


@pytest.mark.parametrize("case", ["info_nce", "clip"])
def test_fp16_gradients_within_fp16s_own_rounding(case):
    # per-row losses summed: gradients of ~1e-6, below fp16's smallest normal (6.1e-5)
    for i, (err, floor) in enumerate(errors(case, 128, 112, torch.float16, "none")):
        assert err <= GRAD_TOL + floor, f"{case}: gradient {i} off by {err:.3g}, fp16's own rounding {floor:.3g}"


@pytest.mark.parametrize("case", ["info_nce", "clip"])
def test_the_old_form_misses(case, monkeypatch, route):
    # the inputs discriminate: without the exact weights (the kernel's p_t, then the target term's -1) the
    # embeddings' gradients miss float64 by far more than the bound, on the fused kernels and the panel path
    monkeypatch.setattr(triton_fused, "exact_weights", lambda *a, **k: None)
    errs = errors(case, 64, 112, torch.bfloat16)
    assert max(e for e, _ in errs[:-1]) > OLD_FORM_MISSES, errs
    route(TRITON_PATH="panel", PANEL_GEMM="cublas", PANEL_ROWS=48)
    errs = errors(case, 128, 112, torch.bfloat16, "none")
    assert max(e for e, _ in errs[:-1]) > OLD_FORM_MISSES, errs


@pytest.mark.parametrize("n,m", [(8, 8), (8, 5), (5, 8)])
def test_the_weight_without_the_target_terms_share(n, m):
    # exact_weights by hand on a small unsaturated problem: the row's -g_i (1 - p_t) and, where column i's target is
    # row i (t_i = i), the column's -gc_i (1 - pc_ii); elsewhere the column's plain weight gc_t pc_it. Against float64
    # softmaxes of the same logits, with M != N both ways (rows past the columns have targets i mod M)
    torch.manual_seed(0)
    s = 5.0
    a = torch.nn.functional.normalize(torch.randn(n, 16, dtype=torch.float64), dim=1)
    b = torch.nn.functional.normalize(torch.randn(m, 16, dtype=torch.float64), dim=1)
    logits = s * a @ b.T
    target = torch.arange(n) % m
    hit = torch.zeros(n, m, dtype=torch.bool)
    hit[torch.arange(n), target] = True
    lt = logits[torch.arange(n), target]
    lse_x = logits.masked_fill(hit, float("-inf")).logsumexp(1)
    diag = torch.zeros(n, m, dtype=torch.bool)  # column j's target entry (j, j), where target[j] == j
    k = min(n, m)
    diag[torch.arange(k), torch.arange(k)] = target[:k] == torch.arange(k)
    lse_col_x = logits.masked_fill(diag, float("-inf")).logsumexp(0)
    minus: dict = {}
    lse, lse_col = target_split.merge_split(lse_x.float(), lse_col_x.float(), torch.cat([lt, lt]).float(), target,
                                            False, minus)
    g, gc = torch.rand(n, dtype=torch.float64), torch.rand(m, dtype=torch.float64)
    w = target_split.exact_weights(minus, target, g.float(), gc.float(), lse_col)
    p_t = logits.softmax(1)[torch.arange(n), target]
    pc_t = logits.softmax(0)[torch.arange(n), target]
    own = diag[torch.arange(n), target]
    want = g * (p_t - 1) + gc[target] * (pc_t - own.double())
    assert torch.allclose(w.double(), want, rtol=1e-5, atol=0), (w, want)


def _summed_info_nce(dtype, normalize: bool, margin: float) -> tuple[float, float]:
    """(the loss's, the temperature gradient's) relative error of a summed InfoNCE on the panel path (48-row panels)
    against float64 on the same rounded rows, N = 128, D = 112, the saturated regime at ``margin``; with ``normalize``
    False the rows are unit rows given as raw dot products."""
    C.REGIME_MARGIN["saturated"] = margin
    tensors, kwargs = make_inputs(CASE_BY_NAME["info_nce"], 128, 112, seed=3, regime="saturated")
    if not normalize:
        kwargs = dict(kwargs, normalize=False)
        tensors = {k: torch.nn.functional.normalize(v, dim=-1) for k, v in tensors.items()}
    out = []
    for backend, dt in (("triton", dtype), ("reference", torch.float64)):
        xs = [v.to(dtype).to(dt).requires_grad_() for v in tensors.values()]
        sc = torch.tensor(float(kwargs["temperature"]), dtype=torch.float32 if dt != torch.float64 else dt,
                          requires_grad=True)
        loss = CASE_BY_NAME["info_nce"].fn(*xs, backend=backend, **dict(kwargs, temperature=sc))
        out.append((loss.detach().double(), torch.autograd.grad(loss, sc)[0].double()))
    (got, gs), (want, ws) = out
    return float((got - want).abs() / want.abs()), float((gs - ws).abs() / ws.abs())


#: a summed InfoNCE's loss on the panel path where the one pass does not apply (measured 3e-8 to 4e-7)
SUMMED_LOSS_TOL = 1e-5
#: (dtype, normalize): fp16's range keeps it off the one pass; raw dot products (normalize=False) too
OFF_THE_ONE_PASS = [(torch.float16, True), (torch.float16, False), (torch.bfloat16, False)]


@pytest.mark.parametrize("margin", [9.0, 13.0])
@pytest.mark.parametrize("dtype,normalize", OFF_THE_ONE_PASS, ids=["fp16", "fp16-raw", "bf16-raw"])
def test_summed_info_nce_off_the_one_pass(dtype, normalize, margin, route, launches):
    # the split statistics forward and the recomputing backward with the exact weights (as per-row losses), where the
    # two-pass eager sweep kept the target in its statistics: there the loss was 7.5e-3 (fp16) and 2.2e-3 (bf16 raw)
    # off float64 at margin 9, 2.3e-2 / 0.51 / 0.46 at margin 13, the temperature's gradient up to 1.2e-2; now the loss
    # 3e-8 to 2e-7 and the temperature's gradient 6e-8 to 1.3e-7
    route(TRITON_PATH="panel", PANEL_GEMM="cublas", PANEL_ROWS=48)
    loss_err, scale_err = _summed_info_nce(dtype, normalize, margin)
    tiles = [x for x in launches if x.name == "panel_dl"]
    assert tiles and all(not x.constexprs["EAGER"] and x.constexprs["EXACT_T"] for x in tiles), tiles
    assert loss_err <= SUMMED_LOSS_TOL, f"the loss off float64 by {loss_err:.3g}"
    assert scale_err <= SCALE_TOL, f"the temperature's gradient off by {scale_err:.3g}"


def test_the_eager_sweep_misses(monkeypatch, route):
    # planted: no split on the panel path (the two-pass eager sweep, its statistics with the target in) misses both
    route(TRITON_PATH="panel", PANEL_GEMM="cublas", PANEL_ROWS=48)
    monkeypatch.setattr(triton_fused, "splits_forward", lambda *a, **k: False)
    loss_err, scale_err = _summed_info_nce(torch.float16, False, 13.0)
    assert loss_err > 0.1 and scale_err > SCALE_TOL, (loss_err, scale_err)


#: fp32 operands: the gradients' largest error over the largest (measured 1.4e-6 to 2.7e-6 on both paths)
FP32_TOL = 1e-4


@pytest.mark.parametrize("path", ["fused", "panel"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_tiles_split_too(case, path, route, launches):
    # fp32 tiles form LSE_i - l_it and p_t - 1 in fp32 as 16-bit ones do: without the split the fused kernels'
    # gradients were 0.17-0.32 of the largest off float64 at margin 13 and the panel path's 0.45-0.56
    if path == "panel":
        route(TRITON_PATH="panel", PANEL_GEMM="cublas", PANEL_ROWS=48)
    errs = errors(case, 128, 112, torch.float32, "none")
    assert any(x.constexprs.get("SPLIT_T") for x in launches if x.name == "lse_fwd"), launches
    for i, (err, _) in enumerate(errs):
        assert err <= FP32_TOL, f"{case} {path} fp32: gradient {i} off float64 by {err:.3g}"


def test_fp32_without_the_split_misses(monkeypatch):
    # planted: the split for 16-bit operands only (the old rule) leaves fp32's gradients far off
    monkeypatch.setattr(triton_fused, "splits_forward", lambda ctx, coef, dt: ctx.split is not None and
                        coef.lse is not None and dt in (torch.float16, torch.bfloat16))
    errs = errors("info_nce", 128, 112, torch.float32, "none")
    assert max(e for e, _ in errs) > OLD_FORM_MISSES, errs
