"""CoSENT (``log(1 + sum_{y_a > y_b} exp(scale * (s_b - s_a)))``) on pair cosines or on given scores.

The PyTorch path is O(B log B) time and O(B) memory (``core/cosent/torch_cosent.py``; batches whose B x B pair tile
fits the tile budget use that tile, fewer ops); ``backend="triton"`` (``"auto"`` on CUDA) is the same
algorithm as Triton kernels (``core/cosent/triton_cosent.py``: fused pair cosines and one sorted-scan program
each way, float32); ``backend="reference"`` is the B x B pair matrix.
"""

from __future__ import annotations

from torch import Tensor, stack

from . import _validate as V
from . import distributed as D
from . import ops
from ._amp import autocast_off
from ._backend import resolve
from .core import reference as ref
from .core.cosent.torch_cosent import PairCosentFn, ScoresCosentFn
from .core.spec import compute_dtype
from .losses._levels import leveled, shrink

__all__ = ["cosent_loss", "cosent_loss_from_scores"]

_EPS = 1e-12


def _scores_loss(scores: Tensor, labels: Tensor, scale, backend: str) -> Tensor:
    dt = compute_dtype(scores)
    sc = V.positive_number("scale", scale, device=scores.device)
    if isinstance(sc, Tensor):
        sc = sc.to(device=scores.device, dtype=dt)
    be = resolve(backend, scores, op="cosent")
    if be == "reference":
        return ref.cosent(scores, labels, sc)
    if ops.tracing_route():
        return ops.cosent_scores(scores, labels, sc, be)
    if be == "triton":
        from .core.cosent.triton_cosent import TritonScoresCosentFn

        return TritonScoresCosentFn.apply(scores, labels, sc)
    return ScoresCosentFn.apply(scores, labels, sc)


@D.agreed
@autocast_off
def cosent_loss_from_scores(scores: Tensor, labels: Tensor, *, scale=20.0, backend: str = "auto",
                            gather=False) -> Tensor:
    """CoSENT on given scores (e.g. a cross-encoder's logits).

    Args:
        scores: [B] floating scores ``s_i`` of the B pairs.
        labels: [B] real labels (any order-comparable values; ties add no term).
        scale: lambda, default 20.0 (float or 0-dim tensor, differentiable).
        backend: "auto" / "torch" (sorted prefix, O(B log B)), "triton" or "reference" (B x B pair matrix).
        gather: False, True or a ProcessGroup: every rank gathers all pairs and returns the global loss.

    Returns:
        0-dim float32 loss (float64 for float64 scores).
    """
    scores = V.embeddings("scores", scores, ndim=1, shape_hint="shape [B]")
    labels = V.real_labels("labels", labels, scores.shape[0], scores.device)
    grp = D.process_group(gather)
    if grp is not None:  # the pair sum spans every rank: each rank computes the global loss
        D.agree(grp, scale=V.positive_number("scale", scale, device=scores.device))
        scores, _, _ = D.gather_rows(scores, grp, name="scores")
        labels, _, _ = D.gather_rows(labels, grp, name="labels")
    return _scores_loss(scores, labels, scale, backend)


@D.agreed
@leveled("u", "v")
@autocast_off
def cosent_loss(u: Tensor, v: Tensor, labels: Tensor, *, scale=20.0, normalize: bool = True,
                backend: str = "auto", gather=False, _levels=None) -> Tensor:
    """CoSENT on sentence pairs: the score of pair i is ``cos(u_i, v_i)`` (``<u_i, v_i>`` when
    ``normalize`` is False).

    Args:
        u, v: [B, D] embeddings of the two sides of each pair (any float dtype).
        labels: [B] real labels (similarity grades; only their order matters).
        scale: lambda, default 20.0.
        gather: False, True or a ProcessGroup: every rank gathers all pairs and returns the global loss.
        matryoshka_dims / matryoshka_weights / return_level_losses: Matryoshka levels (README,
            "Matryoshka"): ``sum_k w_k cosent(shrink(u, d_k), shrink(v, d_k))``. The pair scores are
            O(B*D), so the levels run as K calls of the pair op after one gather (no B x B tile to share).

    Returns:
        0-dim float32 loss (float64 for float64 inputs).
    """
    u = V.embeddings("u", u)
    v = V.embeddings("v", v)
    if u.shape != v.shape:
        raise ValueError(f"v must have the shape of u {tuple(u.shape)}, got {tuple(v.shape)}")
    V.same_device(u=u, v=v)
    V.same_precision("u", u, "v", v)
    V.flag("normalize", normalize)
    labels = V.real_labels("labels", labels, u.shape[0], u.device)
    sc = V.positive_number("scale", scale, device=u.device)
    grp = D.process_group(gather)
    if grp is not None:  # the pair sum spans every rank: each rank computes the global loss, O(B log B)
        D.agree(grp, scale=sc)
        u, _, _ = D.gather_rows(u, grp, name="u")
        v, _, _ = D.gather_rows(v, grp, name="v")
        labels, _, _ = D.gather_rows(labels, grp, name="labels")
    dt = compute_dtype(u, v)
    if isinstance(sc, Tensor):
        sc = sc.to(device=u.device, dtype=dt)
    be = resolve(backend, u, v, op="cosent")
    if _levels is not None:
        return stack([_pairs(shrink(u, d), shrink(v, d), labels, sc, normalize, be) for d in _levels.dims])
    return _pairs(u, v, labels, sc, normalize, be)


def _pairs(u: Tensor, v: Tensor, labels: Tensor, sc, normalize: bool, be: str) -> Tensor:
    if be == "reference":
        return ref.cosent(ref.pair_cosines(u, v, normalize), labels, sc)
    if ops.tracing_route():
        return ops.cosent_pairs(u, v, labels, sc, normalize, _EPS, be)
    if be == "triton":
        from .core.cosent.triton_cosent import TritonPairCosentFn

        return TritonPairCosentFn.apply(u, v, labels, sc, normalize, _EPS)
    return PairCosentFn.apply(u, v, labels, sc, normalize, _EPS)
