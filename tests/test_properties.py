"""Property tests (hypothesis): torch backend == reference over random shapes, labels and options.

In float64, so that the comparison tests the math (float32 rounding noise is covered, with
dtype-aware tolerances, in test_losses.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fused_contrastive as fc
from fused_contrastive.core import reference
from fused_contrastive.testing import CASE_BY_NAME, CASES, assert_close, loss_and_grads, make_inputs
from fused_contrastive.testing.accuracy import amp_of, check_output, rounding_floor, run

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def _both(fn, tensors, **kw):
    tensors = {k: v.double() for k, v in tensors.items()}
    kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    got, gg = loss_and_grads(fn, tensors, "torch", **kw)
    want, gw = loss_and_grads(fn, tensors, "reference", **kw)
    assert_close(got, want, atol=1e-9, rtol=1e-9, what="loss")
    for k in gg:
        if gw[k] is None:
            assert gg[k] is None, k
        else:
            assert_close(gg[k], gw[k], atol=1e-9, rtol=1e-7, what=k)


@SETTINGS
@given(n=st.integers(1, 40), m=st.integers(1, 40), d=st.integers(1, 16), seed=st.integers(0, 2**16),
       reduction=st.sampled_from(["mean", "sum", "none"]), t=st.floats(0.02, 2.0),
       tile=st.sampled_from(["7", "64", "1000000"]), dense=st.sampled_from(["0", "1"]))
def test_info_nce(n, m, d, seed, reduction, t, tile, dense):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, m, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.2] = -100
    if (target == -100).all() and reduction == "mean":
        target[0] = 0  # an all-ignored mean is 0/0 = nan in both, covered elsewhere
    import os

    os.environ["FUSED_CONTRASTIVE_TILE_ELEMENTS"] = tile
    os.environ["FUSED_CONTRASTIVE_DENSE"] = dense
    try:
        _both(fc.info_nce, {"query": torch.randn(n, d, generator=g), "keys": torch.randn(m, d, generator=g)},
              target=target, temperature=t, reduction=reduction)
    finally:
        del os.environ["FUSED_CONTRASTIVE_TILE_ELEMENTS"], os.environ["FUSED_CONTRASTIVE_DENSE"]


@SETTINGS
@given(bsz=st.integers(1, 24), views=st.integers(1, 3), d=st.integers(1, 12), n_cls=st.integers(1, 6),
       seed=st.integers(0, 2**16), mode=st.sampled_from(["all", "one"]), variant=st.sampled_from(["out", "in"]),
       queue=st.integers(0, 5), reduction=st.sampled_from(["mean", "none"]))
def test_supcon(bsz, views, d, n_cls, seed, mode, variant, queue, reduction):
    g = torch.Generator().manual_seed(seed)
    kw = dict(labels=torch.randint(0, n_cls, (bsz,), generator=g), contrast_mode=mode, variant=variant,
              reduction=reduction)
    if queue:
        kw["queue"] = torch.randn(queue, d, generator=g)
        kw["queue_labels"] = torch.randint(0, n_cls, (queue,), generator=g)
    _both(fc.supcon_loss, {"features": torch.randn(bsz, views, d, generator=g)}, **kw)


@SETTINGS
@given(bsz=st.integers(1, 20), d=st.integers(1, 12), n_cls=st.integers(1, 6), seed=st.integers(0, 2**16),
       beta=st.floats(0.0, 10.0))
def test_dscl(bsz, d, n_cls, seed, beta):
    g = torch.Generator().manual_seed(seed)
    _both(fc.dscl_loss, {"features": torch.randn(bsz, 2, d, generator=g)},
          labels=torch.randint(0, n_cls, (bsz,), generator=g), beta=beta)


@SETTINGS
@given(b=st.integers(1, 60), n_levels=st.integers(1, 8), seed=st.integers(0, 2**16), scale=st.floats(1.0, 30.0))
def test_cosent(b, n_levels, seed, scale):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, n_levels, (b,), generator=g).double() / 3
    _both(fc.cosent_loss_from_scores, {"scores": torch.rand(b, generator=g, dtype=torch.float64) * 2 - 1},
          labels=labels, scale=scale)


# --- degenerate rows: zero, tiny (norm below eps = 1e-12) and duplicated ------------------------------
# Every registered case (losses and metrics), its embeddings with such rows planted, on the torch backend
# (dense tile and chunked with small tiles) in float32 and float64, under THE accuracy rule against the
# float64 reference (testing/accuracy.py: within twice the textbook's own error in the dtype plus slack).
# A row of norm r <= eps = 1e-12 is normalised to x / eps, so its gradient is dA / eps: rounding of
# size 1e-16 in dA (in the reference as much as here) becomes 1e-4 in the gradient, and where dA is 0 in
# exact arithmetic no computation gets that 0. The rule is therefore applied to the gradients of
# normalised cases in the sphere's coordinates, g_i * max(||x_i||, eps) (the gradient with respect to
# the normalised row for every row of norm > eps; a positive factor per row).


def _plant(tensors: dict, kinds: list[str], g: torch.Generator) -> dict:
    out = {}
    for k, v in tensors.items():
        if v.dim() < 2:
            out[k] = v
            continue
        rows = v.reshape(-1, v.shape[-1]).clone()
        r = rows.shape[0]
        for kind in kinds:
            i = int(torch.randint(0, r, (1,), generator=g))
            if kind == "zero":
                rows[i] = 0
            elif kind == "tiny":  # norm 1e-15 .. 1e-12
                rows[i] = rows[i] / rows[i].norm().clamp_min(1e-30) * 10 ** float(-15 + 3 * torch.rand(1, generator=g))
            elif r > 1:  # a duplicate of another row
                j = (i + 1 + int(torch.randint(0, r - 1, (1,), generator=g))) % r
                rows[i] = rows[j]
        out[k] = rows.reshape(v.shape)
    return out


def _sphere(grads: dict, tensors: dict, normalized: bool) -> dict:
    if not normalized:
        return grads
    out = {}
    for k, gr in grads.items():
        x = tensors[k]
        out[k] = gr if gr is None or x.dim() < 2 else gr * x.double().norm(dim=-1, keepdim=True).clamp_min(1e-12).to(gr)
    return out


def check_degenerate(case, n: int, d: int, seed: int, kinds: list[str], dtype: torch.dtype, backend: str) -> None:
    """``case`` with ``kinds`` of rows planted, on ``backend`` in ``dtype``, under THE rule (gradients of
    normalised cases in the sphere's coordinates: see above). Raises AssertionError naming the output."""
    g = torch.Generator().manual_seed(seed)
    tensors, kwargs = make_inputs(case, n, d, seed)
    tensors = _plant(tensors, kinds, g)
    normalized = kwargs.get("normalize", True)
    rounded = {k: v.to(dtype).double() for k, v in tensors.items()}
    truth, tg = run(case, (rounded, kwargs), "reference", torch.float64)
    if dtype == torch.float64:
        same, sg = truth, tg
    else:
        with reference.computing_in(dtype):
            same, sg = run(case, (tensors, kwargs), "reference", dtype)
    got, gg = run(case, (tensors, kwargs), backend, dtype)
    tg, sg, gg = (_sphere(x, rounded, normalized) for x in (tg, sg, gg))
    ref = max(1.0, float(truth.double().abs().nan_to_num(posinf=0.0).max()))
    f_loss, f_grad = rounding_floor(tensors, kwargs)
    w, e, tol = check_output("loss", got, truth, same, dtype, ref=ref, floor=f_loss)
    assert e <= tol, f"{case.name} {kinds}: {w}"
    for k in tg:
        assert (gg[k] is None) == (tg[k] is None), k
        if tg[k] is not None:
            w, e, tol = check_output(f"grad {k}", gg[k], tg[k], sg[k], dtype, amp_of(tensors[k]), ref=ref,
                                     floor=0.0 if tensors[k].dim() == 0 else f_grad)
            assert e <= tol, f"{case.name} {kinds}: {w}"


@pytest.mark.parametrize("name", [c.name for c in CASES])
@settings(max_examples=20, deadline=None, derandomize=True)
@given(n=st.integers(2, 20), d=st.integers(1, 8),
       seed=st.integers(0, 2**16), kinds=st.lists(st.sampled_from(["zero", "tiny", "dup"]), min_size=1, max_size=4),
       tile=st.sampled_from(["3", "16", "1000000"]), dense=st.sampled_from(["0", "1"]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_degenerate_rows_match_the_reference(name, n, d, seed, kinds, tile, dense, dtype):
    import os

    os.environ["FUSED_CONTRASTIVE_TILE_ELEMENTS"] = tile
    os.environ["FUSED_CONTRASTIVE_DENSE"] = dense
    try:
        case = CASE_BY_NAME[name]
        check_degenerate(case, max(n, case.min_n), d, seed, kinds, dtype, "torch")
    finally:
        del os.environ["FUSED_CONTRASTIVE_TILE_ELEMENTS"], os.environ["FUSED_CONTRASTIVE_DENSE"]
