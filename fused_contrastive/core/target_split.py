"""The target split's host math, shared by every path that splits the target out of its softmax (the fused kernels'
and the panel path's hosts, ``triton_fused`` / ``triton_panel``, the ahead-of-time library's route, the Matryoshka
kernels' and the chunked PyTorch path): no Triton here, so the PyTorch paths run without it.

In a saturated softmax (``1 - p_t`` of 1e-6 and below) ``LSE_i - l_it`` and ``p_t - 1`` cancel in fp32. A split
forward keeps each row's target entry out of its statistics (``LSEx_i``, and CLIP's column ``LSEcolx_j`` where
``t_j = j``) with the target's logit apart; :func:`merge_split` forms the losses as ``softplus(LSEx_i - l_it)`` and the
merged LSEs, :func:`minus_coefficients` the target term's share those losses hold, and :func:`exact_weights` the
backward's combined target weights ``-g_i (1 - p_t)`` (``docs/panel-path.md``, "The loss of a saturated softmax")."""

from __future__ import annotations

import torch
from torch import Tensor

from .spec import Coeffs

#: how far (relative to ``max(1, |m_i|)``) the split forward's fp32 dot of a row's target logit may lie below the
#: row's largest tile logit and still be taken for it (:func:`tile_target`): 2^-14, 512 fp32 ulps, far above the
#: two sums' difference in rounding (``~sqrt(D)`` ulps) and far below any gap the saturated regime has
TILE_TARGET_TOL = 2.0 ** -14


def logsumexp_without(x: Tensor, idx: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(x at idx, the log-sum-exp of x along dim without those entries)``: each row (``dim`` 1, ``idx`` [R, 1]) or
    column (``dim`` 0, ``idx`` [1, C]) leaves its one entry at ``idx`` out, ``x`` masked in place and then restored
    (no second tile): the PyTorch paths' split statistics ``LSEx`` (or ``log(1 - p_t)`` from a log-softmax tile)."""
    at = x.gather(dim, idx)
    x.scatter_(dim, idx, float("-inf"))
    out = torch.logsumexp(x, dim=dim)
    x.scatter_(dim, idx, at)
    return at.squeeze(dim), out


def merge_split(lse_x: Tensor, lse_col_x: Tensor | None, lt: Tensor, target: Tensor, tri: bool,
                minus_target: dict) -> tuple[Tensor, Tensor | None]:
    """The split forward's host step (also the ahead-of-time library route's, ``library_route``): from the kernel's
    ``LSEx`` [N], CLIP's merged ``LSEcolx`` [M] (or None), ``lt`` (``LT``: [2N], the dot's target logits then each
    row's largest tile logit; [N] with ``tri``) and ``target`` [N], fill ``minus_target`` (see :func:`_lse_fwd`)
    and return the backward's ``(lse, lse_col)``: the merged LSEs, the target logit as the tiles round it."""
    n, dev = lse_x.shape[0], lse_x.device
    # (the loss from the dot's l_it; the backward's LSE from the tile's own, which its recomputed tiles match)
    lt, lt_tile = (lt, lt) if tri else (lt[:n], tile_target(lt[:n], lt[n:]))
    fold = lt > float("-inf")
    loss = softplus(lse_x - lt)
    lse = torch.logaddexp(lse_x, lt_tile)
    # 1 - p_t as the backward's LSE makes it, exp(LSEx_i - LSE_i), without the cancellation (exact_weights)
    minus_target.update(loss=torch.where(fold, loss, torch.logaddexp(lse_x, lt)), fold=fold.to(torch.float32),
                        rest=torch.where(fold, torch.exp(lse_x - lse), 0.0), lt_tile=lt_tile)
    lse_col = None
    if lse_col_x is not None:  # column j's target entry (j, j) apart where target[j] == j
        m = lse_col_x.shape[0]
        k = min(n, m)
        diag = target[:k] == torch.arange(k, device=dev)
        ct = torch.full((m,), float("-inf"), dtype=torch.float32, device=dev)
        ct_tile = ct.clone()
        ct[:k] = torch.where(diag, lt[:k], float("-inf"))
        ct_tile[:k] = torch.where(diag, lt_tile[:k], float("-inf"))
        cfold = ct > float("-inf")
        col_loss = softplus(lse_col_x - ct)
        lse_col = torch.logaddexp(lse_col_x, ct_tile)
        minus_target.update(col_loss=torch.where(cfold, col_loss, torch.logaddexp(lse_col_x, ct)),
                            col_fold=cfold.to(torch.float32),
                            col_rest=torch.where(cfold, torch.exp(lse_col_x - lse_col), 0.0))
    return lse, lse_col


def exact_weights(minus: dict, target: Tensor, g: Tensor, g_col: Tensor | None, lse_col: Tensor | None) -> Tensor:
    """Each row's log-sum-exp weight at its target entry ``(i, t_i)`` combined with the target term's share that the
    split forward took out (the coefficients :func:`minus_coefficients` gives), fp32 [N], from the split's statistics
    (``minus``, filled by :func:`merge_split`) and the upstream gradients ``g`` [N], ``g_col`` [M] (CLIP) or None:

        row part       g_i (p_t - 1) = -g_i exp(LSEx_i - LSE_i)               where the row's loss is the difference
        column part    gc_i (pc_ii - 1) = -gc_i exp(LSEcolx_i - LSEcol_i)      where column i's is (t_i = i)
                       gc_{t_i} exp(l_it - LSEcol_{t_i})                        elsewhere (nothing to combine with)

    In the saturated regime ``1 - p_t`` is ~1e-6 and below: ``p_t - 1`` formed in fp32 (the kernel's ``p_t``, then the
    target term's ``-1``) keeps none of it where ``LSE_i`` and ``l_it`` round alike, while ``exp(LSEx_i - LSE_i)`` keeps
    its relative accuracy. The backward's row kernel takes it at the target entry (``kernels/lse.py`` EXACT_T), and
    the target term then leaves those coefficients out (``core.backward_parts``, ``linear_terms``). Not for B is A
    with a column term (the symmetric tile's column part of ``(i, t_i)`` belongs to another row's target)."""
    w = -g * minus["rest"]
    if g_col is not None:
        n = g.shape[0]
        k = min(n, g_col.shape[0])  # (columns past the rows have no row whose target they are with t_i = i)
        t = target[:n]
        own = torch.zeros(n, dtype=torch.bool, device=t.device)
        own[:k] = (t[:k] == torch.arange(k, device=t.device)) & (minus["col_fold"][:k] > 0)
        rest = torch.zeros(n, dtype=torch.float32, device=t.device)
        rest[:k] = minus["col_rest"][:k]
        gct = g_col[t]
        w = w + torch.where(own, -gct * rest, gct * torch.exp(minus["lt_tile"] - lse_col[t]))
    return w


def minus_coefficients(coef: Coeffs, minus: dict, n: int) -> Tensor:
    """``c_i`` [N] fp32, the coefficient at which the piece's value took row i's target logit ``l_it`` out:
    ``c.lse_i`` where the row's loss is the difference (``minus["fold"]``), plus ``c.col_i`` where column i's is
    (``minus["col_fold"]``, CLIP: column i's target is row i's, ``l_ii``), what ``core.forward_parts`` takes out
    of the target term's value."""
    fold = minus["fold"]

    def cf(c):
        return c.to(device=fold.device, dtype=torch.float32) if isinstance(c, Tensor) else float(c)

    out = cf(coef.lse) * fold
    if "col_fold" in minus:
        col = minus["col_fold"] * cf(coef.col)
        k = min(n, col.shape[0])
        out = out.clone()
        out[:k] += col[:k]
    return out


def tile_target(lt: Tensor, row_max: Tensor) -> Tensor:
    """The target logit as the tiles round it, for the backward's LSE: the row's largest tile logit ``row_max``
    where the dot's ``lt`` lies within :data:`TILE_TARGET_TOL` of it (the target is the row's max: the saturated
    regime, where the backward's fp32 target weight ``exp(l_it - LSE_i)`` meets the target term's -1 and an ulp of
    ``|s|`` between the dot and the tile would be the whole error), else ``lt`` (``p_t <= 1/2`` there, or the
    dot is within the tolerance of the tile's value anyway)."""
    return torch.where(lt >= row_max - TILE_TARGET_TOL * row_max.abs().clamp(min=1.0), row_max, lt)


def softplus(x: Tensor) -> Tensor:
    """``log(1 + e^x)``, accurate on both sides of 0."""
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))
