"""Several column blocks merged into one softmax per row, with exclusion masks computed inside each
tile: the core of guided in-batch negatives (GISTEmbed) and of duplicate masking by id.

Embedding tensors ``X_0 .. X_{T-1}`` (each [n_t, D], differentiable). Row ``i`` (``i < N``) of the
problem sees blocks ``k = 1..K``; block ``k`` pairs the rows ``R_k = X_{r_k}[o_k : o_k + N]`` with the
columns ``C_k = X_{c_k}`` and its logits are ``l^k_ij = s <r_hat_i, c_hat_j>`` (rows L2-normalised unless
``normalize=False``). Column ``j`` of block ``k`` is left out of row ``i``'s softmax (logit ``-inf``) when

* guide:  ``<g_hat(R_k)_i, g_hat(C_k)_j> > theta_i`` (the guide tensors ``G_t`` [n_t, Dg], no gradient,
  normalised here; ``theta`` [N] the per-row threshold), or
* ids:    ``ids(R_k)_i == ids(C_k)_j`` (int64 ids per tensor row), or
* own:    ``j == e_k + i`` (a block's own column, e.g. the anchor itself),

except, in the blocks marked ``protect``, the row's target column ``j == t_i`` (``Masks.target``),
which the guide and ids masks never exclude. The output is the merged log-sum-exp
``LSE_i = log sum_k sum_j exp(l^k_ij)`` ([N], or ``sum_i w_i LSE_i`` with weights). Its gradient is
``dl^k_ij = g_i exp(l^k_ij - LSE_i)``, the
same merged ``LSE_i`` in every block; ``dR_k += s dl^k C_hat_k``, ``dC_k += s dl^k^T R_hat_k`` and the
normalisation's backward once per tensor.

Memory: a row chunk of every block's tile at once (``rows * max_k |C_k| <= tile_elements()`` each, at
least 256 rows at the default budget) plus the guide tile; nothing N x M is kept. With weights (a
summed loss) each chunk's LSE is final inside the chunk, so its gradient tiles are formed right away
("eager", no recompute: 1 + 2 GEMM units per block plus the guide GEMM); the per-row output
recomputes the tiles and the guide tile in the backward.

A row whose guide row or threshold is not finite, or whose blocks read a guide column that is not,
gets ``LSE = NaN`` (its loss is NaN, never a silently unmasked row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..._tracing import traced_op, tracing_route
from ..norms import normalize_backward_, normalize_rows
from ..spec import DirectCtx, compute_dtype, graph_free, threshold_of
from ..tiles import _ScaleGrad, tile_elements

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Block:
    """One column block of every row: rows ``xs[rows][row_start : row_start + N]``, columns
    ``xs[cols]``; with ``protect`` column ``Masks.target[i]`` of row ``i`` is never masked by guide /
    ids; column ``exclude + i`` always is (None: no such column)."""

    rows: int
    cols: int
    row_start: int = 0
    protect: bool = False
    exclude: int | None = None


@dataclass
class Masks:
    """Exclusion data, indexed like ``xs``: ``guides[t]`` [n_t, Dg] (or None), ``threshold`` [N] (the
    guide mask needs both), ``ids[t]`` [n_t] int64 (or None); ``target`` [N] int64, the protected
    column of each row in the blocks marked ``protect``. Nothing here carries a gradient."""

    guides: tuple[Tensor | None, ...] = ()
    threshold: Tensor | None = None
    ids: tuple[Tensor | None, ...] = ()
    target: Tensor | None = None
    #: ``(margin_strategy, margin)``: the threshold is taken from the guide tile itself (``threshold``
    #: None): ``theta_i = threshold_of(G_{i, t_i}, margin_strategy, margin)`` with ``G_{i, t_i}`` the
    #: target entry of the first protected block's guide tile, the same product as the cosines it is
    #: compared with (an exact duplicate of the target ties exactly and is kept, as sentence-transformers'
    #: ``GISTEmbedLoss`` decides it).
    rule: tuple[str, float] | None = None

    @property
    def guided(self) -> bool:
        return self.threshold is not None or self.rule is not None


@dataclass(frozen=True)
class _Config:
    blocks: tuple[Block, ...]
    n: int
    normalize: bool
    eps: float
    minus_target: bool = False
    #: ``label_smoothing`` (with ``minus_target``): the output is ``LSE_i - (1 - e) l_{i, t_i} - e mean_{j in C_i}
    #: l_ij``, ``C_i`` the columns row i's softmax keeps over every block (``_sweep``)
    smoothing: float = 0.0


class _Problem:
    """The normalised inputs and guides of one call, and its masked logit tiles."""

    def __init__(self, xs: tuple[Tensor, ...], cfg: _Config, masks: Masks, scale, dt: torch.dtype):
        self.cfg, self.masks, self.dt = cfg, masks, dt
        self.s = scale.detach().to(dt) if isinstance(scale, Tensor) else float(scale)
        hats = [normalize_rows(x, cfg.eps, dt, cfg.normalize) for x in xs]
        self.xh = [h for h, _ in hats]
        self.norms = [nm for _, nm in hats]
        self.gh: list[Tensor | None] = []
        for g in masks.guides:
            if g is None or not masks.guided:
                self.gh.append(None)
            else:
                gdt = compute_dtype(g)
                self.gh.append(torch.nn.functional.normalize(g.detach().to(gdt), dim=1, eps=cfg.eps))

    def guide_of(self, t: int) -> Tensor | None:
        return self.gh[t] if t < len(self.gh) else None

    def ids_of(self, t: int) -> Tensor | None:
        return self.masks.ids[t] if t < len(self.masks.ids) else None

    def guide_tile(self, blk: Block, r0: int, r1: int) -> Tensor | None:
        """The guide cosines of block ``blk``'s rows [r0, r1) and all its columns (None: no guide)."""
        gr, gc = self.guide_of(blk.rows), self.guide_of(blk.cols)
        if gr is None or gc is None:
            return None
        return gr[blk.row_start + r0 : blk.row_start + r1] @ gc.T

    def thresholds(self, r0: int, r1: int) -> tuple[Tensor | None, dict[int, Tensor]]:
        """``(theta of rows [r0, r1) or None, {block index: guide tile already computed}``: with
        ``Masks.rule`` the threshold is read from the target entry of the first protected block's guide
        tile of this very chunk (the same GEMM as the cosines it is compared with)."""
        if self.masks.rule is None:
            th = self.masks.threshold
            return (None if th is None else th[r0:r1]), {}
        for k, blk in enumerate(self.cfg.blocks):
            if blk.protect:
                gs = self.guide_tile(blk, r0, r1)
                if gs is None:
                    break
                gpos = gs.gather(1, self.masks.target[r0:r1, None])[:, 0]
                return threshold_of(gpos, *self.masks.rule), {k: gs}
        raise ValueError("core.blocks: Masks.rule needs a protected block with guides on both sides")

    def excluded(self, blk: Block, r0: int, r1: int, theta: Tensor | None = None,
                 gs: Tensor | None = None) -> Tensor | None:
        """Bool [r1 - r0, |C|] tile of the guide / ids exclusions of rows [r0, r1) (protected column
        cleared), or None when the block has no such mask. ``theta``: the chunk's thresholds (default
        ``Masks.threshold``); ``gs``: the block's guide tile if already computed."""
        rs = blk.row_start
        ex = None
        if gs is None:
            gs = self.guide_tile(blk, r0, r1)
        if gs is not None:
            if theta is None:
                theta = self.masks.threshold[r0:r1]
            th = theta[:, None].to(gs.dtype)
            ex = gs > th  # a NaN guide similarity keeps the column, but its row's loss is NaN (bad_rows)
        ir, ic = self.ids_of(blk.rows), self.ids_of(blk.cols)
        if ir is not None and ic is not None:
            same = ir[rs + r0 : rs + r1, None] == ic[None, :]
            ex = same if ex is None else ex.logical_or_(same)
        if ex is not None and blk.protect:  # the protected target column
            i = torch.arange(r1 - r0, device=ex.device)
            ex[i, self.masks.target[r0:r1]] = False
        return ex

    def logits(self, blk: Block, r0: int, r1: int, keep_cos: bool, theta: Tensor | None = None,
               gs: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
        """(cosine tile if ``keep_cos``, masked logit tile) of block ``blk`` for rows [r0, r1)
        (``theta`` / ``gs``: as ``excluded``)."""
        rs = blk.row_start
        rows = self.xh[blk.rows][rs + r0 : rs + r1]
        if keep_cos:
            c = rows @ self.xh[blk.cols].T
            l = c * self.s
        else:  # the scale folded into the [rows, D] operand: no pass over the tile
            c, l = None, (rows * self.s) @ self.xh[blk.cols].T
        ex = self.excluded(blk, r0, r1, theta, gs)
        if ex is not None:
            l.masked_fill_(ex, _NEG_INF)
        if blk.exclude is not None:
            lo, hi = max(r0, -blk.exclude), min(r1, l.shape[1] - blk.exclude)
            if hi > lo:
                l[lo - r0 : hi - r0, lo + blk.exclude : hi + blk.exclude].diagonal().fill_(_NEG_INF)
        return c, l

    def bad_rows(self) -> Tensor | None:
        return bad_rows(self.cfg, self.masks)


def bad_rows(cfg: _Config, masks: Masks) -> Tensor | None:
    """[N] rows whose loss must be NaN: a non-finite threshold, guide row, or guide column they read
    (None without a guide mask)."""
    if not masks.guided:
        return None
    n = cfg.n

    def guide(t):
        return masks.guides[t] if t < len(masks.guides) else None

    if masks.threshold is not None:
        bad = ~torch.isfinite(masks.threshold)
    else:  # the rule's threshold is finite where the guide row and its target column are (checked below)
        ref = next(g for g in masks.guides if g is not None)
        bad = torch.zeros(n, dtype=torch.bool, device=ref.device)
    for blk in cfg.blocks:
        gr, gc = guide(blk.rows), guide(blk.cols)
        if gr is None or gc is None:
            continue
        bad |= ~torch.isfinite(gr[blk.row_start : blk.row_start + n]).all(dim=1)
        bad |= ~torch.isfinite(gc).all()  # a 0-dim flag broadcast over the rows (no host sync)
    return bad


def _row_step(p: _Problem) -> int:
    """Rows per chunk: the widest block's tile within ``tile_elements()`` (every block's tile of the
    chunk is held at once: up to K tile budgets), at least ``min(256, budget / 4096)`` rows (256 at the
    default budget: CPU GEMMs of 128 rows ran at a fifth of the speed, 32 against 151 GFLOP/s for
    128 x 768 x 4096 on the 2-core CI machine)."""
    n, budget = p.cfg.n, tile_elements()
    widest = max(p.xh[blk.cols].shape[0] for blk in p.cfg.blocks)
    return max(1, min(n, max(budget // max(widest, 1), min(256, budget >> 12))))


def _sweep(p: _Problem, lse: Tensor | None, g: Tensor | None, need: tuple[bool, ...], need_s: bool):
    """One pass over the row chunks. ``lse`` None: compute it (final per chunk: every chunk spans all
    columns of every block) and, with ``cfg.minus_target``, the target logits. ``g`` (the per-row
    upstream gradient) None: statistics only. Returns ``(lse, target logits or None, grads in
    normalised space per tensor (None where not needed), d scale)``.

    With ``cfg.smoothing = e`` the target term is ``(1 - e) l_t + e S_i / K_i``, ``K_i`` the count and ``S_i``
    the sum of the logits row i keeps (finite) over every block of its chunk, and its gradient ``-(1 - e) g_i``
    at the target and ``-e g_i / K_i`` on every kept column, from a 0 / 1 float tile of the kept entries
    per block (formed before the exp, held through the chunk's gradient step: the chunk's tiles twice).

    Per block and chunk the tile is passed over 6 times besides its GEMMs: the mask compare and fill,
    the row maximum, ``exp(l - m)`` in place, its row sum, and (with ``g``) the gradient scaling
    ``e * g_i / Z_i``; the recomputing backward takes ``exp(l - LSE_i) g_i`` instead."""
    cfg, n = p.cfg, p.cfg.n
    dev = p.xh[0].device
    out_lse = torch.empty(n, device=dev, dtype=p.dt) if lse is None else lse
    tgt_blk = next((k for k, blk in enumerate(cfg.blocks) if blk.protect), None) if cfg.minus_target else None
    out_tgt = torch.empty(n, device=dev, dtype=p.dt) if tgt_blk is not None and lse is None else None
    grads = [torch.zeros_like(h) if nd else None for h, nd in zip(p.xh, need, strict=True)] if g is not None \
        else [None] * len(p.xh)
    sg = _ScaleGrad(n, p.xh[0]) if g is not None and need_s else None
    ds_tgt = torch.zeros((), device=dev, dtype=torch.float64)
    eps = cfg.smoothing if tgt_blk is not None else 0.0
    step = _row_step(p)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        theta, gtiles = p.thresholds(r0, r1)
        tiles = [p.logits(blk, r0, r1, sg is not None, theta, gtiles.get(k)) for k, blk in enumerate(cfg.blocks)]
        del gtiles
        t_r = p.masks.target[r0:r1, None] if tgt_blk is not None else None
        if eps:
            # 1.0 at the kept entries of every block, 0.0 at the excluded (-inf) ones, before the exp: float
            # ops (l + the dtype's largest value is >= 1 for any finite logit and -inf for -inf, clamped to
            # [0, 1]), as a bool mask's compare / where / fill cost 2-5x as much per element on a CPU; K_i the
            # kept count
            big = torch.finfo(p.dt).max
            keep = (l.add(big).clamp_(0.0, 1.0) for _, l in tiles)
            if g is not None:  # held for the gradient step; the statistics alone sum each and drop it
                keep = list(keep)
            kept_n = sum(kf.sum(dim=1) for kf in keep)
        if out_tgt is not None:
            out_tgt[r0:r1] = tiles[tgt_blk][1].gather(1, t_r)[:, 0]
            if eps:
                kept_sum = sum(torch.nan_to_num(l, neginf=0.0).sum(dim=1) for _, l in tiles)
                # l_t + eps (mean - l_t): exactly l_t (a zero loss) for a row that keeps its target alone
                out_tgt[r0:r1] += eps * (kept_sum / kept_n - out_tgt[r0:r1])
        if lse is None:
            # exp(l - m) with m the row maximum over every block; LSE = m + log Z
            m = tiles[0][1].amax(dim=1)
            for _, l in tiles[1:]:
                m = torch.maximum(m, l.amax(dim=1))
            m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)  # an all-excluded row: exp(-inf) = 0
            z = torch.zeros_like(m)
            for _, l in tiles:
                z += l.sub_(m[:, None]).exp_().sum(dim=1)
            out_lse[r0:r1] = m + torch.log(z)
            coef = None if g is None else torch.where(z > 0, 1.0 / z, torch.zeros_like(z))  # e / Z = softmax
        else:
            row_lse = out_lse[r0:r1]
            row_lse = torch.where(row_lse == _NEG_INF, torch.zeros_like(row_lse), row_lse)
            if g is not None:
                for _, l in tiles:
                    l.sub_(row_lse[:, None]).exp_()
            coef = None if g is None else torch.ones_like(row_lse)
        if g is None:
            continue
        gr = g[r0:r1, None]
        for k, (blk, (c, l)) in enumerate(zip(cfg.blocks, tiles, strict=True)):
            if sg is not None:
                dl = l.mul_(coef[:, None])
                sg.add(dl, c, r0, r1, 1)
                dl.mul_(gr)
            else:
                dl = l.mul_(coef[:, None] * gr)
            if eps:  # - eps mean_{kept} l: -eps g_i / K_i on the kept columns of every block
                if k == tgt_blk:  # the target's coefficient 1 - eps (K_i - 1) / K_i: exactly 1 when K_i = 1
                    p_t = dl.gather(1, t_r)
                dl.addcmul_(keep[k], eps * gr / kept_n[:, None], value=-1.0)
                if k == tgt_blk:
                    dl.scatter_(1, t_r, p_t - (1 - eps * (kept_n[:, None] - 1) / kept_n[:, None]) * gr)
                if sg is not None:
                    dt_ds = eps * torch.linalg.vecdot(c, keep[k]) / kept_n  # d(eps S_i / K_i) / ds
                    if k == tgt_blk:
                        dt_ds = dt_ds + (1 - eps) * c.gather(1, t_r)[:, 0]
                    ds_tgt -= (gr[:, 0] * dt_ds).sum().to(torch.float64)
            elif k == tgt_blk:  # - l[i, t_i]: its gradient -g_i at the target column
                dl.scatter_add_(1, t_r, -gr)
                if sg is not None:
                    ds_tgt -= (gr * c.gather(1, t_r)).sum().to(torch.float64)
            rs = blk.row_start
            if grads[blk.rows] is not None:
                grads[blk.rows][rs + r0 : rs + r1].addmm_(dl, p.xh[blk.cols])
            if grads[blk.cols] is not None:
                grads[blk.cols].addmm_(dl.T, p.xh[blk.rows][rs + r0 : rs + r1])
        del tiles
    ds = (sg.total(g) + ds_tgt.to(g.dtype)) if sg is not None else None
    return out_lse, out_tgt, grads, ds


def _input_grads(p: _Problem, grads: list[Tensor | None], xs: tuple[Tensor, ...]) -> list[Tensor | None]:
    out = []
    for gh, xh, nm, x in zip(grads, p.xh, p.norms, xs, strict=True):
        if gh is None:
            out.append(None)
            continue
        out.append(normalize_backward_(gh.mul_(p.s), xh, nm, p.cfg.eps).to(x.dtype))
    return out


class MergedLSEFn(torch.autograd.Function):
    """``LSE_i`` over every block, minus the target logit with ``cfg.minus_target`` (see the module
    docstring): [N], or ``sum_i w_i (...)`` (0-dim) when ``weights`` is given (then the gradients are
    formed in the forward and scaled in the backward)."""

    @staticmethod
    @autocast_off
    def forward(ctx, scale, cfg: _Config, masks: Masks, weights: Tensor | None, *xs: Tensor):
        dt = compute_dtype(*xs)
        p = _Problem(xs, cfg, masks, scale, dt)
        need = tuple(ctx.needs_input_grad[4:])
        need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[0]
        bad = p.bad_rows()
        ctx.cfg, ctx.masks, ctx.scale = cfg, masks, scale
        if weights is not None:
            w = weights.to(dt)
            lse, tgt, grads, ds = _sweep(p, None, w if (any(need) or need_s) else None, need, need_s)
            ctx.eager = (_input_grads(p, grads, xs), ds)
            # a second backward through a retained graph recomputes from the statistics (the first one scales
            # the eager buffers in place): the row weights times its upstream scalar are the rows' upstream
            ctx.weights = w
            ctx.save_for_backward(lse, *xs)
            out = lse if tgt is None else lse - tgt
            if bad is not None:
                out = torch.where(bad, float("nan"), out)
            return (w * out).sum()
        lse, tgt, _, _ = _sweep(p, None, None, need, False)
        ctx.eager = None
        ctx.weights = None
        ctx.save_for_backward(lse, *xs)
        out = lse if tgt is None else lse - tgt
        if bad is not None:
            out = torch.where(bad, float("nan"), out)
        return out

    @staticmethod
    @autocast_off
    @first_order("MergedLSEFn")
    def backward(ctx, go: Tensor):
        need = tuple(ctx.needs_input_grad[4:])
        need_s = isinstance(ctx.scale, Tensor) and ctx.needs_input_grad[0]
        if ctx.eager is not None:
            grads, ds = ctx.eager
            ctx.eager = None  # single use: the buffers are scaled in place
            gs = [None if gx is None else gx.mul_(go.to(gx.dtype)) for gx in grads]
            dsc = None if ds is None else (ds * go).to(ctx.scale.dtype).reshape(ctx.scale.shape)
            return (dsc, None, None, None, *gs)
        lse, *xs = ctx.saved_tensors
        p = _Problem(tuple(xs), ctx.cfg, ctx.masks, ctx.scale, lse.dtype)
        g = go.to(lse.dtype) if ctx.weights is None else go.to(lse.dtype) * ctx.weights
        _, _, grads, ds = _sweep(p, lse, g, need, need_s)
        gs = _input_grads(p, grads, tuple(xs))
        dsc = None if ds is None else ds.to(ctx.scale.dtype).reshape(ctx.scale.shape)
        return (dsc if need_s else None, None, None, None, *gs)


def merged_lse(xs: list[Tensor], blocks: list[Block], n: int, scale, masks: Masks | None = None, *,
               normalize: bool = True, eps: float = 1e-12, weights: Tensor | None = None,
               minus_target: bool = False, backend: str = "torch", label_smoothing: float = 0.0) -> Tensor:
    """Merged log-sum-exp of ``n`` rows over ``blocks`` of ``xs`` (module docstring): [n] in the
    compute dtype (float32, float64 for float64 inputs), or ``sum_i weights_i LSE_i`` with ``weights``
    [n] (the summed loss's fast path: no recompute in the backward). ``scale`` a number or a 0-dim
    tensor (differentiable). ``minus_target``: the cross-entropy ``LSE_i - l_{i, t_i}``, the target
    logit read from the first protected block's tile (a row left with its target alone is exactly 0).
    ``backend="triton"``: one Triton call per block (``core/guided/triton_blocks.py``; float32 / 16-bit
    inputs), merged here; "torch": the eager PyTorch sweep of this module. ``label_smoothing`` (with
    ``minus_target``): ``F.cross_entropy``'s over the kept columns (``_Config.smoothing``): each backend
    counts the kept columns and sums their logits per row in the pass that forms the LSE."""
    cfg = _Config(tuple(blocks), n, normalize, eps, minus_target, float(label_smoothing))
    if label_smoothing and not minus_target:
        raise ValueError("core.blocks: label_smoothing needs minus_target (a target to smooth)")
    if minus_target and not any(blk.protect for blk in cfg.blocks):
        raise ValueError("core.blocks: minus_target needs a protected block (the target's)")
    masks = masks or Masks()
    if any(blk.protect for blk in cfg.blocks) and masks.target is None:
        raise ValueError("core.blocks: a protected block needs Masks.target")
    for blk in cfg.blocks:
        if xs[blk.rows].shape[0] < blk.row_start + n:
            raise ValueError(f"core.blocks: block rows {blk.row_start}..{blk.row_start + n} exceed tensor {blk.rows} "
                             f"({xs[blk.rows].shape[0]} rows)")
    if tracing_route():  # torch.compile / export: the registered operator (ops.merged_lse), O(N*D) as here
        return traced_op("merged_lse")(xs, cfg, masks, scale, weights, backend)
    scale, *xs = graph_free(scale, *xs)
    return merged_fn(backend).apply(scale, cfg, masks, weights, *xs)


def merged_fn(backend: str) -> type[torch.autograd.Function]:
    """The autograd Function of ``backend`` ("triton": ``TritonMergedFn``, else ``MergedLSEFn``): both
    take ``(scale, cfg, masks, weights, *xs)``."""
    return TritonMergedFn if backend == "triton" else MergedLSEFn


def _block_masks(xs: tuple[Tensor, ...], cfg: _Config, masks: Masks) -> list:
    """Each block's ``triton_guided.BlockMasks``: unit guides (16-bit guides stay 16-bit: the kernel's
    guide dot on tensor-core operands; others fp32), the threshold (a tensor, or a ``ThetaSource`` read
    from the first protected block's guide tiles), ids, the protected target and own column."""
    from .triton_blocks import BlockMasks, ThetaSource

    n = cfg.n

    def at(seq, t):
        return seq[t] if t < len(seq) else None

    units = {}
    if len({g.dtype for g in masks.guides if g is not None}) > 1:  # one guide model: one dtype
        masks = Masks(tuple(None if g is None else g.float() for g in masks.guides), masks.threshold, masks.ids,
                      masks.target, masks.rule)
    for t, g in enumerate(masks.guides):
        if g is not None and masks.guided:
            u = torch.nn.functional.normalize(g.detach().to(torch.float32), dim=1, eps=cfg.eps)
            units[t] = u.to(g.dtype if g.dtype in (torch.float16, torch.bfloat16) else torch.float32).contiguous()
    theta = masks.threshold.to(torch.float32).contiguous() if masks.threshold is not None else None
    if masks.rule is not None:
        pb = next((blk for blk in cfg.blocks if blk.protect and blk.rows in units and blk.cols in units), None)
        if pb is None:
            raise ValueError("core.blocks: Masks.rule needs a protected block with guides on both sides")
        theta = ThetaSource(units[pb.rows][pb.row_start : pb.row_start + n].contiguous(), units[pb.cols],
                            masks.target.contiguous(), *masks.rule)
    out = []
    for blk in cfg.blocks:
        rs = blk.row_start
        ga, gb = units.get(blk.rows), units.get(blk.cols)
        guided = ga is not None and gb is not None
        ir, ic = at(masks.ids, blk.rows), at(masks.ids, blk.cols)
        has_ids = ir is not None and ic is not None
        out.append(BlockMasks(ga=ga[rs : rs + n] if guided else None, gb=gb if guided else None,
                              theta=theta if guided else None,
                              idr=ir[rs : rs + n].contiguous() if has_ids else None,
                              idc=ic.contiguous() if has_ids else None,
                              tgt=masks.target.contiguous() if blk.protect else None, exclude=blk.exclude))
    return out


class TritonMergedFn(torch.autograd.Function):
    """``MergedLSEFn``'s contract on the Triton kernels: one ``GuidedBlockFn`` forward per block (its
    ``LSE^k`` [N] and target logit, fp32), merged here by ``LSE_i = log sum_k exp(LSE^k_i)``; the
    backward hands block k the upstream ``g_i exp(LSE^k_i - LSE_i)`` (its share of the merged softmax)
    and ``-g_i`` on the target logit, and sums each tensor's gradient over the blocks that read it (a
    block's rows are a slice of their tensor). Written out rather than left to autograd so that the
    registered operator (``ops.merged_lse``), which runs below autograd, takes the same code."""

    @staticmethod
    @autocast_off
    def forward(ctx, scale, cfg: _Config, masks: Masks, weights: Tensor | None, *xs: Tensor):
        need = tuple(ctx.needs_input_grad[4:])
        need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[0]
        ctx.scale_meta = (scale.dtype, scale.shape) if isinstance(scale, Tensor) else None
        ctx.eager = None
        from .triton_panel import guided_panel_sweep, use_guided_panel

        # the inputs (and a tensor scale) for a second backward through a retained graph, which recomputes the
        # blocks' statistics (the first backward consumes what the forward left: eager buffers scaled in
        # place, the blocks' contexts released)
        ctx.save_for_backward(*xs, *((scale,) if isinstance(scale, Tensor) else ()))
        ctx.masks, ctx.scale_given = masks, scale
        # the panel route does not form label smoothing's kept-column sums: the fused kernels do
        if (any(need) or need_s) and not cfg.smoothing and use_guided_panel(xs, cfg, weights):
            # a summed bf16 loss on CUDA: the epilogue-GEMM panels form the gradients in this pass
            bad = bad_rows(cfg, masks)
            w = weights.to(torch.float32)
            if bad is not None:  # a NaN row's loss does not depend on the inputs
                w = torch.where(bad, torch.zeros_like(w), w)
            per, grads, ds = guided_panel_sweep(xs, cfg, masks, scale, w, need, need_s, _block_masks(xs, cfg, masks))
            if bad is not None:
                per = torch.where(bad, float("nan"), per)
            ctx.eager = (grads, ds)
            ctx.cfg, ctx.weights, ctx.subs = cfg, weights.to(per.dtype), None
            return (weights.to(per.dtype) * per).sum()
        out = TritonMergedFn._blocks(ctx, scale, cfg, masks, xs, need, need_s)
        ctx.weights = None if weights is None else weights.to(out.dtype)
        if weights is None:
            return out
        return (ctx.weights * out).sum()

    @staticmethod
    def _blocks(ctx, scale, cfg: _Config, masks: Masks, xs, need, need_s) -> Tensor:
        """The blocks' forwards (``GuidedBlockFn``, each with a context of its own kept on ``ctx``) and their
        merge: the per-row output."""
        from .triton_blocks import GuidedBlockFn

        n = cfg.n
        smooth = bool(cfg.smoothing) and cfg.minus_target
        subs, lses, tgt, kept_n, kept_sum = [], [], None, 0, 0
        for blk, mk in zip(cfg.blocks, _block_masks(xs, cfg, masks), strict=True):
            rs = blk.row_start
            sub = DirectCtx((need[blk.rows], need[blk.cols], need_s, False, False, False, False))
            lse, tl_, *st = GuidedBlockFn.forward(sub, xs[blk.rows][rs : rs + n], xs[blk.cols], scale, mk,
                                                  cfg.normalize, cfg.eps, smooth)
            subs.append(sub)
            lses.append(lse)
            if smooth:  # label smoothing's kept count and kept-logit sum, over every block
                kept_n, kept_sum = kept_n + st[0], kept_sum + st[1]
            if blk.protect and tgt is None:
                tgt = tl_
        stacked = torch.stack(lses)
        lse = torch.logsumexp(stacked, dim=0)
        out = lse - tgt if cfg.minus_target else lse
        ctx.kept_n = kept_n if smooth else None
        if smooth:  # - eps (mean_kept l - l_t): exactly 0 for a row that keeps its target alone
            out = out - cfg.smoothing * (kept_sum / kept_n - tgt)
        bad = bad_rows(cfg, masks)
        if bad is not None:
            out = torch.where(bad, float("nan"), out)
        ctx.subs, ctx.cfg, ctx.bad = subs, cfg, bad
        ctx.shapes = [(x.shape, x.dtype) for x in xs]
        ctx.stats = (stacked, lse)
        return out

    @staticmethod
    @autocast_off
    @first_order("TritonMergedFn")
    def backward(ctx, go: Tensor):
        from .triton_blocks import GuidedBlockFn

        need = tuple(ctx.needs_input_grad[4:])
        need_s = ctx.scale_meta is not None and ctx.needs_input_grad[0]
        if ctx.eager is not None:  # the panel route's gradients of the summed loss, times the upstream scalar
            grads, ds = ctx.eager
            ctx.eager = None  # single use: scaled in place
            gs = [None if gx is None else gx.mul_(go.to(gx.dtype)) for gx in grads]
            dsc = (ds * go).to(ctx.scale_meta[0]).reshape(ctx.scale_meta[1]) if need_s and ds is not None else None
            return (dsc, None, None, None, *gs)
        if ctx.subs is None:  # a second backward through a retained graph: the blocks' statistics again
            saved = ctx.saved_tensors
            xs = saved[:len(ctx.needs_input_grad) - 4]
            scale = saved[-1] if isinstance(ctx.scale_given, Tensor) else ctx.scale_given
            with torch.no_grad():
                TritonMergedFn._blocks(ctx, scale, ctx.cfg, ctx.masks, xs, need, need_s)
        cfg, n = ctx.cfg, ctx.cfg.n
        stacked, lse = ctx.stats
        g = go.to(torch.float32) * ctx.weights if ctx.weights is not None else go.to(torch.float32)
        g = g.expand(n) if g.dim() == 0 else g
        if ctx.bad is not None:  # a NaN row's loss does not depend on the inputs (torch.where)
            g = torch.where(ctx.bad, torch.zeros_like(g), g)
        base = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
        grads: list[Tensor | None] = [torch.zeros(sh, dtype=dt, device=go.device) if nd else None
                                      for (sh, dt), nd in zip(ctx.shapes, need, strict=True)]
        ds = None
        first_protected = next((k for k, blk in enumerate(cfg.blocks) if blk.protect), None)
        eps = cfg.smoothing if ctx.kept_n is not None else 0.0
        # label smoothing: -(1 - eps) g on the target logit, -eps g / K_i on every kept column of every block
        g_sl = (-eps * g / ctx.kept_n).contiguous() if eps else None
        for k, (blk, sub) in enumerate(zip(cfg.blocks, ctx.subs, strict=True)):
            g_k = (g * torch.exp(stacked[k] - base)).contiguous()
            g_t = -(1 - eps) * g if cfg.minus_target and k == first_protected else None
            da, db, dsk, *_ = GuidedBlockFn.backward(sub, g_k, g_t, None, g_sl)
            rs = blk.row_start
            if da is not None and grads[blk.rows] is not None:
                grads[blk.rows][rs : rs + n] += da
            if db is not None and grads[blk.cols] is not None:
                grads[blk.cols] += db
            if dsk is not None:
                ds = dsk if ds is None else ds + dsk
        ctx.subs = None  # single use
        return (ds if need_s else None, None, None, None, *grads)
