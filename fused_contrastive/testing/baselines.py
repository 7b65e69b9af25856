"""THE seed and peer baselines: the formulas of the seed documents (the papers and reference code each loss
comes from), the textbook formula each benchmark case replaces, and the peer libraries a user would
otherwise pick. Written here once from their math (no code pasted); the tests check them against the
reference, and the benchmark times them next to this library.

:data:`BASELINES` maps a benchmark case of ``cases.py`` to its contenders. Each :class:`Baseline`
takes the case's inputs as one dict (tensors and keyword arguments together). Kinds:

* ``formula``: the textbook formula the case replaces (one per benchmark case; the small-batch table
  of the benchmark compares the torch backend with it);
* ``seed``: a seed document's formula where it differs from the textbook one;
* ``peer``: another library's loss (pytorch-metric-learning, when installed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Estimate = Callable[[int, int, int], float]  # (N, D, itemsize) -> peak bytes


# --- the seeds' and textbook formulas ----------------------------------------------------------


def partner(n: int, device=None) -> Tensor:
    """Interleaved pairs: row i's positive is ``i + 1 - (i % 2) * 2`` (seeds 000/002/004)."""
    idx = torch.arange(n, device=device)
    return idx + 1 - idx % 2 * 2


def info_nce_formula(q: Tensor, k: Tensor, temperature: float) -> Tensor:
    """``F.cross_entropy(F.normalize(q) @ F.normalize(k).T / t, arange)``: the textbook in-batch-negatives
    loss (also sentence-transformers' MultipleNegativesRankingLoss on embeddings, scale = 1 / t)."""
    logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / temperature
    return F.cross_entropy(logits, torch.arange(q.shape[0], device=q.device))


def seed_simcse_unsup(z: Tensor, temperature: float = 0.05) -> Tensor:
    """Seeds 000/002: normalise, ``sim - eye * 1e12`` (self removed), ``/ t``, cross-entropy against the
    interleaved partner."""
    zn = F.normalize(z, p=2, dim=1)
    sim = zn @ zn.T - torch.eye(z.shape[0], device=z.device, dtype=z.dtype) * 1e12
    return F.cross_entropy(sim / temperature, partner(z.shape[0], z.device))


def seed_keras_simcse(z: Tensor) -> Tensor:
    """Seed 004 (Su's Keras loss): l2-normalise, dot, ``- eye * 1e12``, ``* 20``, categorical
    cross-entropy from logits with one-hot labels."""
    labels = F.one_hot(partner(z.shape[0], z.device), z.shape[0]).to(z.dtype)
    zn = z / z.norm(dim=1, keepdim=True)
    logits = (zn @ zn.T - torch.eye(z.shape[0], device=z.device, dtype=z.dtype) * 1e12) * 20
    return -(labels * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def seed_simcse_sup(z: Tensor, temperature: float = 0.05) -> Tensor:
    """Seed 000 supervised: anchors are rows 0::3; candidate columns every row with index % 3 != 0;
    the target of anchor k is column 2k."""
    rows = torch.arange(0, z.shape[0], 3, device=z.device)
    cols = torch.nonzero(torch.arange(z.shape[0], device=z.device) % 3 != 0).squeeze(1)
    zn = F.normalize(z, dim=1)
    sim = zn[rows] @ zn[cols].T / temperature
    return F.cross_entropy(sim, torch.arange(rows.shape[0], device=z.device) * 2)


def broadcast_cos(x: Tensor, y: Tensor) -> Tensor:
    """The seeds' similarity matrix: the cosine of every pair by broadcasting (allocates N x M x D)."""
    return F.cosine_similarity(x.unsqueeze(1), y.unsqueeze(0), dim=2)


def seed_broadcast_pairs(q: Tensor, k: Tensor, temperature: float = 0.05) -> Tensor:
    """Seeds 000/003: broadcast cosine / t, cross-entropy on the diagonal."""
    return F.cross_entropy(broadcast_cos(q, k) / temperature, torch.arange(q.shape[0], device=q.device))


def seed_broadcast_simcse(z: Tensor, temperature: float = 0.05) -> Tensor:
    """Seeds 000/002 with the broadcast cosine: ``- eye * 1e12``, ``/ t``, cross-entropy."""
    n = z.shape[0]
    sim = broadcast_cos(z, z) - torch.eye(n, device=z.device, dtype=z.dtype) * 1e12
    return F.cross_entropy(sim / temperature, partner(n, z.device))


def seed_broadcast_simcse_sup(z: Tensor, temperature: float = 0.05) -> Tensor:
    """Seed 000 supervised with the broadcast cosine over all 3N rows, then index_select."""
    rows = torch.arange(0, z.shape[0], 3, device=z.device)
    cols = torch.nonzero(torch.arange(z.shape[0], device=z.device) % 3 != 0).squeeze(1)
    sim = broadcast_cos(z, z).index_select(0, rows).index_select(1, cols)
    return F.cross_entropy(sim / temperature, torch.arange(0, cols.shape[0], 2, device=z.device))


def supcontrast(features: Tensor, labels: Tensor | None = None, mask: Tensor | None = None,
                temperature: float = 0.07, base_temperature: float = 0.07, contrast_mode: str = "all",
                normalize: bool = True) -> Tensor:
    """Seed 003: SupContrast's algorithm (L_out): logits shifted by their row maximum,
    ``log(sum exp + 1e-30)``, mean log-probability over the positives, anchors without a positive
    count 0 (``features`` are normalised first when ``normalize``)."""
    f = F.normalize(features, dim=-1) if normalize else features
    bsz, n_views = f.shape[:2]
    if labels is None and mask is None:
        mask = torch.eye(bsz, device=f.device, dtype=f.dtype)
    elif labels is not None:
        mask = (labels[:, None] == labels[None, :]).to(f.dtype)
    else:
        mask = mask.to(f.dtype)
    contrast = torch.cat(torch.unbind(f, dim=1), dim=0)
    anchor, anchor_count = (contrast, n_views) if contrast_mode == "all" else (f[:, 0], 1)
    logits = anchor @ contrast.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    mask = mask.repeat(anchor_count, n_views)
    logits_mask = torch.ones_like(mask).scatter(1, torch.arange(bsz * anchor_count, device=f.device)[:, None], 0)
    mask = mask * logits_mask
    log_prob = logits - torch.log((torch.exp(logits) * logits_mask).sum(1, keepdim=True) + 1e-30)
    pos = mask.sum(1)
    pos = torch.where(pos < 1e-6, torch.ones_like(pos), pos)
    mean_log_prob_pos = (mask * log_prob).sum(1) / pos
    return (-(temperature / base_temperature) * mean_log_prob_pos).view(anchor_count, bsz).mean()


def supcon_in_formula(features: Tensor, labels: Tensor, temperature: float = 0.07,
                      base_temperature: float = 0.07) -> Tensor:
    """L_in (Khosla et al. eq. 3) written directly: ``-log((1/|P|) sum_p softmax_p)`` per anchor, with
    the own column removed by ``-inf``; anchors without a positive count 0."""
    f = F.normalize(features, dim=-1)
    n_views = f.shape[1]
    contrast = torch.cat(torch.unbind(f, dim=1), dim=0)
    n = contrast.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=f.device)
    log_prob = torch.log_softmax((contrast @ contrast.T / temperature).masked_fill(eye, float("-inf")), dim=1)
    lab = labels.repeat(n_views)
    pos = (lab[:, None] == lab[None, :]) & ~eye
    n_pos = pos.sum(1)
    lse_pos = torch.logsumexp(log_prob.masked_fill(~pos, float("-inf")), dim=1)
    per = torch.where(n_pos > 0, torch.log(n_pos.clamp_min(1).to(f.dtype)) - lse_pos, torch.zeros_like(lse_pos))
    return (temperature / base_temperature) * per.mean()


def dcl_formula(z1: Tensor, z2: Tensor, temperature: float = 0.1, sigma: float | None = None) -> Tensor:
    """DCL / DCLW (Yeh et al. 2022, eq. 6) as it is usually written (lightly's DCLLoss): normalise both
    views, the 2N x 2N logits of both views, self and partner masked with -inf, then per anchor the
    negatives' logsumexp minus the (weighted) positive logit, averaged."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    logits = z @ z.T / temperature
    idx = torch.arange(2 * n, device=z.device)
    partner = (idx + n) % (2 * n)
    pos = logits[idx, partner]
    mask = (idx[None, :] == idx[:, None]) | (idx[None, :] == partner[:, None])
    neg = torch.logsumexp(logits.masked_fill(mask, float("-inf")), dim=1)
    if sigma is not None:
        with torch.no_grad():
            d = (F.normalize(z1, dim=1) * F.normalize(z2, dim=1)).sum(dim=1)
            w = (2.0 - n * torch.softmax(d / sigma, dim=0)).repeat(2)
        pos = pos * w
    return (neg - pos).mean()


def dscl_formula(features: Tensor, labels: Tensor, beta: float = 8.0, temperature: float = 0.07) -> Tensor:
    """DSCL (the paper's definition) with an explicit weight matrix: anchors view 0, contrast set both
    views, own view 1 weight 1, every other same-label column ``beta / (|P| - 1)``."""
    f = F.normalize(features, dim=-1)
    bsz = f.shape[0]
    contrast = torch.cat([f[:, 0], f[:, 1]])
    self_col = torch.zeros(bsz, 2 * bsz, dtype=torch.bool, device=f.device)
    self_col[torch.arange(bsz), torch.arange(bsz)] = True
    log_prob = torch.log_softmax((f[:, 0] @ contrast.T / temperature).masked_fill(self_col, float("-inf")), dim=1)
    pos = (labels[:, None] == labels.repeat(2)[None, :]) & ~self_col
    others = (pos.sum(1, keepdim=True) - 1).to(f.dtype)
    w = torch.where(pos, beta / others.clamp_min(1), torch.zeros_like(log_prob))
    w[torch.arange(bsz), bsz + torch.arange(bsz)] = 1.0
    return (-(w * log_prob.masked_fill(w == 0, 0.0)).sum(1) / w.sum(1)).mean()


def clip_formula(a: Tensor, b: Tensor, logit_scale: float) -> Tensor:
    """open_clip's ClipLoss on one device: ``(CE(l, arange) + CE(l^T, arange)) / 2``."""
    logits = logit_scale * F.normalize(a, dim=1) @ F.normalize(b, dim=1).T
    target = torch.arange(a.shape[0], device=a.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def am_softmax_formula(query: Tensor, keys: Tensor, margin: float, temperature, symmetric: bool = True,
                       reduction: str = "mean") -> Tensor:
    """LaBSE's additive-margin softmax as it is usually written: the N x N scaled cosines with ``s m``
    taken off the diagonal, ``CE(l, arange)`` (and ``CE(l^T, arange)``, averaged, when symmetric);
    ``reduction`` as ``F.cross_entropy``'s."""
    cos = F.normalize(query, dim=1) @ F.normalize(keys, dim=1).T
    logits = (cos - margin * torch.eye(cos.shape[0], dtype=cos.dtype, device=cos.device)) / temperature
    target = torch.arange(query.shape[0], device=query.device)
    per = F.cross_entropy(logits, target, reduction="none")
    if symmetric:
        per = (per + F.cross_entropy(logits.T, target, reduction="none")) / 2
    return {"mean": per.mean(), "sum": per.sum(), "none": per}[reduction]


def siglip_formula(image: Tensor, text: Tensor, logit_scale, logit_bias) -> Tensor:
    """open_clip's ``SigLipLoss`` on one device, on normalised features: the N x N logits
    ``s x @ y.T + b``, labels ``2 eye - 1``, ``-logsigmoid(labels * logits).sum() / N``."""
    logits = logit_scale * F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T + logit_bias
    labels = 2 * torch.eye(logits.shape[0], device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / logits.shape[0]


def seed_cosent(scores: Tensor, labels: Tensor, scale: float = 20.0) -> Tensor:
    """Seed 001 (= sentence-transformers' CoSENTLoss): scaled score differences kept where the label
    order holds (``- 1e12`` elsewhere), a 0 prepended, logsumexp: a B x B matrix."""
    s = scores * scale
    diff = s[:, None] - s[None, :]  # [i, j] = s_i - s_j, kept where y_i < y_j
    keep = (labels[:, None] < labels[None, :]).to(diff.dtype)
    diff = diff - (1 - keep) * 1e12
    return torch.logsumexp(torch.cat([torch.zeros(1, dtype=diff.dtype, device=diff.device), diff.flatten()]), dim=0)


def cosent_formula(u: Tensor, v: Tensor, labels: Tensor, scale: float = 20.0) -> Tensor:
    """CoSENT on pair cosines with the seed's B x B matrix."""
    return seed_cosent((F.normalize(u, p=2, dim=1) * F.normalize(v, p=2, dim=1)).sum(dim=1), labels, scale)


# --- peers ----------------------------------------------------------------------------------------


def _pml():
    from pytorch_metric_learning import losses

    return losses


def pml_ntxent_pairs(q: Tensor, k: Tensor, temperature: float = 0.05) -> Tensor:
    """pytorch-metric-learning NTXentLoss with ``ref_emb``: anchor q_i, positive k_i, negatives k_j."""
    lab = torch.arange(q.shape[0], device=q.device)
    # a distinct ref_labels tensor: PML drops the diagonal positives when ref_labels *is* labels
    return _pml().NTXentLoss(temperature=temperature)(q, lab, ref_emb=k, ref_labels=lab.clone())


def pml_ntxent_interleaved(z: Tensor, temperature: float = 0.05) -> Tensor:
    """pytorch-metric-learning NTXentLoss on the interleaved batch (labels ``i // 2``)."""
    return _pml().NTXentLoss(temperature=temperature)(z, torch.arange(z.shape[0], device=z.device) // 2)


def pml_supcon(features: Tensor, labels: Tensor, temperature: float = 0.07) -> Tensor:
    """pytorch-metric-learning SupConLoss on the views concatenated (labels repeated)."""
    emb = torch.cat(torch.unbind(features, dim=1), dim=0)
    return _pml().SupConLoss(temperature=temperature)(emb, labels.repeat(features.shape[1]))


# --- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """One contender of a benchmark case besides this library's backends.

    Attributes:
        kind: "formula", "seed" or "peer" (module docstring).
        fn: the loss from the case's inputs (tensors and keyword arguments in one dict).
        memory_order / time_order: growth of peak memory / time with N at fixed D (1 linear,
            2 quadratic, 3 cubic): the benchmark's largest-batch fit and its time predictions.
        estimate: peak bytes before running, for contenders whose memory can explode (checked against
            the memory cap so the case is skipped, not attempted); ``note`` says why.
        requires: an importable module the contender needs (a peer package).
    """

    name: str
    kind: str
    fn: Callable[[dict[str, object]], Tensor]
    source: str
    memory_order: int = 2
    time_order: int = 2
    estimate: Estimate | None = None
    requires: str | None = None
    note: str = ""


def _broadcast(rows: Callable[[int], int]) -> Estimate:
    """Measured peak of the broadcast-cosine seeds: 6 tensors of R x R x D (3 in forward)."""
    return lambda n, d, isz: 6.0 * rows(n) ** 2 * d * isz


def _ntxent(neg_per_anchor: Callable[[int], int]) -> Estimate:
    """PML NTXentLoss builds a [positive pairs, negative pairs] matrix: ~(4 * itemsize + 1) bytes per
    element measured (float32: 17 N^3 bytes for N anchors with one positive each)."""
    return lambda n, d, isz: float(n) * n * neg_per_anchor(n) * (4 * isz + 1)


_PML = "pytorch_metric_learning"
_BCAST = "N x N x D cosine broadcast"
_NTX = "[pos pairs x neg pairs] matrix, 17 N^3 B"

BASELINES: dict[str, list[Baseline]] = {
    "info_nce": [
        Baseline("formula", "formula", lambda x: info_nce_formula(x["query"], x["keys"], x["temperature"]),
                 "F.cross_entropy(F.normalize(q) @ F.normalize(k).T / t, arange) (= sentence-transformers MNRL)"),
        Baseline("seed-broadcast", "seed", lambda x: seed_broadcast_pairs(x["query"], x["keys"], x["temperature"]),
                 "seeds 000/003: F.cosine_similarity broadcast to N x N x D", 2, 3, _broadcast(lambda n: n),
                 note=_BCAST),
        Baseline("pml-ntxent", "peer", lambda x: pml_ntxent_pairs(x["query"], x["keys"], x["temperature"]),
                 "pytorch-metric-learning NTXentLoss(ref_emb=keys)", 3, 3, _ntxent(lambda n: n - 1), _PML, _NTX),
    ],
    "simcse": [
        Baseline("formula", "formula", lambda x: seed_simcse_unsup(x["z1"], x["temperature"]),
                 "seeds 000/004: F.normalize, z @ z.T - eye * 1e12, / t, cross-entropy vs the partner"),
        Baseline("seed-broadcast", "seed", lambda x: seed_broadcast_simcse(x["z1"], x["temperature"]),
                 "seeds 000/002: F.cosine_similarity broadcast, - eye * 1e12, / t", 2, 3, _broadcast(lambda n: n),
                 note=_BCAST),
        Baseline("pml-ntxent", "peer", lambda x: pml_ntxent_interleaved(x["z1"], x["temperature"]),
                 "pytorch-metric-learning NTXentLoss(labels = i // 2)", 3, 3, _ntxent(lambda n: n - 2), _PML, _NTX),
    ],
    "dcl": [
        Baseline("formula", "formula", lambda x: dcl_formula(x["z1"], x["z2"], x["temperature"]),
                 "2N x 2N logits of both views, self and partner masked, logsumexp - positive (lightly DCLLoss)"),
    ],
    "dclw": [
        Baseline("formula", "formula", lambda x: dcl_formula(x["z1"], x["z2"], x["temperature"], x["sigma"]),
                 "DCL's formula with the positive weighted by 2 - N softmax(<z1_i, z2_i> / sigma) (lightly DCLWLoss)"),
    ],
    "simcse_2view": [
        Baseline("formula", "formula", lambda x: info_nce_formula(x["z1"], x["z2"], x["temperature"]),
                 "F.cross_entropy(F.normalize(z1) @ F.normalize(z2).T / t, arange) (SimCSE's official form)"),
        Baseline("seed-broadcast", "seed", lambda x: seed_broadcast_pairs(x["z1"], x["z2"], x["temperature"]),
                 "seeds 000/003: F.cosine_similarity broadcast to N x N x D", 2, 3, _broadcast(lambda n: n),
                 note=_BCAST),
        Baseline("pml-ntxent", "peer", lambda x: pml_ntxent_pairs(x["z1"], x["z2"], x["temperature"]),
                 "pytorch-metric-learning NTXentLoss(ref_emb=z2)", 3, 3, _ntxent(lambda n: n - 1), _PML, _NTX),
    ],
    "simcse_sup": [
        Baseline("formula", "formula", lambda x: seed_simcse_sup(x["anchor"], x["temperature"]),
                 "seed 000 supervised: F.normalize, anchors 0::3 vs columns i % 3 != 0, target 2k, cross-entropy"),
        Baseline("seed-broadcast", "seed", lambda x: seed_broadcast_simcse_sup(x["anchor"], x["temperature"]),
                 "seed 000 supervised with the broadcast cosine over all 3N rows (3N x 3N x D), index_select",
                 2, 3, _broadcast(lambda n: 3 * n), note="3N x 3N x D cosine broadcast"),
    ],
    "supcon_out": [
        Baseline("formula", "formula", lambda x: supcontrast(x["features"], x["labels"], temperature=x["temperature"]),
                 "seed 003: SupContrast's algorithm (max shift, 1e-30) on normalised features"),
        Baseline("pml-supcon", "peer", lambda x: pml_supcon(x["features"], x["labels"], x["temperature"]),
                 "pytorch-metric-learning SupConLoss", requires=_PML),
    ],
    "supcon_in": [
        Baseline("formula", "formula",
                 lambda x: supcon_in_formula(x["features"], x["labels"], temperature=x["temperature"]),
                 "L_in written directly: log_softmax, logsumexp over the positives, - log |P|"),
    ],
    "dscl": [
        Baseline("formula", "formula",
                 lambda x: dscl_formula(x["features"], x["labels"], x["beta"], x["temperature"]),
                 "DSCL's definition: log_softmax and an explicit [N, 2N] weight matrix"),
    ],
    "clip": [
        Baseline("formula", "formula", lambda x: clip_formula(x["a"], x["b"], x["logit_scale"]),
                 "open_clip ClipLoss: (CE(l, arange) + CE(l.T, arange)) / 2"),
    ],
    "am_softmax": [
        Baseline("formula", "formula",
                 lambda x: am_softmax_formula(x["query"], x["keys"], x["margin"], x["temperature"]),
                 "LaBSE: (CE(l, arange) + CE(l.T, arange)) / 2, l = (cos - m eye) / t"),
    ],
    "siglip": [
        Baseline("formula", "formula",
                 lambda x: siglip_formula(x["image"], x["text"], x["logit_scale"], x["logit_bias"]),
                 "open_clip SigLipLoss: s x @ y.T + b, labels 2 eye - 1, -logsigmoid(labels * logits).sum() / N"),
    ],
    "cosent": [
        Baseline("formula", "formula", lambda x: cosent_formula(x["u"], x["v"], x["labels"], x["scale"]),
                 "seed 001 (= sentence-transformers CoSENTLoss): B x B score differences, - 1e12, logsumexp"),
    ],
}


def available(b: Baseline) -> str | None:
    """Why ``b`` cannot run here (its peer package is not installed), or None."""
    if b.requires is None:
        return None
    try:
        __import__(b.requires)
    except ImportError:
        return f"peer not installed (pip install {b.requires.replace('_', '-')})"
    return None


def formula_of(name: str) -> Baseline:
    """The textbook formula of the benchmark case ``name`` (every ``bench=True`` case has one: the
    time and memory ratios are taken against it). ``KeyError`` saying where to add it otherwise."""
    for b in BASELINES.get(name, ()):
        if b.kind == "formula":
            return b
    raise KeyError(f"case {name!r} has no 'formula' baseline: add Baseline(..., kind='formula', ...) for it to "
                   "BASELINES in fused_contrastive/testing/baselines.py")
