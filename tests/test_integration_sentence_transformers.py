"""fused_contrastive.integrations.sentence_transformers against sentence-transformers' own classes, on a
real tiny BERT built offline (float64 and eval mode unless a test says otherwise): the loss and every
parameter gradient equal to 1e-10 for every supported option combination; rejected options raise
naming the option; gather_across_devices on 2 gloo ranks against theirs; a SentenceTransformerTrainer
run; the example script; the bench-st-step command."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests._ranks import gloo_rank, run_ranks

st = pytest.importorskip("sentence_transformers",
                         reason="optional peer: pip install '/path/to/fused-contrastive[sentence-transformers]'")

from sentence_transformers import util
from sentence_transformers.sentence_transformer import losses as peer

from fused_contrastive.bench.st_step import build_tiny_model, load_model
from fused_contrastive.integrations import sentence_transformers as fused

ROOT = Path(__file__).resolve().parents[1]
B = 7
TOL = dict(rtol=1e-10, atol=1e-10)
ALL4 = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
#: every valid (directions, partition_mode): per_direction is refused with query_to_query / doc_to_doc
DIRECTIONS = [
    (("query_to_doc",), "joint"),
    (("query_to_doc",), "per_direction"),
    (("query_to_doc", "doc_to_query"), "joint"),
    (("doc_to_query", "query_to_doc"), "per_direction"),
    (("query_to_doc", "query_to_query"), "joint"),
    (("query_to_doc", "doc_to_doc"), "joint"),
    (ALL4, "joint"),
]
HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]


def _sentences(n: int, seed: int) -> list[str]:
    """Random sentences of 1..6 words (the columns pad to different widths)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(1, 7, (1,), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 90, (k,), generator=g)))
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_bert")))


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(model_path).double().eval()


@pytest.fixture(scope="module")
def columns(model):
    return [model.preprocess(_sentences(B, seed)) for seed in (1, 2, 3)]


def _run(model, loss, feats, labels=None):
    model.zero_grad(set_to_none=True)
    out = loss([dict(f) for f in feats], labels)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, theirs, ours, feats, labels=None) -> None:
    a, ga = _run(model, theirs, feats, labels)
    b, gb = _run(model, ours, feats, labels)
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(b, a, **TOL)
    assert ga.keys() == gb.keys() and len(ga) > 20
    assert max(g.abs().max() for g in ga.values()) > 1e-4  # the comparison is not between zeros
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _sim(kind: str) -> dict:
    # dot products of unnormalised embeddings are large: a small scale keeps the softmax informative
    return dict(similarity_fct=util.cos_sim, scale=20.0) if kind == "cos" else dict(similarity_fct=util.dot_score,
                                                                                     scale=0.5)


# ----------------------------------------------------------------------------------------------
# equal to sentence-transformers' classes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sim", ["cos", "dot"])
@pytest.mark.parametrize("hardness", HARDNESS)
@pytest.mark.parametrize("directions,partition", DIRECTIONS, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("ncols", [2, 3], ids=["pairs", "triplets"])
def test_mnrl_equals_theirs(model, columns, ncols, directions, partition, hardness, sim):
    kw = dict(directions=directions, partition_mode=partition, hardness_mode=hardness,
              hardness_strength=5.0 if hardness else 0.0, **_sim(sim))
    ours = fused.MultipleNegativesRankingLoss(model, **kw)
    theirs = peer.MultipleNegativesRankingLoss(model, **kw)
    _assert_same(model, theirs, ours, columns[:ncols])
    assert ours.get_config_dict() == theirs.get_config_dict()


@pytest.mark.parametrize("case", ["cross_entropy", "symmetric", "all_hard"])
def test_mnrl_on_the_chunked_path(model, columns, case, path):
    """The three implementations in the module (one cross-entropy pass, one pass with the column
    log-sum-exp, per-row log-sum-exp pieces) on the tiled O(N*D) path as well as the one-tile path."""
    kw = {"cross_entropy": {}, "symmetric": dict(directions=("query_to_doc", "doc_to_query"),
                                                 partition_mode="per_direction"),
          "all_hard": dict(directions=ALL4, hardness_mode="all_negatives", hardness_strength=3.0)}[case]
    _assert_same(model, peer.MultipleNegativesRankingLoss(model, **kw), fused.MultipleNegativesRankingLoss(model, **kw),
                 columns)


def test_hardness_strength_zero_is_no_penalty(model, columns):
    kw = dict(hardness_mode="all_negatives", hardness_strength=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peer.MultipleNegativesRankingLoss(model, **kw)
    _assert_same(model, theirs, fused.MultipleNegativesRankingLoss(model, **kw), columns)


@pytest.mark.parametrize("sim", ["cos", "dot"])
@pytest.mark.parametrize("ncols", [2, 3], ids=["pairs", "triplets"])
def test_symmetric_equals_theirs(model, columns, ncols, sim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        theirs = peer.MultipleNegativesSymmetricRankingLoss(model, **_sim(sim))
    _assert_same(model, theirs, fused.MultipleNegativesSymmetricRankingLoss(model, **_sim(sim)), columns[:ncols])


CACHED_OPTIONS = {
    "default": {},
    "symmetric": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "all_hard_dot": dict(directions=ALL4, hardness_mode="all_negatives", hardness_strength=2.0, **_sim("dot")),
    "hard_negatives": dict(hardness_mode="hard_negatives", hardness_strength=5.0),
}


CACHED_CASES = ([(ncols, (3, None), opt) for ncols in (2, 3) for opt in CACHED_OPTIONS]
                + [(3, (32, None), "default"), (3, (4, 12), "all_hard_dot"), (2, (2, 8), "symmetric")])


@pytest.mark.parametrize("ncols,chunks,options", CACHED_CASES,
                         ids=[f"{n}cols-mb{c[0]}-tokens{c[1]}-{o}" for n, c, o in CACHED_CASES])
def test_cached_equals_theirs(model, columns, ncols, chunks, options):
    """Mini-batches of 3 rows (3 per column), one mini-batch (32 >= 7 rows), and packed by token count
    (``mini_batch_num_tokens``, the row cap not binding / binding)."""
    kw = dict(mini_batch_size=chunks[0], mini_batch_num_tokens=chunks[1], **CACHED_OPTIONS[options])
    ours = fused.CachedMultipleNegativesRankingLoss(model, **kw)
    theirs = peer.CachedMultipleNegativesRankingLoss(model, **kw)
    _assert_same(model, theirs, ours, columns[:ncols])
    assert ours.get_config_dict() == theirs.get_config_dict()


def test_cached_symmetric_equals_theirs(model, columns):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        theirs = peer.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=3)
    _assert_same(model, theirs, fused.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=3),
                 columns[:2])


def test_cached_replays_dropout_like_theirs(model_path, columns):
    """In train mode with dropout, each mini-batch's RNG state is replayed in the recompute: from the
    same seed, the same masks, loss and gradients as their GradCache (and different from eval mode)."""
    m = load_model(model_path).double().train()
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.2
    runs = {}
    for name, cls in (("theirs", peer.CachedMultipleNegativesRankingLoss),
                      ("ours", fused.CachedMultipleNegativesRankingLoss)):
        torch.manual_seed(11)
        runs[name] = _run(m, cls(m, mini_batch_size=3), columns[:2])
    (a, ga), (b, gb) = runs["theirs"], runs["ours"]
    torch.testing.assert_close(b, a, **TOL)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], **TOL)
    m.eval()
    c, _ = _run(m, fused.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), columns[:2])
    assert abs(float(c - b)) > 1e-3  # dropout was active


def test_cached_under_no_grad_equals_plain(model, columns):
    with torch.no_grad():
        a = fused.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)([dict(f) for f in columns], None)
        b = peer.MultipleNegativesRankingLoss(model)([dict(f) for f in columns], None)
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("labels", ["float_ties", "int", "bool"])
@pytest.mark.parametrize("sim,scale", [("cos", 20.0), ("cos", 0.5), ("dot", 1.0)])
def test_cosent_equals_theirs(model, columns, sim, scale, labels):
    g = torch.Generator().manual_seed(4)
    y = {"float_ties": torch.randint(0, 4, (B,), generator=g).double() / 4,  # repeated grades: ties add no term
         "int": torch.randint(0, 5, (B,), generator=g),
         "bool": torch.randint(0, 2, (B,), generator=g).bool()}[labels]
    fn = util.pairwise_cos_sim if sim == "cos" else util.pairwise_dot_score
    ours = fused.CoSENTLoss(model, scale=scale, similarity_fct=fn)
    theirs = peer.CoSENTLoss(model, scale=scale, similarity_fct=fn)
    _assert_same(model, theirs, ours, columns[:2], y)
    assert ours.get_config_dict() == theirs.get_config_dict()


# ----------------------------------------------------------------------------------------------
# what is rejected
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,exc,name", [
    (dict(directions=()), ValueError, "direction"),
    (dict(directions=("query_to_doc", "doc_to_docs")), ValueError, "directions"),
    (dict(directions=("doc_to_query",)), ValueError, "query_to_doc"),
    (dict(directions="query_to_doc"), ValueError, "directions"),  # a set of characters, as to theirs
    (dict(partition_mode="separate"), ValueError, "partition_mode"),
    (dict(directions=("query_to_doc", "query_to_query"), partition_mode="per_direction"), ValueError, "partition_mode"),
    (dict(hardness_mode="hardest"), ValueError, "hardness_mode"),
    (dict(hardness_mode="hard_negatives", hardness_strength=-1.0), ValueError, "hardness_strength"),
])
@pytest.mark.parametrize("cls", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_mnrl_rejects_options(model, cls, kw, exc, name):
    with pytest.raises(exc, match=name):
        getattr(fused, cls)(model, **kw)


@pytest.mark.parametrize("kw,exc,name", [
    (dict(mini_batch_size=0), ValueError, "mini_batch_size"),
    (dict(mini_batch_size=2.0), TypeError, "mini_batch_size"),
    (dict(mini_batch_num_tokens=0), ValueError, "mini_batch_num_tokens"),
])
def test_cached_rejects_options(model, kw, exc, name):
    with pytest.raises(exc, match=name):
        fused.CachedMultipleNegativesRankingLoss(model, **kw)


def _peer_run(model, theirs, ours, feats, labels, warns: bool):
    """ours equals theirs (value and parameter gradients); ``warns``: the first use of the options warns
    once that sentence-transformers' computation runs, the second does not warn again."""
    from fused_contrastive.integrations import sentence_transformers as st_mod

    st_mod._WARNED.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _assert_same(model, theirs, ours, feats, labels)
        first = [str(w.message) for w in seen if "sentence-transformers' own" in str(w.message)]
        _run(model, ours, feats, labels)
        again = [str(w.message) for w in seen if "sentence-transformers' own" in str(w.message)]
    assert len(first) == (1 if warns else 0), first
    assert len(again) == len(first), again


@pytest.mark.parametrize("kw,warns", [
    (dict(similarity_fct=util.euclidean_sim, scale=0.5), True),
    (dict(similarity_fct=util.manhattan_sim, scale=0.2), True),
    (dict(similarity_fct=functools.partial(util.cos_sim)), False),  # the cosine: fused
], ids=["euclidean", "manhattan", "partial_cos"])
@pytest.mark.parametrize("cls", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_mnrl_options_outside_the_kernels_run_theirs(model, columns, cls, kw, warns):
    """An option the peer accepts is never an error: outside the fused kernels, the drop-in runs
    sentence-transformers' own computation (same value and gradients) and says so once."""
    extra = dict(mini_batch_size=3) if cls.startswith("Cached") else {}
    ours = getattr(fused, cls)(model, **kw, **extra)
    theirs = peer.MultipleNegativesRankingLoss(model, **kw)
    # the config names the scoring function as theirs does (a partial by its function: was "partial")
    assert ours.get_config_dict()["similarity_fct"] == theirs.get_config_dict()["similarity_fct"]
    _peer_run(model, theirs, ours, columns[:3], None, warns)


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_mnrl_rejects_a_non_positive_scale_as_theirs_does(model, scale):
    with pytest.raises(ValueError, match="(?i)scale"):
        peer.MultipleNegativesRankingLoss(model, scale=scale)
    for cls in ("MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"):
        with pytest.raises(ValueError, match="^Scale must be a positive value.$"):  # theirs, word for word
            getattr(fused, cls)(model, scale=scale)


@pytest.mark.parametrize("kw,warns", [
    (dict(similarity_fct=util.pairwise_manhattan_sim, scale=0.5), True),
    (dict(similarity_fct=util.pairwise_euclidean_sim, scale=0.5), True),
    (dict(similarity_fct=functools.partial(util.pairwise_cos_sim)), False),
    (dict(scale=-0.5), True),
], ids=["manhattan", "euclidean", "partial_cos", "scale_neg"])
def test_cosent_options_outside_the_kernels_run_theirs(model, columns, kw, warns):
    labels = torch.rand(B, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _peer_run(model, peer.CoSENTLoss(model, **kw), fused.CoSENTLoss(model, **kw), columns[:2], labels, warns)


def test_cosent_scale_zero_is_log_one_plus_the_pair_count(model, columns):
    """scale = 0: every pair term is exp(0), so the loss is log(1 + #{(i, j): y_i > y_j}), by hand."""
    labels = torch.tensor([0.1, 0.5, 0.5, 0.9] + [0.3] * (B - 4), dtype=torch.float64)
    pairs = int((labels[:, None] > labels[None, :]).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fused.CoSENTLoss(model, scale=0)([dict(f) for f in columns[:2]], labels)
    assert abs(got.item() - math.log1p(pairs)) < 1e-12, (got, pairs)


def test_bad_inputs_raise(model, columns):
    with pytest.raises(ValueError, match="at least 2 input columns"):
        fused.MultipleNegativesRankingLoss(model)([dict(columns[0])], None)
    with pytest.raises(ValueError, match="at least 2 input columns"):
        fused.CachedMultipleNegativesRankingLoss(model)([dict(columns[0])], None)
    with pytest.raises(ValueError, match="labels"):
        fused.CoSENTLoss(model)([dict(f) for f in columns[:2]], torch.zeros(B + 1))
    loss = fused.MultipleNegativesRankingLoss(model, scale=0.2)
    loss.similarity_fct = util.manhattan_sim  # assigned after construction: read when used
    _peer_run(model, peer.MultipleNegativesRankingLoss(model, scale=0.2, similarity_fct=util.manhattan_sim), loss,
              columns[:2], None, True)


def test_import_does_not_import_sentence_transformers():
    code = ("import sys, fused_contrastive, fused_contrastive.integrations; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sentence_transformers', 'transformers')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


# ----------------------------------------------------------------------------------------------
# gather_across_devices on 2 gloo ranks
# ----------------------------------------------------------------------------------------------

GATHER_CASES = {
    "default_triplets": (3, "MultipleNegativesRankingLoss", {}),
    "all_joint_hard": (3, "MultipleNegativesRankingLoss", dict(directions=ALL4, hardness_mode="in_batch_negatives",
                                                               hardness_strength=4.0)),
    "cached": (3, "CachedMultipleNegativesRankingLoss", dict(mini_batch_size=2, directions=ALL4)),
}


def _gather_worker(rank: int, world: int, init: str, path: str, out) -> None:

    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    with gloo_rank(rank, world, init, out):
        _gather_checks(rank, world, path, out)


def _gather_checks(rank: int, world: int, path: str, out) -> None:
    import torch.distributed as dist

    model = load_model(path).double().eval()
    res = {"rank": rank}
    for case, (ncols, cls, kw) in GATHER_CASES.items():
        # equal local batches (what theirs assumes): rank r holds rows [5r, 5r + 5) of every column
        feats = [model.preprocess(_sentences(10, seed)[5 * rank:5 * rank + 5]) for seed in (1, 2, 3)][:ncols]
        a, ga = _run(model, getattr(peer, cls)(model, gather_across_devices=True, **kw), feats)
        b, gb = _run(model, getattr(fused, cls)(model, gather_across_devices=True, **kw), feats)
        res[case] = (float((a - b).abs()), max(float((ga[k] - gb[k]).abs().max()) for k in ga),
                     ga.keys() == gb.keys(), max(float(g.abs().max()) for g in ga.values()))
    # unequal local batches (4 and 6 rows), which theirs does not handle: the mean over ranks of the
    # returned losses and of the gradients (what DDP averages) is the single-process global loss
    sizes = [4, 6]
    lo = sum(sizes[:rank])
    kw = GATHER_CASES["all_joint_hard"][2]
    full = [model.preprocess(_sentences(10, seed)) for seed in (1, 2, 3)]
    local = [model.preprocess(_sentences(10, seed)[lo:lo + sizes[rank]]) for seed in (1, 2, 3)]
    b, gb = _run(model, fused.MultipleNegativesRankingLoss(model, gather_across_devices=True, **kw), local)
    mean_loss = b.clone()
    dist.all_reduce(mean_loss)
    for g in gb.values():
        dist.all_reduce(g)
    ref, gref = _run(model, peer.MultipleNegativesRankingLoss(model, **kw), full)  # theirs, not gathering
    res["unequal"] = (float((mean_loss / world - ref).abs()),
                      max(float((gb[k] / world - gref[k]).abs().max()) for k in gref))
    out.put(res)


def test_gather_across_devices_two_ranks(model_path, tmp_path):
    world = 2
    results = run_ranks(_gather_worker, world, tmp_path, model_path, timeout=240)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert "error" not in r, r.get("error")
        for case in GATHER_CASES:
            dloss, dgrad, same_keys, scale = r[case]
            assert same_keys and scale > 1e-4 and dloss < 1e-10 and dgrad < 1e-10, (r["rank"], case, r[case])
        assert max(r["unequal"]) < 1e-10, r


# ----------------------------------------------------------------------------------------------
# SentenceTransformerTrainer, the example, the benchmark command
# ----------------------------------------------------------------------------------------------


def test_trainer_runs_and_matches_theirs(model_path, tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    data = Dataset.from_dict({"anchor": _sentences(32, 5), "positive": _sentences(32, 6)})
    logs, changed = {}, {}
    for name, cls in (("theirs", peer.MultipleNegativesRankingLoss), ("ours", fused.MultipleNegativesRankingLoss)):
        model = load_model(model_path)  # float32, as trained
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=8, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=cls(model))
        trainer.train()
        logs[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        changed[name] = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    assert len(logs["ours"]) == 3 and all(torch.isfinite(torch.tensor(logs["ours"])))
    assert changed["ours"] > 1e-5
    # the same batches from the same seed: the same float32 losses step by step, the same updates
    torch.testing.assert_close(torch.tensor(logs["ours"]), torch.tensor(logs["theirs"]), rtol=1e-5, atol=1e-6)
    assert changed["ours"] == pytest.approx(changed["theirs"], rel=1e-3)


def test_example_script_runs():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "train_sentence_transformers.py"), "--steps", "3",
                          "--batch-size", "8", "--pairs", "32"], check=False, capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained 3 steps: loss" in res.stdout


def test_bench_st_step_cli():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-st-step", "--batches", "6",
                          "--losses", "cached-matryoshka,gist", "--hidden", "16", "--layers", "1", "--seq", "4",
                          "--repeats", "1"],
                         check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[1].startswith("ratios: this library / sentence-transformers")
    assert lines[2].split() == ["loss", "batch", "st", "ms", "ours", "ms", "time", "x", "st", "live", "MiB", "ours",
                                "live", "MiB", "live", "x", "st", "RSS", "MiB", "ours", "RSS", "MiB", "RSS", "x"]
    rows = [x.split() for x in lines[4:]]
    # (two losses: two fresh processes each; gist with a guide model, their GISTEmbedLoss against the drop-in)
    assert [r[:2] for r in rows] == [["cached-matryoshka", "6"], ["gist", "6"]]
    for r in rows:
        st_ms, ours_ms, st_live, ours_live = float(r[2]), float(r[3]), float(r[5]), float(r[6])
        assert st_ms > 0 and ours_ms > 0 and st_live > 0 and ours_live > 0, r
        # ours / theirs, from the printed 3 significant digits
        assert float(r[7]) == pytest.approx(ours_live / st_live, rel=0.01, abs=0.006), r
    bad = subprocess.run([sys.executable, "-m", "fused_contrastive", "bench-st-step", "--batches", "1"],
                         check=False, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--batches" in bad.stderr


# ----------------------------------------------------------------------------------------------
# inside sentence-transformers' own wrappers (they check uses_gradient_cache)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_dims_per_step", [-1, 2])
@pytest.mark.parametrize("name", ["CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss",
                                  "MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss"])
def test_their_matryoshka_over_each_drop_in_equals_theirs(model, columns, name, n_dims_per_step):
    # MatryoshkaLoss decorates a gradient-cache loss's calculate_loss and patches model.forward for the
    # others; over the cached drop-in the patch clashed with the recompute (CheckpointError at backward)
    import random

    kw = dict(mini_batch_size=2) if name.startswith("Cached") else {}
    dim = model.get_embedding_dimension()
    dims = [dim, dim // 2, dim // 4]
    assert fused.CachedMultipleNegativesRankingLoss.uses_gradient_cache is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        theirs = peer.MatryoshkaLoss(model, getattr(peer, name)(model, **kw), dims, n_dims_per_step=n_dims_per_step)
        ours = peer.MatryoshkaLoss(model, getattr(fused, name)(model, **kw), dims, n_dims_per_step=n_dims_per_step)
    random.seed(3)
    a, ga = _run(model, theirs, columns[:2])
    random.seed(3)
    b, gb = _run(model, ours, columns[:2])
    torch.testing.assert_close(b, a, **TOL)
    assert ga.keys() == gb.keys() and max(g.abs().max() for g in ga.values()) > 1e-4
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    random.seed(3)
    with torch.no_grad():  # evaluation through the wrapper: the value, no backward
        torch.testing.assert_close(ours([dict(f) for f in columns[:2]], None), a, **TOL)


@pytest.mark.parametrize("name", ["CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"])
def test_their_adaptive_layer_loss_warns_for_the_cached_drop_in_as_for_theirs(model, name):
    with warnings.catch_warnings(record=True) as w_theirs:
        warnings.simplefilter("always")
        peer.AdaptiveLayerLoss(model, getattr(peer, name)(model, mini_batch_size=2))
    with warnings.catch_warnings(record=True) as w_ours:
        warnings.simplefilter("always")
        peer.AdaptiveLayerLoss(model, getattr(fused, name)(model, mini_batch_size=2))
    def adaptive(ws):
        return [str(x.message) for x in ws if str(x.message).startswith("AdaptiveLayerLoss")]

    assert adaptive(w_theirs), [str(x.message) for x in w_theirs]
    assert adaptive(w_ours) == adaptive(w_theirs)


# --- inputs that are not a padded text batch: flattened sequences and per-image tensors -------------
# sentence-transformers' cached losses split them with their own helpers (cu_seq_lens_q ranges; image
# rows by num_images_per_sample); the drop-in uses the same helpers and must equal theirs.


class _FlatOrImageEncoder(torch.nn.Module):
    """A tiny encoder of either input kind, with dropout (so the recompute must replay the RNG):
    flattened tokens pooled per sequence by cu_seq_lens_q; or image rows pooled per sample by
    num_images_per_sample, plus the sample's padded tokens."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(50, 8, generator=g, dtype=torch.float64))
        self.img = torch.nn.Parameter(torch.randn(6, 8, generator=g, dtype=torch.float64))
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, features: dict) -> dict:
        if "cu_seq_lens_q" in features:
            tok = self.drop(self.emb[features["input_ids"][0]])
            lens = (features["cu_seq_lens_q"][1:] - features["cu_seq_lens_q"][:-1]).tolist()
            pooled = torch.stack([t.mean(0) for t in tok.split(lens)])
        else:
            tok = self.drop(self.emb[features["input_ids"]]).mean(1)
            img = self.drop(features["pixel_values"] @ self.img)
            pooled = tok + torch.stack([t.sum(0) for t in img.split(features["num_images_per_sample"].tolist())])
        return {**features, "sentence_embedding": pooled}


def _flat_column(seed: int, b: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6, (b,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return {"input_ids": torch.randint(0, 50, (1, int(cu[-1])), generator=g), "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu.clone(), "max_length_q": int(lens.max()), "max_length_k": int(lens.max()),
            "position_ids": torch.cat([torch.arange(int(n)) for n in lens])[None]}


def _image_column(seed: int, b: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = torch.randint(1, 4, (b,), generator=g)
    return {"input_ids": torch.randint(0, 50, (b, 5), generator=g),
            "attention_mask": torch.ones(b, 5, dtype=torch.long),
            "pixel_values": torch.randn(int(per.sum()), 6, generator=g, dtype=torch.float64),
            "num_images_per_sample": per}


@pytest.mark.parametrize("kind, num_tokens", [("flattened", None), ("flattened", 7), ("images", None)])
def test_cached_drop_in_takes_flattened_and_image_inputs_like_theirs(kind, num_tokens):
    from sentence_transformers import SentenceTransformer

    b = 10
    make = _flat_column if kind == "flattened" else _image_column
    feats = [make(seed, b) for seed in (1, 2)]
    results = []
    for cls in (peer.CachedMultipleNegativesRankingLoss, fused.CachedMultipleNegativesRankingLoss):
        model = SentenceTransformer(modules=[_FlatOrImageEncoder()]).double().train()
        loss = cls(model, mini_batch_size=3, mini_batch_num_tokens=num_tokens)
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        out = loss([dict(f) for f in feats], None)
        out.backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}))
    (want, wg), (got, gg) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert wg.keys() == gg.keys() and wg
    for k in wg:
        torch.testing.assert_close(gg[k], wg[k], rtol=1e-10, atol=1e-12, msg=k)
