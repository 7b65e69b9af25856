"""SigLIP's sigmoid loss on the PyTorch path: O(N*D) memory, any device, with an explicit backward.

With ``x_i`` the (normalised) image rows [N, D], ``y_j`` the (normalised) text rows [M, D], the scale ``s``,
the bias ``b`` and the positive of row i at column ``offset + i`` (0 without ``gather``)::

    z_ij    = s <x_i, y_j> + b
    w_ij    = -z_ij at j == offset + i (label +1), z_ij elsewhere (label -1)      (w = -label * z)
    loss_i  = sum_j softplus(w_ij) = -sum_j log sigmoid(-w_ij)

The gradient of ``softplus(w)`` is ``sigmoid(w)``; with per-row upstream gradients ``g_i``::

    dz_ij   = g_i sign_ij sigmoid(w_ij),   sign_ij = -1 at the positive, +1 elsewhere
    ds      = sum_ij dz_ij <x_i, y_j>       db = sum_ij dz_ij
    dx_i    = s sum_j dz_ij y_j             dy_j = s sum_i dz_ij x_i

followed by the backward of ``x / max(||x||, eps)`` (``norms.normalize_backward_``). ``softplus`` is
``-logsigmoid(-w)`` and its derivative ``torch.sigmoid``: both exact for any finite ``w`` (no overflow at
``s = 1e4``; ``F.softplus``'s linear cut-off at 20 would cost 2e-9 per term in float64).

The N x M logits are never allocated: rows are processed in chunks of ``rows x M`` elements within the
tile budget (``chunked.tile_elements``; one chunk when N x M fits it, the small-problem case). For a
summed loss (mean / sum) whose inputs need gradients, the upstream gradient is a scalar, so the
forward forms the gradients in the same sweep (one cosine tile per chunk, no recompute): 3 units of
an N x M x D matmul. Per-row losses (``reduction="none"``) take a forward sweep and a recomputing
backward sweep (1 + 3 units). Every sum runs in a fixed order: deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..norms import normalize_backward_, normalize_rows
from ..spec import compute_dtype
from ..tiles import tile_elements


def _row_chunk(n: int, m: int) -> int:
    return max(1, min(n, tile_elements() // max(m, 1)))


def _diag(t: Tensor, r0: int, r1: int, offset: int) -> Tensor | None:
    """The positives of rows [r0, r1) inside the [r1 - r0, M] tile ``t`` (a view), None when none is."""
    m = t.shape[1]
    lo, hi = max(r0, -offset), min(r1, m - offset)
    if hi <= lo:
        return None
    return t[lo - r0:hi - r0, lo + offset:hi + offset].diagonal()


def _flipped(x_rows: Tensor, yh: Tensor, s, b, r0: int, r1: int, offset: int) -> tuple[Tensor, Tensor]:
    """(cosines, ``w = -label * z``) of rows [r0, r1) against every column."""
    c = x_rows @ yh.T
    w = c * s + b
    d = _diag(w, r0, r1, offset)
    if d is not None:
        d.neg_()
    return c, w


def _sweep(xh, nx, yh, ny, s, b, offset: int, eps: float, g: Tensor | None, need_x: bool, need_y: bool,
           need_s: bool, need_b: bool, want_loss: bool):
    """One pass over row chunks: the per-row losses (``want_loss``) and, when ``g`` (per-row upstream
    gradients [N]) is given, the gradients (dX, dY in input space through the normalisation; ds, db)."""
    n, m = xh.shape[0], yh.shape[0]
    dt, dev = xh.dtype, xh.device
    loss = torch.empty(n, dtype=dt, device=dev) if want_loss else None
    dx = torch.empty_like(xh) if (g is not None and need_x) else None
    dyh = torch.zeros_like(yh) if (g is not None and need_y) else None
    ds = torch.zeros((), dtype=dt, device=dev) if (g is not None and need_s) else None
    db = torch.zeros((), dtype=dt, device=dev) if (g is not None and need_b) else None
    step = _row_chunk(n, m)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        xr = xh[r0:r1]
        c, w = _flipped(xr, yh, s, b, r0, r1, offset)
        if want_loss:
            loss[r0:r1] = F.logsigmoid(w.neg()).sum(dim=1).neg_()
        if g is None:
            continue
        dz = torch.sigmoid(w).mul_(g[r0:r1, None])
        del w
        d = _diag(dz, r0, r1, offset)
        if d is not None:
            d.neg_()
        if need_s:
            ds += torch.vdot(dz.reshape(-1), c.reshape(-1))
        del c
        if need_b:
            db += dz.sum()
        if need_x:
            dx[r0:r1] = normalize_backward_(torch.matmul(dz, yh).mul_(s), xr, None if nx is None else nx[r0:r1],
                                            eps)
        if need_y:
            dyh.addmm_(dz.T, xr)
    dy = normalize_backward_(dyh.mul_(s), yh, ny, eps) if dyh is not None else None
    return loss, dx, dy, ds, db


def _grad_out(t: Tensor | None, dtype, shape=None) -> Tensor | None:
    if t is None:
        return None
    t = t.to(dtype)
    return t.reshape(shape) if shape is not None else t


class SigLipFn(torch.autograd.Function):
    """SigLIP's per-row losses [N] (``reduce`` False) or ``weight * sum_i loss_i`` (0-dim) in the compute
    dtype (float32; float64 for float64 inputs), with gradients for both embeddings and for ``scale``
    and ``bias`` when they are tensors that require grad (each in its own dtype and shape).

    Inputs: ``image`` [N, D], ``text`` [M, D] (raw rows), ``scale`` / ``bias`` numbers or 0-dim tensors,
    ``offset`` the column of row 0's positive, ``weight`` a Python float (``1 / N_total`` for a mean).
    """

    @staticmethod
    @autocast_off
    def forward(ctx, image: Tensor, text: Tensor, scale, bias, normalize: bool, eps: float, offset: int,
                reduce: bool, weight: float):
        dt = compute_dtype(image, text)
        xh, nx = normalize_rows(image, eps, dt, normalize)
        yh, ny = normalize_rows(text, eps, dt, normalize)
        s = scale.detach().to(dt) if isinstance(scale, Tensor) else float(scale)
        b = bias.detach().to(dt) if isinstance(bias, Tensor) else float(bias)
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[2]
        need_b = isinstance(bias, Tensor) and ctx.needs_input_grad[3]
        ctx.opts = (eps, offset, reduce, weight)
        ctx.dtypes = (image.dtype, text.dtype,
                      (scale.dtype, scale.shape) if isinstance(scale, Tensor) else None,
                      (bias.dtype, bias.shape) if isinstance(bias, Tensor) else None)
        ctx.numbers = (None if isinstance(scale, Tensor) else s, None if isinstance(bias, Tensor) else b)
        ctx.save_for_backward(xh, nx, yh, ny, scale if isinstance(scale, Tensor) else None,
                              bias if isinstance(bias, Tensor) else None)
        ctx.eager = None
        if reduce and (need_x or need_y or need_s or need_b):
            # a summed loss: its upstream gradient is a scalar, so form the gradients in this sweep
            g = torch.full((xh.shape[0],), weight, dtype=dt, device=xh.device)
            loss, dx, dy, ds, db = _sweep(xh, nx, yh, ny, s, b, offset, eps, g, need_x, need_y, need_s, need_b,
                                          True)
            ctx.eager = (dx, dy, ds, db)
        else:
            loss = _sweep(xh, nx, yh, ny, s, b, offset, eps, None, False, False, False, False, True)[0]
        return loss.sum() * weight if reduce else loss

    @staticmethod
    @autocast_off
    @first_order("SigLipFn")
    def backward(ctx, go: Tensor):
        need_x, need_y, need_s, need_b = ctx.needs_input_grad[:4]
        xdt, ydt, sdt, bdt = ctx.dtypes
        if ctx.eager is not None:
            # the buffers are ours and dropped here; a second backward (retain_graph) recomputes
            dx, dy, ds, db = ctx.eager
            ctx.eager = None
            go = go.to(dx.dtype if dx is not None else (dy.dtype if dy is not None else go.dtype))
            dx = dx.mul_(go) if dx is not None else None
            dy = dy.mul_(go) if dy is not None else None
            ds = ds * go if ds is not None else None
            db = db * go if db is not None else None
        else:
            xh, nx, yh, ny, scale, bias = ctx.saved_tensors
            eps, offset, reduce, weight = ctx.opts
            s = scale.detach().to(xh.dtype) if scale is not None else ctx.numbers[0]
            b = bias.detach().to(xh.dtype) if bias is not None else ctx.numbers[1]
            go = go.to(xh.dtype)
            g = (go * weight).expand(xh.shape[0]) if reduce else go
            _, dx, dy, ds, db = _sweep(xh, nx, yh, ny, s, b, offset, eps, g.contiguous(), need_x, need_y,
                                       need_s and scale is not None, need_b and bias is not None, False)
        return (_grad_out(dx, xdt) if need_x else None, _grad_out(dy, ydt) if need_y else None,
                _grad_out(ds, *sdt) if need_s and sdt is not None else None,
                _grad_out(db, *bdt) if need_b and bdt is not None else None,
                None, None, None, None, None)


# --- group positives (``siglip_loss(image_groups=, text_groups=)``) ---------------------------------------

#: the losses' row-normalisation floor
EPS = 1e-12


def _counts(ids: Tensor, of: Tensor) -> Tensor:
    """For each id in ``ids``, how many entries of ``of`` equal it (O((N + M) log M), no N x M)."""
    srt = torch.sort(of).values
    return torch.searchsorted(srt, ids, right=True) - torch.searchsorted(srt, ids)


def group_pairs(ig: Tensor, tg: Tensor, ig_all: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The positive pairs of group ids: ``(rows, cols, v)`` [P], ordered by row, with ``ig[rows] == tg[cols]``
    for every such pair and its weight ``v = 1 / (2 k_i) + 1 / (2 k'_j)`` (``k_i``: entries of ``tg`` in row i's
    group; ``k'_j``: entries of ``ig_all``, every rank's images, in column j's group). O(N + M + P); reading
    P is one host sync (as ``torch.unique`` in siglip-kernel's SigLIP+)."""
    tg_sorted, perm = torch.sort(tg, stable=True)
    lo = torch.searchsorted(tg_sorted, ig)
    k = torch.searchsorted(tg_sorted, ig, right=True) - lo
    p = int(k.sum())
    rows = torch.repeat_interleave(torch.arange(ig.shape[0], device=ig.device), k, output_size=p)
    start = torch.cumsum(k, 0) - k
    cols = perm[lo[rows] + torch.arange(p, device=ig.device) - start[rows]]
    k_col = _counts(tg, ig_all)
    v = 0.5 / k[rows].double() + 0.5 / k_col[cols].double()
    return rows, cols, v


def _pair_cosines(image: Tensor, text: Tensor, normalize: bool, rows: Tensor, cols: Tensor):
    """``(x_hat, norms_x, y_hat, norms_y, cosines of the pairs)`` in the compute dtype."""
    dt = compute_dtype(image, text)
    xh, nx = normalize_rows(image, EPS, dt, normalize)
    yh, ny = normalize_rows(text, EPS, dt, normalize)
    return xh, nx, yh, ny, (xh[rows] * yh[cols]).sum(-1)


def _segment_sum(src: Tensor, idx: Tensor, n: int, ordered: bool = False) -> Tensor:
    """``zeros(n, D).index_add_(0, idx, src)`` as a segment sum over ``idx``'s sorted order (a 2-D index_add is
    a serial scatter on the CPU); ``ordered``: ``idx`` is ascending already."""
    if not ordered:
        order = torch.argsort(idx, stable=True)
        src = src[order]
    return torch.segment_reduce(src, "sum", lengths=torch.bincount(idx, minlength=n))


def _num(v, dt):
    return v.detach().to(dt) if isinstance(v, Tensor) else v


def positives_correction(image: Tensor, text: Tensor, s, b, normalize: bool, image_groups: Tensor,
                         text_groups: Tensor, all_image_groups: Tensor) -> Tensor:
    """Per image [N]: ``sum_{j positive} (v_ij softplus(-z_ij) - softplus(z_ij))``, what turns the loss with
    every pair a negative into the loss with group positives (:class:`SigLipGroupsFn`: differentiable in the
    embeddings, scale and bias; O(P D) for P pairs; under tracing the operator ``ops.siglip_groups`` runs it)."""
    return SigLipGroupsFn.apply(image, text, s, b, normalize, group_pairs(image_groups, text_groups, all_image_groups))


def correction_forward(image: Tensor, text: Tensor, s, b, normalize: bool, pairs) -> Tensor:
    """:func:`positives_correction`'s value for the pairs ``(rows, cols, v)`` of :func:`group_pairs`."""
    rows, _, v = pairs
    *_, c = _pair_cosines(image, text, normalize, rows, pairs[1])
    z = c * _num(s, c.dtype) + _num(b, c.dtype)
    # softplus(w) = -logsigmoid(-w): exact for any finite w (F.softplus cuts over to w at 20)
    term = F.logsigmoid(-z) - v.to(c.dtype) * F.logsigmoid(z)
    return torch.zeros(image.shape[0], dtype=c.dtype, device=image.device).index_add_(0, rows, term)


def correction_grads(image: Tensor, text: Tensor, s, b, normalize: bool, pairs, go: Tensor, need):
    """Its gradients for the upstream ``go`` [N] (image, text, scale, bias; None where not in ``need``):
    ``d term / dz = -(sigmoid(z) + v sigmoid(-z))``, then the cosines' and the normalisation's backward."""
    rows, cols, v = pairs
    xh, nx, yh, ny, c = _pair_cosines(image, text, normalize, rows, cols)
    dt = c.dtype
    sv = _num(s, dt)
    z = c * sv + _num(b, dt)
    dz = -go.to(dt)[rows] * (torch.sigmoid(z) + v.to(dt) * torch.sigmoid(-z))
    gx = gy = gs = gb = None
    if need[0]:
        # the pairs come ordered by row (group_pairs)
        gx = normalize_backward_(_segment_sum(dz[:, None] * yh[cols] * sv, rows, xh.shape[0], ordered=True), xh, nx,
                                 EPS)
        gx = gx.to(image.dtype)
    if need[1]:
        gy = normalize_backward_(_segment_sum(dz[:, None] * xh[rows] * sv, cols, yh.shape[0]), yh, ny, EPS)
        gy = gy.to(text.dtype)
    if need[2]:
        gs = (dz * c).sum().to(s.dtype).reshape(s.shape)
    if need[3]:
        gb = dz.sum().to(b.dtype).reshape(b.shape)
    return gx, gy, gs, gb


class SigLipGroupsFn(torch.autograd.Function):
    """:func:`positives_correction` [N] for given pairs, with its gradient written out (autocast off)."""

    @staticmethod
    @autocast_off
    def forward(ctx, image: Tensor, text: Tensor, s, b, normalize: bool, pairs) -> Tensor:
        ctx.save_for_backward(image, text, *(x if isinstance(x, Tensor) else None for x in (s, b)), *pairs)
        ctx.numbers = (s, b, normalize)
        return correction_forward(image, text, s, b, normalize, pairs)

    @staticmethod
    @autocast_off
    @first_order("SigLipGroupsFn")
    def backward(ctx, go: Tensor):
        image, text, s_t, b_t, *pairs = ctx.saved_tensors
        s, b, normalize = ctx.numbers
        s, b = (s_t if s_t is not None else s), (b_t if b_t is not None else b)
        need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], s_t is not None and ctx.needs_input_grad[2],
                b_t is not None and ctx.needs_input_grad[3]]
        return (*correction_grads(image, text, s, b, normalize, pairs, go, need), None, None)
