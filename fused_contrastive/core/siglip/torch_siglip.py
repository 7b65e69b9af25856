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
