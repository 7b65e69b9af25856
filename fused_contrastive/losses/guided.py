"""Guided in-batch negatives (GISTEmbed) and duplicate masking by id, on the merged-block core
(``core/guided/torch_blocks.py``): the exclusion mask is computed inside each logit tile from a guide tile (or an
id compare), never stored, and several column blocks merge into one softmax per row.

GISTEmbed (Solatorio 2024; sentence-transformers' ``GISTEmbedLoss``), for anchors ``a``, positives
``p`` (global row ``o + i`` of the batch gathered over ranks), optional hard negatives ``n^k``, a frozen
guide model's embeddings ``ga, gp, gn^k``, ``gpos_i = cos(ga_i, gp_{o+i})`` and the threshold
``theta_i = gpos_i - margin`` ("absolute") or ``gpos_i - |gpos_i| margin`` ("relative")::

    row i = [ a_i . p_j | a_i . a_j | p_{o+i} . p_j | a_i . n^k_j ] / temperature   (cosines)
    a column is dropped (-inf) when the guide's cosine of the same pair is > theta_i, except
    column o + i of the first block (the positive)
    loss  = mean_i  CE(row i, target o + i)

With ``label_smoothing = e`` the cross-entropy is ``F.cross_entropy``'s smoothed one over the columns row i
keeps (``C_i``, the dropped ones deleted: the textbook form with -inf columns would return inf):
``CE_i - e (mean_{j in C_i} l_ij - l_{i, o+i})``.

The second and third blocks are ``contrast_anchors`` / ``contrast_positives`` (on by default). A row
whose every other column is dropped keeps only its positive and contributes 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from .. import distributed as D
from .._amp import autocast_off
from .._backend import resolve
from ..core.guided.torch_blocks import Block, Masks, merged_lse, threshold_of
from ..core.reference import smoothed_cross_entropy
from ..core.spec import compute_dtype
from ._levels import leveled
from ._scope import EPS, Scope

__all__ = ["gist_loss"]

MARGIN_STRATEGIES = ("absolute", "relative")
#: ``gist_loss(anchor_anchor=)``: the anchor-anchor block's columns under ``gather``
ANCHOR_ANCHOR = ("global", "local")


#: ``theta_i`` from ``gpos_i`` (``core.guided.torch_blocks.threshold_of``). ``gpos_i`` itself is never a separate dot
#: product: every backend reads it from the target entry of the same guide products it is compared with
#: (``Masks.rule``; ``_dense`` here), so an exact duplicate of the positive ties exactly and is kept
#: (strict ``>``), as in sentence-transformers' ``GISTEmbedLoss``.
guide_threshold = threshold_of


def _unit(g: Tensor) -> Tensor:
    return F.normalize(g.detach().to(compute_dtype(g)), dim=1, eps=EPS)




def _columns(name: str, x, b: int | None, d: int, dev) -> list[Tensor]:
    """A tensor or a sequence of tensors [rows, d] (``b`` rows when given) as a list."""
    xs = [x] if isinstance(x, Tensor) else list(x)
    out = []
    for k, t in enumerate(xs):
        nm = name if isinstance(x, Tensor) else f"{name}[{k}]"
        t = V.embeddings(nm, t)
        if t.shape[1] != d:
            raise ValueError(f"{nm} must have {d} columns (the embedding dimension), got {t.shape[1]}")
        if b is not None and t.shape[0] != b:
            raise ValueError(f"{nm} must have {b} rows (one per anchor), got {t.shape[0]}")
        V.same_device(anchors=torch.empty(0, device=dev), **{nm: t})
        out.append(t)
    return out


@D.agreed
@leveled("anchors", "positives", "negatives", one_pass=False)
@autocast_off
def gist_loss(
    anchors: Tensor,
    positives: Tensor,
    negatives: Tensor | Sequence[Tensor] | None = None,
    *,
    guide: Sequence[Tensor | Sequence[Tensor]],
    temperature=0.01,
    margin_strategy: str = "absolute",
    margin: float = 0.0,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    gather=False,
    anchor_anchor: str = "global",
    label_smoothing: float = 0.0,
    _levels=None,
) -> Tensor:
    """GISTEmbed loss (guided in-batch negatives; module docstring has the math) without the B x B
    similarity matrices: one merged-softmax pass with the guide mask computed per tile.

    Args:
        anchors: [B, D].
        positives: [B, D] (row i is anchor i's positive).
        negatives: None, [M, D] or a sequence of [M_k, D] hard-negative columns.
        guide: the frozen guide model's embeddings of the same texts, ``(guide_anchors [B, Dg],
            guide_positives [B, Dg][, guide_negatives])`` with the negatives' guide laid out like
            ``negatives``. No gradient flows into them. Dg may differ from D.
        temperature: softmax temperature (default 0.01, as sentence-transformers); a float or a 0-dim
            tensor (differentiable).
        margin_strategy / margin: ``"absolute"`` drops a column when its guide cosine is
            ``> gpos_i - margin``; ``"relative"`` when ``> gpos_i - |gpos_i| * margin``.
        contrast_anchors / contrast_positives: include the anchor-anchor / positive-positive blocks.
        normalize: cosine (True) or raw dot products (False) for the model's logits (the guide always
            uses the cosine).
        reduction: "mean" (default), "sum" or "none" ([B] per-anchor losses).
        backend: "auto" (triton on CUDA), "torch" (the eager PyTorch sweep, O(B*D) memory), "triton"
            (one fused kernel call per block, the guide tile computed in the kernel; float32 / 16-bit)
            or "reference" (materialises the matrices: the definition). Under ``torch.compile`` /
            ``torch.export`` the same backend runs as the registered operator
            ``fused_contrastive::merged_lse`` (O(B*D) memory, dynamic B).
        gather: gather positives and negatives (and their guide embeddings) over ranks, and the
            anchors for the anchor-anchor block (``anchor_anchor``); rows stay local. The rank average
            is the loss of the global batch and DDP gives its gradients exactly.
        anchor_anchor: the anchor-anchor block's columns under ``gather``: ``"global"`` (default: every
            rank's anchors, the global-batch loss) or ``"local"`` (this rank's anchors only:
            sentence-transformers' ``GISTEmbedLoss(gather_across_devices=True)``, which gathers only the
            candidates; the drop-ins pass it). No effect without ``gather`` or ``contrast_anchors``.
        label_smoothing: ``F.cross_entropy``'s, in [0, 1) (default 0): each row's target becomes
            ``(1 - eps) onehot + eps / |C_i|`` over the columns ``C_i`` its softmax keeps (the guide's dropped
            candidates deleted, not given ``eps / M`` at ``-inf``). Accumulated in the same sweep (the kept
            count and logit sum per row, in the Triton kernels' registers on backend="triton").

    Also ``matryoshka_dims`` / ``matryoshka_weights`` / ``return_level_losses``: the model embeddings
    are truncated and re-normalised per level, the guide mask is the same at every level (one call
    per level).

    Returns:
        0-dim loss (mean / sum) or [B] (none), float32 (float64 for float64 inputs). A row whose guide
        embedding or threshold is not finite has a NaN loss.
    """
    anchors = V.embeddings("anchors", anchors)
    b, d = anchors.shape
    dev = anchors.device
    positives = _columns("positives", positives, b, d, dev)[0]
    negs = [] if negatives is None else _columns("negatives", negatives, None, d, dev)
    if isinstance(guide, Tensor) or not isinstance(guide, Sequence) or len(guide) not in (2, 3):
        raise TypeError("guide must be a sequence (guide_anchors, guide_positives[, guide_negatives])")
    if (len(guide) == 3 and guide[2] is not None) != bool(negs):
        raise ValueError("guide must hold guide_negatives exactly when negatives are given")
    ga = V.embeddings("guide[0] (guide_anchors)", guide[0])
    if ga.shape[0] != b:
        raise ValueError(f"guide[0] (guide_anchors) must have {b} rows, got {ga.shape[0]}")
    dg = ga.shape[1]
    gp = _columns("guide[1] (guide_positives)", guide[1], b, dg, dev)[0]
    gn = _columns("guide[2] (guide_negatives)", guide[2], None, dg, dev) if negs else []
    if len(gn) != len(negs) or any(x.shape[0] != y.shape[0] for x, y in zip(gn, negs, strict=False)):
        raise ValueError("guide[2] (guide_negatives) must match negatives tensor for tensor, row for row")
    V.same_device(anchors=anchors, guide_anchors=ga)
    for name, x in (("positives", positives), *(("negatives", x) for x in negs)):
        V.same_precision("anchors", anchors, name, x)
    # one guide model, one dtype: parts given in different dtypes (a cast on one side) compute in the widest
    gdt = ga.dtype
    for x in (gp, *gn):
        gdt = torch.promote_types(gdt, x.dtype)
    ga, gp, gn = ga.to(gdt), gp.to(gdt), [x.to(gdt) for x in gn]
    margin_strategy = V.choice("margin_strategy", margin_strategy, MARGIN_STRATEGIES)
    margin = V.number("margin", margin, low=-math.inf, strict=True)
    anchor_anchor = V.choice("anchor_anchor", anchor_anchor, ANCHOR_ANCHOR)
    for name, v in (("contrast_anchors", contrast_anchors), ("contrast_positives", contrast_positives),
                    ("normalize", normalize)):
        V.flag(name, v)
    reduction = V.reduction(reduction)
    eps = V.label_smoothing(label_smoothing)
    dt = compute_dtype(anchors, positives, *negs)
    s, _ = V.scale_of(temperature, None, 0.01, dt, dev)
    be = resolve(backend, anchors, positives)
    scope = Scope(gather)
    scope.agree(s)
    p_all, off, _ = scope.rows(positives, "positives")
    n_all = [scope.rows(x, "negatives")[0] for x in negs]
    # the anchor-anchor block's columns: every rank's anchors (the global batch) unless "local"
    aa_global = contrast_anchors and not scope.local and anchor_anchor == "global"
    a_all = scope.rows(anchors, "anchors")[0] if aa_global else anchors
    with torch.no_grad():
        gp_all = scope.rows(gp.detach(), "guide_positives")[0]
        gn_all = [scope.rows(x.detach(), "guide_negatives")[0] for x in gn]
        ga_all = scope.rows(ga.detach(), "guide_anchors")[0] if aa_global else ga
    _, n_total = scope.offset(b, dev)
    rule = (margin_strategy, margin)
    if be == "reference":
        per = _reference(anchors, p_all, n_all, ga, gp_all, gn_all, rule, s, off, contrast_anchors,
                         contrast_positives, normalize, a_all, ga_all, eps)
        return scope.reduce(per, reduction, n_total)
    xs = [anchors, p_all, *n_all]
    guides = [ga, gp_all, *gn_all]
    blocks = [Block(rows=0, cols=1, protect=True)]
    if contrast_anchors:
        if aa_global:  # this rank's anchors (rows) against the gathered ones (columns, tensor len(xs))
            xs.append(a_all)
            guides.append(ga_all)
        blocks.append(Block(rows=0, cols=len(xs) - 1 if aa_global else 0))
    if contrast_positives:
        blocks.append(Block(rows=1, cols=1, row_start=off))
    blocks += [Block(rows=0, cols=2 + k) for k in range(len(n_all))]
    masks = Masks(guides=tuple(guides), target=torch.arange(b, device=dev) + off, rule=rule)
    if reduction == "none":
        return merged_lse(xs, blocks, b, s, masks, normalize=normalize, eps=EPS, minus_target=True, backend=be,
                          label_smoothing=eps)
    per_n = reduction == "mean" and scope.local
    w = torch.full((b,), 1.0 / b if per_n else 1.0, dtype=dt, device=dev)
    out = merged_lse(xs, blocks, b, s, masks, normalize=normalize, eps=EPS, weights=w, minus_target=True,
                     backend=be, label_smoothing=eps)
    return out if per_n else scope.reduce(out, reduction, n_total)


@dataclass
class _DenseBlock:
    """One block of the materialised definition (``_dense``): rows, columns, their guides and ids."""

    rows: Tensor
    cols: Tensor
    g_rows: Tensor | None = None
    g_cols: Tensor | None = None
    id_rows: Tensor | None = None
    id_cols: Tensor | None = None
    protect: Tensor | None = None  # [N] each row's protected column
    exclude: int | None = None


def _dense(blocks: list[_DenseBlock], rule: tuple[str, float] | None, s, normalize: bool, target_block: int,
           target: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """The definition, materialised: the blocks' masked score matrices side by side and the
    cross-entropy of each row at column ``target`` of block ``target_block`` ([N]; smoothed over the finite
    columns with ``label_smoothing``, ``reference.smoothed_cross_entropy``), and the guide threshold.
    As sentence-transformers' ``GISTEmbedLoss``: ``theta_i`` (``rule`` = (strategy, margin)) is the target
    entry of block ``target_block``'s guide matrix, the very matrix (and entries) it is
    compared with, so an exact duplicate of the target ties and is kept."""
    dt = compute_dtype(blocks[0].rows, blocks[0].cols)
    gms = [None if blk.g_rows is None or rule is None else _unit(blk.g_rows) @ _unit(blk.g_cols).T
           for blk in blocks]
    theta = None
    if gms[target_block] is not None:
        gpos = gms[target_block].gather(1, target[:, None])[:, 0]
        theta = guide_threshold(gpos, *rule)
    scores = []
    for blk, gm in zip(blocks, gms, strict=True):
        x, y = blk.rows.to(dt), blk.cols.to(dt)
        if normalize:
            x, y = F.normalize(x, dim=1, eps=EPS), F.normalize(y, dim=1, eps=EPS)
        sc = (x @ y.T) * s
        n, m = sc.shape
        drop = torch.zeros(n, m, dtype=torch.bool, device=sc.device)
        if gm is not None:
            drop |= ~(gm <= theta[:, None])
        if blk.id_rows is not None:
            drop |= blk.id_rows[:, None] == blk.id_cols[None, :]
        i = torch.arange(n, device=sc.device)
        if blk.protect is not None:
            drop[i, blk.protect] = False
        if blk.exclude is not None:
            j = i + blk.exclude
            ok = (j >= 0) & (j < m)
            drop[i[ok], j[ok]] = True
        scores.append(sc.masked_fill(drop, float("-inf")))
    before = sum(x.shape[1] for x in scores[:target_block])
    logits = torch.cat(scores, dim=1)
    n = logits.shape[0]
    if label_smoothing:
        return smoothed_cross_entropy(logits, before + target, label_smoothing), theta
    return torch.logsumexp(logits, dim=1) - logits[torch.arange(n, device=logits.device), before + target], theta


def _nan_rows(per: Tensor, theta: Tensor | None, col_guides) -> Tensor:
    """``per`` with NaN at the rows whose threshold is not finite, everywhere when a guide column is not."""
    if theta is None:
        return per
    bad = ~torch.isfinite(theta)
    for g in col_guides:
        bad = bad | ~torch.isfinite(g).all()  # a 0-dim flag over every row (no host sync: traceable)
    return torch.where(bad, float("nan"), per)


def _reference(a, p_all, n_all, ga, gp_all, gn_all, rule, s, off, contrast_anchors, contrast_positives,
               normalize, a_all, ga_all, label_smoothing: float = 0.0) -> Tensor:
    """GISTEmbed's definition, materialised ([B] per-row losses); ``a_all`` / ``ga_all``: the
    anchor-anchor block's columns (every rank's anchors, or this rank's)."""
    b = a.shape[0]
    tgt = torch.arange(b, device=a.device) + off
    blocks = [_DenseBlock(a, p_all, ga, gp_all, protect=tgt)]
    if contrast_anchors:
        blocks.append(_DenseBlock(a, a_all, ga, ga_all))
    if contrast_positives:
        blocks.append(_DenseBlock(p_all[off : off + b], p_all, gp_all[off : off + b], gp_all))
    blocks += [_DenseBlock(a, x, ga, gx) for x, gx in zip(n_all, gn_all, strict=True)]
    per, theta = _dense(blocks, rule, s, normalize, 0, tgt, label_smoothing)
    return _nan_rows(per, theta, [gp_all, *gn_all, *((ga_all,) if contrast_anchors else ())])


def _id_vector(name: str, v, n: int, dev) -> Tensor:
    if not isinstance(v, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer ids, got {type(v).__name__}")
    if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer ids (one per row, equal ids are duplicates), got {v.dtype}")
    if v.dim() != 1 or v.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(v.shape)}")
    if v.device != dev:
        raise ValueError(f"{name} is on {v.device} but the embeddings are on {dev}")
    return v.long()


def guide_options_unused(guide, guide_margin, guide_margin_strategy) -> None:
    """``guide_margin`` / ``guide_margin_strategy`` given without ``guide=``: an error, not ignored."""
    if guide is not None:
        return
    V.choice("guide_margin_strategy", guide_margin_strategy, MARGIN_STRATEGIES)
    V.number("guide_margin", guide_margin, low=-math.inf, strict=True)
    for name, v, default in (("guide_margin", guide_margin, 0.0), ("guide_margin_strategy", guide_margin_strategy,
                                                                   "absolute")):
        if v != default:
            raise ValueError(f"{name}={v!r} has no effect without guide= (the guide model's embeddings): pass "
                             f"guide, or leave {name} at {default!r}")


def _pair(name: str, v, same: bool) -> tuple:
    """``(for the rows, for the columns)`` of an argument given as one tensor (keys=None) or a pair."""
    if v is None:
        return None, None
    if same:
        if not isinstance(v, Tensor):
            raise TypeError(f"{name} must be one tensor when keys is None (the rows are the columns)")
        return v, v
    if isinstance(v, Tensor) or not isinstance(v, Sequence) or len(v) != 2:
        raise TypeError(f"{name} must be a pair (for query, for keys) when keys are given")
    return v[0], v[1]


@dataclass
class InfoNCEMasks:
    """``info_nce``'s validated ``guide=`` / ``ids=`` arguments (rows' and local columns' tensors)."""

    gq: Tensor | None
    gk: Tensor | None
    iq: Tensor | None
    ik: Tensor | None
    strategy: str
    margin: float


def info_nce_masks(query: Tensor, keys: Tensor | None, guide, guide_margin, guide_margin_strategy,
                   ids) -> InfoNCEMasks:
    """Checks ``info_nce``'s mask arguments (before any collective, so a bad call fails on every rank)."""
    dev, n = query.device, query.shape[0]
    same = keys is None
    gq, gk = _pair("guide", guide, same)
    iq, ik = _pair("ids", ids, same)
    m_local = n if same else keys.shape[0]
    if gq is not None:
        gq = V.embeddings("guide (query)" if not same else "guide", gq)
        if gq.shape[0] != n:
            raise ValueError(f"guide for the query must have {n} rows, got {gq.shape[0]}")
        V.same_device(query=query, guide=gq)
        gk = gq if same else _columns("guide (keys)", gk, m_local, gq.shape[1], dev)[0]
    strategy = V.choice("guide_margin_strategy", guide_margin_strategy, MARGIN_STRATEGIES)
    margin = V.number("guide_margin", guide_margin, low=-math.inf, strict=True)
    if iq is not None:
        iq = _id_vector("ids" if same else "ids[0] (query)", iq, n, dev)
        ik = iq if same else _id_vector("ids[1] (keys)", ik, m_local, dev)
    return InfoNCEMasks(gq, gk, iq, ik, strategy, margin)


def guided_info_nce(be: str, scope: Scope, query: Tensor, contrast: Tensor, qoff: int, n_total: int, s, t: Tensor,
                    valid: Tensor | None, mk: InfoNCEMasks, *, exclude_self: bool, normalize: bool,
                    reduction: str, keys_gathered: bool = False, label_smoothing: float = 0.0) -> Tensor:
    """``info_nce`` with a guide mask and / or an id mask (its docstring has the arguments): one block,
    query rows (this rank's, the first at global row ``qoff``) against the (gathered) ``contrast`` set,
    each row's target column ``t`` (global indices; rows outside ``valid`` point anywhere and weigh 0)
    protected. ``keys_gathered``: ``mk.gk`` / ``mk.ik`` are already laid out like ``contrast``.
    ``label_smoothing``: over the columns each row keeps (``merged_lse``'s)."""
    dev, n = query.device, query.shape[0]
    gq, iq = mk.gq, mk.iq
    with torch.no_grad():
        if keys_gathered:
            gk_all, ik_all = (None if gq is None else mk.gk.detach()), (None if iq is None else mk.ik)
        else:
            gk_all = None if gq is None else scope.rows(mk.gk.detach(), "guide")[0]
            ik_all = None if iq is None else scope.rows(mk.ik, "ids")[0]
    rule = None if gq is None else (mk.strategy, mk.margin)
    excl = qoff if exclude_self else None
    dt = compute_dtype(query, contrast)
    if be == "reference":
        blk = _DenseBlock(query, contrast, gq, gk_all, iq, ik_all, protect=t, exclude=excl)
        per, theta = _dense([blk], rule, s, normalize, 0, t, label_smoothing)
        per = _nan_rows(per, theta, [] if gk_all is None else [gk_all])
        if valid is not None:
            per = torch.where(valid, per, torch.zeros_like(per))
        return scope.reduce(per, reduction, n_total if valid is None else scope.sum(valid.sum()))
    masks = Masks(guides=(gq, gk_all), ids=(iq, ik_all), target=t, rule=rule)
    w = valid.to(dt) if valid is not None else torch.ones(n, dtype=dt, device=dev)
    blocks = [Block(rows=0, cols=1, protect=True, exclude=excl)]
    if reduction == "none":
        per = merged_lse([query, contrast], blocks, n, s, masks, normalize=normalize, eps=EPS, minus_target=True,
                         backend=be, label_smoothing=label_smoothing)
        return per if valid is None else torch.where(valid, per, torch.zeros_like(per))
    out = merged_lse([query, contrast], blocks, n, s, masks, normalize=normalize, eps=EPS, weights=w,
                     minus_target=True, backend=be, label_smoothing=label_smoothing)
    return scope.reduce(out, reduction, n_total if valid is None else scope.sum(valid.sum()))
