"""fused-contrastive: contrastive losses (InfoNCE, SimCSE, CLIP, SupCon, DSCL, CoSENT, MaxSim) that never
materialise the N x M similarity matrix. See README.md for the API table."""

# _cli_warnings first (before torch); losses: its __all__ below; maxsim: late interaction
from . import _cli_warnings, losses, maxsim, nn  # noqa: F401
from .cosent import cosent_loss, cosent_loss_from_scores
from .encode import encode_in_chunks
from .losses import *  # noqa: F403 - the InfoNCE-family losses: losses.__all__
from .maxsim import maxsim_info_nce, maxsim_scores
from .metrics import alignment, uniformity
from .siglip import siglip_loss

__version__ = "0.2.0"

#: the package's public names: every loss of ``losses.__all__`` (a new loss there is exported here
#: without an edit), the losses outside that package, the metrics and helpers, and ``nn``
__all__ = ["__version__", "alignment", "cosent_loss", "cosent_loss_from_scores", "encode_in_chunks",
           "maxsim_info_nce", "maxsim_scores", "nn", "siglip_loss", "uniformity"]
__all__ += losses.__all__
__all__.sort()
