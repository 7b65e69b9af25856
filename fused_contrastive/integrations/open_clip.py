"""Drop-in ``ClipLoss`` and ``SigLipLoss`` for open_clip training code (open-clip-torch 3.x), on this
library's core op and SigLIP kernels: the same constructor arguments, the same ``forward`` signature and
return contract, the same value and gradients, without the N x N logits.

Swap the import and nothing else::

    # from open_clip.loss import ClipLoss, SigLipLoss
    from fused_contrastive.integrations.open_clip import ClipLoss, SigLipLoss

open_clip's losses receive features its model has already L2-normalised, so these classes do not
normalise either (``normalize=False``): the logits are ``logit_scale * image @ text.T (+ logit_bias)``
exactly as open_clip forms them. This module never imports open_clip.

Under ``torch.distributed`` (``world_size > 1``) every combination of open_clip's options is reproduced
in value and gradient (the all-gather's backward sums every rank's gradient into the rows' owner, as
``torch.distributed.nn.all_gather`` does). open_clip assumes the same local batch size on every rank;
here unequal sizes also work, with the true row offsets, and a mean is then the global-batch mean
scaled by the world size, as the library's ``gather=`` contract says (docs/distributed.md):

* ``ClipLoss(local_loss=True, gather_with_grad=True)``: this rank's rows against every rank's columns,
  the library's ``gather=`` path (``clip_loss(..., gather=True)``);
* ``local_loss=True, gather_with_grad=False``: the same value, the gathered columns carry no gradient
  (only this rank's rows do);
* ``local_loss=False``: the whole global loss on every rank; with ``gather_with_grad=False`` only this
  rank's own slice of the gathered features carries a gradient.

``SigLipLoss``: every ``dist_impl`` ("bidir", "shift", "reduce", "gather") is one computation here: this
rank's images against every rank's texts, positives on this rank's diagonal block (``siglip_loss(...,
gather=True)``), with the texts' gradients summed back to their owners as open_clip's exchanges do.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import distributed as D
from ..losses import clip_loss, info_nce
from ..siglip import reference as _siglip_textbook
from ..siglip import siglip_loss

__all__ = ["ClipLoss", "SigLipLoss"]

_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


class _DistImplError(ValueError, AssertionError):
    """A ``dist_impl`` open_clip's ``SigLipLoss`` rejects: theirs asserts (``AssertionError``, no message),
    so this is an ``AssertionError`` as theirs and a ``ValueError`` naming the option."""


def _world(rank: int, world_size: int, cls: str) -> bool:
    """True when the loss is distributed (``world_size > 1``), after checking the arguments against the
    initialised default process group."""
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{cls}: {name} must be an int, got {type(v).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{cls}: need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
    if world_size == 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{cls}: world_size={world_size} needs torch.distributed initialised "
                         "(dist.init_process_group) before the forward")
    if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
        raise ValueError(f"{cls}: rank={rank}, world_size={world_size} disagree with torch.distributed "
                         f"(rank {dist.get_rank()} of {dist.get_world_size()})")
    return True


def _gathered(x: Tensor, with_grad: bool, keep_local: bool, name: str) -> tuple[Tensor, int]:
    """Every rank's ``x`` in rank order and this rank's offset. ``with_grad``: differentiable (the
    backward sums every rank's gradient into this rank's rows). Otherwise the gather carries no gradient,
    except, with ``keep_local``, through this rank's own slice (open_clip puts the local tensor back)."""
    if with_grad:
        rows, off, _ = D.gather_rows(x, name=name)
        return rows, off
    rows, off, _ = D.gather_rows(x.detach(), name=name)
    if keep_local:
        rows = torch.cat([rows[:off], x, rows[off + x.shape[0]:]])
    return rows, off


_WARNED: set[str] = set()


def _fused_scale(logit_scale, cls: str) -> bool:
    """Whether the fused losses take this ``logit_scale``: they need it > 0, as open_clip's trained scale
    always is; a number or CPU tensor <= 0 (or NaN) runs open_clip's formula instead (materialising the
    N x M logits), with a one-time warning. A CUDA tensor is not read (that would be a host sync per
    step): the fused op computes it as given."""
    if isinstance(logit_scale, Tensor) and logit_scale.device.type != "cpu":
        return True
    if not isinstance(logit_scale, (Tensor, int, float)) or isinstance(logit_scale, bool):
        return True  # the fused loss names the argument in its error
    if isinstance(logit_scale, Tensor) and logit_scale.numel() != 1:
        return True
    if float(logit_scale.detach() if isinstance(logit_scale, Tensor) else logit_scale) > 0:
        return True
    if cls not in _WARNED:
        _WARNED.add(cls)
        warnings.warn(f"{cls}: logit_scale={float(logit_scale)} is outside the fused losses (they need > 0), so "
                      "this call computes open_clip's formula on the materialised logits", stacklevel=3)
    return False


def _scalar(v):
    """open_clip's models keep ``logit_scale`` (and ``logit_bias``) as a one-element parameter, often of shape
    [1]: as open_clip's losses do, take it as the scalar it holds (a differentiable view)."""
    return v.reshape(()) if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == 1 else v


def _with_zero_grad(loss: Tensor, logit_bias) -> Tensor:
    """A bias added to every logit of a softmax row cancels: its gradient is exactly 0. Keep it in the
    graph (as open_clip's autograd does) so that an optimiser sees a zero gradient, not None. Only a
    scalar bias cancels: anything else raises (a per-column bias would change the loss)."""
    if isinstance(logit_bias, Tensor) and logit_bias.numel() != 1:
        raise ValueError(f"ClipLoss: logit_bias must be None, a number or a one-element tensor (a scalar "
                         f"cancels in the softmax), got shape {tuple(logit_bias.shape)}")
    if logit_bias is not None and not isinstance(logit_bias, (Tensor, int, float)):
        raise TypeError(f"ClipLoss: logit_bias must be None, a number or a tensor, got {type(logit_bias).__name__}")
    if isinstance(logit_bias, Tensor) and logit_bias.requires_grad:
        return loss + 0.0 * logit_bias.sum()
    return loss


class ClipLoss(nn.Module):
    """open_clip's ``ClipLoss``: ``(CE(l, labels) + CE(l_text, labels)) / 2`` with
    ``l = logit_scale * image @ text.T`` (features taken as given: open_clip's model normalised them).

    Args:
        local_loss: with ``world_size > 1``, this rank's rows against every rank's columns (True) or
            the whole global batch on every rank (False, default).
        gather_with_grad: with ``world_size > 1``, whether the gathered features carry gradients.
        cache_labels: accepted for compatibility; no labels are materialised here, so it has no effect.
        rank, world_size: this process's rank and the number of processes (they must match the
            initialised ``torch.distributed`` default group when ``world_size > 1``).
        use_horovod: not supported (``ValueError``); use torch.distributed.

    ``forward(image_features [N, D], text_features [N, D], logit_scale, logit_bias=None,
    output_dict=False)``: ``logit_scale`` a float or 0-dim tensor (already exponentiated; one <= 0 runs
    open_clip's formula on the materialised logits, with a one-time warning), the
    optional ``logit_bias`` cancels in the softmax (its gradient is 0). Returns the 0-dim loss (float32,
    float64 for float64 features) or ``{"contrastive_loss": loss}``. Runs ``backend="auto"``.
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False, cache_labels: bool = False,
                 rank: int = 0, world_size: int = 1, use_horovod: bool = False):
        super().__init__()
        if use_horovod:
            raise ValueError("ClipLoss: use_horovod=True is not supported; use torch.distributed "
                             "(the default, use_horovod=False)")
        self.local_loss = bool(local_loss)
        self.gather_with_grad = bool(gather_with_grad)
        self.cache_labels = bool(cache_labels)
        self.rank = rank
        self.world_size = world_size
        self.use_horovod = False
        _world(rank, world_size, "ClipLoss")  # argument types and ranges now; the group at forward

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale, logit_bias=None,
                output_dict: bool = False):
        distributed = _world(self.rank, self.world_size, "ClipLoss")
        logit_scale = _scalar(logit_scale)
        if not _fused_scale(logit_scale, "ClipLoss"):
            loss = self._textbook(image_features, text_features, logit_scale, distributed)
        elif distributed:
            loss = self._distributed(image_features, text_features, logit_scale)
        else:
            loss = clip_loss(image_features, text_features, logit_scale, normalize=False)
        loss = _with_zero_grad(loss, logit_bias)
        return {"contrastive_loss": loss} if output_dict else loss

    def _textbook(self, img: Tensor, txt: Tensor, s, distributed: bool) -> Tensor:
        """open_clip's computation (for a scale the fused losses do not take): the logits materialised,
        the features gathered as open_clip gathers them for each combination of options."""
        off = 0
        rows_img, rows_txt, all_img, all_txt = img, txt, img, txt
        if distributed:
            keep = not self.local_loss
            all_img, off = _gathered(img, self.gather_with_grad, keep, "image_features")
            all_txt, _ = _gathered(txt, self.gather_with_grad, keep, "text_features")
            if not self.local_loss:  # the global batch on every rank
                rows_img, rows_txt, off = all_img, all_txt, 0
        target = torch.arange(rows_img.shape[0], device=img.device) + off
        row = F.cross_entropy(s * rows_img @ all_txt.T, target)
        col = F.cross_entropy(s * rows_txt @ all_img.T, target)
        return (row + col) / 2

    def _distributed(self, img: Tensor, txt: Tensor, s) -> Tensor:
        if self.local_loss and self.gather_with_grad:
            return clip_loss(img, txt, s, normalize=False, gather=True)
        if self.local_loss:  # the gathered columns carry no gradient at all
            all_img, off = _gathered(img, False, False, "image_features")
            all_txt, _ = _gathered(txt, False, False, "text_features")
            target = torch.arange(img.shape[0], device=img.device) + off
            kw = dict(target=target, scale=s, exclude_self=False, normalize=False)
            return (info_nce(img, all_txt, **kw) + info_nce(txt, all_img, **kw)) / 2
        all_img, _ = _gathered(img, self.gather_with_grad, True, "image_features")
        all_txt, _ = _gathered(txt, self.gather_with_grad, True, "text_features")
        return clip_loss(all_img, all_txt, s, normalize=False)


class SigLipLoss(nn.Module):
    """open_clip's ``SigLipLoss``: ``-(1/N) sum_ij log sigmoid(y_ij (logit_scale <x_i, t_j> + logit_bias))``
    with ``y_ij = +1`` on the pairs and -1 elsewhere, over this rank's N images and (distributed) every
    rank's texts; features taken as given (open_clip's model normalised them).

    Args:
        cache_labels: accepted for compatibility (no labels are materialised; no effect).
        rank, world_size: as for :class:`ClipLoss`.
        dist_impl: None (open_clip's default, "bidir"), "bidir", "shift", "reduce" or "gather": open_clip's
            ways of passing texts between ranks. All give the same value and gradients, which is what
            this class computes (one all-gather of the texts, its backward summing into their owners).

    ``forward(image_features [N, D], text_features [N, D], logit_scale, logit_bias, output_dict=False)``:
    ``logit_scale`` a positive float or 0-dim tensor (already exponentiated), ``logit_bias`` a float, a
    0-dim tensor or None (no bias). Returns the 0-dim loss or ``{"contrastive_loss": loss}``. Runs
    ``siglip_loss(..., normalize=False, backend="auto")``.
    """

    def __init__(self, cache_labels: bool = False, rank: int = 0, world_size: int = 1, dist_impl: str | None = None):
        super().__init__()
        impl = dist_impl or "bidir"  # as theirs: any false value is the default
        if impl not in _DIST_IMPLS:
            raise _DistImplError(f"SigLipLoss: dist_impl must be None or one of {_DIST_IMPLS}, got {dist_impl!r}")
        self.cache_labels = bool(cache_labels)
        self.rank = rank
        self.world_size = world_size
        self.dist_impl = impl
        _world(rank, world_size, "SigLipLoss")

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale, logit_bias,
                output_dict: bool = False):
        gather = _world(self.rank, self.world_size, "SigLipLoss")
        logit_scale = _scalar(logit_scale)
        bias = 0.0 if logit_bias is None else _scalar(logit_bias)
        if not _fused_scale(logit_scale, "SigLipLoss"):  # open_clip's formula on the materialised logits
            txt, off = _gathered(text_features, True, True, "text_features") if gather else (text_features, 0)
            loss = _siglip_textbook(image_features, txt, logit_scale, bias, False, "mean", offset=off)
        else:
            loss = siglip_loss(image_features, text_features, logit_scale, bias, normalize=False, gather=gather)
        return {"contrastive_loss": loss} if output_dict else loss
