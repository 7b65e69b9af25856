"""The GPU-only libraries ``bench-gpu`` times beside this one, each on the losses it computes exactly as
``gpu_losses`` defines them (same inputs, same value up to rounding; each row is checked against the
float64 definition all the same). None is a dependency: a peer that does not import is listed as
not installed. Their wheels are pure Python; for a machine without package access see the README's
"Running on a GPU" (``pip download`` into an ignored folder, ``pip install --no-index`` there).

* ``memeff`` (0.3.1): ``MemoryEfficientCLIPLoss`` (CLIP), ``MemoryEfficientQwen3Loss`` with
  ``margin=2.0`` (its false-negative mask off: cosines never exceed the positive's by 2, so the loss is
  the one-directional InfoNCE), and their fused Matryoshka forms over the ascending levels; temperature
  a divisor; ``stable=False`` (its default ``stable=True`` multiplies the gradients by ``sqrt(N t)``:
  not the loss's gradient, although the work is the same).
* ``inf-cl`` (1.2.1): ``cal_flash_loss`` (per-row losses of ``scale q . k``, no normalisation inside:
  the caller normalises) for InfoNCE, and its mean over both directions for CLIP; ``head_dim`` 256
  where D allows (D % head_dim == 0 is required), its fp32 kernels (TF32 products).
* ``siglip-kernel`` (0.1.2): ``fused_siglip_loss`` on normalised rows, log-temperature log(10) and bias
  -10 as CUDA tensors; bf16 inputs take its chunked-bf16 route (cuBLAS logits, a Triton BCE pass,
  cuBLAS gradients), the one its README times.
* ``late-interaction-kernels`` (0.4.5): ``maxsim`` all-pairs scores with the masks, then
  ``F.cross_entropy``.
* ``flash-maxsim`` (0.3.0): ``flash_maxsim_batched_train`` with the prefix lengths, then
  ``F.cross_entropy``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .gpu_losses import Problem, _arange


@dataclass(frozen=True)
class Peer:
    """A peer library: its pip name (the contender's name), the module it imports and, per loss it
    computes, ``make(problem) -> fn(problem) -> loss``."""

    package: str
    module: str
    losses: dict[str, Callable[[Problem], Callable[[Problem], Tensor]]]

    def missing(self) -> str | None:
        """None when the peer imports, else why not (one line)."""
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # noqa: BLE001 - anything that stops the import: not installed / broken
            return f"not installed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        return None


def _memeff_info_nce(p: Problem):
    import memeff

    m = memeff.MemoryEfficientQwen3Loss(temperature=p.extra["temperature"], margin=2.0, stable=False)
    return lambda p: m(p.leaves["query"], p.leaves["keys"])


def _memeff_clip(p: Problem):
    import memeff

    m = memeff.MemoryEfficientCLIPLoss(temperature=1 / p.extra["logit_scale"], stable=False)
    return lambda p: m(p.leaves["a"], p.leaves["b"])


def _memeff_matryoshka(p: Problem):
    import memeff

    dims = sorted(p.extra["matryoshka_dims"])
    m = memeff.MemoryEfficientMatryoshkaQwen3Loss(dims, temperature=p.extra["temperature"], margin=2.0, stable=False)
    return lambda p: m(p.leaves["query"], p.leaves["keys"])


def _memeff_matryoshka_clip(p: Problem):
    import memeff

    dims = sorted(p.extra["matryoshka_dims"])
    m = memeff.MemoryEfficientMatryoshkaCLIPLoss(dims, temperature=1 / p.extra["logit_scale"], stable=False)
    return lambda p: m(p.leaves["a"], p.leaves["b"])


def _head_dim(d: int) -> int:
    """inf-cl's head_dim: the largest power of two <= 256 dividing D (it needs D % head_dim == 0, >= 16)."""
    for h in (256, 128, 64, 32, 16):
        if d % h == 0:
            return h
    raise ValueError(f"inf-cl needs D divisible by 16, got {d}")


def _infcl_info_nce(p: Problem):
    from inf_cl import cal_flash_loss

    s, h = 1 / p.extra["temperature"], _head_dim(p.d)
    return lambda p: cal_flash_loss(F.normalize(p.leaves["query"], dim=-1), F.normalize(p.leaves["keys"], dim=-1),
                                    scale=s, head_dim=h).mean()


def _infcl_clip(p: Problem):
    from inf_cl import cal_flash_loss

    s, h = p.extra["logit_scale"], _head_dim(p.d)

    def run(p: Problem) -> Tensor:
        a, b = F.normalize(p.leaves["a"], dim=-1), F.normalize(p.leaves["b"], dim=-1)
        return (cal_flash_loss(a, b, scale=s, head_dim=h).mean() + cal_flash_loss(b, a, scale=s, head_dim=h).mean()) / 2
    return run


def _siglip_kernel(p: Problem):
    from siglip_kernel import fused_siglip_loss

    log_t = torch.tensor(math.log(p.extra["logit_scale"]), device=p.device, dtype=torch.float32)
    bias = torch.tensor(p.extra["logit_bias"], device=p.device, dtype=torch.float32)
    return lambda p: fused_siglip_loss(F.normalize(p.leaves["image"], dim=-1), F.normalize(p.leaves["text"], dim=-1),
                                       log_t, bias)


def _lik_maxsim(p: Problem):
    from late_interaction_kernels import maxsim

    def run(p: Problem) -> Tensor:
        q, e = p.leaves["q"], p.extra
        scores = maxsim(q, p.leaves["docs"], e["query_mask"], e["doc_mask"], normalize=False)
        return F.cross_entropy(e["scale"] * scores, _arange(q))
    return run


def _flash_maxsim(p: Problem):
    from flash_maxsim import flash_maxsim_batched_train

    def run(p: Problem) -> Tensor:
        q, e = p.leaves["q"], p.extra
        scores = flash_maxsim_batched_train(q, p.leaves["docs"], shared_docs=True, doc_lengths=e["doc_lengths"],
                                            query_lengths=e["query_lengths"])
        return F.cross_entropy(e["scale"] * scores, _arange(q))
    return run


PEERS: tuple[Peer, ...] = (
    Peer("memeff", "memeff", {"info_nce": _memeff_info_nce, "clip": _memeff_clip, "matryoshka5": _memeff_matryoshka,
                              "matryoshka5_clip": _memeff_matryoshka_clip}),
    Peer("inf-cl", "inf_cl", {"info_nce": _infcl_info_nce, "clip": _infcl_clip}),
    Peer("siglip-kernel", "siglip_kernel", {"siglip": _siglip_kernel}),
    Peer("late-interaction-kernels", "late_interaction_kernels", {"maxsim": _lik_maxsim}),
    Peer("flash-maxsim", "flash_maxsim", {"maxsim": _flash_maxsim}),
)
#: the wheels of the peers, as ``pip download`` takes them (the versions read for this module)
WHEELS = ("memeff==0.3.1", "inf-cl==1.2.1", "siglip-kernel==0.1.2", "late-interaction-kernels==0.4.5",
          "flash-maxsim==0.3.0")


def peers_of(loss: str) -> list[Peer]:
    return [p for p in PEERS if loss in p.losses]
