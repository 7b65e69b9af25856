"""SigLIP's pairwise sigmoid loss (Zhai et al. 2023) without the N x N logits.

``backend="torch"`` is the chunked PyTorch path of ``core/siglip/torch_siglip.py`` (O(N*D) memory, any device);
``backend="triton"`` the fused kernels of ``core/siglip/triton_siglip.py`` (CUDA, or CPU under
``TRITON_INTERPRET=1``); ``backend="reference"`` the textbook formula on the materialised logits
(:func:`reference`, the test oracle). ``"auto"`` chooses like every other loss (``_backend.resolve``).
Group positives (``image_groups`` / ``text_groups``): every backend's loss with every pair a negative plus
``core.siglip.torch_siglip.positives_correction`` over the positive pairs (``ops.siglip_groups`` under tracing).
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
from .core.siglip.torch_siglip import SigLipFn, positives_correction
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
              offset: int = 0, groups: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """The textbook formula on the materialised [N, M] logits: ``-sum_j v_ij logsigmoid(label_ij z_ij)`` per
    row, the positive of row i at column ``offset + i`` and ``v = 1`` (computes in float32, float64 for
    float64 inputs, or the dtype of ``core.reference.computing_in``). ``groups``: ``(image_groups [N],
    text_groups [M], every image's groups)``: label +1 where the groups are equal, weighted
    ``v_ij = 1 / (2 k_i) + 1 / (2 k'_j)`` (``k_i`` the texts in image i's group, ``k'_j`` the images, of
    every rank, in text j's group); 1 on negatives."""
    dt = ref._dt(image, text)
    x = ref._unit(image, normalize, dt)
    y = ref._unit(text, normalize, dt)
    logits = ref._scalar(logit_scale, dt) * (x @ y.T) + ref._scalar(logit_bias, dt)
    n, m = logits.shape
    if groups is not None:
        ig, tg, ig_all = groups
        pos = ig[:, None] == tg[None, :]
        k_row = (ig[:, None] == tg[None, :]).sum(1).to(dt)
        k_col = (ig_all[:, None] == tg[None, :]).sum(0).to(dt)
        v = torch.where(pos, 0.5 / k_row[:, None] + 0.5 / k_col[None, :], torch.ones_like(logits))
        labels = torch.where(pos, 1.0, -1.0).to(dt)
        per = -(v * F.logsigmoid(labels * logits)).sum(dim=1)
        if reduction == "none":
            return per
        return per.sum() / n if reduction == "mean" else per.sum()
    labels = -torch.ones(n, m, dtype=dt, device=logits.device)
    rows = torch.arange(n, device=logits.device)
    inside = (rows + offset >= 0) & (rows + offset < m)
    labels[rows[inside], rows[inside] + offset] = 1.0
    per = -F.logsigmoid(labels * logits).sum(dim=1)
    if reduction == "none":
        return per
    return per.sum() / n if reduction == "mean" else per.sum()


def _groups(name: str, g, rows: int, device: torch.device) -> Tensor:
    """Integer group ids, one per row ([rows], on the embeddings' device) as int64."""
    if not isinstance(g, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer group ids, got {type(g).__name__}")
    if g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer group ids, got {g.dtype}")
    if g.dim() != 1 or g.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}] (one id per row), got {tuple(g.shape)}")
    if g.device != device:
        raise ValueError(f"{name} is on {g.device} but the embeddings are on {device}")
    return g.long()


def _per_rank(out: Tensor, reduction: str, n_total: int, world: int) -> Tensor:
    """Under ``gather``: the local per-row losses, or the local sum scaled so that the average over ranks
    is the global loss (``world / N_global`` for a mean, ``world`` for a sum)."""
    if reduction == "none":
        return out
    out = out.sum() if out.dim() else out
    return out * (world / n_total) if reduction == "mean" else out * world


@D.agreed
@autocast_off
def siglip_loss(image: Tensor, text: Tensor, logit_scale, logit_bias=None, *, image_groups: Tensor | None = None,
                text_groups: Tensor | None = None, normalize: bool = True, reduction: str = "mean", gather=False,
                backend: str = "auto") -> Tensor:
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
        image_groups / text_groups: None (default: pair i is (image_i, text_i)) or integer group ids, [N] and
            [M], given together; then ``text`` may have M != N rows and every pair sharing a group id is a
            positive, weighted as siglip-kernel's SigLIP+: ``-(1/N) sum_ij v_ij log sigmoid(label_ij z_ij)``
            with ``v_ij = 1 / (2 k_i) + 1 / (2 k'_j)`` on positives (``k_i``: texts in image i's group,
            ``k'_j``: images in text j's group, over every rank under ``gather``) and 1 on negatives (an
            image whose group has no text has only negatives). Unique ids on both sides give the plain
            loss. Computed as the loss with every pair a negative (the backend's kernels) plus, over the P
            positive pairs, ``v softplus(-z) - softplus(z)`` (O(P D) PyTorch with autograd; counting P is one
            host sync). siglip-kernel's ``fused_siglip_plus_loss`` divides the same sum by N M.

    Returns:
        0-dim loss (mean / sum) or [N] per-image losses, float32 (float64 for float64 inputs).
        Gradients come back in each input's dtype.
    """
    image = V.embeddings("image", image)
    grouped = image_groups is not None or text_groups is not None
    if grouped:
        if image_groups is None or text_groups is None:
            raise ValueError(f"{'text_groups' if text_groups is None else 'image_groups'} is None but "
                             f"{'image_groups' if text_groups is None else 'text_groups'} is given: pass both "
                             "(integer group ids of the images and of the texts) or neither")
        text = V.embeddings("text", text)
        V.same_dim("image", image, "text", text)
        V.same_device(image=image, text=text)
        V.same_precision("image", image, "text", text)
        image_groups = _groups("image_groups", image_groups, image.shape[0], image.device)
        text_groups = _groups("text_groups", text_groups, text.shape[0], image.device)
    else:
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
    ig_all = image_groups
    if grp is not None:
        D.agree(grp, scale=s)
        text, off, sizes = D.gather_rows(text, grp, name="text")
        world = D.world_size(grp)
        if grouped:  # the positives' weights count every rank's texts and images
            text_groups = D.gather_rows(text_groups, grp, name="text_groups")[0]
            ig_all = D.gather_rows(image_groups, grp, name="image_groups")[0]
            n_total = ig_all.shape[0]
        else:
            n_total = sum(sizes)
    groups = (image_groups, text_groups, ig_all) if grouped else None
    if be == "reference":
        out = reference(image, text, s, b, normalize, "none" if grp is not None else reduction, offset=off,
                        groups=groups)
    else:
        if grouped:  # every pair a negative in the kernels (no column is row i's offset + i), positives after
            off = text.shape[0]
            if ops.tracing_route():  # torch.compile / export: its pair count is data-dependent (one opaque op)
                corr = ops.siglip_groups(image, text, s, b, normalize, image_groups, text_groups, ig_all)
            else:
                corr = positives_correction(*graph_free(image, text, s, b), normalize, image_groups, text_groups,
                                            ig_all)
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
        if grouped:
            out = out + (corr.sum() * weight if keep else corr)
        if grp is None:
            return out / n if (reduction == "mean" and not per_n) else out
    return _per_rank(out, reduction, n_total, world) if grp is not None else out
