"""Train a sentence-transformers model with the fused MultipleNegativesRankingLoss.

The script is an ordinary SentenceTransformerTrainer run; the only change from sentence-transformers'
own loss is the import marked below. To stay offline it builds a tiny random BERT and a word-level
tokenizer in a temporary directory and trains on generated (anchor, positive) pairs: a sentence and
the same words shuffled. Replace ``build_model`` with ``SentenceTransformer("your/model")`` and the
dataset with yours for real training.

    pip install "/path/to/fused-contrastive[sentence-transformers]"   # a checkout of this project
    python examples/train_sentence_transformers.py --steps 20 --batch-size 64
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

# from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from fused_contrastive.integrations.sentence_transformers import MultipleNegativesRankingLoss  # the only change

WORDS = [f"w{i}" for i in range(200)]


def build_model(path: str, hidden: int = 64) -> SentenceTransformer:
    """A random 2-layer BERT with a whitespace word-level tokenizer, saved to ``path`` and loaded."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=64).save_pretrained(path)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=2 * hidden, max_position_embeddings=64)).save_pretrained(path)
    return SentenceTransformer(modules=[Transformer(path), Pooling(hidden, "mean")], device="cpu")


def pairs(n: int, rng: random.Random) -> Dataset:
    """(anchor, positive): random sentences and the same words in another order."""
    anchors, positives = [], []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(4, 12))
        anchors.append(" ".join(words))
        rng.shuffle(words)
        positives.append(" ".join(words))
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(os.path.join(tmp, "model"))
        trainer = SentenceTransformerTrainer(
            model=model,
            args=SentenceTransformerTrainingArguments(
                output_dir=os.path.join(tmp, "out"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                disable_tqdm=True, seed=args.seed),
            train_dataset=pairs(args.pairs, random.Random(args.seed)),
            loss=MultipleNegativesRankingLoss(model),  # scale=20.0, directions=..., as in sentence-transformers
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"trained {len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
