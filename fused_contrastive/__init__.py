"""fused-contrastive: contrastive losses (InfoNCE, SimCSE, CLIP, SupCon, DSCL, CoSENT) that never
materialise the N x M similarity matrix. See README.md for the API table."""

from . import nn
from .cosent import cosent_loss, cosent_loss_from_scores
from .losses import clip_loss, dscl_loss, info_nce, simcse_loss, simcse_sup_loss, supcon_loss

__version__ = "0.1.0"

__all__ = [
    "info_nce",
    "simcse_loss",
    "simcse_sup_loss",
    "supcon_loss",
    "dscl_loss",
    "cosent_loss",
    "cosent_loss_from_scores",
    "clip_loss",
    "nn",
    "__version__",
]
