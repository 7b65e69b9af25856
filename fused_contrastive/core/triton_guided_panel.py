"""The merged-block core (``core/blocks.py``: GISTEmbed, guided and id-masked InfoNCE) on row panels with
the epilogue GEMM: one Triton GEMM per block and panel forms the masked exponentials in registers and
writes only a 16-bit tile, cuBLAS does the gradient GEMMs. The CUDA route of a summed loss in bf16.

Why: the per-block fused kernels (``kernels/guided.py``: a forward and two recomputing backward kernels
that stream through an fp32 scratch) do 5 units of matmul work per block plus three guide tiles, slower
than the textbook's cuBLAS GEMMs wherever the textbook fits (``docs/guided.md``). Here, per block,
1 unit (the logits, with the guide tile in the same kernel) + 2 cuBLAS units (``dR += E @ C_hat``,
``dC += E^T @ diag(W) R_hat``), nothing recomputed, and only 2 bytes per logit written and read back.

For a panel of rows ``[r0, r0 + P)`` of every block (all blocks share the rows ``i``; block ``k`` pairs
``R_k = xs[rows_k][o_k + i]`` with the columns ``C_k = xs[cols_k]``):

1. per block, ``guided_epi_kernel`` MODE 1: ``E_k = exp(l^k - m)`` in bf16 (``m = |s| - 56`` for every
   block: unit rows bound each logit by ``|s|``, kernels/panel.py ONE_PASS) and the fp32 partials of
   ``z^k_i = sum_j e^k_ij``, ``t^k_i = sum_j e^k_ij cos^k_ij`` and the row maximum; the block whose
   target the loss subtracts (the first protected one, ``minus_target``) leaves the target column out of
   ``E`` and returns its ``e_it`` and ``cos_it`` in fp32;
2. the merge, O(P): ``zx_i = sum_k z^k_i`` (every column but the target), ``z_i = zx_i + e_it``; a row
   with ``z_i < 2^-64`` (every logit below ``|s| - 100.4``) is redone exactly by MODE 2 with its
   largest logit over every block as the shift; ``LSE_i = m_i + log z_i``, the row's loss
   ``log1p(zx_i / e_it)`` (``LSE_i - l_it`` without its cancellation; exactly 0 for a row whose every
   other column is excluded, as the textbook's), or ``LSE_i - l_it`` where ``e_it`` is tiny, and the
   row weight ``W_i = w_i / z_i``;
3. per row tensor, ``dR_hat = W (sum_k E_k @ C_hat_k - zx e_t-row)``: the target's gradient
   ``W_i e_it - w_i = -W_i zx_i`` in fp32 (the 16-bit tile never holds ``p_t - 1``), then the
   normalisation backward (``panel_rows_kernel``, which also writes ``XW = diag(W) R_hat``);
4. per block, ``acc[cols_k] += E_k^T @ XW`` (fp32 accumulator per column tensor), the target term by
   ``index_add_``; after the sweep the normalisation backward of each accumulator.

Units per block: 3 (the eager sweep of a summed loss), plus the guide tile (``Dg / D`` of a unit) and
``P / N`` of a redo where it happens. Memory: ``4 D`` bytes per column row (the accumulators), the
gradients in fp32, and per panel row ``2 sum_k M_k`` (the tiles) + ``12 D`` + partials; nothing N x M.
Per-row outputs (``reduction="none"``), fp16 (its range cannot hold ``e^56``), fp32 and
``normalize=False`` keep the fused kernels (``core/triton_guided.py``).
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from ..kernels import guided as KG
from ..kernels import panel as KP
from . import triton_backend as TB
from . import triton_guided as TG
from . import triton_panel as TPN
from .spec import CoreSpec
from .triton_configs import EPI_GROUP_M, GUIDED_EPI, LaunchConfig

#: Test hook: a fixed panel height (rounded to the row tile; None: from the budget).
PANEL_ROWS: int | None = None
#: A target exponential below this takes the loss as ``LSE - l_t`` (its ratio would lose precision).
MIN_TARGET_E = 1e-30


def guided_blocks_dtype(xs) -> torch.dtype | None:
    """The one dtype of every embedding tensor, or None when they differ."""
    dts = {x.dtype for x in xs}
    return dts.pop() if len(dts) == 1 else None


def use_guided_panel(xs, cfg, weights: Tensor | None) -> bool:
    """Whether ``TritonMergedFn`` takes this route: a summed loss (``weights``) of unit rows
    (``normalize``), every tensor bf16, a protected block only together with ``minus_target`` (the
    target then leaves the tile), and the panel path's choice for the problem (``triton_panel.use_panel``
    with N x sum_k M_k elements: CUDA from 2^24, env ``FUSED_CONTRASTIVE_TRITON_PATH``) and the epilogue
    GEMM's (``triton_panel.use_epilogue`` form "guided", env ``FUSED_CONTRASTIVE_PANEL_GEMM``)."""
    if weights is None or not cfg.normalize or guided_blocks_dtype(xs) != torch.bfloat16:
        return False
    protected = [blk for blk in cfg.blocks if blk.protect]
    if protected and not cfg.minus_target:
        return False
    elements = cfg.n * sum(xs[blk.cols].shape[0] for blk in cfg.blocks)
    a = xs[0]
    return TPN.use_panel(a, cfg.n, elements // max(cfg.n, 1)) and TPN.use_epilogue(a.device, a.dtype, "guided",
                                                                                      elements)


#: Fewest rows of a panel whatever the budget says (rounded to the row tile): the K tiles of a panel row
#: are alive together (its weight needs every block's sum before any ``E^T @ XW``), so a small budget
#: would otherwise shrink the panels of a large problem to a few rows, where the dC GEMMs re-read the
#: columns and their fp32 accumulators per panel and the launches multiply (bench/gpu_model.py, H100,
#: GIST at N = 65536: 1638 ms in 64-row panels, 246 in 1152-row ones).
P_MIN = 1024


def panel_rows(n: int, col_rows: list[int], d: int, groups: int, grad_rows: int, block_m: int, block_n: int,
               split: bool, need_s: bool) -> int:
    """Rows per panel from the core panel path's byte budget (``FUSED_CONTRASTIVE_PANEL_BUDGET``, default
    ``triton_panel.BUDGET_BYTES``): ``fixed = 4 D grad_rows`` (the fp32 accumulators of the tensors with a
    gradient), per panel row ``2 sum_k M_k`` (the bf16 tiles) + the partials (4 bytes x 2-5 per column
    tile of each block) + ``8 D`` per row group (the operand copy, the dR GEMM's fp32 output, XW). A
    multiple of ``block_m`` (the threshold kernel's row tiles line up), at least :data:`P_MIN`."""
    if PANEL_ROWS is not None:
        return max(1, min(n, triton.cdiv(PANEL_ROWS, block_m) * block_m))
    budget = int(os.environ.get("FUSED_CONTRASTIVE_PANEL_BUDGET", TPN.BUDGET_BYTES))
    fixed = 4 * d * grad_rows
    parts = 3 + (1 if need_s else 0) + (2 if split else 0)
    per_row = sum(2 * m + 4 * parts * triton.cdiv(m, block_n) for m in col_rows) + 8 * d * groups + 32
    p = max(0, budget - fixed) // per_row
    p = p - p % block_m
    return max(1, min(n, max(triton.cdiv(P_MIN, block_m) * block_m, p)))


def guided_panel_sweep(xs: tuple[Tensor, ...], cfg, masks, scale, weights: Tensor, need: tuple[bool, ...],
                       need_s: bool, block_masks: list) -> tuple[Tensor, list[Tensor | None], Tensor | None]:
    """``(per-row loss [N] fp32, gradients of sum_i w_i loss_i per tensor (its dtype; None where not
    needed), d/ds as a 0-dim fp32 tensor or None)`` of ``merged_lse`` with ``weights`` on this route
    (module docstring). ``block_masks``: ``blocks._block_masks`` of the call (guides, thresholds, ids,
    targets per block). The per-row loss is ``LSE_i - l_it`` with ``minus_target``, else ``LSE_i``."""
    n = cfg.n
    dev = xs[0].device
    dt = xs[0].dtype
    d = xs[0].shape[1]
    eps = cfg.eps
    launch = TB._launch
    cfg_e: LaunchConfig = GUIDED_EPI["one_pass"]
    cfg_w: LaunchConfig = GUIDED_EPI["one_pass_wide"]  # 16-bit guides, no split target: 128-row tiles
    # the redo's BLOCK_N is the partials' column tile: cfg_e's
    cfg_r: LaunchConfig = GUIDED_EPI["redo_sm90" if TB._arch(dev) == "sm90" else "redo_sm80"]
    bn, bk = cfg_e.block_n, cfg_e.block_d  # every config shares BLOCK_N (the partials' column tile) and BLOCK_K
    split_k = next((k for k, blk in enumerate(cfg.blocks) if blk.protect), None) if cfg.minus_target else None
    # each block's launch config: the wide tiles where they compile without spills
    g16 = [mk.ga is not None and mk.ga.dtype in (torch.float16, torch.bfloat16) for mk in block_masks]
    cfgs = [cfg_w if (k != split_k and g16[k]) else cfg_e for k in range(len(block_masks))]
    groups = sorted({(blk.rows, blk.row_start) for blk in cfg.blocks})
    col_ts = sorted({blk.cols for blk in cfg.blocks})
    need_cols = {c: need[c] for c in col_ts}
    p_rows = panel_rows(n, [xs[blk.cols].shape[0] for blk in cfg.blocks], d, len(groups),
                        sum(x.shape[0] for x, nd in zip(xs, need, strict=True) if nd), max(c.block_m for c in cfgs),
                        bn, split_k is not None, need_s)
    scale_t = TB._scale32(scale, dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)  # gscale: W carries the weights in fp32
    dm = torch.empty(1, dtype=torch.float32, device=dev)
    shift = scale_t.reshape(()).abs() - KP.ONE_PASS_SHIFT.value
    w_all = weights.to(torch.float32)
    # norms of every column tensor and every tensor with a gradient (its accumulator is in their frame)
    # (the panel path's column norms in chunks: nb, rb; bf16 needs no normalised copy)
    cols = {c: TPN._Problem(xs[c], xs[c], CoreSpec(normalize=True, eps=eps), need_op=False)
            for c in sorted(set(col_ts) | {t for t, nd in enumerate(need) if nd})}
    # one fp32 accumulator per tensor with a gradient, rows j holding rb_j (dL / dx_hat_j) / s: the column
    # roles' E^T @ XW (rb folded into E) and the row roles' W (E @ C_hat) times rb, both added here, then
    # one normalisation backward per tensor after the sweep
    acc = {t: torch.zeros(xs[t].shape, dtype=torch.float32, device=dev) for t, nd in enumerate(need) if nd}
    loss = TB._alloc((n,), torch.float32, dev)
    ds_parts = []
    # the mask arguments per block; 16-bit guides take GUIDE_BLOCK_16-wide k-steps of the guide dot
    kargs = [TG._mask_args(mk, dm, c, TG.GUIDE_BLOCK_16 if is16 else TG.GUIDE_BLOCK)
             for mk, c, is16 in zip(block_masks, cfgs, g16, strict=True)]
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        ops = {}
        for t, o in groups:  # the panel's operand rows of each row tensor: scaled copy, factor, norm
            xsc, nrm, _, rs = TB._row_norms(xs[t][o + r0:o + r1], eps)
            ops[(t, o)] = (xsc, rs, nrm)
        tiles = []
        for k, blk in enumerate(cfg.blocks):
            xsc, rs, _ = ops[(blk.rows, blk.row_start)]
            y = xs[blk.cols]
            m = y.shape[0]
            n_pn = triton.cdiv(m, bn)
            split = k == split_k
            dl = TB._alloc((pp, m), dt, dev)
            zp = TB._alloc((pp, n_pn), torch.float32, dev)
            tp = TB._alloc((pp, n_pn), torch.float32, dev) if need_s else dm
            mxp = TB._alloc((pp, n_pn), torch.float32, dev)
            etp = TB._alloc((pp, n_pn), torch.float32, dev) if split else dm
            ctp = TB._alloc((pp, n_pn), torch.float32, dev) if split else dm
            margs, mflags = kargs[k]
            ck = cfgs[k]
            n_pm = triton.cdiv(pp, ck.block_m)
            args = dict(X=xsc, Y=y, DL=dl, ZP=zp, TP=tp, MXP=mxp, ETP=etp, CTP=ctp, RSP=rs, RB=cols[blk.cols].rb,
                        SCALE=scale_t, **margs, P=pp, M=m, D=d, r0=r0, stride_x=xsc.stride(0), stride_y=y.stride(0),
                        stride_dl=dl.stride(0), stride_zp=n_pn)
            const = dict(BLOCK_M=ck.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0,
                         UPCAST=TB._upcast(dt), NORMALIZE=True, **mflags, SPLIT_T=split, NEED_DS=bool(need_s),
                         FOLD_RB=True)
            launch(TB.Launch("guided_epi", KG.guided_epi_kernel, (n_pm * n_pn,), dict(args, BAD=dm, SHIFT=dm),
                             dict(const, MODE=1), ck.num_warps, ck.num_stages))
            tiles.append((dl, zp, tp, mxp, etp, ctp, args, const))
        # the merge over the blocks; rows whose every e underflowed are redone with their own maximum
        z = sum(tt[1].sum(1) for tt in tiles)
        if split_k is not None:
            z = z + tiles[split_k][4].sum(1)
        mx = torch.stack([tt[3].amax(1) for tt in tiles]).amax(0)
        bad = z < KP.ONE_PASS_MIN_Z.value
        sh = torch.where(bad & (mx > float("-inf")), mx, shift)
        bad8 = bad.to(torch.int8)
        for *_, args, const in tiles:
            launch(TB.Launch("guided_epi_redo", KG.guided_epi_kernel, (triton.cdiv(pp, cfg_r.block_m),),
                             dict(args, BAD=bad8, SHIFT=sh), dict(const, MODE=2, BLOCK_M=cfg_r.block_m),
                             cfg_r.num_warps, cfg_r.num_stages))
        zx = sum(tt[1].sum(1) for tt in tiles)
        w = w_all[r0:r1]
        if split_k is not None:
            et = tiles[split_k][4].sum(1)
            ct = tiles[split_k][5].sum(1)
            z = zx + et
            lse = sh + torch.log(z)
            tl_ = scale_t.reshape(()) * ct
            ratio = torch.log1p(zx / torch.where(et > MIN_TARGET_E, et, torch.ones_like(et)))
            loss[r0:r1] = torch.where(et > MIN_TARGET_E, ratio, lse - tl_)
        else:
            z = zx
            loss[r0:r1] = sh + torch.log(z)
        ok = torch.isfinite(z) & (z > 0) & (w != 0)
        wrow = torch.where(ok, w / torch.where(ok, z, torch.ones_like(z)), torch.zeros_like(z))
        if need_s:
            tx = sum(tt[2].sum(1) for tt in tiles)
            if split_k is not None:  # the target's d/ds: (W e_t - w) cos_t = -W zx cos_t
                tx = tx - zx * ct
            ds_parts.append((wrow * tx).sum().reshape(1))
        # per row tensor: dR_hat = s W (sum_k E_k @ C_hat_k - zx c_hat_t), into its accumulator (times rb),
        # and XW = diag(W) R_hat for the column roles' GEMMs
        xw = {}
        for t, o in groups:
            xsc, rs, nrm = ops[(t, o)]
            mine = [k for k, blk in enumerate(cfg.blocks) if (blk.rows, blk.row_start) == (t, o)]
            if any(need_cols[cfg.blocks[k].cols] for k in mine):
                xw[(t, o)] = TB._alloc((pp, d), dt, dev)
                TPN._rows_launch(launch, None, xsc, rs, nrm, wrow, scale_t, one, None, xw[(t, o)], eps, True, 1.0, dm)
            if not need[t]:
                continue
            raw = None
            for k in mine:
                blk = cfg.blocks[k]
                part = TPN._mm32(tiles[k][0], xs[blk.cols])
                raw = part if raw is None else raw.add_(part)
                if k == split_k:
                    tgt = block_masks[k].tgt[r0:r1]
                    raw.sub_((zx * cols[blk.cols].rb[tgt])[:, None] * xs[blk.cols][tgt].float())
            acc[t][o + r0:o + r1].add_(raw.mul_((wrow * cols[t].rb[o + r0:o + r1])[:, None]))
            del raw
        for k, blk in enumerate(cfg.blocks):
            if not need_cols[blk.cols]:
                continue
            TPN._addmm32_(acc[blk.cols], tiles[k][0].T, xw[(blk.rows, blk.row_start)])
            if k == split_k:  # the target column's term, W_i e_it - w_i = -W_i zx_i, rb folded as the tile's
                tgt = block_masks[k].tgt[r0:r1]
                xsc, rs, _ = ops[(blk.rows, blk.row_start)]
                coef = -(wrow * zx) * cols[blk.cols].rb[tgt] * rs
                acc[blk.cols].index_add_(0, tgt, coef[:, None] * xsc.float())
        del tiles, ops, xw
    grads: list[Tensor | None] = [None] * len(xs)
    for t, a in acc.items():  # times the norm (undoes rb), s, then the normalisation backward, in x's dtype
        grads[t] = TB._alloc(xs[t].shape, xs[t].dtype, dev)
        TPN._rows_launch(launch, a, xs[t], cols[t].rb, cols[t].nb, cols[t].nb, scale_t, one, grads[t], None, eps, True,
                         1.0, dm)
    del acc
    ds = torch.cat(ds_parts).sum() if need_s and ds_parts else (torch.zeros((), device=dev) if need_s else None)
    return loss, grads, ds
