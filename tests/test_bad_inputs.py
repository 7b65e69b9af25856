"""The last bad inputs of issue 39, one test per probe: each raises at once with an error that names the
argument (or, for a valid but odd value, behaves as documented), instead of an inf / NaN loss, a
silently ignored option or an error at forward time."""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive import nn as fnn


def _r(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


Q, K = _r(6, 4, seed=1), _r(6, 4, seed=2)


# ---------------------------------------------------------------------------------------------
# info_nce: an explicit target equal to the excluded own column
# ---------------------------------------------------------------------------------------------


def test_info_nce_target_arange_without_keys_raises():
    # keys=None excludes each row's own column; target=arange(N) names exactly that column (loss inf)
    with pytest.raises(ValueError, match=r"target\[0\] = 0 is row 0's own column.*exclude_self=True"):
        fc.info_nce(Q, target=torch.arange(6))


def test_info_nce_target_on_the_own_column_with_exclude_self_raises():
    # row 0's target 0 is its own (excluded) column; the other rows' 0 is a real key
    with pytest.raises(ValueError, match=r"target\[0\] = 0 is row 0's own column"):
        fc.info_nce(Q, K, target=torch.zeros(6, dtype=torch.long), exclude_self=True)


def test_info_nce_target_elsewhere_and_ignored_rows_are_fine():
    # the check is exact: a target off the own column, and ignore_index rows, still run (finite)
    t = (torch.arange(6) + 1) % 6
    assert torch.isfinite(fc.info_nce(Q, target=t))
    t2 = torch.tensor([-100, 0, 0, 0, 0, 0])  # row 0 ignored, the others point at key 0 (not their own)
    assert torch.isfinite(fc.info_nce(Q, K, target=t2, exclude_self=True))


# ---------------------------------------------------------------------------------------------
# supcon_loss: a mask that is not finite
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_supcon_mask_not_finite_raises(bad):
    m = torch.eye(6)
    m[2, 3] = bad
    with pytest.raises(ValueError, match=r"mask must be finite .*mask\[2, 3\]"):
        fc.supcon_loss(_r(6, 2, 4), mask=m)


# ---------------------------------------------------------------------------------------------
# options that would be ignored
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["info_nce", "simcse_loss", "simcse_sup_loss"])
def test_guide_margin_without_guide_raises(fn):
    args = (Q, K) if fn != "simcse_loss" else (Q,)
    with pytest.raises(ValueError, match=r"guide_margin=0\.1 has no effect without guide="):
        getattr(fc, fn)(*args, guide_margin=0.1)


@pytest.mark.parametrize("fn", ["info_nce", "simcse_loss", "simcse_sup_loss"])
def test_guide_margin_strategy_without_guide_raises(fn):
    args = (Q, K) if fn != "simcse_loss" else (Q,)
    bogus = r"guide_margin_strategy must be one of \('absolute', 'relative'\), got 'bogus'"
    with pytest.raises(ValueError, match=bogus):
        getattr(fc, fn)(*args, guide_margin_strategy="bogus")
    with pytest.raises(ValueError, match=r"guide_margin_strategy='relative' has no effect without guide="):
        getattr(fc, fn)(*args, guide_margin_strategy="relative")


def test_hard_negative_weight_without_negatives_raises():
    with pytest.raises(ValueError, match=r"hard_negative_weight=1 needs negative"):
        fc.simcse_sup_loss(Q, K, hard_negative_weight=1)
    # with negatives it is the documented option
    assert torch.isfinite(fc.simcse_sup_loss(Q, K, _r(6, 4, seed=3), hard_negative_weight=1))


# ---------------------------------------------------------------------------------------------
# against the documented types
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_temperature_tensor_must_be_0_dim(shape):
    with pytest.raises(ValueError, match=r"temperature must be a float or a 0-dim tensor, got shape"):
        fc.info_nce(Q, K, temperature=torch.full(shape, 0.1))
    assert fc.info_nce(Q, K, temperature=torch.tensor(0.1)).shape == ()


def test_mixed_float64_dtypes_raise_naming_both():
    with pytest.raises(TypeError, match=r"query is torch.float64 but keys is torch.float32"):
        fc.info_nce(Q.double(), K)
    with pytest.raises(TypeError, match=r"query is torch.float32 but keys is torch.float64"):
        fc.info_nce(Q, K.double())
    # 16 / 32-bit mixes (autocast outputs beside float32 rows) compute in float32, as documented
    assert fc.info_nce(Q.half(), K).dtype == torch.float32


@pytest.mark.parametrize("keys", [False, True])
def test_bool_ids_raise(keys):
    ids = torch.tensor([True, False, True, False, True, False])
    with pytest.raises(TypeError, match=r"ids.* must hold integer ids .*got torch.bool"):
        if keys:
            fc.info_nce(Q, K, ids=(ids, ids))
        else:
            fc.info_nce(Q, target=(torch.arange(6) + 1) % 6, ids=ids)


# ---------------------------------------------------------------------------------------------
# module constructors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["InfoNCELoss", "GISTLoss", "CLIPLoss", "SigLIPLoss", "SupConLoss", "DCLLoss"])
def test_module_backend_typo_fails_at_construction(cls):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton', 'reference'\), got 'x'"):
        getattr(fnn, cls)(backend="x")


@pytest.mark.parametrize("kw,err,msg", [
    (dict(backend="cuda"), ValueError, r"backend must be one of"),
    (dict(reduction="avg"), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
    (dict(gather="yes"), TypeError, r"gather must be False, True or a torch.distributed ProcessGroup, got str"),
    (dict(normalize=1), TypeError, r"normalize must be a bool, got int"),
])
def test_siglip_module_checks_its_options_at_construction(kw, err, msg):
    with pytest.raises(err, match=msg):
        fnn.SigLIPLoss(**kw)


@pytest.mark.parametrize("cls,fn", [("DCLLoss", "dcl_loss"), ("DCLWLoss", "dclw_loss")])
def test_dcl_modules_take_the_temperature_by_position(cls, fn):
    m = getattr(fnn, cls)(0.3)
    assert m.kw["temperature"] == 0.3
    torch.testing.assert_close(m(Q, K), getattr(fc, fn)(Q, K, temperature=0.3))
    with pytest.raises(TypeError, match=rf"{cls}: too many positional arguments \(by position it takes temperature"):
        getattr(fnn, cls)(0.3, 0.5)


# ---------------------------------------------------------------------------------------------
# CachedGISTEmbedLoss(mini_batch_size=...)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,err,msg", [
    (0, ValueError, r"mini_batch_size must be >= 1, got 0"),
    (-4, ValueError, r"mini_batch_size must be >= 1, got -4"),
    (2.5, TypeError, r"mini_batch_size must be an int, got float"),
    (True, TypeError, r"mini_batch_size must be an int, got bool"),
])
def test_cached_gist_mini_batch_size_fails_at_construction(tmp_path, bad, err, msg):
    pytest.importorskip("sentence_transformers")
    from fused_contrastive.bench.st_step import build_tiny_model, load_model
    from fused_contrastive.integrations import sentence_transformers as fused

    model = load_model(build_tiny_model(str(tmp_path / "m")))
    with pytest.raises(err, match=msg):
        fused.CachedGISTEmbedLoss(model, model, mini_batch_size=bad)
