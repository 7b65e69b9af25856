"""Row-specific hard negatives: anchor ``i``'s own ``K`` negatives ``n_i1 .. n_iK`` (a tensor [N, K, D]),
in row ``i``'s softmax only, beside the shared columns of the contrast set (the Qwen3-Embedding recipe,
memeff's ``hard_negative_features``).

With ``l_ij`` the shared logits of row ``i``, ``t_i`` its target column and ``r_ik = s <q_i, n_ik>``
(``q``, ``n`` normalised unless ``normalize=False``)::

    loss_i = log( sum_j e^{l_ij} + sum_k e^{r_ik} ) - l_{i t_i}
           = logaddexp(CE_i, R_i - l_{i t_i}),     R_i = log sum_k e^{r_ik},  CE_i = LSE_i - l_{i t_i}

so the shared part is any backend's per-row cross-entropy ``CE_i`` (its hand-written gradient), and the
row negatives add O(N K D) PyTorch with autograd: ``R_i`` from one batched product, the target logit
``l_{i t_i}`` from the target's key row. A row whose every negative is masked (``keep``) has
``R_i = -inf``: its loss is ``CE_i`` and its negatives get no gradient. Under ``gather`` the row
negatives stay with their row (they are never columns of another rank's rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validate as V
from .._amp import autocast_off
from .._first_order import first_order
from ..core.norms import clamped_norms, normalize_backward_, normalize_rows, unit_rows
from ..core.spec import compute_dtype
from ._scope import EPS


def checked(row_negatives, query: Tensor, name: str = "row_negatives") -> Tensor:
    """``row_negatives`` validated against ``query`` [N, D]: a floating [N, K, D] tensor (K >= 1) on the
    query's device, float64 exactly when the query is."""
    rn = V.embeddings(name, row_negatives, ndim=3, shape_hint="shape [N, K, D] (each row's own K negatives)")
    n, d = query.shape
    if rn.shape[0] != n or rn.shape[2] != d:
        raise ValueError(f"{name} must have shape [{n}, K, {d}] (each query row's own K negatives), got "
                         f"{tuple(rn.shape)}")
    V.same_device(query=query, **{name: rn})
    V.same_precision("query", query, name, rn)
    return rn


def _units(x: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    """Rows of ``x`` (any leading shape, last dim D) in ``dt``, normalised when asked (differentiable)."""
    x = x.to(dt)
    if not normalize:
        return x
    return unit_rows(x.reshape(-1, x.shape[-1]), EPS).reshape(x.shape)


class _RowLogitsFn(torch.autograd.Function):
    """``r_ik = s <q_hat_i, n_ik> / max(||n_ik||, eps)`` [N, K] in the compute dtype, with its gradient written
    out: no normalised copy of the negatives (one norm pass and one batched product forward; one batched
    product, one outer product and one fused update backward; autocast off)."""

    @staticmethod
    @autocast_off
    def forward(ctx, query: Tensor, negs: Tensor, s, normalize: bool) -> Tensor:
        n, k, d = negs.shape
        dt = compute_dtype(query, negs)
        qh, nq = normalize_rows(query, EPS, dt, normalize)
        nf = negs.to(dt)
        c = torch.bmm(nf, qh[:, :, None])[..., 0]
        nn = clamped_norms(nf.reshape(n * k, d), EPS, dt).view(n, k) if normalize else None
        if nn is not None:
            c = c / nn
        ctx.save_for_backward(qh, nq, nf, nn, c, s if isinstance(s, Tensor) else None)
        ctx.meta = (None if isinstance(s, Tensor) else s, query.dtype, negs.dtype)
        return c * (s.detach().to(dt) if isinstance(s, Tensor) else s)

    @staticmethod
    @autocast_off
    @first_order("RowLogitsFn")
    def backward(ctx, g: Tensor):
        qh, nq, nf, nn, c, s_t = ctx.saved_tensors
        s_f, qdt, ndt = ctx.meta
        g = g.to(c.dtype)
        a = g * (s_t.detach().to(c.dtype) if s_t is not None else s_f)  # d loss / d <q_hat, n_hat>
        if nn is not None:
            a = a / nn
        dq = dn = ds = None
        if ctx.needs_input_grad[0]:
            dq = normalize_backward_(torch.bmm(a[:, None, :], nf)[:, 0], qh, nq, EPS).to(qdt)
        if ctx.needs_input_grad[1]:
            dn = a[:, :, None] * qh[:, None, :]
            if nn is not None:  # the normalisation's projection, none for a clamped row (a linear map there)
                proj = torch.where(nn > EPS, a * c / nn, torch.zeros_like(a))
                dn.addcmul_(nf, proj[:, :, None], value=-1.0)
            dn = dn.to(ndt)
        if s_t is not None and ctx.needs_input_grad[2]:
            ds = (g * c).sum().to(s_t.dtype).reshape(s_t.shape)
        return dq, dn, ds, None


def row_logits(query: Tensor, row_negatives: Tensor, s, normalize: bool) -> Tensor:
    """``r_ik = s <q_i, n_ik>`` [N, K] in the compute dtype (differentiable in all three)."""
    return _RowLogitsFn.apply(query, row_negatives, s, normalize)


def target_logit(query: Tensor, target_rows: Tensor, s, normalize: bool) -> Tensor:
    """``l_{i t_i} = s <q_i, k_{t_i}>`` [N] from each row's target key row ``target_rows`` [N, D]."""
    dt = compute_dtype(query, target_rows)
    sc = s.to(dt) if isinstance(s, Tensor) else s
    return (_units(query, normalize, dt) * _units(target_rows, normalize, dt)).sum(-1) * sc


def merged(ce: Tensor, tgt: Tensor, r: Tensor, keep: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
    """``logaddexp(ce_i, logsumexp_k r_ik - tgt_i)`` per row [N] (module docstring), ``r`` [N, K] the row
    negatives' logits, ``keep`` [N, K] bool (None: all kept), rows outside ``valid`` 0 (ignored rows)."""
    dt = torch.promote_types(ce.dtype, r.dtype)
    if keep is not None:
        any_kept = keep.any(dim=1)
        # a row with nothing kept reads zeros (finite, so its gradient is 0, not NaN) and gets R_i = -inf
        r = torch.where(keep & any_kept[:, None], r, torch.where(any_kept[:, None], float("-inf"), 0.0))
        big_r = torch.where(any_kept, torch.logsumexp(r, dim=1), float("-inf"))
    else:
        big_r = torch.logsumexp(r, dim=1)
    out = torch.logaddexp(ce.to(dt), big_r.to(dt) - tgt.to(dt))
    return out if valid is None else torch.where(valid, out, torch.zeros_like(out))
