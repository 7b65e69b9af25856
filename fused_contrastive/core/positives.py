"""The linear positive terms of the core op in O(N*D): ``TGT_i = l_{i, target_i}`` and
``SET_i = sum_j w_ij l_ij``, plus the positive counts ``|P_i| = sum_j w_ij`` the losses divide by.

Used by the chunked PyTorch path and the Triton path (the dense path reads them off its tile). No
N x M work: with ``l_ij = s <a_i, b_j> + bias [j == bias_col_i]``,

* ``TGT_i = s <a_i, b_{t_i}> + bias [t_i == bias_col_i]`` (``-inf`` when ``t_i`` is the excluded own
  column), a gathered row dot (:class:`PairCos`, which saves only its inputs);
* labels: ``sum_j w_ij b_j = C[y_i] - [y_i == y_self] b_self`` with class sums ``C`` over the contrast
  rows (``index_add`` by group id; the groups come from a sort, not ``torch.unique``, so every shape is
  known without reading the labels);
* dense mask ``w_ij = mask[i % n0, j % m0]``: ``sum_j w_ij b_j = (mask @ V)[i % n0] - w_self b_self``
  with ``V[c] = sum_{j % m0 = c} b_j`` (an [n0, m0] x [m0, D] matmul).

Everything is plain differentiable PyTorch (autograd gives the gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunked import tile_elements
from .norms import clamped_norms, normalize_backward_, unit_rows
from .spec import Coeffs, CoreData, CoreSpec, drop_zero

_CHUNK_ELEMENTS = 1 << 18  # rows per chunk x D: the float64 norm temporaries stay ~2 MiB


def _chunks(n: int, d: int):
    step = max(1, _CHUNK_ELEMENTS // max(d, 1))
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)


class PairCos(torch.autograd.Function):
    """``out_i = <x_hat_i, y_hat_{idx_i}>``: the cosine of row i of x with row idx_i of y (raw dot
    products when ``normalize`` is False), in row chunks, saving only the inputs."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, idx: Tensor, normalize: bool, eps: float, dt: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, y, idx)
        ctx.normalize, ctx.eps, ctx.dt = normalize, eps, dt
        out = torch.empty(x.shape[0], dtype=dt, device=x.device)
        for r0, r1 in _chunks(x.shape[0], x.shape[1]):
            xr, yr = x[r0:r1], y[idx[r0:r1]]
            if normalize:
                xh = xr.to(dt) / clamped_norms(xr, eps, dt)[:, None]
                yh = yr.to(dt) / clamped_norms(yr, eps, dt)[:, None]
            else:
                xh, yh = xr.to(dt), yr.to(dt)
            out[r0:r1] = torch.linalg.vecdot(xh, yh, dim=1)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, y, idx = ctx.saved_tensors
        dt, eps = ctx.dt, ctx.eps
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if need_x else None
        gy = torch.zeros(y.shape, dtype=dt, device=y.device) if need_y else None
        for r0, r1 in _chunks(x.shape[0], x.shape[1]):
            xr, yr, gr = x[r0:r1], y[idx[r0:r1]], g[r0:r1].to(dt)[:, None]
            if ctx.normalize:
                nx, ny = clamped_norms(xr, eps, dt), clamped_norms(yr, eps, dt)
                xh, yh = xr.to(dt) / nx[:, None], yr.to(dt) / ny[:, None]
                if need_x:
                    gx[r0:r1] = normalize_backward_(gr * yh, xh, nx, eps).to(x.dtype)
                if need_y:
                    gy.index_add_(0, idx[r0:r1], normalize_backward_(gr * xh, yh, ny, eps))
            else:
                if need_x:
                    gx[r0:r1] = (gr * yr.to(dt)).to(x.dtype)
                if need_y:
                    gy.index_add_(0, idx[r0:r1], gr * xr.to(dt))
        return gx, (gy.to(y.dtype) if need_y else None), None, None, None, None


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
    if data.pos_mask is None and n * m <= tile_elements():
        # small problems: count on the label-equality tile (4 ops instead of a sort and its bookkeeping)
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


def _positive_sums(ah: Tensor, bh: Tensor, spec: CoreSpec, data: CoreData) -> Tensor:
    """``sum_j w_ij b_hat_j`` for every row, [N, D], excluding the own column."""
    n, m = ah.shape[0], bh.shape[0]
    dev, dt = ah.device, ah.dtype
    if data.pos_mask is not None:
        n0, m0 = data.pos_mask.shape
        folded = bh.new_zeros(m0, bh.shape[1]).index_add(0, torch.arange(m, device=dev) % m0, bh)
        sums = (data.pos_mask.to(dt) @ folded)[torch.arange(n, device=dev) % n0]
    else:
        col_gid, row_gid, found = _groups(data.col_labels, data.row_labels)
        class_sums = bh.new_zeros(m, bh.shape[1]).index_add(0, col_gid, bh)
        sums = torch.where(found[:, None], class_sums[row_gid], torch.zeros((), dtype=dt, device=dev))
    if spec.exclude_self:
        own, _ = _self_columns(spec, n, m, dev)
        sums = sums - _self_weights(spec, data, n, m, dt, dev)[:, None] * bh[own]
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


def linear_terms(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                 reduce: bool, dt: torch.dtype) -> Tensor | None:
    """``c.tgt TGT + c.set SET`` per row ([N]) or summed (0-dim); None when neither term is asked for."""
    if coef.tgt is None and coef.set is None:
        return None
    n = a.shape[0]
    bb = a if b is None else b
    dev = a.device
    s = scale.to(dt) if isinstance(scale, Tensor) else float(scale)
    has_bias = data.bias_col is not None and spec.bias != 0.0
    out = None
    if coef.tgt is not None:
        t = data.target
        tgt = s * PairCos.apply(a, bb, t, spec.normalize, spec.eps, dt)
        if has_bias:
            tgt = tgt + spec.bias * (t == data.bias_col).to(dt)
        if spec.exclude_self:
            tgt = torch.where(t == torch.arange(n, device=dev) + spec.offset,
                              torch.full((), float("-inf"), dtype=dt, device=dev), tgt)
        out = drop_zero(coef.tgt.to(dt) if isinstance(coef.tgt, Tensor) else coef.tgt, tgt)
    if coef.set is not None:
        ah = unit_rows(a, spec.eps, dt, spec.normalize)
        bh = ah if b is None else unit_rows(b, spec.eps, dt, spec.normalize)
        set_ = s * torch.linalg.vecdot(ah, _positive_sums(ah, bh, spec, data), dim=1)
        if has_bias:
            set_ = set_ + spec.bias * _positive_weight_at(data.bias_col, spec, data, n, dt)
        term = drop_zero(coef.set.to(dt) if isinstance(coef.set, Tensor) else coef.set, set_)
        out = term if out is None else out + term
    return out.sum() if reduce else out
