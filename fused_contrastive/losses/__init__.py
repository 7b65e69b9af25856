"""The InfoNCE-family losses, by family: :mod:`.cross_entropy` (``info_nce``, ``clip_loss``,
``simcse_loss``, ``simcse_sup_loss``), :mod:`.decoupled` (``dcl_loss``, ``dclw_loss``),
:mod:`.supervised` (``supcon_loss``, ``dscl_loss``), :mod:`.qwen3` (``qwen3_embedding_loss``) and
:mod:`.guided` (``gist_loss``, and ``info_nce``'s ``guide=`` / ``ids=`` masks on the merged-block core of
``core/guided/torch_blocks.py``); :mod:`._scope` holds what they share (one body per loss: a local call is a
world of one rank). Each is the core op of ``core/spec.py`` (per row:
coefficients times ``LSE``, ``LSEcol``, ``LSEpos`` minus coefficients times the target logit ``TGT`` and the weighted
positive logits ``SET``) with the coefficients, constants and denominator the loss defines.

Common keyword arguments:

* ``normalize`` (default True): L2-normalise rows inside the loss (``x / max(||x||, 1e-12)``, like
  ``F.normalize``, without overflow for large finite rows). With False the raw dot products are used.
* ``reduction``: ``"mean"`` (default), ``"sum"`` or ``"none"`` (per-anchor losses).
* ``backend``: ``"auto"`` (default; env ``FUSED_CONTRASTIVE_BACKEND`` overrides it, then triton for
  CUDA tensors that are not float64 when triton is installed, else torch), ``"torch"`` (PyTorch,
  O(N*D) memory, any device), ``"triton"`` (fused kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``)
  or ``"reference"`` (materialises the logits; the test oracle). Problems whose N x M logits fit the
  tile budget run one materialised tile on both torch and triton (see ``core.dense_path``).

* ``gather`` (default False): True (the default process group) or a ``torch.distributed`` ProcessGroup:
  the contrast set is gathered from every rank and each rank computes its own anchors' rows; the
  returned value averages over ranks to the global-batch loss (README, "Negatives across ranks").

Embeddings may be float16, bfloat16, float32 or float64, contiguous or not. Accumulation is in
float32 (float64 for float64 inputs); the loss is float32 (float64 for float64 inputs) and gradients
come back in each input's dtype. Temperatures / scales may be Python numbers (exact: kept in double
precision) or 0-dim tensors (differentiable). Tensor values are validated only on CPU (reading a CUDA
value would be a host sync).
"""

from . import cross_entropy, decoupled, guided, qwen3, supervised
from .cross_entropy import *  # noqa: F403 - each family module's __all__ is its public losses
from .decoupled import *  # noqa: F403
from .guided import *  # noqa: F403
from .qwen3 import *  # noqa: F403
from .supervised import *  # noqa: F403

__all__ = sorted([*cross_entropy.__all__, *decoupled.__all__, *guided.__all__, *qwen3.__all__, *supervised.__all__])
