"""SigLIP's pairwise sigmoid loss (Zhai et al. 2023) without the N x N logits.

``backend="torch"`` is the chunked PyTorch path of ``core/siglip/torch_siglip.py`` (O(N*D) memory, any device);
``backend="triton"`` the fused kernels of ``core/siglip/triton_siglip.py`` (CUDA, or CPU under
``TRITON_INTERPRET=1``); ``backend="reference"`` the textbook formula on the materialised logits
(:func:`reference`, the test oracle). ``"auto"`` chooses like every other loss (``_backend.resolve``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _validate as V
from . import distributed as D
from . import ops
from ._amp import autocast_off
from ._backend import resolve
from .core import reference as ref
from .core.siglip.torch_siglip import SigLipFn
from .core.spec import compute_dtype, graph_free

__all__ = ["siglip_loss"]

_EPS = 1e-12


def _finite(name: str, v, *, positive: bool, device: torch.device):
    """A finite number (``> 0`` when ``positive``) or a 0-dim floating tensor (value checked on the CPU)."""
    if positive:
        return V.positive_number(name, v, device=device)
    out = V.number(name, v, low=-math.inf, strict=False, allow_tensor=True)
    if not isinstance(out, Tensor):
        if not (-math.inf < out < math.inf):
            raise ValueError(f"{name} must be finite, got {out}")
    elif out.device != device and out.device.type != "cpu":
        raise ValueError(f"{name} is on {out.device} but the embeddings are on {device}")
    return out


def reference(image: Tensor, text: Tensor, logit_scale, logit_bias, normalize: bool, reduction: str,
              offset: int = 0) -> Tensor:
    """The textbook formula on the materialised [N, M] logits: ``-sum_j logsigmoid(label_ij z_ij)`` per
    row, the positive of row i at column ``offset + i`` (computes in float32, float64 for float64 inputs,
    or the dtype of ``core.reference.computing_in``)."""
    dt = ref._dt(image, text)
    x = ref._unit(image, normalize, dt)
    y = ref._unit(text, normalize, dt)
    logits = ref._scalar(logit_scale, dt) * (x @ y.T) + ref._scalar(logit_bias, dt)
    n, m = logits.shape
    labels = -torch.ones(n, m, dtype=dt, device=logits.device)
    rows = torch.arange(n, device=logits.device)
    inside = (rows + offset >= 0) & (rows + offset < m)
    labels[rows[inside], rows[inside] + offset] = 1.0
    per = -F.logsigmoid(labels * logits).sum(dim=1)
    if reduction == "none":
        return per
    return per.sum() / n if reduction == "mean" else per.sum()


def _per_rank(out: Tensor, reduction: str, n_total: int, world: int) -> Tensor:
    """Under ``gather``: the local per-row losses, or the local sum scaled so that the average over ranks
    is the global loss (``world / N_global`` for a mean, ``world`` for a sum)."""
    if reduction == "none":
        return out
    out = out.sum() if out.dim() else out
    return out * (world / n_total) if reduction == "mean" else out * world


@D.agreed
@autocast_off
def siglip_loss(image: Tensor, text: Tensor, logit_scale, logit_bias=None, *, normalize: bool = True,
                reduction: str = "mean", gather=False, backend: str = "auto") -> Tensor:
    """SigLIP's sigmoid loss: ``-(1/N) sum_ij log sigmoid(label_ij (s <x_i, y_j> + b))`` with
    ``label_ij = +1`` for the pair (i == j) and -1 otherwise, without materialising the N x N logits.

    Args:
        image: [N, D] image embeddings (float16 / bfloat16 / float32 / float64).
        text: [N, D] text embeddings; pair i is (image_i, text_i).
        logit_scale: s, the multiplier of the cosines, already exponentiated (open_clip passes
            ``logit_scale.exp()``): a finite float > 0 or a 0-dim tensor (differentiable; its value is
            checked on the CPU only).
        logit_bias: b, a finite float (any sign; SigLIP initialises it to -10) or a 0-dim tensor
            (differentiable); None (the default): no bias, as open_clip's ``SigLipLoss`` without one.
        normalize: L2-normalise rows first (``x / max(||x||, 1e-12)``, overflow-free). False uses the
            raw dot products (open_clip's ``SigLipLoss`` receives already normalised features).
        reduction: ``"mean"`` (default: the sum over all N x N terms divided by N, the number of images,
            as open_clip and the paper normalise; not by N^2), ``"sum"``, or ``"none"`` ([N] per-image
            losses ``sum_j softplus(-label_ij z_ij)``).
        gather: False, True (the default process group) or a ProcessGroup: this rank's images against
            every rank's texts (gathered with gradients), positives at this rank's row offset; a mean
            returns the local sum times ``world / N_global`` (so the average over ranks, which DDP's
            gradient averaging takes, is the global-batch loss), a sum the local sum times ``world``,
            ``"none"`` the local rows' losses.
        backend: ``"auto"`` / ``"torch"`` (chunked, O(N*D) memory) / ``"triton"`` / ``"reference"``.

    Returns:
        0-dim loss (mean / sum) or [N] per-image losses, float32 (float64 for float64 inputs).
        Gradients come back in each input's dtype.
    """
    image = V.embeddings("image", image)
    text = V.paired("image", image, "text", text)
    reduction = V.reduction(reduction)
    V.flag("normalize", normalize)
    dev = image.device
    dt = compute_dtype(image, text)
    s = _finite("logit_scale", logit_scale, positive=True, device=dev)
    b = _finite("logit_bias", 0.0 if logit_bias is None else logit_bias, positive=False, device=dev)
    s = s.to(device=dev, dtype=dt) if isinstance(s, Tensor) else s
    b = b.to(device=dev, dtype=dt) if isinstance(b, Tensor) else b
    be = resolve(backend, image, text)  # op "core": the SigLIP kernels ship beside the core kernels
    grp = D.process_group(gather)
    n = image.shape[0]
    off, n_total, world = 0, n, 1
    if grp is not None:
        D.agree(grp, scale=s)
        text, off, sizes = D.gather_rows(text, grp, name="text")
        n_total, world = sum(sizes), D.world_size(grp)
    if be == "reference":
        out = reference(image, text, s, b, normalize, "none" if grp is not None else reduction, offset=off)
    else:
        keep = reduction != "none"
        # a mean is the sum with weight 1/N; under torch.compile the weight is 1 and the sum is divided
        # afterwards (a weight 1/N would be a constant of the compiled graph: one recompile per N)
        per_n = reduction == "mean" and grp is None and not ops.tracing_route()
        weight = 1.0 / n if per_n else 1.0
        if be == "triton":
            from .core.siglip.triton_siglip import TritonSigLipFn as fn
        else:
            fn = SigLipFn
        if ops.tracing_route():  # torch.compile / export: one opaque operator (no guard on N)
            out = ops.siglip(image, text, s, b, normalize, _EPS, off, keep, weight, be)
        else:
            out = fn.apply(*graph_free(image, text, s, b), normalize, _EPS, off, keep, weight)
        if grp is None:
            return out / n if (reduction == "mean" and not per_n) else out
    return _per_rank(out, reduction, n_total, world) if grp is not None else out
