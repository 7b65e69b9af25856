"""Drop-ins for sentence-transformers' multi-vector (ColBERT, late interaction) in-batch-negatives losses
whose cross-entropy runs on :func:`fused_contrastive.maxsim.maxsim_info_nce`, which never builds the
``B x B·N x Lq x Ld`` token similarities (memory O(B·Lq·B·N) for the scores and the argmax indices)::

    # from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
    from fused_contrastive.integrations.sentence_transformers import MultiVectorMultipleNegativesRankingLoss

Both classes subclass sentence-transformers' own (6.2), so the constructor, its checks and options,
``get_config_dict``, ``citation``, the embedding of the columns (``embed_columns_padded`` with
``mini_batch_size``) and the gradient cache (``mini_batch_size`` / ``mini_batch_num_tokens`` /
``show_progress_bar``, the RNG replay and the backward hook) are theirs; only the scoring and the
cross-entropy are replaced:

* :class:`MultiVectorMultipleNegativesRankingLoss`: ``forward`` embeds as theirs and computes the loss in
  one fused call.
* :class:`CachedMultiVectorMultipleNegativesRankingLoss`: ``calculate_loss`` (the GradCache loss step)
  computes the batch in blocks of ``score_mini_batch_size`` queries against every candidate, one fused
  call per block, each back-propagated to the cached embeddings at once when ``with_backward``, as
  theirs: the fused call's working set (the scores and the argmax indices, O(rows·Lq·B·N)) is then one
  block's, so the drop-in never holds more than their class (one call over the whole batch held 3x
  theirs at B = 256). Under ``gather_across_devices`` the local batch is one block.

The math. Their scorer takes the queries ``(B, Lq, D)`` and the candidate columns stacked to
``(B, N, T, D)`` (the positives, then the hard negatives) and returns ``(B, B·N)`` MaxSim scores in
query-major order (the positive of query ``i`` at column ``i·N``); the loss is
``F.cross_entropy(scale * scores, arange(B) * N)``. The cross-entropy of a row does not depend on the
order of its columns, so here the positives are ``doc_tokens`` (target ``arange(B)``) and the hard
negatives, flattened to ``(B·(N-1), T, D)``, are ``negatives``: the same set of logits per row, the same
loss. The query mask is their ``outputs["attention_mask"].bool()`` (multiplied into the query-token
maxima), document tokens outside their mask take no part in the maximum, and a document without a valid
token scores -1e9 before the scale (``fused_contrastive.maxsim.EMPTY_DOC_SCORE``, their value).
sentence-transformers returns float32 scores whatever the embeddings' dtype; the fused loss is float32
for 16 / 32-bit embeddings and float64 for float64 ones.

``similarity_fct``: ``colbert_scores`` (their default) and ``mean_colbert_scores`` (MeanMaxSim,
``length_normalize=True``) are fused, and so is a ``functools.partial`` of either that binds only
``chunk_elements`` (a memory budget of their scorer, not needed here) and / or ``length_normalize``
(honoured). Any other scorer (``XTRScores``, ``xtr_scores``, a custom callable) and a ``scale`` the
fused op does not take (not a finite real number or 0-dim floating tensor) run their own computation
(the parent class's method), with a one-time warning per class and reason: swapping the import never
turns a working script into an error.

``gather_across_devices=True`` with an initialised ``torch.distributed``: this rank's queries against
every rank's positives and hard negatives through ``maxsim_info_nce(gather=the default group)``, which
returns the local loss scaled so that the average over ranks is the global-batch loss (their per-rank
cross-entropy mean: the same value when the local batches have equal sizes; unequal local sizes,
which theirs does not handle, are handled). Without an initialised process group: the local loss, as
theirs.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sentence_transformers.base.losses.merged_forward import embed_columns_padded
from sentence_transformers.multi_vector_encoder import losses as _mv_losses
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores
from sentence_transformers.util import cat_padded_token_embeddings
from torch import Tensor

from ..maxsim import maxsim_info_nce

__all__ = ["CachedMultiVectorMultipleNegativesRankingLoss", "MultiVectorMultipleNegativesRankingLoss"]

#: the scorers computed by the fused loss, with their default of ``length_normalize``
_FUSED_SCORERS = ((colbert_scores, False), (mean_colbert_scores, True))
#: the keywords a ``functools.partial`` of a fused scorer may bind and stay fused
_FUSED_KEYWORDS = frozenset({"chunk_elements", "length_normalize"})

_WARNED: set[tuple[str, str]] = set()


def _scorer_name(fn) -> str:
    if isinstance(fn, functools.partial):
        inner = getattr(fn.func, "__name__", type(fn.func).__name__)
        bound = [*(repr(a) for a in fn.args), *(f"{k}={v!r}" for k, v in fn.keywords.items())]
        return f"partial({inner}, {', '.join(bound)})" if bound else f"partial({inner})"
    return getattr(fn, "__name__", type(fn).__name__)


def fused_length_normalize(similarity_fct) -> bool | None:
    """``length_normalize`` of the fused loss for sentence-transformers' ``similarity_fct`` (False for
    ``colbert_scores``, True for ``mean_colbert_scores``, a partial's bound ``length_normalize`` read as
    their scorer reads it, by truth value), or None when the scorer is not one the fused loss computes."""
    fn, keywords = similarity_fct, {}
    if isinstance(fn, functools.partial):  # nested partials are flattened by functools itself
        if fn.args or not set(fn.keywords) <= _FUSED_KEYWORDS:
            return None
        fn, keywords = fn.func, fn.keywords
    for scorer, default in _FUSED_SCORERS:
        if fn is scorer:
            return bool(keywords.get("length_normalize", default))
    return None


def _scale_ok(scale) -> bool:
    """Whether the fused op takes ``scale`` as theirs uses it: a finite real number > 0 or a 0-dim floating
    tensor (a CUDA tensor is not read: their constructor checked it)."""
    if isinstance(scale, Tensor):
        return scale.dim() == 0 and scale.is_floating_point()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return False
    return math.isfinite(scale) and scale > 0


def _unfused_reason(loss) -> str | None:
    """Why this loss's options are outside the fused op (None: they are not)."""
    if fused_length_normalize(loss.similarity_fct) is None:
        return f"similarity_fct={_scorer_name(loss.similarity_fct)}"
    if not _scale_ok(loss.scale):
        return f"scale={loss.scale!r}"
    return None


def _warn_peer(owner, reason: str) -> None:
    """The one-time warning (per class and reason) that this loss runs sentence-transformers' computation."""
    key = (type(owner).__name__, reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"{type(owner).__name__}: {reason} is outside the fused MaxSim loss, so this loss runs "
                  f"sentence-transformers' own {type(owner).__mro__[1].__name__} computation on the token "
                  "embeddings (their scorer, then cross_entropy); the value is sentence-transformers'", stacklevel=3)


def _group(gather_across_devices) -> dist.ProcessGroup | None:
    """The default group when gathering and torch.distributed is initialised; else None (the local
    batch, as sentence-transformers does without a process group)."""
    if gather_across_devices and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _pad_width(x: Tensor, mask: Tensor, width: int) -> tuple[Tensor, Tensor]:
    if x.shape[1] == width:
        return x, mask
    return F.pad(x, (0, 0, 0, width - x.shape[1])), F.pad(mask, (0, width - mask.shape[1]))


def multi_vector_mnrl(queries: Tensor, query_mask: Tensor, docs: list[Tensor], doc_masks: list[Tensor], *,
                      scale=1.0, length_normalize: bool = False, group: dist.ProcessGroup | None = None,
                      backend: str = "auto", first_row: int = 0, batch_size: int | None = None) -> Tensor:
    """sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss`` on token embeddings, fused.

    Args:
        queries: [B, Lq, D] this rank's query token embeddings; ``query_mask`` [B, Lq] (bool, or float
            weights multiplied into the maxima).
        docs: N >= 1 tensors [B, T_k, D]: the positives, then the hard-negative columns (any widths);
            ``doc_masks`` their [B, T_k] masks.
        scale: ``1 / temperature``.
        length_normalize: MeanMaxSim (each score divided by its query's count of real tokens).
        group: gather the candidates over this process group (None: the local batch).
        first_row / batch_size: ``queries`` are rows ``first_row ..`` of a batch of ``batch_size`` queries
            (their positives the documents of those rows) and the result is their share of its mean (the
            sum of their cross-entropies / ``batch_size``): a block of the batch. Defaults: the whole
            batch. Not with ``group``.

    Returns the 0-dim mean cross-entropy (under ``group``: the local sum scaled so that the average over
    ranks is the global-batch mean).
    """
    block = first_row != 0 or batch_size is not None
    if block and group is not None:
        raise ValueError("first_row / batch_size compute a block of the local batch: not with group")
    negatives = negative_mask = None
    if len(docs) > 1:
        width = max(d.shape[1] for d in docs[1:])
        padded = [_pad_width(d, m, width) for d, m in zip(docs[1:], doc_masks[1:], strict=True)]
        negatives = torch.cat([d for d, _ in padded])  # [B * (N - 1), T, D]: the order of columns is free
        negative_mask = torch.cat([m for _, m in padded])
    if block:
        n = queries.shape[0]
        target = torch.arange(first_row, first_row + n, device=queries.device)
        return maxsim_info_nce(queries, docs[0], target, query_mask=query_mask, doc_mask=doc_masks[0],
                               negatives=negatives, negative_mask=negative_mask, scale=scale,
                               length_normalize=length_normalize, normalize=False, backend=backend,
                               reduction="sum") / (n if batch_size is None else batch_size)
    return maxsim_info_nce(queries, docs[0], None, query_mask=query_mask, doc_mask=doc_masks[0], negatives=negatives,
                           negative_mask=negative_mask, scale=scale, length_normalize=length_normalize,
                           normalize=False, backend=backend, gather=group if group is not None else False)


class MultiVectorMultipleNegativesRankingLoss(_mv_losses.MultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss`` (its constructor and options),
    the loss computed by :func:`fused_contrastive.maxsim.maxsim_info_nce` (the module docstring says
    which ``similarity_fct`` are fused; others run their computation with a one-time warning)."""

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = [dict(features) for features in sentence_features]
        reason = _unfused_reason(self)
        if reason is not None or len(sentence_features) < 2:
            if reason is not None:
                _warn_peer(self, reason)
            return super().forward(sentence_features, labels)
        # the embedding phase exactly as theirs (task routing, merged columns, mini_batch_size chunks)
        query_features = sentence_features[0]
        query_outputs = self.model(query_features, task=query_features.get("task", "query"))
        queries = query_outputs["token_embeddings"]
        query_mask = query_outputs["attention_mask"].bool()
        docs, doc_masks = embed_columns_padded(self.model, sentence_features[1:], self.mini_batch_size,
                                               task_default="document")
        return multi_vector_mnrl(queries, query_mask, docs, doc_masks, scale=self.scale,
                                 length_normalize=fused_length_normalize(self.similarity_fct),
                                 group=_group(self.gather_across_devices))


class CachedMultiVectorMultipleNegativesRankingLoss(_mv_losses.CachedMultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss`` (its constructor, options
    and GradCache mechanics), whose loss step runs :func:`fused_contrastive.maxsim.maxsim_info_nce` on
    blocks of ``score_mini_batch_size`` queries (the module docstring says why)."""

    def calculate_loss(self, reps: list[list[Tensor]], masks_chunks: list[list[Tensor]], *,
                       with_backward: bool = False) -> Tensor:
        reason = _unfused_reason(self)
        if reason is not None or len(reps) < 2:
            if reason is not None:
                _warn_peer(self, reason)
            return super().calculate_loss(reps, masks_chunks, with_backward=with_backward)
        catted = [cat_padded_token_embeddings(r, m) for r, m in zip(reps, masks_chunks, strict=True)]
        (queries, query_mask), docs = catted[0], catted[1:]
        kw = dict(scale=self.scale, length_normalize=fused_length_normalize(self.similarity_fct))
        group = _group(self.gather_across_devices)
        if group is not None:  # the local batch in one block (the gathered columns need every rank's call)
            loss = multi_vector_mnrl(queries, query_mask, [e for e, _ in docs], [m for _, m in docs], group=group,
                                     **kw)
            if with_backward:
                loss.backward()
                loss = loss.detach()
            return loss
        b = queries.shape[0]
        step = max(1, int(self.score_mini_batch_size))
        total = None
        for begin in range(0, b, step):
            end = min(begin + step, b)
            part = multi_vector_mnrl(queries[begin:end], query_mask[begin:end], [e for e, _ in docs],
                                     [m for _, m in docs], first_row=begin, batch_size=b, **kw)
            if with_backward:
                part.backward()
                part = part.detach()
            total = part if total is None else total + part
        return total
