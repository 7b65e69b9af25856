"""Triton path of SigLIP's sigmoid loss: launchers and one autograd Function (device code in
``fused_contrastive.kernels.siglip``, whose docstring has the math).

Per step (forward + backward) with images [N, D] and texts [M, D]:

* ``row_norm`` (the core kernels' prologue, ``triton_shared.launch._row_norms``) on each side when
  ``normalize``: clamped norms, their inverses and the power-of-two scaled copies the tiles read;
* ``siglip_fwd``: the per-image losses [N] (fp32), one program per row block;
* ``siglip_bwd_rows``: dX and per-row-block partial sums of ds and db (summed here, fixed order);
* ``siglip_bwd_cols``: dY, one program per column block.

Launch configs come from the core kernels' table (``triton_shared.configs.config_for`` with "fwd",
"bwd_rows", "bwd_cols"). Every launch goes through ``triton_shared/launch.py`` ``_launch`` (so the ahead-of-time
compiles of ``tools.compile_survey`` see exactly these argument lists, and ``wrap_triton`` under tracing).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ...kernels import siglip as KS
from ..triton_shared import launch as TL
from ..triton_shared import panels
from ..triton_shared.configs import config_for
from . import triton_sweep

__all__ = ["TritonSigLipFn", "use_panel_route"]

#: The SigLIP forward's tile on sm_80 (16-bit, the shared "fwd" config's 128 x 128 at 16 warps otherwise): there, at
#: 128 registers a thread, its softplus epilogue spilled 32 bytes under Triton 3.6 (the version PyTorch's CUDA wheels
#: ship: bench/gpu_compiles.py), and 128 x 128 at 8 warps spilled 16 under Triton 3.9; 128 x 64 at 8 warps (the fused
#: forward's tile with a softmax over positives) compiles without under both (180-182 registers). Untimed on a GPU
#: (no A100 has been lent), as the 16 warps were.
SIGLIP_FWD_SM80 = dict(block_n=64, num_warps=8)


class _Prepared(NamedTuple):
    x: Tensor  # raw rows in the kernel dtype (the normalisation backward reads them)
    y: Tensor
    sx: Tensor  # power-of-two scaled copies (the raw rows without normalisation): what the tiles read
    sy: Tensor
    norms: tuple[Tensor, ...]  # nx, rx, ny, ry, rsx, rsy (dummies without normalisation)
    normalize: bool
    dummy: Tensor


def _prepare(x: Tensor, y: Tensor, normalize: bool, eps: float) -> _Prepared:
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    x, y = TL._rows_ok(x), TL._rows_ok(y)
    if normalize:
        sx, nx, rx, rsx = TL._row_norms(x, eps)
        sy, ny, ry, rsy = TL._row_norms(y, eps)
    else:
        sx, sy = x, y
        nx = rx = ny = ry = rsx = rsy = dummy
    return _Prepared(x, y, sx, sy, (nx, rx, ny, ry, rsx, rsy), bool(normalize), dummy)


def _common(p: _Prepared) -> dict[str, object]:
    return dict(N=p.x.shape[0], M=p.y.shape[0], D=p.x.shape[1], stride_sa=p.sx.stride(0),
                stride_sb=p.sy.stride(0))


def _flags(p: _Prepared) -> dict[str, object]:
    return dict(NORMALIZE=p.normalize, UPCAST=TL._upcast(p.x.dtype), DOT_PREC=TL._dot_prec(p.x.dtype))


def siglip_fwd(x: Tensor, y: Tensor, scale, bias, normalize: bool, eps: float, offset: int
               ) -> tuple[Tensor, _Prepared]:
    """(per-image losses [N] fp32, prepared inputs); ``x`` [N, D], ``y`` [M, D] in one kernel dtype."""
    dev = x.device
    n, d = x.shape
    p = _prepare(x, y, normalize, eps)
    arch = TL._arch(dev)
    cfg, block_d, _ = config_for("fwd", arch, p.x.dtype, d)
    if arch == "sm80" and p.x.dtype != torch.float32:
        cfg = dataclasses.replace(cfg, **SIGLIP_FWD_SM80)
    loss = TL._alloc((n,), torch.float32, dev)
    rsx, rsy = p.norms[4:]
    TL._launch(TL.Launch(
        "siglip_fwd", KS.siglip_fwd_kernel, (triton.cdiv(n, cfg.block_m),),
        dict(SA=p.sx, SB=p.sy, RSA=rsx, RSB=rsy, SCALE=TL._scale32(scale, dev), BIAS=TL._scale32(bias, dev),
             LOSS=loss, **_common(p), offset=int(offset)),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **_flags(p)),
        cfg.num_warps, cfg.num_stages))
    return loss, p


def siglip_bwd(p: _Prepared, scale, bias, g: Tensor, offset: int, eps: float, need_x: bool, need_y: bool,
               need_s: bool, need_b: bool):
    """``(dX, dY, ds, db)`` (None where not needed) for per-image upstream gradients ``g`` [N] fp32; dX, dY
    in the kernel dtype, ds / db 0-dim fp32 tensors (no host sync)."""
    x, y = p.x, p.y
    dev = x.device
    n, d = x.shape
    m = y.shape[0]
    nx, rx, ny, ry, rsx, rsy = p.norms
    dm = p.dummy
    # one global scale of the upstream gradients, so the fp16 operand dz / gscale cannot underflow
    gs = g.abs().amax()
    gs = torch.where(gs > 0, gs, torch.ones_like(gs)).reshape(1)
    arch = TL._arch(dev)
    common = dict(SCALE=TL._scale32(scale, dev), BIAS=TL._scale32(bias, dev), GSCALE=gs, G=g, **_common(p),
                  offset=int(offset), eps=float(eps))
    dx = dy = ds = db = None
    if need_x or need_s or need_b:
        cfg, block_d, resident = config_for("bwd_rows", arch, x.dtype, d)
        n_rb = triton.cdiv(n, cfg.block_m)
        dxb = TL._alloc((n, d), x.dtype, dev) if need_x else dm
        acc = dm if (resident or not need_x) else torch.empty((n, d), dtype=torch.float32, device=dev)
        ds_part = TL._alloc((n_rb,), torch.float32, dev) if need_s else dm
        db_part = TL._alloc((n_rb,), torch.float32, dev) if need_b else dm
        TL._launch(TL.Launch(
            "siglip_bwd_rows", KS.siglip_bwd_rows_kernel, (n_rb,),
            dict(A=x, SA=p.sx, SB=p.sy, RA=rx, NA=nx, RSA=rsx, RSB=rsy, **common, DA=dxb, ACC=acc,
                 DS_PART=ds_part, DB_PART=db_part, stride_a=x.stride(0), stride_da=dxb.stride(0) if need_x else 0),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **_flags(p), NEED_DX=bool(need_x),
                 NEED_DS=bool(need_s), NEED_DB=bool(need_b), RESIDENT=resident,
                 PRESCALE=TL.prescale(x.dtype)),
            cfg.num_warps, cfg.num_stages))
        dx = dxb if need_x else None
        ds = ds_part.sum() * gs.reshape(()) if need_s else None
        db = db_part.sum() * gs.reshape(()) if need_b else None
    if need_y:
        cfg, block_d, resident = config_for("bwd_cols", arch, y.dtype, d)
        dy = TL._alloc((m, d), y.dtype, dev)
        acc = dm if resident else torch.empty((m, d), dtype=torch.float32, device=dev)
        TL._launch(TL.Launch(
            "siglip_bwd_cols", KS.siglip_bwd_cols_kernel, (triton.cdiv(m, cfg.block_n),),
            dict(B=y, SA=p.sx, SB=p.sy, RB=ry, NB=ny, RSA=rsx, RSB=rsy, **common, DB=dy, ACC=acc,
                 stride_b=y.stride(0), stride_db=dy.stride(0)),
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, **_flags(p), RESIDENT=resident,
                 PRESCALE=TL.prescale(y.dtype)),
            cfg.num_warps, cfg.num_stages))
    return dx, dy, ds, db


def use_panel_route(x: Tensor, n: int, m: int, dt: torch.dtype) -> bool:
    """SigLIP takes the panel path's epilogue GEMM (``triton_sweep.siglip_sweep``) where the core op takes
    the panel path (``panels.use_panel``: CUDA, N x M >= 2^24, or forced) with its epilogue GEMM
    (``use_epilogue``: 16-bit operands), else the fused kernels below."""
    return panels.use_panel(x, n, m) and panels.use_epilogue(x.device, dt, "one_pass", n * m)


class TritonSigLipFn(torch.autograd.Function):
    """SigLIP on the Triton kernels, the contract of ``core.siglip.SigLipFn``: per-image losses [N]
    (``reduce`` False) or ``weight * sum_i loss_i`` (0-dim), float32; gradients in each input's dtype
    (scale and bias in theirs), None for inputs that do not require grad. Saves the inputs and the
    O(N*D) prologue outputs; the backward recomputes the tiles."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    @autocast_off
    def forward(ctx, image: Tensor, text: Tensor, scale, bias, normalize: bool, eps: float, offset: int,
                reduce: bool, weight: float):
        dt = TL.kernel_dtype(image, text)
        ctx.opts = (eps, offset, reduce, weight)
        ctx.numbers = (None if isinstance(scale, Tensor) else scale, None if isinstance(bias, Tensor) else bias)
        ctx.dtypes = (image.dtype, text.dtype,
                      (scale.dtype, scale.shape) if isinstance(scale, Tensor) else None,
                      (bias.dtype, bias.shape) if isinstance(bias, Tensor) else None)
        ctx.panel = use_panel_route(image, image.shape[0], text.shape[0], dt)
        ctx.eager = None
        if ctx.panel:
            x, y = TL._rows_ok(image.to(dt)), TL._rows_ok(text.to(dt))
            dev = x.device
            need_x, need_y = ctx.needs_input_grad[:2]
            need_s = isinstance(scale, Tensor) and ctx.needs_input_grad[2]
            need_b = isinstance(bias, Tensor) and ctx.needs_input_grad[3]
            if reduce and (need_x or need_y or need_s or need_b):
                # a summed loss: its upstream gradient is one scalar, so the sweep that forms the losses
                # forms the gradients for an upstream 1 too (MODE 5: 3 matmul units for the step, not 4)
                g = torch.full((x.shape[0],), float(weight), dtype=torch.float32, device=dev)
                loss, dx, dy, ds, db = triton_sweep.siglip_sweep(
                    TL._launch, x, y, TL._scale32(scale, dev), TL._scale32(bias, dev), normalize, eps, offset, g,
                    need_x, need_y, need_s or need_b, with_loss=True)
                ctx.eager = (dx, dy, ds if need_s else None, db if need_b else None)
            else:
                loss = triton_sweep.siglip_sweep(TL._launch, x, y, TL._scale32(scale, dev), TL._scale32(bias, dev),
                                                 normalize, eps, offset, None, False, False, False)[0]
            ctx.normalize = bool(normalize)
            ctx.save_for_backward(scale if isinstance(scale, Tensor) else None,
                                  bias if isinstance(bias, Tensor) else None, x, y)
            return loss.sum() * weight if reduce else loss
        loss, p = siglip_fwd(image.to(dt), text.to(dt), scale, bias, normalize, eps, offset)
        ctx.prep = p._replace(x=None, y=None, sx=None, sy=None)
        ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, bias if isinstance(bias, Tensor) else None,
                              p.x, p.y, p.sx, p.sy)
        return loss.sum() * weight if reduce else loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @autocast_off
    @first_order("TritonSigLipFn")
    def backward(ctx, go: Tensor):
        need_x, need_y, need_s, need_b = ctx.needs_input_grad[:4]
        eps, offset, reduce, weight = ctx.opts
        xdt, ydt, sdt, bdt = ctx.dtypes
        go = go.to(torch.float32)
        if ctx.eager is not None:
            # the forward's gradients for an upstream 1, times the upstream scalar (the buffers are ours and
            # dropped here: a second backward, retain_graph, recomputes below)
            dx, dy, ds, db = ctx.eager
            ctx.eager = None
            dx = dx.mul_(go.to(dx.dtype)) if dx is not None else None
            dy = dy.mul_(go.to(dy.dtype)) if dy is not None else None
            ds = ds * go if ds is not None else None
            db = db * go if db is not None else None
        elif ctx.panel:
            scale, bias, x, y = ctx.saved_tensors
            dev = x.device
            g = (go * weight).expand(x.shape[0]).contiguous() if reduce else go.contiguous()
            need_s, need_b = need_s and sdt is not None, need_b and bdt is not None
            _, dx, dy, ds, db = triton_sweep.siglip_sweep(
                TL._launch, x, y, TL._scale32(scale if scale is not None else ctx.numbers[0], dev),
                TL._scale32(bias if bias is not None else ctx.numbers[1], dev), ctx.normalize, eps, offset, g,
                need_x, need_y, need_s or need_b)
        else:
            scale, bias, x, y, sx, sy = ctx.saved_tensors
            p = ctx.prep._replace(x=x, y=y, sx=sx, sy=sy)
            g = (go * weight).expand(x.shape[0]).contiguous() if reduce else go.contiguous()
            dx, dy, ds, db = siglip_bwd(p, scale if scale is not None else ctx.numbers[0],
                                        bias if bias is not None else ctx.numbers[1], g, offset, eps, need_x,
                                        need_y, need_s and sdt is not None, need_b and bdt is not None)
        return (dx.to(xdt) if need_x else None, dy.to(ydt) if need_y else None,
                ds.to(sdt[0]).reshape(sdt[1]) if need_s and sdt is not None else None,
                db.to(bdt[0]).reshape(bdt[1]) if need_b and bdt is not None else None,
                None, None, None, None, None)
