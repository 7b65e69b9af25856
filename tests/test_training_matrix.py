"""The training-step matrix (issue 24): failures of use, not of math. Every functional loss and
``fused_contrastive.nn`` drop-in x {fp32, autocast bf16} x {one process, 2-rank gloo DDP} x {plain,
encode_in_chunks}, plus sentence-transformers' drop-ins x {plain, MatryoshkaLoss, AdaptiveLayerLoss}.

Each cell is one optimizer-free training step (forward, loss, backward) of a tiny offline encoder with
buffers (tests/_training_matrix.py: Embedding, Linear, BatchNorm1d in eval mode, LayerNorm, a registered
shift buffer; 286 parameters). Every parameter's gradient is compared with a float64 single-process run
of an independent textbook computation (F.cross_entropy / logsigmoid on materialised cosine logits) on
the global batch, under THE accuracy rule of fused_contrastive.testing.accuracy: the error may be at most
twice the textbook's own error computing in the cell's precision (the same step, same autocast) plus the
dtype's slack.

DDP cells: DistributedDataParallel(broadcast_buffers=True, the default) on 2 gloo ranks with uneven
local batches (5 and 3 rows), every loss with gather=True. Each rank backpropagates its own loss (the
library scales it so that DDP's average over ranks is the global batch's gradient), so the averaged
gradients equal the single-process gradients on the global batch unchanged. The textbook's own error
there is that of the same DDP step with the textbook loss on the gathered global batch (itself checked
against the one-process textbook error). One spawn runs all cells of a (precision, encoding) group;
30 s collective timeouts turn a hang into a failure, and the cells after a hang report "not run".

sentence-transformers cells (one process): the library's drop-ins in sentence-transformers' own
wrappers against sentence-transformers' losses in the same wrappers, on a tiny BERT built offline; the
truth is theirs in float64, the tolerance their own error in the cell's precision.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from _training_matrix import BY_NAME, CELLS, fresh, global_data, step, truth_and_same

from fused_contrastive.testing.accuracy import check_output

PRECISIONS = ["fp32", "bf16"]
MODES = ["plain", "encode_in_chunks"]
CELL_IDS = [c.name for c in CELLS]


def _assert_grads(got: dict, truth: dict, same: dict, bf16: bool, what: str) -> None:
    """Every parameter's gradient within THE rule's tolerance of the float64 truth."""
    assert set(got) == set(truth), f"{what}: gradients of {sorted(got)} but the truth has {sorted(truth)}"
    dtype = torch.bfloat16 if bf16 else torch.float32
    bad = []
    for k in truth:
        # ref 1: the step's loss is O(1), and a parameter gradient below 1e-10 of it is zero up to float64
        # rounding (attention key biases: the softmax is invariant to them); cap=False: in bf16 the
        # same-dtype error is the whole model's under autocast, not the loss's
        worst, err, tol = check_output(f"grad {k}", got[k], truth[k], same[k], dtype, ref=1.0, cap=False)
        if not err <= tol:
            bad.append(str(worst))
    assert not bad, f"{what}: " + "; ".join(bad)


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", CELL_IDS)
def test_one_process(name, precision, mode):
    cell, bf16 = BY_NAME[name], precision == "bf16"
    truth, same = truth_and_same(cell, bf16)
    model, mod = fresh(cell)
    got = step(cell, model, mod, global_data(cell), textbook=False, chunks=mode == "encode_in_chunks", bf16=bf16)
    _assert_grads(got, truth, same, bf16, f"{name}/{precision}/{mode}")


# ------------------------------------------------------------------------------------------------
# 2-rank gloo DDP
# ------------------------------------------------------------------------------------------------

_DDP_CACHE: dict[tuple[str, str], dict[str, dict]] = {}


def _spawn(names: list[str], precision: str, mode: str, store) -> list[dict]:
    """Both ranks' reports of one spawn running ``names`` in order (see ddp_worker)."""
    from _training_matrix import ddp_worker

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (2, f"file://{store}", names, mode == "encode_in_chunks", precision == "bf16", out)
    procs = [ctx.Process(target=ddp_worker, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(2):
            results.append(torch.load(io.BytesIO(out.get(timeout=150))))
    except queue_mod.Empty:
        results.append({"rank": -1, "grads": {}, "textbook": {},
                        "error": (names[0], "a rank did not report within 150 s")})
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def reported_cells(results: list[dict], names: list[str]) -> dict[str, dict]:
    """{cell: {"grads": (rank 0's, rank 1's), "textbook": (...)}} for the cells of ``names`` both ranks reported."""
    ranks = sorted(results, key=lambda r: r["rank"])
    return {name: {"grads": tuple(r["grads"][name] for r in ranks),
                   "textbook": tuple(r["textbook"][name] for r in ranks)}
            for name in names if all(name in r["grads"] for r in results)}


def ranks_agree(res: dict, what: str) -> dict:
    """Rank 0's gradients of a DDP cell, after checking that DDP left identical ones on every rank."""
    g0, g1 = res["grads"]
    assert set(g0) == set(g1)
    for k in g0:
        assert torch.equal(g0[k], g1[k]), f"{what}: grad {k} differs between the ranks"
    return g0


def _ddp_group(precision: str, mode: str, tmp_path_factory) -> dict[str, dict]:
    """{cell: {"grads": (rank 0's, rank 1's)} or {"error": text}} for every cell of one (precision,
    mode) group, cached. One spawn runs the cells in order and stops at the first failure; after a
    failure both ranks raised (no collective left waiting) the remaining cells run in a new spawn,
    after a collective timeout (a hang: the ranks are out of step) they are reported as not run."""
    key = (precision, mode)
    if key in _DDP_CACHE:
        return _DDP_CACHE[key]
    cells: dict[str, dict] = {}
    remaining = list(CELL_IDS)
    while remaining:
        results = _spawn(remaining, precision, mode, tmp_path_factory.mktemp(f"ddp_{precision}_{mode}") / "store")
        cells.update(reported_cells(results, remaining))
        errors = [(r["rank"], *r["error"]) for r in results if r["error"] is not None]
        if not errors:
            break
        failed = min((remaining.index(e[1]) for e in errors if e[1] in remaining), default=0)
        cells[remaining[failed]] = {"error": "\n".join(f"rank {r} failed at {n}:\n{t}" for r, n, t in errors)}
        hang = len(errors) < 2 or any("Timed out" in t or "timeout" in t.lower() for _, _, t in errors)
        if hang:
            for name in remaining[failed + 1:]:
                cells[name] = {"error": f"not run: the ranks were out of step after {remaining[failed]} failed:\n"
                               + cells[remaining[failed]]["error"]}
            break
        remaining = remaining[failed + 1:]
    _DDP_CACHE[key] = cells
    return cells


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", CELL_IDS)
def test_ddp_two_ranks(name, precision, mode, tmp_path_factory):
    bf16 = precision == "bf16"
    res = _ddp_group(precision, mode, tmp_path_factory)[name]
    if "error" in res:
        pytest.fail(f"{name}/{precision}/{mode}/ddp: {res['error']}")
    truth, same_one_process = truth_and_same(BY_NAME[name], bf16)
    g0 = ranks_agree(res, f"{name}/{precision}/{mode}")
    # the textbook's own error: the same DDP step (plain encoding) with the textbook loss on the
    # gathered global batch, in the cell's precision
    same = res["textbook"][0]
    # the harness itself: the textbook under DDP is within the rule of the textbook in one process
    _assert_grads(same, truth, same_one_process, bf16, f"{name}/{precision}/textbook-under-ddp (the harness)")
    _assert_grads(g0, truth, same, bf16, f"{name}/{precision}/{mode}/ddp")


# ------------------------------------------------------------------------------------------------
# sentence-transformers drop-ins in sentence-transformers' wrappers, against theirs in the same wrappers
# ------------------------------------------------------------------------------------------------

ST_LOSSES = ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss", "CoSENTLoss"]
#: "MatryoshkaLoss": theirs around both losses; "ours:MatryoshkaLoss": each library's own MatryoshkaLoss
ST_WRAPPERS = ["plain", "MatryoshkaLoss", "ours:MatryoshkaLoss", "AdaptiveLayerLoss"]
ST_CELLS = [(l, w) for l in ST_LOSSES for w in ST_WRAPPERS
            # AdaptiveLayerLoss does not support gradient-caching losses (sentence-transformers warns)
            if not (l.startswith("Cached") and w == "AdaptiveLayerLoss")]


@pytest.fixture(scope="module")
def st_model():
    pytest.importorskip("sentence_transformers",
                        reason="optional peer: pip install '/path/to/fused-contrastive[sentence-transformers]'")
    import tempfile

    from fused_contrastive.bench.st_step import build_tiny_model, load_model

    with tempfile.TemporaryDirectory() as d:
        model = load_model(build_tiny_model(d)).eval()
    return model


def _st_sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 90, (int(torch.randint(1, 6, (1,), generator=g)),),
                                                          generator=g)) for _ in range(n)]


def _st_step(model, loss_name: str, wrapper: str, ours: bool, bf16: bool) -> dict:
    from sentence_transformers.sentence_transformer import losses as peer

    from fused_contrastive.integrations import sentence_transformers as fused

    lib = fused if ours else peer
    kw = {"mini_batch_size": 3} if loss_name.startswith("Cached") else {}
    if loss_name == "CoSENTLoss":
        kw["scale"] = 5.0
    loss = getattr(lib, loss_name)(model, **kw)
    if wrapper == "MatryoshkaLoss":
        loss = peer.MatryoshkaLoss(model, loss, matryoshka_dims=[32, 16, 8])
    elif wrapper == "ours:MatryoshkaLoss":
        loss = lib.MatryoshkaLoss(model, loss, matryoshka_dims=[32, 16, 8], matryoshka_weights=[1.0, 2.0, 0.5])
    elif wrapper == "AdaptiveLayerLoss":
        loss = peer.AdaptiveLayerLoss(model, loss)
    ncols = 2 if loss_name == "CoSENTLoss" else 3
    feats = [model.preprocess(_st_sentences(7, seed)) for seed in range(1, ncols + 1)]
    labels = torch.tensor([0.0, 1, 4, 2, 3, 1, 0]) if loss_name == "CoSENTLoss" else None
    if labels is not None and next(model.parameters()).dtype == torch.float64:
        labels = labels.double()
    model.zero_grad(set_to_none=True)
    random.seed(0)  # AdaptiveLayerLoss samples its prior layer with `random`: the same one in every run
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False):
        out = loss([dict(f) for f in feats], labels)
    out.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("loss_name,wrapper", ST_CELLS, ids=[f"{l}-{w}" for l, w in ST_CELLS])
def test_sentence_transformers(st_model, loss_name, wrapper, precision):
    import copy
    import warnings

    bf16 = precision == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        truth = _st_step(copy.deepcopy(st_model).double(), loss_name, wrapper, ours=False, bf16=False)
        same = _st_step(copy.deepcopy(st_model), loss_name, wrapper, ours=False, bf16=bf16)
        got = _st_step(copy.deepcopy(st_model), loss_name, wrapper, ours=True, bf16=bf16)
    _assert_grads(got, truth, same, bf16, f"{loss_name}/{wrapper}/{precision}")
