"""Triton path of CoSENT: launchers and the two autograd Functions (device code in
``fused_contrastive.kernels.cosent``, whose docstring has the math).

Per step (forward + backward), embedding pairs [B, D] and labels [B]:

* ``torch.sort`` of the labels (one op: the permutation and the sorted labels);
* ``pair_cos_fwd``: the cosines and clamped norms, one pass over U and V (reads 2 B D elements);
* ``cosent_scan_fwd``: one program, the scaled cosines gathered in label order, the grouped prefix
  log-sum-exp and the loss (reads ~4 B values, writes B);
* ``cosent_scan_bwd``: one program, the reverse scan and dL/dx written in the original order;
* ``pair_cos_bwd``: dU, dV in one pass (reads 2 B D, writes 2 B D); dL/dscale is a dot in PyTorch
  when the scale is a tensor that requires grad.

Every launch goes through ``triton_shared/launch.py`` ``_launch`` (so the ahead-of-time compiles of the kernel
report and ``wrap_triton`` under tracing see them).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ...kernels import cosent as KCS
from ..triton_shared import launch as TL

#: Scores per block of the scan kernels. None: 1024 on a GPU, 64 under the interpreter (so test sizes
#: run the carried values across many blocks).
SCAN_BLOCK: int | None = None
PAIR_BLOCK_R = 16
PAIR_WARPS = 4
SCAN_WARPS = 4


def _scan_block() -> int:
    if SCAN_BLOCK is not None:
        return SCAN_BLOCK
    return 64 if TL.interpreted() else 1024


def _block_d(d: int) -> int:
    return max(16, min(128, triton.next_power_of_2(d)))


def _scale(scale, device) -> Tensor:
    return (scale.detach().to(device=device, dtype=torch.float32).reshape(1) if isinstance(scale, Tensor)
            else torch.full((1,), float(scale), dtype=torch.float32, device=device))


def pair_cos(u: Tensor, v: Tensor, normalize: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(cosines [B] fp32, clamped norms of u and v [B] fp32 (empty without ``normalize``))."""
    b, d = u.shape
    c = TL._alloc((b,), torch.float32, u.device)
    nu = TL._alloc((b if normalize else 0,), torch.float32, u.device)
    nv = TL._alloc((b if normalize else 0,), torch.float32, u.device)
    TL._launch(TL.Launch(
        "pair_cos_fwd", KCS.pair_cos_fwd_kernel, (triton.cdiv(b, PAIR_BLOCK_R),),
        dict(U=u, V=v, C=c, NU=nu, NV=nv, B=b, D=d, stride_u=u.stride(0), stride_v=v.stride(0), eps=float(eps)),
        dict(NORMALIZE=bool(normalize), BLOCK_R=PAIR_BLOCK_R, BLOCK_D=_block_d(d)), PAIR_WARPS, 1))
    return c, nu, nv


def pair_cos_backward(u: Tensor, v: Tensor, c: Tensor, nu: Tensor, nv: Tensor, dx: Tensor, s: Tensor,
                      normalize: bool, eps: float, need_u: bool, need_v: bool) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of u and v (their dtypes) for ``dx`` = dL/d(s c) [B] fp32."""
    b, d = u.shape
    gu = TL._alloc((b, d), u.dtype, u.device) if need_u else u.new_empty((1, d))
    gv = TL._alloc((b, d), v.dtype, v.device) if need_v else v.new_empty((1, d))
    TL._launch(TL.Launch(
        "pair_cos_bwd", KCS.pair_cos_bwd_kernel, (triton.cdiv(b, PAIR_BLOCK_R),),
        dict(U=u, V=v, C=c, NU=nu, NV=nv, DX=dx, S=s, GU=gu, GV=gv, B=b, D=d, stride_u=u.stride(0),
             stride_v=v.stride(0), stride_gu=gu.stride(0), stride_gv=gv.stride(0), eps=float(eps)),
        dict(NORMALIZE=bool(normalize), NEED_U=bool(need_u), NEED_V=bool(need_v), BLOCK_R=PAIR_BLOCK_R,
             BLOCK_D=_block_d(d)), PAIR_WARPS, 1))
    return (gu if need_u else None), (gv if need_v else None)


def scan_forward(x: Tensor, labels: Tensor, s: Tensor) -> tuple[Tensor, tuple]:
    """(loss 0-dim fp32, state) of CoSENT on the scaled scores ``s * x`` (x [B] fp32)."""
    ys, order = torch.sort(labels, stable=True)
    b = x.shape[0]
    z = TL._alloc((b,), torch.float32, x.device)
    loss = TL._alloc((), torch.float32, x.device)
    TL._launch(TL.Launch(
        "cosent_scan_fwd", KCS.cosent_scan_fwd_kernel, (1,),
        dict(X=x, ORDER=order, YS=ys, S=s, Z=z, LOSS=loss, B=b), dict(BLOCK_B=_scan_block()), SCAN_WARPS, 1))
    return loss, (order, ys, z, loss)


def scan_backward(x: Tensor, s: Tensor, state: tuple, g: Tensor) -> Tensor:
    """``g * dL/d(s x)`` [B] fp32 in the original order."""
    order, ys, z, loss = state
    b = x.shape[0]
    dx = TL._alloc((b,), torch.float32, x.device)
    TL._launch(TL.Launch(
        "cosent_scan_bwd", KCS.cosent_scan_bwd_kernel, (1,),
        dict(X=x, ORDER=order, YS=ys, S=s, Z=z, LOSS=loss, G=g.reshape(1).to(torch.float32), DX=dx, B=b),
        dict(BLOCK_B=_scan_block()), SCAN_WARPS, 1))
    return dx


def _scale_grad(gs: Tensor | None, scale) -> Tensor | None:
    return None if gs is None else gs.to(scale.dtype).reshape(scale.shape)


class TritonScoresCosentFn(torch.autograd.Function):
    """CoSENT of given scores [B] (float32 / float16 / bfloat16) on the scan kernels; fp32 loss."""

    @staticmethod
    @autocast_off
    def forward(ctx, scores: Tensor, labels: Tensor, scale):
        x = scores.to(torch.float32).contiguous()
        s = _scale(scale, scores.device)
        loss, state = scan_forward(x, labels, s)
        ctx.state, ctx.scale, ctx.dtype = state, scale, scores.dtype
        ctx.save_for_backward(x, s)
        return loss

    @staticmethod
    @autocast_off
    @first_order("TritonScoresCosentFn")
    def backward(ctx, g: Tensor):
        x, s = ctx.saved_tensors
        need_x, _, need_s = ctx.needs_input_grad[:3]
        dx = scan_backward(x, s, ctx.state, g)
        gs = torch.dot(dx, x) if need_s and isinstance(ctx.scale, Tensor) else None
        gx = (dx * s).to(ctx.dtype) if need_x else None
        return gx, None, _scale_grad(gs, ctx.scale)


class TritonPairCosentFn(torch.autograd.Function):
    """CoSENT on the cosines of pairs (u_i, v_i) on the Triton kernels; fp32 loss, gradients in each
    input's dtype."""

    @staticmethod
    @autocast_off
    def forward(ctx, u: Tensor, v: Tensor, labels: Tensor, scale, normalize: bool, eps: float):
        u = u if u.stride(1) == 1 else u.contiguous()  # the kernels read rows with unit stride
        v = v if v.stride(1) == 1 else v.contiguous()
        c, nu, nv = pair_cos(u, v, normalize, eps)
        s = _scale(scale, u.device)
        loss, state = scan_forward(c, labels, s)
        ctx.state, ctx.scale, ctx.normalize, ctx.eps = state, scale, normalize, eps
        ctx.save_for_backward(u, v, c, nu, nv, s)
        return loss

    @staticmethod
    @autocast_off
    @first_order("TritonPairCosentFn")
    def backward(ctx, g: Tensor):
        u, v, c, nu, nv, s = ctx.saved_tensors
        need_u, need_v, _, need_s = ctx.needs_input_grad[:4]
        dx = scan_backward(c, s, ctx.state, g)
        gs = torch.dot(dx, c) if need_s and isinstance(ctx.scale, Tensor) else None
        gu = gv = None
        if need_u or need_v:
            gu, gv = pair_cos_backward(u, v, c, nu, nv, dx, s, ctx.normalize, ctx.eps, need_u, need_v)
        return gu, gv, None, _scale_grad(gs, ctx.scale), None, None
