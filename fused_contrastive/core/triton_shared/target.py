"""Launchers of the target term's row kernel (``kernels/target.py``): the triton backend's
``TGT_i = s <a_i, b_{t_i}>`` and its backward in two O(N*D) kernels (``positives.LinearTermsFn``
takes them when the core op runs on the triton backend without a SET term)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...kernels import target as KT
from .configs import TARGET_BLOCK_R, TARGET_MAX_BLOCK_D, TARGET_WARPS, d_pad
from .launch import Launch, _alloc, _launch

__all__ = ["target_backward", "target_cos"]


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _run(a: Tensor, b: Tensor, t: Tensor, h: Tensor | None, eps: float, normalize: bool, acc: Tensor | None = None):
    a, b = _rows(a), _rows(b)
    n, d = a.shape
    dev = a.device
    cos = _alloc((n,), torch.float32, dev)
    bwd = h is not None
    da = (_alloc((n, d), torch.float32, dev) if acc is None else acc) if bwd else cos
    db = _alloc((n, d), torch.float32, dev) if bwd else cos
    _launch(Launch("target_rows", KT.target_rows_kernel, (triton.cdiv(n, TARGET_BLOCK_R),),
                   dict(A=a, B=b, TGT=t, H=h if bwd else cos, COS=cos, DA=da, DB=db, N=n, D=d,
                        stride_a=a.stride(0), stride_b=b.stride(0), stride_da=da.stride(0) if bwd else 0,
                        stride_db=db.stride(0) if bwd else 0, eps=float(eps)),
                   dict(BLOCK_R=TARGET_BLOCK_R, BLOCK_D=min(d_pad(d), TARGET_MAX_BLOCK_D), NORMALIZE=bool(normalize),
                        BWD=bwd, ACC=acc is not None),
                   TARGET_WARPS, 1))
    return cos, (da if bwd else None), (db if bwd else None)


def target_cos(a: Tensor, b: Tensor, t: Tensor, eps: float, normalize: bool) -> Tensor:
    """``c_i = <a_i, b_{t_i}>`` of the unit rows (raw rows without ``normalize``), fp32 [N]. ``a`` [N, D],
    ``b`` [M, D] (a itself when B is A), ``t`` [N] target rows of b."""
    return _run(a, b, t, None, eps, normalize)[0]


def target_backward(a: Tensor, b: Tensor, t: Tensor, h: Tensor, eps: float, normalize: bool,
                    acc: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(c, dA, dBrows)``: ``c`` as :func:`target_cos`, ``dA`` [N, D] fp32 the gradient of ``sum_i h_i c_i``
    with respect to ``a`` (``h`` [N] fp32), ``dBrows`` [N, D] fp32 row i's part of the gradient of the row
    ``t_i`` of ``b`` (the caller adds it there: ``index_add_``). ``acc``: an fp32 [N, D] gradient of ``a``
    (row-contiguous) that dA is added to in place and returned as ``dA``."""
    return _run(a, b, t, h.contiguous(), eps, normalize, acc)
