"""THE case registry: every loss configuration that ``python -m fused_contrastive check``, the
test-suite and the benchmark run, in one list.

A case builds its inputs at N **anchors** (the rows of the similarity matrix) and dimension D on the
CPU from a seeded generator, in float32: ``build(n, d, gen) -> (tensors, kwargs)``. ``tensors`` are the
differentiable inputs (embeddings, and temperature-like 0-dim tensors whose gradient is checked too),
``kwargs`` everything else (labels, targets, options). Cases marked ``bench`` are the benchmark's
losses: square or textbook-shaped problems whose options match the formulas of
``testing.baselines`` (a Python-number temperature, ``arange`` targets), so those run side by side.

Adding a loss: write its function (its family's module of ``losses/``), its reference
(``core/reference.py``) and add its cases here (and, for the benchmark, its textbook formula in
``baselines.py``). Every fact a test or the benchmark needs about a case is a field of :class:`Case`
(``tests/test_registry.py`` says which one is missing): nothing is chosen elsewhere by case name.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import losses as L
from ..cosent import cosent_loss, cosent_loss_from_scores
from ..metrics import alignment, uniformity
from ..siglip import siglip_loss

Inputs = tuple[dict[str, Tensor], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One loss configuration.

    Attributes:
        name: unique; what ``check --losses`` and ``bench --losses`` accept.
        fn: the public loss function called as ``fn(**tensors, **kwargs, backend=...)``.
        build: ``(n, d, gen) -> (tensors, kwargs)`` at N anchors, float32 CPU.
        op: "core" (InfoNCE family and uniformity: the Triton kernels run it), "cosent", "siglip",
            "guided" (the merged-block core of ``core/guided/torch_blocks.py``: GIST) or "alignment" (elementwise
            O(N*D) PyTorch, no Triton kernel: ``backend="triton"`` raises).
        covers: what the case exercises (shown by ``check --list``).
        bench: one of the benchmark's losses.
        inputs: what the inputs are at N (benchmark tables).
        logits: ``n -> (rows, cols)`` of the logits the textbook formula materialises (the FLOPs every
            benchmark contender is credited with); None when there is no matmul (CoSENT).
        min_n: the smallest N the case is defined at (``make_inputs`` refuses less; the shape grids
            leave those shapes out for this case: :func:`shapes_for`).
        m: ``n -> M``, the columns of the contrast set the case builds at N (the memory test's N x M
            bound); None: the ``cols`` of ``logits``, else N.
        inductor: the case that represents its loss function in the Inductor compile test (exactly one
            per public loss function).
        peaked: the correlated regimes apply (:data:`REGIMES`).
        families: the test families that run this case besides the ones every case runs:
            "gradcheck" (analytic gradients against finite differences in float64), "degenerate_rows"
            (zero and duplicated rows), "huge_rows" (rows whose squared norm overflows the dtype). Every
            public loss function has a "gradcheck" case (``tests/test_registry.py``).
        gather_split: how the case's inputs split over ranks for ``gather=True`` (None: not stated):
            "rows" (built at N, every input with N rows is split by the ranks' row counts, the rest is
            replicated) or "pairs" (built at 2N, interleaved pairs: 2 rows per example). The loss's
            rank average must be its global-batch value: the multi-process parity test and, for a
            benchmarked case of [N, D] embeddings, the DDP training matrix run these from the registry.
        core_calls: how many times one call of the loss calls the core op (``core.run``), for op "core"
            (``tools.compile_survey.core_calls`` checks it: the kernel report, ``opcheck`` and the host-code trace
            read every call).
    """

    name: str
    fn: Callable[..., Tensor]
    build: Callable[[int, int, torch.Generator], Inputs]
    op: str = "core"
    covers: str = ""
    bench: bool = False
    inputs: str = ""
    logits: Callable[[int], tuple[int, int]] | None = None
    min_n: int = 1
    m: Callable[[int], int] | None = None
    inductor: bool = False
    #: whether the correlated regimes of :func:`make_inputs` apply: False where a row's positive is the
    #: row itself (cosine 1: any temperature saturates its softmax), whose regimes are its flat inputs
    peaked: bool = True
    core_calls: int = 1
    families: frozenset[str] = frozenset()
    gather_split: str | None = None

    def cols(self, n: int) -> int:
        """M: the columns of the contrast set at N anchors."""
        if self.m is not None:
            return self.m(n)
        return self.logits(n)[1] if self.logits is not None else n

    @property
    def has_triton(self) -> bool:
        """Whether ``backend="triton"`` runs kernels for this case (every op but "alignment")."""
        return self.op != "alignment"

    def flops(self, n: int, d: int, mode: str) -> float | None:
        """Matmul FLOPs of the textbook formula at N: forward ``2 R C D`` (the logits), backward
        ``4 R C D`` (the gradients of both sides), forward+backward ``6 R C D``."""
        if self.logits is None:
            return None
        r, c = self.logits(n)
        return float({"forward": 2, "backward": 4, "forward+backward": 6}[mode]) * r * c * d


#: Input regimes of :func:`make_inputs`: the temperature each sets (None: the case's own, on
#: independent random rows). "peaked" and "sharp" correlate every pair of rows a case makes positive and
#: set every temperature-like argument to 0.05 / 0.01 (``logit_scale`` and CoSENT's ``scale`` to 20 /
#: 100). The positives' cosine is chosen for the temperature, N and D (0.5 at 0.05 and 0.17 at 0.01 for
#: N = 4099, D = 768; up to 0.95 at small D, whose random cosines are wide): the target's logit stands
#: ``log N + 2`` above the log-mean-exp of the other logits, so the softmax is peaked on it (p ~ 0.9,
#: loss ~ 0.1) without saturating. The loss is then a small difference of large logits and the gradient
#: ``p - y`` cancels in its target term: the regime where a 16-bit intermediate shows, and a flat random
#: softmax hides it. The rows stay isotropic (no shared direction): with every cosine near 0.9 the
#: gradient is a small difference of nearly parallel unit rows, which no 16-bit GEMM operand resolves.
#: "saturated" is "peaked" with the target's logit ``log N + 9`` above (:data:`REGIME_MARGIN`: p ~ 0.9999,
#: a loss of ~1e-4 per row, as SimCSE reaches in training): the log-sum-exp piece's weight on the target
#: and the target term's -1 cancel to ``1e-4``, which 16-bit rounding of either (``2^-9``) swamps.
REGIMES: dict[str, float | None] = {"flat": None, "peaked": 0.05, "sharp": 0.01, "saturated": 0.05}
#: How far the target's logit stands above the others' log-sum-exp in each correlated regime (2 unless listed).
REGIME_MARGIN: dict[str, float] = {"saturated": 9.0}
#: In a correlated regime: the latent rows by D, their generator and the positives' cosine.
_LATENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("_LATENT", default=None)


def _latent(n: int, t: float, seed: int, margin: float = 2.0) -> dict:
    """The correlated regime's state at N anchors, temperature t and target margin (the cosine is set
    per D at use)."""
    return {"gen": torch.Generator().manual_seed(seed + 1_000_003), "n": max(n, 2), "t": t, "rows": {},
            "margin": margin}


def positive_cosine(n: int, d: int, t: float, margin: float = 2.0) -> float:
    """The positives' cosine of a correlated regime: ``c / t = LSE + margin``, LSE the log-sum-exp of N
    random logits of standard deviation ``s = 1 / (t sqrt D)``: ``log N + s^2 / 2`` while the sum is a
    mean (``s^2 < 2 log N``), else its largest term ``s sqrt(2 log N)``; at most 0.95."""
    s2, ln = 1.0 / (t * t * max(d, 1)), math.log(n)
    lse = ln + s2 / 2 if s2 < 2 * ln else math.sqrt(s2 * 2 * ln)
    return min(0.95, t * (lse + margin))


def _randn(g: torch.Generator, *shape: int, group: int = 1) -> Tensor:
    """Random rows; in a correlated regime (:data:`REGIMES`) row r of every tensor is
    ``w latent[r // group] + sqrt(1 - w^2) noise`` (its leading index; later leading dims, e.g. views,
    share it), ``w^2`` the positives' cosine, so rows that share a position (a query and its key, the
    views of a sample, ``group`` rows in a row for interleaved layouts) are the correlated pairs."""
    x = torch.randn(*shape, generator=g)
    lat = _LATENT.get()
    if lat is None or len(shape) < 2:
        return x
    rows, d = shape[0], shape[-1]
    need = -(-rows // group)
    base = lat["rows"].get(d, torch.empty(0, d))
    if base.shape[0] < need:
        base = lat["rows"][d] = torch.cat([base, torch.randn(need - base.shape[0], d, generator=lat["gen"])])
    w2 = positive_cosine(lat["n"], d, lat["t"], lat["margin"])
    latent = base[torch.arange(rows) // group].reshape(rows, *([1] * (len(shape) - 2)), d)
    return w2**0.5 * latent + (1.0 - w2) ** 0.5 * x


def _set_temperature(inputs: Inputs, t: float, mid: float) -> Inputs:
    """Every temperature-like argument of a case's inputs set for temperature ``t`` (tensors stay 0-dim
    tensors): ``temperature`` = t, ``logit_scale`` and ``scale`` = 1 / t, a Python-number
    ``logit_bias`` (SigLIP) = -mid / t (mid: half the positives' cosine), so that positive pairs sit above
    0 and negatives below."""
    tensors, kwargs = inputs
    want = {"temperature": t, "logit_scale": 1.0 / t, "scale": 1.0 / t, "logit_bias": -mid / t}
    tensors = {k: (torch.tensor(want[k]) if k in want and v.dim() == 0 else v) for k, v in tensors.items()}
    kwargs = {k: (want[k] if k in want and isinstance(v, float) else v) for k, v in kwargs.items()}
    return tensors, kwargs


def _classes(bsz: int) -> int:
    """Labels of the SupCon-style cases: up to 100 classes (CIFAR-100-like at benchmark sizes), about
    three samples per class at test sizes, so most anchors have positives besides their own views."""
    return max(1, min(100, bsz // 3))


def _labels(g: torch.Generator, bsz: int) -> Tensor:
    return torch.randint(0, _classes(bsz), (bsz,), generator=g)


def _half(n: int) -> int:
    return max(1, n // 2)


# --- InfoNCE ----------------------------------------------------------------------------------


def _info_nce(n, d, g):
    return {"query": _randn(g, n, d), "keys": _randn(g, n, d)}, {"temperature": 0.05}


def _info_nce_target(n, d, g):
    m = n + 3  # M != N on purpose
    return ({"query": _randn(g, n, d), "keys": _randn(g, m, d), "temperature": torch.tensor(0.07)},
            {"target": torch.randint(0, m, (n,), generator=g)})


def _info_nce_self(n, d, g):
    if n == 1:  # a single row cannot exclude its only column
        return {"query": _randn(g, n, d)}, {"target": torch.zeros(1, dtype=torch.long), "exclude_self": False}
    tgt = (torch.arange(n) + torch.randint(1, max(n, 2), (n,), generator=g)) % n
    return {"query": _randn(g, n, d), "temperature": torch.tensor(0.05)}, {"target": tgt}


def _info_nce_self_none(n, d, g):
    x, kw = _info_nce_self(n, d, g)
    return x, {**kw, "reduction": "none"}


def _info_nce_ignore(n, d, g):
    tgt = torch.randint(0, n, (n,), generator=g)
    tgt[::3] = -100
    if n > 1:
        tgt[1] = 0
    return {"query": _randn(g, n, d), "keys": _randn(g, n, d)}, {"target": tgt, "reduction": "sum"}


def _info_nce_none(n, d, g):
    m = n + 29
    return ({"query": _randn(g, n, d), "keys": _randn(g, m, d), "temperature": torch.tensor(0.1)},
            {"target": torch.randint(0, m, (n,), generator=g), "reduction": "none"})


def _info_nce_smoothed(n, d, g):
    m = n + 3
    tgt = torch.randint(0, m, (n,), generator=g)
    tgt[1::4] = -100
    return ({"query": _randn(g, n, d), "keys": _randn(g, m, d), "temperature": torch.tensor(0.07)},
            {"target": tgt, "label_smoothing": 0.1})


def _info_nce_self_smoothed_none(n, d, g):
    tgt = (torch.arange(n) + torch.randint(1, max(n, 2), (n,), generator=g)) % n
    return {"query": _randn(g, n, d)}, {"target": tgt, "label_smoothing": 0.2, "reduction": "none"}


def _info_nce_debiased(n, d, g):
    return ({"query": _randn(g, n, d), "keys": _randn(g, n, d), "temperature": torch.tensor(0.1)},
            {"tau_plus": 0.1})


def _info_nce_debiased_self_none(n, d, g):
    tgt = (torch.arange(n) + torch.randint(1, max(n, 2), (n,), generator=g)) % n
    prior = torch.rand(n, generator=g) * 0.3
    return ({"query": _randn(g, n, d)},
            {"target": tgt, "tau_plus": prior, "label_smoothing": 0.1, "reduction": "none", "temperature": 0.2})
def _info_nce_rowneg(n, d, g):
    # each row's own 3 hard negatives: independent rows (not correlated with the row's pair in a regime)
    return ({"query": _randn(g, n, d), "keys": _randn(g, n, d), "row_negatives": torch.randn(n, 3, d, generator=g),
             "temperature": torch.tensor(0.07)}, {})


# --- CLIP -------------------------------------------------------------------------------------


def _clip(n, d, g):
    return {"a": _randn(g, n, d), "b": _randn(g, n, d)}, {"logit_scale": 1 / 0.07}


def _am_softmax(n, d, g):
    return {"query": _randn(g, n, d), "keys": _randn(g, n, d)}, {"margin": 0.3, "temperature": 0.05}


def _am_softmax_row_none(n, d, g):
    return ({"query": _randn(g, n, d), "keys": _randn(g, n, d), "temperature": torch.tensor(0.07)},
            {"margin": 0.2, "symmetric": False, "reduction": "none"})


def _clip_smoothed(n, d, g):
    return {"a": _randn(g, n, d), "b": _randn(g, n, d), "logit_scale": torch.tensor(14.3)}, {"label_smoothing": 0.1}


def _clip_debiased(n, d, g):
    return ({"a": _randn(g, n, d), "b": _randn(g, n, d), "logit_scale": torch.tensor(5.0)},
            {"tau_plus": 0.1})


def _am_softmax_smoothed(n, d, g):
    return ({"query": _randn(g, n, d), "keys": _randn(g, n, d)},
            {"margin": 0.3, "temperature": 0.05, "label_smoothing": 0.1})


def _clip_scale(n, d, g):
    return {"a": _randn(g, n, d), "b": _randn(g, n, d), "logit_scale": torch.tensor(14.3)}, {}


def _clip_none(n, d, g):
    return {"a": _randn(g, n, d), "b": _randn(g, n, d), "logit_scale": torch.tensor(10.0)}, {"reduction": "none"}


def _clip_self(n, d, g):
    # CLIP-style symmetric loss of A against itself (B is A with a column term). The diagonal (cosine 1)
    # is every row's target; a temperature of 0.49 keeps the per-row losses O(1) (at 0.07 they are
    # ~1e-4 = LSE - l_ii, pure cancellation, for every backend)
    return ({"query": _randn(g, n, d), "temperature": torch.tensor(0.49)},
            {"symmetric": True, "exclude_self": False, "reduction": "none"})


# --- SimCSE -----------------------------------------------------------------------------------


def _simcse(n, d, g):
    return {"z1": _randn(g, 2 * _half(n), d, group=2)}, {"temperature": 0.05}


def _simcse_2view(n, d, g):
    return {"z1": _randn(g, n, d), "z2": _randn(g, n, d)}, {"temperature": 0.05}


def _simcse_2view_none(n, d, g):
    return {"z1": _randn(g, n, d), "z2": _randn(g, n, d), "temperature": torch.tensor(0.05)}, {"reduction": "none"}


def _simcse_smoothed(n, d, g):
    return {"z1": _randn(g, 2 * _half(n), d, group=2)}, {"temperature": 0.05, "label_smoothing": 0.1}


def _gist(n, d, g):
    return ({"anchors": _randn(g, n, d), "positives": _randn(g, n, d), "negatives": _randn(g, n, d)},
            {"guide": (_randn(g, n, 3), _randn(g, n, 3), _randn(g, n, 3)), "temperature": 0.05, "margin": 0.05})


def _gist_smoothed(n, d, g):
    return ({"anchors": _randn(g, n, d), "positives": _randn(g, n, d), "negatives": _randn(g, n, d),
             "temperature": torch.tensor(0.05)},
            {"guide": (_randn(g, n, 3), _randn(g, n, 3), _randn(g, n, 3)), "margin": 0.05, "label_smoothing": 0.1})


def _info_nce_masked_smoothed_none(n, d, g):
    m = n + 3
    # some columns share their row's id, others not (at every N: key ids 0..max(N // 2, 2) - 1)
    ids = (torch.randint(0, max(n // 2, 1), (n,), generator=g), torch.arange(m) % max(n // 2, 2))
    return ({"query": _randn(g, n, d), "keys": _randn(g, m, d), "temperature": torch.tensor(0.07)},
            {"guide": (_randn(g, n, 3), _randn(g, m, 3)), "guide_margin": 0.05, "ids": ids, "label_smoothing": 0.2,
             "reduction": "none"})


def _gist_relative_none(n, d, g):
    return ({"anchors": _randn(g, n, d), "positives": _randn(g, n, d), "temperature": torch.tensor(0.05)},
            {"guide": (_randn(g, n, 3), _randn(g, n, 3)), "margin_strategy": "relative", "margin": 0.1,
             "contrast_anchors": False, "reduction": "none"})


def _qwen3(n, d, g):
    return ({"query": _randn(g, n, d), "docs": _randn(g, n, d), "row_negatives": torch.randn(n, 2, d, generator=g)},
            {"temperature": 0.05, "margin": 0.1})


def _qwen3_plain_none(n, d, g):
    return ({"query": _randn(g, n, d), "docs": _randn(g, n, d), "temperature": torch.tensor(0.07)},
            {"margin": 0.05, "doc_doc": False, "reduction": "none"})


def _simcse_sup(n, d, g):
    return {"anchor": _randn(g, 3 * n, d, group=3)}, {"temperature": 0.05}


def _simcse_sup_hard(n, d, g):
    return ({"anchor": _randn(g, n, d), "positive": _randn(g, n, d), "negative": _randn(g, n, d),
             "temperature": torch.tensor(0.05)}, {"hard_negative_weight": 0.5})


def _simcse_sup_smoothed(n, d, g):
    return ({"anchor": _randn(g, n, d), "positive": _randn(g, n, d), "negative": _randn(g, n, d),
             "temperature": torch.tensor(0.05)}, {"hard_negative_weight": 0.5, "label_smoothing": 0.1})


def _simcse_sup_none(n, d, g):
    return {"anchor": _randn(g, 3 * n, d, group=3)}, {"hard_negative_weight": -0.3, "reduction": "none"}


# --- SupCon / DSCL ----------------------------------------------------------------------------


def _supcon(variant: str):
    def build(n, d, g):
        bsz = _half(n)
        return {"features": _randn(g, bsz, 2, d)}, {"labels": _labels(g, bsz), "variant": variant,
                                                     "temperature": 0.07}
    return build


def _supcon_temps(n, d, g):
    bsz = _half(n)
    return ({"features": _randn(g, bsz, 2, d), "temperature": torch.tensor(0.1),
             "base_temperature": torch.tensor(0.2)}, {"labels": _labels(g, bsz), "variant": "in"})


def _supcon_mask(variant: str, reduction: str):
    def build(n, d, g):
        bsz = _half(n)
        mask = (torch.rand(bsz, bsz, generator=g) < 0.3).float()  # asymmetric on purpose
        if bsz > 1 and variant == "out":
            mask[0] = 0  # ... and one anchor whose only positive is its other view
        return {"features": _randn(g, bsz, 2, d)}, {"mask": mask, "variant": variant, "reduction": reduction}
    return build


def _supcon_one(n, d, g):
    bsz = max(1, n // 3)
    return {"features": _randn(g, bsz, 3, d)}, {"labels": _labels(g, bsz), "contrast_mode": "one"}


def _supcon_simclr_one(n, d, g):
    bsz = max(1, n // 3)
    return {"features": _randn(g, bsz, 3, d)}, {"contrast_mode": "one", "variant": "in"}


def _supcon_queue(variant: str, reduction: str):
    def build(n, d, g):
        bsz, k = _half(n), 7
        return ({"features": _randn(g, bsz, 2, d)},
                {"labels": _labels(g, bsz), "queue": _randn(g, k, d), "variant": variant, "reduction": reduction,
                 "queue_labels": torch.randint(0, _classes(bsz), (k,), generator=g)})
    return build


def _dcl(weighted: bool, reduction: str = "mean", tensor_t: bool = False, normalize: bool = True):
    def build(n, d, g):
        b = max(1, n // 2)  # N anchors: both views of N / 2 samples
        x: dict[str, Tensor] = {"z1": _randn(g, b, d), "z2": _randn(g, b, d)}
        kw: dict[str, Any] = {"temperature": 0.1, "reduction": reduction, "normalize": normalize}
        if not normalize:
            x = {k: v / (2 * max(d, 1) ** 0.5) for k, v in x.items()}
        if tensor_t:
            x["temperature"] = torch.tensor(0.2)
            del kw["temperature"]
        if weighted:
            kw["sigma"] = 0.5
        return x, kw
    return build


def _dscl(queue: bool):
    def build(n, d, g):
        kw: dict[str, Any] = {"labels": _labels(g, n), "beta": 8.0, "temperature": 0.07}
        x: dict[str, Tensor] = {"features": _randn(g, n, 2, d)}
        if queue:
            kw["queue"] = _randn(g, 5, d)
            kw["queue_labels"] = torch.randint(0, _classes(n), (5,), generator=g)
            x["temperature"] = torch.tensor(0.1)
            del kw["temperature"]
        return x, kw
    return build


# --- CoSENT -----------------------------------------------------------------------------------


def _cosent(n, d, g):
    return ({"u": _randn(g, n, d), "v": _randn(g, n, d)},
            {"labels": torch.randint(0, 6, (n,), generator=g).float(), "scale": 20.0})


def _cosent_scores(n, d, g):
    return {"scores": _randn(g, n), "scale": torch.tensor(20.0)}, {"labels": torch.randn(n, generator=g)}


# --- SigLIP -----------------------------------------------------------------------------------


def _siglip(n, d, g):
    # SigLIP's initialisation: scale 10, bias -10
    return {"image": _randn(g, n, d), "text": _randn(g, n, d)}, {"logit_scale": 10.0, "logit_bias": -10.0}


def _siglip_learn(n, d, g):
    return ({"image": _randn(g, n, d), "text": _randn(g, n, d), "logit_scale": torch.tensor(12.5),
             "logit_bias": torch.tensor(-4.0)}, {"reduction": "sum"})


def _siglip_raw_none(n, d, g):
    return ({"image": _randn(g, n, d), "text": _randn(g, n, d), "logit_bias": torch.tensor(0.75)},
            {"logit_scale": 0.5, "normalize": False, "reduction": "none"})


def _siglip_groups(n, d, g):
    # 2N texts; images 2i and 2i + 1 share a group, each group holds 4 texts in a shuffled order
    tg = (torch.arange(2 * n) // 4)[torch.randperm(2 * n, generator=g)]
    return ({"image": _randn(g, n, d), "text": _randn(g, 2 * n, d), "logit_scale": torch.tensor(8.0),
             "logit_bias": torch.tensor(-3.0)}, {"image_groups": torch.arange(n) // 2, "text_groups": tg,
                                                 "reduction": "none"})


# --- metrics (Wang and Isola 2020) ---------------------------------------------------------------


def _uniformity(n, d, g):
    return {"x": _randn(g, n, d)}, {}  # min_n = 2: a mean over pairs i != j


def _uniformity_raw(n, d, g):
    # raw rows scaled so that squared distances are O(1) (exp(-t d^2) stays well inside float32)
    x = _randn(g, n, d) / (2 * max(d, 1) ** 0.5)
    return {"x": x, "t": torch.tensor(1.5)}, {"normalize": False}


def _alignment(n, d, g):
    return {"x": _randn(g, n, d), "y": _randn(g, n, d)}, {}


def _alignment_raw(n, d, g):
    return {"x": _randn(g, n, d), "y": _randn(g, n, d)}, {"alpha": 1.5, "normalize": False}


def _sq(n: int) -> tuple[int, int]:
    return n, n


CASES: list[Case] = [
    Case("info_nce", L.info_nce, _info_nce, families=frozenset({"degenerate_rows", "huge_rows"}),
         bench=True, covers="queries vs keys, arange targets",
         inputs="query [N, D], keys [N, D]; logits N x N", logits=_sq),
    Case("info_nce_target", L.info_nce, _info_nce_target, families=frozenset({"gradcheck"}),
         covers="M = N + 3, random targets, tensor temperature",
         m=lambda n: n + 3),
    Case("info_nce_self", L.info_nce, _info_nce_self, families=frozenset({"gradcheck"}),
         covers="keys=None (B is A), own column excluded"),
    Case("info_nce_self_none", L.info_nce, _info_nce_self_none, covers="B is A, per-row losses"),
    Case("info_nce_ignore", L.info_nce, _info_nce_ignore, covers="ignore_index rows, sum"),
    Case("info_nce_none", L.info_nce, _info_nce_none, covers="M = N + 29, per-row losses, tensor temperature",
         m=lambda n: n + 29, inductor=True),
    Case("info_nce_smoothed", L.info_nce, _info_nce_smoothed, families=frozenset({"gradcheck"}),
         covers="label_smoothing 0.1, M = N + 3, ignored rows, tensor temperature", m=lambda n: n + 3),
    Case("info_nce_self_smoothed_none", L.info_nce, _info_nce_self_smoothed_none,
         covers="label_smoothing 0.2 with the own column deleted, per-row losses", min_n=2),
    Case("info_nce_debiased", L.info_nce, _info_nce_debiased, families=frozenset({"gradcheck"}),
         covers="tau_plus 0.1 (debiased), tensor temperature", min_n=2, gather_split="rows"),
    Case("info_nce_debiased_self_none", L.info_nce, _info_nce_debiased_self_none, families=frozenset({"gradcheck"}),
         covers="per-row tau_plus with label_smoothing, own column excluded, per-row losses", min_n=3),
    Case("clip_smoothed", L.clip_loss, _clip_smoothed, families=frozenset({"gradcheck"}), gather_split="rows",
         covers="label_smoothing 0.1 both directions, learnable logit_scale"),
    Case("clip_debiased", L.clip_loss, _clip_debiased, families=frozenset({"gradcheck"}), gather_split="rows",
         covers="tau_plus 0.1 both directions, learnable logit_scale", min_n=2, core_calls=2),
    Case("am_softmax_smoothed", L.am_softmax_loss, _am_softmax_smoothed, gather_split="rows",
         covers="label_smoothing 0.1 on the margin logits, row + column forms"),
    Case("info_nce_rowneg", L.info_nce, _info_nce_rowneg, families=frozenset({"gradcheck"}), gather_split="rows",
         covers="row-specific hard negatives [N, 3, D] beside the shared keys, tensor temperature",
         m=lambda n: n + 3),
    Case("clip", L.clip_loss, _clip, families=frozenset({"huge_rows"}), bench=True, covers="row + column cross-entropy",
         inputs="a [N, D], b [N, D], logit_scale 1/0.07; logits N x N (rows and columns)", logits=_sq,
         gather_split="rows"),
    Case("am_softmax", L.am_softmax_loss, _am_softmax, families=frozenset({"gradcheck", "huge_rows"}), bench=True,
         covers="LaBSE additive margin 0.3 on the pair logit, row + column forms",
         inputs="query [N, D], keys [N, D], margin 0.3, temperature 0.05; logits N x N (rows and columns)",
         logits=_sq, inductor=True, gather_split="rows"),
    Case("am_softmax_row_none", L.am_softmax_loss, _am_softmax_row_none, families=frozenset({"gradcheck"}),
         covers="row form, per-pair losses, tensor temperature (its gradient through the margin)"),
    Case("clip_scale", L.clip_loss, _clip_scale, families=frozenset({"gradcheck"}), gather_split="rows",
         covers="learnable logit_scale", inductor=True),
    Case("clip_none", L.clip_loss, _clip_none, covers="per-pair losses"),
    Case("clip_self", L.info_nce, _clip_self, families=frozenset({"gradcheck"}),
         covers="symmetric with B is A (column term, symmetric logits)",
         peaked=False),
    Case("simcse", L.simcse_loss, _simcse, families=frozenset({"gradcheck", "degenerate_rows", "huge_rows"}),
         gather_split="pairs",
         bench=True, covers="interleaved views, partner i xor 1, self excluded",
         inputs="interleaved z [N, D] (N/2 sentences x 2 views); logits N x N", logits=_sq, min_n=2, inductor=True),
    Case("simcse_smoothed", L.simcse_loss, _simcse_smoothed, gather_split="pairs", min_n=4,
         covers="label_smoothing 0.1, interleaved views, own column deleted"),
    Case("simcse_2view", L.simcse_loss, _simcse_2view, bench=True, covers="two views",
         inputs="z1 [N, D], z2 [N, D]; logits N x N", logits=_sq, gather_split="rows"),
    Case("simcse_2view_none", L.simcse_loss, _simcse_2view_none, covers="two views, per-row, tensor temperature"),
    Case("simcse_sup", L.simcse_sup_loss, _simcse_sup, families=frozenset({"huge_rows"}),
         bench=True, covers="interleaved NLI triplets",
         inputs="interleaved triplets z [3N, D]; logits N x 2N", logits=lambda n: (n, 2 * n)),
    Case("simcse_sup_hard", L.simcse_sup_loss, _simcse_sup_hard, families=frozenset({"gradcheck"}),
         covers="hard-negative weight (bias column)",
         m=lambda n: 2 * n, inductor=True),
    Case("simcse_sup_smoothed", L.simcse_sup_loss, _simcse_sup_smoothed, families=frozenset({"gradcheck"}),
         covers="label_smoothing 0.1 with the hard-negative bias column", m=lambda n: 2 * n),
    Case("simcse_sup_none", L.simcse_sup_loss, _simcse_sup_none, covers="negative weight, per-row losses",
         m=lambda n: 2 * n),
    Case("gist", L.gist_loss, _gist, op="guided", covers="GISTEmbed: a-p, a-a, p-p, a-n blocks, guide mask",
         logits=lambda n: (n, 4 * n), inductor=True),
    Case("gist_smoothed", L.gist_loss, _gist_smoothed, families=frozenset({"gradcheck"}), op="guided",
         covers="label_smoothing 0.1 over the columns the guide keeps, tensor temperature",
         logits=lambda n: (n, 4 * n)),
    Case("info_nce_masked_smoothed_none", L.info_nce, _info_nce_masked_smoothed_none,
         families=frozenset({"gradcheck"}), op="guided",
         covers="label_smoothing 0.2 with guide= and ids= masks (columns deleted), per-row, tensor temperature",
         logits=lambda n: (n, n + 3), m=lambda n: n + 3),
    Case("gist_relative_none", L.gist_loss, _gist_relative_none, families=frozenset({"gradcheck"}), op="guided",
         covers="relative margin, no anchor block, per-row, tensor temperature", logits=lambda n: (n, 2 * n)),
    Case("qwen3", L.qwen3_embedding_loss, _qwen3, op="guided", gather_split="rows",
         covers="Qwen3-Embedding: q-d, q-q, d-d blocks, false-negative mask, row negatives [N, 2, D]",
         logits=lambda n: (n, 3 * n + 2), inductor=True),
    Case("qwen3_plain_none", L.qwen3_embedding_loss, _qwen3_plain_none, families=frozenset({"gradcheck"}), op="guided",
         covers="no d-d block, no row negatives, margin 0.05, per-row, tensor temperature",
         logits=lambda n: (n, 2 * n)),
    Case("supcon_out", L.supcon_loss, _supcon("out"), families=frozenset({"degenerate_rows"}),
         bench=True, covers="labels, L_out, B is A",
         inputs="features [N/2, 2, D], labels [N/2] (up to 100 classes); logits N x N", logits=_sq, min_n=2),
    Case("supcon_in", L.supcon_loss, _supcon("in"), families=frozenset({"gradcheck", "degenerate_rows", "huge_rows"}),
         bench=True, covers="labels, L_in (LSE over positives)",
         inputs="features [N/2, 2, D], labels [N/2] (up to 100 classes); logits N x N", logits=_sq, min_n=2),
    Case("supcon_temps", L.supcon_loss, _supcon_temps, families=frozenset({"gradcheck"}),
         covers="tensor temperature and base_temperature", min_n=2),
    Case("supcon_mask_in", L.supcon_loss, _supcon_mask("in", "none"), families=frozenset({"gradcheck"}),
         covers="dense asymmetric mask, L_in, per-row",
         min_n=2),
    Case("supcon_mask_out", L.supcon_loss, _supcon_mask("out", "mean"), covers="dense mask, L_out", min_n=2),
    Case("supcon_one", L.supcon_loss, _supcon_one, families=frozenset({"gradcheck"}),
         covers="contrast_mode one, 3 views", min_n=3),
    Case("supcon_simclr_one", L.supcon_loss, _supcon_simclr_one, covers="no labels (SimCLR), mode one, L_in", min_n=3),
    Case("supcon_queue", L.supcon_loss, _supcon_queue("out", "mean"), families=frozenset({"gradcheck"}),
         covers="memory-bank queue columns",
         min_n=2, m=lambda n: 2 * (n // 2) + 7),
    Case("supcon_queue_in", L.supcon_loss, _supcon_queue("in", "none"), covers="queue, L_in, per-row",
         min_n=2, m=lambda n: 2 * (n // 2) + 7, inductor=True),
    Case("dscl", L.dscl_loss, _dscl(False), families=frozenset({"degenerate_rows", "huge_rows"}),
         bench=True, covers="decoupled weights, own view 1",
         inputs="features [N, 2, D], labels [N] (up to 100 classes); logits N x 2N", logits=lambda n: (n, 2 * n)),
    Case("dscl_queue", L.dscl_loss, _dscl(True), families=frozenset({"gradcheck"}),
         covers="decoupled weights with a queue, tensor temperature",
         m=lambda n: 2 * n + 5, inductor=True),
    Case("dcl", L.dcl_loss, _dcl(False), bench=True, covers="both views anchors, self and partner out of the LSE",
         inputs="z1 [N/2, D], z2 [N/2, D]; logits N x N", logits=_sq, min_n=4, m=lambda n: 2 * (n // 2),
         inductor=True),
    Case("dcl_none", L.dcl_loss, _dcl(False, "none", tensor_t=True), families=frozenset({"gradcheck"}),
         min_n=4, m=lambda n: 2 * (n // 2),
         covers="per-anchor losses, tensor temperature"),
    Case("dcl_raw_sum", L.dcl_loss, _dcl(False, "sum", normalize=False), min_n=4, m=lambda n: 2 * (n // 2),
         covers="normalize=False, sum"),
    Case("dclw", L.dclw_loss, _dcl(True), bench=True, covers="positive weighted by 2 - N softmax(cos / sigma)",
         inputs="z1 [N/2, D], z2 [N/2, D]; logits N x N", logits=_sq, min_n=4, m=lambda n: 2 * (n // 2),
         inductor=True),
    Case("dclw_none", L.dclw_loss, _dcl(True, "none", tensor_t=True), min_n=4, m=lambda n: 2 * (n // 2),
         covers="weighted, per-anchor losses, tensor temperature"),
    Case("cosent", cosent_loss, _cosent, families=frozenset({"gradcheck", "degenerate_rows", "huge_rows"}),
         gather_split="rows",
         op="cosent", bench=True, covers="pair cosines, grades 0..5",
         inputs="u [N, D], v [N, D], labels [N] (grades 0..5); N x N label pairs", inductor=True),
    Case("cosent_scores", cosent_loss_from_scores, _cosent_scores, families=frozenset({"gradcheck"}), op="cosent",
         covers="given scores, real labels, tensor scale", inductor=True),
    Case("siglip", siglip_loss, _siglip, op="siglip", bench=True, covers="sigmoid loss, scale 10, bias -10",
         inputs="image [N, D], text [N, D]; logits N x N", logits=_sq, inductor=True, gather_split="rows"),
    Case("siglip_learn", siglip_loss, _siglip_learn, families=frozenset({"gradcheck"}), gather_split="rows",
         op="siglip", covers="learnable scale and bias, sum"),
    Case("siglip_raw_none", siglip_loss, _siglip_raw_none, op="siglip",
         covers="normalize=False, learnable bias, per-image losses"),
    Case("siglip_groups", siglip_loss, _siglip_groups, families=frozenset({"gradcheck"}), op="siglip",
         covers="group positives (SigLIP+ weights), M = 2N texts, learnable scale and bias, per-image losses",
         m=lambda n: 2 * n, peaked=False),
    Case("uniformity", uniformity, _uniformity, families=frozenset({"gradcheck"}),
         covers="log mean exp(-2 ||x_i - x_j||^2) of unit rows, N >= 2",
         min_n=2, inductor=True),
    Case("uniformity_raw", uniformity, _uniformity_raw,
         covers="normalize=False, tensor t = 1.5 (augmented rows, B != A)", min_n=2),
    Case("alignment", alignment, _alignment, families=frozenset({"gradcheck"}),
         op="alignment", covers="mean squared distance of unit pairs",
         inductor=True),
    Case("alignment_raw", alignment, _alignment_raw, op="alignment", covers="alpha 1.5, normalize=False"),
]
CASE_BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
BENCH_CASES: list[Case] = [c for c in CASES if c.bench]

#: Ragged shapes (N anchors, D) of the correctness grid: N 1 (a single row: degenerate softmax), 2, 3
#: (odd, smaller than any block), 97 (prime), 128 (a power of two), 257 (one past it); D 1 (every
#: cosine is +-1), 3, 100 (not a multiple of 8), 768 (BERT).
SHAPES: list[tuple[int, int]] = [(n, d) for n in (1, 2, 3, 97, 128, 257) for d in (1, 3, 100, 768)]


def get(name: str) -> Case:
    """The case called ``name``; ``KeyError`` listing the valid names otherwise."""
    try:
        return CASE_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown case {name!r}; valid: {', '.join(CASE_BY_NAME)}") from None


def shapes_for(case: Case, shapes: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The (N, D) of ``shapes`` (default :data:`SHAPES`) at which ``case`` is defined (N >= its min_n)."""
    return [(n, d) for n, d in (SHAPES if shapes is None else shapes) if n >= case.min_n]


def make_inputs(case: Case, n: int, d: int, seed: int = 0, regime: str = "flat") -> Inputs:
    """The inputs of ``case`` at N anchors and dimension D (float32, CPU, seeded) in ``regime`` (one of
    :data:`REGIMES`: "flat", the case's own temperature on independent rows; "peaked" / "sharp":
    correlated positives at temperature 0.05 / 0.01; "saturated": "peaked" with the target's logit far
    above the rest, p ~ 0.9999). ``ValueError`` below the case's ``min_n`` or for
    an unknown regime."""
    if n < case.min_n:
        raise ValueError(f"case {case.name} needs N >= {case.min_n}, got N = {n}")
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {regime!r}")
    t = REGIMES[regime]
    flat = case.build(n, d, torch.Generator().manual_seed(seed))
    if t is None or not case.peaked or flat[1].get("normalize") is False:  # raw rows: scaled for their norms
        return flat
    margin = REGIME_MARGIN.get(regime, 2.0)
    token = _LATENT.set(_latent(n, t, seed, margin))
    try:
        inputs = case.build(n, d, torch.Generator().manual_seed(seed))
    finally:
        _LATENT.reset(token)
    return _set_temperature(inputs, t, positive_cosine(max(n, 2), d, t, margin) / 2)
