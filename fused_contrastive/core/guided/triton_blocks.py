"""Triton path of the merged-block core (``core/guided/torch_blocks.py``): one column block per autograd call on the
kernels of ``fused_contrastive.kernels.guided`` (the guide tile computed in the same kernel as the
logit tile, never stored), the blocks of a row merged by log-sum-exp in PyTorch (O(N)).

Per block, in units of one N x M x D matmul, plus the guide's N x M x Dg dot each time a tile is
built: forward 1 (+1 guide); backward, dA kernel (recompute 1 + ``dl @ B`` 1) and dB kernel (recompute
1 + ``dl^T @ A`` 1) = 4 (+2 guide): the deterministic, atomic-free backward of ``kernels/lse.py``.
Launch configs: ``triton_shared.configs.guided_config`` (the fused kernels' "fwd_pos" / "bwd_rows" /
"bwd_cols", narrower backward tiles on sm_80 with fp32 guides); the guide is read in 16-wide fp32 chunks
(``GUIDE_BLOCK``) with ``tf32x3`` dots, 16-bit guides in one 16-bit pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ...kernels import guided as KG
from ..spec import CoreData, CoreSpec, DirectCtx, threshold_of
from ..triton_shared import launch as TL
from ..triton_shared.configs import guided_config

#: BLOCK_G: the guide dimension is streamed in chunks of this many fp32 values (tf32x3 dots).
GUIDE_BLOCK = 16
#: BLOCK_G of 16-bit guides on the panel route's epilogue GEMM (``core/guided/triton_panel.py``): 32-wide
#: k-steps of the tensor-core dot (64 spilled its 128 x 128 tiles on sm_80; the fused kernels keep
#: GUIDE_BLOCK for every guide dtype).
GUIDE_BLOCK_16 = 32


@dataclass
class ThetaSource:
    """A threshold read from the guide tile (``core.blocks.Masks.rule``): ``theta_i =
    threshold_of(<ga_i, gb_{t_i}>, strategy, margin)`` with the guide product computed by
    ``guided_theta_kernel`` on the tiles of the kernel that compares with it (per launch config: the
    forward and the two backward kernels may tile differently), cached per config."""

    ga: Tensor  # the protected block's unit guide rows [N, Dg]
    gb: Tensor  # its unit guide columns [M, Dg]
    tgt: Tensor  # [N] int64
    strategy: str
    margin: float
    cache: dict = field(default_factory=dict)

    def theta(self, cfg, block_g: int = GUIDE_BLOCK) -> Tensor:
        key = (cfg.block_m, cfg.block_n, cfg.num_warps, block_g)
        if key not in self.cache:
            n, m = self.ga.shape[0], self.gb.shape[0]
            gpos = TL._alloc((n,), torch.float32, self.ga.device)
            gdt = self.ga.dtype
            TL._launch(TL.Launch(
                "theta_guided", KG.guided_theta_kernel, (triton.cdiv(n, cfg.block_m),),
                dict(GA=self.ga, GB=self.gb, TGT=self.tgt, GPOS=gpos, N=n, M=m, Dg=self.ga.shape[1],
                     stride_ga=self.ga.stride(0), stride_gb=self.gb.stride(0)),
                dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_G=block_g, GUIDE_UPCAST=TL._upcast(gdt),
                     GUIDE_PREC=TL._dot_prec(gdt)),
                cfg.num_warps, cfg.num_stages))
            self.cache[key] = threshold_of(gpos, self.strategy, self.margin).contiguous()
        return self.cache[key]


@dataclass
class BlockMasks:
    """One block's exclusion data (no gradient): unit-normalised guide rows / columns (fp32, or both
    fp16 / bf16: the guide tile's dot then runs on 16-bit operands) and the fp32 per-row threshold (all
    or none; a tensor, or a ``ThetaSource`` read from the guide tiles), int64 ids of rows / columns
    (both or none), the protected column per row (int64) and the own-column offset (None: none)."""

    ga: Tensor | None = None
    gb: Tensor | None = None
    theta: Tensor | ThetaSource | None = None
    idr: Tensor | None = None
    idc: Tensor | None = None
    tgt: Tensor | None = None
    exclude: int | None = None


def _guide_dtype(mk: BlockMasks) -> torch.dtype:
    return mk.ga.dtype if mk.ga is not None else torch.float32


def _mask_args(mk: BlockMasks, dummy: Tensor, cfg, block_g: int = GUIDE_BLOCK) -> tuple[dict, dict]:
    """The kernels' mask arguments and flags of one block; a ``ThetaSource`` threshold is read with the
    launch's own tiles (``cfg``) and guide k-steps (``block_g``)."""
    ga = mk.ga if mk.ga is not None else dummy
    gb = mk.gb if mk.gb is not None else dummy
    theta = mk.theta.theta(cfg, block_g) if isinstance(mk.theta, ThetaSource) else mk.theta
    args = dict(GA=ga, GB=gb, THETA=theta if theta is not None else dummy,
                ID_R=mk.idr if mk.idr is not None else dummy, ID_C=mk.idc if mk.idc is not None else dummy,
                TGT=mk.tgt if mk.tgt is not None else dummy,
                Dg=ga.shape[1] if mk.ga is not None else 1,
                stride_ga=ga.stride(0) if mk.ga is not None else 1, stride_gb=gb.stride(0) if mk.gb is not None else 1,
                offset=int(mk.exclude or 0))
    gdt = mk.ga.dtype if mk.ga is not None else torch.float32
    flags = dict(BLOCK_G=block_g, EXCLUDE_SELF=mk.exclude is not None, HAS_GUIDE=mk.ga is not None,
                 HAS_IDS=mk.idr is not None, PROTECT=mk.tgt is not None, GUIDE_UPCAST=TL._upcast(gdt),
                 GUIDE_PREC=TL._dot_prec(gdt))
    return args, flags


def block_fwd(a: Tensor, b: Tensor, scale, mk: BlockMasks, normalize: bool, eps: float,
              stats: tuple[Tensor, Tensor] | None = None):
    """``(LSE [N], TL [N] or None, prepared inputs)`` of one block, fp32 (``a``, ``b`` in one kernel dtype).
    ``stats``: two fp32 [N] buffers the kernel fills with each row's kept-column count and kept-logit sum
    (label smoothing's, from the same tiles)."""
    dev = a.device
    n, d = a.shape
    p = TL._prepare(a, b, CoreSpec(normalize=normalize, eps=eps), CoreData(), False)
    cfg, block_d, _ = guided_config("fwd", TL._arch(dev), p.a.dtype, d, _guide_dtype(mk))
    lse = TL._alloc((n,), torch.float32, dev)
    tl_ = TL._alloc((n,), torch.float32, dev) if mk.tgt is not None else p.dummy
    margs, mflags = _mask_args(mk, p.dummy, cfg)
    TL._launch(TL.Launch(
        "guided_fwd", KG.guided_fwd_kernel, (triton.cdiv(n, cfg.block_m),),
        dict(SA=p.sa, SB=p.sb, RSA=p.norms[4], RSB=p.norms[5], SCALE=TL._scale32(scale, dev), **margs,
             LSE=lse, TL=tl_, KN=stats[0] if stats else p.dummy, SL=stats[1] if stats else p.dummy, **TL._sizes(p)),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, NORMALIZE=bool(normalize), **mflags,
             UPCAST=TL._upcast(p.a.dtype), DOT_PREC=TL._dot_prec(p.a.dtype), SMOOTH=stats is not None),
        cfg.num_warps, cfg.num_stages))
    return lse, (tl_ if mk.tgt is not None else None), p


def block_bwd(p, scale, mk: BlockMasks, normalize: bool, eps: float, lse: Tensor, g: Tensor, gt: Tensor | None,
              need_a: bool, need_b: bool, need_s: bool, gsl: Tensor | None = None):
    """``(dA, dB, ds)`` of one block (None where not needed); dA, dB in the kernels' input dtype. ``gsl``
    [N] fp32: the upstream of each row's kept-logit sum (``block_fwd``'s ``stats``), on every kept column."""
    a, b = p.a, p.b
    dev = a.device
    n, d = a.shape
    m = b.shape[0]
    dm = p.dummy
    gs = g.abs().amax() if gt is None else torch.maximum(g.abs().amax(), gt.abs().amax())
    if gsl is not None:
        gs = torch.maximum(gs, gsl.abs().amax())
    gs = torch.where(gs > 0, gs, torch.ones_like(gs)).reshape(1)
    na, ra, nb, rb, rsa, rsb = p.norms

    def args(cfg):  # the threshold of a ThetaSource from this kernel's own tiles
        margs, mflags = _mask_args(mk, dm, cfg)
        common = dict(SCALE=TL._scale32(scale, dev), GSCALE=gs, **margs, LSE=lse, G=g,
                      GT=gt if gt is not None else dm, GSL=gsl if gsl is not None else dm)
        flags = dict(NORMALIZE=bool(normalize), **mflags, HAS_GT=gt is not None, UPCAST=TL._upcast(a.dtype),
                     DOT_PREC=TL._dot_prec(a.dtype), PRESCALE=TL.prescale(a.dtype), SMOOTH=gsl is not None)
        return common, flags

    arch = TL._arch(dev)
    da = db = ds = None
    if need_a or need_s:
        cfg, block_d, resident = guided_config("bwd_rows", arch, a.dtype, d, _guide_dtype(mk))
        common, flags = args(cfg)
        n_rb = triton.cdiv(n, cfg.block_m)
        da = TL._alloc((n, d), a.dtype, dev) if need_a else dm
        acc = dm if (resident or not need_a) else torch.empty((n, d), dtype=torch.float32, device=dev)
        ds_part = TL._alloc((n_rb,), torch.float32, dev) if need_s else dm
        TL._launch(TL.Launch(
            "guided_bwd_rows", KG.guided_bwd_rows_kernel, (n_rb,),
            dict(A=a, SA=p.sa, SB=p.sb, RA=ra, NA=na, RSA=rsa, RSB=rsb, **common, DA=da, ACC=acc, DS_PART=ds_part,
                 **TL._sizes(p), stride_a=a.stride(0), stride_da=da.stride(0) if need_a else 0, eps=float(eps)),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, NEED_DX=bool(need_a),
                 NEED_DS=bool(need_s), RESIDENT=resident),
            cfg.num_warps, cfg.num_stages))
        ds = ds_part.sum() * gs.reshape(()) if need_s else None
        da = da if need_a else None
    if need_b:
        cfg, block_d, resident = guided_config("bwd_cols", arch, b.dtype, d, _guide_dtype(mk))
        common, flags = args(cfg)
        db = TL._alloc((m, d), b.dtype, dev)
        acc = dm if resident else torch.empty((m, d), dtype=torch.float32, device=dev)
        TL._launch(TL.Launch(
            "guided_bwd_cols", KG.guided_bwd_cols_kernel, (triton.cdiv(m, cfg.block_n),),
            dict(B=b, SA=p.sa, SB=p.sb, RB=rb, NB=nb, RSA=rsa, RSB=rsb, **common, DB=db, ACC=acc, **TL._sizes(p),
                 stride_b=b.stride(0), stride_db=db.stride(0), eps=float(eps)),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **flags, RESIDENT=resident),
            cfg.num_warps, cfg.num_stages))
    return da, db, ds


class GuidedBlockFn(torch.autograd.Function):
    """``(LSE [N], TL [N])`` of one masked block on the Triton kernels (fp32; TL is zeros without a
    protected column); with ``smooth`` also ``(KN [N], SL [N])``, each row's kept-column count (no
    gradient) and kept-logit sum (label smoothing's). Gradients flow to ``a``, ``b`` and a tensor ``scale``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor, scale, mk: BlockMasks, normalize: bool, eps: float, smooth: bool = False):
        dt = TL.kernel_dtype(a, b)
        n = a.shape[0]
        stats = tuple(TL._alloc((n,), torch.float32, a.device) for _ in range(2)) if smooth else None
        lse, tl_, p = block_fwd(a.to(dt), b.to(dt), scale, mk, normalize, eps, stats)
        ctx.mk, ctx.normalize, ctx.eps = mk, normalize, eps
        ctx.prep = p._replace(a=None, b=None, sa=None, sb=None)
        ctx.scale = None if isinstance(scale, Tensor) else scale
        ctx.dtypes = (a.dtype, b.dtype, scale.dtype if isinstance(scale, Tensor) else None,
                      scale.shape if isinstance(scale, Tensor) else None)
        ctx.has_tl = tl_ is not None
        ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, p.a, p.b, p.sa, p.sb)
        out = lse, (tl_ if tl_ is not None else torch.zeros_like(lse))
        if smooth:
            if not isinstance(ctx, DirectCtx):
                ctx.mark_non_differentiable(stats[0])
            return (*out, *stats)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @autocast_off
    @first_order("GuidedBlockFn")
    def backward(ctx, g_lse: Tensor, g_tl: Tensor, g_kn: Tensor | None = None, g_sl: Tensor | None = None):
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        scale, lse, a, b, sa, sb = ctx.saved_tensors
        if scale is None:
            scale = ctx.scale
        p = ctx.prep._replace(a=a, b=b, sa=sa, sb=sb)
        g = g_lse.to(torch.float32).contiguous() if g_lse is not None else torch.zeros_like(lse)
        gt = g_tl.to(torch.float32).contiguous() if (g_tl is not None and ctx.has_tl) else None
        gsl = g_sl.to(torch.float32).contiguous() if g_sl is not None else None
        da, db, ds = block_bwd(p, scale, ctx.mk, ctx.normalize, ctx.eps, lse, g, gt, need_a, need_b, need_s, gsl)
        adt, bdt, sdt, sshape = ctx.dtypes
        return (da.to(adt) if need_a and da is not None else None, db.to(bdt) if need_b and db is not None else None,
                ds.to(sdt).reshape(sshape) if need_s and ds is not None else None, None, None, None, None)
