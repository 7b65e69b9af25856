"""SigLIP's sweeps in the fp16 pass form (``FUSED_CONTRASTIVE_SIGLIP_EPILOGUE=fp16pass``, an untimed option):
cuBLAS cosines in fp16 from normalised fp16 copies, then one in-place Triton pass per panel
(``kernels/logit_pass.py`` ``siglip_pass_kernel``) in place of the epilogue GEMM's MODE 4 / 5 launch.

Per panel of rows ``[r0, r0 + P)`` of :func:`triton_sweep.siglip_sweep` (every sweep: the forward's per-image
losses, the gradient sweep of per-row upstream gradients, the one pass of a summed loss):

1. ``cos = A_hat_P @ B_hat^T`` (``torch.mm``, fp16 operands and output, fp32 accumulation: cuBLAS's
   reduced-precision fp16 reductions are switched off around it, ``triton_shared.logit_pass.exact_fp16``)
   written into the panel's own 16-bit [P, M] buffer (the gradient tile's), ``A_hat_P`` / ``B_hat`` the unit rows
   rounded once to fp16 (B's once per sweep, or the sweep's own normalised fp16 copy where fp16 operands have
   one; the panel's per panel);
2. the positive pairs' cosines in fp32 (``triton_shared.target.target_cos``: row i and column ``offset + i``,
   for the panel's rows whose positive lies in ``[0, M)``), so the positive pair's loss and gradient keep fp32
   accuracy;
3. ``siglip_pass_kernel`` reads each cosine once: ``z = s cos + b`` (the positive's from its fp32 cosine), the
   loss partials ``sum_j softplus(-y_ij z_ij)`` (fp32, ``kernels/common.py``'s exact ``_softplus``: finite and
   saturation-safe for any finite z) and, with upstream gradients, ``dz = -y sigmoid(-y z) g_i / gscale``
   (``_dz``) written back over the cosine in the operands' 16-bit dtype (times the fp16 pre-scale 2^13, and
   B's inverse norm folded for bf16: MODE 5's tile exactly) with the row sums of ``dz cos`` and ``dz`` (ds, db);

and everything after is the sweep's existing code: ``dA = dZ @ B`` and ``dB += dZ^T @ A_hat`` by cuBLAS and the
normalisation backward (``panels._panel_gemms``, ``panels._db_from_acc``).

Supported: what the MODE 4 / 5 route supports with normalised rows: bf16 and fp16 operands, positives at
column ``offset + i`` (any offset: ``gather=``'s, and group positives' out-of-range one, where every pair is a
negative and the positives' correction is added by ``siglip.py``), numbers or learnable tensors for the scale
and the bias, summed or per-row losses. Raw rows (``normalize=False``: a raw dot product may overflow fp16)
and fp32 operands (fp32 cosines would be rounded) take MODE 4 / 5 under this setting (:func:`use_fp16_pass`).

Precision: every logit but the positive's is ``s`` times an fp16 cosine, ``|delta z| <= |s| 2^-11`` (the fp16
rounding of the output, half an ulp of ``2^-10`` below 1, plus the copies' rounding); MODE 4 / 5's are exact in
fp32. The gradient tile's rounding to 16 bits is the same in both. Extra memory: ``B_hat`` (``2 M D`` bytes) and
``A_hat_P`` (``2 P D``), counted in the panel height (``logit_pass.panel_bytes``). No GPU has timed it
(``bench/gpu.py`` FORMS ``siglip=fp16pass``)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...kernels import logit_pass as KLP
from ...routes import setting
from ..triton_shared.configs import LOGIT_PASS_BLOCK_R, LOGIT_PASS_WARPS
from ..triton_shared.launch import Launch
from ..triton_shared.logit_pass import exact_fp16, unit_fp16, unit_rows_fp16
from ..triton_shared.target import target_cos

__all__ = ["SigLipFp16Pass", "use_fp16_pass"]


def use_fp16_pass(dt: torch.dtype, normalize: bool) -> bool:
    """Whether a SigLIP sweep with ``dt`` operands takes this form: the switchboard's ``SIGLIP_EPILOGUE`` is
    "fp16pass", the rows are normalised and the operands 16-bit (bf16 or fp16)."""
    return (setting("SIGLIP_EPILOGUE") == "fp16pass" and bool(normalize)
            and dt in (torch.bfloat16, torch.float16))


class SigLipFp16Pass:
    """One sweep's producer of SigLIP's panel outputs: ``x`` [N, D] and ``y`` [M, D] the sweep's raw rows (16-bit),
    ``b_op`` the sweep's gradient operand for B (``panels._Problem.b_op``: fp16 operands' normalised copy, reused as
    ``B_hat`` when it is one), ``eps`` the norms' clamp, ``offset`` the column of row 0's positive."""

    def __init__(self, x: Tensor, y: Tensor, b_op: Tensor, eps: float, offset: int):
        self.x, self.y, self.eps, self.offset = x, y, float(eps), int(offset)
        reuse = b_op is not y and b_op.dtype == torch.float16
        self.b_hat = b_op if reuse else unit_rows_fp16(y, eps)

    def positives(self, r0: int, r1: int) -> Tensor:
        """[r1 - r0] fp32: the fp32 cosine of row i and its positive column ``offset + i`` where that lies in
        ``[0, M)``, else 0 (the kernel reads it only at the positive's column)."""
        m = self.y.shape[0]
        ct = torch.zeros(r1 - r0, dtype=torch.float32, device=self.x.device)
        lo, hi = max(r0, -self.offset), min(r1, m - self.offset)
        if hi > lo:
            t = torch.arange(lo + self.offset, hi + self.offset, dtype=torch.int64, device=self.x.device)
            ct[lo - r0:hi - r0] = target_cos(self.x[lo:hi], self.y, t, self.eps, True)
        return ct

    def __call__(self, launch, xp: Tensor, rs: Tensor, buf: Tensor, r0: int, zp: Tensor, tp: Tensor, bp: Tensor,
                 args: dict, const: dict) -> None:
        """The panel of rows ``[r0, r0 + P)``: ``xp`` [P, D] its rows scaled by powers of two and ``rs`` their
        inverse norms (``_Problem.rows``), ``buf`` [P, M] 16-bit (the gradient tile with upstream gradients, else a
        scratch of the same size), ``zp / tp / bp`` [P, cdiv(M, BLOCK_N)] row-major the partials (dummies where
        not written); ``args`` the pointers ``RB``, ``SCALE``, ``LBIAS``, ``G``, ``GSCALE`` and ``const`` the flags
        ``BLOCK_N``, ``WANT_LOSS``, ``HAS_G``, ``NEED_DS``, ``FOLD_RB``, ``PRESCALE``."""
        pp, m = buf.shape
        n_pn = triton.cdiv(m, const["BLOCK_N"])
        t16 = buf.view(torch.float16)  # the cosines land in the tile's own bytes
        with exact_fp16():
            torch.mm(unit_fp16(xp, rs), self.b_hat.T, out=t16)
        ct = self.positives(r0, r0 + pp)
        launch(Launch(
            "siglip_pass", KLP.siglip_pass_kernel,
            (triton.cdiv(pp, LOGIT_PASS_BLOCK_R), n_pn),
            dict(T=t16, DL=buf, ZP=zp, TP=tp, BP=bp, CT=ct, **args, P=pp, M=m, r0=r0, stride_t=t16.stride(0),
                 stride_zp=n_pn, offset=self.offset),
            dict(const, BLOCK_R=LOGIT_PASS_BLOCK_R), LOGIT_PASS_WARPS, 1))
