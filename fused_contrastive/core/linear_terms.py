"""The linear positive terms of the core op in O(N*D): ``TGT_i = l_{i, target_i}`` and
``SET_i = sum_j w_ij l_ij``, plus the positive counts ``|P_i| = sum_j w_ij`` the losses divide by.

Used by the chunked PyTorch path and the Triton path (the dense path reads them off its tile). No
N x M work: with ``l_ij = s <a_i, b_j> + bias [j == bias_col_i]``,

* ``TGT_i = s <a_i, b_{t_i}> + bias [t_i == bias_col_i]`` (``-inf`` when ``t_i`` is the excluded own
  column): a gathered row dot;
* labels: ``P_i = sum_j w_ij b_j = C[y_i] - [y_i == y_self] b_self`` with class sums ``C`` over the
  contrast rows (``index_add`` by group id; the groups come from a sort, not ``torch.unique``, so every
  shape is known without reading the labels: no host synchronisation);
* dense mask ``w_ij = mask[i % n0, j % m0]``: ``P_i = (mask @ V)[i % n0] - w_self b_self`` with
  ``V[c] = sum_{j % m0 = c} b_j`` (an [n0, m0] x [m0, D] matmul).

The backward is explicit (:class:`LinearTermsFn`; no autograd graph inside, so the same code runs
inside the registered custom ops of ``fused_contrastive.ops``). On the triton backend the target term
alone (no SET) runs as two row kernels (``kernels/target.py``: the cosine per row, then the gradients,
added in place to the other pieces' fp32 gradients of ``core.PiecesFn``) instead of the unit rows of A
and B and their normalisation backward in PyTorch (~20 passes over N x D fp32 tensors at N = M).
With ``h_i`` the upstream gradient times the coefficient: ``dA_hat_i = s h_i P_i`` and
``dB_hat_j = s sum_i h_i w_ij a_hat_i`` (the same class sums, over rows, read at each column's label; or
``mask^T`` applied to the rows folded by ``i % n0``), the target logit adds ``s h_i`` at ``(i, t_i)``,
then the normalisation backward. Only the inputs are saved; the unit rows are recomputed in backward
(O(N*D)). Where the Triton piece beside it formed SET's gradient inside its 16-bit tiles
(``core.backward_parts`` sets ``ctx.set_taken``), the backward leaves SET out (the forward value stays).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._amp import autocast_off
from .._first_order import first_order
from .._tracing import tracing_route
from .norms import normalize_backward_, normalize_rows
from .spec import Coeffs, CoreData, CoreSpec, drop_zero
from .tiles import tile_elements


def _groups(col_labels: Tensor, row_labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(group id of every column [M], group id of every row's label [N], row label found among the
    columns [N] bool). Group ids are in [0, M); found by sorting, so no shape depends on the values."""
    m = col_labels.shape[0]
    sorted_lab, order = torch.sort(col_labels)
    new = torch.ones_like(sorted_lab, dtype=torch.bool)
    new[1:] = sorted_lab[1:] != sorted_lab[:-1]
    gid_sorted = torch.cumsum(new.long(), 0) - 1
    col_gid = torch.empty_like(gid_sorted).scatter_(0, order, gid_sorted)
    where = torch.searchsorted(sorted_lab, row_labels).clamp_(max=m - 1)
    found = sorted_lab[where] == row_labels
    return col_gid, gid_sorted[where], found


def _self_columns(spec: CoreSpec, n: int, m: int, device) -> tuple[Tensor, Tensor]:
    """(own column of every row clamped into [0, M), the row has an excluded own column)."""
    own = torch.arange(n, device=device) + spec.offset
    has = own < m if spec.exclude_self else torch.zeros(n, dtype=torch.bool, device=device)
    return own.clamp(max=m - 1), has


def _self_weights(spec: CoreSpec, data: CoreData, n: int, m: int, dt: torch.dtype, device) -> Tensor:
    """w_{i, own column} before the exclusion (0 for rows without an excluded own column)."""
    own, has = _self_columns(spec, n, m, device)
    if data.pos_mask is not None:
        n0, m0 = data.pos_mask.shape
        w = data.pos_mask.to(dt)[torch.arange(n, device=device) % n0, own % m0]
    else:
        w = (data.row_labels == data.col_labels[own]).to(dt)
    return torch.where(has, w, torch.zeros_like(w))


def positive_counts(spec: CoreSpec, data: CoreData, n: int, m: int, dt: torch.dtype) -> Tensor:
    """``|P_i| = sum_j w_ij`` (the excluded own column not counted), [N] in ``dt``. O(N + M) for labels,
    O(n0 * m0) for a dense mask."""
    dev = (data.pos_mask if data.pos_mask is not None else data.row_labels).device
    # small problems: count on the label-equality tile (4 ops instead of a sort and its bookkeeping);
    # not in a compiled graph, where the size test would be a guard that recompiles when N crosses it
    if data.pos_mask is None and not tracing_route() and n * m <= tile_elements():
        eq = data.row_labels[:, None] == data.col_labels[None, :]
        if spec.exclude_self:
            eq.diagonal(spec.offset).fill_(False)
        return eq.sum(dim=1).to(dt)
    if data.pos_mask is not None:
        n0, m0 = data.pos_mask.shape
        c = torch.arange(m0, device=dev)
        per_class = (m // m0 + (c < m % m0).long()).to(dt)  # columns j < M with j % m0 == c
        total = (data.pos_mask.to(dt) @ per_class)[torch.arange(n, device=dev) % n0]
    else:
        col_gid, row_gid, found = _groups(data.col_labels, data.row_labels)
        counts = torch.zeros(m, dtype=dt, device=dev).index_add_(0, col_gid, torch.ones(m, dtype=dt, device=dev))
        total = torch.where(found, counts[row_gid], torch.zeros((), dtype=dt, device=dev))
    return total - _self_weights(spec, data, n, m, dt, dev)


def _weighted_row_sums(x: Tensor, n_out: int, mask: Tensor | None, x_labels: Tensor | None,
                       out_labels: Tensor | None) -> Tensor:
    """``sum_k w_ok x_k`` for every output o, [n_out, D], with ``w_ok = mask[o % o0, k % k0]`` or
    ``[out_labels_o == x_labels_k]``: the positive sums of the rows and, with the roles swapped (the mask
    transposed), of the columns. O((n_out + K) D) for labels, O(o0 k0 D) for a mask."""
    dev, dt = x.device, x.dtype
    if mask is not None:
        o0, k0 = mask.shape
        # (one mask row or column, as label smoothing's [1, 1]: a sum and a broadcast view, not an index
        # gather, which costs ~10x a pass over the rows on a CPU)
        folded = x.sum(0, keepdim=True) if k0 == 1 else \
            x.new_zeros(k0, x.shape[1]).index_add(0, torch.arange(x.shape[0], device=dev) % k0, x)
        prod = mask.to(dt) @ folded
        return prod.expand(n_out, -1) if o0 == 1 else prod[torch.arange(n_out, device=dev) % o0]
    x_gid, out_gid, found = _groups(x_labels, out_labels)
    class_sums = x.new_zeros(x.shape[0], x.shape[1]).index_add(0, x_gid, x)
    return torch.where(found[:, None], class_sums[out_gid], torch.zeros((), dtype=dt, device=dev))


def _positive_sums(ah: Tensor, bh: Tensor, spec: CoreSpec, data: CoreData) -> Tensor:
    """``sum_j w_ij b_hat_j`` for every row, [N, D], excluding the own column."""
    n, m = ah.shape[0], bh.shape[0]
    sums = _weighted_row_sums(bh, n, data.pos_mask, data.col_labels, data.row_labels)
    if spec.exclude_self:
        own, _ = _self_columns(spec, n, m, ah.device)
        sums = sums - _self_weights(spec, data, n, m, ah.dtype, ah.device)[:, None] * bh[own]
    return sums


def _positive_weight_at(cols: Tensor, spec: CoreSpec, data: CoreData, n: int, dt: torch.dtype) -> Tensor:
    """w_{i, cols_i} for one column per row (0 at an excluded own column)."""
    dev = cols.device
    if data.pos_mask is not None:
        n0, m0 = data.pos_mask.shape
        w = data.pos_mask.to(dt)[torch.arange(n, device=dev) % n0, cols % m0]
    else:
        w = (data.row_labels == data.col_labels[cols]).to(dt)
    if spec.exclude_self:
        w = torch.where(cols == torch.arange(n, device=dev) + spec.offset, torch.zeros_like(w), w)
    return w


def _positive_sums_by_column(x: Tensor, m: int, spec: CoreSpec, data: CoreData) -> Tensor:
    """``sum_i w_ij x_i`` for every column j, [M, D] (the transpose of :func:`_positive_sums`)."""
    n = x.shape[0]
    mask = data.pos_mask.T if data.pos_mask is not None else None
    sums = _weighted_row_sums(x, m, mask, data.row_labels, data.col_labels)
    if spec.exclude_self:
        own, _ = _self_columns(spec, n, m, x.device)
        # rows without an own column have weight 0: adding 0 at the clamped index is harmless
        sums = sums.index_add(0, own, _self_weights(spec, data, n, m, x.dtype, x.device)[:, None] * x, alpha=-1)
    return sums


def target_logits(ah: Tensor, bh: Tensor, s, spec: CoreSpec, data: CoreData) -> Tensor:
    """``TGT`` per row: ``s (<a_i, b_{t_i}> - margin) + bias [t_i == bias_col_i]``, -inf at an excluded own
    column."""
    return _target_from_cos(torch.linalg.vecdot(ah, bh[data.target], dim=1), ah.shape[0], s, spec, data)


def _target_from_cos(cos: Tensor, n: int, s, spec: CoreSpec, data: CoreData) -> Tensor:
    """``TGT`` per row from ``cos_i = <a_i, b_{t_i}>`` (see :func:`target_logits`)."""
    t = data.target
    tgt = (cos - spec.margin if spec.margin != 0.0 else cos) * s
    if data.bias_col is not None and spec.bias != 0.0:
        tgt = tgt + spec.bias * (t == data.bias_col).to(tgt.dtype)
    if not spec.exclude_self:
        return tgt
    return torch.where(t == torch.arange(n, device=t.device) + spec.offset, float("-inf"), tgt)


def _weighted(c, v: Tensor, dt: torch.dtype) -> Tensor:
    return drop_zero(c.to(dt) if isinstance(c, Tensor) else c, v)


class LinearTermsFn(torch.autograd.Function):
    """``c.tgt TGT + c.set SET`` per row ([N]) or summed (0-dim), in ``dt``, with an explicit backward.

    ``a`` [N, D], ``b`` [M, D] or None (B is A), ``scale`` a number or a 0-dim tensor. Gradients come
    back in each input's dtype; a row whose coefficient is 0 (or whose target is its excluded own
    column) passes no gradient.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                reduce: bool, dt: torch.dtype, kernel: bool = False) -> Tensor:
        s = scale.detach().to(dt) if isinstance(scale, Tensor) else float(scale)
        tgt_logits = None
        # the target term alone on the triton backend: two row kernels (kernels/target.py) instead of
        # the unit rows of A and B and their gradients in PyTorch (~20 passes over N x D fp32 tensors)
        ctx.kernel = kernel and coef.set is None and coef.tgt is not None and dt == torch.float32
        out = None
        if ctx.kernel:
            from .triton_shared.target import target_cos

            cos = target_cos(a, a if b is None else b, data.target, spec.eps, spec.normalize)
            tgt_logits = _target_from_cos(cos, a.shape[0], s, spec, data)
            out = _weighted(coef.tgt, tgt_logits, dt)
        else:
            ah, _ = normalize_rows(a, spec.eps, dt, spec.normalize)
            bh = ah if b is None else normalize_rows(b, spec.eps, dt, spec.normalize)[0]
            if coef.tgt is not None:
                tgt_logits = target_logits(ah, bh, s, spec, data)
                out = _weighted(coef.tgt, tgt_logits, dt)
        if coef.set is not None:
            set_ = torch.linalg.vecdot(ah, _positive_sums(ah, bh, spec, data), dim=1) * s
            if data.bias_col is not None and spec.bias != 0.0:
                set_ = set_ + spec.bias * _positive_weight_at(data.bias_col, spec, data, ah.shape[0], dt)
            term = _weighted(coef.set, set_, dt)
            if getattr(ctx, "keep_rows", False):
                ctx.rows = (out, tgt_logits, term)
            out = term if out is None else out + term
        elif getattr(ctx, "keep_rows", False):
            ctx.rows = (out, tgt_logits, None)
        ctx.spec, ctx.data, ctx.coef, ctx.dt = spec, data, coef, dt
        ctx.dtypes = (a.dtype, None if b is None else b.dtype, None, None)  # the gradients' (core.PiecesFn may widen)
        ctx.scale = None if isinstance(scale, Tensor) else scale
        ctx.save_for_backward(a, b, scale if isinstance(scale, Tensor) else None)
        return out.sum() if reduce else out

    @staticmethod
    @autocast_off
    @first_order("LinearTermsFn")
    def backward(ctx, g: Tensor):
        a, b, scale = ctx.saved_tensors
        spec, data, coef, dt = ctx.spec, ctx.data, ctx.coef, ctx.dt
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        need_s = need_s and scale is not None
        s = float(ctx.scale) if scale is None else scale.detach().to(dt)
        n = a.shape[0]
        if ctx.kernel:
            return (*_target_backward_kernel(ctx, a, b, s, g, need_a, need_b, need_s, scale), None, None, None, None,
                    None, None)
        # the SET term's gradient already formed inside the log-sum-exp piece's 16-bit tiles (core.PiecesFn
        # sets ``set_taken``; its forward value stays this one's)
        with_set = coef.set is not None and not getattr(ctx, "set_taken", False)
        if coef.tgt is None and not with_set:
            return None, None, None, None, None, None, None, None, None
        ah, na = normalize_rows(a, spec.eps, dt, spec.normalize)
        bh, nb = (ah, na) if b is None else normalize_rows(b, spec.eps, dt, spec.normalize)
        g = g.to(dt).expand(n)
        dah = torch.zeros_like(ah) if need_a else None
        dbh = torch.zeros_like(bh) if need_b and b is not None else None
        ds = torch.zeros((), dtype=dt, device=a.device) if need_s else None
        if coef.tgt is not None:
            t = data.target
            # (0 for a target on the excluded own column)
            h = _target_h(g, coef, spec, data, n, dt, getattr(ctx, "target_less", None))
            bt = bh[t]
            if need_s:  # d TGT / ds = c - margin
                ds += torch.linalg.vecdot(ah, bt, dim=1).sub_(spec.margin).mul_(h).sum()
            extra = getattr(ctx, "target_extra", None)
            if extra is not None:
                # the log-sum-exp terms' weight on the target logit, left out of their 16-bit tiles
                # (core.PiecesFn): here it meets this term's coefficient in fp32 (their temperature
                # gradient already counts it)
                h = h + extra.to(dt)
            hs = (h * s)[:, None]
            if dah is not None:
                dah.addcmul_(bt, hs)
            del bt
            gb_t = dah if b is None else dbh
            if gb_t is not None:
                gb_t.index_add_(0, t, hs * ah)
        if with_set:
            h = _weighted(coef.set, g, dt)
            if need_s or dah is not None:
                sums = _positive_sums(ah, bh, spec, data)
                if need_s:
                    ds += (h * torch.linalg.vecdot(ah, sums, dim=1)).sum()
                if dah is not None:
                    dah.addcmul_(sums, (h * s)[:, None])
                del sums
            gb_s = dah if b is None else dbh
            if gb_s is not None:
                gb_s += _positive_sums_by_column((h * s)[:, None] * ah, bh.shape[0], spec, data)
        ga = normalize_backward_(dah, ah, na, spec.eps).to(ctx.dtypes[0]) if dah is not None else None
        gb = normalize_backward_(dbh, bh, nb, spec.eps).to(ctx.dtypes[1]) if dbh is not None else None
        gs = ds.to(scale.dtype).reshape(scale.shape) if need_s else None
        return ga, gb, gs, None, None, None, None, None, None


def value_less_target(ctx, c: Tensor, reduce: bool) -> Tensor:
    """:class:`LinearTermsFn`'s forward value (its ``ctx``, run with ``ctx.keep_rows``) with ``c_i TGT_i`` taken
    out, ``c`` [N] fp32: the rows' ``(c.tgt_i - c_i) TGT_i + c.set_i SET_i`` (``c.tgt_i TGT_i`` as before where
    ``c_i = 0``), summed with ``reduce``. What ``core.forward_parts`` uses when a log-sum-exp piece reports that
    its value already subtracts ``c_i l_it`` (``ctx.minus_target``): the two pieces' ``l_it`` then never meet, and
    with ``c.tgt = c.lse`` (InfoNCE) the target term's value is exactly 0 on those rows."""
    tgt_w, tgt_logits, set_w = ctx.rows
    if tgt_logits is None:
        raise ValueError("linear_terms.value_less_target: the piece has no target term to take c_i TGT_i from")
    rows = target_rows_less(ctx.coef.tgt, c, tgt_logits, tgt_w)
    if set_w is not None:
        rows = rows + set_w
    return rows.sum() if reduce else rows


def target_rows_less(coef, c: Tensor, tgt_logits: Tensor, tgt_w: Tensor | None = None) -> Tensor:
    """The target term's rows ``(c.tgt_i - c_i) TGT_i`` with ``c_i TGT_i`` taken out (``coef`` = ``c.tgt``, a number or
    [N]; ``c`` [N]; ``tgt_logits`` [N], whose dtype the rows take), and ``c.tgt_i TGT_i`` (``tgt_w``, or
    :func:`drop_zero`'s product) where ``c_i = 0``: exactly 0 where ``c.tgt_i = c_i``, and a row whose target logit is
    -inf (its excluded own column) never meets a nonzero coefficient times -inf."""
    dt = tgt_logits.dtype
    coef = coef.to(dt) if isinstance(coef, Tensor) else float(coef)
    c = c.to(dt)
    if tgt_w is None:
        tgt_w = _weighted(coef, tgt_logits, dt)
    return torch.where(c != 0, (coef - c) * torch.where(c != 0, tgt_logits, 0.0), tgt_w)


def _target_h(g: Tensor, coef, spec: CoreSpec, data: CoreData, n: int, dt: torch.dtype, less=None) -> Tensor:
    """The target term's coefficient times the upstream gradient per row, 0 where the target is the
    row's excluded own column (its logit is -inf: no gradient). ``less`` [N] (``ctx.target_less``, or None): the
    coefficients whose share the log-sum-exp piece's weight on the target logit holds already (``core.backward_parts``),
    left out: ``(c.tgt_i - less_i) g_i``, exactly 0 where they are equal."""
    c = coef.tgt
    if less is not None:
        c = (c.to(device=less.device, dtype=torch.float32) if isinstance(c, Tensor) else float(c)) - less
    h = _weighted(c, g.to(dt).expand(n), dt)
    if spec.exclude_self:
        t = data.target
        h = torch.where(t == torch.arange(n, device=t.device) + spec.offset, 0.0, h)
    return h


def _target_backward_kernel(ctx, a: Tensor, b: Tensor | None, s, g: Tensor, need_a: bool, need_b: bool,
                            need_s: bool, scale: Tensor | None) -> tuple:
    """(dA, dB, d scale) of the target term by the row kernel (``ctx.kernel``; the term alone, fp32)."""
    from .triton_shared.target import target_backward

    spec, data, coef, dt = ctx.spec, ctx.data, ctx.coef, ctx.dt
    n, t = a.shape[0], data.target
    h = _target_h(g, coef, spec, data, n, dt, getattr(ctx, "target_less", None))
    hk = h
    extra = getattr(ctx, "target_extra", None)
    if extra is not None:  # the log-sum-exp terms' weight on the target logit (core.PiecesFn), in fp32
        hk = h + extra.to(dt)
    need_b = need_b and b is not None
    # core.PiecesFn's fp32 gradients of the other pieces (``ctx.grads_in``): this term is added to them in
    # place (the kernel's dA, index_add_ for the target rows) and returns None for them instead
    into = getattr(ctx, "grads_in", None) or [None, None]
    into = [x if x is not None and x.dtype == torch.float32 and x.stride(-1) == 1 else None for x in into[:2]]
    acc_a = into[0] if need_a else None
    cos, da, dbr = target_backward(a, a if b is None else b, t, (hk * s).contiguous(), spec.eps, spec.normalize,
                                   acc_a)
    gs = None
    if need_s:  # d TGT / ds = c - margin
        gs = (h * (cos - spec.margin)).sum().to(scale.dtype).reshape(scale.shape)
    db = None
    if b is None:  # B is A: row t_i's part lands in dA
        if need_a:
            da.index_add_(0, t, dbr)
    elif need_b:
        if into[1] is not None:
            into[1].index_add_(0, t, dbr)
        else:
            db = torch.zeros(b.shape, dtype=torch.float32, device=b.device).index_add_(0, t, dbr).to(ctx.dtypes[1])
    return (da.to(ctx.dtypes[0]) if need_a and acc_a is None else None), db, gs


def linear_terms(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                 reduce: bool, dt: torch.dtype) -> Tensor | None:
    """``c.tgt TGT + c.set SET`` per row ([N]) or summed (0-dim); None when neither term is asked for."""
    if coef.tgt is None and coef.set is None:
        return None
    return LinearTermsFn.apply(a, b, scale, spec, data, coef, reduce, dt, False)
