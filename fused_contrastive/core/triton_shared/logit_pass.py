"""The one pass's third tile producer (``FUSED_CONTRASTIVE_PANEL_GEMM=fp16pass``, an untimed option): cuBLAS
cosines in fp16 from normalised fp16 copies, then one in-place Triton pass (``kernels/logit_pass.py``).

Where the one pass runs (``core/lse/triton_panel.py`` ``sweep``: a summed loss without a column term or a
softmax over positives, unit rows, bf16 operands), the epilogue GEMM's MODE 1 launch forms each panel's tile
``DL_ij = exp(l_ij - m) rb_j`` (bf16) and its per-row partials from the products in registers. This form
replaces that one launch by

1. ``cos = A_hat_P @ B_hat^T`` (``torch.mm``, fp16 operands and output, fp32 accumulation: cuBLAS's
   reduced-precision fp16 reductions are switched off around it) written into the panel's own [P, M]
   buffer, ``A_hat_P`` / ``B_hat`` the unit rows rounded to fp16 (B's once per sweep, the panel's per panel);
2. ``logit_pass_kernel``: over the same buffer, each cosine becomes ``e_ij rb_j`` in bf16, and the partials
   ``ZP / TP / MXP`` and the target's ``TV`` are written in MODE 1's format (the target column's logit from
   its fp32 cosine, ``target_cos``: not the rounded tile);

and everything after is the existing one-pass code (``panels._epi_panel``: ``epi_rows_kernel``, the MODE 2
redo of rows with ``z_i < 2^-64`` from the exact bf16 operands, the row weights; the gradient GEMMs on the
bf16 tile and the raw B, as before). Extra memory: ``B_hat`` (``2 M D`` bytes) and ``A_hat_P`` (``2 P D``),
counted in the panel height (:func:`panel_bytes`).

Precision: every logit but the target's is ``s`` times an fp16 cosine, ``|delta l| <= |s| 2^-11`` (MODE 1's is
exact in fp32); the bf16 tile's rounding (2^-9 relative) is the same in both forms. Where it applies: bf16
operands only (fp16's eager sweep has no one pass; fp32 keeps cuBLAS in fp32); elsewhere the setting
takes the default (``panels.use_epilogue``). No GPU has timed it (``bench/gpu.py`` FORMS ``gemm=fp16pass``)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...kernels import logit_pass as KLP
from ...routes import setting
from .configs import LOGIT_PASS_BLOCK_R, LOGIT_PASS_WARPS
from .launch import Launch, _row_norms
from .panels import NORM_CHUNK_ELEMENTS
from .target import target_cos

__all__ = ["Fp16Pass", "exact_fp16", "panel_bytes", "unit_fp16", "unit_rows_fp16", "use_fp16_pass"]


def use_fp16_pass(dt: torch.dtype) -> bool:
    """Whether a one-pass sweep with ``dt`` operands takes this form: env ``FUSED_CONTRASTIVE_PANEL_GEMM`` is
    "fp16pass" and the operands are bf16 (the one pass's 16-bit operand type)."""
    return setting("PANEL_GEMM") == "fp16pass" and dt == torch.bfloat16


def panel_bytes(m: int, d: int) -> tuple[int, int]:
    """``(fixed, per panel row)`` bytes this form adds to the panel's workspace: B's fp16 unit rows, the
    panel's."""
    return 2 * m * d, 2 * d


class exact_fp16:
    """Within the block, CUDA fp16 GEMMs accumulate in fp32 throughout (no reduced-precision split-K
    reductions); the global flag is put back afterwards."""

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.old = m.allow_fp16_reduced_precision_reduction
        m.allow_fp16_reduced_precision_reduction = False
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = self.old


def unit_fp16(xs: Tensor, rs: Tensor) -> Tensor:
    """The unit rows ``xs rs`` (``xs`` rows scaled by powers of two, ``rs`` their inverse clamped norms) in fp16,
    rounded once from fp32."""
    return (xs.float() * rs[:, None]).to(torch.float16)


def unit_rows_fp16(b: Tensor, eps: float) -> Tensor:
    """The unit rows ``b_j / max(||b_j||, eps)`` of ``b`` [M, D] in fp16 [M, D] (:func:`unit_fp16`), the row norms
    in chunks of at most ``NORM_CHUNK_ELEMENTS`` elements (the prologue's scaled copy of a chunk is a temporary)."""
    m, d = b.shape
    out = torch.empty((m, d), dtype=torch.float16, device=b.device)
    step = max(1, NORM_CHUNK_ELEMENTS // max(d, 1))
    for c0 in range(0, m, step):
        xs, _, _, rs = _row_norms(b[c0:c0 + step], eps)
        out[c0:c0 + step] = unit_fp16(xs, rs)
        del xs
    return out


class Fp16Pass:
    """One sweep's producer of the one-pass tiles (``panels._epi_panel``'s ``producer``): holds ``B_hat`` [M, D]
    fp16 (the unit rows of ``b``) and, per panel, writes the tile and the partials that the MODE 1 launch
    would (see the module docstring). ``a`` [N, D] and ``b`` [M, D] the sweep's raw operands, ``spec`` the core
    op's (unit rows), ``target`` [N] int64 each row's target column with SPLIT_T, else None."""

    def __init__(self, a: Tensor, b: Tensor, spec, target: Tensor | None):
        self.a, self.b, self.eps, self.target = a, b, float(spec.eps), target
        self.b_hat = unit_rows_fp16(b, spec.eps)

    def __call__(self, launch, x: Tensor, rs: Tensor, dl: Tensor, zp: Tensor, tp: Tensor, mxp: Tensor,
                 common: dict, flags: dict, margs: dict, r0: int, block_n: int) -> None:
        """The panel of rows ``[r0, r0 + P)``: ``x`` [P, D] its rows scaled by powers of two and ``rs`` their
        inverse norms (``_Problem.rows``), ``dl`` [P, M] bf16 the tile, ``zp / tp / mxp`` [P, cdiv(M, block_n)]
        the partials (``tp`` a dummy without NEED_DS), ``common`` / ``flags`` / ``margs`` the sweep's."""
        pp = x.shape[0]
        m = dl.shape[1]
        t16 = dl.view(torch.float16)  # the cosines land in the tile's own bytes
        with exact_fp16():
            torch.mm(unit_fp16(x, rs), self.b_hat.T, out=t16)
        split = bool(flags["SPLIT_T"])
        # the targets' fp32 cosines (with SPLIT_T; else a dummy: the kernel does not read it)
        ct = target_cos(self.a[r0:r0 + pp], self.b, self.target[r0:r0 + pp], self.eps, True) if split else zp
        launch(Launch(
            "logit_pass", KLP.logit_pass_kernel, (triton.cdiv(pp, LOGIT_PASS_BLOCK_R), triton.cdiv(m, block_n)),
            dict(T=t16, DL=dl, ZP=zp, TP=tp, MXP=mxp, TV=common["TV"], CT=ct, CTO=common["CT"], RB=common["RB"],
                 SCALE=common["SCALE"],
                 BIAS_COL=common["BIAS_COL"], TGT=common["TGT"], P=pp, M=m, r0=r0, stride_t=t16.stride(0),
                 stride_zp=zp.stride(0), offset=margs["offset"], bias=margs["bias"]),
            dict(BLOCK_R=LOGIT_PASS_BLOCK_R, BLOCK_N=block_n, EXCLUDE_SELF=flags["EXCLUDE_SELF"],
                 HAS_BIAS=flags["HAS_BIAS"], BIAS_COS=flags["BIAS_COS"], NEED_DS=flags["NEED_DS"],
                 FOLD_RB=flags["FOLD_RB"], SPLIT_T=split),
            LOGIT_PASS_WARPS, 1))
