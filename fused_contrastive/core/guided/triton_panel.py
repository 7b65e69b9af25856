"""The merged-block core (``core/guided/torch_blocks.py``: GISTEmbed, guided and id-masked InfoNCE) on row panels with
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
2. the merge, O(P) (``guided_rows_kernel``, before and after the redo; every block's partials side by side
   in one buffer): ``zx_i = sum_k z^k_i`` (every column but the target), ``z_i = zx_i + e_it``; a row
   with ``z_i < 2^-64`` (every logit below ``|s| - 100.4``) is redone exactly by MODE 2 with its
   largest logit over every block as the shift; ``LSE_i = m_i + log z_i``, the row's loss
   ``log1p(zx_i / e_it)`` (``LSE_i - l_it`` without its cancellation; exactly 0 for a row whose every
   other column is excluded, as the textbook's), or ``LSE_i - l_it`` where ``e_it`` is tiny, and the
   row weight ``W_i = w_i / z_i``;
3. per row tensor, ``dR_hat = W (sum_k E_k @ C_hat_k - zx e_t-row)``: the target's gradient
   ``W_i e_it - w_i = -W_i zx_i`` in fp32 (the 16-bit tile never holds ``p_t - 1``), added to its fp32
   accumulator by ``guided_acc_kernel`` (``sum_k E_k @ C_k`` accumulated by cuBLAS); ``XW = diag(W) R_hat``
   by ``panel_rows_kernel``;
4. per block, ``acc[cols_k] += E_k^T @ XW`` (fp32 accumulator per column tensor), the target term by
   ``index_add_``; after the sweep the normalisation backward of each accumulator.

Units per block: 3 (the eager sweep of a summed loss), plus the guide tile (``Dg / D`` of a unit) and
``P / N`` of a redo where it happens. Memory: ``4 D`` bytes per column row (the accumulators), the
gradients in fp32, and per panel row ``2 sum_k M_k`` (the tiles) + ``12 D`` + partials; nothing N x M.
Per-row outputs (``reduction="none"``), fp16 (its range cannot hold ``e^56``), fp32 and
``normalize=False`` keep the fused kernels (``core/guided/triton_blocks.py``).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...kernels import guided as KG
from ...kernels import panel as KP
from ...routes import setting
from ..spec import CoreSpec
from ..triton_shared import launch as TL
from ..triton_shared import panels
from ..triton_shared.configs import (
    EPI_GROUP_M,
    GUIDED_EPI,
    GUIDED_PERSIST_STAGES,
    GUIDED_ROWS_BLOCK_C,
    GUIDED_ROWS_BLOCK_R,
    LaunchConfig,
    d_pad,
)
from . import triton_blocks as TG

#: A target exponential below this takes the loss as ``LSE - l_t`` (its ratio would lose precision).
MIN_TARGET_E = 1e-30


def guided_blocks_dtype(xs) -> torch.dtype | None:
    """The one dtype of every embedding tensor, or None when they differ."""
    dts = {x.dtype for x in xs}
    return dts.pop() if len(dts) == 1 else None


def use_guided_panel(xs, cfg, weights: Tensor | None) -> bool:
    """Whether ``TritonMergedFn`` takes this route: a summed loss (``weights``) of unit rows
    (``normalize``), every tensor bf16, a protected block only together with ``minus_target`` (the
    target then leaves the tile), and the panel path's choice for the problem (``panels.use_panel``
    with N x sum_k M_k elements: CUDA from 2^24, env ``FUSED_CONTRASTIVE_TRITON_PATH``) and the epilogue
    GEMM's (``panels.use_epilogue`` form "guided", env ``FUSED_CONTRASTIVE_PANEL_GEMM``)."""
    if weights is None or not cfg.normalize or guided_blocks_dtype(xs) != torch.bfloat16:
        return False
    protected = [blk for blk in cfg.blocks if blk.protect]
    if protected and not cfg.minus_target:
        return False
    elements = cfg.n * sum(xs[blk.cols].shape[0] for blk in cfg.blocks)
    a = xs[0]
    return panels.use_panel(a, cfg.n, elements // max(cfg.n, 1)) and panels.use_epilogue(a.device,
                                                                                                     a.dtype, "guided",
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
    ``panels.BUDGET_BYTES``): ``fixed = 4 D grad_rows`` (the fp32 accumulators of the tensors with a
    gradient), per panel row ``2 sum_k M_k`` (the bf16 tiles) + the partials (4 bytes x 2-5 per column
    tile of each block) + ``8 D`` per row group (the operand copy, the dR GEMM's fp32 output, XW). A
    multiple of ``block_m`` (the threshold kernel's row tiles line up), at least :data:`P_MIN`."""
    if setting("GUIDED_PANEL_ROWS") is not None:  # a fixed height, rounded to the row tile
        return max(1, min(n, triton.cdiv(setting("GUIDED_PANEL_ROWS"), block_m) * block_m))
    budget = setting("PANEL_BUDGET") or panels.BUDGET_BYTES
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
    launch = TL._launch
    cfg_e: LaunchConfig = GUIDED_EPI["one_pass"]
    cfg_w: LaunchConfig = GUIDED_EPI["one_pass_wide"]  # 16-bit guides, no split target: 128-row tiles
    # the redo's BLOCK_N is the partials' column tile: cfg_e's
    cfg_r: LaunchConfig = GUIDED_EPI["redo_sm90" if TL._arch(dev) == "sm90" else "redo_sm80"]
    bn, bk = cfg_e.block_n, cfg_e.block_d  # every config shares BLOCK_N (the partials' column tile) and BLOCK_K
    split_k = next((k for k, blk in enumerate(cfg.blocks) if blk.protect), None) if cfg.minus_target else None
    # each block's launch config: the wide tiles where they compile without spills
    g16 = [mk.ga is not None and mk.ga.dtype in (torch.float16, torch.bfloat16) for mk in block_masks]
    names = ["one_pass_wide" if (k != split_k and g16[k]) else "one_pass" for k in range(len(block_masks))]
    cfgs = [cfg_w if name == "one_pass_wide" else cfg_e for name in names]
    # the tile loop's form (panels.EPI_FORMS; "tma" is "persistent" here: the guide operands have no
    # descriptors) and each block's persistent pipeline depth (None: that block keeps the tiles form)
    persist = [GUIDED_PERSIST_STAGES[(name, TL._arch(dev), g16[k], k == split_k)] if panels.epi_form() != "tiles"
               else None for k, name in enumerate(names)]
    groups = sorted({(blk.rows, blk.row_start) for blk in cfg.blocks})
    col_ts = sorted({blk.cols for blk in cfg.blocks})
    need_cols = {c: need[c] for c in col_ts}
    p_rows = panel_rows(n, [xs[blk.cols].shape[0] for blk in cfg.blocks], d, len(groups),
                        sum(x.shape[0] for x, nd in zip(xs, need, strict=True) if nd), max(c.block_m for c in cfgs),
                        bn, split_k is not None, need_s)
    scale_t = TL._scale32(scale, dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)  # gscale: W carries the weights in fp32
    dm = torch.empty(1, dtype=torch.float32, device=dev)
    shift = scale_t.reshape(()).abs() - KP.ONE_PASS_SHIFT.value
    w_all = weights.to(torch.float32)
    # norms of every column tensor and every tensor with a gradient (its accumulator is in their frame)
    # (the panel path's column norms in chunks: nb, rb; bf16 needs no normalised copy)
    cols = {c: panels._Problem(xs[c], xs[c], CoreSpec(normalize=True, eps=eps), need_op=False)
            for c in sorted(set(col_ts) | {t for t, nd in enumerate(need) if nd})}
    # one fp32 accumulator per tensor with a gradient, rows j holding rb_j (dL / dx_hat_j) / s: the column
    # roles' E^T @ XW (rb folded into E) and the row roles' W (E @ C_hat) times rb, both added here, then
    # one normalisation backward per tensor after the sweep
    acc = {t: torch.zeros(xs[t].shape, dtype=torch.float32, device=dev) for t, nd in enumerate(need) if nd}
    loss = TL._alloc((n,), torch.float32, dev)
    ds_parts = []
    # the mask arguments per block; 16-bit guides take GUIDE_BLOCK_16-wide k-steps of the guide dot
    kargs = [TG._mask_args(mk, dm, c, TG.GUIDE_BLOCK_16 if is16 else TG.GUIDE_BLOCK)
             for mk, c, is16 in zip(block_masks, cfgs, g16, strict=True)]
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        ops = {}
        for t, o in groups:  # the panel's operand rows of each row tensor: scaled copy, factor, norm
            xsc, nrm, _, rs = TL._row_norms(xs[t][o + r0:o + r1], eps)
            ops[(t, o)] = (xsc, rs, nrm)
        # every block's row partials side by side in one buffer per kind (the merge reads them in one pass)
        n_pns = [triton.cdiv(xs[blk.cols].shape[0], bn) for blk in cfg.blocks]
        offs = [sum(n_pns[:k]) for k in range(len(n_pns))]
        n_all = sum(n_pns)
        zp = TL._alloc((pp, n_all), torch.float32, dev)
        tp = TL._alloc((pp, n_all), torch.float32, dev) if need_s else None
        mxp = TL._alloc((pp, n_all), torch.float32, dev)
        etp = TL._alloc((pp, n_all), torch.float32, dev) if split_k is not None else None
        ctp = TL._alloc((pp, n_all), torch.float32, dev) if split_k is not None else None
        tiles = []
        for k, blk in enumerate(cfg.blocks):
            xsc, rs, _ = ops[(blk.rows, blk.row_start)]
            y = xs[blk.cols]
            m = y.shape[0]
            n_pn = n_pns[k]
            split = k == split_k
            dl = TL._alloc((pp, m), dt, dev)
            o = offs[k]
            margs, mflags = kargs[k]
            ck = cfgs[k]
            n_pm = triton.cdiv(pp, ck.block_m)
            args = dict(X=xsc, Y=y, DL=dl, ZP=zp[:, o:], TP=tp[:, o:] if need_s else dm, MXP=mxp[:, o:],
                        ETP=etp[:, o:] if split else dm, CTP=ctp[:, o:] if split else dm, RSP=rs,
                        RB=cols[blk.cols].rb, SCALE=scale_t, **margs, P=pp, M=m, D=d, r0=r0, stride_x=xsc.stride(0),
                        stride_y=y.stride(0), stride_dl=dl.stride(0), stride_zp=n_all)
            const = dict(BLOCK_M=ck.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0,
                         UPCAST=TL._upcast(dt), NORMALIZE=True, **mflags, SPLIT_T=split, NEED_DS=bool(need_s),
                         FOLD_RB=True)
            if persist[k] is None:
                launch(TL.Launch("guided_epi", KG.guided_epi_kernel, (n_pm * n_pn,), dict(args, BAD=dm, SHIFT=dm),
                                 dict(const, MODE=1, PERSIST=False), ck.num_warps, ck.num_stages))
            else:
                grid = (max(1, min(n_pm * n_pn, panels.persistent_programs(dev))),)
                launch(TL.Launch("guided_epi", KG.guided_epi_kernel, grid, dict(args, BAD=dm, SHIFT=dm),
                                 dict(const, MODE=1, PERSIST=True), ck.num_warps, persist[k]))
            tiles.append((dl, args, const))
        # the merge over the blocks (guided_rows_kernel, before and after the redo); rows whose every e
        # underflowed are redone with their own maximum
        bad8 = torch.empty((pp,), dtype=torch.int8, device=dev)
        sh = TL._alloc((pp,), torch.float32, dev)
        wrow = TL._alloc((pp,), torch.float32, dev)
        zx = TL._alloc((pp,), torch.float32, dev)
        dsw = TL._alloc((pp,), torch.float32, dev) if need_s else dm
        o_t = offs[split_k] if split_k is not None else 0
        rows_args = dict(ZP=zp, TP=tp if need_s else dm, MXP=mxp, ETP=etp[:, o_t:] if split_k is not None else dm,
                         CTP=ctp[:, o_t:] if split_k is not None else dm, SHIFT0=shift, BAD=bad8, SH=sh, LOSS=loss,
                         W=w_all, WROW=wrow, ZX=zx, DSW=dsw, SCALE=scale_t, P=pp, n_all=n_all,
                         n_t=n_pns[split_k] if split_k is not None else 0, r0=r0, stride_zp=n_all,
                         min_te=MIN_TARGET_E)
        rows_const = dict(BLOCK_R=GUIDED_ROWS_BLOCK_R, BLOCK_C=GUIDED_ROWS_BLOCK_C, SPLIT=split_k is not None,
                          NEED_DS=bool(need_s))
        rows_grid = (triton.cdiv(pp, GUIDED_ROWS_BLOCK_R),)
        launch(TL.Launch("guided_rows", KG.guided_rows_kernel, rows_grid, rows_args, dict(rows_const, FINISH=False),
                         4, 1))
        for _, args, const in tiles:
            launch(TL.Launch("guided_epi_redo", KG.guided_epi_kernel, (triton.cdiv(pp, cfg_r.block_m),),
                             dict(args, BAD=bad8, SHIFT=sh), dict(const, MODE=2, BLOCK_M=cfg_r.block_m, PERSIST=False),
                             cfg_r.num_warps, cfg_r.num_stages))
        launch(TL.Launch("guided_rows", KG.guided_rows_kernel, rows_grid, rows_args, dict(rows_const, FINISH=True),
                         4, 1))
        if need_s:
            ds_parts.append(dsw)
        del zp, tp, mxp, etp, ctp
        # per row tensor: dR_hat = s W (sum_k E_k @ C_hat_k - zx c_hat_t), into its accumulator (times rb),
        # and XW = diag(W) R_hat for the column roles' GEMMs
        xw = {}
        for t, o in groups:
            xsc, rs, nrm = ops[(t, o)]
            mine = [k for k, blk in enumerate(cfg.blocks) if (blk.rows, blk.row_start) == (t, o)]
            if any(need_cols[cfg.blocks[k].cols] for k in mine):
                xw[(t, o)] = TL._alloc((pp, d), dt, dev)
                panels._rows_launch(launch, None, xsc, rs, nrm, wrow, scale_t, one, None, xw[(t, o)],
                                          eps, True, 1.0, dm)
            if not need[t]:
                continue
            raw = None
            for k in mine:  # sum_k E_k @ C_k in fp32 (cuBLAS, accumulating)
                blk = cfg.blocks[k]
                if raw is None:
                    raw = panels._mm32(tiles[k][0], xs[blk.cols])
                else:
                    panels._addmm32_(raw, tiles[k][0], xs[blk.cols])
            # acc += W rb (raw - zx rb_t C_t): the target's term in fp32 (guided_acc_kernel, one pass)
            ks = [k for k in mine if k == split_k]
            tgt = block_masks[ks[0]].tgt[r0:r1] if ks else dm
            cm = xs[cfg.blocks[ks[0]].cols] if ks else xs[t]
            ct = zx * cols[cfg.blocks[ks[0]].cols].rb[tgt] if ks else dm
            dst = acc[t][o + r0:o + r1]
            f = wrow * cols[t].rb[o + r0:o + r1]
            launch(TL.Launch("guided_acc", KG.guided_acc_kernel, (triton.cdiv(pp, GUIDED_ROWS_BLOCK_R),),
                             dict(ACC=dst, RAW=raw, C=cm, TGT=tgt, CT=ct, F=f, P=pp, D=d, stride_acc=dst.stride(0),
                                  stride_raw=raw.stride(0), stride_c=cm.stride(0)),
                             dict(BLOCK_R=GUIDED_ROWS_BLOCK_R, BLOCK_D=min(d_pad(d), 128), HAS_T=bool(ks)), 4, 1))
            del raw
        for k, blk in enumerate(cfg.blocks):
            if not need_cols[blk.cols]:
                continue
            panels._addmm32_(acc[blk.cols], tiles[k][0].T, xw[(blk.rows, blk.row_start)])
            if k == split_k:  # the target column's term, W_i e_it - w_i = -W_i zx_i, rb folded as the tile's
                tgt = block_masks[k].tgt[r0:r1]
                xsc, rs, _ = ops[(blk.rows, blk.row_start)]
                coef = -(wrow * zx) * cols[blk.cols].rb[tgt] * rs
                acc[blk.cols].index_add_(0, tgt, coef[:, None] * xsc.float())
        del tiles, ops, xw
    grads: list[Tensor | None] = [None] * len(xs)
    for t, a in acc.items():  # times the norm (undoes rb), s, then the normalisation backward, in x's dtype
        grads[t] = TL._alloc(xs[t].shape, xs[t].dtype, dev)
        panels._rows_launch(launch, a, xs[t], cols[t].rb, cols[t].nb, cols[t].nb, scale_t, one, grads[t],
                                  None, eps, True,
                         1.0, dm)
    del acc
    ds = torch.cat(ds_parts).sum() if need_s and ds_parts else (torch.zeros((), device=dev) if need_s else None)
    return loss, grads, ds
