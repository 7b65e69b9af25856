"""Drop-in replacements for sentence-transformers' in-batch-negatives losses that never build the
``B x B`` (or ``B x B(1 + n_neg)``) similarity matrix: swap one import line and keep the rest of a
``SentenceTransformerTrainer`` script::

    # from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from fused_contrastive.integrations.sentence_transformers import MultipleNegativesRankingLoss

Importing this module imports sentence-transformers (from a checkout of this project:
``pip install "/path/to/fused-contrastive[sentence-transformers]"``);
importing ``fused_contrastive`` never does.

Classes (the constructor signatures and the ``forward(sentence_features, labels)`` contract of
sentence-transformers 6.x; tested against 6.2.0, loss and parameter gradients equal in float64):

* :class:`MultipleNegativesRankingLoss` with every option: ``scale``, ``similarity_fct`` (``cos_sim`` or
  ``dot_score``), ``gather_across_devices``, ``directions``, ``partition_mode``, ``hardness_mode``,
  ``hardness_strength``.
* :class:`MultipleNegativesSymmetricRankingLoss`: the above with ``directions=("query_to_doc",
  "doc_to_query")``, ``partition_mode="per_direction"``.
* :class:`CachedMultipleNegativesRankingLoss` (and the symmetric one): the same loss with the columns
  embedded ``mini_batch_size`` rows (or ``mini_batch_num_tokens`` tokens) at a time through
  :func:`fused_contrastive.encode_in_chunks` (gradient caching by activation checkpointing; the same
  loss and gradients as their GradCache implementation, dropout masks included).
* :class:`CoSENTLoss` (``similarity_fct`` ``pairwise_cos_sim`` or ``pairwise_dot_score``) on
  :func:`fused_contrastive.cosent_loss` (O(B log B)).
* :class:`MultiVectorMultipleNegativesRankingLoss` and :class:`CachedMultiVectorMultipleNegativesRankingLoss`
  (``sentence_transformers.multi_vector_encoder.losses``, late interaction): subclasses of theirs whose
  scoring and cross-entropy run on :func:`fused_contrastive.maxsim.maxsim_info_nce` (no token similarity
  tensor); defined in ``sentence_transformers_multi_vector.py``, whose docstring has the details.

Options the fused kernels do not cover run sentence-transformers' own computation on the embeddings
(``compute_loss_from_embeddings`` of their class, built with the same options), with a one-time warning
naming the option: a ``similarity_fct`` other than the cosine or dot product (a ``functools.partial`` of
those without bound arguments is fused), and CoSENT's ``scale <= 0`` (MultipleNegativesRankingLoss
rejects a non-positive scale, as sentence-transformers' does). So swapping the
import never turns a working script into an error. The cached variant splits flattened
(``cu_seq_lens_q``, ``DataCollatorWithFlattening``) and image inputs (tensors not indexed by example,
such as ``pixel_values``) into mini-batches with sentence-transformers' own splitting helpers, as theirs
does, and raises ``ValueError`` for ``StaticEmbedding`` models (which the original rejects too).

The math of MultipleNegativesRankingLoss (sentence-transformers 6.x), for this rank's queries ``q_i``
(global row ``o + i`` of the batch gathered over ranks, ``o = 0`` without gathering), the positive
documents ``d^0`` and hard negatives ``d^1 .. d^{K-1}`` (all gathered), ``sim`` the cosine (or dot)::

    query_to_doc   s sim(q_i, d^k_j) (+ a sim(q_i, d^k_j) with no gradient where hardness penalises it)
    query_to_query s sim(q_i, q_j),    j != o + i
    doc_to_query   s sim(d^0_i, q_j)
    doc_to_doc     s sim(d^0_i, d^k_j), j != o + i (every k)
    loss = mean_i (log Z_i - s sim(q_i, d^0_{o+i}))

``log Z_i`` is one log-sum-exp over the union of the selected directions ("joint") or the mean of one
log-sum-exp per direction ("per_direction"). Each log-sum-exp is a per-row output of the core op
(``fused_contrastive.core.run``, O(N*D) memory): a block of columns with the row's own column
``o + i`` excluded is ``exclude_self`` at ``offset=o``; the own columns that the hardness penalty
treats differently are O(B) pair terms; a penalised block ``(s + a) sim`` whose ``a`` part carries no
gradient runs at scale ``s + a`` on inputs whose gradient is scaled by ``s / (s + a)`` (exact: the
logits are bilinear in the two inputs). The default (``query_to_doc`` only, no hardness) is one
cross-entropy pass; the symmetric loss without gathering one pass with the column log-sum-exp.

``gather_across_devices=True`` uses this library's gather (``fused_contrastive.distributed``): each rank
computes its own queries against every rank's documents and returns its local loss scaled so that
the average over ranks is the global-batch loss (equal to their per-rank value when the local batches
have equal sizes; unequal sizes, which they do not handle, are handled). Without an initialised
``torch.distributed`` it computes the local loss, as theirs does.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import random
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tqdm
from sentence_transformers import util as _st_util

try:  # sentence-transformers >= 6.2 (the old module path warns there)
    from sentence_transformers.sentence_transformer import losses as _st_losses
except ImportError:  # pragma: no cover - older releases
    from sentence_transformers import losses as _st_losses
from torch import Tensor, nn
from torch.utils import checkpoint as _checkpoint
from transformers import PreTrainedTokenizerBase

from .. import _validate as V
from .. import core, routes
from .. import distributed as D
from .._backend import resolve
from ..core.spec import Coeffs, CoreData, CoreSpec, compute_dtype
from ..cosent import cosent_loss
from ..encode import encode_in_chunks
from ..losses import _levels
from ..losses.guided import gist_loss

try:  # sentence-transformers >= 6: one merged forward for the candidate columns (what their losses call)
    from sentence_transformers.base.losses.merged_forward import embed_columns as _embed_columns
except ImportError:  # pragma: no cover - older releases embed each column on its own
    def _embed_columns(model, features_list):
        return [model(f)["sentence_embedding"] for f in features_list]

__all__ = [
    "CachedMultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "CachedGISTEmbedLoss",
    "CoSENTLoss",
    "GISTEmbedLoss",
    "MatryoshkaLoss",
    "MultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
]

_EPS = 1e-12
_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
_HARDNESS = (None, "in_batch_negatives", "hard_negatives", "all_negatives")

Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]


# ----------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------


def _fct_name(fn) -> str:
    """The config dict's name of a scoring callable: sentence-transformers' own rendering where it has one
    (``similarity_fct_name``: a ``functools.partial`` by its function and keywords, a bound ``similarity``
    by what it resolves to), so the drop-in's config equals its peer's."""
    try:
        from sentence_transformers.util.misc import similarity_fct_name
    except ImportError:
        similarity_fct_name = None
    if similarity_fct_name is not None:
        return similarity_fct_name(fn)
    if isinstance(fn, functools.partial):
        args = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        name = getattr(fn.func, "__name__", type(fn.func).__name__)
        return f"{name}({args})" if args else name
    return getattr(fn, "__name__", type(fn).__name__)


def _normalize_of(similarity_fct, pairwise: bool) -> bool | None:
    """True for the cosine, False for the dot product (the fused paths; a ``functools.partial`` of
    either without bound arguments counts as it), None for any other similarity."""
    fn = similarity_fct
    while isinstance(fn, functools.partial) and not fn.args and not fn.keywords:
        fn = fn.func
    if pairwise:
        cos, dot = (_st_util.pairwise_cos_sim,), (_st_util.pairwise_dot_score,)
    else:
        cos, dot = (_st_util.cos_sim, _st_util.pytorch_cos_sim), (_st_util.dot_score,)
    if any(fn is f for f in cos):
        return True
    if any(fn is f for f in dot):
        return False
    return None


def _check_scale(scale) -> None:
    """Types only: any real scale is the peer's (a non-positive one runs the peer's computation)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, Tensor)):
        raise TypeError(f"scale must be a number or a 0-dim tensor, got {type(scale).__name__}")
    if isinstance(scale, Tensor) and scale.dim() != 0:
        raise ValueError(f"scale must be a 0-dim tensor, got shape {tuple(scale.shape)}")


def _unfused_reason(scale, similarity_fct, pairwise: bool) -> str | None:
    """Why the fused kernels cannot run these options (None: they can). A CUDA tensor scale is not
    read (a host sync per step): the fused op computes any real scale; the kernels' own checks need
    scale > 0 only for numbers and CPU tensors."""
    if _normalize_of(similarity_fct, pairwise) is None:
        return f"similarity_fct={_fct_name(similarity_fct)}"
    if isinstance(scale, Tensor) and scale.device.type != "cpu":
        return None
    value = float(scale.detach()) if isinstance(scale, Tensor) else float(scale)
    if not value > 0:
        return f"scale={value}"
    return None


_WARNED: set[tuple[str, str]] = set()


def _peer_computation(owner: nn.Module, peer_cls: type, reason: str, **options) -> nn.Module:
    """sentence-transformers' own loss with the drop-in's options, for options the fused kernels do not
    cover; built once per set of options, kept outside the module tree (it shares the model), with a
    one-time warning per class and reason."""
    key = (peer_cls.__name__, tuple(sorted((k, repr(v)) for k, v in options.items())))
    cached = owner.__dict__.get("_peer")
    if cached is None or cached[0] != key:
        owner.__dict__["_peer"] = cached = (key, peer_cls(owner.model, **options))
    if (type(owner).__name__, reason) not in _WARNED:
        _WARNED.add((type(owner).__name__, reason))
        warnings.warn(f"{type(owner).__name__}: {reason} is outside the fused kernels, so this loss runs "
                      f"sentence-transformers' own {peer_cls.__name__} computation on the embeddings (the "
                      "B x B similarity matrix); the value is sentence-transformers'", stacklevel=3)
    return cached[1]


def _check_scale_as_theirs(scale) -> None:
    """sentence-transformers' own check of ``scale`` (``MultipleNegativesRankingLoss.__init__``): the same
    exception and words (a CUDA tensor is read once, here), then this library's type checks."""
    if not scale > 0:
        raise ValueError("Scale must be a positive value.")
    _check_scale(scale)


def _raise_as_theirs(ours: Exception, peer_cls: type, model: nn.Module, **options) -> None:
    """Raise what sentence-transformers' ``peer_cls`` raises for ``options`` when it is an exception of
    ``ours``'s type (its exact words: e.g. a set of valid values printed in its own order, which depends on
    the process that compiled their module), else ``ours``. Runs only once an option was found bad."""
    import inspect

    params = inspect.signature(peer_cls.__init__).parameters
    try:
        peer_cls(model, **{k: v for k, v in options.items() if k in params})
    except type(ours) as theirs:
        raise type(theirs)(*theirs.args) from None
    except Exception:  # noqa: BLE001 - theirs fails otherwise: ours stands
        pass
    raise ours


def _check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength) -> tuple[str, ...]:
    """sentence-transformers' checks of ``MultipleNegativesRankingLoss.__init__`` in their order, with
    their exceptions and words (code and tests written against theirs catch the same errors; a
    ``directions`` string is a set of characters to them too), then this library's stricter ones."""
    valid_directions = {"query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"}  # their set (its repr)
    if not directions:
        raise ValueError("At least one direction must be specified.")
    if not set(directions).issubset(valid_directions):
        raise ValueError(f"Invalid directions: {set(directions) - valid_directions}. Valid: {valid_directions}")
    if "query_to_doc" not in directions:
        raise ValueError("'query_to_doc' direction is required (contains the positive pair).")
    directions = tuple(directions)
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode}")
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError(
            "partition_mode='per_direction' requires every direction's candidate pool to include the positive pair. "
            "'query_to_query' and 'doc_to_doc' only contain same-type similarities and never include the positive, "
            "making the per-direction loss ill-defined. Use partition_mode='joint' instead.")
    valid_hardness_modes = {None, "in_batch_negatives", "hard_negatives", "all_negatives"}  # their set
    if hardness_mode not in valid_hardness_modes:
        raise ValueError(f"hardness_mode must be one of {valid_hardness_modes}, got {hardness_mode!r}")
    if hardness_strength < 0.0:
        raise ValueError("hardness_strength must be non-negative.")
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, (int, float)):
        raise TypeError(f"hardness_strength must be a number, got {type(hardness_strength).__name__}")
    if not hardness_strength >= 0.0:  # NaN
        raise ValueError(f"hardness_strength must be a number >= 0, got {hardness_strength}")
    return directions


def _group(gather_across_devices) -> dist.ProcessGroup | None:
    """The default group when gathering and torch.distributed is initialised; else None (the local
    batch, as sentence-transformers does without a process group)."""
    if gather_across_devices and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


# ----------------------------------------------------------------------------------------------
# the loss on embeddings
# ----------------------------------------------------------------------------------------------


class _GradScale(torch.autograd.Function):
    """Identity forward; the gradient multiplied by a constant."""

    @staticmethod
    def forward(ctx, x: Tensor, c) -> Tensor:
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.c, None


def _pair_sim(x: Tensor, y: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    """``sim(x_i, y_i)`` per row in ``dt`` ([n])."""
    x, y = x.to(dt), y.to(dt)
    if normalize:
        x, y = F.normalize(x, dim=-1, eps=_EPS), F.normalize(y, dim=-1, eps=_EPS)
    return (x * y).sum(-1)


def _gathered(x: Tensor, group, name: str):
    """``distributed.gather_rows``, its result made a plain tensor: with equal local sizes it is the
    functional collective's ``AsyncCollectiveTensor``, whose storage the core op's dense path cannot
    inspect (``untyped_storage().data_ptr()`` raises); ``clone`` waits for it (and copies B*D values)."""
    rows, off, sizes = D.gather_rows(x, group, name=name)
    return (rows if type(rows) is Tensor else rows.clone()), off, sizes


def _lse_all(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.logsumexp(torch.stack(parts), dim=0)


def mnrl_from_embeddings(queries: Tensor, docs: Sequence[Tensor], *, scale=20.0, normalize: bool = True,
                         directions: Sequence[str] = ("query_to_doc",), partition_mode: str = "joint",
                         hardness_mode: str | None = None, hardness_strength: float = 0.0,
                         group: dist.ProcessGroup | None = None, backend: str = "auto",
                         matryoshka_dims: Sequence[int] | None = None,
                         matryoshka_weights: Sequence[float] | None = None) -> Tensor:
    """MultipleNegativesRankingLoss on embeddings (the module docstring has the math).

    Args:
        queries: [B, D] this rank's anchors.
        docs: K >= 1 tensors [B, D]: the positives, then the hard-negative columns.
        scale: ``1 / temperature`` (a number or a 0-dim tensor).
        normalize: cosine (True) or dot product (False).
        group: a process group to gather over (None: the local batch).
        backend: "auto" (torch on CPU and for float64, triton on CUDA), "torch" or "triton".
        matryoshka_dims / matryoshka_weights: Matryoshka levels, ``sum_k w_k loss(shrink(x, d_k))``
            (sentence-transformers' ``MatryoshkaLoss`` semantics): every level in one pass over D for the
            one-pass routes (``query_to_doc`` without hardness; the symmetric loss without gathering),
            one call per level otherwise.

    Returns:
        0-dim loss in the compute dtype (float32, float64 for float64 inputs); under ``group`` the
        local sum times ``world / global batch``.
    """
    queries = V.embeddings("queries", queries)
    if len(docs) < 1:
        raise ValueError("docs must hold at least the positives column")
    docs = [V.embeddings("docs", d) for d in docs]
    for d in docs:
        if d.shape != queries.shape:
            raise ValueError(f"every docs column must have the shape of queries {tuple(queries.shape)}, "
                             f"got {tuple(d.shape)}")
    V.same_device(queries=queries, docs=docs[0])
    directions = _check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
    lv = None
    if matryoshka_dims is not None:
        lv = _levels.levels(matryoshka_dims, matryoshka_weights, queries.shape[1])
    elif matryoshka_weights is not None:
        raise ValueError("matryoshka_weights needs matryoshka_dims")
    dev = queries.device
    dt = compute_dtype(queries, *docs)
    s = V.positive_number("scale", scale, device=dev)
    if isinstance(s, Tensor):
        s = s.to(device=dev, dtype=dt)
    be = resolve(backend, queries, docs[0])
    if be == "reference":  # the core op has no reference variant (the classes' tests use the original)
        be = "torch"
    b, k_cols = queries.shape[0], len(docs)
    if group is not None:
        q_all, off, sizes = _gathered(queries, group, "queries")
        d_all = [_gathered(d, group, "docs")[0] for d in docs]
        world, n_total = D.world_size(group), sum(sizes)
    else:
        q_all, off, d_all, world, n_total = queries, 0, docs, 1, b
    per_rank = world / n_total  # the mean over the global batch, times world (see the module docstring)
    dirs = set(directions)
    hard = hardness_mode is not None and hardness_strength > 0.0
    cat = torch.cat(d_all) if k_cols > 1 else d_all[0]
    plain = CoreSpec(normalize=normalize, eps=_EPS)
    core_lv = None if lv is None else lv.core
    if not hard and dirs == {"query_to_doc"}:  # cross-entropy with target o + i: one pass
        tgt = torch.arange(b, device=dev) + off
        out = core.run(be, queries, cat, s, plain, CoreData(target=tgt), Coeffs(lse=1.0, tgt=1.0), True,
                       levels=core_lv) * per_rank
        return out if lv is None else _levels.combine(out, lv)
    if not hard and group is None and dirs == {"query_to_doc", "doc_to_query"} \
            and partition_mode == "per_direction":
        # (LSE_i + LSEcol_i) / 2 - TGT_i: the column log-sum-exp of the positives' columns, one pass
        col = 0.5 if k_cols == 1 else torch.cat([torch.full((b,), 0.5, dtype=dt, device=dev),
                                                 torch.zeros(b * (k_cols - 1), dtype=dt, device=dev)])
        tgt = torch.arange(b, device=dev)
        out = core.run(be, queries, cat, s, plain, CoreData(target=tgt), Coeffs(lse=0.5, col=col, tgt=1.0), True,
                       levels=core_lv) / b
        return out if lv is None else _levels.combine(out, lv)
    if lv is not None:  # the other routes: one call per level on the truncated, re-normalised embeddings
        kw = dict(scale=scale, normalize=normalize, directions=directions, partition_mode=partition_mode,
                  hardness_mode=hardness_mode, hardness_strength=hardness_strength, group=group, backend=backend)
        return sum(w * mnrl_from_embeddings(_levels.shrink(queries, d), [_levels.shrink(x, d) for x in docs], **kw)
                   for d, w in zip(lv.dims, lv.weights, strict=True))

    excl = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True, offset=off)

    def lse(a: Tensor, bm: Tensor, own_excluded: bool, sc) -> Tensor | None:
        """Per-row log-sum-exp of ``sc * sim(a_i, bm_j)`` ([B]), column ``o + i`` left out if asked."""
        if own_excluded and bm.shape[0] == 1:
            return None  # nothing left in the block
        return core.run(be, a, bm, sc, excl if own_excluded else plain, CoreData(), Coeffs(lse=1.0), False)

    pos = _pair_sim(queries, docs[0], normalize, dt)
    parts: dict[str, list[Tensor | None]] = {}
    if not hard:
        parts["query_to_doc"] = [lse(queries, cat, False, s)]
    else:
        a = float(hardness_strength)
        sa = s + a
        c = (s / sa).detach() if isinstance(sa, Tensor) else s / sa
        others = hardness_mode in ("in_batch_negatives", "all_negatives")
        q2d = []
        for k in range(k_cols):
            if others:  # (s + a) sim on every column but the own one, a without gradient
                q2d.append(lse(_GradScale.apply(queries, c), _GradScale.apply(d_all[k], c), True, sa))
            else:
                q2d.append(lse(queries, d_all[k], True, s))
            own = pos if k == 0 else _pair_sim(queries, docs[k], normalize, dt)
            own_pen = k >= 1 and hardness_mode in ("hard_negatives", "all_negatives")
            q2d.append(s * own + a * own.detach() if own_pen else s * own)
        parts["query_to_doc"] = q2d
    if "query_to_query" in dirs:
        parts["query_to_query"] = [lse(queries, q_all, True, s)]
    if "doc_to_query" in dirs:
        parts["doc_to_query"] = [lse(docs[0], q_all, False, s)]
    if "doc_to_doc" in dirs:
        parts["doc_to_doc"] = [lse(docs[0], d_all[k], True, s) for k in range(k_cols)]
    parts = {key: [p for p in v if p is not None] for key, v in parts.items()}
    if partition_mode == "joint":
        log_z = _lse_all([p for v in parts.values() for p in v])
    else:
        log_z = sum(_lse_all(v) for v in parts.values()) / len(parts)
    return (log_z - s * pos).sum() * per_rank


# ----------------------------------------------------------------------------------------------
# the classes
# ----------------------------------------------------------------------------------------------


class MultipleNegativesRankingLoss(nn.Module):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` (InfoNCE with in-batch negatives) on
    the fused core op: the same constructor and ``forward(sentence_features, labels)``, no B x B matrix.

    Args:
        model: the ``SentenceTransformer`` (``model(features)["sentence_embedding"]`` gives [B, D]).
        scale: multiplier of the similarities (``1 / temperature``), default 20.0; > 0 (as theirs).
        similarity_fct: ``sentence_transformers.util.cos_sim`` (default) or ``dot_score`` (fused); any
            other runs sentence-transformers' computation (one-time warning).
        gather_across_devices: gather queries and documents over ``torch.distributed`` ranks (this
            library's ``gather``); without an initialised process group the local batch is used.
        directions: tuple of "query_to_doc" (required), "query_to_query", "doc_to_query", "doc_to_doc".
        partition_mode: "joint" (one softmax over all directions) or "per_direction" (mean of one
            log-partition per direction; not with "query_to_query" / "doc_to_doc").
        hardness_mode: None, "in_batch_negatives", "hard_negatives" or "all_negatives": adds
            ``hardness_strength * sim`` (no gradient) to those negative logits.
        hardness_strength: >= 0 (0 disables the penalty).

    Inputs: (anchor, positive[, negative_1, ...]) columns, labels unused. Returns a 0-dim loss
    (float32; float64 for a float64 model). The backend is "auto" (Triton on CUDA, PyTorch on CPU;
    env ``FUSED_CONTRASTIVE_BACKEND`` overrides it).
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        super().__init__()
        try:
            _check_scale_as_theirs(scale)
            directions = _check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
        except (TypeError, ValueError, RuntimeError) as ours:
            _raise_as_theirs(ours, _st_losses.MultipleNegativesRankingLoss, model, scale=scale,
                             similarity_fct=similarity_fct, gather_across_devices=gather_across_devices,
                             directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
                             hardness_strength=hardness_strength)
        self.model = model
        self.scale = scale
        self.similarity_fct = similarity_fct
        self.gather_across_devices = gather_across_devices
        self.directions = directions
        self.partition_mode = partition_mode
        self.hardness_mode = hardness_mode
        self.hardness_strength = hardness_strength

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        return self.compute_loss_from_embeddings(_embed_columns(self.model, sentence_features), labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """The loss of the column embeddings ``[anchors, positives, negatives...]`` (each [B, D])."""
        reason = _unfused_reason(self.scale, self.similarity_fct, pairwise=False)
        if reason is not None:
            peer = _peer_computation(
                self, _st_losses.MultipleNegativesRankingLoss, reason, scale=self.scale,
                similarity_fct=self.similarity_fct, gather_across_devices=self.gather_across_devices,
                directions=self.directions, partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
                hardness_strength=self.hardness_strength)
            return peer.compute_loss_from_embeddings(embeddings, labels)
        if len(embeddings) < 2:
            raise ValueError(f"{type(self).__name__} needs at least 2 input columns (anchor, positive), "
                             f"got {len(embeddings)}")
        return mnrl_from_embeddings(
            embeddings[0], embeddings[1:], scale=self.scale, normalize=_normalize_of(self.similarity_fct, False),
            directions=self.directions, partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength, group=_group(self.gather_across_devices))

    def leveled_loss(self, embeddings: list[Tensor], labels: Tensor | None, dims: Sequence[int],
                     weights: Sequence[float]) -> Tensor:
        """``sum_k weights[k] * loss(shrink(embeddings, dims[k]))`` (what :class:`MatryoshkaLoss` computes):
        every level in one pass over D where the fused loss is one core-op call, else one call per level
        (sentence-transformers' own computation for options outside the kernels)."""
        reason = _unfused_reason(self.scale, self.similarity_fct, pairwise=False)
        if reason is not None or len(embeddings) < 2:
            return _per_level(self.compute_loss_from_embeddings, embeddings, labels, dims, weights)
        return mnrl_from_embeddings(
            embeddings[0], embeddings[1:], scale=self.scale, normalize=_normalize_of(self.similarity_fct, False),
            directions=self.directions, partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength, group=_group(self.gather_across_devices),
            matryoshka_dims=dims, matryoshka_weights=weights)

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "similarity_fct": _fct_name(self.similarity_fct),
            "gather_across_devices": self.gather_across_devices,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
        }

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def citation(self) -> str:
        return _CITE_INFONCE


class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss):
    """sentence-transformers' (deprecated) ``MultipleNegativesSymmetricRankingLoss``: the query-to-doc
    and doc-to-query cross-entropies averaged (``directions=("query_to_doc", "doc_to_query")``,
    ``partition_mode="per_direction"``); hard-negative columns are candidates of the first only."""

    def __init__(self, model: nn.Module, scale: float = 20.0,
                 similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
                 gather_across_devices: bool = False) -> None:
        super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                         gather_across_devices=gather_across_devices,
                         directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")


def _is_static_embedding(model) -> bool:
    model = getattr(model, "_orig_mod", model)
    try:
        first = model[0]
    except (TypeError, IndexError, KeyError):
        return False
    if type(first).__name__ == "Router":  # its input modules sit one level down (as theirs checks)
        return any(type(route[0]).__name__ == "StaticEmbedding" for route in first.sub_modules.values())
    return type(first).__name__ == "StaticEmbedding"


def _batch_size(features: dict[str, Any]) -> int:
    for key in ("input_ids", "attention_mask"):
        v = features.get(key)
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.shape[0]
    for v in features.values():
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.shape[0]
    raise ValueError("sentence_features holds no tensor with a batch dimension")


def _padded(features: dict[str, Any], n: int) -> bool:
    """Whether every batched tensor is indexed by example along dim 0 (a padded text batch): the
    splitting of :func:`_ranges` / :func:`_minibatch` applies. Flattened inputs (``cu_seq_lens_q``) and
    image tensors are split by sentence-transformers' helpers instead (:func:`_peer_split`)."""
    if "cu_seq_lens_q" in features:
        return False
    return all(v.shape[0] == n for v in features.values() if isinstance(v, Tensor) and v.dim() > 0)


def _peer_split(features: dict[str, Any], size: int, num_tokens: int | None) -> list[dict[str, Any]]:
    """The mini-batches sentence-transformers' cached losses make of inputs that are not a padded batch
    (flattened sequences, per-image tensors): their own helpers, so the split is theirs exactly."""
    try:
        from sentence_transformers.base.losses.gradcache import _create_minibatch, _minibatch_ranges
    except ImportError:  # pragma: no cover - sentence-transformers < 6.2 has no such inputs in its cached losses
        raise NotImplementedError("the cached loss splits flattened or image inputs with sentence-transformers "
                                  ">= 6.2's helpers; this version has none") from None
    return [_create_minibatch(features, b, e) for b, e in _minibatch_ranges(features, size, num_tokens)]


def _encode_opaque(encode: Callable[[dict[str, Any]], Tensor], features: dict[str, Any]) -> Tensor:
    """``encode(features)`` with its activations freed after the forward and recomputed in the backward
    (RNG state replayed), for a mini-batch whose tensors are not all indexed by example (what
    ``encode_in_chunks`` requires): one checkpointed call."""
    keys = [k for k, v in features.items() if isinstance(v, Tensor)]

    def run(*tensors: Tensor) -> Tensor:
        return encode({**features, **dict(zip(keys, tensors, strict=True))})

    if not torch.is_grad_enabled():
        return run(*(features[k] for k in keys))
    return _checkpoint.checkpoint(run, *(features[k] for k in keys), use_reentrant=False, preserve_rng_state=True)


def _ranges(features: dict[str, Any], n: int, size: int, num_tokens: int | None) -> list[tuple[int, int]]:
    """Mini-batches of ``size`` rows, or packed to at most ``num_tokens`` non-padding tokens each (at
    least one row each)."""
    if num_tokens is None:
        return [(i, min(i + size, n)) for i in range(0, n, size)]
    mask = features.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError("mini_batch_num_tokens needs the attention_mask of each input column")
    cum = mask.sum(dim=1).cumsum(dim=0).tolist()
    out, begin = [], 0
    while begin < n:
        before = cum[begin - 1] if begin else 0
        end = max(bisect.bisect_right(cum, before + num_tokens), begin + 1)
        out.append((begin, end))
        begin = end
    return out


def _minibatch(features: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
    """Rows ``[begin, end)`` of every batched tensor, without the trailing padding columns that every
    row of the mini-batch has."""
    mask = features.get("attention_mask")
    width = stop = None
    if isinstance(mask, Tensor) and mask.dim() == 2:
        width = mask.shape[1]
        active = mask[begin:end].bool().any(dim=0).nonzero()
        if active.numel():
            stop = int(active.max()) + 1
    out = {}
    for key, v in features.items():
        if not isinstance(v, Tensor) or v.dim() == 0:
            out[key] = v
        elif stop is not None and v.dim() >= 2 and v.shape[1] == width:
            out[key] = v[begin:end, :stop]
        else:
            out[key] = v[begin:end]
    return out


def _embed_cached(encode: Callable[[dict[str, Any]], Tensor], features: dict[str, Any], size: int,
                  num_tokens: int | None, progress: bool) -> Tensor:
    """[B, D] embeddings of one input column, mini-batch by mini-batch (``encode_in_chunks``: the
    activations of one mini-batch at a time, recomputed in the backward)."""
    n = _batch_size(features)
    outs = []
    if not _padded(features, n):
        for mb in tqdm.tqdm(_peer_split(features, size, num_tokens), desc="Embed mini-batches", disable=not progress):
            outs.append(_encode_opaque(encode, mb))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    for begin, end in tqdm.tqdm(_ranges(features, n, size, num_tokens), desc="Embed mini-batches",
                                disable=not progress):
        outs.append(encode_in_chunks(encode, _minibatch(features, begin, end), end - begin))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _joined(parts: Sequence[Tensor]) -> Tensor:
    """One column's mini-batch embeddings as one tensor: the tensor itself when there is one (a
    ``torch.cat`` of one tensor is a copy, held beside the original through the loss step)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


@contextlib.contextmanager
def _mini_batch_tiles(rows: int, columns: int):
    """The core op's logit tiles at most ``rows x columns`` elements inside the block (the tile budget, through
    the switchboard's ``routes.override(TILE_ELEMENTS=...)``: this process only, restored after the block; a
    smaller budget the user set with ``FUSED_CONTRASTIVE_TILE_ELEMENTS`` is kept). sentence-transformers' cached
    losses score ``mini_batch_size`` rows against every candidate column at a time; under this budget the fused
    loss's working set is that block too, instead of its default 2^21-element tiles (8 MiB each, several alive),
    which made the cached drop-ins hold more than the class they replace. The budget is read in the forward and
    the backward, so the block must hold both (:func:`_through_wrapper` back-propagates the loss inside it)."""
    budget = max(1, rows) * max(1, columns)
    if routes.setting("TILE_ELEMENTS") is not None:
        budget = min(budget, core.tile_elements())
    with routes.override(TILE_ELEMENTS=budget):
        yield


def _through_wrapper(calculate_loss: Callable, embeddings: list[Tensor], *rest) -> Tensor:
    """The gradient-cache step of a cached loss (GradCache, as sentence-transformers' cached losses):
    run ``calculate_loss`` (possibly replaced by a wrapper, sentence-transformers' MatryoshkaLoss) on
    detached leaves, which it back-propagates into at once (``with_backward=True``: the loss's graph and
    tiles are freed here, under the loss's own tile budget), then carry their gradients into the
    embeddings' graph (one more backward through the chunked encoder, when the caller's backward
    reaches it)."""
    leaves = [e.detach().requires_grad_() for e in embeddings]
    loss = calculate_loss([[x] for x in leaves], *rest, with_backward=True)
    link = loss.new_zeros(())
    for e, x in zip(embeddings, leaves, strict=True):
        if x.grad is not None:
            link = link + (e * x.grad).sum()
    return loss.detach() + (link - link.detach())


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss``: :class:`MultipleNegativesRankingLoss`
    with each input column embedded ``mini_batch_size`` rows at a time through
    :func:`fused_contrastive.encode_in_chunks`, so activation memory is one mini-batch's (the loss itself
    is O(B*D)). The same loss and parameter gradients as their GradCache implementation (each
    mini-batch's RNG state is replayed in the recompute, so dropout masks match); one extra encoder
    forward per step, like theirs.

    Args (beyond :class:`MultipleNegativesRankingLoss`'s):
        mini_batch_size: rows per embedding mini-batch (default 32).
        mini_batch_num_tokens: if set, mini-batches are packed to at most this many non-padding tokens
            (at least one row each) instead of ``mini_batch_size`` rows.
        show_progress_bar: a tqdm bar over the mini-batches of the forward.
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        show_progress_bar: bool = False,
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        # sentence-transformers' checks first, in their order and words (the symmetric class says
        # "CachedMultipleNegativesRankingLoss" too, as theirs)
        if _is_static_embedding(model):
            raise ValueError(
                "CachedMultipleNegativesRankingLoss is not compatible with a SentenceTransformer model based on a "
                "StaticEmbedding, whose inputs cannot be split into mini-batches along a batch dimension. "
                "Consider using MultipleNegativesRankingLoss instead.")
        if mini_batch_num_tokens is not None and mini_batch_num_tokens <= 0:
            raise ValueError("mini_batch_num_tokens must be a positive integer or None.")
        super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                         gather_across_devices=gather_across_devices, directions=directions,
                         partition_mode=partition_mode, hardness_mode=hardness_mode,
                         hardness_strength=hardness_strength)
        for name, v, optional in (("mini_batch_size", mini_batch_size, False),
                                  ("mini_batch_num_tokens", mini_batch_num_tokens, True)):
            if optional and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def _encode(self, features: dict[str, Any]) -> Tensor:
        return self.model(features)["sentence_embedding"]

    def embed_column(self, features: dict[str, Any]) -> Tensor:
        """[B, D] embeddings of one input column, mini-batch by mini-batch (``encode_in_chunks``)."""
        return _embed_cached(self._encode, features, self.mini_batch_size, self.mini_batch_num_tokens,
                             self.show_progress_bar)

    #: sentence-transformers' flag of a gradient-cache loss (``uses_gradient_cache``): its
    #: ``MatryoshkaLoss`` then wraps :meth:`calculate_loss` instead of patching ``model.forward`` (which
    #: would clash with the recompute of the mini-batches), and ``AdaptiveLayerLoss`` warns, as for theirs.
    uses_gradient_cache: bool = True

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None, *,
                       with_backward: bool = False) -> Tensor:
        """sentence-transformers' gradient-cache protocol: the loss of the batch from its per-column lists
        of mini-batch embeddings ``reps[column][minibatch]`` [b, D]; with ``with_backward`` the loss is
        back-propagated into ``reps`` and returned detached."""
        embeddings = [_joined(mbs) for mbs in reps]
        with self.loss_tiles(embeddings):
            loss = self.compute_loss_from_embeddings(embeddings, labels)
            if with_backward:
                loss.backward()
                return loss.detach()
        return loss

    def loss_tiles(self, embeddings: Sequence[Tensor]):
        """The tile budget of the loss step (:func:`_mini_batch_tiles`): ``mini_batch_size`` rows against
        every candidate column (the documents' columns, or the batch for the other directions), the block
        sentence-transformers' class scores at a time."""
        b = embeddings[0].shape[0]
        return _mini_batch_tiles(self.mini_batch_size, max(b, b * (len(embeddings) - 1)))

    def leveled_loss(self, embeddings: list[Tensor], labels: Tensor | None, dims: Sequence[int],
                     weights: Sequence[float]) -> Tensor:
        """:meth:`MultipleNegativesRankingLoss.leveled_loss` as a gradient-cache step (the loss
        back-propagated into the embeddings at once, under :meth:`loss_tiles`)."""
        base = super().leveled_loss

        def step(reps: list[list[Tensor]], labels, *, with_backward: bool = False) -> Tensor:
            leaves = [_joined(m) for m in reps]
            with self.loss_tiles(leaves):
                loss = base(leaves, labels, dims, weights)
                if with_backward:
                    loss.backward()
                    return loss.detach()
            return loss

        if not torch.is_grad_enabled():
            return step([[e] for e in embeddings], labels)
        return _through_wrapper(step, embeddings, labels)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        features = list(sentence_features)
        if len(features) < 2:
            raise ValueError(f"{type(self).__name__} needs at least 2 input columns (anchor, positive), "
                             f"got {len(features)}")
        embeddings = [self.embed_column(f) for f in features]
        if not torch.is_grad_enabled():  # evaluation: no backward
            return self.calculate_loss([[e] for e in embeddings], labels)
        return _through_wrapper(self.calculate_loss, embeddings, labels)

    def get_config_dict(self) -> dict[str, Any]:
        out = super().get_config_dict()
        out["mini_batch_size"] = self.mini_batch_size
        out["mini_batch_num_tokens"] = self.mini_batch_num_tokens
        return out

    @property
    def citation(self) -> str:
        return _CITE_GRADCACHE


class CachedMultipleNegativesSymmetricRankingLoss(CachedMultipleNegativesRankingLoss):
    """sentence-transformers' (deprecated) ``CachedMultipleNegativesSymmetricRankingLoss``: the cached loss
    with ``directions=("query_to_doc", "doc_to_query")``, ``partition_mode="per_direction"``."""

    def __init__(self, model: nn.Module, scale: float = 20.0,
                 similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
                 mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None,
                 gather_across_devices: bool = False, show_progress_bar: bool = False) -> None:
        super().__init__(model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size,
                         mini_batch_num_tokens=mini_batch_num_tokens, gather_across_devices=gather_across_devices,
                         directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
                         show_progress_bar=show_progress_bar)


class CoSENTLoss(nn.Module):
    """sentence-transformers' ``CoSENTLoss`` on :func:`fused_contrastive.cosent_loss`:
    ``log(1 + sum_{y_a > y_b} exp(scale (sim_b - sim_a)))`` over the pairs of the batch, O(B log B).

    Args:
        model: the ``SentenceTransformer``.
        scale: default 20.0 (``<= 0``: sentence-transformers' computation, one-time warning).
        similarity_fct: ``sentence_transformers.util.pairwise_cos_sim`` (default) or ``pairwise_dot_score``
            (fused); any other runs sentence-transformers' computation (one-time warning).

    Inputs: (sentence_A, sentence_B) columns and [B] float similarity labels (only their order
    matters). Returns a 0-dim loss (float32; float64 for a float64 model).
    """

    def __init__(self, model: nn.Module, scale: float = 20.0,
                 similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.pairwise_cos_sim) -> None:
        super().__init__()
        _check_scale(scale)
        self.model = model
        self.scale = scale
        self.similarity_fct = similarity_fct

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        return self.compute_loss_from_embeddings(_embed_columns(self.model, sentence_features), labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        reason = _unfused_reason(self.scale, self.similarity_fct, pairwise=True)
        if reason is not None:
            peer = _peer_computation(self, _st_losses.CoSENTLoss, reason, scale=self.scale,
                                     similarity_fct=self.similarity_fct)
            return peer.compute_loss_from_embeddings(embeddings, labels)
        if len(embeddings) < 2:
            raise ValueError(f"CoSENTLoss needs 2 input columns, got {len(embeddings)}")
        b = embeddings[0].shape[0]
        if not isinstance(labels, Tensor) or labels.numel() != b:
            shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"CoSENTLoss expects {b} labels (one per pair), got {shape}")
        labels = labels.reshape(-1)
        if labels.dtype == torch.bool:
            labels = labels.int()
        return cosent_loss(embeddings[0], embeddings[1], labels, scale=self.scale,
                           normalize=_normalize_of(self.similarity_fct, True))

    def leveled_loss(self, embeddings: list[Tensor], labels: Tensor, dims: Sequence[int],
                     weights: Sequence[float]) -> Tensor:
        """``sum_k weights[k] * loss(shrink(embeddings, dims[k]))`` (see :class:`MatryoshkaLoss`)."""
        reason = _unfused_reason(self.scale, self.similarity_fct, pairwise=True)
        if reason is not None or len(embeddings) < 2:
            return _per_level(self.compute_loss_from_embeddings, embeddings, labels, dims, weights)
        b = embeddings[0].shape[0]
        if not isinstance(labels, Tensor) or labels.numel() != b:
            return self.compute_loss_from_embeddings(embeddings, labels)  # its error names the labels
        labels = labels.reshape(-1)
        if labels.dtype == torch.bool:
            labels = labels.int()
        return cosent_loss(embeddings[0], embeddings[1], labels, scale=self.scale,
                           normalize=_normalize_of(self.similarity_fct, True), matryoshka_dims=list(dims),
                           matryoshka_weights=list(weights))

    def get_config_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "similarity_fct": _fct_name(self.similarity_fct)}

    @property
    def citation(self) -> str:
        return _CITE_COSENT


def _check_gist(model, guide, margin_strategy) -> bool:
    """sentence-transformers' constructor checks of the GIST losses; whether the guide must re-tokenise
    (another vocabulary, or a shorter ``max_seq_length``)."""
    if not hasattr(model, "tokenizer") or not hasattr(guide, "tokenizer"):
        raise ValueError("Both the training model and the guiding model must have a tokenizer attribute.")
    if not isinstance(model.tokenizer, PreTrainedTokenizerBase) or not isinstance(guide.tokenizer,
                                                                                  PreTrainedTokenizerBase):
        raise ValueError("Both the training model and the guiding model must use a PreTrainedTokenizer from "
                         "transformers.")
    if margin_strategy not in ("absolute", "relative"):
        raise ValueError("margin_strategy must be 'absolute' or 'relative'.")
    return (model.tokenizer.get_vocab() != guide.tokenizer.get_vocab()
            or guide.max_seq_length < model.max_seq_length)


class GISTEmbedLoss(nn.Module):
    """sentence-transformers' ``GISTEmbedLoss`` (guided in-batch negatives) on
    :func:`fused_contrastive.gist_loss`: the anchor-positive, anchor-anchor, positive-positive and
    anchor-negative blocks in one merged-softmax pass whose exclusion mask is computed per tile from the
    guide's embeddings; none of their 8 B x B matrices is built.

    Args (sentence-transformers 6.2's): ``model``, ``guide`` (a frozen SentenceTransformer; when its
    tokenizer's vocabulary differs, or its ``max_seq_length`` is shorter, the inputs are decoded and
    re-tokenised for it, as theirs), ``temperature`` (0.01), ``margin_strategy`` ("absolute" |
    "relative"), ``margin`` (0.0), ``contrast_anchors`` / ``contrast_positives`` (True),
    ``gather_across_devices`` (this library's gather; see the module docstring).

    Inputs: 2 (anchor, positive) or 3 (anchor, positive, negative) columns, as theirs.
    """

    def __init__(self, model: nn.Module, guide: nn.Module, temperature: float = 0.01,
                 margin_strategy: Literal["absolute", "relative"] = "absolute", margin: float = 0.0,
                 contrast_anchors: bool = True, contrast_positives: bool = True,
                 gather_across_devices: bool = False) -> None:
        super().__init__()
        self.model = model
        self.guide = guide
        self.temperature = temperature
        self.must_retokenize = _check_gist(model, guide, margin_strategy)
        if self.must_retokenize:
            self.tokenizer = model.tokenizer
            if _is_static_embedding(model) and not isinstance(self, CachedGISTEmbedLoss):
                raise ValueError("If we must retokenize because the guide model has a different tokenizer, "
                                 "then the Sentence Transformer model must not be based on a StaticEmbedding.")
        self.margin_strategy = margin_strategy
        self.margin = margin
        self.contrast_anchors = contrast_anchors
        self.contrast_positives = contrast_positives
        self.gather_across_devices = gather_across_devices

    def _columns(self, n: int) -> None:
        if n not in (2, 3):
            raise ValueError(f"Expected 2 or 3 embeddings, got {n}")

    def guide_features(self, features: dict[str, Any]) -> dict[str, Any]:
        """The guide's inputs for one column: the same features, or the decoded texts re-tokenised."""
        if not self.must_retokenize:
            return dict(features)
        input_ids = features["input_ids"]
        if "cu_seq_lens_q" in features:
            flat = input_ids[0].tolist()
            cu = features["cu_seq_lens_q"].tolist()
            input_ids = [flat[b:e] for b, e in zip(cu[:-1], cu[1:], strict=True)]
        decoded = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        return _st_util.batch_to_device(self.guide.preprocess(decoded), self.guide.device)

    def embed_guide(self, features: dict[str, Any]) -> Tensor:
        """[B, Dg] guide embeddings of one column (no gradient)."""
        with torch.no_grad():
            return self.guide(self.guide_features(features))["sentence_embedding"]

    def embed(self, features: list[dict[str, Any]]) -> tuple[list[Tensor], list[Tensor]]:
        """(model embeddings, guide embeddings) of every column."""
        embeddings = _embed_columns(self.model, features)
        with torch.no_grad():
            guides = _embed_columns(self.guide, [self.guide_features(f) for f in features])
        return list(embeddings), list(guides)

    def loss_from_embeddings(self, embeddings: Sequence[Tensor], guides: Sequence[Tensor], *,
                             matryoshka_dims: Sequence[int] | None = None,
                             matryoshka_weights: Sequence[float] | None = None) -> Tensor:
        """The loss of model embeddings ``[anchor, positive, *negatives]`` and the guide's of the same."""
        neg = list(embeddings[2:]) or None
        gneg = list(guides[2:]) or None
        return gist_loss(embeddings[0], embeddings[1], neg,
                         guide=(guides[0], guides[1], gneg) if neg else (guides[0], guides[1]),
                         temperature=self.temperature, margin_strategy=self.margin_strategy, margin=self.margin,
                         contrast_anchors=self.contrast_anchors, contrast_positives=self.contrast_positives,
                         gather=_group(self.gather_across_devices) or False,
                         # theirs gathers only the candidates: each rank's anchor-anchor block stays local
                         anchor_anchor="local",
                         matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights)

    def leveled_forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None,
                        dims: Sequence[int], weights: Sequence[float]) -> Tensor:
        """``sum_k w_k loss(shrink(embeddings, d_k))``, the guide's mask the same at every level
        (what sentence-transformers' ``MatryoshkaLoss`` computes around this loss): the columns and the
        guide embedded once."""
        features = list(sentence_features)
        self._columns(len(features))
        embeddings, guides = self.embed(features)
        return self.loss_from_embeddings(embeddings, guides, matryoshka_dims=dims, matryoshka_weights=weights)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        features = list(sentence_features)
        self._columns(len(features))
        embeddings, guides = self.embed(features)
        return self.loss_from_embeddings(embeddings, guides)

    def get_config_dict(self) -> dict[str, Any]:
        return {"guide": self.guide, "temperature": self.temperature, "margin_strategy": self.margin_strategy,
                "margin": self.margin, "contrast_anchors": self.contrast_anchors,
                "contrast_positives": self.contrast_positives, "gather_across_devices": self.gather_across_devices}

    @property
    def citation(self) -> str:
        return _CITE_GIST


class CachedGISTEmbedLoss(GISTEmbedLoss):
    """sentence-transformers' ``CachedGISTEmbedLoss``: :class:`GISTEmbedLoss` with the model's columns
    embedded ``mini_batch_size`` rows (or ``mini_batch_num_tokens`` tokens) at a time through
    :func:`fused_contrastive.encode_in_chunks` (activation memory of one mini-batch, the loss O(B*D)),
    the guide embedded mini-batch by mini-batch without gradient, any number of negative columns (as
    theirs). The same loss and parameter gradients as their gradient-cache implementation.

    Args: those of :class:`GISTEmbedLoss` plus ``mini_batch_size`` (32), ``mini_batch_num_tokens``
    (None) and ``show_progress_bar`` (False), in sentence-transformers' order.
    """

    def __init__(self, model: nn.Module, guide: nn.Module, temperature: float = 0.01, mini_batch_size: int = 32,
                 mini_batch_num_tokens: int | None = None, show_progress_bar: bool = False,
                 margin_strategy: Literal["absolute", "relative"] = "absolute", margin: float = 0.0,
                 contrast_anchors: bool = True, contrast_positives: bool = True,
                 gather_across_devices: bool = False) -> None:
        if _is_static_embedding(model):
            raise ValueError("CachedGISTEmbedLoss is not compatible with a SentenceTransformer model based on a "
                             "StaticEmbedding. Consider using GISTEmbedLoss instead.")
        if mini_batch_num_tokens is not None and (isinstance(mini_batch_num_tokens, bool)
                                                  or not isinstance(mini_batch_num_tokens, int)
                                                  or mini_batch_num_tokens < 1):
            raise ValueError(f"mini_batch_num_tokens must be a positive integer or None, got {mini_batch_num_tokens!r}")
        # theirs fails at forward with a raw range / index error; the drop-in says so at construction
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int):
            raise TypeError(f"mini_batch_size must be an int, got {type(mini_batch_size).__name__}")
        if mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
        super().__init__(model, guide, temperature=temperature, margin_strategy=margin_strategy, margin=margin,
                         contrast_anchors=contrast_anchors, contrast_positives=contrast_positives,
                         gather_across_devices=gather_across_devices)
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    #: sentence-transformers' flag of a gradient-cache loss (its wrappers read it).
    uses_gradient_cache: bool = True

    def _columns(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"CachedGISTEmbedLoss needs at least 2 input columns (anchor, positive), got {n}")

    def _encode(self, features: dict[str, Any]) -> Tensor:
        return self.model(features)["sentence_embedding"]

    def embed(self, features: list[dict[str, Any]]) -> tuple[list[Tensor], list[Tensor]]:
        embeddings = [_embed_cached(self._encode, f, self.mini_batch_size, self.mini_batch_num_tokens,
                                    self.show_progress_bar) for f in features]
        from sentence_transformers.base.losses.gradcache import _create_minibatch, _minibatch_ranges
        guides = []
        with torch.no_grad():
            for f in features:
                parts = [self.embed_guide(_create_minibatch(f, b, e))
                         for b, e in _minibatch_ranges(f, self.mini_batch_size, self.mini_batch_num_tokens)]
                guides.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        return embeddings, guides

    def calculate_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *,
                       with_backward: bool = False) -> Tensor:
        """sentence-transformers' gradient-cache protocol: the loss from per-column lists of mini-batch
        embeddings ``reps[column][minibatch]`` and the guide's ``reps_guided``; with ``with_backward`` the
        loss is back-propagated into ``reps`` and returned detached."""
        return self._step(reps, reps_guided, with_backward)

    def _step(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], with_backward: bool,
              **levels) -> Tensor:
        """The loss step under :meth:`loss_tiles` (back-propagated into ``reps`` with ``with_backward``)."""
        embeddings = [_joined(m) for m in reps]
        with self.loss_tiles(embeddings):
            loss = self.loss_from_embeddings(embeddings, [_joined(m) for m in reps_guided], **levels)
            if with_backward:
                loss.backward()
                return loss.detach()
        return loss

    def loss_tiles(self, embeddings: Sequence[Tensor]):
        """The tile budget of the loss step (:func:`_mini_batch_tiles`): ``mini_batch_size`` rows against
        every column of the batch, the block sentence-transformers' class scores at a time."""
        return _mini_batch_tiles(self.mini_batch_size, embeddings[0].shape[0] * len(embeddings))

    def leveled_forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None,
                        dims: Sequence[int], weights: Sequence[float]) -> Tensor:
        """:meth:`GISTEmbedLoss.leveled_forward` as a gradient-cache step (see :meth:`forward`)."""
        features = list(sentence_features)
        self._columns(len(features))
        embeddings, guides = self.embed(features)
        levels = dict(matryoshka_dims=dims, matryoshka_weights=weights)
        if not torch.is_grad_enabled():
            return self._step([[e] for e in embeddings], [[g] for g in guides], False, **levels)

        def step(reps, reps_guided, *, with_backward: bool = False) -> Tensor:
            return self._step(reps, reps_guided, with_backward, **levels)

        return _through_wrapper(step, embeddings, [[g] for g in guides])

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        features = list(sentence_features)
        self._columns(len(features))
        embeddings, guides = self.embed(features)
        if not torch.is_grad_enabled():  # evaluation: no backward
            return self.calculate_loss([[e] for e in embeddings], [[g] for g in guides])
        return _through_wrapper(self.calculate_loss, embeddings, [[g] for g in guides])

    def get_config_dict(self) -> dict[str, Any]:
        # sentence-transformers' keys in their order (the model card lists them so)
        out = super().get_config_dict()
        head = {k: out.pop(k) for k in ("guide", "temperature")}
        return {**head, "mini_batch_size": self.mini_batch_size, "mini_batch_num_tokens": self.mini_batch_num_tokens,
                **out}


def _per_level(loss_fn: Callable, embeddings: list[Tensor], labels, dims: Sequence[int],
               weights: Sequence[float]) -> Tensor:
    """``sum_k w_k loss_fn(shrink(embeddings, d_k), labels)``: the levels as separate calls."""
    return sum(w * loss_fn([_levels.shrink(e, d) for e in embeddings], labels)
               for d, w in zip(dims, weights, strict=True))


class MatryoshkaLoss(nn.Module):
    """sentence-transformers' ``MatryoshkaLoss``: ``sum_k w_k loss(shrink(embeddings, d_k))`` with
    ``shrink(x, d) = F.normalize(x[..., :d])``, the same constructor and ``forward(sentence_features,
    labels)``.

    Args:
        model: the ``SentenceTransformer``.
        loss: the inner loss. This library's :class:`MultipleNegativesRankingLoss`,
            :class:`MultipleNegativesSymmetricRankingLoss`, their ``Cached`` variants and
            :class:`CoSENTLoss` are fused: the columns are embedded once (the cached ones mini-batch by
            mini-batch, as they do alone) and every level is computed from them in one pass over D
            (CoSENT: one pair-score call per level, O(B*D) each). Any other loss runs
            sentence-transformers' own ``MatryoshkaLoss`` (K calls of it; one-time warning).
        matryoshka_dims: the truncation dimensions, e.g. ``[768, 512, 256, 128, 64]`` (any order; each
            in [1, embedding dimension], distinct).
        matryoshka_weights: one weight per dimension (None: all 1).
        n_dims_per_step: > 0 (and fewer than the dims): that many levels sampled per step with Python's
            ``random.sample``, as sentence-transformers does; -1 (default): every level.

    Attributes ``matryoshka_dims`` / ``matryoshka_weights`` are sorted by decreasing dimension, as theirs.
    """

    def __init__(self, model: nn.Module, loss: nn.Module, matryoshka_dims: Sequence[int],
                 matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
                 n_dims_per_step: int = -1) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        if not matryoshka_dims:
            raise ValueError("You must provide at least one dimension in matryoshka_dims.")
        if any(dim <= 0 for dim in matryoshka_dims):
            raise ValueError("All dimensions passed to a matryoshka loss must be > 0.")
        if matryoshka_weights is None:
            matryoshka_weights = [1] * len(matryoshka_dims)
        elif len(matryoshka_weights) != len(matryoshka_dims):
            raise ValueError("matryoshka_weights must be the same length as matryoshka_dims.")
        get_dim = getattr(model, "get_embedding_dimension", None)
        full = get_dim() if callable(get_dim) else None
        if full is not None and any(d > full for d in matryoshka_dims):
            raise ValueError(f"Dimensions in matryoshka_dims cannot exceed the model's embedding dimension of "
                             f"{full}.")
        # this library's own (theirs accepts a repeated dimension: it counts that level twice)
        if len(set(matryoshka_dims)) != len(matryoshka_dims):
            raise ValueError(f"matryoshka_dims must not repeat a dimension, got {list(matryoshka_dims)}")
        if full is not None:
            if full not in matryoshka_dims:
                warnings.warn(f"The model's embedding dimension {full} is not included in matryoshka_dims: "
                              f"{list(matryoshka_dims)}; the full dimension is not trained", stacklevel=2)
        pairs = sorted(zip(matryoshka_dims, matryoshka_weights, strict=True), key=lambda x: x[0], reverse=True)
        self.matryoshka_dims = tuple(d for d, _ in pairs)
        self.matryoshka_weights = tuple(w for _, w in pairs)
        self.n_dims_per_step = n_dims_per_step
        self.fused = isinstance(loss, (MultipleNegativesRankingLoss, CoSENTLoss, GISTEmbedLoss))
        self.__dict__["_peer"] = None
        if not self.fused:
            if ("MatryoshkaLoss", type(loss).__name__) not in _WARNED:
                _WARNED.add(("MatryoshkaLoss", type(loss).__name__))
                warnings.warn(f"MatryoshkaLoss: the inner loss {type(loss).__name__} is not one of "
                              "fused_contrastive's, so sentence-transformers' own MatryoshkaLoss runs it (one "
                              "loss call per dimension)", stacklevel=2)
            self.__dict__["_peer"] = _st_losses.MatryoshkaLoss(model, loss, list(matryoshka_dims),
                                                               list(matryoshka_weights), n_dims_per_step)

    def levels(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The ``(dims, weights)`` of this step: all of them, or ``n_dims_per_step`` sampled with
        ``random.sample`` (sorted by position for the uncached inner losses, as sentence-transformers)."""
        idx = list(range(len(self.matryoshka_dims)))
        if 0 < self.n_dims_per_step < len(idx):
            idx = random.sample(idx, self.n_dims_per_step)
            if not isinstance(self.loss, (CachedMultipleNegativesRankingLoss, CachedGISTEmbedLoss)):
                idx.sort()
        return tuple(self.matryoshka_dims[i] for i in idx), tuple(self.matryoshka_weights[i] for i in idx)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        peer = self.__dict__["_peer"]
        if peer is not None:
            return peer(sentence_features, labels)
        dims, weights = self.levels()
        features = list(sentence_features)
        if isinstance(self.loss, GISTEmbedLoss):
            return self.loss.leveled_forward(features, labels, dims, weights)
        if isinstance(self.loss, CachedMultipleNegativesRankingLoss):
            embeddings = [self.loss.embed_column(f) for f in features]
        else:
            embeddings = _embed_columns(self.model, features)
        return self.loss.leveled_loss(list(embeddings), labels, dims, weights)

    def get_config_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.__class__.__name__, "matryoshka_dims": self.matryoshka_dims,
                "matryoshka_weights": self.matryoshka_weights, "n_dims_per_step": self.n_dims_per_step}

    @property
    def citation(self) -> str:
        return _CITE_MATRYOSHKA


_CITE_MATRYOSHKA = """
@misc{kusupati2024matryoshka,
    title={Matryoshka Representation Learning},
    author={Aditya Kusupati and Gantavya Bhatt and Aniket Rege and Matthew Wallingford and Aditya Sinha and
            Vivek Ramanujan and William Howard-Snyder and Kaifeng Chen and Sham Kakade and Prateek Jain and
            Ali Farhadi},
    year={2024},
    eprint={2205.13147},
    archivePrefix={arXiv},
}
"""

_CITE_GIST = """
@misc{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Aivin V. Solatorio},
    year={2024},
    eprint={2402.16829},
    archivePrefix={arXiv},
}
"""

_CITE_INFONCE = """
@misc{oord2018cpc,
    title={Representation Learning with Contrastive Predictive Coding},
    author={Aaron van den Oord and Yazhe Li and Oriol Vinyals},
    year={2018},
    eprint={1807.03748},
    archivePrefix={arXiv},
}
"""

_CITE_GRADCACHE = """
@misc{gao2021gradcache,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
}
"""

_CITE_COSENT = """
@online{su2022cosent,
    title={CoSENT: A more efficient sentence vector scheme than Sentence-BERT},
    author={Jianlin Su},
    year={2022},
    url={https://kexue.fm/archives/8847},
}
"""


from .sentence_transformers_multi_vector import (  # noqa: E402, F401 - the late-interaction drop-ins, re-exported
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
