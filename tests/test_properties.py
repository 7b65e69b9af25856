"""Property tests (hypothesis): torch backend == reference over random shapes, labels and options.

In float64, so that the comparison tests the math (float32 rounding noise is covered, with
dtype-aware tolerances, in test_losses.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fused_contrastive as fc
from fused_contrastive.testing import assert_close, loss_and_grads

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
