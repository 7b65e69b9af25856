"""``torch.nn.Module`` wrappers of the losses: hold the options (including ``gather``), call the functional
form."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .cosent import cosent_loss
from .losses import clip_loss, dscl_loss, info_nce, simcse_loss, supcon_loss
from .siglip import siglip_loss


def _validated(fn, *args, **kw) -> None:
    """Run ``fn`` once on a tiny float64 CPU problem with the module's options (reference backend, no
    gather): a bad option raises here, at construction, with the functional form's own message."""
    kw = dict(kw, backend="reference", gather=False)
    fn(*args, **kw)


def _gather_option(gather) -> None:
    import torch.distributed as dist

    if not (gather is False or gather is None or gather is True or isinstance(gather, dist.ProcessGroup)):
        raise TypeError(f"gather must be False, True or a torch.distributed ProcessGroup, got {type(gather).__name__}")


def _x(*shape: int) -> Tensor:
    return torch.linspace(-1.0, 1.0, math.prod(shape), dtype=torch.float64).reshape(shape) + 0.1


__all__ = ["CLIPLoss", "CoSENTLoss", "DSCLLoss", "InfoNCELoss", "SigLIPLoss", "SimCSELoss", "SupConLoss"]


class InfoNCELoss(nn.Module):
    """Module form of :func:`fused_contrastive.info_nce`; ``forward(query, keys=None, target=None)``."""

    def __init__(self, temperature: float | None = None, *, scale: float | None = None,
                 exclude_self: bool | None = None, symmetric: bool = False, normalize: bool = True,
                 reduction: str = "mean", ignore_index: int = -100, backend: str = "auto", gather=False):
        super().__init__()
        self.kw = dict(temperature=temperature, scale=scale, exclude_self=exclude_self, symmetric=symmetric,
                       normalize=normalize, reduction=reduction, ignore_index=ignore_index, backend=backend,
                       gather=gather)
        _gather_option(gather)
        _validated(info_nce, _x(2, 2), _x(2, 2).flip(0), None if symmetric is True else torch.tensor([1, 0]),
                   **self.kw)

    def forward(self, query: Tensor, keys: Tensor | None = None, target: Tensor | None = None) -> Tensor:
        return info_nce(query, keys, target, **self.kw)


class SimCSELoss(nn.Module):
    """Module form of :func:`fused_contrastive.simcse_loss`; ``forward(z1, z2=None)``."""

    def __init__(self, temperature: float = 0.05, *, normalize: bool = True, reduction: str = "mean",
                 backend: str = "auto", gather=False):
        super().__init__()
        self.kw = dict(temperature=temperature, normalize=normalize, reduction=reduction, backend=backend,
                       gather=gather)
        _gather_option(gather)
        _validated(simcse_loss, _x(4, 2), **self.kw)

    def forward(self, z1: Tensor, z2: Tensor | None = None) -> Tensor:
        return simcse_loss(z1, z2, **self.kw)


class SupConLoss(nn.Module):
    """Module form of :func:`fused_contrastive.supcon_loss`;
    ``forward(features, labels=None, mask=None, queue=None, queue_labels=None)``."""

    def __init__(self, temperature=0.07, base_temperature=0.07, *, contrast_mode: str = "all",
                 variant: str = "out", normalize: bool = True, reduction: str = "mean", backend: str = "auto",
                 gather=False):
        super().__init__()
        self.kw = dict(temperature=temperature, base_temperature=base_temperature, contrast_mode=contrast_mode,
                       variant=variant, normalize=normalize, reduction=reduction, backend=backend, gather=gather)
        _gather_option(gather)
        _validated(supcon_loss, _x(2, 2, 2), torch.tensor([0, 0]), **self.kw)

    def forward(self, features: Tensor, labels: Tensor | None = None, mask: Tensor | None = None,
                queue: Tensor | None = None, queue_labels: Tensor | None = None) -> Tensor:
        return supcon_loss(features, labels, mask, queue=queue, queue_labels=queue_labels, **self.kw)


class DSCLLoss(nn.Module):
    """Module form of :func:`fused_contrastive.dscl_loss`;
    ``forward(features, labels, queue=None, queue_labels=None)``."""

    def __init__(self, beta: float = 8.0, temperature: float = 0.07, base_temperature: float | None = None, *,
                 normalize: bool = True, reduction: str = "mean", backend: str = "auto", gather=False):
        super().__init__()
        self.kw = dict(beta=beta, temperature=temperature, base_temperature=base_temperature, normalize=normalize,
                       reduction=reduction, backend=backend, gather=gather)
        _gather_option(gather)
        _validated(dscl_loss, _x(2, 2, 2), torch.tensor([0, 0]), **self.kw)

    def forward(self, features: Tensor, labels: Tensor, queue: Tensor | None = None,
                queue_labels: Tensor | None = None) -> Tensor:
        return dscl_loss(features, labels, queue=queue, queue_labels=queue_labels, **self.kw)


class CoSENTLoss(nn.Module):
    """Module form of :func:`fused_contrastive.cosent_loss`; ``forward(u, v, labels)``."""

    def __init__(self, scale: float = 20.0, *, normalize: bool = True, backend: str = "auto", gather=False):
        super().__init__()
        self.kw = dict(scale=scale, normalize=normalize, backend=backend, gather=gather)
        _gather_option(gather)
        _validated(cosent_loss, _x(2, 2), _x(2, 2).flip(0), torch.tensor([0.0, 1.0]), **self.kw)

    def forward(self, u: Tensor, v: Tensor, labels: Tensor) -> Tensor:
        return cosent_loss(u, v, labels, **self.kw)


class CLIPLoss(nn.Module):
    """CLIP loss with a learnable temperature: ``logit_scale`` (a parameter, initialised to
    ``log(1 / 0.07)``) is used as ``exp(logit_scale)``; ``forward(a, b)`` with a, b [N, D]."""

    def __init__(self, init_temperature: float = 0.07, *, normalize: bool = True, reduction: str = "mean",
                 backend: str = "auto", gather=False):
        super().__init__()
        if isinstance(init_temperature, bool) or not (isinstance(init_temperature, (int, float))
                                                      and 0 < init_temperature < math.inf):
            raise ValueError(f"init_temperature must be a finite number > 0, got {init_temperature!r}")
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / init_temperature)))
        self.kw = dict(normalize=normalize, reduction=reduction, backend=backend, gather=gather)
        _gather_option(gather)
        _validated(clip_loss, _x(2, 2), _x(2, 2).flip(0), 1.0 / init_temperature, **self.kw)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return clip_loss(a, b, self.logit_scale.exp(), **self.kw)


class SigLIPLoss(nn.Module):
    """SigLIP loss with a learnable scale and bias (the paper's initialisation by default): ``logit_scale``
    (a parameter, initialised to ``log(init_scale)``) is used as ``exp(logit_scale)`` and ``logit_bias``
    (a parameter, initialised to ``init_bias``) as is; ``forward(image, text)`` with image, text [N, D]
    calls :func:`fused_contrastive.siglip_loss`."""

    def __init__(self, init_scale: float = 10.0, init_bias: float = -10.0, *, normalize: bool = True,
                 reduction: str = "mean", backend: str = "auto", gather=False):
        super().__init__()
        if not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if not (isinstance(init_bias, (int, float)) and -math.inf < init_bias < math.inf):
            raise ValueError(f"init_bias must be a finite number, got {init_bias!r}")
        self.logit_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.logit_bias = nn.Parameter(torch.tensor(float(init_bias)))
        self.kw = dict(normalize=normalize, reduction=reduction, backend=backend, gather=gather)

    def forward(self, image: Tensor, text: Tensor) -> Tensor:
        return siglip_loss(image, text, self.logit_scale.exp(), self.logit_bias, **self.kw)
