"""``python -m fused_contrastive bench-st-step``: one sentence-transformers training step (forward, loss,
backward) of a small BERT built offline, with sentence-transformers' own loss class and with this
library's drop-in of the same name, side by side at several batch sizes, for three losses (``--losses``):
``mnrl`` (``MultipleNegativesRankingLoss``), ``cached`` (``CachedMultipleNegativesRankingLoss``,
``mini_batch_size`` 32) and ``cached-matryoshka`` (``MatryoshkaLoss`` around the cached loss, dims
hidden, hidden/2, hidden/4); on request also ``gist`` (``GISTEmbedLoss``) and ``cached-gist``
(``CachedGISTEmbedLoss``, ``mini_batch_size`` 32), with a guide of the same shape and vocabulary built from
another seed (frozen; the same tokenisation, so nothing is re-tokenised). sentence-transformers' GIST classes
score with a broadcast ``nn.CosineSimilarity`` (B x B x hidden products per block), so their memory grows with
B^2 * hidden: they are not in the default set. Every ratio is this library / sentence-transformers (< 1: ours
faster or smaller).

Time: the two losses alternate in one process (ABBA rounds), medians over the repeats. Live bytes:
the high-water mark of the tensor storages one step creates (``bench/memory.py``'s ``LiveBytes``:
deterministic, in process; parameter gradients included, the model and the tokenized batch not).
Peak memory: each step in a fresh process, the resident-set high-water mark over the baseline after
the model and the tokenized batch exist (``bench/memory.py``'s CPU meter; on CUDA
``max_memory_allocated``). The encoder's activations are the same for both; the difference is the
loss's B x B similarity matrix (and its softmax and gradient) against the fused loss's O(B*D) working
set, and for the cached losses (whose loss works on ``mini_batch_size`` rows at a time either way) the
gradient cache and the loss's tiles. sentence-transformers is imported only when the sub-command runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from .helptext import help_text
from .memory import LiveBytes, step_peak

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LOSSES = ("mnrl", "cached", "cached-matryoshka", "gist", "cached-gist")
#: what ``--losses`` runs unless told: the GIST kinds only on request (their class's B x B x hidden products)
DEFAULT_LOSSES = ("mnrl", "cached", "cached-matryoshka")
GUIDED = ("gist", "cached-gist")
MINI_BATCH = 32  # the cached losses' mini_batch_size (theirs and ours)


def build_tiny_model(path: str, *, hidden: int = 32, layers: int = 2, heads: int = 2, words: int = 90,
                     max_len: int = 64, dropout: float = 0.0, seed: int = 0) -> str:
    """Save a randomly initialised BERT (``hidden`` wide, ``layers`` deep, FFN ``2 * hidden``) and a
    whitespace WordLevel tokenizer over the words ``w0 .. w{words-1}`` to ``path``; no download.
    Returns ``path`` (load it with :func:`load_model`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_len)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, max_position_embeddings=max_len, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout)
    torch.manual_seed(seed)
    BertModel(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def load_model(path: str, device: str = "cpu"):
    """The ``SentenceTransformer`` of :func:`build_tiny_model`'s files: Transformer + mean pooling."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer
    enc = Transformer(path)
    dim = (enc.get_embedding_dimension() if hasattr(enc, "get_embedding_dimension")
           else enc.get_word_embedding_dimension())
    return SentenceTransformer(modules=[enc, Pooling(dim, "mean")], device=device)


def sentences(n: int, words: int, vocab: int = 90, seed: int = 0) -> list[str]:
    """``n`` random sentences of ``words`` words ``w<k>`` each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, words), generator=g).tolist()
    return [" ".join(f"w{k}" for k in row) for row in ids]


def _loss(model, which: str, kind: str = "mnrl", guide=None):
    """sentence-transformers' loss (``which="peer"``) or this library's drop-in (``"fused"``) of ``kind``
    (``guide``: the GIST kinds' guide model)."""
    if which == "peer":
        try:
            from sentence_transformers.sentence_transformer import losses as lib
        except ImportError:  # sentence-transformers < 6
            from sentence_transformers import losses as lib
    else:
        from ..integrations import sentence_transformers as lib
    if kind == "mnrl":
        return lib.MultipleNegativesRankingLoss(model)
    if kind == "gist":
        return lib.GISTEmbedLoss(model, guide)
    if kind == "cached-gist":
        return lib.CachedGISTEmbedLoss(model, guide, mini_batch_size=MINI_BATCH)
    cached = lib.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)
    if kind == "cached":
        return cached
    dim = model.get_embedding_dimension()
    return lib.MatryoshkaLoss(model, cached, [dim, dim // 2, dim // 4])


def _setup(a: dict[str, Any], batch: int, kind: str = "mnrl"):
    """The model, the tokenized (anchor, positive) batch and, for the GIST kinds, the frozen guide (else None)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = load_model(a["model_path"], a["device"])
    model.train()
    guide = None
    if kind in GUIDED:
        guide = load_model(a["guide_path"], a["device"])
        guide.eval()
        guide.requires_grad_(False)
    words = a["seq"] - 2  # [CLS] ... [SEP]
    feats = [model.preprocess(sentences(batch, words, seed=s)) for s in (1, 2)]
    feats = [{k: v.to(a["device"]) if isinstance(v, torch.Tensor) else v for k, v in f.items()} for f in feats]
    return model, feats, guide


def _step(model, loss, feats) -> None:
    model.zero_grad(set_to_none=True)
    loss([dict(f) for f in feats], None).backward()


def _live(model, loss, feats) -> int:
    """Live bytes (``LiveBytes`` peak) of one step."""
    model.zero_grad(set_to_none=True)
    with LiveBytes() as m:
        _step(model, loss, feats)
    return m.peak


def _peak(args: tuple[dict[str, Any], int, str, str]) -> int:
    a, batch, which, kind = args
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    model, feats, guide = _setup(a, batch, kind)
    loss = _loss(model, which, kind, guide)
    _step(model, loss, [{k: v[:8] if isinstance(v, torch.Tensor) else v for k, v in f.items()} for f in feats])
    model.zero_grad(set_to_none=True)
    return step_peak(a["device"], lambda: _step(model, loss, feats))


def measure(a: dict[str, Any]) -> dict[str, Any]:
    """Per batch size: median step time and peak memory of each loss (see the module docstring)."""
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    sync = torch.cuda.synchronize if a["device"].startswith("cuda") else (lambda: None)
    ctx = mp.get_context("spawn")
    rows = []
    for kind, batch in ((k, b) for k in a.get("losses", ("mnrl",)) for b in a["batches"]):
        model, feats, guide = _setup(a, batch, kind)
        losses = {w: _loss(model, w, kind, guide) for w in ("peer", "fused")}
        times: dict[str, list[float]] = {w: [] for w in losses}
        for loss in losses.values():  # warm-up
            _step(model, loss, feats)
        for r in range(a["repeats"]):
            for w in (("peer", "fused") if r % 2 == 0 else ("fused", "peer")):
                sync()
                t0 = time.perf_counter()
                _step(model, losses[w], feats)
                sync()
                times[w].append(time.perf_counter() - t0)
        live = {w: _live(model, losses[w], feats) for w in losses}
        peaks = {}
        for w in losses:
            with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as ex:
                peaks[w] = ex.submit(_peak, (a, batch, w, kind)).result()
        rows.append({"loss": kind, "batch": batch, "median_s": {w: statistics.median(v) for w, v in times.items()},
                     "times_s": times, "live_bytes": live, "peak_bytes": peaks})
    return {"config": a, "rows": rows}


def render(res: dict[str, Any]) -> str:
    """The table: per loss and batch, time, live bytes and peak memory of theirs and ours, and ours / theirs."""
    from tabulate import tabulate  # the [bench] extra: imported when the table is made
    a = res["config"]
    table = []

    def mib(b: int) -> str:  # 3 significant digits, no exponent
        v = b / (1 << 20)
        return f"{v:.3g}" if v < 1000 else f"{v:.0f}"

    def ratio(ours: float, theirs: float) -> str:
        return f"{ours / theirs:.2f}" if theirs else "-"

    for r in res["rows"]:
        t, lv, p = r["median_s"], r["live_bytes"], r["peak_bytes"]
        table.append([r.get("loss", "mnrl"), r["batch"], f"{t['peer'] * 1e3:.0f}", f"{t['fused'] * 1e3:.0f}",
                      ratio(t["fused"], t["peer"]), mib(lv["peer"]), mib(lv["fused"]), ratio(lv["fused"], lv["peer"]),
                      mib(p["peer"]), mib(p["fused"]), ratio(p["fused"], p["peer"])])
    return "\n".join([
        (f"sentence-transformers training step (anchor, positive): their class (st) against this library's drop-in "
         f"(ours); BERT hidden {a['hidden']}, {a['layers']} layers, {a['seq']} tokens per sentence, {a['device']}, "
         f"{a.get('threads') or torch.get_num_threads()} threads, medians of {a['repeats']} alternating repeats; "
         f"cached, cached-gist: mini_batch_size {MINI_BATCH}, gist: guide of the same shape (another seed), "
         f"cached-matryoshka: MatryoshkaLoss(cached) at dims {a['hidden']}, "
         f"{a['hidden'] // 2}, {a['hidden'] // 4}"),
        ("ratios: this library / sentence-transformers (< 1: ours faster or smaller); live = tensor bytes one step "
         "creates (LiveBytes, deterministic); RSS = resident-set peak of the step in a fresh process, over the model "
         "and inputs"),
        tabulate(table, headers=["loss", "batch", "st ms", "ours ms", "time x", "st live MiB", "ours live MiB",
                                 "live x", "st RSS MiB", "ours RSS MiB", "RSS x"],
                 tablefmt="simple", disable_numparse=True),
    ])


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-st-step", help="a sentence-transformers training step: their (cached) MNRL against "
                       "the fused drop-ins", description=help_text(__doc__))
    p.add_argument("--losses", default=",".join(DEFAULT_LOSSES),
                   help=f"comma-separated among {', '.join(LOSSES)} (default {','.join(DEFAULT_LOSSES)})")
    p.add_argument("--batches", default="256,1024,4096", help="comma-separated batch sizes (default 256,1024,4096)")
    p.add_argument("--hidden", type=int, default=128, help="BERT hidden size (default 128)")
    p.add_argument("--layers", type=int, default=2, help="BERT layers (default 2)")
    p.add_argument("--seq", type=int, default=8, help="tokens per sentence, [CLS] and [SEP] included (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each loss per batch size (default 5)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not batches or min(batches) < 2:
        parser.error("--batches: every batch size must be >= 2")
    for name in ("hidden", "layers", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    if not losses or any(x not in LOSSES for x in losses):
        parser.error(f"--losses must be comma-separated among {', '.join(LOSSES)}, got {args.losses!r}")
    if "cached-matryoshka" in losses and args.hidden < 4:
        parser.error("--hidden must be >= 4 for cached-matryoshka (dims hidden, hidden/2, hidden/4)")
    if args.seq < 3:
        parser.error("--seq must be >= 3 ([CLS], one word, [SEP])")
    if args.hidden % 2:
        parser.error("--hidden must be even (2 attention heads)")
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        parser.error("bench-st-step needs sentence-transformers: "
                     'pip install "/path/to/fused-contrastive[sentence-transformers]" (a checkout of this project)')
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(hidden=args.hidden, layers=args.layers, heads=2, max_len=max(64, args.seq))
        build_tiny_model(os.path.join(tmp, "model"), **shape, dropout=0.1)
        if any(k in GUIDED for k in losses):
            build_tiny_model(os.path.join(tmp, "guide"), **shape, seed=1)
        a = {k: getattr(args, k) for k in ("hidden", "layers", "seq", "repeats", "device", "threads")}
        a.update(batches=batches, model_path=os.path.join(tmp, "model"), guide_path=os.path.join(tmp, "guide"),
                 losses=losses)
        print(render(measure(a)))
    return 0
