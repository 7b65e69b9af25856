"""fused_contrastive.integrations.sentence_transformers.MatryoshkaLoss against sentence-transformers' own
``MatryoshkaLoss`` on a real tiny BERT built offline (float64, eval mode): loss and every parameter
gradient equal to 1e-10 over (Cached)MultipleNegativesRankingLoss, the symmetric ones and CoSENT, with
weights, unsorted dims, ``n_dims_per_step`` sampling (same ``random`` stream) and hard-negative columns;
an inner loss that is not this library's runs theirs (warned); their constructor's errors."""

from __future__ import annotations

import os
import random
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

st = pytest.importorskip("sentence_transformers",
                         reason="optional peer: pip install '/path/to/fused-contrastive[sentence-transformers]'")

from sentence_transformers import util
from sentence_transformers.sentence_transformer import losses as peer

from fused_contrastive.bench.st_step import build_tiny_model, load_model
from fused_contrastive.integrations import sentence_transformers as fused

B = 6
TOL = dict(rtol=1e-10, atol=1e-10)


def _sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 90, (int(torch.randint(1, 7, (1,), generator=g)),),
                                                          generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_model(str(tmp_path_factory.mktemp("tiny_bert")))).double().eval()


@pytest.fixture(scope="module")
def columns(model):
    return [model.preprocess(_sentences(B, seed)) for seed in (11, 12, 13)]


def _run(model, loss, feats, labels=None, seed=5):
    random.seed(seed)
    model.zero_grad(set_to_none=True)
    out = loss([dict(f) for f in feats], labels)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(model, theirs, ours, feats, labels=None):
    a, ga = _run(model, theirs, feats, labels)
    b, gb = _run(model, ours, feats, labels)
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(b, a, **TOL)
    assert ga.keys() == gb.keys() and len(ga) > 20
    assert max(g.abs().max() for g in ga.values()) > 1e-4
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def _dims(model):
    d = model.get_embedding_dimension()
    return [d // 4, d, 5, d // 2]  # unsorted, one level off any power of two


INNER = {
    "MultipleNegativesRankingLoss": {},
    "MultipleNegativesRankingLoss-dot": dict(similarity_fct=util.dot_score, scale=0.5),
    "MultipleNegativesSymmetricRankingLoss": {},
    "CachedMultipleNegativesRankingLoss": dict(mini_batch_size=2),
    "CachedMultipleNegativesSymmetricRankingLoss": dict(mini_batch_size=4),
    "MultipleNegativesRankingLoss-q2q": dict(directions=("query_to_doc", "query_to_query")),
}


@pytest.mark.parametrize("n_dims_per_step", [-1, 2])
@pytest.mark.parametrize("ncols", [2, 3], ids=["pairs", "triplets"])
@pytest.mark.parametrize("inner", list(INNER))
def test_matryoshka_over_mnrl_equals_theirs(model, columns, inner, ncols, n_dims_per_step):
    name = inner.split("-")[0]
    kw = INNER[inner]
    dims, weights = _dims(model), [1.0, 0.5, 2.0, 0.25]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        theirs = peer.MatryoshkaLoss(model, getattr(peer, name)(model, **kw), dims, weights,
                                     n_dims_per_step=n_dims_per_step)
    ours = fused.MatryoshkaLoss(model, getattr(fused, name)(model, **kw), dims, weights,
                                n_dims_per_step=n_dims_per_step)
    assert ours.matryoshka_dims == theirs.matryoshka_dims
    assert ours.matryoshka_weights == theirs.matryoshka_weights
    _same(model, theirs, ours, columns[:ncols])


@pytest.mark.parametrize("sim", ["cos", "dot"])
def test_matryoshka_over_cosent_equals_theirs(model, columns, sim):
    kw = {} if sim == "cos" else dict(similarity_fct=util.pairwise_dot_score, scale=2.0)
    labels = torch.tensor([0.1, 0.9, 0.4, 0.4, 0.7, 0.0], dtype=torch.float64)
    dims = _dims(model)
    theirs = peer.MatryoshkaLoss(model, peer.CoSENTLoss(model, **kw), dims)
    ours = fused.MatryoshkaLoss(model, fused.CoSENTLoss(model, **kw), dims)
    _same(model, theirs, ours, columns[:2], labels)


def test_the_one_pass_route_runs_once_per_step(model, columns, monkeypatch):
    # the fused inner MNRL computes every level in one core-op call on the embeddings of one forward
    from fused_contrastive import core

    calls = []
    orig = core.run

    def spy(*a, **k):
        calls.append(k.get("levels"))
        return orig(*a, **k)

    monkeypatch.setattr(core, "run", spy)
    dims = _dims(model)
    forwards = []
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        inner = fused.MultipleNegativesRankingLoss(model)
        inner([dict(f) for f in columns[:2]], None)
        plain = len(forwards)
        fused.MatryoshkaLoss(model, inner, dims)([dict(f) for f in columns[:2]], None)
    finally:
        hook.remove()
    assert calls[0] is None and len(calls) == 2 and calls[1][0] == tuple(sorted(dims))
    assert len(forwards) == 2 * plain  # the columns embedded as often as the plain loss does


def test_another_inner_loss_runs_theirs_with_a_warning(model, columns):
    dims = _dims(model)
    theirs = peer.MatryoshkaLoss(model, peer.MultipleNegativesRankingLoss(model), dims)
    with pytest.warns(UserWarning, match="not one of fused_contrastive's"):
        ours = fused.MatryoshkaLoss(model, peer.MultipleNegativesRankingLoss(model), dims)
    _same(model, theirs, ours, columns[:2])


@pytest.mark.parametrize("kw,match", [
    (dict(matryoshka_dims=[]), "at least one dimension"),
    (dict(matryoshka_dims=[0, 8]), "must be > 0"),
    (dict(matryoshka_dims=[8, 8]), "must not repeat"),
    (dict(matryoshka_dims=[8, 4], matryoshka_weights=[1.0]), "same length"),
    (dict(matryoshka_dims=[10 ** 6]), "cannot exceed"),
])
def test_constructor_errors_name_the_argument(model, kw, match):
    with pytest.raises(ValueError, match=match):
        fused.MatryoshkaLoss(model, fused.MultipleNegativesRankingLoss(model), **kw)


@pytest.mark.parametrize("directions,partition", [(("query_to_doc",), "joint"),
                                                  (("query_to_doc", "doc_to_query"), "per_direction")])
def test_levels_on_triton_run_the_matryoshka_kernels(directions, partition):
    # under the interpreter (conftest): one pass on the Matryoshka kernels (no warning), the same value and
    # gradients as the torch one-pass route
    g = torch.Generator().manual_seed(0)
    q, d1, d2 = (torch.randn(6, 16, generator=g) for _ in range(3))
    res = []
    for be in ("torch", "triton"):
        xs = [x.clone().requires_grad_() for x in (q, d1, d2)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = fused.mnrl_from_embeddings(xs[0], xs[1:], directions=directions, partition_mode=partition,
                                             matryoshka_dims=[16, 4, 8], matryoshka_weights=[1.0, 2.0, 0.5],
                                             backend=be)
        out.backward()
        res.append((out.detach(), [x.grad for x in xs]))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(res[1][1], res[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
