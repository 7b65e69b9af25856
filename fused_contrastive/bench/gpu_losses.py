"""The losses ``bench-gpu`` times: for each, its inputs on the device, this library's call, the textbook
formula as a user writes it, and its float64 definition (the loss value, computed in row chunks so that
N = 65536 fits beside the contenders).

Every problem is one (loss, N, D) with its differentiable inputs (``Problem.leaves``, 16-bit, requiring
grad) and the rest (``Problem.extra``: labels, masks, frozen guide embeddings, options). The inputs are
seeded random rows on the device with correlated positives (each positive is its anchor plus as much
independent noise), so the softmax is not flat and the loss is not ``log N``:

* ``info_nce``: query, keys [N, D], temperature 0.05, targets ``arange(N)``;
* ``simcse``: the interleaved unsupervised batch z [N, D] (rows 2i, 2i+1 two views), temperature 0.05;
* ``clip``: a, b [N, D], logit scale 1 / 0.07 (rows and columns);
* ``siglip``: image, text [N, D], logit scale 10, bias -10 (SigLIP's initialisation);
* ``supcon_in``: features [N/2, 2, D] (two views), labels [N/2] of 100 classes, L_in, temperature 0.07;
* ``gist``: anchors, positives, negatives [N, D] and a frozen guide's [N, 384] (``bench-gist``'s inputs:
  topics, paraphrases, hard negatives), temperature 0.01, margin 0: logits N x 4N;
* ``matryoshka5``: InfoNCE at the levels 768 / 512 / 256 / 128 / 64 (scaled to D), summed;
* ``matryoshka5_clip``: CLIP at the same levels, summed;
* ``maxsim``: late interaction, query tokens [N, 32, 128], document tokens [N, 180, 128] (unit tokens,
  padded: each query keeps its first 8..32 tokens, each document its first 45..180, prefix masks), scale
  1, the in-batch cross-entropy over the N x N MaxSim scores.

The float64 definitions are written here from each loss's math (not from this library's code paths):
the inputs are the same 16-bit tensors, promoted exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

TEMPERATURE = 0.05
CLIP_SCALE = 1 / 0.07
SIGLIP_SCALE, SIGLIP_BIAS = 10.0, -10.0
SUPCON_TEMPERATURE = 0.07
SUPCON_CLASSES = 100
GIST_TEMPERATURE, GIST_MARGIN, GIST_GUIDE_DIM = 0.01, 0.0, 384
MATRYOSHKA_DIMS = (768, 512, 256, 128, 64)
MAXSIM_LQ, MAXSIM_LD, MAXSIM_D, MAXSIM_SCALE = 32, 180, 128, 1.0
#: the noise added to an anchor to make its positive (cosine ~ 1 / sqrt(2) at D = 768)
POSITIVE_NOISE = 1.0
#: float64 elements of one row chunk of a definition's logits (2 GiB)
CHUNK_ELEMENTS = 1 << 28


@dataclass
class Problem:
    """One (loss, N, D) on a device: ``leaves`` (requiring grad) and ``extra`` (everything else)."""

    loss: str
    n: int
    d: int
    dtype: torch.dtype
    device: torch.device
    leaves: dict[str, Tensor]
    extra: dict[str, Any] = field(default_factory=dict)

    def zero_grad(self) -> None:
        for t in self.leaves.values():
            t.grad = None

    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves.values())


def matryoshka_dims(d: int) -> list[int]:
    """The levels at D: 768 / 512 / 256 / 128 / 64 scaled by D / 768 (every one at least 1)."""
    return [max(1, x * d // 768) for x in MATRYOSHKA_DIMS]


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, device) -> Tensor:
    return torch.randn(*shape, generator=g, device=device)


def _leaf(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype).contiguous().requires_grad_(True)


def _pair(g, n: int, d: int, device, dtype) -> tuple[Tensor, Tensor]:
    x = _randn(g, n, d, device=device)
    return _leaf(x, dtype), _leaf(x + POSITIVE_NOISE * _randn(g, n, d, device=device), dtype)


# --- inputs ---------------------------------------------------------------------------------------


def _build_info_nce(n, d, g, device, dtype):
    q, k = _pair(g, n, d, device, dtype)
    return {"query": q, "keys": k}, {"temperature": TEMPERATURE}


def _build_simcse(n, d, g, device, dtype):
    base = _randn(g, n // 2, d, device=device)
    z = torch.stack([base + POSITIVE_NOISE * _randn(g, n // 2, d, device=device) for _ in range(2)], 1)
    return {"z1": _leaf(z.reshape(2 * (n // 2), d), dtype)}, {"temperature": TEMPERATURE}


def _build_clip(n, d, g, device, dtype):
    a, b = _pair(g, n, d, device, dtype)
    return {"a": a, "b": b}, {"logit_scale": CLIP_SCALE}


def _build_siglip(n, d, g, device, dtype):
    a, b = _pair(g, n, d, device, dtype)
    return {"image": a, "text": b}, {"logit_scale": SIGLIP_SCALE, "logit_bias": SIGLIP_BIAS}


def _build_supcon_in(n, d, g, device, dtype):
    bsz = n // 2
    labels = torch.randint(0, SUPCON_CLASSES, (bsz,), generator=g, device=device)
    centres = _randn(g, SUPCON_CLASSES, d, device=device)
    views = centres[labels][:, None] + POSITIVE_NOISE * _randn(g, bsz, 2, d, device=device)
    return ({"features": _leaf(views, dtype)},
            {"labels": labels, "variant": "in", "temperature": SUPCON_TEMPERATURE})


def _build_gist(n, d, g, device, dtype):
    from .gist import _inputs

    a, p, neg, ga, gp, gn = _inputs(n, d, GIST_GUIDE_DIM, "cpu", torch.float64)  # seeded by n on the CPU
    return ({"anchors": _leaf(a.detach().to(device), dtype), "positives": _leaf(p.detach().to(device), dtype),
             "negatives": _leaf(neg.detach().to(device), dtype)},
            {"guide": tuple(x.to(device=device, dtype=dtype) for x in (ga, gp, gn)),
             "temperature": GIST_TEMPERATURE, "margin": GIST_MARGIN})


def _build_matryoshka5(n, d, g, device, dtype):
    q, k = _pair(g, n, d, device, dtype)
    return {"query": q, "keys": k}, {"temperature": TEMPERATURE, "matryoshka_dims": matryoshka_dims(d)}


def _build_matryoshka5_clip(n, d, g, device, dtype):
    a, b = _pair(g, n, d, device, dtype)
    return {"a": a, "b": b}, {"logit_scale": CLIP_SCALE, "matryoshka_dims": matryoshka_dims(d)}


def _build_maxsim(n, d, g, device, dtype):
    lq, ld = MAXSIM_LQ, MAXSIM_LD
    q = _randn(g, n, lq, d, device=device)
    docs = _randn(g, n, ld, d, device=device)
    docs[:, :lq] += 0.5 * q  # document i shares directions with query i
    qlen = torch.randint(min(8, lq), lq + 1, (n,), generator=g, device=device)
    dlen = torch.randint(max(1, ld // 4), ld + 1, (n,), generator=g, device=device)
    qm = torch.arange(lq, device=device)[None] < qlen[:, None]
    dm = torch.arange(ld, device=device)[None] < dlen[:, None]
    return ({"q": _leaf(F.normalize(q, dim=-1), dtype), "docs": _leaf(F.normalize(docs, dim=-1), dtype)},
            {"query_mask": qm, "doc_mask": dm, "query_lengths": qlen, "doc_lengths": dlen, "scale": MAXSIM_SCALE})


# --- this library -----------------------------------------------------------------------------------


def _ours(name: str) -> Callable[[Problem], Tensor]:
    import fused_contrastive as fc

    def run(p: Problem) -> Tensor:
        x, e = p.leaves, p.extra
        if name == "info_nce":
            return fc.info_nce(x["query"], x["keys"], temperature=e["temperature"])
        if name == "simcse":
            return fc.simcse_loss(x["z1"], temperature=e["temperature"])
        if name == "clip":
            return fc.clip_loss(x["a"], x["b"], e["logit_scale"])
        if name == "siglip":
            return fc.siglip_loss(x["image"], x["text"], e["logit_scale"], e["logit_bias"])
        if name == "supcon_in":
            return fc.supcon_loss(x["features"], e["labels"], variant="in", temperature=e["temperature"])
        if name == "gist":
            return fc.gist_loss(x["anchors"], x["positives"], x["negatives"], guide=e["guide"],
                                temperature=e["temperature"], margin=e["margin"])
        if name == "matryoshka5":
            return fc.info_nce(x["query"], x["keys"], temperature=e["temperature"],
                               matryoshka_dims=e["matryoshka_dims"])
        if name == "matryoshka5_clip":
            return fc.clip_loss(x["a"], x["b"], e["logit_scale"], matryoshka_dims=e["matryoshka_dims"])
        if name == "maxsim":
            return fc.maxsim.maxsim_info_nce(x["q"], x["docs"], query_mask=e["query_mask"], doc_mask=e["doc_mask"],
                                             scale=e["scale"], normalize=False)
        raise KeyError(name)
    return run


# --- the textbook formulas (as a user writes them; run under autocast by the harness) -------------------


def _arange(x: Tensor) -> Tensor:
    return torch.arange(x.shape[0], device=x.device)


def _textbook(name: str) -> Callable[..., Tensor]:
    """``f(*leaves, **extra-as-needed)``: positional leaves, so that ``torch.compile`` sees plain tensors."""
    from ..testing.baselines import (
        clip_formula,
        info_nce_formula,
        seed_simcse_unsup,
        siglip_formula,
        supcon_in_formula,
    )
    from .gist import textbook as gist_textbook

    if name == "info_nce":
        return info_nce_formula
    if name == "simcse":
        return seed_simcse_unsup
    if name == "clip":
        return clip_formula
    if name == "siglip":
        return siglip_formula
    if name == "supcon_in":
        return supcon_in_formula
    if name == "gist":
        return gist_textbook
    if name == "matryoshka5":
        return lambda q, k, t, dims: sum(info_nce_formula(q[:, :m], k[:, :m], t) for m in dims)
    if name == "matryoshka5_clip":
        return lambda a, b, s, dims: sum(clip_formula(a[:, :m], b[:, :m], s) for m in dims)
    if name == "maxsim":
        return textbook_maxsim
    raise KeyError(name)


def textbook_maxsim(q, docs, qm, dm, scale):
    """Every token similarity at once ([N, M, Lq, Ld]), masked max, masked sum, cross-entropy."""
    sims = torch.einsum("nad,mbd->nmab", q, docs)
    sims = sims.masked_fill(~dm[None, :, None, :], torch.finfo(sims.dtype).min)
    s = (sims.max(dim=-1).values.float() * qm[:, None, :]).sum(-1)
    return F.cross_entropy(scale * s, _arange(q))


def textbook_call(name: str) -> Callable[[Problem], Tensor]:
    """The textbook of ``name`` as ``fn(problem)`` (what the harness times, eager or compiled)."""
    f = _textbook(name)
    return lambda p: f(*textbook_args(p))


def textbook_args(p: Problem) -> tuple:
    x, e = p.leaves, p.extra
    return {
        "info_nce": lambda: (x["query"], x["keys"], e["temperature"]),
        "simcse": lambda: (x["z1"], e["temperature"]),
        "clip": lambda: (x["a"], x["b"], e["logit_scale"]),
        "siglip": lambda: (x["image"], x["text"], e["logit_scale"], e["logit_bias"]),
        "supcon_in": lambda: (x["features"], e["labels"], e["temperature"]),
        "gist": lambda: (x["anchors"], x["positives"], x["negatives"], *e["guide"], e["temperature"], e["margin"]),
        "matryoshka5": lambda: (x["query"], x["keys"], e["temperature"], tuple(e["matryoshka_dims"])),
        "matryoshka5_clip": lambda: (x["a"], x["b"], e["logit_scale"], tuple(e["matryoshka_dims"])),
        "maxsim": lambda: (x["q"], x["docs"], e["query_mask"], e["doc_mask"], e["scale"]),
    }[p.loss]()


# --- float64 definitions ------------------------------------------------------------------------------


def _unit(x: Tensor) -> Tensor:
    x = x.detach().double()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _step(cols: int, chunk: int | None) -> int:
    """Rows per chunk of a definition's [rows, cols] float64 logits (``chunk``, else CHUNK_ELEMENTS)."""
    return chunk or max(1, CHUNK_ELEMENTS // max(1, cols))


def _row_ce(a: Tensor, b: Tensor, s: float, target: Tensor, exclude_self: bool = False,
            chunk: int | None = None) -> Tensor:
    """Per-row ``logsumexp_j(s a_i . b_j) - s a_i . b_{t_i}`` (float64, unit rows given), column i left
    out of row i when ``exclude_self``."""
    out = []
    step = _step(b.shape[0], chunk)
    for r0 in range(0, a.shape[0], step):
        r1 = min(a.shape[0], r0 + step)
        logits = s * (a[r0:r1] @ b.T)
        rows = torch.arange(r0, r1, device=a.device)
        if exclude_self:
            logits[rows - r0, rows] = float("-inf")
        out.append(torch.logsumexp(logits, 1) - logits[rows - r0, target[r0:r1]])
    return torch.cat(out)


def _col_lse(a: Tensor, b: Tensor, s: float, chunk: int | None = None) -> Tensor:
    """``logsumexp_i(s a_i . b_j)`` for every column j, accumulated over row chunks."""
    acc = torch.full((b.shape[0],), float("-inf"), dtype=torch.float64, device=a.device)
    step = _step(b.shape[0], chunk)
    for r0 in range(0, a.shape[0], step):
        acc = torch.logaddexp(acc, torch.logsumexp(s * (a[r0:r0 + step] @ b.T), 0))
    return acc


def _info_nce64(q, k, t, chunk=None) -> float:
    a, b = _unit(q), _unit(k)
    return float(_row_ce(a, b, 1 / t, _arange(a), chunk=chunk).mean())


def _clip64(a, b, s, chunk=None) -> float:
    a, b = _unit(a), _unit(b)
    diag = s * (a * b).sum(1)
    rows = _row_ce(a, b, s, _arange(a), chunk=chunk)
    cols = _col_lse(a, b, s, chunk) - diag
    return float((rows.mean() + cols.mean()) / 2)


def truth_info_nce(p: Problem, chunk: int | None = None) -> float:
    return _info_nce64(p.leaves["query"], p.leaves["keys"], p.extra["temperature"], chunk)


def truth_simcse(p: Problem, chunk: int | None = None) -> float:
    z = _unit(p.leaves["z1"])
    idx = _arange(z)
    return float(_row_ce(z, z, 1 / p.extra["temperature"], idx + 1 - idx % 2 * 2, exclude_self=True,
                         chunk=chunk).mean())


def truth_clip(p: Problem, chunk: int | None = None) -> float:
    return _clip64(p.leaves["a"], p.leaves["b"], p.extra["logit_scale"], chunk)


def truth_siglip(p: Problem, chunk: int | None = None) -> float:
    """``-(1/N) sum_ij log sigmoid(y_ij (s x_i . y_j + b))``, y = +1 on the diagonal, -1 elsewhere."""
    x, y = _unit(p.leaves["image"]), _unit(p.leaves["text"])
    s, bias = p.extra["logit_scale"], p.extra["logit_bias"]
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    step = _step(y.shape[0], chunk)
    for r0 in range(0, x.shape[0], step):
        logits = s * (x[r0:r0 + step] @ y.T) + bias
        rows = torch.arange(r0, min(x.shape[0], r0 + step), device=x.device)
        sign = -torch.ones_like(logits)
        sign[rows - r0, rows] = 1.0
        total += F.softplus(-sign * logits).sum()
    return float(total / x.shape[0])


def truth_supcon_in(p: Problem, chunk: int | None = None) -> float:
    """L_in: per anchor (each view of each sample) ``LSE_{a != i} l_ia - LSE_{p in P(i)} l_ip + log |P(i)|``
    (times temperature / base temperature = 1), 0 for an anchor without positives; the mean over anchors."""
    f = p.leaves["features"]
    z = _unit(torch.cat(torch.unbind(f, dim=1), 0))
    lab = p.extra["labels"].repeat(f.shape[1])
    s = 1 / p.extra["temperature"]
    out = []
    step = _step(z.shape[0], chunk)
    for r0 in range(0, z.shape[0], step):
        r1 = min(z.shape[0], r0 + step)
        logits = s * (z[r0:r1] @ z.T)
        rows = torch.arange(r0, r1, device=z.device)
        logits[rows - r0, rows] = float("-inf")
        pos = lab[r0:r1, None] == lab[None, :]
        pos[rows - r0, rows] = False
        n_pos = pos.sum(1)
        lse_pos = torch.logsumexp(logits.masked_fill(~pos, float("-inf")), 1)
        per = torch.logsumexp(logits, 1) - lse_pos + torch.log(n_pos.clamp_min(1).double())
        out.append(torch.where(n_pos > 0, per, torch.zeros_like(per)))
    return float(torch.cat(out).mean())


def truth_gist(p: Problem, chunk: int | None = None) -> float:
    """GISTEmbed: row i's candidates are its columns of the blocks anchor-positive, anchor-anchor,
    positive-positive and anchor-negative (cosines / temperature); a candidate whose guide cosine exceeds
    ``cos_guide(a_i, p_i) - margin`` is dropped, the anchor-positive diagonal (the target) never."""
    x = p.leaves
    a, pos, neg = _unit(x["anchors"]), _unit(x["positives"]), _unit(x["negatives"])
    ga, gp, gn = (_unit(g) for g in p.extra["guide"])
    s, margin = 1 / p.extra["temperature"], p.extra["margin"]
    theta = (ga * gp).sum(1) - margin
    out = []
    step = _step(4 * a.shape[0], chunk)
    for r0 in range(0, a.shape[0], step):
        r1 = min(a.shape[0], r0 + step)
        rows = torch.arange(r0, r1, device=a.device)
        th = theta[r0:r1, None]
        blocks = []
        for k, (m, c, gm, gc) in enumerate(((a, pos, ga, gp), (a, a, ga, ga), (pos, pos, gp, gp), (a, neg, ga, gn))):
            logits = s * (m[r0:r1] @ c.T)
            drop = (gm[r0:r1] @ gc.T) > th
            if k == 0:
                drop[rows - r0, rows] = False
            blocks.append(logits.masked_fill(drop, float("-inf")))
        logits = torch.cat(blocks, 1)
        out.append(torch.logsumexp(logits, 1) - logits[rows - r0, rows])
    return float(torch.cat(out).mean())


def truth_matryoshka5(p: Problem, chunk: int | None = None) -> float:
    q, k, t = p.leaves["query"], p.leaves["keys"], p.extra["temperature"]
    return sum(_info_nce64(q[:, :m], k[:, :m], t, chunk) for m in p.extra["matryoshka_dims"])


def truth_matryoshka5_clip(p: Problem, chunk: int | None = None) -> float:
    a, b, s = p.leaves["a"], p.leaves["b"], p.extra["logit_scale"]
    return sum(_clip64(a[:, :m], b[:, :m], s, chunk) for m in p.extra["matryoshka_dims"])


def truth_maxsim(p: Problem, chunk: int | None = None) -> float:
    """``S_ij = sum_{a valid} max_{b valid} q_ia . d_jb``; the mean over i of ``LSE_j(s S_ij) - s S_ii``."""
    q, docs = p.leaves["q"].detach().double(), p.leaves["docs"].detach().double()
    qm, dm, s = p.extra["query_mask"], p.extra["doc_mask"], p.extra["scale"]
    n, lq, ld = q.shape[0], q.shape[1], docs.shape[1]
    step = _step(docs.shape[0] * lq * ld, chunk)
    scores = []
    for r0 in range(0, n, step):
        sims = torch.einsum("nad,mbd->nmab", q[r0:r0 + step], docs)
        sims = sims.masked_fill(~dm[None, :, None, :], float("-inf"))
        scores.append((sims.amax(-1) * qm[r0:r0 + step, None, :]).sum(-1))
    logits = s * torch.cat(scores)
    return float((torch.logsumexp(logits, 1) - logits.diagonal()).mean())


@dataclass(frozen=True)
class LossSpec:
    name: str
    build: Callable[..., tuple[dict[str, Tensor], dict[str, Any]]]
    truth: Callable[..., float]
    sizes: tuple[int, ...]
    dims: tuple[int, ...] = (768,)
    #: the logit scale (for the rounding floor of THE accuracy rule)
    scale: float = 1 / TEMPERATURE
    #: the logits the textbook materialises at N (rows, columns)
    logits: Callable[[int], tuple[int, int]] = lambda n: (n, n)

    @property
    def ours(self) -> Callable[[Problem], Tensor]:
        return _ours(self.name)

    @property
    def textbook(self) -> Callable[[Problem], Tensor]:
        return textbook_call(self.name)


SPECS: dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("info_nce", _build_info_nce, truth_info_nce, (4096, 16384, 65536), (768, 256)),
    LossSpec("simcse", _build_simcse, truth_simcse, (4096, 16384, 65536)),
    LossSpec("clip", _build_clip, truth_clip, (4096, 16384, 65536), (768, 256), scale=CLIP_SCALE),
    LossSpec("siglip", _build_siglip, truth_siglip, (4096, 16384, 65536), scale=SIGLIP_SCALE - SIGLIP_BIAS),
    LossSpec("supcon_in", _build_supcon_in, truth_supcon_in, (4096, 16384, 65536), scale=1 / SUPCON_TEMPERATURE),
    LossSpec("gist", _build_gist, truth_gist, (4096, 16384), scale=1 / GIST_TEMPERATURE,
             logits=lambda n: (n, 4 * n)),
    LossSpec("matryoshka5", _build_matryoshka5, truth_matryoshka5, (4096, 16384, 65536)),
    LossSpec("matryoshka5_clip", _build_matryoshka5_clip, truth_matryoshka5_clip, (4096, 16384, 65536),
             scale=CLIP_SCALE),
    LossSpec("maxsim", _build_maxsim, truth_maxsim, (1024, 4096), (MAXSIM_D,), scale=MAXSIM_SCALE * MAXSIM_LQ),
)}
LOSSES = tuple(SPECS)


def build(loss: str, n: int, d: int, device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Problem:
    """The problem ``loss`` at (N, D) on ``device`` in ``dtype`` (seeded by ``seed`` and N)."""
    spec = SPECS[loss]
    device = torch.device(device)
    if loss == "simcse" and n % 2:
        raise ValueError(f"simcse needs an even N (interleaved pairs), got {n}")
    leaves, extra = spec.build(n, d, _gen(device, seed * 1_000_003 + n), device, dtype)
    return Problem(loss, n, d, dtype, device, leaves, extra)


def flops(loss: str, n: int, d: int) -> float:
    """Matmul FLOPs of the textbook's forward + backward at (N, D): ``6 R C D`` per logits matrix (R x C),
    times the levels' share of D for Matryoshka, ``Lq Ld`` token products per pair for MaxSim."""
    r, c = SPECS[loss].logits(n)
    if loss.startswith("matryoshka5"):
        return 6.0 * r * c * sum(matryoshka_dims(d))
    if loss == "maxsim":
        return 6.0 * r * c * MAXSIM_LQ * MAXSIM_LD * d
    return 6.0 * r * c * d
