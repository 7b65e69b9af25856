"""SigLIP's panel sweep: the epilogue GEMM's SigLIP modes (``kernels/panel.py`` ``epi_gemm_kernel`` MODE 4 / 5;
the math in ``kernels/siglip.py``) per row panel, with the shared panel machinery of ``triton_shared/panels.py``.

The switchboard's ``SIGLIP_EPILOGUE`` picks the per-logit math of every SigLIP sweep (:func:`epilogue`): "exact"
(the default: ``kernels/common.py`` ``_softplus`` / ``_dz``, a libdevice log and IEEE divisions), "lean" (the
kernel's LEAN constexpr: ``_softplus_lean`` / ``_dz_lean``, one exp, a degree-7 log1p polynomial and one
approximate reciprocal per logit) or "lean128" (lean, and the one pass, MODE 5, at :data:`LEAN128_BLOCK_M`
rows per tile), or "fp16pass" (no epilogue GEMM: cuBLAS fp16 cosines of the unit rows and one in-place Triton pass
per panel with the exact math, ``triton_fp16pass.py``; normalised 16-bit rows only, MODE 4 / 5 with the exact math
elsewhere).
No GPU has timed the lean forms or the fp16 pass: they are options (bench-gpu's ``siglip=lean``,
``siglip=lean128``, ``siglip=lean128+tiles``, ``siglip=fp16pass``)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...routes import setting
from ..triton_shared import panels
from ..triton_shared.configs import EPI_GEMM, EPI_GROUP_M
from ..triton_shared.launch import _alloc, _gscale, _upcast
from ..triton_shared.logit_pass import panel_bytes
from .triton_fp16pass import SigLipFp16Pass, use_fp16_pass

#: The one pass's (MODE 5) row tile under ``SIGLIP_EPILOGUE=lean128``, with ``EPI_GEMM["siglip_eager"]``'s column
#: tile, D chunk, warps and stages (the exact epilogue spilled 168-516 bytes at 128 x 128; the lean one 20 bytes in
#: the tiles loop and 116-176 in the TMA loop on sm_90: docs/panel-path.md; not timed). Panels are multiples of 64
#: rows, so a panel's last row tile may be half empty (N = 16384: 2 of 136 row tiles).
LEAN128_BLOCK_M = 128


def epilogue() -> tuple[bool, bool]:
    """(LEAN: the lean per-logit math in every SigLIP sweep, whether the one pass takes
    :data:`LEAN128_BLOCK_M`-row tiles) from the switchboard's ``SIGLIP_EPILOGUE`` ("exact" and "fp16pass": the
    exact math)."""
    form = setting("SIGLIP_EPILOGUE")
    return form in ("lean", "lean128"), form == "lean128"


def siglip_sweep(launch, x: Tensor, y: Tensor, scale_t: Tensor, bias_t: Tensor, normalize: bool, eps: float,
                 offset: int, g: Tensor | None, need_x: bool, need_y: bool, need_s: bool, with_loss: bool = False):
    """SigLIP on row panels (``kernels/panel.py`` ``epi_gemm_kernel`` MODE 4; the math in
    ``kernels/siglip.py``): ``(loss [N], dX, dY, ds, db)`` for images ``x`` [N, D] and texts ``y`` [M, D]
    in one 16-bit dtype, ``scale_t`` / ``bias_t`` [1] fp32. Without ``g`` (the forward): the per-image
    losses only, one matmul unit. With ``g`` [N] fp32 (the upstream gradient of each image's loss; the
    loss is then None unless ``with_loss``): per panel the epilogue GEMM writes the gradient tile ``dz``
    (16-bit, pre-scaled and ``rb_j`` folded as the core op's ``DL``), then the core sweep's cuBLAS GEMMs
    and row epilogue give dX and the dY accumulator: 3 units. ``with_loss`` (MODE 5, the eager forward of
    a summed loss: ``g`` is its weight per row) forms the losses in the same epilogue: 3 units for the step
    where a forward and a backward sweep take 4 (the fused kernels take 5, their backward streaming through
    an fp32 scratch). ds / db are 0-dim fp32 tensors (no host sync), None unless ``need_s``; dX / dY None
    unless asked. Under ``SIGLIP_EPILOGUE=fp16pass`` with normalised 16-bit rows, cuBLAS fp16 cosines and
    ``triton_fp16pass.SigLipFp16Pass`` write the same outputs in place of each epilogue GEMM launch."""
    from ..spec import CoreSpec

    n, d = x.shape
    m = y.shape[0]
    dev, dt = x.device, x.dtype
    spec = CoreSpec(normalize=normalize, eps=eps)
    need = g is not None
    pr = panels._Problem(x, y, spec, need_op=need and need_x)
    fp16pass = use_fp16_pass(dt, normalize)
    p_rows = panels.panel_rows(n, m, d, dt, need and need_y, True, extra=panel_bytes(m, d) if fp16pass else (0, 0))
    producer = SigLipFp16Pass(x, y, pr.b_op, eps, offset) if fp16pass else None
    one_pass = need and with_loss  # MODE 5
    with_loss = with_loss or not need
    config = "siglip_eager" if one_pass else "siglip_bwd" if need else "siglip_fwd"
    cfg = EPI_GEMM[config]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_d
    lean, tall = epilogue()
    if one_pass and tall:
        bm = LEAN128_BLOCK_M
    dm = torch.empty(1, dtype=torch.float32, device=dev)
    gs = _gscale(g) if need else None
    loss = _alloc((n,), torch.float32, dev) if with_loss else None
    dx = _alloc((n, d), dt, dev) if need and need_x else None
    acc = torch.zeros((m, d), dtype=torch.float32, device=dev) if need and need_y else None
    n_pn = triton.cdiv(m, bn)
    ds_parts, db_parts = [], []
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0, UPCAST=_upcast(dt),
                 MODE=5 if one_pass else 4, NORMALIZE=bool(normalize), EXCLUDE_SELF=False, HAS_BIAS=False,
                 BIAS_COS=False, POS_KIND=0,
                 HAS_G=need, HAS_GCOL=False, HAS_GPOS=False, SYM=False, NEED_DS=bool(need and need_s),
                 FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale, TRI=False, WANT_COL=False, SPLIT_T=False,
                 LEAN=lean)
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        xp, rs, nrm = pr.rows(r0, r1)
        n_pm = triton.cdiv(pp, bm)
        zp = _alloc((pp, n_pn), torch.float32, dev) if with_loss else dm
        tp = _alloc((pp, n_pn), torch.float32, dev) if need and need_s else dm
        bp = _alloc((pp, n_pn), torch.float32, dev) if need and need_s else dm
        dl = _alloc((pp, m), dt, dev) if need or fp16pass else dm
        if fp16pass:
            producer(launch, xp, rs, dl, r0, zp, tp, bp,
                     dict(RB=pr.rb if pr.rb is not None else dm, SCALE=scale_t, LBIAS=bias_t, G=g if need else dm,
                          GSCALE=gs if need else dm),
                     dict(BLOCK_N=bn, WANT_LOSS=with_loss, HAS_G=need, NEED_DS=bool(need and need_s),
                          FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale))
        else:
            panels._epi_launch(launch, "epi_gemm_siglip",
                        dict(X=xp, Y=y, DL=dl, ZP=zp, TP=tp, MXP=bp, CZ=dm, CM=dm, DS_PART=dm, BAD=dm, SHIFT=dm,
                             LBIAS=bias_t, RSP=rs.contiguous(), RB=pr.rb if pr.rb is not None else dm, SCALE=scale_t,
                             GSCALE=gs if need else dm, BIAS_COL=dm, ROW_LAB=dm, COL_LAB=dm, POS_MASK=dm, LSE=dm,
                             G=g if need else dm, LSE_COL=dm, G_COL=dm, LSE_POS=dm, G_POS=dm, TGT=dm, TV=dm, P=pp, M=m,
                             D=d, r0=r0,
                             stride_x=xp.stride(0), stride_y=y.stride(0), stride_dl=dl.stride(0) if need else 0,
                             stride_zp=n_pn, offset=int(offset), bias=0.0, n0=1, m0=1, stride_pm=1),
                        const, config, n_pm * n_pn)
        if with_loss:
            loss[r0:r1] = zp.sum(1)
        if need and need_s:
            ds_parts.append(tp.sum().reshape(1))
            db_parts.append(bp.sum().reshape(1))
        if need:
            panels._panel_gemms(launch, pr, dl, torch.ones(pp, dtype=torch.float32, device=dev), xp, rs, nrm, scale_t,
                                gs, dx[r0:r1] if need_x else None, acc, m, dm)
        del xp, dl
    dy = None
    if acc is not None:
        dy = panels._db_from_acc(launch, pr, acc, y, m, scale_t, gs, dm)
        del acc
    ds = db = None
    if need and need_s:
        ds = torch.cat(ds_parts).sum() * gs.reshape(())
        db = torch.cat(db_parts).sum() * gs.reshape(())
    return loss, dx, dy, ds, db
