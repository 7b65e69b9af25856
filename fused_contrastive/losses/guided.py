"""Guided in-batch negatives (GISTEmbed) and duplicate masking by id, on the merged-block core
(``core/blocks.py``): the exclusion mask is computed inside each logit tile from a guide tile (or an
id compare), never stored, and several column blocks merge into one softmax per row.

GISTEmbed (Solatorio 2024; sentence-transformers' ``GISTEmbedLoss``), for anchors ``a``, positives
``p`` (global row ``o + i`` of the batch gathered over ranks), optional hard negatives ``n^k``, a frozen
guide model's embeddings ``ga, gp, gn^k``, ``gpos_i = cos(ga_i, gp_{o+i})`` and the threshold
``theta_i = gpos_i - margin`` ("absolute") or ``gpos_i - |gpos_i| margin`` ("relative")::

    row i = [ a_i . p_j | a_i . a_j | p_{o+i} . p_j | a_i . n^k_j ] / temperature   (cosines)
    a column is dropped (-inf) when the guide's cosine of the same pair is > theta_i, except
    column o + i of the first block (the positive)
    loss  = mean_i  CE(row i, target o + i)

The second and third blocks are ``contrast_anchors`` / ``contrast_positives`` (on by default). A row
whose every other column is dropped keeps only its positive and contributes 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from .. import distributed as D
from .._amp import autocast_off
from .._backend import resolve
from ..core.blocks import Block, Masks, merged_lse
from ..core.spec import compute_dtype
from ._levels import leveled
from ._scope import EPS, Scope

__all__ = ["gist_loss"]

MARGIN_STRATEGIES = ("absolute", "relative")
_WARNED: set = set()


def guide_threshold(gpos: Tensor, margin_strategy: str, margin: float) -> Tensor:
    """``theta_i``: ``gpos - margin`` ("absolute") or ``gpos - |gpos| * margin`` ("relative", the
    sign-independent rule of sentence-transformers 6.2)."""
    return gpos - margin if margin_strategy == "absolute" else gpos - gpos.abs() * margin


def _unit(g: Tensor) -> Tensor:
    return F.normalize(g.detach().to(compute_dtype(g)), dim=1, eps=EPS)


def pair_cos(x: Tensor, y: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    """``sim(x_i, y_i)`` per row in ``dt`` ([n], differentiable)."""
    x, y = x.to(dt), y.to(dt)
    if normalize:
        x, y = F.normalize(x, dim=1, eps=EPS), F.normalize(y, dim=1, eps=EPS)
    return (x * y).sum(1)


def _torch_backend(be: str, what: str) -> str:
    """The merged-block core is PyTorch (any device); on triton it runs there with a one-time warning."""
    if be == "triton" and what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"{what} runs on the PyTorch path (O(N*D) memory, any device) with backend='triton': the "
                      "Triton kernels do not compute guide tiles yet", stacklevel=3)
    return "torch" if be == "triton" else be


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


@leveled("anchors", "positives", "negatives", one_pass=False)
@D.agreed
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
        backend: "auto" / "torch" / "triton" run the fused PyTorch path (O(B*D) memory; on "triton"
            with a one-time warning: no Triton kernel computes guide tiles yet); "reference"
            materialises the matrices (the definition).
        gather: gather positives and negatives (and their guide embeddings) over ranks; rows stay local.

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
    margin_strategy = V.choice("margin_strategy", margin_strategy, MARGIN_STRATEGIES)
    margin = V.number("margin", margin, low=-math.inf, strict=True)
    for name, v in (("contrast_anchors", contrast_anchors), ("contrast_positives", contrast_positives),
                    ("normalize", normalize)):
        V.flag(name, v)
    reduction = V.reduction(reduction)
    dt = compute_dtype(anchors, positives, *negs)
    s, _ = V.scale_of(temperature, None, 0.01, dt, dev)
    be = _torch_backend(resolve(backend, anchors, positives), "gist_loss")
    scope = Scope(gather)
    scope.agree(s)
    p_all, off, _ = scope.rows(positives, "positives")
    n_all = [scope.rows(x, "negatives")[0] for x in negs]
    with torch.no_grad():
        gp_all = scope.rows(gp.detach(), "guide_positives")[0]
        gn_all = [scope.rows(x.detach(), "guide_negatives")[0] for x in gn]
    _, n_total = scope.offset(b, dev)
    gpos = (_unit(ga) * _unit(gp)).sum(1)
    theta = guide_threshold(gpos, margin_strategy, margin)
    if be == "reference":
        per = _reference(anchors, p_all, n_all, ga, gp_all, gn_all, theta, s, off, contrast_anchors,
                         contrast_positives, normalize)
        return scope.reduce(per, reduction, n_total)
    xs = [anchors, p_all, *n_all]
    blocks = [Block(rows=0, cols=1, protect=off)]
    if contrast_anchors:
        blocks.append(Block(rows=0, cols=0))
    if contrast_positives:
        blocks.append(Block(rows=1, cols=1, row_start=off))
    blocks += [Block(rows=0, cols=2 + k) for k in range(len(n_all))]
    masks = Masks(guides=(ga, gp_all, *gn_all), threshold=theta)
    tgt = s * pair_cos(anchors, positives, normalize, dt)
    if reduction == "none":
        lse = merged_lse(xs, blocks, b, s, masks, normalize=normalize, eps=EPS)
        return lse - tgt
    per_n = reduction == "mean" and scope.local
    w = torch.full((b,), 1.0 / b if per_n else 1.0, dtype=dt, device=dev)
    out = merged_lse(xs, blocks, b, s, masks, normalize=normalize, eps=EPS, weights=w) - (w * tgt).sum()
    return out if per_n else scope.reduce(out, reduction, n_total)


def _reference(a, p_all, n_all, ga, gp_all, gn_all, theta, s, off, contrast_anchors, contrast_positives,
               normalize) -> Tensor:
    """The definition, materialised: sentence-transformers' concatenated score matrix and its
    cross-entropy per row ([B])."""
    b = a.shape[0]
    dt = compute_dtype(a, p_all)

    def sim(x, y, unit):
        x, y = x.to(dt), y.to(dt)
        if unit:
            x, y = F.normalize(x, dim=1, eps=EPS), F.normalize(y, dim=1, eps=EPS)
        return x @ y.T

    def masked(x, y, gx, gy, protect: bool):
        sc = sim(x, y, normalize) * s
        drop = ~(_unit(gx) @ _unit(gy).T <= theta[:, None])
        if protect:
            drop[torch.arange(b), off + torch.arange(b)] = False
        return sc.masked_fill(drop, float("-inf"))

    p_mine, gp_mine = p_all[off : off + b], gp_all[off : off + b]
    scores = [masked(a, p_all, ga, gp_all, True)]
    if contrast_anchors:
        scores.append(masked(a, a, ga, ga, False))
    if contrast_positives:
        scores.append(masked(p_mine, p_all, gp_mine, gp_all, False))
    scores += [masked(a, x, ga, gx, False) for x, gx in zip(n_all, gn_all, strict=True)]
    logits = torch.cat(scores, dim=1)
    per = torch.logsumexp(logits, dim=1) - logits[torch.arange(b), off + torch.arange(b)]
    bad = ~torch.isfinite(theta)  # a non-finite guide row of anchor i or of its positive
    for gx in (gp_all, *gn_all, *((ga,) if contrast_anchors else ())):  # the guide columns read
        if not bool(torch.isfinite(gx).all()):
            bad |= True
    return torch.where(bad, float("nan"), per)
