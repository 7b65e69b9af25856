"""The core op at several Matryoshka levels in one pass over D (``docs/matryoshka.md`` derives it).

Levels ``d_1 < ... < d_K <= D``: level k's cosine is ``cos^k_ij = <A_i[:d_k], B_j[:d_k]> / (n^k_i m^k_j)``
with the clamped prefix norms ``n^k_i = max(||A_i[:d_k]||, eps)`` (``m^k_j`` likewise): every level
re-normalises its prefix, sentence-transformers' ``truncate, then F.normalize`` (so ``spec.normalize``
does not apply: a prefix is always a unit row). Each level is the whole core op of ``spec.py`` on its
cosines (logits ``s cos^k`` plus the spec's bias and masks, the five statistics, the coefficients), and
the output is one value per level: ``[K, N]`` per-row losses, or ``[K]`` sums (``reduce``).

How it runs (PyTorch, any device, O(N*D + K*N) memory; no N x M tensor):

* D is cut into segments ``S_r = [d_{r-1}, d_r)``; a row chunk's tile of level k is the running sum of
  the segment products ``A[:, S_r] B[:, S_r]^T`` (one N x M x D unit of matmul for every level
  together) divided by the prefix norms (running sums of segment square norms, O(N K)).
* Backward: ``G^k = s dl^k / (n^k m^k)`` and the row / column scalars ``rho^k = sum_j s dl^k cos^k /
  (n^k)^2`` (``gamma^k`` per column); ``H^r = sum_{k >= r} G^k`` built from the top level down, and
  ``dA[:, S_r] = H^r B[:, S_r] - A[:, S_r] sum_{k >= r} rho^k`` (``dB`` the same transposed): one GEMM
  per segment and side, so two units, as for one loss.
* A summed output without a column term forms its gradients in the forward (each row chunk spans all
  columns, so its log-sum-exps are final there): 3 units in all, for every level together. Those
  gradients are of ``sum_k w_k out_k`` (``weights``); the backward scales them by ``alpha`` from the
  upstream gradient ``go = alpha w``, which is what every loss passes (the weighted sum of the levels
  times factors that do not depend on the level). Other outputs store statistics and recompute.

A row chunk has the plain chunked path's rows (``chunked._row_chunk``: a ``rows x M`` tile within the
tile budget, spanning all M columns); the levels' tiles live at once (K + 1 on the cross-entropy
route, K + 3 otherwise): O(K M) memory, within O(N D + K N).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..norms import clamped_norms
from ..spec import Coeffs, CoreData, CoreSpec, combine, compute_dtype
from ..tiles import _row_chunk, _safe, _vec

_NEG_INF = float("-inf")


def _prefix_norms(x: Tensor, bounds: list[int], eps: float, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(norms, active)`` [R, K]: the clamped norm of every prefix ``x[:, :d_k]`` and whether it is above
    ``eps`` (a clamped prefix is divided by the constant eps: no projection in its backward)."""
    segs = [clamped_norms(x[:, lo:hi], 0.0, dt) ** 2 for lo, hi in zip([0] + bounds[:-1], bounds, strict=True)]
    raw = torch.stack(segs, dim=1).cumsum_(1).sqrt_()
    return raw.clamp_min(eps), raw > eps


class _Problem:
    """What one call needs in every pass: the inputs in the compute dtype, prefix norms, the masks."""

    def __init__(self, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, dims: tuple[int, ...],
                 dt: torch.dtype):
        self.same = b is None
        self.a = a.to(dt)
        self.b = self.a if b is None else b.to(dt)
        self.s = scale.detach().to(dt) if isinstance(scale, Tensor) else float(scale)
        self.spec, self.data, self.dims, self.dt = spec, data, list(dims), dt
        self.lo = [0] + self.dims[:-1]
        self.na, self.act_a = _prefix_norms(self.a, self.dims, spec.eps, dt)
        self.nb, self.act_b = (self.na, self.act_a) if b is None else _prefix_norms(self.b, self.dims, spec.eps, dt)
        self.n, self.m, self.k = self.a.shape[0], self.b.shape[0], len(self.dims)

    def cosines(self, r0: int, r1: int) -> list[Tensor]:
        """Level k's cosine tile [r1 - r0, M] for every k (running sums of the segment products)."""
        out, acc = [], None
        for k, (lo, hi) in enumerate(zip(self.lo, self.dims, strict=True)):
            p = self.a[r0:r1, lo:hi] @ self.b[:, lo:hi].T
            acc = p if acc is None else acc + p
            out.append(acc / (self.na[r0:r1, k, None] * self.nb[None, :, k]))
        return out

    def logits(self, c: Tensor, r0: int, r1: int) -> tuple[Tensor, Tensor | None]:
        """``(masked logits, the target logit per row or None)`` of a cosine tile of rows [r0, r1)."""
        spec, data = self.spec, self.data
        l = c * self.s
        if data.bias_col is not None and spec.bias != 0.0:
            l.scatter_add_(1, data.bias_col[r0:r1, None],
                           torch.full((r1 - r0, 1), spec.bias, dtype=l.dtype, device=l.device))
        if spec.exclude_self:
            own = torch.arange(r0, r1, device=l.device) + spec.offset
            inside = own < self.m
            rows = torch.arange(r1 - r0, device=l.device)[inside]
            l[rows, own[inside]] = _NEG_INF
        tgt = None
        if data.target is not None:
            tgt = l.gather(1, data.target[r0:r1, None])[:, 0]
            if spec.exclude_target:
                l = l.scatter(1, data.target[r0:r1, None], _NEG_INF)
        return l, tgt

    def weights(self, r0: int, r1: int) -> Tensor | None:
        """Positive weights ``w_ij`` of rows [r0, r1) (0 at the excluded own column), or None."""
        data = self.data
        if not data.has_positives:
            return None
        dev = self.a.device
        if data.pos_mask is not None:
            n0, m0 = data.pos_mask.shape
            ri = torch.arange(r0, r1, device=dev) % n0
            ci = torch.arange(self.m, device=dev) % m0
            w = data.pos_mask[ri[:, None], ci[None, :]].to(self.dt)
        else:
            w = (data.row_labels[r0:r1, None] == data.col_labels[None, :]).to(self.dt)
        if self.spec.exclude_self:
            own = torch.arange(r0, r1, device=dev) + self.spec.offset
            inside = own < self.m
            w[torch.arange(r1 - r0, device=dev)[inside], own[inside]] = 0.0
        return w


def _stats(l: Tensor, w: Tensor | None, want_pos: bool, want_set: bool):
    """Row statistics of a logit tile spanning all columns: LSE, LSEpos, SET (None when not wanted)."""
    lse = torch.logsumexp(l, dim=1)
    lse_pos = torch.logsumexp(l + torch.log(w), dim=1) if want_pos else None
    set_ = torch.where(w > 0, w * l, 0.0).sum(1) if want_set else None
    return lse, lse_pos, set_


def _logit_grad(l: Tensor, w: Tensor | None, r0: int, r1: int, data: CoreData, lse, lse_col, lse_pos,
                g, g_col, g_pos, g_tgt, g_set) -> Tensor:
    """``dl`` of one level's tile: ``g p + gc pc + gp q - gt [j == target] - gs w`` (each g per row of the
    tile, ``gc`` per column; None: the term is absent)."""
    dl = torch.zeros_like(l)
    if g is not None:
        dl += (l - _safe(lse)[:, None]).exp() * g[:, None]
    if g_col is not None:
        dl += (l - _safe(lse_col)[None, :]).exp() * g_col[None, :]
    if g_pos is not None:
        dl += w * (l - _safe(lse_pos)[:, None]).exp() * g_pos[:, None]
    if g_set is not None:
        dl -= w * g_set[:, None]
    if g_tgt is not None:
        dl.scatter_add_(1, data.target[r0:r1, None], -g_tgt[:, None])
    return dl


class _Grads:
    """Accumulates ``dA``, ``dB`` and ``ds`` over row chunks from the levels' logit-gradient tiles."""

    def __init__(self, pb: _Problem, need_a: bool, need_b: bool, need_s: bool):
        self.pb = pb
        self.need_a, self.need_b, self.need_s = need_a, need_b, need_s
        self.da = torch.zeros_like(pb.a) if need_a else None
        self.db = torch.zeros_like(pb.b) if need_b else None
        self.gamma = torch.zeros(pb.m, pb.k, dtype=pb.dt, device=pb.a.device) if need_b else None
        self.ds = torch.zeros((), dtype=torch.float64, device=pb.a.device)

    def add(self, r0: int, r1: int, cos: list[Tensor], dls: list[Tensor]) -> None:
        """Rows [r0, r1): ``cos[k]``, ``dls[k]`` level k's cosine and logit-gradient tiles (consumed)."""
        pb = self.pb
        if self.need_s:
            for c, dl in zip(cos, dls, strict=True):
                self.ds += torch.linalg.vecdot(dl, c, dim=1).sum().to(torch.float64)
        na, nb = pb.na[r0:r1], pb.nb
        gs, rhos, gammas = [], [], []
        for k in range(pb.k):
            gc = dls[k].mul_(pb.s)  # d loss / d cos^k
            rhos.append(torch.where(pb.act_a[r0:r1, k], torch.linalg.vecdot(gc, cos[k], dim=1) / na[:, k] ** 2, 0.0))
            if self.need_b:
                col = torch.linalg.vecdot(gc, cos[k], dim=0) / nb[:, k] ** 2
                gammas.append(torch.where(pb.act_b[:, k], col, 0.0))
            gs.append(gc.div_(na[:, k, None]).div_(nb[None, :, k]))
        self.apply(r0, r1, gs, rhos, gammas)

    def apply(self, r0: int, r1: int, gs: list[Tensor], rhos: list[Tensor], gammas: list[Tensor],
              cols: list[Tensor] | None = None) -> None:
        """Rows [r0, r1) from level k's ``G^k`` tile (consumed; ``G^k = gs[k] * cols[k]`` per column when
        ``cols`` is given), row scalars ``rho^k`` and column scalars ``gamma^k``: the suffix sums from the
        top level down, one GEMM per segment and side."""
        pb = self.pb
        h = None
        rho = None
        for k in range(pb.k - 1, -1, -1):
            if cols is None:
                h = gs[k] if h is None else h.add_(gs[k])
            else:
                h = gs[k].mul_(cols[k][None, :]) if h is None else h.addcmul_(gs[k], cols[k][None, :])
            gs[k] = None
            rho = rhos[k] if rho is None else rho + rhos[k]
            if self.need_b:
                self.gamma[:, k] += gammas[k]
            lo, hi = pb.lo[k], pb.dims[k]
            if self.need_a:
                da = self.da[r0:r1, lo:hi]
                da.addmm_(h, pb.b[:, lo:hi])
                da.addcmul_(pb.a[r0:r1, lo:hi], rho[:, None], value=-1.0)
            if self.need_b:
                self.db[:, lo:hi].addmm_(h.T, pb.a[r0:r1, lo:hi])

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor]:
        pb = self.pb
        db = self.db
        if db is not None:
            suffix = self.gamma.flip(1).cumsum(1).flip(1)
            for k in range(pb.k):
                lo, hi = pb.lo[k], pb.dims[k]
                db[:, lo:hi] -= pb.b[:, lo:hi] * suffix[:, k, None]
            if pb.spec.grad_cols is not None:
                db[pb.spec.grad_cols:] = 0.0
        # the columns past the last level take no part in any level: their gradient stays 0
        return self.da, db, self.ds.to(pb.dt)



_LOG2E = 1.0 / math.log(2.0)

#: the largest |logit| for which exp(logit) needs no max subtraction: exp(+-40) and sums of up to 1e20 of
#: them stay normal float32 numbers (float64: exp(+-600))
_NO_SHIFT = {torch.float32: 40.0, torch.float64: 600.0}


def _ce_fast(pb: _Problem, coef: Coeffs) -> bool:
    """Whether the cross-entropy route applies: coefficients on LSE and the target logit only, and
    logits bounded by ``|s| + |bias|`` (every level's cosine is in [-1, 1]) small enough to exponentiate
    without a row maximum. A scale tensor off the CPU is not read (that would be a host sync)."""
    if coef.col is not None or coef.pos is not None or coef.set is not None:
        return False
    s = pb.s
    if isinstance(s, Tensor):
        if s.device.type != "cpu":
            return False
        s = float(s)
    bias = abs(pb.spec.bias) if pb.data.bias_col is not None else 0.0
    return abs(s) + bias <= _NO_SHIFT.get(pb.dt, 0.0)


class _Tiles:
    """The cross-entropy route's tiles, allocated once per call and reused by every row chunk (a fresh
    4 MiB CPU tensor costs more to allocate, page by page, than one pass over it): 0 the raw prefix
    products, 1 a product tile, 2 + k level k's exponentials."""

    def __init__(self, rows: int, pb: _Problem):
        self.buf = [None] * (pb.k + 2)
        self.rows, self.m, self.dt, self.dev = rows, pb.m, pb.dt, pb.a.device

    def tile(self, i: int, rows: int) -> Tensor:
        if self.buf[i] is None:
            self.buf[i] = torch.empty(self.rows, self.m, dtype=self.dt, device=self.dev)
        return self.buf[i][:rows]


def _ce_chunk(pb: _Problem, r0: int, r1: int, coef: Coeffs, go: list[Tensor] | None, stats: list | None,
              grads: _Grads | None, bufs: _Tiles) -> None:
    """Rows [r0, r1) of every level on the cross-entropy route (``_ce_fast``): the statistics LSE and TGT
    into ``stats = [lse, tgt]`` ([K, N] each, or None), and with ``go`` (level k's upstream gradient of
    its rows) the gradient tiles into ``grads``.

    Per level and tile: the logits ``acc * (s / n) (1 / m)`` (the raw prefix products ``acc``
    accumulated in place by one GEMM per segment), ``e = exp`` of them without a shift, the masks as
    zeros in ``e``, ``z = sum_j e``; the gradient tile ``G = s dl / (n m)`` is ``e`` scaled in place by
    the row factor ``g s / (z n)`` and the column factor ``1 / m``, less the target's one-hot. Nine
    passes over the tile per level in all, into tiles allocated once per call (``_Tiles``)."""
    spec, data = pb.spec, pb.data
    dev = pb.a.device
    rows = torch.arange(r1 - r0, device=dev)
    tgt_col = data.target[r0:r1] if data.target is not None else None
    own = torch.arange(r0, r1, device=dev) + spec.offset if spec.exclude_self else None
    own_in = (own < pb.m) if own is not None else None
    bias_col = data.bias_col[r0:r1] if data.bias_col is not None and spec.bias != 0.0 else None
    acc = bufs.tile(0, r1 - r0)
    s = pb.s
    gs, rhos, gammas, cols = [], [], [], []
    for k in range(pb.k):
        lo, hi = pb.lo[k], pb.dims[k]
        if k == 0:
            torch.mm(pb.a[r0:r1, lo:hi], pb.b[:, lo:hi].T, out=acc)
        else:
            acc.addmm_(pb.a[r0:r1, lo:hi], pb.b[:, lo:hi].T)
        ra = s / pb.na[r0:r1, k]
        rb = 1.0 / pb.nb[:, k]
        tgt = None
        if tgt_col is not None:  # the target logit, in the tile's order of operations: (acc ra) rb
            tgt = acc[rows, tgt_col] * ra * rb[tgt_col]
            if bias_col is not None:
                tgt = torch.where(bias_col == tgt_col, tgt + spec.bias, tgt)
            if own is not None:
                tgt = torch.where(own == tgt_col, _NEG_INF, tgt)
        # exp(l) as exp2(l log2 e), log2 e folded into the row factor: exp2 runs at twice exp's speed on
        # the CPU (1.1 against 2.0 ms per 2M float32 elements, measured here); the argument's extra rounding
        # is a relative 6e-8 |l| <= 2.4e-6 of each exponential at the route's |l| <= 40 (float64: 1e-16 |l|)
        e = torch.mul(acc, (ra * _LOG2E)[:, None], out=bufs.tile(2 + k, r1 - r0)).mul_(rb[None, :])
        e.exp2_()
        if bias_col is not None:
            e[rows, bias_col] *= math.exp(spec.bias)
        if own is not None:
            e[rows[own_in], own[own_in]] = 0.0
        if spec.exclude_target:
            e[rows, tgt_col] = 0.0
        z = e.sum(1)
        lse = torch.where(z > 0, torch.log(z), _NEG_INF)
        if stats is not None:
            stats[0][k, r0:r1] = lse
            if stats[1] is not None:
                stats[1][k, r0:r1] = tgt
        if go is None:
            continue
        g = _vec(coef.lse, pb.n, lse)[r0:r1] * go[k]
        g = torch.where(z > 0, g / torch.where(z > 0, z, 1.0), 0.0)
        e.mul_((g * ra)[:, None])  # E = G / (1 / m): the softmax part, its columns not yet scaled
        if coef.tgt is not None:
            gt = _vec(coef.tgt, pb.n, lse)[r0:r1] * go[k]
            e[rows, tgt_col] -= gt * ra
        t = torch.mul(e, acc, out=bufs.tile(1, r1 - r0))
        r = torch.mv(t, rb)  # sum_j G_ij acc_ij = s sum_j dl_ij cos_ij
        if grads.need_s:
            grads.ds += (r.sum() / s).to(torch.float64)
        rhos.append(torch.where(pb.act_a[r0:r1, k], r / pb.na[r0:r1, k] ** 2, 0.0))
        if grads.need_b:
            gammas.append(torch.where(pb.act_b[:, k], t.sum(0) * rb / pb.nb[:, k] ** 2, 0.0))
        del t
        gs.append(e)
        cols.append(rb)
    if go is not None:
        grads.apply(r0, r1, gs, rhos, gammas, cols)

def _general_chunk(pb: _Problem, r0: int, r1: int, coef: Coeffs, st: tuple, write: bool,
                   go_rows: list[Tensor] | None, go_cols: list[Tensor] | None, grads: _Grads | None) -> None:
    """Rows [r0, r1) of every level on the general route (any coefficients): with ``write`` the statistics
    ``st = (lse, lse_col, lse_pos, tgt, set)`` ([K, N], ``lse_col`` [K, M] accumulated; None when not
    computed) are filled from the tiles, else read; with ``go_rows`` (level k's upstream gradient of its
    rows; ``go_cols`` of the columns for a column term) the gradient tiles go into ``grads``."""
    lse, lse_col, lse_pos, tgt, set_ = st
    cos = pb.cosines(r0, r1)
    w = pb.weights(r0, r1)
    dls = []
    for lvl in range(pb.k):
        l, t = pb.logits(cos[lvl], r0, r1)
        if write:
            stats = _stats(l, w, lse_pos is not None, set_ is not None)
            lse[lvl, r0:r1] = stats[0]
            if lse_pos is not None:
                lse_pos[lvl, r0:r1] = stats[1]
            if set_ is not None:
                set_[lvl, r0:r1] = stats[2]
            if tgt is not None:
                tgt[lvl, r0:r1] = t
            if lse_col is not None:
                lse_col[lvl] = torch.logaddexp(lse_col[lvl], torch.logsumexp(l, dim=0))
        if go_rows is not None:
            pos = None if lse_pos is None else lse_pos[lvl, r0:r1]
            col = None if go_cols is None else (lse_col[lvl], go_cols[lvl])
            gs = _level_grads(coef, go_rows[lvl], r0, r1, lse[lvl, r0:r1], col, pos, pb.n)
            dls.append(_logit_grad(l, w, r0, r1, pb.data, lse[lvl, r0:r1], None if col is None else lse_col[lvl],
                                   pos, *gs))
        del l
    if go_rows is not None:
        grads.add(r0, r1, cos, dls)


class MatryoshkaCoreFn(torch.autograd.Function):
    """The core op at levels ``dims`` (ascending, ``dims[-1] <= D``): ``[K, N]`` per-row values or
    ``[K]`` sums, level k in row k. ``weights`` (one float per level) are the multipliers the caller
    applies to the levels; they are used only by the eager route (see the module docstring)."""

    @staticmethod
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                reduce: bool, dims: tuple[int, ...], weights: tuple[float, ...]):
        dt = compute_dtype(a, b)
        coef = coef.to(dt)
        pb = _Problem(a, b, scale, spec, data, dims, dt)
        n, m, k = pb.n, pb.m, pb.k
        want_col, want_pos = coef.col is not None, coef.pos is not None
        want_tgt, want_set = coef.tgt is not None, coef.set is not None
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[2]
        ctx.spec, ctx.data, ctx.coef, ctx.reduce, ctx.dims, ctx.weights = spec, data, coef, reduce, dims, weights
        ctx.dtypes = (a.dtype, None if b is None else b.dtype,
                      scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        ctx.scale = None if isinstance(scale, Tensor) else scale
        eager = (reduce and not want_col and (need_a or need_b or need_s)
                 and any(w != 0 for w in weights))
        dev = pb.a.device
        lse = torch.empty(k, n, dtype=dt, device=dev)
        lse_pos = torch.empty(k, n, dtype=dt, device=dev) if want_pos else None
        tgt = torch.empty(k, n, dtype=dt, device=dev) if want_tgt else None
        set_ = torch.empty(k, n, dtype=dt, device=dev) if want_set else None
        lse_col = torch.full((k, m), _NEG_INF, dtype=dt, device=dev) if want_col else None
        grads = _Grads(pb, need_a, need_b or (pb.same and need_a), need_s) if eager else None
        fast = _ce_fast(pb, coef)
        step = _row_chunk(n, m)
        bufs = _Tiles(min(n, step), pb) if fast else None
        for r0 in range(0, n if fast else 0, step):
            r1 = min(n, r0 + step)
            go = [torch.full((r1 - r0,), float(w), dtype=dt, device=dev) for w in weights] if eager else None
            _ce_chunk(pb, r0, r1, coef, go, [lse, tgt], grads, bufs)
        for r0 in range(0, n if not fast else 0, step):
            r1 = min(n, r0 + step)
            go = [torch.full((r1 - r0,), float(w), dtype=dt, device=dev) for w in weights] if eager else None
            _general_chunk(pb, r0, r1, coef, (lse, lse_col, lse_pos, tgt, set_), True, go, None, grads)
        ctx.eager = grads.result() if eager else None
        ctx.save_for_backward(a, b, scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos)
        return torch.stack([combine(coef, reduce, lse[lvl], None if lse_col is None else lse_col[lvl],
                                    None if lse_pos is None else lse_pos[lvl], None if tgt is None else tgt[lvl],
                                    None if set_ is None else set_[lvl]) for lvl in range(k)])

    @staticmethod
    @autocast_off
    @first_order("MatryoshkaCoreFn")
    def backward(ctx, go: Tensor):
        need_a, need_b, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        a, b, scale, lse, lse_col, lse_pos = ctx.saved_tensors
        if scale is None:
            scale = ctx.scale
        dt = lse.dtype
        go = go.to(dt)
        if ctx.eager is not None:
            w = torch.tensor(ctx.weights, dtype=dt, device=go.device)
            alpha = (go * w).sum() / (w * w).sum()
            if go.device.type != "cpu" or torch.allclose(go, alpha * w, rtol=1e-6, atol=0.0):
                da, db, ds = ctx.eager
                ctx.eager = None
                return _out(ctx, need_a, need_b, need_s, da, db, ds, alpha, b is None)
        pb = _Problem(a, b, scale, ctx.spec, ctx.data, ctx.dims, dt)
        coef, reduce = ctx.coef, ctx.reduce
        n, m, k = pb.n, pb.m, pb.k
        grads = _Grads(pb, need_a, need_b or (pb.same and need_a), need_s)
        fast = _ce_fast(pb, coef)
        step = _row_chunk(n, m)
        bufs = _Tiles(min(n, step), pb) if fast else None
        for r0 in range(0, n if fast else 0, step):
            r1 = min(n, r0 + step)
            rows_go = [go[lvl].expand(r1 - r0) if reduce else go[lvl, r0:r1] for lvl in range(k)]
            _ce_chunk(pb, r0, r1, coef, rows_go, None, grads, bufs)
        for r0 in range(0, n if not fast else 0, step):
            r1 = min(n, r0 + step)
            rows_go = [go[lvl].expand(n)[r0:r1] if reduce else go[lvl, r0:r1] for lvl in range(k)]
            cols_go = None
            if lse_col is not None:
                cols_go = [go[lvl].expand(m) if reduce else go[lvl] for lvl in range(k)]
            _general_chunk(pb, r0, r1, coef, (lse, lse_col, lse_pos, None, None), False, rows_go, cols_go, grads)
        da, db, ds = grads.result()
        return _out(ctx, need_a, need_b, need_s, da, db, ds, None, b is None)


def _level_grads(coef: Coeffs, go_rows: Tensor, r0: int, r1: int, lse_r: Tensor, col: tuple | None,
                 lse_pos_r: Tensor | None, n: int):
    """``(g, g_col, g_pos, g_tgt, g_set)`` of one level for rows [r0, r1): the coefficients times the
    upstream gradient, 0 where the statistic is -inf (a dropped term) or absent (None)."""
    def rows(c):
        v = _vec(c, n, go_rows)
        return None if v is None else v[r0:r1] * go_rows
    g = rows(coef.lse)
    g = torch.where(lse_r == _NEG_INF, 0.0, g)
    g_col = None
    if col is not None:
        lse_col, go_cols = col
        g_col = torch.where(lse_col == _NEG_INF, 0.0, _vec(coef.col, go_cols.shape[0], go_cols) * go_cols)
    g_pos = rows(coef.pos)
    if g_pos is not None:
        g_pos = torch.where(lse_pos_r == _NEG_INF, 0.0, g_pos)
    return g, g_col, g_pos, rows(coef.tgt), rows(coef.set)


def _out(ctx, need_a, need_b, need_s, da, db, ds, alpha, same):
    adt, bdt, sdt, sshape = ctx.dtypes
    if same and da is not None and db is not None:
        da = da + db
        db = None
    if alpha is not None:
        da = da * alpha if da is not None else None
        db = db * alpha if db is not None else None
        ds = ds * alpha
    return (
        da.to(adt) if need_a and da is not None else None,
        db.to(bdt) if need_b and db is not None else None,
        ds.to(sdt).reshape(sshape) if need_s else None,
        None, None, None, None, None, None,
    )


def run(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs, reduce: bool,
        dims: tuple[int, ...], weights: tuple[float, ...]) -> Tensor:
    """The core op at every level (see :class:`MatryoshkaCoreFn`): ``[K]`` or ``[K, N]``."""
    return MatryoshkaCoreFn.apply(a, b, scale, spec, data, coef, reduce, tuple(dims), tuple(float(w) for w in weights))
