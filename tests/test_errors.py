"""Bad input raises ValueError / TypeError whose message names the offending argument (the argument
the user passed: ``logit_scale`` for clip_loss, not an internal name)."""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc

X = torch.randn(6, 4)
Y = torch.randn(6, 4)
F3 = torch.randn(6, 2, 4)
LAB = torch.tensor([0, 0, 1, 1, 2, 2])

CASES = [
    ("mismatched D", lambda: fc.info_nce(X, torch.randn(6, 5)), ValueError, "keys"),
    ("target float", lambda: fc.info_nce(X, Y, torch.zeros(6)), TypeError, "target"),
    ("target range", lambda: fc.info_nce(X, Y, torch.tensor([0, 1, 2, 3, 4, 6])), ValueError, "target"),
    ("target negative", lambda: fc.info_nce(X, Y, torch.tensor([0, 1, 2, 3, 4, -3])), ValueError, "target"),
    ("target length", lambda: fc.info_nce(X, Y, torch.arange(5)), ValueError, "target"),
    ("target self", lambda: fc.info_nce(X), ValueError, "target"),
    ("labels length", lambda: fc.supcon_loss(F3, torch.arange(5)), ValueError, "labels"),
    ("labels float", lambda: fc.supcon_loss(F3, torch.zeros(6)), TypeError, "labels"),
    ("labels and mask", lambda: fc.supcon_loss(F3, LAB, torch.eye(6)), ValueError, "mask"),
    ("mask shape", lambda: fc.supcon_loss(F3, mask=torch.eye(5)), ValueError, "mask"),
    ("temperature 0", lambda: fc.info_nce(X, Y, temperature=0.0), ValueError, "temperature"),
    ("temperature < 0", lambda: fc.supcon_loss(F3, LAB, temperature=-1.0), ValueError, "temperature"),
    ("temperature nan", lambda: fc.simcse_loss(X, temperature=float("nan")), ValueError, "temperature"),
    ("temperature inf", lambda: fc.dscl_loss(F3, LAB, temperature=float("inf")), ValueError, "temperature"),
    ("temperature tensor 0", lambda: fc.info_nce(X, Y, temperature=torch.tensor(0.0)), ValueError, "temperature"),
    ("temperature str", lambda: fc.info_nce(X, Y, temperature="0.1"), TypeError, "temperature"),
    ("scale and temperature", lambda: fc.info_nce(X, Y, temperature=0.1, scale=10.0), ValueError, "scale"),
    ("scale <= 0", lambda: fc.clip_loss(X, Y, -1.0), ValueError, "scale"),
    ("cosent scale", lambda: fc.cosent_loss(X, Y, torch.arange(6).float(), scale=0.0), ValueError, "scale"),
    ("empty batch", lambda: fc.info_nce(torch.randn(0, 4), Y), ValueError, "query"),
    ("empty keys", lambda: fc.info_nce(X, torch.randn(0, 4)), ValueError, "keys"),
    ("empty features", lambda: fc.supcon_loss(torch.randn(0, 2, 4)), ValueError, "features"),
    ("empty D", lambda: fc.info_nce(torch.randn(6, 0), torch.randn(6, 0)), ValueError, "query"),
    ("integer embeddings", lambda: fc.info_nce(torch.ones(6, 4, dtype=torch.long), Y), TypeError, "query"),
    ("integer cosent u", lambda: fc.cosent_loss(torch.ones(6, 4, dtype=torch.int32), Y, LAB), TypeError, "u"),
    ("1-d query", lambda: fc.info_nce(torch.randn(6), Y), ValueError, "query"),
    ("not a tensor", lambda: fc.info_nce([[1.0]], Y), TypeError, "query"),
    ("different devices", lambda: fc.info_nce(X, torch.randn(6, 4, device="meta")), ValueError, "keys"),
    ("target other device", lambda: fc.info_nce(X, Y, torch.arange(6, device="meta")), ValueError, "target"),
    ("labels other device", lambda: fc.supcon_loss(F3, torch.arange(6, device="meta")), ValueError, "labels"),
    ("bad reduction", lambda: fc.info_nce(X, Y, reduction="avg"), ValueError, "reduction"),
    ("bad backend", lambda: fc.info_nce(X, Y, backend="cuda"), ValueError, "backend"),
    ("symmetric target", lambda: fc.info_nce(X, Y, torch.arange(6), symmetric=True), ValueError, "target"),
    ("symmetric N != M", lambda: fc.info_nce(X, torch.randn(5, 4), symmetric=True), ValueError, "symmetric"),
    ("simcse odd", lambda: fc.simcse_loss(torch.randn(5, 4)), ValueError, "z1"),
    ("simcse z2 shape", lambda: fc.simcse_loss(X, torch.randn(5, 4)), ValueError, "z2"),
    ("simcse_sup triplets", lambda: fc.simcse_sup_loss(torch.randn(7, 4)), ValueError, "anchor"),
    ("simcse_sup negative shape", lambda: fc.simcse_sup_loss(X, Y, torch.randn(5, 4)), ValueError, "negative"),
    ("contrast_mode", lambda: fc.supcon_loss(F3, LAB, contrast_mode="two"), ValueError, "contrast_mode"),
    ("variant", lambda: fc.supcon_loss(F3, LAB, variant="mid"), ValueError, "variant"),
    ("queue labels missing", lambda: fc.supcon_loss(F3, LAB, queue=torch.randn(3, 4)), ValueError, "queue_labels"),
    ("queue D", lambda: fc.supcon_loss(F3, LAB, queue=torch.randn(3, 5), queue_labels=torch.arange(3)),
     ValueError, "queue"),
    ("queue with mask", lambda: fc.supcon_loss(F3, mask=torch.eye(6), queue=torch.randn(3, 4)), ValueError, "queue"),
    ("dscl views", lambda: fc.dscl_loss(torch.randn(6, 3, 4), LAB), ValueError, "features"),
    ("dscl beta", lambda: fc.dscl_loss(F3, LAB, beta=-1.0), ValueError, "beta"),
    ("dscl labels None", lambda: fc.dscl_loss(F3, None), ValueError, "labels"),
    ("cosent labels length", lambda: fc.cosent_loss(X, Y, torch.arange(5)), ValueError, "labels"),
    ("cosent v shape", lambda: fc.cosent_loss(X, torch.randn(6, 3), LAB), ValueError, "v"),
    ("cosent triton float64", lambda: fc.cosent_loss(X.double(), Y.double(), LAB, backend="triton"), TypeError,
     "float64"),
    ("cosent scores triton float64",
     lambda: fc.cosent_loss_from_scores(X[:, 0].double(), LAB, backend="triton"), TypeError, "float64"),
    # traps of the first release: each error names the argument the user passed
    ("clip logit_scale 0", lambda: fc.clip_loss(X, Y, 0.0), ValueError, "logit_scale"),
    ("clip logit_scale str", lambda: fc.clip_loss(X, Y, "2"), TypeError, "logit_scale"),
    ("clip row mismatch", lambda: fc.clip_loss(X, torch.randn(5, 4), 10.0), ValueError, "b must have as many rows"),
    ("supcon 1-d features", lambda: fc.supcon_loss(torch.randn(8)), ValueError, "[bsz, n_views, D] or [bsz, D]"),
    ("supcon one view no labels", lambda: fc.supcon_loss(torch.randn(8, 16)), ValueError, "labels or mask"),
    ("supcon one view mode one", lambda: fc.supcon_loss(torch.randn(8, 1, 16), contrast_mode="one"), ValueError,
     "features"),
    ("supcon base_temperature 0", lambda: fc.supcon_loss(F3, LAB, base_temperature=0.0), ValueError,
     "base_temperature"),
    ("supcon base_temperature str", lambda: fc.supcon_loss(F3, LAB, base_temperature="a"), TypeError,
     "base_temperature"),
    ("supcon negative mask", lambda: fc.supcon_loss(F3, mask=-torch.eye(6)), ValueError, "mask"),
    ("dscl base_temperature", lambda: fc.dscl_loss(F3, LAB, base_temperature=-1.0), ValueError, "base_temperature"),
    ("hard_negative_weight nan", lambda: fc.simcse_sup_loss(X, Y, X, hard_negative_weight=float("nan")),
     ValueError, "hard_negative_weight"),
    ("exclude_self not bool", lambda: fc.info_nce(X, Y, exclude_self=1), TypeError, "exclude_self"),
    ("normalize not bool", lambda: fc.simcse_loss(X, normalize="yes"), TypeError, "normalize"),
    ("ignore_index float", lambda: fc.info_nce(X, Y, ignore_index=-1.0), TypeError, "ignore_index"),
    ("backend not str", lambda: fc.info_nce(X, Y, backend=None), ValueError, "backend"),
    ("temperature 2-d tensor", lambda: fc.info_nce(X, Y, temperature=torch.ones(2, 2)), ValueError, "temperature"),
    ("temperature int tensor", lambda: fc.info_nce(X, Y, temperature=torch.tensor(1)), TypeError, "temperature"),
    ("cosent complex labels", lambda: fc.cosent_loss(X, Y, torch.zeros(6, dtype=torch.complex64)), TypeError,
     "labels"),
]


@pytest.mark.parametrize("what,call,exc,arg", CASES, ids=[c[0] for c in CASES])
def test_bad_input(what, call, exc, arg):
    with pytest.raises(exc) as info:
        call()
    assert arg in str(info.value), f"message does not name {arg!r}: {info.value}"


def test_tensor_base_temperature_is_accepted_and_differentiable():
    bt = torch.tensor(0.2, requires_grad=True)
    fc.supcon_loss(F3, LAB, base_temperature=bt, backend="torch").backward()
    assert bt.grad is not None and torch.isfinite(bt.grad)


def test_info_nce_default_target_needs_its_key_and_must_not_exclude_it():
    # issue 24 item 5: a raw IndexError / RuntimeError, and a silent inf, before
    q, k = torch.randn(5, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"fewer keys \(3\) than queries \(5\)"):
        fc.info_nce(q, k)
    with pytest.raises(ValueError, match="exclude_self=True with keys and target=None"):
        fc.info_nce(q, torch.randn(5, 4), exclude_self=True)
    # an explicit target into the smaller key set is fine and equals the textbook formula
    t = torch.tensor([0, 1, 2, 0, 1])
    want = torch.nn.functional.cross_entropy(
        torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(k, dim=1).T / 0.05, t)
    torch.testing.assert_close(fc.info_nce(q, k, t), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value,match", [("abc", "FUSED_CONTRASTIVE_TILE_ELEMENTS.*positive integer"),
                                         ("0", "FUSED_CONTRASTIVE_TILE_ELEMENTS.*>= 1"),
                                         ("-5", "FUSED_CONTRASTIVE_TILE_ELEMENTS.*>= 1")])
def test_tile_elements_environment_variable_is_validated(monkeypatch, value, match):
    monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", value)
    with pytest.raises(ValueError, match=match):
        fc.info_nce(torch.randn(4, 3), torch.randn(4, 3), backend="torch")


def test_encode_in_chunks_of_an_empty_batch_names_it():
    enc = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="batch has 0 rows"):
        fc.encode_in_chunks(enc, torch.randn(0, 3), 2)
