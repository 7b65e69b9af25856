"""The drop-ins reject what their peers reject, as their peers do: for every constructor option that
sentence-transformers' or open_clip's class refuses, the drop-in raises the same exception type with
the same message text, at construction, so that code and tests written against the peer
(``pytest.raises(ValueError, match=...)``, ``except ValueError``) keep working after the import swap.

Each case runs the peer's class first (it must reject the option: a case that stops being an error
there fails here, so the list follows the peer) and then ours. Where this library checks more than the
peer (e.g. a repeated Matryoshka dimension), that is tested in the integration tests, not here.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

st = pytest.importorskip("sentence_transformers",
                         reason="optional peer: pip install '/path/to/fused-contrastive[sentence-transformers]'")

from sentence_transformers.sentence_transformer import losses as peer  # noqa: E402

from fused_contrastive.bench.st_step import build_tiny_model, load_model  # noqa: E402
from fused_contrastive.integrations import open_clip as fo  # noqa: E402
from fused_contrastive.integrations import sentence_transformers as fused  # noqa: E402
from tests._peers import open_clip_loss  # noqa: E402


def _raised(build) -> BaseException | None:
    try:
        build()
    except Exception as e:  # noqa: BLE001 - the exception is what is compared
        return e
    return None


def assert_same_rejection(theirs, ours) -> BaseException:
    """``theirs()`` raises; ``ours()`` raises an exception of the same type (or a subclass) with the same
    message."""
    t = _raised(theirs)
    assert t is not None, "the peer accepts this option (the case is out of date)"
    o = _raised(ours)
    assert o is not None, f"the peer raises {type(t).__name__}({str(t)!r}); the drop-in accepts the option"
    assert isinstance(o, type(t)), f"peer: {type(t).__name__}({t}); drop-in: {type(o).__name__}({o})"
    assert str(o) == str(t), f"peer: {str(t)!r}\ndrop-in: {str(o)!r}"
    return t


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_model(str(tmp_path_factory.mktemp("tiny_bert")), hidden=16, layers=1))


def _static_model(router: bool):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Router, StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    def static():
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return StaticEmbedding(tok, embedding_dim=4)

    first = Router.for_query_document(query_modules=[static()], document_modules=[static()]) if router else static()
    return SentenceTransformer(modules=[first], device="cpu")


#: constructor options that sentence-transformers' MultipleNegativesRankingLoss rejects (and so their
#: CachedMultipleNegativesRankingLoss, which builds one)
MNRL_BAD = {
    "scale=-1": dict(scale=-1),
    "scale=0": dict(scale=0.0),
    "scale=-tensor": dict(scale=torch.tensor(-2.0)),
    "scale=str": dict(scale="20"),
    "scale=None": dict(scale=None),
    "directions=()": dict(directions=()),
    "directions=[]": dict(directions=[]),
    "directions=''": dict(directions=""),
    "directions=unknown": dict(directions=("query_to_doc", "doc_to_docs")),
    "directions=str": dict(directions="query_to_doc"),
    "directions=int": dict(directions=3),
    "directions=no_query_to_doc": dict(directions=("doc_to_query",)),
    "partition_mode=separate": dict(partition_mode="separate"),
    "partition_mode=None": dict(partition_mode=None),
    "per_direction+query_to_query": dict(directions=("query_to_doc", "query_to_query"), partition_mode="per_direction"),
    "per_direction+doc_to_doc": dict(directions=("query_to_doc", "doc_to_doc"), partition_mode="per_direction"),
    "hardness_mode=hardest": dict(hardness_mode="hardest"),
    "hardness_strength=-1": dict(hardness_mode="hard_negatives", hardness_strength=-1.0),
    "hardness_strength=str": dict(hardness_strength="1"),
    # two bad options: the first one theirs checks is the one named
    "scale+directions": dict(scale=-1, directions=()),
    "directions+partition_mode": dict(directions=("doc_to_query",), partition_mode="separate"),
    "partition_mode+hardness_mode": dict(partition_mode="separate", hardness_mode="hardest"),
}

CACHED_BAD = {
    "mini_batch_num_tokens=0": dict(mini_batch_num_tokens=0),
    "mini_batch_num_tokens=-3": dict(mini_batch_num_tokens=-3),
    "mini_batch_num_tokens=str": dict(mini_batch_num_tokens="64"),
    "mini_batch_num_tokens+scale": dict(mini_batch_num_tokens=0, scale=-1),  # theirs checks the tokens first
}


@pytest.mark.parametrize("kw", MNRL_BAD.values(), ids=MNRL_BAD.keys())
@pytest.mark.parametrize("cls", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_mnrl_options(model, cls, kw):
    assert_same_rejection(lambda: getattr(peer, cls)(model, **kw), lambda: getattr(fused, cls)(model, **kw))


@pytest.mark.parametrize("kw", CACHED_BAD.values(), ids=CACHED_BAD.keys())
@pytest.mark.parametrize("cls", ["CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"])
def test_cached_options(model, cls, kw):
    assert_same_rejection(lambda: getattr(peer, cls)(model, **kw), lambda: getattr(fused, cls)(model, **kw))


@pytest.mark.parametrize("kw", [dict(scale=-1), dict(scale=0), dict(scale="20")], ids=["-1", "0", "str"])
@pytest.mark.parametrize("cls", ["MultipleNegativesSymmetricRankingLoss",
                                 "CachedMultipleNegativesSymmetricRankingLoss"])
def test_symmetric_scale(model, cls, kw):
    assert_same_rejection(lambda: getattr(peer, cls)(model, **kw), lambda: getattr(fused, cls)(model, **kw))


@pytest.mark.parametrize("router", [False, True], ids=["static", "router_of_static"])
@pytest.mark.parametrize("cls", ["CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"])
def test_cached_rejects_a_static_embedding_model(cls, router):
    m = _static_model(router)
    assert_same_rejection(lambda: getattr(peer, cls)(m), lambda: getattr(fused, cls)(m))
    # the model is checked before the other options, as theirs does
    assert_same_rejection(lambda: getattr(peer, cls)(m, mini_batch_num_tokens=0, scale=-1),
                          lambda: getattr(fused, cls)(m, mini_batch_num_tokens=0, scale=-1))


#: MatryoshkaLoss's rejections (the tiny model's embedding dimension is 16)
MATRYOSHKA_BAD = {
    "dims=[]": dict(matryoshka_dims=[]),
    "dims=None": dict(matryoshka_dims=None),
    "dims<=0": dict(matryoshka_dims=[16, 0]),
    "dims<0": dict(matryoshka_dims=[-4, 16]),
    "weights_length": dict(matryoshka_dims=[16, 8], matryoshka_weights=[1.0]),
    "dims>model": dict(matryoshka_dims=[32, 16]),
    # theirs accepts a repeated dimension; with another bad option theirs names that one
    "repeated+weights_length": dict(matryoshka_dims=[8, 8], matryoshka_weights=[1.0]),
    "repeated+dims>model": dict(matryoshka_dims=[8, 8, 32]),
}


@pytest.mark.parametrize("kw", MATRYOSHKA_BAD.values(), ids=MATRYOSHKA_BAD.keys())
def test_matryoshka_options(model, kw):
    assert_same_rejection(lambda: peer.MatryoshkaLoss(model, peer.MultipleNegativesRankingLoss(model), **kw),
                          lambda: fused.MatryoshkaLoss(model, fused.MultipleNegativesRankingLoss(model), **kw))


def test_accepted_options_stay_accepted(model):
    """The reordered checks reject nothing that theirs accepts (and that the drop-ins supported)."""
    for kw in (dict(scale=torch.tensor(20.0)), dict(directions=["query_to_doc", "doc_to_query"]),
               dict(directions=("query_to_doc", "query_to_query")), dict(hardness_mode="all_negatives",
                                                                          hardness_strength=2)):
        peer.MultipleNegativesRankingLoss(model, **kw)
        fused.MultipleNegativesRankingLoss(model, **kw)
    fused.CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=None)
    fused.CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=64)


# ----------------------------------------------------------------------------------------------
# open_clip (its loss.py loaded by path: ``import open_clip`` needs torchvision)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dist_impl", ["ring", "BIDIR", 3])
def test_siglip_dist_impl(dist_impl):
    oc = open_clip_loss()
    if oc is None:
        pytest.skip("open-clip-torch is not installed (pip install --no-deps open-clip-torch)")
    t = _raised(lambda: oc.SigLipLoss(dist_impl=dist_impl))
    # theirs asserts with no message: ours is an AssertionError too, with a message naming the option
    # (and a ValueError, as it was)
    assert type(t) is AssertionError and str(t) == ""
    o = _raised(lambda: fo.SigLipLoss(dist_impl=dist_impl))
    assert isinstance(o, AssertionError) and isinstance(o, ValueError) and "dist_impl" in str(o), repr(o)


@pytest.mark.parametrize("dist_impl", [None, "", "bidir", "shift", "reduce", "gather"])
def test_siglip_dist_impl_accepted_as_theirs(dist_impl):
    oc = open_clip_loss()
    if oc is None:
        pytest.skip("open-clip-torch is not installed (pip install --no-deps open-clip-torch)")
    assert fo.SigLipLoss(dist_impl=dist_impl).dist_impl == oc.SigLipLoss(dist_impl=dist_impl).dist_impl


def test_clip_loss_constructor_rejects_nothing_of_theirs():
    """open_clip's ClipLoss checks no option at construction: nothing to match there (the drop-in's own
    refusals, e.g. ``use_horovod=True``, are tested in tests/test_integration_open_clip.py)."""
    oc = open_clip_loss()
    if oc is None:
        pytest.skip("open-clip-torch is not installed (pip install --no-deps open-clip-torch)")
    import inspect

    src = inspect.getsource(oc.ClipLoss.__init__)
    assert "raise" not in src and "assert" not in src
