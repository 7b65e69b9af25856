"""The small-problem path of the core op: one materialised N x M tile, for problems that fit the tile
budget (``N * M <= tile_elements()``).

When the whole logit matrix fits the transient tile the chunked path would allocate anyway, chunking
buys nothing and its bookkeeping (and the separate O(N*D) positive terms) only adds small ops. Here
the whole loss is one autograd Function: the forward is the textbook formula's work (normalise, one
matmul, scale, masks, ``logsumexp``, a gather) and the hand-written backward forms ``dl`` once and
applies it with one matmul per input (one in all when B is A: ``(dl + dl^T) @ A``), followed by the
normalisation backward in closed form. That is about half the ATen ops of the autograd graph of
``F.cross_entropy(F.normalize(q) @ F.normalize(k).T / t, target)`` (whose ``F.normalize`` backward
alone is about ten nodes per input), so this path is never slower than the formula it replaces; the
small-batch table of ``python -m fused_contrastive bench`` measures it.

Memory: the tiles ``l``, the cosines (only when the scale needs a gradient) and the positive weights
(only when the loss has positives) are each N x M <= the tile budget; O(N*D) otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..._tracing import tensors_are_traced
from ..linear_terms import target_rows_less
from ..norms import clamped_norms
from ..spec import Coeffs, CoreData, CoreSpec, drop_zero
from ..target_split import exact_weights, logsumexp_without, minus_coefficients, softplus

_NEG_INF = float("-inf")


def _unit(x: Tensor, spec: CoreSpec, dt: torch.dtype):
    """(rows in ``dt`` divided by their clamped norms, the norms) or (raw rows, None)."""
    xf = x if x.dtype == dt else x.to(dt)
    if not spec.normalize:
        return xf, None
    norm = clamped_norms(x, spec.eps, dt)
    return xf / norm[:, None], norm


def _unit_backward(g: Tensor, xh: Tensor, norm: Tensor | None, proj: Tensor, eps: float) -> Tensor:
    """``(g - x_hat <g, x_hat>) / ||x||`` in place on ``g`` (``g / eps`` for a clamped row); ``proj`` is
    ``<g, x_hat>`` (the caller computes it on the tile or as a row dot, whichever is less work)."""
    if norm is None:
        return g
    proj = proj.masked_fill_(norm <= eps, 0.0)
    return g.addcmul_(xh, proj[:, None], value=-1.0).div_(norm[:, None])


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    return torch.linalg.vecdot(x, y, dim=1)


def _per_row(c, g: Tensor) -> Tensor:
    """Upstream gradient times a coefficient, shaped to scale the rows of a tile."""
    x = c * g
    return x[:, None] if x.dim() == 1 else x


def _row_slice(a: Tensor, b: Tensor | None) -> int | None:
    """``r`` when ``a`` is the view ``b[r : r + N]`` (the anchors are rows of the contrast set, as in
    SupCon "one", DSCL and queues), else None. Then the anchors' normalised rows are ``b``'s, and their
    gradient is folded into ``b``'s rows (autograd adds a view's gradient into its base)."""
    if b is None or a.dtype != b.dtype or a.device != b.device or a.stride() != b.stride() or b.stride(0) == 0:
        return None
    if tensors_are_traced():  # fake tensors have no storage to compare (and compiled buffers may differ)
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.shape[1] != b.shape[1]:
        return None
    r, rem = divmod(a.storage_offset() - b.storage_offset(), b.stride(0))
    return r if rem == 0 and 0 <= r and r + a.shape[0] <= b.shape[0] else None


def _cross_entropy_form(coef: Coeffs) -> bool:
    """``loss_i = c_i (LSE_i - l_{i, t_i})``: the same coefficient on LSE and on the target logit and no
    other term. Then ``log_softmax`` (one fused kernel) gives the loss and, exponentiated, the softmax."""
    if coef.tgt is None or coef.col is not None or coef.pos is not None or coef.set is not None:
        return False
    if isinstance(coef.lse, Tensor) or isinstance(coef.tgt, Tensor):
        return coef.lse is coef.tgt
    return coef.lse == coef.tgt


def uniform_weight(data: CoreData, coef: Coeffs) -> bool:
    """Whether the positive weights are one number for every column (a [1, 1] mask) and only ``SET`` reads
    them: then ``SET_i = w s sum_{j in C_i} cos_ij`` is a row sum of the cosine tile and its gradient a
    per-row constant on the logit tile (label smoothing's mean logit), no weight tile."""
    return coef.set is not None and coef.pos is None and data.pos_mask is not None and data.pos_mask.shape == (1, 1)


def _own_cos(cos: Tensor, offset: int) -> Tensor:
    """``cos[i, offset + i]`` per row, 0 where that column does not exist."""
    diag = cos.diagonal(offset)
    return torch.cat([diag, diag.new_zeros(cos.shape[0] - diag.shape[0])]) if diag.shape[0] < cos.shape[0] else diag


def _positive_weights(data: CoreData, spec: CoreSpec, n: int, m: int, dt: torch.dtype, dev) -> Tensor:
    """w_ij as a dense [N, M] tile, 0 at the excluded own column: a bool tile for label positives
    (weights 0 / 1), a ``dt`` tile for a dense mask (real weights)."""
    if data.pos_mask is not None:
        n0, m0 = data.pos_mask.shape
        w = data.pos_mask.to(dt)
        if (n0, m0) != (n, m):
            w = w[torch.arange(n, device=dev) % n0][:, torch.arange(m, device=dev) % m0]
        elif w is data.pos_mask:
            w = w.clone()
    else:
        w = data.row_labels[:, None] == data.col_labels[None, :]
    if spec.exclude_self:
        w.diagonal(spec.offset).zero_()
    return w


def _positive_logits(l: Tensor, w: Tensor) -> Tensor:
    """``l + log w``: -inf off the positives (a ``where`` for 0 / 1 weights, no logarithm)."""
    if w.dtype == torch.bool:
        return torch.where(w, l, _NEG_INF)
    return l + w.log()


def _softmax(p: Tensor, dim: int, exact_sum: bool) -> Tensor:
    """``p`` (an ``exp(log_softmax)`` tile), divided in place by its sums along ``dim`` when ``exact_sum``.

    Mathematically those sums are 1; computed, a row's ``exp(l - LSE)`` sums to ``exp(-delta)`` with
    ``delta`` the rounding of its LSE (a few ulp of ``|l - max|`` and ``log z``, which depend on the CPU's
    vectorised exp / log / sum). The scale's gradient ``sum_j p_ij cos_ij - cos_it`` cancels (to 1/30 of
    its terms at D = 1), amplifying ``delta``, and rows of the same structure (every row at D = 1) share
    it, so it does not average out: the float32 gradient of a temperature was off by ~30 ulp-relative on
    some CPUs. Dividing by the computed sum removes ``delta``; a row with every entry excluded stays 0.
    """
    if exact_sum:
        z = p.sum(dim=dim, keepdim=True)
        p.div_(torch.where(z > 0, z, 1.0))
    return p


def _split(lsm: Tensor, idx: Tensor, dim: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The target split of a log-softmax tile ``lsm`` along ``dim`` (1: rows, 0: columns), the target entry of each
    row (column) at ``idx`` [N, 1] ([1, M]) where ``keep`` (None: every one): ``(loss, fold, rest)``, fp [N] ([M]):
    ``-lsm_t`` as ``softplus(log(1 - p_t) - log p_t)`` with ``log(1 - p_t)`` the log-sum-exp of the other entries
    (no cancellation of ``LSE - l_t`` or ``1 - p_t`` in a saturated softmax: ``p_t`` within an ulp of 1), 1 where
    the entry is split (kept, finite), and ``1 - p_t`` there (0 elsewhere)."""
    lt, rest_log = logsumexp_without(lsm, idx, dim)
    fold = lt > _NEG_INF
    if keep is not None:
        fold = fold & keep
    loss = torch.where(fold, softplus(rest_log - lt), -lt)
    return loss, fold, torch.where(fold, rest_log.exp(), 0.0)


def _vector(c, g: Tensor, n: int) -> Tensor:
    """``c * g`` as an [n] vector (``c`` a number or [n]; ``g`` 0-dim or [n])."""
    x = c * g
    return x.expand(n) if x.dim() == 0 else x


class DenseCoreFn(torch.autograd.Function):
    """The core op (``spec.py``) on one materialised tile; returns the per-row loss [N] or its sum."""

    @staticmethod
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                reduce: bool):
        dt = torch.float64 if a.dtype == torch.float64 or (b is not None and b.dtype == torch.float64) \
            else torch.float32
        r0 = _row_slice(a, b)
        if r0 is None:
            ah, na = _unit(a, spec, dt)
            bh, nb = (ah, na) if b is None else _unit(b, spec, dt)
        else:
            bh, nb = _unit(b, spec, dt)
            ah, na = bh[r0:r0 + a.shape[0]], None if nb is None else nb[r0:r0 + a.shape[0]]
        n, m = ah.shape[0], bh.shape[0]
        s = scale.detach().to(dt) if isinstance(scale, Tensor) else scale
        need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[2]
        cos = ah @ bh.T
        l = cos * s
        has_bias = data.bias_col is not None and spec.bias != 0.0
        if has_bias:
            l.scatter_add_(1, data.bias_col[:, None], l.new_full((n, 1), spec.bias))
        if spec.margin != 0.0:  # s (c - margin) at each row's target
            l.scatter_add_(1, data.target[:, None], (-spec.margin * s) * torch.ones_like(l[:, :1]))
        if spec.exclude_self:
            l.diagonal(spec.offset).fill_(_NEG_INF)
        l_tgt = None
        if spec.exclude_target:  # the target logit read as it is, then its column left out of the LSEs
            l_tgt = l.gather(1, data.target[:, None])[:, 0].clone()
            l.scatter_(1, data.target[:, None], _NEG_INF)
        # log_softmax is one fused kernel: the loss reads it, and exp of it is the backward's softmax
        # (a row or column with every entry excluded, possible only when N or M is 1, is -inf, not NaN)
        empty = (spec.exclude_self and (n == 1 or m == 1)) or (spec.exclude_target and m <= 2)
        lsm = torch.log_softmax(l, dim=1)
        if empty:
            lsm = torch.nan_to_num(lsm, nan=_NEG_INF)
        ce = _cross_entropy_form(coef) and not spec.exclude_target
        w = lsmc = lpp = None
        # the target split (fp32 tiles, a target term, no softmax over positives): each row's LSE_i - l_it, and CLIP's
        # column's, from the other entries' log-sum-exp (_split), and the backward's target weight from 1 - p_t formed
        # the same way: in a saturated softmax (p_t within ~1e-7 of 1) LSE_i and l_it round alike in fp32, and so do
        # p_t and 1, whatever the inputs' dtype (float64 tiles keep the plain form)
        split = dt == torch.float32 and coef.tgt is not None and coef.pos is None and not spec.exclude_target \
            and not empty
        ctx.split = None
        if split:
            t_idx = data.target[:, None]
            row_loss, fold, rest = _split(lsm, t_idx, 1)
        if ce:
            # loss_i = c_i (LSE_i - l_{i, t_i}) = -c_i log_softmax(l)_{i, t_i}
            picked = lsm.gather(1, data.target[:, None])[:, 0] if not split else -row_loss
            if reduce and not isinstance(coef.tgt, Tensor) and coef.tgt != 0:
                out = picked.sum() * -coef.tgt  # one number for every row: sum, then scale
            else:
                out = drop_zero(coef.tgt, picked, spec.exclude_self).neg_()
            if split:  # (the split statistics, merge_split's names: target_split.exact_weights reads them)
                minus = dict(fold=fold.to(dt), rest=rest)
                ctx.split = (minus, minus_coefficients(coef, minus, n), None)
        else:
            # loss_i = c.lse LSE_i + c.col LSEcol_i + c.pos LSEpos_i - c.tgt TGT_i - c.set SET_i, with
            # LSE = max(l) - max(log_softmax(l)) and LSEpos = LSE + LPP, LPP = log sum_j w_ij softmax_ij
            lse = torch.logsumexp(l, dim=1) if empty else l.amax(dim=1) - lsm.amax(dim=1)
            if split:  # the split rows' LSE_i - l_it in place of LSE_i; the target term leaves c.lse_i l_it out below
                lse = torch.where(fold, row_loss, lse)
            c_lse = coef.lse
            if coef.pos is not None:
                w = _positive_weights(data, spec, n, m, dt, a.device)
                lpp = torch.logsumexp(_positive_logits(lsm, w), dim=1)  # -inf for a row without positives
                c_lse = c_lse + coef.pos  # L_in: c.pos = -c.lse, the LSE terms cancel exactly
                out = drop_zero(coef.pos, lpp)
            out = drop_zero(c_lse, lse, empty) if lpp is None else out + drop_zero(c_lse, lse, empty)
            if coef.col is not None:
                lsmc = torch.log_softmax(l, dim=0)
                if empty:
                    lsmc = torch.nan_to_num(lsmc, nan=_NEG_INF)
                lse_col = torch.logsumexp(l, dim=0) if empty else l.amax(dim=0) - lsmc.amax(dim=0)
                if split:  # column j's (j, j) apart where row j's target is j (CLIP's pairs)
                    k = min(n, m)
                    own = torch.zeros(m, dtype=torch.bool, device=l.device)
                    own[:k] = data.target[:k] == torch.arange(k, device=l.device)
                    cols = torch.arange(m, device=l.device).clamp(max=n - 1)[None, :]  # (columns past N: not kept)
                    col_loss, col_fold, col_rest = _split(lsmc, cols, 0, own)
                    lse_col_all = lse_col  # (the backward's column weights of the entries it does not split)
                    lse_col = torch.where(col_fold, col_loss, lse_col)
                col = drop_zero(coef.col, lse_col, empty)
                out = out + col if not reduce else out  # a summed column term is added below
            uni = uniform_weight(data, coef)
            if coef.set is not None and w is None and not uni:
                w = _positive_weights(data, spec, n, m, dt, a.device)
            if coef.tgt is not None:
                picked = l.gather(1, data.target[:, None])[:, 0] if l_tgt is None else l_tgt
                if split:  # the target term without the c_i l_it the split rows' and columns' losses hold
                    minus = dict(fold=fold.to(dt), rest=rest, lt_tile=picked)
                    if coef.col is not None:
                        minus.update(col_fold=col_fold.to(dt), col_rest=col_rest)
                    less = minus_coefficients(coef, minus, n)
                    out = out - target_rows_less(coef.tgt, less, picked)
                    ctx.split = (minus, less, lse_col_all if coef.col is not None else None)
                else:
                    out = out - drop_zero(coef.tgt, picked, spec.exclude_self)
            if coef.set is not None and uni:  # one weight for every column but the excluded own one
                w00 = data.pos_mask.reshape(()).to(dt)
                rows = cos.sum(dim=1)
                if spec.exclude_self:
                    rows = rows - _own_cos(cos, spec.offset)
                set_ = rows * (s * w00)
                if has_bias:
                    own = torch.arange(n, device=a.device) + spec.offset
                    hit = (data.bias_col != own) if spec.exclude_self else torch.ones_like(data.bias_col, dtype=bool)
                    set_ = set_ + (spec.bias * w00) * hit.to(dt)
                out = out - drop_zero(coef.set, set_, False)
            elif coef.set is not None:
                set_ = (cos * w).sum(dim=1) * s
                if has_bias:
                    set_ = set_ + spec.bias * w.gather(1, data.bias_col[:, None])[:, 0].to(cos.dtype)
                out = out - drop_zero(coef.set, set_, False)  # w is 0 at the excluded column: finite
        if reduce and out.dim():
            out = out.sum() if coef.col is None else out.sum() + col.sum()

        ctx.spec, ctx.data, ctx.coef, ctx.s, ctx.ce, ctx.r0 = spec, data, coef, s, ce, r0
        ctx.dtypes = (a.dtype, None if b is None else b.dtype,
                      scale.dtype if need_s else None, scale.shape if need_s else None)
        ctx.save_for_backward(ah, None if b is None else bh, na, nb, lsm, lsmc, lpp, cos, w)
        return out

    @staticmethod
    @autocast_off
    @first_order("DenseCoreFn")
    def backward(ctx, g: Tensor):
        ah, bh, na, nb, lsm, lsmc, lpp, cos, w = ctx.saved_tensors
        spec, data, coef, s = ctx.spec, ctx.data, ctx.coef, ctx.s
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        if g.dtype != cos.dtype:
            g = g.to(cos.dtype)
        # dL/dl = g_i (c.lse p + c.pos q - c.tgt onehot - c.set w) + g_j c.col pc, with p = exp(lsm),
        # pc = exp(log_softmax over columns), q = w exp(lsm - LPP) (the softmax restricted to positives)
        # with a scale gradient, each softmax is divided by its computed sum (see _softmax)
        dl = _softmax(lsm.exp(), 1, need_s).mul_(_per_row(coef.lse, g))
        split = ctx.split
        set_t = None
        if split is not None:
            t_idx = data.target[:, None]
        if coef.col is not None:
            dl.add_(_softmax(lsmc.exp(), 0, need_s).mul_(coef.col * g))
        if coef.pos is not None:
            safe = torch.where(lpp == _NEG_INF, 0.0, lpp)  # a row without positives: exp(-inf) = 0 below
            q = _softmax((_positive_logits(lsm, w) - safe[:, None]).exp_(), 1, need_s)
            dl.add_(q.mul_(_per_row(coef.pos, g)))
        if coef.set is not None and w is None:  # one weight for every column (uniform_weight)
            dl.sub_(_per_row(coef.set, g) * data.pos_mask.reshape(()).to(dl.dtype))
            if split is not None:
                set_t = -_vector(coef.set, g, cos.shape[0]) * data.pos_mask.reshape(()).to(dl.dtype)
            if spec.exclude_self:
                dl.diagonal(spec.offset).zero_()
        elif coef.set is not None:
            dl.sub_(w * _per_row(coef.set, g))
            if split is not None:
                set_t = -_vector(coef.set, g, cos.shape[0]) * w.gather(1, t_idx)[:, 0].to(dl.dtype)
        if split is not None:
            # each target entry from its parts, none formed as a difference of nearly equal numbers: the log-sum-exp
            # terms' weight combined with the target term's share the split took (target_split.exact_weights: the
            # row's -g_i c.lse_i (1 - p_t), CLIP's column pair's likewise), the SET term's value there, and the rest
            # of the target term
            minus, less, lse_col_all = split
            n, m = cos.shape
            v = exact_weights(minus, data.target, _vector(coef.lse, g, n),
                              None if coef.col is None else _vector(coef.col, g, m), lse_col_all)
            if set_t is not None:
                v = v + set_t
            tgt_c = coef.tgt.to(dl.dtype) if isinstance(coef.tgt, Tensor) else coef.tgt
            v = v - (tgt_c - less) * _vector(1.0, g, n)
            dl.scatter_(1, t_idx, v[:, None])
            if spec.exclude_self:
                dl.diagonal(spec.offset).zero_()  # a target on the excluded column carries no gradient
        if coef.tgt is not None and split is None:
            dl.scatter_add_(1, data.target[:, None], _per_row(coef.tgt, g).neg().expand(cos.shape[0], 1))
            if spec.exclude_self:
                dl.diagonal(spec.offset).zero_()  # a target on the excluded column carries no gradient
        gs = (dl * cos).sum() if need_s else None
        if need_s and spec.margin != 0.0:  # dl/ds is c - margin at the target
            at_t = dl.gather(1, data.target[:, None]).sum()
            if coef.set is not None:  # ... but for the uniform SET, which sums the unshifted s c (spec.py)
                at_t = at_t + (_per_row(coef.set, g) * data.pos_mask.reshape(()).to(dl.dtype)).sum() \
                    * (1 if _per_row(coef.set, g).dim() else cos.shape[0])
            gs = gs - spec.margin * at_t
        dcos = dl.mul_(s)  # dL/dcos
        # The normalisation backward needs <g_i, x_hat_i> for g = dcos @ B_hat (and its transpose).
        # Read off the tile it is sum_j dcos_ij cos_ij (N x M work), as a row dot N x D work: the tile
        # when it is smaller (M < D), else the row dot, which also cancels exactly when D is tiny.
        tile = cos.shape[1] < ah.shape[1] and cos.shape[0] < ah.shape[1]
        ga = gb = None
        if bh is None:  # B is A: both roles of every row in one matmul
            if need_a:
                h = dcos + dcos.T
                gah = h @ ah
                proj = None if na is None else ((h * cos).sum(dim=1) if tile else _rowdot(gah, ah))
                ga = _unit_backward(gah, ah, na, proj, spec.eps)
        elif ctx.r0 is not None and need_b:  # A = B[r0 : r0 + N]: one gradient, into B's rows
            r0, n = ctx.r0, cos.shape[0]
            gbh = dcos.T @ ah
            gbh[r0:r0 + n] += dcos @ bh
            proj = None
            if nb is None:
                pass
            elif tile:  # the column role of every row, plus the row role of the anchor rows
                dc = dcos * cos
                proj = dc.sum(dim=0)
                proj[r0:r0 + n] += dc.sum(dim=1)
            else:
                proj = _rowdot(gbh, bh)
            gb = _unit_backward(gbh, bh, nb, proj, spec.eps)
        else:
            dc = dcos * cos if tile and ((na is not None and need_a) or (nb is not None and need_b)) else None
            if need_a:
                gah = dcos @ bh
                proj = None if na is None else (dc.sum(dim=1) if tile else _rowdot(gah, ah))
                ga = _unit_backward(gah, ah, na, proj, spec.eps)
            if need_b:
                gbh = dcos.T @ ah
                proj = None if nb is None else (dc.sum(dim=0) if tile else _rowdot(gbh, bh))
                gb = _unit_backward(gbh, bh, nb, proj, spec.eps)
        adt, bdt, sdt, sshape = ctx.dtypes
        return (None if ga is None else ga.to(adt), None if gb is None else gb.to(bdt),
                None if gs is None else gs.to(sdt).reshape(sshape), None, None, None, None)


def core(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
         reduce: bool) -> Tensor:
    """Per-row loss [N] (``reduce=False``) or its sum (0-dim) on one materialised tile."""
    return DenseCoreFn.apply(a, b, scale, spec, data, coef, reduce)
