"""The Qwen3-Embedding InfoNCE (Zhang et al. 2025, "Qwen3 Embedding", eq. 1), on the merged-block core of
``core/guided/torch_blocks.py`` (the guide mask of GISTEmbed with the model's own embeddings as the guide).

For queries ``q_i``, their documents ``d_i`` (global row ``o + i`` of the batch gathered over ranks),
optional row-specific hard negatives ``n_ik``, cosine similarity ``s(., .)`` and temperature ``tau``::

    Z_i   = e^{s(q_i, d_i) / tau}
          + sum_j  m_ij e^{s(q_i, d_j) / tau}          j != o + i   (in-batch documents)
          + sum_k  m_ik e^{s(q_i, n_ik) / tau}                      (its own hard negatives)
          + sum_j  m_ij e^{s(q_i, q_j) / tau}          j != o + i   (query_query)
          + sum_j  m_ij e^{s(d_i, d_j) / tau}          j != o + i   (doc_doc)
    m_ij  = 0 when the pair's similarity s_ij > s(q_i, d_i) + margin (a likely false negative), else 1
    loss  = mean_i  -log( e^{s(q_i, d_i) / tau} / Z_i )

The mask always reads the cosine (also with ``normalize=False``, whose logits are raw dot products) and
carries no gradient. ``gist_loss(q, d, guide=(q, d), margin=-margin)`` has the same first three blocks
but no own-column exclusion in the q-q and d-d blocks (there the guide drops ``s = 1 > s(q_i, d_i) +
margin``, i.e. unless ``s(q_i, d_i) >= 1 - margin``); this loss excludes them always, as the paper and
memeff do.

memeff 0.3.1's ``MemoryEfficientQwen3Loss(use_qq_negatives=True, use_dd_negatives=True)`` computes the
same value with one difference: it masks the positive like any column (with ``margin < 0`` its
denominator loses ``e^{s(q_i, d_i)/tau}``; here the positive is always kept). Its defaults differ
(temperature 0.07, no q-q / d-d blocks); this loss takes the paper's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from .. import distributed as D
from .._amp import autocast_off
from .._backend import resolve
from ..core import reference as ref
from ..core.guided.torch_blocks import Block, Masks, merged_lse
from ..core.spec import compute_dtype
from . import _row_negatives as RN
from ._levels import leveled
from ._scope import EPS, Scope

__all__ = ["qwen3_embedding_loss"]


@D.agreed
@leveled("query", "docs", "row_negatives", one_pass=False)
@autocast_off
def qwen3_embedding_loss(query: Tensor, docs: Tensor, row_negatives: Tensor | None = None, *, temperature=0.05,
                         margin: float = 0.1, query_query: bool = True, doc_doc: bool = True, normalize: bool = True,
                         reduction: str = "mean", backend: str = "auto", gather=False, _levels=None) -> Tensor:
    """The Qwen3-Embedding InfoNCE (module docstring has the math): query-document softmax with the
    false-negative mask, optional q-q and d-d in-batch blocks and row-specific hard negatives.

    Args:
        query: [N, D] queries.
        docs: [N, D] documents (row i is query i's positive).
        row_negatives: None or [N, K, D], each query's own K hard negatives (masked by the same rule;
            never gathered).
        temperature: tau, a positive float or a 0-dim tensor (differentiable); default 0.05.
        margin: a finite float (default 0.1, the paper's): a candidate whose cosine with the row's query
            (or, in the d-d block, document) exceeds ``s(q_i, d_i) + margin`` leaves row i's softmax. A
            large margin (>= 2) masks nothing.
        query_query / doc_doc: include the q-q / d-d blocks (default True, the paper's), own column excluded.
        normalize: cosine logits (True) or raw dot products (False; the mask still reads cosines).
        reduction / backend / gather: as every loss (:mod:`fused_contrastive.losses`); ``gather`` contrasts
            with every rank's documents (and queries), the rank average is the global-batch loss.
        matryoshka_dims / matryoshka_weights / return_level_losses: Matryoshka levels (one call per level
            on the truncated, re-normalised embeddings; the mask follows each level's cosines).

    Returns:
        0-dim loss (mean / sum) or [N] per-query losses (none); float32 (float64 for float64 inputs).
    """
    query = V.embeddings("query", query)
    docs = V.paired("query", query, "docs", docs)
    V.same_precision("query", query, "docs", docs)
    if row_negatives is not None:
        row_negatives = RN.checked(row_negatives, query)
    margin = V.number("margin", margin, low=-math.inf, strict=True)
    for name, v in (("query_query", query_query), ("doc_doc", doc_doc), ("normalize", normalize)):
        V.flag(name, v)
    reduction = V.reduction(reduction)
    dev, n = query.device, query.shape[0]
    dt = compute_dtype(query, docs)
    s, _ = V.scale_of(temperature, None, 0.05, dt, dev)
    be = resolve(backend, query, docs)
    scope = Scope(gather)
    scope.agree(s)
    d_all, off, total = scope.rows(docs, "docs")
    q_all = query if scope.local or not query_query else scope.rows(query, "query")[0]
    t = torch.arange(n, device=dev) + off
    if be == "reference":
        per = ref.qwen3_embedding(query, docs, d_all, q_all, row_negatives, s, margin, query_query, doc_doc,
                                  normalize, off)
        return scope.reduce(per, reduction, total)
    # the mask's cosines in float32 at least: 16-bit guides are normalised and rounded to 16 bits on the Triton
    # path (cosines off by ~2^-8, which flips candidates near the threshold against the definition)
    gdt = torch.promote_types(dt, torch.float32)
    xs, guides = [query, d_all], [query.detach().to(gdt), d_all.detach().to(gdt)]
    blocks = [Block(rows=0, cols=1, protect=True)]
    if query_query:
        if not scope.local:  # the q-q block's columns: every rank's queries (tensor 2)
            xs.append(q_all)
            guides.append(q_all.detach().to(gdt))
        blocks.append(Block(rows=0, cols=0 if scope.local else 2, exclude=off))
    if doc_doc:
        blocks.append(Block(rows=1, cols=1, row_start=off, exclude=off))
    # the guide rule drops a column when its cosine is > gpos_i - (-margin)
    masks = Masks(guides=tuple(guides), target=t, rule=("absolute", -margin))
    if row_negatives is None and reduction != "none":
        per_n = reduction == "mean" and scope.local
        w = torch.full((n,), 1.0 / n if per_n else 1.0, dtype=dt, device=dev)
        out = merged_lse(xs, blocks, n, s, masks, normalize=normalize, eps=EPS, weights=w, minus_target=True,
                         backend=be)
        return out if per_n else scope.reduce(out, reduction, total)
    per = merged_lse(xs, blocks, n, s, masks, normalize=normalize, eps=EPS, minus_target=True, backend=be)
    if row_negatives is not None:
        with torch.no_grad():
            qh = F.normalize(query.detach().to(dt), dim=1, eps=EPS)
            gpos = torch.linalg.vecdot(qh, F.normalize(docs.detach().to(dt), dim=1, eps=EPS), dim=1)
            cos = torch.einsum("nd,nkd->nk", qh, F.normalize(row_negatives.detach().to(dt), dim=2, eps=EPS))
            keep = cos <= (gpos + margin)[:, None]
        per = RN.merged(per, RN.target_logit(query, docs, s, normalize),
                        RN.row_logits(query, row_negatives, s, normalize), keep=keep)
    return scope.reduce(per, reduction, total)
