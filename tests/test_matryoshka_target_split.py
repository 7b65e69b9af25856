"""The Matryoshka kernels' backward keeps each row's target entry out of its 16-bit tiles (SPLIT_T,
``kernels/matryoshka.py`` ``mat_bwd_kernel``; ``core/matryoshka/triton_levels.py`` ``_bwd`` and ``_target_cols``),
as the plain kernels do (``kernels/lse.py``): in a peaked softmax the target entry ``p_it - 1`` of every level's
gradient tile nearly cancels and is its row's largest entry, and the 16-bit roundings of the tile and of the
other side's unit rows fell on it whole. In bf16 the other side's inverse norms also multiply the tile
(FOLD_NORM) so that the GEMM reads the exact scaled rows: the levels shared one rounded ``Y_hat``, whose
errors added up over the levels. Against the float64 definition ``sum_k loss(F.normalize(x[:, :d_k]))``
(the reference backend per level) under the Triton interpreter, its bf16 casts rounded to nearest as on the GPU
(the ``gpu_rounding`` fixture: the interpreter's own cast drops the low bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import fused_contrastive as fc  # noqa: E402
from fused_contrastive.core.matryoshka import triton_levels as TM  # noqa: E402
from fused_contrastive.core.triton_shared import launch as TL  # noqa: E402

DIMS = [16, 32, 64]


@pytest.fixture
def kernels(route):
    """The Matryoshka kernels' own backward, on the kernels at every size."""
    route(DENSE="0", TRITON_PATH="fused", MATRYOSHKA_ROUTE="kernels")


def _definition(q, k, target=None, dims=DIMS, temperature=0.05):
    """The float64 definition: the reference loss of each level on its re-normalised prefix, summed."""
    return sum(fc.info_nce(F.normalize(q[:, :d], dim=-1), F.normalize(k[:, :d], dim=-1), target=target,
                           temperature=temperature, backend="reference") for d in dims)


def _errors(q0, k0, dtype, target=None, need=("q", "k"), dims=DIMS):
    """max |error| / max |truth| of each requested gradient of the kernels' call against the float64
    definition on the same ``dtype``-rounded inputs."""
    out = {}
    for name, dt in (("truth", torch.float64), ("got", dtype)):
        q = q0.to(dtype).to(dt).clone().requires_grad_("q" in need)
        k = k0.to(dtype).to(dt).clone().requires_grad_("k" in need)
        if name == "truth":
            loss = _definition(q, k, target, dims)
        else:
            loss = fc.info_nce(q, k, target=target, temperature=0.05, matryoshka_dims=dims, backend="triton")
        loss.backward()
        out[name] = {n: x.grad.double() for n, x in (("q", q), ("k", k)) if n in need}
    return {n: float((out["got"][n] - out["truth"][n]).abs().max() / out["truth"][n].abs().max()) for n in need}


def _peaked(seed):
    """48 rows of 64 with positives at cosine ~0.8 (trained embeddings): at temperature 0.05, 1 - p_t ~ 1e-4."""
    g = torch.Generator().manual_seed(seed)
    q0 = torch.randn(48, 64, generator=g)
    return q0, q0 + 0.5 * torch.randn(48, 64, generator=g)


#: max |err| / max |grad| of the bf16 gradients in the peaked softmax (test_bf16_gradients_in_a_peaked_softmax)
PEAKED_BF16 = 3.5e-3


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_bf16_gradients_in_a_peaked_softmax(kernels, gpu_rounding, seed):
    """bf16, temperature 0.05, N = 48, levels 16 / 32 / 64: within 3.5e-3 of max |grad| (the kernels' max over
    seeds 0-4: 3.2e-3; one plain call per level: 4.5e-3). Measured max |err| / max |grad| (q / k), seeds 0-4,
    with the GPU's rounding (``gpu_rounding``):

    * the target entry in the 16-bit tiles (before): 3.9 / 2.8, 5.1 / 6.5, 4.7 / 4.5, 3.1 / 2.6, 3.6 / 4.2 e-3;
    * SPLIT_T alone: 2.5 / 1.0, 1.6 / 3.2, 4.5 / 4.5, 2.6 / 2.6, 1.4 / 2.5 e-3;
    * SPLIT_T and FOLD_NORM (now): 2.5 / 1.2, 1.6 / 3.2, 2.7 / 3.2, 2.6 / 2.6, 1.6 / 2.5 e-3;
    * one plain call per level: 2.5 / 1.2, 2.7 / 2.4, 2.8 / 3.2, 4.3 / 3.2, 2.1 / 4.5 e-3.

    With the interpreter's own casts (toward zero) the kernels measured 3.9 / 4.0, 8.2 / 3.4, 6.2 / 5.1,
    5.8 / 5.7, 2.9 / 4.0 e-3 and the plain calls' key gradients 2.0-3.7e-3: the kernels round their bf16
    output in the kernel (the interpreter truncated it: up to 2^-8 of an entry, 4e-3 of max |grad| where the
    largest entry sits), the plain calls in PyTorch (their fp32 output, ``core.PiecesFn``). Level 16 alone,
    seed 0, keys: the epilogue's value from the kernel's own fp32 scratch and scalars, evaluated in float64,
    is 1.3e-3 off; rounded to nearest bf16 1.4e-3; the kernel's output (the interpreter's truncation) 4.0e-3."""
    errs = _errors(*_peaked(seed), torch.bfloat16)
    assert max(errs.values()) <= PEAKED_BF16, errs


@pytest.mark.parametrize(("flag", "seed"), [("SPLIT_T", 0), ("FOLD_NORM", 2)])
def test_the_bound_needs_the_split_and_the_fold(kernels, gpu_rounding, monkeypatch, flag, seed):
    """Either form off (the gradient launches' constexpr set False) breaks the peaked-softmax bound on a seed
    (without SPLIT_T 4.0e-3 on seed 0; without FOLD_NORM 4.5e-3 on seed 2): the bound tells them apart."""
    orig = TL._launch

    def spy(lz):
        if lz.name.startswith("mat_bwd"):
            lz = lz._replace(constexprs={**lz.constexprs, flag: False})
        orig(lz)

    monkeypatch.setattr(TL, "_launch", spy)
    errs = _errors(*_peaked(seed), torch.bfloat16)
    assert max(errs.values()) > PEAKED_BF16, errs


def test_the_split_runs_and_its_entries_matter(kernels, monkeypatch):
    """The rows kernel runs with SPLIT_T and writes the target entries; the columns kernel starts from them.
    Planted: the columns kernel's fp32 start dropped (zeros): the key gradients miss every target entry."""
    seen = []
    orig = TL._launch

    def spy(lz):
        seen.append((lz.name, lz.constexprs.get("SPLIT_T")))
        orig(lz)

    monkeypatch.setattr(TL, "_launch", spy)
    q0, k0 = _peaked(0)
    assert max(_errors(q0, k0, torch.float32).values()) <= 2e-4
    assert ("mat_bwd_rows", True) in seen and ("mat_bwd_cols", True) in seen, seen
    monkeypatch.setattr(TM, "_target_cols", lambda L, t, tg, gcols: torch.zeros(
        (gcols, L.p.a.shape[1]), dtype=torch.float32, device=tg.device))
    errs = _errors(q0, k0, torch.float32)
    assert errs["q"] <= 2e-4 and errs["k"] > 0.1, errs


def test_rows_sharing_a_target_and_key_gradients_alone(kernels):
    """fp32: several rows with one target column (the columns kernel's start sums them), more keys than
    rows, and only the keys needing a gradient (the rows kernel runs for the target entries alone)."""
    g = torch.Generator().manual_seed(7)
    q0 = torch.randn(40, 64, generator=g)
    k0 = torch.randn(70, 64, generator=g)
    target = torch.tensor([i % 13 for i in range(40)])
    k0[:13] = q0[:13] + 0.3 * torch.randn(13, 64, generator=g)
    errs = _errors(q0, k0, torch.float32, target=target)
    assert max(errs.values()) <= 2e-4, errs
    errs = _errors(q0, k0, torch.float32, target=target, need=("k",))
    assert errs["k"] <= 2e-4, errs


# ------------------------------------------------------------------------------------------------
# the forward: every level's loss without the cancellation of LSE_i - l_it
# ------------------------------------------------------------------------------------------------

#: The levels' loss, |error| / |float64| per entry (summed or per row; measured 1.5e-7 to 4.3e-6 at margins 9 and 13).
LOSS_TOL = 1e-4


def _saturated_losses(case: str, reduction: str | None, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the Triton route's bf16 loss, float64's on the same rounded rows) of ``case`` with levels 112 / 64 / 32 in the
    saturated regime (``testing.cases.REGIMES``) at ``margin``, N = 64, D = 112."""
    from fused_contrastive.testing import CASE_BY_NAME
    from fused_contrastive.testing import cases as C
    from fused_contrastive.testing.accuracy import make_inputs

    C.REGIME_MARGIN["saturated"] = margin
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], 64, 112, seed=3, regime="saturated")
    if reduction is not None:
        kwargs = dict(kwargs, reduction=reduction)
    out = []
    for backend, dt in (("triton", torch.bfloat16), ("reference", torch.float64)):
        xs = [v.to(torch.bfloat16).to(dt) for v in tensors.values()]
        if backend == "triton":
            out.append(CASE_BY_NAME[case].fn(*xs, backend=backend, matryoshka_dims=[112, 64, 32], **kwargs).double())
        else:  # the definition: the plain loss of each level's re-normalised prefix, summed
            out.append(sum(CASE_BY_NAME[case].fn(*[F.normalize(x[:, :d], dim=-1) for x in xs], backend=backend,
                                                 **kwargs) for d in (112, 64, 32)))
    return out[0], out[1]


@pytest.mark.parametrize("margin", [9.0, 13.0])
@pytest.mark.parametrize("case,reduction", [("info_nce", None), ("info_nce", "none"), ("clip", None)])
def test_saturated_level_losses_against_float64(kernels, launches, case, reduction, margin):
    """``mat_fwd_kernel``'s SPLIT_T: each level's ``LSE_i - l_it`` as ``softplus(LSEx_i - l_it)``. Without it (the row
    sums with their target entry, the fp32 target logit subtracted after) the summed loss was 8.6e-5 / 8.1e-5 (InfoNCE
    / CLIP) off float64 at margin 9 and 6.8e-3 / 1.3e-2 at margin 13, a row's 2.9e-2 and 0.53."""
    got, want = _saturated_losses(case, reduction, margin)
    fwd = [x for x in launches if x.name == "mat_fwd"]
    assert fwd and all(x.constexprs["SPLIT_T"] for x in fwd), fwd
    err = float(((got - want).abs() / want.abs()).max())
    assert err <= LOSS_TOL, f"{case} {reduction} margin {margin}: the loss off float64 by {err:.3g}"


@pytest.mark.parametrize("case,reduction,misses", [("info_nce", None, 1e-3), ("info_nce", "none", 0.1),
                                                   ("clip", None, 1e-3)])
def test_the_unsplit_forward_misses(kernels, monkeypatch, case, reduction, misses):
    """Planted: the levels' forward without the split (``TritonLevelsFn``'s ``may_split`` False, the old form) misses
    the bound at margin 13 by far."""
    orig = TM.TritonLevelsFn.apply
    # (a, b, scale, spec, data, coef, reduce, dims, lt, may_split, set_term)
    monkeypatch.setattr(TM.TritonLevelsFn, "apply", lambda *args: orig(*args[:9], False, *args[10:]))
    got, want = _saturated_losses(case, reduction, 13.0)
    assert float(((got - want).abs() / want.abs()).max()) > misses


@pytest.mark.parametrize("case", ["info_nce", "info_nce_ignore", "info_nce_self", "info_nce_symmetric", "clip",
                                  "simcse_2view", "simcse_interleaved", "simcse_sup"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_target_loss_takes_the_split_in_16_bits(kernels, launches, case, reduction):
    """The split on every loss with a target term in bf16 (an ignored row, a target at the excluded own column's
    neighbour, B is A, CLIP's column term, hard negatives; ragged levels off every tile edge): loss and every gradient
    against the float64 definition (``tests/test_triton_matryoshka.py``'s bf16 bounds)."""
    from test_triton_matryoshka import _check, _run

    got, g_got = _run(case, reduction, "triton", torch.bfloat16)
    want, g_want = _run(case, reduction, "def", torch.bfloat16)
    assert [x.constexprs["SPLIT_T"] for x in launches if x.name == "mat_fwd"] == [True], launches
    _check(got, want, torch.bfloat16, "loss")
    assert len(g_got) == len(g_want) > 0
    for i, (a, b) in enumerate(zip(g_got, g_want, strict=True)):
        _check(a, b, torch.bfloat16, f"grad {i}")


@pytest.mark.parametrize("case", ["supcon_out", "supcon_one", "supcon_mask", "supcon_queue", "dscl", "supcon_simclr"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_positive_set_term_in_the_tiles(kernels, launches, case, reduction):
    """The positive-set term's gradient inside every level's gradient tile (HAS_SET) on the losses that have one, in
    bf16 (labels, a float mask, a queue, DSCL's target beside it, B is A and not): loss and every gradient against the
    float64 definition (``tests/test_triton_matryoshka.py``'s bf16 bounds). Planted: without HAS_SET the SET term's
    gradient is missing and the test fails (``test_the_set_weights_matter``)."""
    from test_triton_matryoshka import _check, _run

    got, g_got = _run(case, reduction, "triton", torch.bfloat16)
    want, g_want = _run(case, reduction, "def", torch.bfloat16)
    bwd = [x for x in launches if x.name.startswith("mat_bwd")]
    assert bwd and all(x.constexprs["HAS_SET"] and x.constexprs["POS_KIND"] for x in bwd), bwd
    _check(got, want, torch.bfloat16, "loss")
    assert len(g_got) == len(g_want) > 0
    for i, (a, b) in enumerate(zip(g_got, g_want, strict=True)):
        _check(a, b, torch.bfloat16, f"grad {i}")


def test_the_set_weights_matter(kernels, monkeypatch):
    """Planted: the SET coefficients zeroed on their way into the tiles: the gradients miss the definition."""
    from test_triton_matryoshka import _run

    orig = TM.set_grad
    monkeypatch.setattr(TM, "set_grad", lambda c, go, n: torch.zeros_like(orig(c, go, n)))
    _, g_got = _run("supcon_out", "mean", "triton", torch.float32)
    _, g_want = _run("supcon_out", "mean", "def", torch.float32)
    assert max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(g_got, g_want, strict=True)) > 0.05


def _saturated_grad_error(case: str, dtype, margin: float) -> float:
    """The largest gradient error over the largest gradient of ``case`` with levels 112 / 64 / 32 against float64, the
    saturated regime at ``margin`` (N = 64, D = 112), on the same ``dtype``-rounded rows."""
    from fused_contrastive.testing import CASE_BY_NAME
    from fused_contrastive.testing import cases as C
    from fused_contrastive.testing.accuracy import make_inputs

    C.REGIME_MARGIN["saturated"] = margin
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], 64, 112, seed=3, regime="saturated")
    grads = []
    for backend, dt in (("triton", dtype), ("reference", torch.float64)):
        xs = [v.to(dtype).to(dt).requires_grad_() for v in tensors.values()]
        if backend == "triton":
            loss = CASE_BY_NAME[case].fn(*xs, backend=backend, matryoshka_dims=[112, 64, 32], **kwargs)
        else:
            loss = sum(CASE_BY_NAME[case].fn(*[F.normalize(x[:, :d], dim=-1) for x in xs], backend=backend, **kwargs)
                       for d in (112, 64, 32))
        grads.append(torch.autograd.grad(loss.sum(), xs))
    return max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(*grads, strict=True))


#: fp32 levels' gradients in the saturated regime (measured 8e-7 to 1.6e-6 with the exact target weights)
FP32_GRAD_TOL = 1e-4


@pytest.mark.parametrize("case", ["info_nce", "clip"])
def test_fp32_level_gradients_take_the_exact_target_weight(kernels, launches, case):
    """The backward's target entries from the split forward's statistics (``level_exact_weights``, EXACT_T): fp32 at
    margin 13 was 1.6e-3 / 1.2e-3 of the largest gradient off float64 (``p_t - 1`` in fp32), now within 1e-4.
    Planted: without the levels' split statistics (the old form) it misses."""
    assert _saturated_grad_error(case, torch.float32, 13.0) <= FP32_GRAD_TOL
    bwd = [x for x in launches if x.name.startswith("mat_bwd")]
    assert bwd and all(x.constexprs["EXACT_T"] for x in bwd), bwd


def test_the_levels_without_exact_weights_miss(kernels, monkeypatch):
    orig = TM._merge_levels
    monkeypatch.setattr(TM, "_merge_levels", lambda *a: (*orig(*a)[:3], None))
    assert _saturated_grad_error("info_nce", torch.float32, 13.0) > 10 * FP32_GRAD_TOL
