"""Microbenchmarks: every loss, every contender, forward / backward / forward+backward, over batch sizes.

Run ``python -m fused_contrastive bench --help`` (or ``python -m fused_contrastive.bench``). The same
cases run under pytest-benchmark with ``pytest bench/ --benchmark-only``; both build them with
:func:`build_case` from the registries below, so the CLI and pytest cannot drift apart.

What a *case* is
----------------
A case is (loss, contender, N, mode). ``N`` is the number of **anchors**, the rows of the similarity
matrix; the inputs of each loss are listed in :data:`LOSSES` (e.g. SupCon at N takes ``[N/2, 2, D]``
features, so its logits are N x N; supervised SimCSE at N takes N interleaved triplets ``[3N, D]``,
logits N x 2N). Every contender of a case gets the same input values (a seeded generator per loss
and N, cast to ``--dtype``).

Contenders (:func:`contenders`):

* ``reference``: the package's own ``backend="reference"`` (materialises the logits, ``F.cross_entropy``);
  the tests' oracle and the baseline of every ratio and difference. It always runs.
* ``torch`` / ``triton``: our backends (triton only on CUDA; CoSENT has no triton path).
* ``seed-*``: the formulas of the seed blog posts (``/work/shared/seeds``), written from their math:
  ``seed-broadcast`` is ``F.cosine_similarity(x.unsqueeze(1), y.unsqueeze(0), dim=2)`` (it allocates
  N x M x D; skipped where the estimate does not fit the memory cap), ``seed-keras`` Su's l2-normalise,
  dot, ``- eye * 1e12``, ``* 20`` form, ``seed-supcontrast`` SupContrast's algorithm (max shift, 1e-30).
  DSCL has none on purpose: the blog's decoupled code scales logit rows after the max shift, a
  different function from the DSCL definition the package follows (see the seeds' README). CoSENT's
  seed formula *is* the reference's pair matrix.
* ``pml-*``: pytorch-metric-learning's ``NTXentLoss`` and ``SupConLoss`` when installed ("peer not
  installed" otherwise). ``st-*``: the formulas of sentence-transformers' ``MultipleNegativesRankingLoss``
  and ``CoSENTLoss`` reproduced on embeddings (no install needed).

What is measured
----------------
* **Time** (:func:`time_interleaved`, one process per loss and N): every contender that passed its
  memory pass is built side by side and warmed up, then the repeats go round-robin, one step of each
  contender per round, so the drift of a shared machine hits all of them alike. Each step is timed as
  forward (the loss call with inputs that require grad, as in a training step), backward
  (``loss.backward()``) and forward+backward (their sum): the three modes come from the same repeats.
  Median and spread (25th-75th percentile) over ``--repeats`` (fewer, never below 3, for a contender
  whose repeats would exceed ``--max-case-seconds``); host clock on CPU (CPU ops are synchronous),
  CUDA events on GPU. Where the torch backend forms its gradients during the forward (reduced losses
  with A != B, see ``_torch_core``), its forward time includes the gradient matmuls and its backward
  is nearly free: compare forward+backward.
* **Peak memory** (:func:`measure`), each case in isolation. CPU: every case runs in a fresh process
  (forked from a server that only imported the modules). Baseline = resident set (VmRSS) after a small warm-up and
  after the inputs were created; the high-water mark (VmHWM) is reset by writing 5 to
  ``/proc/self/clear_refs``, and peak = VmHWM after the phase - baseline. So peaks exclude the inputs
  (listed separately as ``input_bytes``) and include everything the loss allocates, gradients of the
  inputs included. Backward's peak is measured from the same baseline, so it includes what the forward
  saved. A case that exceeds the cap (``--mem-budget-gb``, lowered to the memory available; enforced as
  an address-space limit over the baseline) is reported as ``oom``. CUDA: ``max_memory_allocated`` over
  ``memory_allocated`` after the inputs.
* **Differences**: max |loss - loss_ref| and max |grad - grad_ref| over all input gradients, against the
  reference run on the same inputs; ``within_tolerance`` applies :data:`TOLERANCES`.
* **Ratios**: contender / reference, time and peak memory, same mode, size and run.
* **Throughput**: every contender is credited with the FLOPs of the textbook formula's matmuls,
  with R x C the logits' shape: forward ``2*R*C*D`` (the logits), backward ``4*R*C*D`` (the gradients of
  both sides), forward+backward ``6*R*C*D``. TFLOP/s = FLOPs / median time, and the fraction of the
  device's matmul peak (the best of a matmul timed at the start and at the end of the run,
  ``meta.matmul_peak``). It can exceed 100% where a backend does less work than the textbook
  formula (the torch backend visits only half the blocks when A is B). CoSENT has no matmul (None).

Cases that do not run are rows too, with a status and a reason; none stops the run:

* ``skipped``: the contender is unavailable (no GPU, peer not installed); or its memory estimate
  exceeds the cap (the broadcast seeds, pml-ntxent); or, to keep the run within its time budget, a
  seed's or peer's step is predicted to exceed ``--max-iter-seconds`` (from its previous size as
  ``t ~ N^time_order``, or at its first size from its memory estimate). Only the memory-bound
  contenders (those with a memory estimate) are skipped for time; one whose cold step in the memory
  pass exceeded the limit keeps its peak and differences but is not timed.
* ``oom``: the case hit the cap while running (or its worker was SIGKILLed, e.g. by the OOM killer).
* ``error`` / ``timeout`` (``--timeout``): anything else.

Largest batch within a memory budget (:func:`largest_batches`): total memory = inputs + peak over
baseline. The peaks measured at the largest sizes a contender ran are fitted (least squares) by its
declared model (``a + bN`` for ours, ``a + bN + cN^2`` for the reference, seeds and most peers,
``a + bN^2 + cN^3`` for pml-ntxent) and solved for the budget. These N are **extrapolated from the
measured points** and labelled so, as is the time at that N (``t ~ N^time_order`` from the largest
timed size).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import fused_contrastive as fc

__all__ = [
    "main",
    "LOSSES",
    "MODES",
    "LossSpec",
    "Contender",
    "Case",
    "Job",
    "TimingJob",
    "BenchParam",
    "contenders",
    "build_case",
    "benchmark_call",
    "measure",
    "time_interleaved",
    "plan_params",
    "run_suite",
    "largest_batches",
    "format_table",
    "write_json",
    "plot",
]

MODES: Tuple[str, ...] = ("forward", "backward", "forward+backward")
DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
#: (loss, gradient) tolerance per dtype: |dloss| <= tol * max(1, |loss_ref|) and
#: max|dgrad| <= tol * max|grad_ref| (every contender computes in the input dtype or wider).
TOLERANCES: Dict[str, Tuple[float, float]] = {
    "float64": (1e-9, 1e-7),
    "float32": (1e-4, 2e-3),
    "float16": (2e-2, 5e-2),
    "bfloat16": (5e-2, 1e-1),
}
GiB = 1 << 30
MiB = 1 << 20
_N_CLASSES = 100  # SupCon / DSCL labels: uniform over 100 classes (CIFAR-100-like)

# Defaults per device and run length. CPU sizes are small because one 4096 x 4096 x 768 matmul already
# takes ~0.6 s on the 2-core reference machine; the default run must stay under 15 minutes there and
# --quick under 2 (issue 4). info_nce also runs at 8192 on CPU: the largest-batch extrapolation needs
# two sizes whose N x N temporaries exceed glibc's 32 MiB mmap threshold (N > ~2900 in float32), see
# _fit. CUDA sizes are the issue's.
_DEFAULTS = {
    ("cpu", False): dict(sizes=(256, 512, 1024, 2048, 4096), repeats=5, max_iter_seconds=10.0,
                         extra_sizes={"info_nce": (8192,)}),
    ("cpu", True): dict(sizes=(256, 1024), repeats=3, max_iter_seconds=2.0),
    ("cuda", False): dict(sizes=(1024, 4096, 16384), repeats=20, max_iter_seconds=30.0),
    ("cuda", True): dict(sizes=(1024, 4096), repeats=5, max_iter_seconds=5.0),
}


# ================================================================================================
# Inputs and losses
# ================================================================================================


@dataclass
class CaseInputs:
    """Tensors of one case: ``diff`` require grad (their gradients are compared), ``aux`` do not."""

    diff: Dict[str, Tensor]
    aux: Dict[str, Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Tensor:
        return self.diff[key] if key in self.diff else self.aux[key]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.diff.values(), *self.aux.values()))

    def grads(self) -> List[Optional[Tensor]]:
        return [t.grad for t in self.diff.values()]

    def zero_grad(self) -> None:
        for t in self.diff.values():
            t.grad = None


Maker = Callable[[int, int, torch.Generator], Tuple[Dict[str, Tensor], Dict[str, Tensor]]]


@dataclass(frozen=True)
class LossSpec:
    """One loss of the public API as benchmarked.

    ``make(n, d, gen)`` returns float32 CPU tensors (differentiable, auxiliary); ``ours(inputs,
    backend)`` calls the public function; ``logits(n)`` is the (rows, cols) of the similarity matrix
    the textbook formula materialises (None when there is no matmul: CoSENT).
    """

    name: str
    inputs: str
    logits: Optional[Callable[[int], Tuple[int, int]]]
    make: Maker
    ours: Callable[[CaseInputs, str], Tensor]
    has_triton: bool = True

    def flops(self, n: int, d: int, mode: str) -> Optional[float]:
        """FLOPs credited to every contender (the naive formula's matmuls), see the module docstring."""
        if self.logits is None:
            return None
        r, c = self.logits(n)
        per = {"forward": 2, "backward": 4, "forward+backward": 6}[mode]
        return float(per) * r * c * d


def _randn(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=gen)


def _labels(gen: torch.Generator, n: int, classes: int = _N_CLASSES) -> Tensor:
    return torch.randint(0, classes, (n,), generator=gen)


def _views(n: int, d: int, gen: torch.Generator, bsz: int):
    return {"features": _randn(gen, bsz, 2, d)}, {"labels": _labels(gen, bsz)}


LOSSES: Dict[str, LossSpec] = {
    s.name: s
    for s in (
        LossSpec(
            "info_nce", "query [N, D], keys [N, D]; logits N x N", lambda n: (n, n),
            lambda n, d, g: ({"query": _randn(g, n, d), "keys": _randn(g, n, d)}, {}),
            lambda x, be: fc.info_nce(x["query"], x["keys"], temperature=0.05, backend=be),
        ),
        LossSpec(
            "simcse", "interleaved z [N, D] (N/2 sentences x 2 views); logits N x N", lambda n: (n, n),
            lambda n, d, g: ({"z": _randn(g, n, d)}, {}),
            lambda x, be: fc.simcse_loss(x["z"], temperature=0.05, backend=be),
        ),
        LossSpec(
            "simcse_2view", "z1 [N, D], z2 [N, D]; logits N x N", lambda n: (n, n),
            lambda n, d, g: ({"z1": _randn(g, n, d), "z2": _randn(g, n, d)}, {}),
            lambda x, be: fc.simcse_loss(x["z1"], x["z2"], temperature=0.05, backend=be),
        ),
        LossSpec(
            "simcse_sup", "interleaved triplets z [3N, D]; logits N x 2N", lambda n: (n, 2 * n),
            lambda n, d, g: ({"z": _randn(g, 3 * n, d)}, {}),
            lambda x, be: fc.simcse_sup_loss(x["z"], temperature=0.05, backend=be),
        ),
        LossSpec(
            "supcon_out", "features [N/2, 2, D], labels [N/2] (100 classes); logits N x N", lambda n: (n, n),
            lambda n, d, g: _views(n, d, g, n // 2),
            lambda x, be: fc.supcon_loss(x["features"], x["labels"], temperature=0.07, variant="out", backend=be),
        ),
        LossSpec(
            "supcon_in", "features [N/2, 2, D], labels [N/2] (100 classes); logits N x N", lambda n: (n, n),
            lambda n, d, g: _views(n, d, g, n // 2),
            lambda x, be: fc.supcon_loss(x["features"], x["labels"], temperature=0.07, variant="in", backend=be),
        ),
        LossSpec(
            "dscl", "features [N, 2, D], labels [N] (100 classes); logits N x 2N", lambda n: (n, 2 * n),
            lambda n, d, g: _views(n, d, g, n),
            lambda x, be: fc.dscl_loss(x["features"], x["labels"], beta=8.0, temperature=0.07, backend=be),
        ),
        LossSpec(
            "clip", "a [N, D], b [N, D], logit_scale 1/0.07; logits N x N (rows and columns)", lambda n: (n, n),
            lambda n, d, g: ({"a": _randn(g, n, d), "b": _randn(g, n, d)}, {}),
            lambda x, be: fc.clip_loss(x["a"], x["b"], 1 / 0.07, backend=be),
        ),
        LossSpec(
            "cosent", "u [N, D], v [N, D], labels [N] (grades 0..5); N x N label pairs", None,
            lambda n, d, g: ({"u": _randn(g, n, d), "v": _randn(g, n, d)},
                             {"labels": torch.randint(0, 6, (n,), generator=g).float()}),
            lambda x, be: fc.cosent_loss(x["u"], x["v"], x["labels"], scale=20.0, backend=be),
            has_triton=False,
        ),
    )
}


def make_inputs(loss: str, n: int, d: int, dtype: torch.dtype, device: torch.device) -> CaseInputs:
    """The inputs of ``loss`` at N anchors: the same values for every contender (seeded per loss, N, D)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{loss}:{n}:{d}".encode()))
    diff, aux = LOSSES[loss].make(n, d, gen)
    return CaseInputs(
        diff={k: v.to(device=device, dtype=dtype).requires_grad_(True) for k, v in diff.items()},
        aux={k: v.to(device) for k, v in aux.items()},
    )


# ================================================================================================
# Seeds' formulas (written from the blog posts' math, /work/shared/seeds) and peers
# ================================================================================================


def _broadcast_cos(x: Tensor, y: Tensor) -> Tensor:
    """The seeds' similarity matrix: cosine of every pair by broadcasting (allocates N x M x D)."""
    return F.cosine_similarity(x.unsqueeze(1), y.unsqueeze(0), dim=2)


def _partner(n: int, device: torch.device) -> Tensor:
    """Interleaved pairs: row i's positive is ``i + 1 - (i % 2) * 2``."""
    idx = torch.arange(n, device=device)
    return idx + 1 - idx % 2 * 2


def seed_broadcast_pairs(q: Tensor, k: Tensor, temperature: float = 0.05) -> Tensor:
    """SimCSE's two-view loss as in the seeds: broadcast cosine / t, cross-entropy on the diagonal."""
    sim = _broadcast_cos(q, k) / temperature
    return F.cross_entropy(sim, torch.arange(q.shape[0], device=q.device))


def seed_broadcast_simcse(z: Tensor, temperature: float = 0.05) -> Tensor:
    """Seed 000/002 unsupervised SimCSE: broadcast cosine, ``- eye * 1e12``, ``/ t``, cross-entropy."""
    n = z.shape[0]
    sim = _broadcast_cos(z, z) - torch.eye(n, device=z.device, dtype=z.dtype) * 1e12
    return F.cross_entropy(sim / temperature, _partner(n, z.device))


def seed_keras_simcse(z: Tensor) -> Tensor:
    """Seed 004 (Su's Keras loss): l2-normalise, dot, ``- eye * 1e12``, ``* 20``, cross-entropy."""
    n = z.shape[0]
    zn = F.normalize(z, dim=1)
    sim = (zn @ zn.T - torch.eye(n, device=z.device, dtype=z.dtype) * 1e12) * 20
    return F.cross_entropy(sim, _partner(n, z.device))


def seed_broadcast_simcse_sup(z: Tensor, temperature: float = 0.05) -> Tensor:
    """Seed 000 supervised SimCSE on interleaved triplets: broadcast cosine over all 3N rows, keep the
    anchor rows (0::3) and the non-anchor columns; the target of anchor k is column 2k."""
    rows = torch.arange(0, z.shape[0], 3, device=z.device)
    cols = torch.nonzero(torch.arange(z.shape[0], device=z.device) % 3 != 0).squeeze(1)
    sim = _broadcast_cos(z, z).index_select(0, rows).index_select(1, cols)
    target = torch.arange(0, cols.shape[0], 2, device=z.device)
    return F.cross_entropy(sim / temperature, target)


def seed_supcontrast(features: Tensor, labels: Tensor, temperature: float = 0.07,
                     base_temperature: float = 0.07) -> Tensor:
    """Seed 003 (SupContrast's algorithm, L_out, contrast_mode "all") on l2-normalised features:
    logits shifted by their row max, ``log(sum exp + 1e-30)``, mean log-probability over positives."""
    f = F.normalize(features, dim=-1)
    bsz, n_views = f.shape[0], f.shape[1]
    contrast = torch.cat(torch.unbind(f, dim=1), dim=0)
    dots = contrast @ contrast.T / temperature
    logits = dots - dots.max(dim=1, keepdim=True).values.detach()
    mask = (labels[:, None] == labels[None, :]).to(f.dtype).repeat(n_views, n_views)
    n = contrast.shape[0]
    logits_mask = torch.ones_like(mask).scatter(1, torch.arange(n, device=f.device)[:, None], 0)
    mask = mask * logits_mask
    log_prob = logits - torch.log((torch.exp(logits) * logits_mask).sum(1, keepdim=True) + 1e-30)
    n_pos = mask.sum(1)
    n_pos = torch.where(n_pos < 1e-6, torch.ones_like(n_pos), n_pos)
    mean_log_prob_pos = (mask * log_prob).sum(1) / n_pos
    return (-(temperature / base_temperature) * mean_log_prob_pos).view(n_views, bsz).mean()


def st_mnrl(anchors: Tensor, candidates: Tensor, scale: float = 20.0) -> Tensor:
    """sentence-transformers MultipleNegativesRankingLoss on embeddings: ``cos_sim(a, c) * scale``,
    cross-entropy with target ``arange`` (candidates = positives, then hard negatives)."""
    scores = F.normalize(anchors, p=2, dim=1) @ F.normalize(candidates, p=2, dim=1).T * scale
    return F.cross_entropy(scores, torch.arange(anchors.shape[0], device=anchors.device))


def st_cosent(u: Tensor, v: Tensor, labels: Tensor, scale: float = 20.0) -> Tensor:
    """sentence-transformers CoSENTLoss on embeddings: pair-score differences masked with ``- 1e12``
    where the label order does not hold, a 0 prepended, logsumexp (a B x B matrix)."""
    scores = (F.normalize(u, p=2, dim=1) * F.normalize(v, p=2, dim=1)).sum(dim=1) * scale
    diff = scores[:, None] - scores[None, :]
    ordered = (labels[:, None] < labels[None, :]).to(diff.dtype)
    diff = diff - (1 - ordered) * 1e12
    return torch.logsumexp(torch.cat([torch.zeros(1, dtype=diff.dtype, device=diff.device), diff.view(-1)]), dim=0)


def _pml():
    """pytorch_metric_learning.losses, or None when not installed."""
    try:
        from pytorch_metric_learning import losses
    except ImportError:
        return None
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


# ================================================================================================
# Contenders
# ================================================================================================

Estimate = Callable[[int, int, int], float]  # (N, D, itemsize) -> peak bytes


@dataclass(frozen=True)
class Contender:
    """One implementation of a loss.

    Attributes:
        kind: "reference", "ours", "seed" or "peer".
        memory_order / time_order: growth of peak memory / time with N at fixed D (1 linear, 2
            quadratic, 3 cubic); memory_order picks the fit of :func:`largest_batches`, time_order
            predicts whether the next size fits ``--max-iter-seconds``.
        estimate: peak bytes before running, for contenders whose memory can explode
            (checked against the memory cap so the case is skipped, not attempted); ``memory_note``
            says why in the skip reason.
        requires: an importable module the contender needs (a peer package).
    """

    name: str
    kind: str
    fn: Callable[[CaseInputs], Tensor]
    source: str
    memory_order: int
    time_order: int = 2
    estimate: Optional[Estimate] = None
    requires: Optional[str] = None
    backend: Optional[str] = None
    memory_note: str = ""


def _ours(spec: LossSpec) -> List[Contender]:
    return [
        Contender("reference", "reference", lambda x: spec.ours(x, "reference"),
                  'fused_contrastive backend="reference" (naive, materialises the logits)', 2, backend="reference"),
        Contender("torch", "ours", lambda x: spec.ours(x, "torch"),
                  'fused_contrastive backend="torch" (chunked, O(N*D) memory)', 1,
                  time_order=2 if spec.logits is not None else 1, backend="torch"),  # CoSENT: O(N log N)
        Contender("triton", "ours", lambda x: spec.ours(x, "triton"),
                  'fused_contrastive backend="triton" (fused kernels, CUDA)', 1, backend="triton"),
    ]


def _bcast(rows_of: Callable[[int], int]) -> Estimate:
    """Measured peak of the broadcast-cosine seeds: 6 tensors of R x R x D (3 in forward)."""
    return lambda n, d, isz: 6.0 * rows_of(n) ** 2 * d * isz


def _ntxent(neg_per_anchor: Callable[[int], int]) -> Estimate:
    """PML NTXentLoss builds a [positive pairs, negative pairs] matrix: ~(4 * itemsize + 1) bytes per
    element measured (float32: 17 N^3 bytes for N anchors with one positive each)."""
    return lambda n, d, isz: float(n) * n * neg_per_anchor(n) * (4 * isz + 1)


_PML = "pytorch_metric_learning"
_BCAST_NOTE = "N x N x D cosine broadcast"
_NTXENT_NOTE = "[pos pairs x neg pairs] matrix, 17 N^3 B"
_EXTRA: Dict[str, List[Contender]] = {
    "info_nce": [
        Contender("seed-broadcast", "seed", lambda x: seed_broadcast_pairs(x["query"], x["keys"]),
                  "seeds 000/003: F.cosine_similarity broadcast to N x N x D", 2, 3, _bcast(lambda n: n),
                  memory_note=_BCAST_NOTE),
        Contender("st-mnrl", "peer", lambda x: st_mnrl(x["query"], x["keys"]),
                  "sentence-transformers MultipleNegativesRankingLoss formula (scale 20)", 2),
        Contender("pml-ntxent", "peer", lambda x: pml_ntxent_pairs(x["query"], x["keys"]),
                  "pytorch-metric-learning NTXentLoss(ref_emb=keys)", 3, 3, _ntxent(lambda n: n - 1), _PML,
                  memory_note=_NTXENT_NOTE),
    ],
    "simcse": [
        Contender("seed-broadcast", "seed", lambda x: seed_broadcast_simcse(x["z"]),
                  "seeds 000/002: F.cosine_similarity broadcast, - eye * 1e12, / 0.05", 2, 3, _bcast(lambda n: n),
                  memory_note=_BCAST_NOTE),
        Contender("seed-keras", "seed", lambda x: seed_keras_simcse(x["z"]),
                  "seed 004: l2_normalize, dot, - eye * 1e12, * 20, cross-entropy", 2),
        Contender("pml-ntxent", "peer", lambda x: pml_ntxent_interleaved(x["z"]),
                  "pytorch-metric-learning NTXentLoss(labels = i // 2)", 3, 3, _ntxent(lambda n: n - 2), _PML,
                  memory_note=_NTXENT_NOTE),
    ],
    "simcse_2view": [
        Contender("seed-broadcast", "seed", lambda x: seed_broadcast_pairs(x["z1"], x["z2"]),
                  "seeds 000/003: F.cosine_similarity broadcast to N x N x D", 2, 3, _bcast(lambda n: n),
                  memory_note=_BCAST_NOTE),
        Contender("st-mnrl", "peer", lambda x: st_mnrl(x["z1"], x["z2"]),
                  "sentence-transformers MultipleNegativesRankingLoss formula (scale 20)", 2),
        Contender("pml-ntxent", "peer", lambda x: pml_ntxent_pairs(x["z1"], x["z2"]),
                  "pytorch-metric-learning NTXentLoss(ref_emb=z2)", 3, 3, _ntxent(lambda n: n - 1), _PML,
                  memory_note=_NTXENT_NOTE),
    ],
    "simcse_sup": [
        Contender("seed-broadcast", "seed", lambda x: seed_broadcast_simcse_sup(x["z"]),
                  "seed 000 supervised: broadcast cosine over all 3N rows (3N x 3N x D), index_select",
                  2, 3, _bcast(lambda n: 3 * n), memory_note="3N x 3N x D cosine broadcast"),
        Contender("st-mnrl", "peer",
                  lambda x: st_mnrl(x["z"][0::3], torch.cat([x["z"][1::3], x["z"][2::3]])),
                  "sentence-transformers MultipleNegativesRankingLoss formula with hard negatives", 2),
    ],
    "supcon_out": [
        Contender("seed-supcontrast", "seed", lambda x: seed_supcontrast(x["features"], x["labels"]),
                  "seed 003: SupContrast's algorithm (max shift, 1e-30) on normalised features", 2),
        Contender("pml-supcon", "peer", lambda x: pml_supcon(x["features"], x["labels"]),
                  "pytorch-metric-learning SupConLoss(temperature=0.07)", 2, requires=_PML),
    ],
    "cosent": [
        Contender("st-cosent", "peer", lambda x: st_cosent(x["u"], x["v"], x["labels"]),
                  "sentence-transformers CoSENTLoss formula (scale 20)", 2),
    ],
}


def contenders(loss: str) -> List[Contender]:
    """Every contender of ``loss``: reference, torch, triton, then the seeds and peers that fit it."""
    return _ours(LOSSES[loss]) + _EXTRA.get(loss, [])


def get_contender(loss: str, name: str) -> Contender:
    for c in contenders(loss):
        if c.name == name:
            return c
    raise KeyError(f"no contender {name!r} for loss {loss!r}")


def unavailable(spec: LossSpec, con: Contender, device: torch.device) -> Optional[str]:
    """Why ``con`` cannot run on ``device`` (None when it can)."""
    if con.backend == "triton":
        if not spec.has_triton:
            return "no triton kernel for this loss (its torch path is O(B log B) already)"
        if device.type != "cuda":
            return "no GPU: the triton backend runs on CUDA (the CPU interpreter is for tests only)"
        from . import _dispatch

        if not _dispatch.triton_available():
            return "triton backend not importable"
    if con.requires is not None:
        try:
            __import__(con.requires)
        except ImportError:
            return f"peer not installed (pip install {con.requires.replace('_', '-')})"
    return None


# ================================================================================================
# One case, shared by the CLI and pytest-benchmark
# ================================================================================================


@dataclass
class Case:
    """A contender bound to concrete inputs: ``forward()``, ``backward(loss)``, ``step()``."""

    spec: LossSpec
    contender: Contender
    n: int
    d: int
    inputs: CaseInputs

    def forward(self) -> Tensor:
        return self.contender.fn(self.inputs)

    @staticmethod
    def backward(loss: Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        self.inputs.zero_grad()

    def step(self) -> Tensor:
        """One training step of the loss: clear gradients, forward, backward."""
        self.zero_grad()
        loss = self.forward()
        loss.backward()
        return loss.detach()


def build_case(loss: str, contender: str, n: int, d: int, dtype: torch.dtype, device: torch.device) -> Case:
    """The case (loss, contender) at N anchors and dimension D, inputs created on ``device``."""
    return Case(LOSSES[loss], get_contender(loss, contender), n, d, make_inputs(loss, n, d, dtype, device))


def benchmark_call(case: Case, mode: str) -> Tuple[Callable[..., None], Callable[[], Any]]:
    """(target, setup) for pytest-benchmark's ``benchmark.pedantic`` timing ``mode`` of ``case``.

    pytest-benchmark uses the host clock, so on CUDA the target synchronises before returning.
    ``backward``'s setup runs the (untimed) forward and hands the loss to the target.
    """
    dev = next(iter(case.inputs.diff.values())).device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def forward() -> None:
        case.forward()
        sync()

    def backward(loss: Tensor) -> None:
        loss.backward()
        sync()

    def forward_backward() -> None:
        case.step()
        sync()

    def clear() -> None:
        case.zero_grad()
        sync()

    def run_forward() -> Tuple[Tuple[Tensor], Dict[str, Any]]:
        case.zero_grad()
        loss = case.forward()
        sync()
        return (loss,), {}

    calls = {"forward": (forward, clear), "backward": (backward, run_forward),
             "forward+backward": (forward_backward, clear)}
    if mode not in calls:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return calls[mode]


#: Throughput of the memory-bound contenders (those with a memory estimate), measured on the 2-core
#: CPU: a step takes ~1 s per 0.5 GB of their estimate. Used to predict steps too slow to time.
_MEMORY_BOUND_BYTES_PER_S = 5e8


def skip_reason(loss: str, con: Contender, n: int, d: int, dtype: torch.dtype, device: torch.device,
                mem_cap: float, max_iter_seconds: Optional[float] = None) -> Optional[str]:
    """Why the case is not attempted: unavailable; or its memory estimate exceeds ``mem_cap``; or
    (a memory-bound seed or peer) its step is predicted from that estimate to exceed
    ``max_iter_seconds``."""
    why = unavailable(LOSSES[loss], con, device)
    if why is not None or con.estimate is None:
        return why
    need = con.estimate(n, d, torch.empty((), dtype=dtype).element_size())
    if need > mem_cap:
        return f"would need ~{need / GiB:.1f} GiB ({con.memory_note}) > cap {mem_cap / GiB:.1f} GiB"
    step = need / _MEMORY_BOUND_BYTES_PER_S
    if max_iter_seconds is not None and con.kind in ("seed", "peer") and step > max_iter_seconds:
        return (f"predicted ~{step:.0f} s per step (~1 s per 0.5 GB of its {con.memory_note}) > "
                f"max {max_iter_seconds:g} s per step")
    return None


@dataclass(frozen=True)
class BenchParam:
    """One pytest-benchmark parameter: a case that runs, or is skipped with ``skip``."""

    loss: str
    contender: str
    n: int
    skip: Optional[str]

    @property
    def id(self) -> str:
        return f"{self.loss}-{self.contender}-N{self.n}"


def plan_params(losses: Sequence[str], sizes: Sequence[int], d: int, dtype: torch.dtype, device: torch.device,
                *, backends: Sequence[str] = ("reference", "torch", "triton"), seeds: bool = True,
                peers: bool = True, mem_cap: float = 16 * GiB, max_iter_seconds: Optional[float] = None,
                extra_sizes: Optional[Dict[str, Sequence[int]]] = None) -> List[BenchParam]:
    """The (loss, contender, N) grid of a run, in run order (by size, then loss, reference first), with
    the static skip reasons of :func:`skip_reason`. ``extra_sizes`` adds sizes for some losses only."""
    extra = extra_sizes or {}
    out = []
    for n in sorted(set(sizes).union(*extra.values())):
        for loss in losses:
            if n not in sizes and n not in extra.get(loss, ()):
                continue
            for con in contenders(loss):
                if con.kind == "ours" and con.name not in backends:
                    continue
                if (con.kind == "seed" and not seeds) or (con.kind == "peer" and not peers):
                    continue
                why = skip_reason(loss, con, n, d, dtype, device, mem_cap, max_iter_seconds)
                out.append(BenchParam(loss, con.name, n, why))
    return out


# ================================================================================================
# Measurement of one case (run in a fresh process on CPU)
# ================================================================================================


@dataclass(frozen=True)
class Job:
    """The memory pass of one case (plain values: it crosses a process boundary)."""

    loss: str
    contender: str
    n: int
    dim: int
    dtype: str
    device: str
    mem_cap: float
    ref_path: str  # the reference saves its loss and gradients here; the others compare against it
    isolated: bool = True  # a fresh process: the peak RSS is this case's alone, the memory cap may be set
    threads: Optional[int] = None  # torch.set_num_threads in the worker (None: torch's default)


@dataclass(frozen=True)
class TimingJob:
    """The timing pass of one (loss, N): every contender that passed its memory pass, interleaved."""

    loss: str
    contenders: Tuple[str, ...]
    repeats: Tuple[int, ...]  # per contender
    n: int
    dim: int
    dtype: str
    device: str
    warmup: int
    threads: Optional[int] = None


def _proc_status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmSize"):
                out[key] = int(val.split()[0]) * 1024
    return out


class _CpuMeter:
    """Peak RSS over a baseline in this (fresh) process; see the module docstring."""

    method = ("CPU: fresh process per case; peak = VmHWM - VmRSS after inputs, VmHWM reset through "
              "/proc/self/clear_refs; cap = address-space limit over the baseline")

    def __init__(self, isolated: bool) -> None:
        self.base = 0
        self.isolated = isolated
        if not isolated:
            self.method = ("CPU inline (not isolated): VmHWM - VmRSS after inputs; freed-but-cached memory "
                           "may hide allocations")

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")

    def start(self, cap: float) -> None:
        gc.collect()
        st = _proc_status()
        self.base = st["VmRSS"]
        self._reset()
        if not self.isolated:
            return
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = int(st["VmSize"] + cap)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    def peak(self) -> int:
        return max(0, _proc_status()["VmHWM"] - self.base)

    def next_phase(self) -> None:
        self._reset()

    @staticmethod
    def sync() -> None:
        pass


class _CudaMeter:
    method = "CUDA: torch.cuda.max_memory_allocated - memory_allocated after the inputs"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def start(self, cap: float) -> None:
        gc.collect()
        self.sync()
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.sync()
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)

    def next_phase(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in msg for s in ("can't allocate memory", "out of memory", "not enough memory", "cannot allocate memory")
    )


def _time_step(case: Case, device: torch.device) -> Tuple[float, float]:
    """Seconds of one forward and one backward (CUDA events on GPU, host clock on CPU: CPU ops are
    synchronous)."""
    case.zero_grad()
    if device.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        loss = case.forward()
        ev[1].record()
        loss.backward()
        ev[2].record()
        torch.cuda.synchronize(device)
        return ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3
    t0 = time.perf_counter()
    loss = case.forward()
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


def _error(exc: BaseException) -> Dict[str, str]:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return {"status": "oom" if _is_oom(exc) else "error", "reason": f"{type(exc).__name__}: {text}"}


def _warm_n(n: int) -> int:
    return min(n, 32)


def _compare(loss_value: float, grads: List[Optional[Tensor]], ref: Dict[str, Any]) -> Dict[str, Any]:
    d_loss = abs(loss_value - ref["loss"])
    d_grad = 0.0
    scale = 0.0
    for g, r in zip(grads, ref["grads"]):
        if g is None or r is None:
            d_grad = math.inf
            continue
        r64 = r.to(torch.float64)
        d_grad = max(d_grad, float((g.detach().cpu().to(torch.float64) - r64).abs().max()))
        scale = max(scale, float(r64.abs().max()))
    return {"max_abs_diff_loss": d_loss, "max_abs_diff_grad": d_grad, "ref_grad_scale": scale,
            "ref_loss": ref["loss"]}


def measure(job: Job) -> Dict[str, Any]:
    """The memory pass of one case, in a fresh process: a small warm-up (lazy initialisation, thread
    pool), the inputs, then one forward and one backward with the peak of each over the baseline, and
    the differences to the reference (which saves its loss and gradients to ``job.ref_path``).

    Returns ``status`` ("ok", "oom", "error"), ``reason``, ``peaks`` {mode: bytes}, ``input_bytes``,
    ``first_seconds`` (the cold step), ``loss_value`` and the difference fields.
    """
    device = torch.device(job.device)
    dtype = DTYPES[job.dtype]
    meter: Any = _CpuMeter(job.isolated) if device.type == "cpu" else _CudaMeter(device)
    res: Dict[str, Any] = {"status": "ok", "reason": "", "memory_method": meter.method}
    case = None
    if job.threads:
        torch.set_num_threads(job.threads)
    try:
        build_case(job.loss, job.contender, _warm_n(job.n), job.dim, dtype, device).step()
        case = build_case(job.loss, job.contender, job.n, job.dim, dtype, device)
        res["input_bytes"] = case.inputs.nbytes()
        meter.start(job.mem_cap)
        t0 = time.perf_counter()
        loss = case.forward()
        meter.sync()
        peak_f = meter.peak()
        meter.next_phase()
        loss.backward()
        meter.sync()
        res["first_seconds"] = time.perf_counter() - t0
        peak_b = meter.peak()
        res["peaks"] = {"forward": peak_f, "backward": peak_b, "forward+backward": max(peak_f, peak_b)}
        res["loss_value"] = float(loss.detach())
        del loss
        grads = case.inputs.grads()
        if job.contender == "reference":
            torch.save({"loss": res["loss_value"], "grads": [None if g is None else g.detach().cpu() for g in grads]},
                       job.ref_path)
        elif os.path.exists(job.ref_path):
            res.update(_compare(res["loss_value"], grads, torch.load(job.ref_path)))
    except Exception as exc:  # noqa: BLE001 - a case must never crash the run
        res.update(_error(exc))
    finally:
        del case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def time_interleaved(job: TimingJob) -> Dict[str, Dict[str, Any]]:
    """The timing pass of one (loss, N): every contender's case built side by side, ``job.warmup``
    untimed steps each, then rounds in which each contender times one step (forward, backward) while
    it has repeats left. Interleaving spreads the drift of a shared, noisy machine over all contenders,
    so the ratios compare like with like. Returns {contender: {"times": {mode: [s]}, "repeats": r}} or
    {contender: {"status", "reason"}} for one that failed here."""
    device = torch.device(job.device)
    dtype = DTYPES[job.dtype]
    if job.threads:
        torch.set_num_threads(job.threads)
    out: Dict[str, Dict[str, Any]] = {}
    cases: Dict[str, Case] = {}
    fwd: Dict[str, List[float]] = {}
    bwd: Dict[str, List[float]] = {}
    todo = dict(zip(job.contenders, job.repeats))
    for name in job.contenders:
        try:
            cases[name] = build_case(job.loss, name, job.n, job.dim, dtype, device)
            for _ in range(job.warmup):
                cases[name].step()
        except Exception as exc:  # noqa: BLE001
            out[name] = _error(exc)
            cases.pop(name, None)
        fwd[name], bwd[name] = [], []
    for r in range(max(job.repeats, default=0)):
        for name, case in list(cases.items()):
            if r >= todo[name]:
                continue
            try:
                f, b = _time_step(case, device)
            except Exception as exc:  # noqa: BLE001
                out[name] = _error(exc)
                del cases[name]
                continue
            fwd[name].append(f)
            bwd[name].append(b)
    for name in cases:
        out[name] = {"repeats": len(fwd[name]), "times": {
            "forward": fwd[name], "backward": bwd[name],
            "forward+backward": [a + b for a, b in zip(fwd[name], bwd[name])]}}
    cases.clear()
    if device.type == "cuda":  # inline on CUDA: hand the memory back before the next pass
        gc.collect()
        torch.cuda.empty_cache()
    return out


def matmul_peak(device: str, dtype: str, dim: int) -> Dict[str, Any]:
    """Best FLOP/s of one matmul on ``device``: CPU [4096, D] @ [D, 4096] (the shape of the largest
    default case's logits), CUDA 8192^3; the best of several runs."""
    dev = torch.device(device)
    dt = DTYPES[dtype]
    if dev.type == "cuda":
        m, k, n, reps = 8192, 8192, 8192, 20
    else:
        m, k, n, reps = 4096, max(dim, 256), 4096, 3
    a = torch.randn(m, k, device=dev).to(dt)
    b = torch.randn(k, n, device=dev).to(dt)
    best = math.inf
    for _ in range(reps + 1):  # the first is a warm-up that can only lose the min
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            a @ b
            e1.record()
            torch.cuda.synchronize(dev)
            best = min(best, e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return {"flops_per_s": 2.0 * m * k * n / best, "shape": [m, k, n], "dtype": dtype}


# ================================================================================================
# Running many cases: isolation, progress
# ================================================================================================


_TASKS: Dict[str, Callable[[Any], Dict[str, Any]]] = {
    "measure": measure,
    "time": time_interleaved,
    "matmul_peak": lambda arg: matmul_peak(*arg),
}


def _child(conn, what: str, arg: Any) -> None:
    """Worker entry (a fresh process): run task ``what`` on ``arg`` and send back the result."""
    try:
        out = _TASKS[what](arg)
    except BaseException as exc:  # noqa: BLE001
        out = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    conn.send(out)
    conn.close()


class _Runner:
    """Runs a task inline, or in a fresh process forked from a server that only imported the modules
    (so each case's memory is its own and a crash or kernel OOM kill only loses that case)."""

    def __init__(self, isolate: bool) -> None:
        self.isolate = isolate
        self.ctx = None
        if isolate:
            import multiprocessing as mp

            self.ctx = mp.get_context("forkserver")
            # everything a case imports, so every worker runs the code as it was when the run started
            preload = ["torch", "fused_contrastive", "fused_contrastive._torch_core", "fused_contrastive.bench"]
            if _pml() is not None:
                preload.append("pytorch_metric_learning.losses")
            self.ctx.set_forkserver_preload(preload)

    def __call__(self, what: str, arg: Any, timeout: float) -> Dict[str, Any]:
        if not self.isolate:
            return _TASKS[what](arg)
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_child, args=(send, what, arg), daemon=True)
        proc.start()
        send.close()
        out: Optional[Dict[str, Any]] = None
        try:
            if recv.poll(timeout):
                out = recv.recv()
        except EOFError:
            out = None
        if out is None and proc.is_alive():
            proc.kill()
            proc.join()
            return {"status": "timeout", "reason": f"no result within {timeout:.0f} s (killed)"}
        proc.join()
        if out is None:
            code = proc.exitcode
            hint = " (SIGKILL: likely the kernel's OOM killer)" if code == -9 else ""
            return {"status": "oom" if code == -9 else "error", "reason": f"worker exited with code {code}{hint}"}
        return out


class _Progress:
    """A dependency-free progress bar on stderr, weighted by each case's expected cost."""

    def __init__(self, total: float, count: int, stream=None) -> None:
        self.total, self.count = max(total, 1e-9), count
        self.done_w, self.done = 0.0, 0
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, weight: float, label: str) -> None:
        self.done += 1
        self.done_w += weight
        frac = min(1.0, self.done_w / self.total)
        el = time.perf_counter() - self.t0
        eta = el * (1 - frac) / frac if frac > 0 else 0.0
        bar = "#" * int(28 * frac) + "-" * (28 - int(28 * frac))
        msg = f"[{bar}] {self.done}/{self.count} {_dur(el)} eta ~{_dur(eta)}  {label}"
        if self.tty:
            width = shutil.get_terminal_size((120, 20)).columns - 1
            self.stream.write("\r" + msg[:width].ljust(width))
            if self.done == self.count:
                self.stream.write("\n")
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


# ================================================================================================
# The suite
# ================================================================================================


@dataclass
class Config:
    """One run of the suite, as parsed from the command line (see :func:`parse_args`)."""

    losses: List[str]
    sizes: List[int]
    dim: int
    dtype: str
    device: str
    backends: List[str]
    seeds: bool
    peers: bool
    repeats: int
    warmup: int
    out: str
    mem_budget: float
    mem_cap: float
    max_iter_seconds: float
    max_case_seconds: float
    timeout: float
    isolate: bool
    plots: bool
    threads: Optional[int] = None
    extra_sizes: Dict[str, List[int]] = field(default_factory=dict)  # sizes run for some losses only


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _rows_of(p: BenchParam, cfg: Config, res: Dict[str, Any], device_name: str) -> List[Dict[str, Any]]:
    spec = LOSSES[p.loss]
    con = get_contender(p.loss, p.contender)
    rows = []
    shape = spec.logits(p.n) if spec.logits is not None else (p.n, p.n)
    tol_l, tol_g = TOLERANCES[cfg.dtype]
    for mode in MODES:
        row: Dict[str, Any] = {
            "loss": p.loss, "inputs": spec.inputs, "contender": p.contender, "kind": con.kind, "source": con.source,
            "n": p.n, "rows": shape[0], "cols": shape[1], "dim": cfg.dim, "dtype": cfg.dtype, "device": cfg.device,
            "device_name": device_name, "version": fc.__version__,
            "mode": mode, "status": res.get("status", "error"), "reason": res.get("reason", ""),
            "repeats": res.get("repeats"), "time_ms": None, "time_ms_p25": None, "time_ms_p75": None,
            "time_ms_min": None, "time_ms_max": None, "peak_bytes": None, "input_bytes": res.get("input_bytes"),
            "time_ratio_vs_reference": None, "memory_ratio_vs_reference": None, "loss_value": res.get("loss_value"),
            "max_abs_diff_loss": res.get("max_abs_diff_loss"), "max_abs_diff_grad": res.get("max_abs_diff_grad"),
            "ref_grad_scale": res.get("ref_grad_scale"), "within_tolerance": None,
            "flops": spec.flops(p.n, cfg.dim, mode), "tflops": None, "fraction_of_matmul_peak": None,
            "memory_order": con.memory_order, "memory_method": res.get("memory_method"),
            "memory_pass_seconds": res.get("memory_pass_seconds"),
            "timing_pass_seconds": res.get("timing_pass_seconds"),
        }
        if "peaks" in res:  # the memory pass ran (also for a seed or peer then left untimed)
            row["peak_bytes"] = res["peaks"][mode]
        if row["max_abs_diff_loss"] is not None:
            row["within_tolerance"] = bool(
                row["max_abs_diff_loss"] <= tol_l * max(1.0, abs(res["ref_loss"]))
                and row["max_abs_diff_grad"] <= tol_g * max(res["ref_grad_scale"], 1e-30) + 1e-12
            )
        if res.get("status") == "ok":
            ms = [t * 1e3 for t in res["times"][mode]]
            row.update(time_ms=statistics.median(ms), time_ms_p25=_quantile(ms, 0.25), time_ms_p75=_quantile(ms, 0.75),
                       time_ms_min=min(ms), time_ms_max=max(ms))
            if row["flops"] is not None:
                row["tflops"] = row["flops"] / (row["time_ms"] / 1e3) / 1e12
        rows.append(row)
    return rows


def _add_ratios(rows: List[Dict[str, Any]]) -> None:
    ref = {(r["loss"], r["n"], r["mode"]): r for r in rows if r["contender"] == "reference"}
    for r in rows:
        b = ref.get((r["loss"], r["n"], r["mode"]))
        if b is None:
            continue
        if r["time_ms"] is not None and b["time_ms"]:
            r["time_ratio_vs_reference"] = r["time_ms"] / b["time_ms"]
        if r["peak_bytes"] is not None and b["peak_bytes"]:
            r["memory_ratio_vs_reference"] = r["peak_bytes"] / b["peak_bytes"]


def _step_cost(p: BenchParam, cfg: Config) -> float:
    """Rough seconds of one step, for the progress bar's ETA only: the textbook FLOPs at 40 GFLOP/s,
    or for the memory-bound contenders ``estimate / _MEMORY_BOUND_BYTES_PER_S``."""
    if p.skip:
        return 0.0
    con = get_contender(p.loss, p.contender)
    step = (LOSSES[p.loss].flops(p.n, cfg.dim, "forward+backward") or 6.0 * p.n * p.n) / 4e10
    if con.estimate is not None:
        isz = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
        step = max(step, con.estimate(p.n, cfg.dim, isz) / _MEMORY_BOUND_BYTES_PER_S)
    return step


def _versions() -> Dict[str, Optional[str]]:
    def ver(mod: str) -> Optional[str]:
        try:
            m = __import__(mod)
        except ImportError:
            return None
        return str(getattr(m, "__version__", "?"))

    return {
        "fused_contrastive": fc.__version__, "torch": torch.__version__, "triton": ver("triton"),
        "numpy": ver("numpy"), "pytorch_metric_learning": ver("pytorch_metric_learning"),
        "matplotlib": ver("matplotlib"), "python": platform.python_version(),
    }


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> Optional[str]:
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_suite(cfg: Config, progress_stream=None) -> Dict[str, Any]:
    """Run every case of ``cfg``; returns the report (``meta``, ``rows``, ``largest_batch``)."""
    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    params = plan_params(cfg.losses, cfg.sizes, cfg.dim, dtype, device, backends=cfg.backends,
                         seeds=cfg.seeds, peers=cfg.peers, mem_cap=cfg.mem_cap, max_iter_seconds=cfg.max_iter_seconds,
                         extra_sizes=cfg.extra_sizes)
    runner = _Runner(cfg.isolate)
    dev_name = _device_name(cfg.device)
    load_start = _loadavg()
    tmp = tempfile.mkdtemp(prefix="fc-bench-ref-")
    t_start = time.perf_counter()
    try:
        peak_start = runner("matmul_peak", (cfg.device, cfg.dtype, cfg.dim), cfg.timeout)
        groups: Dict[Tuple[int, str], List[BenchParam]] = {}
        for p in params:
            groups.setdefault((p.n, p.loss), []).append(p)
        total = sum(_step_cost(p, cfg) * (cfg.repeats + cfg.warmup + 1) + 1.5 for p in params if not p.skip)
        prog = _Progress(total, len(params) + len(groups), progress_stream)
        # (loss, contender) -> (N, fastest step in s): a memory-bound seed or peer skips a size predicted
        # to exceed --max-iter-seconds (see _time_skippable)
        last: Dict[Tuple[str, str], Tuple[int, float]] = {}
        rows: List[Dict[str, Any]] = []
        for (n, loss), group in groups.items():
            results: Dict[str, Dict[str, Any]] = {}
            for p in group:  # memory pass: one fresh process per case, the reference first
                results[p.contender] = res = _memory_pass(p, cfg, runner, last, tmp)
                first = res.get("first_seconds", 0.0)
                if res["status"] == "ok" and _time_skippable(p) and first > cfg.max_iter_seconds:
                    last[(loss, p.contender)] = (n, first)
                    res.update(status="skipped", reason=(
                        f"not timed: its cold step took {first:.1f} s > --max-iter-seconds {cfg.max_iter_seconds:g} "
                        "(peak memory and differences were measured)"))
                prog.update(_step_cost(p, cfg) + 0.8 if res["status"] == "ok" else 0.0,
                            f"{loss} N={n} {p.contender}: memory {res['status']}")
            ran = [p for p in group if results[p.contender]["status"] == "ok"]
            reps = tuple(_repeats(results[p.contender]["first_seconds"], cfg) for p in ran)
            job = TimingJob(loss, tuple(p.contender for p in ran), reps, n, cfg.dim, cfg.dtype, cfg.device,
                            cfg.warmup, cfg.threads)
            t_group = time.perf_counter()
            timed = runner("time", job, cfg.timeout) if ran else {}
            for p in ran:
                got = timed.get(p.contender, {"status": timed.get("status", "error"),
                                              "reason": timed.get("reason", "timing pass returned nothing")})
                results[p.contender].update(got)
                if "times" in got:
                    last[(loss, p.contender)] = (n, min(got["times"]["forward+backward"]))
            for p in group:
                results[p.contender].setdefault("timing_pass_seconds", time.perf_counter() - t_group)
                rows.extend(_rows_of(p, cfg, results[p.contender], dev_name))
            prog.update(sum(_step_cost(p, cfg) * (r + cfg.warmup) + 0.7 for p, r in zip(ran, reps)),
                        f"{loss} N={n}: timed {len(ran)} contenders interleaved")
        # measured again at the end: on a shared machine the best of the two is the better estimate
        peak = _best_peak(peak_start, runner("matmul_peak", (cfg.device, cfg.dtype, cfg.dim), cfg.timeout))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _add_ratios(rows)
    for r in rows:
        if r["tflops"] is not None and peak.get("flops_per_s"):
            r["fraction_of_matmul_peak"] = r["tflops"] * 1e12 / peak["flops_per_s"]
    meta = {
        "device": cfg.device, "device_name": dev_name, "dtype": cfg.dtype, "dim": cfg.dim,
        "loadavg_1min": {"start": load_start, "end": _loadavg()},
        "sizes": sorted(set(cfg.sizes).union(*cfg.extra_sizes.values())), "extra_sizes": cfg.extra_sizes,
        "losses": cfg.losses, "repeats": cfg.repeats, "warmup": cfg.warmup,
        "torch_threads": cfg.threads or torch.get_num_threads(), "versions": _versions(), "git_commit": _git_commit(),
        "matmul_peak": peak, "mem_cap_bytes": cfg.mem_cap, "mem_budget_bytes": cfg.mem_budget,
        "max_iter_seconds": cfg.max_iter_seconds, "isolated_processes": cfg.isolate,
        "tolerances": {"loss_rel": TOLERANCES[cfg.dtype][0], "grad_rel_to_max_ref_grad": TOLERANCES[cfg.dtype][1]},
        "flops_formula": "forward 2*R*C*D, backward 4*R*C*D, forward+backward 6*R*C*D (R x C = logits)",
        "n_meaning": "N = anchors = rows of the similarity matrix (see 'inputs' of each row)",
        "memory_method": _CpuMeter(cfg.isolate).method if cfg.device == "cpu" else _CudaMeter.method,
        "wall_seconds": time.perf_counter() - t_start,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return {"meta": meta, "rows": rows, "largest_batch": largest_batches(rows, cfg.mem_budget)}


def _best_peak(*runs: Dict[str, Any]) -> Dict[str, Any]:
    ok = [r for r in runs if "flops_per_s" in r]
    if not ok:
        return {"error": "; ".join(str(r.get("reason")) for r in runs)}
    best = max(ok, key=lambda r: r["flops_per_s"])
    return dict(best, runs_flops_per_s=[r.get("flops_per_s") for r in runs])


def _memory_pass(p: BenchParam, cfg: Config, runner: _Runner, last: Dict[Tuple[str, str], Tuple[int, float]],
                 tmp: str) -> Dict[str, Any]:
    """Skip the case (with the reason) or run its memory pass in a fresh process."""
    con = get_contender(p.loss, p.contender)
    if p.skip:
        return {"status": "skipped", "reason": p.skip}
    prev = last.get((p.loss, p.contender))
    if _time_skippable(p) and prev is not None and _predict(prev, p.n, con) > cfg.max_iter_seconds:
        return {"status": "skipped", "reason": (
            f"predicted ~{_predict(prev, p.n, con):.0f} s per step (N^{con.time_order} from {prev[1]:.1f} s at "
            f"N={prev[0]}) > --max-iter-seconds {cfg.max_iter_seconds:g}")}
    job = Job(p.loss, p.contender, p.n, cfg.dim, cfg.dtype, cfg.device, cfg.mem_cap,
              os.path.join(tmp, f"{p.loss}-{p.n}.pt"), cfg.isolate, cfg.threads)
    t0 = time.perf_counter()
    res = runner("measure", job, cfg.timeout)
    res["memory_pass_seconds"] = time.perf_counter() - t0
    return res


def _time_skippable(p: BenchParam) -> bool:
    """A memory-bound seed or peer (one with a memory estimate: the broadcast seeds, pml-ntxent), the
    only contenders the time budget may skip; ours, the reference and the matmul-bound seeds and
    peers always run."""
    con = get_contender(p.loss, p.contender)
    return con.kind in ("seed", "peer") and con.estimate is not None


def _repeats(first_seconds: float, cfg: Config) -> int:
    """``cfg.repeats``, or fewer (never below 3) when they would take longer than --max-case-seconds."""
    if first_seconds * (cfg.repeats + cfg.warmup) <= cfg.max_case_seconds:
        return cfg.repeats
    return max(min(3, cfg.repeats), min(cfg.repeats, int(cfg.max_case_seconds / max(first_seconds, 1e-9)) - cfg.warmup))


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _predict(last: Tuple[int, float], n: int, con: Contender) -> float:
    n0, t0 = last
    return t0 * (n / n0) ** con.time_order


# ================================================================================================
# Largest batch within a memory budget (extrapolated from the measured peaks)
# ================================================================================================


#: memory models by order, leading powers last: a + bN (ours), bN + cN^2, bN^2 + cN^3
_POWERS = {1: [0, 1], 2: [1, 2], 3: [2, 3]}


def _fit(points: Sequence[Tuple[int, float]], order: int) -> Tuple[Optional[Tuple[List[int], List[float]]], str]:
    """The memory model of ``order`` (:data:`_POWERS`) through the two largest (N, bytes) points.

    Two parameters through the two largest sizes: smaller sizes are not asymptotic (glibc serves
    blocks under its 32 MiB mmap threshold from a reused heap, so N x N temporaries below N ~ 2900
    overlap differently). A negative lower coefficient is dropped (the leading term alone through the
    largest point, which over- rather than under-estimates the memory); a non-positive leading one
    means the peaks did not grow as the model says, and (None, why) is returned.
    """
    pts = sorted(points)[-2:]
    powers = list(_POWERS[order])
    for attempt in (powers, powers[-1:]):
        use = pts[-len(attempt):]
        if len(use) < len(attempt):
            continue
        a = [[float(n) ** k for k in attempt] for n, _ in use]
        y = [float(v) for _, v in use]
        if len(attempt) == 1:
            c = [y[0] / a[0][0]]
        else:
            det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
            c = [(y[0] * a[1][1] - y[1] * a[0][1]) / det, (a[0][0] * y[1] - a[1][0] * y[0]) / det]
        if c[-1] <= 0:
            return None, f"peaks did not grow like N^{attempt[-1]} over N={','.join(str(n) for n, _ in use)}"
        if min(c) >= 0 or (order == 1 and c[-1] > 0):  # ours: a negative constant is harmless
            return (attempt, c), ""
    return None, "no fit"


def _eval(fit: Tuple[List[int], List[float]], n: float) -> float:
    return sum(c * n ** p for p, c in zip(*fit))


def _solve(total: Callable[[float], float], budget: float) -> float:
    """The largest N with ``total(N) <= budget`` (``total`` increasing), by doubling then bisection."""
    lo, hi = 1.0, 2.0
    while total(hi) <= budget and hi < 1e12:
        lo, hi = hi, hi * 2
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo


def largest_batches(rows: List[Dict[str, Any]], budget: float) -> List[Dict[str, Any]]:
    """Per (loss, contender): the largest N whose inputs + forward+backward peak fit in ``budget``.

    EXTRAPOLATED: the contender's memory model (``memory_order``, see :func:`_fit`) through the peaks
    of the two largest sizes it ran, solved for the budget; the time there is the largest timed
    size's median scaled by ``(N / N_timed)^time_order``.
    """
    out = []
    keys = sorted({(r["loss"], r["contender"]) for r in rows}, key=lambda k: (list(LOSSES).index(k[0]), k[1]))
    for loss, cname in keys:
        mine = [r for r in rows if r["loss"] == loss and r["contender"] == cname and r["mode"] == "forward+backward"]
        pts = sorted((r["n"], r["peak_bytes"], r["input_bytes"]) for r in mine if r["peak_bytes"] is not None)
        timed = sorted((r["n"], r["time_ms"]) for r in mine if r["time_ms"] is not None)
        con = get_contender(loss, cname)
        used = pts[-2:]
        entry: Dict[str, Any] = {"loss": loss, "contender": cname, "budget_bytes": budget,
                                 "measured_n": [p[0] for p in pts], "fit_n": [p[0] for p in used],
                                 "memory_order": con.memory_order, "n_max": None,
                                 "method": "extrapolated from measured points"}
        out.append(entry)
        if not used:
            entry["reason"] = "no measured size"
            continue
        fit, why = _fit([(p[0], float(p[1])) for p in used], con.memory_order)
        if fit is None:
            entry["reason"] = why
            continue
        in_per_n = used[-1][2] / used[-1][0]
        lo = _solve(lambda n, f=fit, k=in_per_n: _eval(f, n) + k * n, budget)
        entry.update(n_max=int(lo), fit_powers=fit[0], fit_coefficients=fit[1], input_bytes_per_n=in_per_n)
        if timed:
            n_big, t_big = timed[-1]
            entry.update(time_ms_at_n_max=t_big * (lo / n_big) ** con.time_order,
                         time_model=f"t({n_big}) * (N / {n_big})^{con.time_order}")
    return out


# ================================================================================================
# Output: table, JSON, plots
# ================================================================================================


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "-"
    return f"{b / GiB:.2f}G" if b >= 10 * GiB else f"{b / MiB:.1f}M"


def _fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def _fmt_x(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 10 else f"{x:.0f}")


def _fmt_e(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def _fmt_n(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else f"{n:.0f}"


def format_table(report: Dict[str, Any]) -> str:
    """The terminal report: one block per loss (times per mode, forward+backward ratio, peak memory,
    differences), then the torch-vs-reference summary and the largest batches."""
    meta, rows = report["meta"], report["rows"]
    by = {(r["loss"], r["contender"], r["n"], r["mode"]): r for r in rows}
    lines = [
        f"fused_contrastive bench - {meta['device_name']} ({meta['device']}), dtype {meta['dtype']}, D={meta['dim']}, "
        f"{meta['torch_threads']} threads, torch {meta['versions']['torch']}, median of {meta['repeats']} repeats",
        "times in ms (median, [p25-p75] spread in %), peak = max memory over the baseline (fwd+bwd), "
        "x ref = ratio to the reference in this run",
    ]
    load = (meta.get("loadavg_1min") or {}).get("start")
    if load is not None and load > 0.5 * (os.cpu_count() or 1):
        lines.append(f"WARNING: 1-min load average {load:.1f} on {os.cpu_count()} CPUs when the run started: "
                     "the machine was busy: absolute times are noisy (ratios less so: contenders are interleaved)")
    pk = meta.get("matmul_peak") or {}
    if pk.get("flops_per_s"):
        lines.append(f"matmul peak measured: {pk['flops_per_s'] / 1e9:.0f} GFLOP/s ({'x'.join(map(str, pk['shape']))} "
                     f"{pk['dtype']}, best of start and end); eff% = textbook FLOPs (6*R*C*D) / median time / peak")
    hdr = (f"{'contender':<17}{'N':>6} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>9} {'±%':>4} {'x ref':>6} {'eff%':>5} "
           f"{'peak':>8} {'x ref':>6} {'|dloss|':>8} {'|dgrad|':>8}  status")
    skipped: Dict[Tuple[str, str], List[int]] = {}
    for loss in meta["losses"]:
        lines += ["", f"== {loss}: {LOSSES[loss].inputs}", hdr]
        names = []
        for r in rows:
            if r["loss"] == loss and r["contender"] not in names:
                names.append(r["contender"])
        for cname in names:
            for n in meta["sizes"]:
                fb = by.get((loss, cname, n, "forward+backward"))
                if fb is None:
                    continue
                if fb["status"] == "skipped" and fb["reason"].startswith(("no GPU", "peer not", "no triton")):
                    skipped.setdefault((cname, fb["reason"]), []).append(n)
                    continue
                if fb["peak_bytes"] is None:  # did not run
                    lines.append(f"{cname:<17}{n:>6}  {fb['status']}: {fb['reason'][:110]}")
                    continue
                f, b = by[(loss, cname, n, "forward")], by[(loss, cname, n, "backward")]
                spread = (f"{100 * (fb['time_ms_p75'] - fb['time_ms_p25']) / fb['time_ms']:.0f}"
                          if fb["time_ms"] else "-")
                eff = f"{100 * fb['fraction_of_matmul_peak']:.0f}" if fb["fraction_of_matmul_peak"] else "-"
                tol = "" if fb["within_tolerance"] is None else (" ok" if fb["within_tolerance"] else " DIFF!")
                status = "ok" if fb["status"] == "ok" else f"{fb['status']}: {fb['reason'][:60]}"
                lines.append(
                    f"{cname:<17}{n:>6} {_fmt_ms(f['time_ms']):>8} {_fmt_ms(b['time_ms']):>8} "
                    f"{_fmt_ms(fb['time_ms']):>9} {spread:>4} {_fmt_x(fb['time_ratio_vs_reference']):>6} {eff:>5} "
                    f"{_fmt_bytes(fb['peak_bytes']):>8} {_fmt_x(fb['memory_ratio_vs_reference']):>6} "
                    f"{_fmt_e(fb['max_abs_diff_loss']):>8} {_fmt_e(fb['max_abs_diff_grad']):>8}  {status}{tol}")
    if skipped:
        lines += ["", "not run:"]
        for (cname, why), ns in skipped.items():
            lines.append(f"  {cname} ({len(ns)} cases): {why}")
    lines += ["", "torch backend vs reference at the largest size each ran (forward+backward, same run):",
              f"  {'loss':<14}{'N':>6} {'time x ref':>11} {'peak x ref':>11} {'torch ms':>9} {'ref ms':>9} "
              f"{'torch peak':>11} {'ref peak':>9}"]
    for s in torch_vs_reference(rows, meta["losses"]):
        lines.append(f"  {s['loss']:<14}{s['n']:>6} {_fmt_x(s['time_ratio']):>11} {_fmt_x(s['memory_ratio']):>11} "
                     f"{_fmt_ms(s['torch_ms']):>9} {_fmt_ms(s['reference_ms']):>9} "
                     f"{_fmt_bytes(s['torch_peak']):>11} {_fmt_bytes(s['reference_peak']):>9}")
    budget = meta["mem_budget_bytes"]
    lines += ["", f"largest info_nce batch within {budget / GiB:.0f} GiB at D={meta['dim']}: inputs + peak, "
              "EXTRAPOLATED by each contender's memory model through its two largest measured sizes; "
              "time there ~ N^2 (N^3 for pml-ntxent) from the largest timed size:",
              f"  {'contender':<17}{'N max':>9} {'fwd+bwd time there':>19}  {'peak model (bytes)':<30}  fitted on N"]
    fitted = [max(e["fit_n"]) for e in report["largest_batch"] if e["loss"] == "info_nce" and e["fit_n"]]
    if meta["device"] == "cpu" and fitted and max(fitted) < 4096:
        lines.append("  (rough: below N ~ 4096 the peaks are not asymptotic, see _fit; the default sizes run "
                     "info_nce at 4096 and 8192)")
    for e in report["largest_batch"]:
        if e["loss"] != "info_nce":
            continue
        if e["n_max"] is None:
            lines.append(f"  {e['contender']:<17}{'-':>9} {'-':>19}  {'-':<30}  {e.get('reason', '')}")
            continue
        model = " + ".join(f"{c:.3g}" + ("" if p == 0 else f" N^{p}" if p > 1 else " N")
                           for p, c in zip(e["fit_powers"], e["fit_coefficients"]))
        there = _dur(e["time_ms_at_n_max"] / 1e3) if e.get("time_ms_at_n_max") is not None else "(not timed)"
        lines.append(f"  {e['contender']:<17}{_fmt_n(e['n_max']):>9} {there:>19}  {model:<30}  "
                     f"{','.join(map(str, e['fit_n']))}")
    lines.append("")
    lines.append(f"wall time {_dur(meta['wall_seconds'])}")
    return "\n".join(lines)


def torch_vs_reference(rows: List[Dict[str, Any]], losses: Sequence[str]) -> List[Dict[str, Any]]:
    """Per loss: forward+backward time and peak ratios torch / reference at the largest N both ran."""
    out = []
    for loss in losses:
        both = {}
        for r in rows:
            if r["loss"] == loss and r["mode"] == "forward+backward" and r["status"] == "ok":
                both.setdefault(r["n"], {})[r["contender"]] = r
        ns = [n for n, d in both.items() if "torch" in d and "reference" in d]
        if not ns:
            continue
        n = max(ns)
        t, ref = both[n]["torch"], both[n]["reference"]
        out.append({"loss": loss, "n": n, "time_ratio": t["time_ratio_vs_reference"],
                    "memory_ratio": t["memory_ratio_vs_reference"], "torch_ms": t["time_ms"],
                    "reference_ms": ref["time_ms"], "torch_peak": t["peak_bytes"], "reference_peak": ref["peak_bytes"]})
    return out


def write_json(report: Dict[str, Any], path: str) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    report = dict(report, summary={"torch_vs_reference": torch_vs_reference(report["rows"], report["meta"]["losses"])})
    with open(path, "w") as fh:
        json.dump(clean(report), fh, indent=1)


def plot(report: Dict[str, Any], out_dir: str) -> List[str]:
    """PNG per loss: forward+backward time and peak memory against N, log-log, one line per contender,
    cases that did not run marked with x at the top (oom / skipped). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = report["meta"], report["rows"]
    paths = []
    for loss in meta["losses"]:
        lrows = [r for r in rows if r["loss"] == loss and r["mode"] == "forward+backward"]
        names = []
        for r in lrows:
            if r["contender"] not in names:
                names.append(r["contender"])
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ci, cname in enumerate(names):
            color = f"C{ci % 10}"
            mine = sorted((r for r in lrows if r["contender"] == cname), key=lambda r: r["n"])
            ok = [r for r in mine if r["status"] == "ok"]
            bad = [r for r in mine if r["status"] != "ok" and not r["reason"].startswith(("no GPU", "no triton"))]
            for ax, key in ((axes[0], "time_ms"), (axes[1], "peak_bytes")):
                xs = [r["n"] for r in ok]
                ys = [r[key] / (1e3 if key == "time_ms" else MiB) for r in ok]
                if key == "time_ms" and ok:
                    err = [[(r["time_ms"] - r["time_ms_p25"]) / 1e3 for r in ok],
                           [(r["time_ms_p75"] - r["time_ms"]) / 1e3 for r in ok]]
                    ax.errorbar(xs, ys, yerr=err, color=color, marker="o", label=cname, capsize=3)
                elif ok:
                    ax.plot(xs, [max(y, 1e-2) for y in ys], color=color, marker="o", label=cname)
                for r in bad:
                    ax.plot([r["n"]], [1.0], color=color, marker="x", markersize=10, mew=2,
                            transform=ax.get_xaxis_transform(), clip_on=False, linestyle="none")
                    ax.annotate("OOM" if r["status"] == "oom" else "skip", (r["n"], 1.0),
                                xycoords=("data", "axes fraction"), textcoords="offset points",
                                xytext=(4, -12 - 9 * (ci % 4)), color=color, fontsize=7)
        if loss == "info_nce":
            budget = meta["mem_budget_bytes"]
            for ci, cname in enumerate(names):
                e = next((e for e in report["largest_batch"] if e["loss"] == loss and e["contender"] == cname
                          and e["n_max"]), None)
                if e is None:
                    continue
                n0 = min(e["fit_n"])
                xs = [n0 * (e["n_max"] / n0) ** (i / 40) for i in range(41)]
                fit = (e["fit_powers"], e["fit_coefficients"])
                total = [(_eval(fit, x) + e["input_bytes_per_n"] * x) / MiB for x in xs]
                axes[1].plot(xs, total, color=f"C{ci % 10}", linestyle=":", linewidth=1)
            axes[1].axhline(budget / MiB, color="k", linestyle="--", linewidth=0.8)
            axes[1].text(0.01, budget / MiB, f" {budget / GiB:.0f} GiB budget; dotted: inputs + fitted peak, "
                         "EXTRAPOLATED to the budget", transform=axes[1].get_yaxis_transform(), va="bottom", fontsize=8)
        axes[0].set_ylabel("forward+backward time [s] (median, p25-p75)")
        axes[1].set_ylabel("peak memory over baseline [MiB]")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (anchors)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{loss}: {LOSSES[loss].inputs}\n{meta['device_name']}, {meta['dtype']}, D={meta['dim']} "
                     "(x = did not run: OOM or skipped)", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"bench_{loss}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ================================================================================================
# CLI
# ================================================================================================


def _split(values: Optional[Sequence[str]]) -> Optional[List[str]]:
    if values is None:
        return None
    return [v for item in values for v in item.split(",") if v]


def _mem_available() -> Optional[float]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return None


def parse_args(argv: Sequence[str]) -> Config:
    ap = argparse.ArgumentParser(
        prog="python -m fused_contrastive bench",
        description="Microbenchmarks of every loss: our backends vs the reference, the seeds' formulas and "
                    "the peers; time (fwd, bwd, fwd+bwd), peak memory, differences. Writes a table, "
                    "bench.json and PNG plots. N is the number of anchors (rows of the similarity matrix).")
    ap.add_argument("--losses", nargs="+", metavar="LOSS", help=f"subset of: {', '.join(LOSSES)} (default all)")
    ap.add_argument("--sizes", help="comma-separated N (even, >= 4); default CPU 256,512,1024,2048,4096 and "
                                    "8192 for info_nce (quick 256,1024), CUDA 1024,4096,16384 (quick 1024,4096)")
    ap.add_argument("--dim", type=int, default=768, help="embedding dimension D (default 768)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--backends", nargs="+", metavar="BACKEND",
                    help="ours to run among torch, triton (default both; the reference always runs)")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                    help="pytorch-metric-learning and sentence-transformers formulas (default on)")
    ap.add_argument("--seeds", action=argparse.BooleanOptionalAction, default=True,
                    help="the seed blog posts' formulas (default on)")
    ap.add_argument("--repeats", type=int, help="timed repeats per case (default CPU 5, quick 3; CUDA 20)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per contender before timing (default 1)")
    ap.add_argument("--out", default="bench_out", help="output directory (bench.json, bench.txt, PNGs)")
    ap.add_argument("--quick", action="store_true", help="small sizes and 3 repeats: the whole suite in < 2 min on CPU")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:i]")
    ap.add_argument("--mem-budget-gb", type=float, default=16.0,
                    help="budget of the largest-batch extrapolation, and memory cap of every case (lowered to the "
                         "memory available on CPU; default 16)")
    ap.add_argument("--max-iter-seconds", type=float,
                    help="skip a size of a memory-bound seed or peer (broadcast seeds, pml-ntxent) whose step is "
                         "predicted to take longer (default CPU 10, quick 2; CUDA 30)")
    ap.add_argument("--max-case-seconds", type=float, default=20.0,
                    help="fewer repeats (>= 3) for a case whose repeats would take longer (default 20)")
    ap.add_argument("--timeout", type=float, default=900.0, help="kill a case after this many seconds")
    ap.add_argument("--isolate", choices=("auto", "process", "inline"), default="auto",
                    help="fresh process per case (auto: on CPU, needed for its peak RSS) or inline")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads in every case (default: torch's default)")
    ap.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    a = ap.parse_args(list(argv))

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: CUDA is not available here")
    if a.repeats is not None and a.repeats < 1:
        ap.error("--repeats must be >= 1")
    dflt = _DEFAULTS[("cuda" if device.startswith("cuda") else "cpu", a.quick)]
    losses = _split(a.losses) or list(LOSSES)
    bad = [x for x in losses if x not in LOSSES]
    if bad:
        ap.error(f"unknown loss(es) {bad}; choose from {list(LOSSES)}")
    try:
        sizes = [int(s) for s in a.sizes.split(",") if s] if a.sizes else list(dflt["sizes"])
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {a.sizes!r}")
    if not sizes or any(n < 4 or n % 2 for n in sizes):
        ap.error(f"--sizes must be even numbers >= 4 (interleaved pairs, two views), got {sizes}")
    backends = _split(a.backends) or ["torch", "triton"]
    bad = [b for b in backends if b not in ("torch", "triton", "reference")]
    if bad:
        ap.error(f"unknown backend(s) {bad}; choose from torch, triton")
    budget = a.mem_budget_gb * GiB
    cap = budget
    avail = _mem_available() if not device.startswith("cuda") else None
    if avail is not None:
        cap = min(cap, max(avail - 2 * GiB, 1 * GiB))
    return Config(
        losses=losses, sizes=sorted(set(sizes)), dim=a.dim, dtype=a.dtype, device=device,
        backends=sorted(set(backends) | {"reference"}), seeds=a.seeds, peers=a.peers,
        repeats=a.repeats or dflt["repeats"], warmup=max(1, a.warmup), out=a.out, mem_budget=budget, mem_cap=cap,
        max_iter_seconds=a.max_iter_seconds or dflt["max_iter_seconds"], max_case_seconds=a.max_case_seconds,
        timeout=a.timeout,
        isolate=(a.isolate == "process") or (a.isolate == "auto" and not device.startswith("cuda")),
        plots=not a.no_plots, threads=a.threads,
        extra_sizes={} if a.sizes else {k: list(v) for k, v in dflt.get("extra_sizes", {}).items()
                                        if k in losses},
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fused_contrastive bench ARGS``: run the suite, print the table, write JSON and PNGs."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(cfg.out, exist_ok=True)
    report = run_suite(cfg)
    json_path = os.path.join(cfg.out, "bench.json")
    write_json(report, json_path)  # first: the measurements survive a failure below
    table = format_table(report)
    print(table)
    with open(os.path.join(cfg.out, "bench.txt"), "w") as fh:
        fh.write(table + "\n")
    print(f"\nJSON: {json_path}")
    if cfg.plots:
        try:
            paths = plot(report, cfg.out)
        except ImportError:
            print("matplotlib not installed: no plots (pip install matplotlib)")
        else:
            print(f"plots: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    from fused_contrastive.bench import main as _main  # the imported module, so workers pickle its functions

    raise SystemExit(_main())
