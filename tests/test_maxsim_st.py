"""fused_contrastive.integrations.sentence_transformers' multi-vector drop-ins
(MultiVectorMultipleNegativesRankingLoss, CachedMultiVectorMultipleNegativesRankingLoss) against
sentence-transformers' own classes on a real tiny MultiVectorEncoder built offline (BERT, a token Dense,
a MultiVectorMask with a document skiplist, a token Normalize; float64, eval mode): the loss and every
parameter gradient equal to float64 round-off for pairs, triplets and 4-tuples, padded columns and
skiplisted document tokens, MaxSim, MeanMaxSim and partials of both, the embedding phase chunked, the
cached variant by rows and by tokens; empty documents and query rows on the loss step itself; other
scorers and scales run theirs (one warning, their value); gather over 2 gloo ranks (equal local batches
against theirs, unequal against their global batch); a MultiVectorEncoderTrainer run.

Their scorer returns float32 scores for float64 embeddings (``.float()`` of the query-token maxima in
``util.similarity._maxsim_score_documents``), which caps any comparison at float32 round-off; the float64
comparisons therefore run theirs with that one cast dropped (``_f64_scores``, their function otherwise
line for line: bit for bit theirs on float32 inputs, checked below), and one test compares with theirs
as shipped at float32 tolerance."""

# ruff: noqa: E402 - the module skips itself before importing the optional peer when it is not installed

from __future__ import annotations

import functools
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests._ranks import gloo_rank, run_ranks

st = pytest.importorskip("sentence_transformers",
                         reason="optional peer: pip install '/path/to/fused-contrastive[sentence-transformers]'")

from sentence_transformers.multi_vector_encoder import losses as peer
from sentence_transformers.multi_vector_encoder.scoring import XTRScores, colbert_scores, mean_colbert_scores
from sentence_transformers.util import similarity as st_similarity

from fused_contrastive.bench.st_step import build_tiny_model
from fused_contrastive.integrations import sentence_transformers as fused
from fused_contrastive.integrations import sentence_transformers_multi_vector as mv

B = 6
TOL = dict(rtol=1e-10, atol=1e-10)
PLAIN, CACHED = "MultiVectorMultipleNegativesRankingLoss", "CachedMultiVectorMultipleNegativesRankingLoss"
#: document words the MultiVectorMask drops from scoring (holes inside the documents' masks)
SKIP = [f"w{i}" for i in range(0, 90, 7)]
SCORERS = {
    "colbert": colbert_scores,
    "mean": mean_colbert_scores,
    "partial_chunk": functools.partial(colbert_scores, chunk_elements=700),
    "partial_mean_chunk": functools.partial(mean_colbert_scores, chunk_elements=500),
    "partial_ln": functools.partial(colbert_scores, length_normalize=True),
    "partial_mean_off": functools.partial(mean_colbert_scores, length_normalize=False, chunk_elements=10_000),
}
#: (columns, class, options): every scorer on triplets, the columns and mini-batching on the default
CASES = {
    **{f"3col-{name}": (3, PLAIN, dict(similarity_fct=fn, scale=2.5)) for name, fn in SCORERS.items()},
    "2col": (2, PLAIN, {}),
    "4col": (4, PLAIN, {}),
    "4col-mbs2": (4, PLAIN, dict(mini_batch_size=2)),
    "3col-score_mbs4": (3, PLAIN, dict(score_mini_batch_size=4)),
    "2col-cached-mbs2": (2, CACHED, dict(mini_batch_size=2)),
    "3col-cached-mbs4-mean": (3, CACHED, dict(mini_batch_size=4, similarity_fct=mean_colbert_scores, scale=4.0)),
    "4col-cached-tokens12": (4, CACHED, dict(mini_batch_size=B, mini_batch_num_tokens=12, score_mini_batch_size=2)),
}


def _f64_scores(a, b, a_mask, b_mask):
    """sentence-transformers 6.2's ``_maxsim_score_documents`` without its float32 cast of the maxima."""
    if b.shape[1] == 0:
        empty = torch.ones(a.shape[0], b.shape[0], dtype=torch.bool, device=b.device)
        return st_similarity._fill_empty_document_scores(
            torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=b.device), empty)
    scores = torch.einsum("ash,bth->abst", a, b)
    if b_mask is not None:
        scores.masked_fill_(~b_mask.bool().unsqueeze(0).unsqueeze(2), torch.finfo(scores.dtype).min)
    scores = scores.max(dim=-1).values  # theirs: .values.float()
    if a_mask is not None:
        scores = scores * a_mask.unsqueeze(1)
    scores = scores.sum(dim=-1)
    if b_mask is not None:
        scores = st_similarity._fill_empty_document_scores(scores, ~b_mask.bool().any(dim=-1))
    return scores


@pytest.fixture
def f64(monkeypatch):
    monkeypatch.setattr(st_similarity, "_maxsim_score_documents", _f64_scores)


def _sentences(n: int, seed: int) -> list[str]:
    """Random sentences of 1..6 words (the columns pad to different widths)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(1, 7, (1,), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 90, (k,), generator=g)))
    return out


def _load(path: str):
    """The tiny MultiVectorEncoder (float32, train mode), its Dense seeded: the same weights every call."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(0)
    enc = Transformer(path)
    dense = Dense(in_features=enc.get_embedding_dimension(), out_features=16, bias=False,
                  activation_function=torch.nn.Identity(), module_input_name="token_embeddings")
    return MultiVectorEncoder(modules=[enc, dense, MultiVectorMask(skiplist_words=SKIP),
                                       Normalize(module_input_name="token_embeddings")], device="cpu")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_bert")))


@pytest.fixture(scope="module")
def model(model_path):
    return _load(model_path).double().eval()


@pytest.fixture(scope="module")
def columns(model):
    return [model.preprocess(_sentences(B, seed)) for seed in (1, 2, 3, 4)]


def _run(model, loss, feats):
    model.zero_grad(set_to_none=True)
    out = loss([dict(f) for f in feats], None)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(ga: dict, gb: dict, **tol) -> None:
    assert ga.keys() == gb.keys() and max(float(g.abs().max()) for g in ga.values()) > 1e-4
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], **tol, msg=lambda msg, n=n: f"{n}: {msg}")


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_match_theirs(f64, model, columns, case):
    ncols, cls, kw = CASES[case]
    feats = columns[:ncols]
    a, ga = _run(model, getattr(peer, cls)(model, **kw), feats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fused: no fallback warning
        b, gb = _run(model, getattr(fused, cls)(model, **kw), feats)
    assert a.dtype == b.dtype == torch.float64 and a.item() > 0.1
    torch.testing.assert_close(b, a, **TOL)
    _same(ga, gb, **TOL)


def test_the_columns_have_padding_and_skiplisted_tokens(model, columns):
    # the precondition of the comparisons: padded rows in every column, skiplist holes in the documents
    with torch.no_grad():
        for k, f in enumerate(columns):
            task = "query" if k == 0 else "document"
            mask = model(dict(f), task=task)["attention_mask"].bool()
            assert (~mask[:, -1]).any(), k
            if k:
                assert (~mask & f["attention_mask"].bool()).any(), k


def test_f64_scores_is_theirs_on_float32():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, 8, generator=g), torch.randn(7, 6, 8, generator=g)
    am, bm = torch.rand(5, 4, generator=g) > 0.3, torch.rand(7, 6, generator=g) > 0.3
    bm[2] = False
    assert torch.equal(_f64_scores(a, b, am, bm), st_similarity._maxsim_score_documents(a, b, am, bm))


@pytest.mark.parametrize("cls", [PLAIN, CACHED])
def test_against_theirs_as_shipped(model_path, columns, cls):
    # no patch: their float32 scores; a float32 model (the training dtype) and the float64 one
    for dtype in (torch.float32, torch.float64):
        m = _load(model_path).to(dtype).eval()
        kw = dict(mini_batch_size=2) if cls == CACHED else {}
        a, ga = _run(m, getattr(peer, cls)(m, **kw), columns[:3])
        b, gb = _run(m, getattr(fused, cls)(m, **kw), columns[:3])
        assert a.dtype == torch.float32 and b.dtype == dtype
        torch.testing.assert_close(b, a.to(dtype), rtol=1e-5, atol=1e-6)
        scale = max(float(g.abs().max()) for g in ga.values())
        _same(ga, gb, rtol=1e-3, atol=1e-4 * scale)


def _empty_rows_case(seed: int, empty_positive: bool):
    """Token embeddings of 3 columns (B = 5 rows, widths 4 / 6 / 3) and masks with a padded tail, holes,
    a hard negative without any valid token (and a positive, where ``empty_positive``), and a query
    without any."""
    g = torch.Generator().manual_seed(seed)
    widths = (4, 6, 3)
    reps = [torch.nn.functional.normalize(torch.randn(5, w, 8, generator=g, dtype=torch.float64), dim=-1)
            for w in widths]
    masks = [torch.rand(5, w, generator=g) > 0.3 for w in widths]
    for m in masks:
        m[:, 0] = True
    masks[2][1] = False  # an empty hard negative
    masks[0][4] = False  # a query without a valid token: every score 0
    if empty_positive:
        masks[1][3] = False
    return reps, masks




# an empty positive under MeanMaxSim: -1e9 divided by the query's token count, theirs and ours
@pytest.mark.parametrize("fn,empty_positive", [("colbert", True), ("colbert", False), ("mean", False),
                                               ("mean", True)])
def test_loss_step_on_empty_documents_and_queries(f64, model, fn, empty_positive):
    # the cached class's loss step on given embeddings (mini-batches of 2, 2, 1 rows): loss and the
    # embeddings' gradients, with empty documents (-1e9, no gradient) and an empty query (all scores 0)
    reps, masks = _empty_rows_case(3, empty_positive)
    out = []
    for mod in (peer, fused):
        loss = getattr(mod, CACHED)(model, similarity_fct=SCORERS[fn], scale=3.0, mini_batch_size=2)
        leaves = [[x.detach().clone().requires_grad_() for x in r.split(2)] for r in reps]
        value = loss.calculate_loss(leaves, [list(m.split(2)) for m in masks], with_backward=True)
        out.append((value, [torch.cat([x.grad for x in col]) for col in leaves]))
    (a, ga), (b, gb) = out
    assert not b.requires_grad and torch.isfinite(a) and a.item() > 0.1
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(y, x, **TOL)
    assert float(ga[2][1].abs().max()) == 0.0 and float(gb[2][1].abs().max()) == 0.0
    torch.testing.assert_close(b, a, **TOL)


def test_fused_scorer_rule():
    assert mv.fused_length_normalize(colbert_scores) is False
    assert mv.fused_length_normalize(mean_colbert_scores) is True
    assert mv.fused_length_normalize(functools.partial(colbert_scores, length_normalize=1)) is True
    assert mv.fused_length_normalize(functools.partial(functools.partial(mean_colbert_scores, chunk_elements=9),
                                                       length_normalize=False)) is False
    for other in (XTRScores(), functools.partial(colbert_scores, None), st_similarity.maxsim,
                  functools.partial(colbert_scores, queries_mask=None), lambda q, d, **k: colbert_scores(q, d, **k)):
        assert mv.fused_length_normalize(other) is None, other


def _custom(q, d, queries_mask=None, documents_mask=None):
    return 0.5 * colbert_scores(q, d, queries_mask=queries_mask, documents_mask=documents_mask)


FALLBACKS = {
    "xtr": (3, PLAIN, dict(similarity_fct=XTRScores(top_k=8)), "similarity_fct=XTRScores"),
    "custom_cached": (3, CACHED, dict(similarity_fct=_custom, mini_batch_size=2), "similarity_fct=_custom"),
    "scale_1d": (2, PLAIN, dict(scale=torch.tensor([2.0], dtype=torch.float64)), "scale=tensor([2."),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_other_options_run_theirs_with_one_warning(model, columns, case):
    ncols, cls, kw, words = FALLBACKS[case]
    a, ga = _run(model, getattr(peer, cls)(model, **kw), columns[:ncols])
    mv._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = getattr(fused, cls)(model, **kw)
        b, gb = _run(model, ours, columns[:ncols])
        b2, _ = _run(model, ours, columns[:ncols])
    msgs = [str(w.message) for w in caught if "outside the fused MaxSim loss" in str(w.message)]
    assert len(msgs) == 1 and words in msgs[0] and cls in msgs[0], msgs
    assert torch.equal(a, b) and torch.equal(b, b2)
    _same(ga, gb, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [PLAIN, CACHED])
def test_theirs_in_everything_but_the_loss(model, cls):
    kw = dict(scale=3.0, similarity_fct=functools.partial(mean_colbert_scores, chunk_elements=64),
              score_mini_batch_size=3, gather_across_devices=True)
    if cls == CACHED:
        kw.update(mini_batch_size=4, mini_batch_num_tokens=40, show_progress_bar=False)
    a, b = getattr(peer, cls)(model, **kw), getattr(fused, cls)(model, **kw)
    assert isinstance(b, type(a)) and b.get_config_dict() == a.get_config_dict() and b.citation == a.citation
    assert getattr(b, "uses_gradient_cache", False) == getattr(a, "uses_gradient_cache", False)
    with pytest.raises(ValueError, match="Scale must be a positive value"):
        getattr(fused, cls)(model, scale=0.0)


def test_no_grad_evaluation(f64, model, columns):
    for cls, kw in ((PLAIN, {}), (CACHED, dict(mini_batch_size=2))):
        with torch.no_grad():
            a = getattr(peer, cls)(model, **kw)([dict(f) for f in columns[:3]], None)
            b = getattr(fused, cls)(model, **kw)([dict(f) for f in columns[:3]], None)
        assert not b.requires_grad
        torch.testing.assert_close(b, a, **TOL)


# ----------------------------------------------------------------------------------------------
# gather_across_devices on 2 gloo ranks
# ----------------------------------------------------------------------------------------------

GATHER_CASES = {
    "triplets": (3, PLAIN, {}),
    "mean_4col": (4, PLAIN, dict(similarity_fct=mean_colbert_scores, scale=3.0)),
    "cached_triplets": (3, CACHED, dict(mini_batch_size=2)),
}


def _gather_worker(rank: int, world: int, init: str, path: str, out) -> None:

    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    with gloo_rank(rank, world, init, out):
        st_similarity._maxsim_score_documents = _f64_scores  # a process of its own: float64 scores
        _gather_checks(rank, world, path, out)


def _gather_checks(rank: int, world: int, path: str, out) -> None:
    import torch.distributed as dist

    model = _load(path).double().eval()
    res = {"rank": rank}
    for case, (ncols, cls, kw) in GATHER_CASES.items():
        # equal local batches (what theirs assumes): rank r holds rows [4r, 4r + 4) of every column
        feats = [model.preprocess(_sentences(8, seed)[4 * rank:4 * rank + 4]) for seed in (1, 2, 3, 4)][:ncols]
        a, ga = _run(model, getattr(peer, cls)(model, gather_across_devices=True, **kw), feats)
        b, gb = _run(model, getattr(fused, cls)(model, gather_across_devices=True, **kw), feats)
        local, _ = _run(model, getattr(peer, cls)(model, **kw), feats)
        res[case] = (float((a - b).abs()), max(float((ga[k] - gb[k]).abs().max()) for k in ga),
                     ga.keys() == gb.keys(), max(float(g.abs().max()) for g in ga.values()), float((local - b).abs()))
    # unequal local batches (3 and 7 rows), which theirs does not handle: the mean over ranks of the
    # returned losses and of the gradients (what DDP averages) is their single-process global loss
    sizes = [3, 7]
    lo = sum(sizes[:rank])
    for case, (cls, kw) in {"unequal": (PLAIN, {}), "unequal_cached": (CACHED, dict(mini_batch_size=2))}.items():
        full = [model.preprocess(_sentences(10, seed)) for seed in (1, 2, 3)]
        local = [model.preprocess(_sentences(10, seed)[lo:lo + sizes[rank]]) for seed in (1, 2, 3)]
        b, gb = _run(model, getattr(fused, cls)(model, gather_across_devices=True, **kw), local)
        mean_loss = b.clone()
        dist.all_reduce(mean_loss)
        for g in gb.values():
            dist.all_reduce(g)
        ref, gref = _run(model, getattr(peer, cls)(model, **kw), full)  # theirs, not gathering
        res[case] = (float((mean_loss / world - ref).abs()),
                     max(float((gb[k] / world - gref[k]).abs().max()) for k in gref))
    out.put(res)


def test_gather_across_devices_two_ranks(model_path, tmp_path):
    world = 2
    results = run_ranks(_gather_worker, world, tmp_path, model_path, timeout=240)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        for case in GATHER_CASES:
            dloss, dgrad, same_keys, scale, dlocal = r[case]
            # not between zeros, and the other rank's documents change the loss (the gather is on)
            assert same_keys and scale > 1e-4 and dlocal > 1e-3, (r["rank"], case, r[case])
            assert dloss < 1e-10 and dgrad < 1e-10, (r["rank"], case, r[case])
        assert max(r["unequal"]) < 1e-10 and max(r["unequal_cached"]) < 1e-10, r


# ----------------------------------------------------------------------------------------------
# MultiVectorEncoderTrainer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [PLAIN, CACHED])
def test_trainer_runs_and_matches_theirs(model_path, tmp_path, cls):
    from datasets import Dataset
    from sentence_transformers import MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments

    data = Dataset.from_dict({"query": _sentences(16, 5), "positive": _sentences(16, 6),
                              "negative": _sentences(16, 7)})
    kw = dict(mini_batch_size=3) if cls == CACHED else {}
    logs, params = {}, {}
    for name, mod in (("theirs", peer), ("ours", fused)):
        model = _load(model_path)  # float32, as trained
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = MultiVectorEncoderTrainingArguments(
            output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
        trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=data,
                                            loss=getattr(mod, cls)(model, **kw))
        trainer.train()
        logs[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        params[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert max(float((params[name][n] - before[n]).abs().max()) for n in before) > 1e-5
    assert len(logs["ours"]) == 2 and all(torch.isfinite(torch.tensor(logs["ours"])))
    # the same batches from the same seed: the same float32 losses step by step, the same parameters
    torch.testing.assert_close(torch.tensor(logs["ours"]), torch.tensor(logs["theirs"]), rtol=1e-5, atol=1e-6)
    for n, p in params["theirs"].items():
        torch.testing.assert_close(params["ours"][n], p, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
