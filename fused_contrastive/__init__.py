"""fused-contrastive: contrastive losses (InfoNCE, SimCSE, CLIP, SupCon, DSCL, CoSENT) that never
materialise the N x M similarity matrix. See README.md for the API table."""

from . import nn
from .cosent import cosent_loss, cosent_loss_from_scores
from .encode import encode_in_chunks
from .losses import (
    clip_loss,
    dcl_loss,
    dclw_loss,
    dscl_loss,
    gist_loss,
    info_nce,
    simcse_loss,
    simcse_sup_loss,
    supcon_loss,
)
from .metrics import alignment, uniformity
from .siglip import siglip_loss

__version__ = "0.2.0"

__all__ = [
    "__version__",
    "alignment",
    "clip_loss",
    "cosent_loss",
    "cosent_loss_from_scores",
    "dcl_loss",
    "dclw_loss",
    "dscl_loss",
    "encode_in_chunks",
    "gist_loss",
    "info_nce",
    "nn",
    "siglip_loss",
    "simcse_loss",
    "simcse_sup_loss",
    "supcon_loss",
    "uniformity",
]
