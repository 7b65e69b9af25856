"""The cached sentence-transformers drop-ins never hold more than the class they replace: the live tensor
bytes of one training step (forward and backward, ``bench.memory.LiveBytes``: deterministic, every ATen
op's new storages until they die) of ours against sentence-transformers' own class on the same tiny BERT
and batch: the cached MNRL, the symmetric one, MatryoshkaLoss around the cached MNRL, and the cached
multi-vector MNRL. A planted extra copy of the embeddings (one [B, D] tensor per column kept through the
step), the loss run without the mini-batch tile budget (the drop-ins before issue 60: 2^21-element
tiles) and, for the multi-vector loss, the whole batch in one fused call make the comparison fail."""

from __future__ import annotations

import contextlib
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

st = pytest.importorskip("sentence_transformers",
                         reason="optional peer: pip install '/path/to/fused-contrastive[sentence-transformers]'")

from sentence_transformers.sentence_transformer import losses as peer  # noqa: E402

from fused_contrastive.bench.memory import LiveBytes  # noqa: E402
from fused_contrastive.bench.st_step import build_tiny_model, load_model, sentences  # noqa: E402
from fused_contrastive.integrations import sentence_transformers as fused  # noqa: E402

B, HIDDEN, MINI = 256, 64, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(str(tmp_path_factory.mktemp("tiny_bert")), hidden=HIDDEN, layers=1)
    return load_model(path).eval()


@pytest.fixture(scope="module")
def columns(model):
    return [model.preprocess(sentences(B, 6, seed=s)) for s in (1, 2)]


def _loss(lib, kind: str, model):
    if kind == "mnrl":
        return lib.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI)
    if kind == "symmetric":
        return lib.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=MINI)
    return lib.MatryoshkaLoss(model, lib.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI),
                              [HIDDEN, HIDDEN // 2])


def _step(model, loss, columns) -> tuple[int, float]:
    """(peak live bytes, loss value) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    with LiveBytes() as m:
        out = loss([dict(f) for f in columns], None)
        out.backward()
    return m.peak, float(out.detach())


@pytest.fixture(scope="module")
def theirs(model, columns):
    with warnings.catch_warnings():  # their symmetric class is deprecated
        warnings.simplefilter("ignore")
        return {k: _step(model, _loss(peer, k, model), columns) for k in ("mnrl", "symmetric", "matryoshka")}


@pytest.mark.parametrize("kind", ["mnrl", "symmetric", "matryoshka"])
def test_cached_drop_in_holds_no_more_than_theirs(model, columns, theirs, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = _loss(fused, kind, model)
    ours, value = _step(model, loss, columns)
    their_peak, their_value = theirs[kind]
    assert value == pytest.approx(their_value, rel=1e-5)  # the same step (float32)
    assert their_peak > B * HIDDEN * 4  # the meter saw their step: more than one [B, D] float32 column
    assert ours <= their_peak, f"ours {ours} B > theirs {their_peak} B"


def test_a_planted_extra_copy_fails_the_comparison(model, columns, theirs, monkeypatch):
    kept = []
    real = fused._embed_cached

    def with_copy(*args, **kwargs):  # a [B, D] copy of each column held through the step
        out = real(*args, **kwargs)
        kept.append(out.detach().clone())
        return out

    monkeypatch.setattr(fused, "_embed_cached", with_copy)
    ours, _ = _step(model, _loss(fused, "mnrl", model), columns)
    assert len(kept) == 2
    assert ours > theirs["mnrl"][0], (ours, theirs["mnrl"][0])


@pytest.mark.parametrize("kind", ["mnrl", "matryoshka"])
def test_the_loss_without_the_mini_batch_tiles_fails_the_comparison(model, columns, theirs, monkeypatch, kind):
    # the drop-ins before issue 60: the loss's default tiles (up to 2^21 elements, several alive)
    monkeypatch.setattr(fused, "_mini_batch_tiles", lambda rows, cols: contextlib.nullcontext())
    ours, _ = _step(model, _loss(fused, kind, model), columns)
    assert ours > theirs[kind][0], (ours, theirs[kind][0])


def test_mini_batch_tiles_sets_and_restores_the_budget(monkeypatch):
    from fused_contrastive.core import tile_elements

    monkeypatch.delenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", raising=False)
    default = tile_elements()
    with fused._mini_batch_tiles(16, 300):
        assert tile_elements() == 16 * 300
    assert tile_elements() == default and "FUSED_CONTRASTIVE_TILE_ELEMENTS" not in os.environ
    monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", "1000")  # a smaller budget of the user's is kept
    with fused._mini_batch_tiles(16, 300):
        assert tile_elements() == 1000
    with fused._mini_batch_tiles(2, 300):
        assert tile_elements() == 600
    assert os.environ["FUSED_CONTRASTIVE_TILE_ELEMENTS"] == "1000"


# ------------------------------------------------------------------------------------------------
# the cached multi-vector (late interaction) MNRL
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_vector(tmp_path_factory):
    """(tiny MultiVectorEncoder, its two columns of B sentences): their modules, 16-dim unit tokens."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    path = build_tiny_model(str(tmp_path_factory.mktemp("tiny_bert_mv")), hidden=32, layers=1)
    torch.manual_seed(0)
    enc = Transformer(path)
    dense = Dense(in_features=enc.get_embedding_dimension(), out_features=16, bias=False,
                  activation_function=torch.nn.Identity(), module_input_name="token_embeddings")
    model = MultiVectorEncoder(modules=[enc, dense, MultiVectorMask(skiplist_words=[]),
                                        Normalize(module_input_name="token_embeddings")], device="cpu").eval()
    return model, [model.preprocess(sentences(B, 6, seed=s)) for s in (1, 2)]


def test_cached_multi_vector_holds_no_more_than_theirs(multi_vector):
    from sentence_transformers.multi_vector_encoder import losses as mv_peer

    from fused_contrastive.integrations import sentence_transformers_multi_vector as mv

    model, cols = multi_vector
    their_peak, their_value = _step(model, mv_peer.CachedMultiVectorMultipleNegativesRankingLoss(model), cols)
    ours, value = _step(model, mv.CachedMultiVectorMultipleNegativesRankingLoss(model), cols)
    assert value == pytest.approx(their_value, rel=1e-5)
    assert ours <= their_peak, f"ours {ours} B > theirs {their_peak} B"
    # the whole batch in one fused call (the drop-in before issue 60): its [B, Lq, B] argmax indices
    one = mv.CachedMultiVectorMultipleNegativesRankingLoss(model, score_mini_batch_size=B)
    assert _step(model, one, cols)[0] > their_peak
