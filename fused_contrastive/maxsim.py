"""Late interaction (ColBERT's MaxSim) with in-batch negatives, without the token similarity tensor.

A query i of token vectors ``q_ia`` (a = 1..Lq) and a document j of token vectors ``d_jb`` (b = 1..Ld)
score ``S_ij = sum_a w_ia max_{b valid in j} <q_ia, d_jb>`` (``w_ia``: the query mask as 0 / 1 or float
weights; divided by the query's token count for MeanMaxSim). The loss is the cross-entropy of
``scale * S_i`` against the row's target column. The token similarities form an N·Lq x M·Ld tensor
(6e9 entries at N = M = 1024, Lq = 32, Ld = 180); here they exist only one chunk (torch) or one tile
(Triton) at a time: the forward keeps the scores ``S`` [N, M] and, per (query token, document), the index
of the maximising document token ``[N, Lq, M]`` (int16, int32 for Ld >= 2^15), so memory is
O(N·Lq·D + M·Ld·D + N·Lq·M) and the backward needs no second similarity pass (the index costs
N·Lq·M·2 bytes; recomputing it would cost one more matmul of the full token products, the whole
forward again).

Gradient rule at ties: ``max`` is not differentiable where two document tokens tie for the maximum;
the gradient of that term goes to the first of them (the lowest token index), on every backend and
in the reference (``reference`` below takes that index explicitly).

A document with no valid token scores ``EMPTY_DOC_SCORE`` (-1e9, before the scale; divided by the
query's token count under MeanMaxSim), as sentence-transformers' MaxSim scorers do: it ranks below every
real document and gets no gradient.

``backend="torch"`` runs the chunked PyTorch path below (any device); ``backend="triton"`` the kernels
of ``core/maxsim/triton_maxsim.py`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``); ``backend="reference"``
materialises the [N, M, Lq, Ld] similarities in float64 (the test oracle).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from . import _validate as V
from . import distributed as D
from ._amp import autocast_off
from ._backend import resolve
from ._first_order import first_order
from .core import reference as ref

__all__ = ["EMPTY_DOC_SCORE", "maxsim_info_nce", "maxsim_scores"]

#: the score of a document without any valid token (before the scale): sentence-transformers' value
EMPTY_DOC_SCORE = -1e9
#: elements of one chunk's token similarities (torch path) and of one chunk's gathered rows (backward) on
#: the CPU: 16 MB fp32 chunks (64 MB ones sit above glibc's mmap threshold and are page-faulted afresh each
#: time: 7.3 s of kernel time in a 10.8 s step at N = 512 on 2 cores, 0.3 s at 16 MB)
CHUNK_ELEMENTS = 1 << 22
#: the same on a GPU (its caching allocator reuses the blocks; larger chunks, fewer launches)
DEVICE_CHUNK_ELEMENTS = 1 << 24


# --- inputs -----------------------------------------------------------------------------------------

def _tokens(name: str, x) -> Tensor:
    return V.embeddings(name, x, ndim=3, shape_hint="3 dimensions [batch, tokens, dim]")


def _mask(name: str, m, shape: tuple[int, int], device: torch.device, *, weights: bool) -> Tensor | None:
    """None, or a [batch, tokens] tensor: bool (or integer 0 / 1) masks; float weights where ``weights``."""
    if m is None:
        return None
    if not isinstance(m, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {list(shape)} or None, got {type(m).__name__}")
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)} (one entry per token), got {tuple(m.shape)}")
    if m.device != device:
        raise ValueError(f"{name} is on {m.device} but the token embeddings are on {device}")
    if m.is_complex() or (m.is_floating_point() and not weights):
        raise TypeError(f"{name} must be a bool (or integer 0 / 1) mask, got {m.dtype}")
    return m


def query_weights(query_mask: Tensor | None, n: int, lq: int, length_normalize: bool, dtype: torch.dtype,
                  device: torch.device) -> Tensor:
    """``w`` [N, Lq] in ``dtype``: the mask as 0 / 1 (float masks as given), divided by the count of
    non-zero entries per query (at least 1) for MeanMaxSim."""
    w = (torch.ones(n, lq, dtype=dtype, device=device) if query_mask is None else
         query_mask.to(dtype) if query_mask.is_floating_point() else (query_mask != 0).to(dtype))
    if length_normalize:
        count = (w != 0).sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
        w = w / count
    return w


def empty_scores(w: Tensor, length_normalize: bool) -> Tensor:
    """[N]: the score of a document without any valid token, per query: ``EMPTY_DOC_SCORE``, divided by
    the query's count of non-zero weights under MeanMaxSim (sentence-transformers fills it, then divides
    every score by the count)."""
    if not length_normalize:
        return torch.full((w.shape[0],), EMPTY_DOC_SCORE, dtype=w.dtype, device=w.device)
    return EMPTY_DOC_SCORE / (w != 0).sum(dim=1).clamp(min=1).to(w.dtype)


def _fill(s: Tensor, valid: Tensor, fill: Tensor) -> Tensor:
    """``s`` with the empty documents' columns set to ``fill`` [N]."""
    return torch.where(valid.any(dim=1)[None, :], s, fill.to(s.dtype)[:, None])


def _valid(doc_mask: Tensor | None, m: int, ld: int, device: torch.device) -> Tensor:
    return torch.ones(m, ld, dtype=torch.bool, device=device) if doc_mask is None else doc_mask != 0


def _pad_tokens(x: Tensor, valid: Tensor, ld: int) -> tuple[Tensor, Tensor]:
    """``x`` [M, L, D] and ``valid`` [M, L] padded with invalid tokens to ``ld`` tokens."""
    if x.shape[1] == ld:
        return x, valid
    x = torch.cat([x, x.new_zeros(x.shape[0], ld - x.shape[1], x.shape[2])], dim=1)
    valid = torch.cat([valid, valid.new_zeros(valid.shape[0], ld - valid.shape[1])], dim=1)
    return x, valid


def index_dtype(ld: int) -> torch.dtype:
    """The dtype of the stored argmax indices: int16 below 2^15 document tokens, else int32."""
    return torch.int16 if ld < (1 << 15) else torch.int32


# --- the reference (oracle) -------------------------------------------------------------------------

def reference_scores(q: Tensor, d: Tensor, w: Tensor, valid: Tensor, fill: Tensor | None = None) -> Tensor:
    """``S`` [N, M] from the materialised [N, M, Lq, Ld] similarities (float64 for float64 inputs, else
    float32, or ``core.reference.computing_in``'s dtype), the maximum's gradient at the first maximising
    token (taken explicitly, not left to ``torch.max``)."""
    dt = ref._dt(q, d)
    sims = torch.einsum("nad,mbd->nmab", q.to(dt), d.to(dt))
    sims = sims.masked_fill(~valid[None, :, None, :], -math.inf)
    top = sims.detach().amax(dim=-1, keepdim=True)
    first = (sims.detach() == top).to(torch.int8).argmax(dim=-1, keepdim=True)  # the first maximum
    empty = ~valid.any(dim=1)  # [M]
    first = first.masked_fill(empty[None, :, None, None], 0)
    best = sims.gather(-1, first).squeeze(-1)  # [N, M, Lq]
    best = best.masked_fill(empty[None, :, None], 0.0)
    s = torch.einsum("nma,na->nm", best, w.to(dt))
    return _fill(s, valid, empty_scores(w, False) if fill is None else fill)


def reference(query_tokens: Tensor, doc_tokens: Tensor, target: Tensor | None = None, *,
              query_mask: Tensor | None = None, doc_mask: Tensor | None = None, scale=1.0,
              length_normalize: bool = False, normalize: bool = True, reduction: str = "mean",
              ignore_index: int = -100, label_smoothing: float = 0.0) -> Tensor:
    """The textbook computation of :func:`maxsim_info_nce` (no gather, no negatives argument: append
    the negatives to ``doc_tokens``): materialised similarities, ``F.cross_entropy`` of ``scale * S``."""
    dt = ref._dt(query_tokens, doc_tokens)
    n, lq, _ = query_tokens.shape
    m, ld, _ = doc_tokens.shape
    q = ref._unit(query_tokens, normalize, dt)
    d = ref._unit(doc_tokens, normalize, dt)
    w = query_weights(query_mask, n, lq, length_normalize, dt, q.device)
    s = reference_scores(q, d, w, _valid(doc_mask, m, ld, q.device), empty_scores(w, length_normalize))
    t = torch.arange(n, device=q.device) if target is None else target.long()
    logits = ref._scalar(scale, dt) * s
    return torch.nn.functional.cross_entropy(logits, t, reduction=reduction, ignore_index=ignore_index,
                                             label_smoothing=label_smoothing)


# --- the chunked PyTorch path -----------------------------------------------------------------------

def _chunks(n: int, m: int, per_pair: int, device: torch.device) -> tuple[int, int]:
    """Rows and columns of a chunk whose ``rows * cols * per_pair`` elements fit ``CHUNK_ELEMENTS`` (on the
    CPU) or ``DEVICE_CHUNK_ELEMENTS``."""
    budget = CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    pairs = max(1, budget // max(per_pair, 1))
    # the floor of the square root through a float (exact below 2^52; math.isqrt takes no symbolic size, and
    # under torch.compile(dynamic=True) the token counts are symbolic)
    cols = min(m, max(1, int(pairs ** 0.5)))
    rows = min(n, max(1, pairs // cols))
    return rows, cols


def scores_torch(q: Tensor, d: Tensor, w: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``(S [N, M], idx [N, Lq, M])``: the scores in float32 (float64 for float64 inputs) and the first
    maximising document token per (query token, document), chunk by chunk (at most ``CHUNK_ELEMENTS``
    similarities at a time, computed in the scores' dtype)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    n, lq, dim = q.shape
    m, ld, _ = d.shape
    s = torch.empty(n, m, dtype=dt, device=q.device)
    idx = torch.empty(n, lq, m, dtype=index_dtype(ld), device=q.device)
    empty = ~valid.any(dim=1)
    w = w.to(dt)
    rows, cols = _chunks(n, m, lq * ld, q.device)
    for j0 in range(0, m, cols):
        j1 = min(j0 + cols, m)
        dc = d[j0:j1].to(dt).reshape(-1, dim)
        pad = ~valid[j0:j1]  # [mc, Ld]
        for i0 in range(0, n, rows):
            i1 = min(i0 + rows, n)
            sims = (q[i0:i1].to(dt).reshape(-1, dim) @ dc.T).view(i1 - i0, lq, j1 - j0, ld)
            sims.masked_fill_(pad[None, None], -math.inf)
            best, arg = sims.max(dim=-1)  # the first maximum on ties (torch.max's documented rule)
            del sims
            best.masked_fill_(empty[None, None, j0:j1], 0.0)
            s[i0:i1, j0:j1] = torch.einsum("nam,na->nm", best, w[i0:i1])
            idx[i0:i1, :, j0:j1] = arg
    s.masked_fill_(empty[None, :], EMPTY_DOC_SCORE)
    return s, idx


def grads_torch(q: Tensor, d: Tensor, w: Tensor, idx: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``dq_ia = w_ia sum_j G_ij d_{j, idx_iaj}`` and ``dd_jb = sum_{(i,a): idx_iaj = b} G_ij w_ia q_ia``
    (``g`` = G [N, M], zero on empty documents), in ``g``'s dtype, chunk by chunk: a gather of the
    maximising rows and an ``index_add_`` (no similarity is recomputed)."""
    dt = g.dtype
    n, lq, dim = q.shape
    m, ld, _ = d.shape
    dq = torch.zeros(n, lq, dim, dtype=dt, device=q.device)
    dd = torch.zeros(m * ld, dim, dtype=dt, device=q.device)
    w = w.to(dt)
    rows, cols = _chunks(n, m, lq * dim, q.device)
    for j0 in range(0, m, cols):
        j1 = min(j0 + cols, m)
        dc = d[j0:j1].to(dt).reshape(-1, dim)
        base = (torch.arange(j0, j1, device=q.device) - j0) * ld
        for i0 in range(0, n, rows):
            i1 = min(i0 + rows, n)
            c = g[i0:i1, None, j0:j1] * w[i0:i1, :, None]  # [nc, Lq, mc]
            flat = idx[i0:i1, :, j0:j1].long() + base  # rows of dc
            dq[i0:i1] += torch.einsum("nam,namd->nad", c, dc[flat])
            qc = q[i0:i1].to(dt)
            part = c[..., None] * qc[:, :, None, :]  # [nc, Lq, mc, D]
            dd.index_add_(0, (flat + j0 * ld).reshape(-1), part.reshape(-1, dim))
    return dq, dd.view(m, ld, dim)


# --- the autograd Function --------------------------------------------------------------------------

def _scores(backend: str, q, d, w, valid, scale_t, fill: Tensor, length_normalize: bool):
    """``(S, idx, lse)`` of the backend: lse_i = logsumexp_j scale S_ij, the empty documents at ``fill``."""
    if backend == "triton":
        from .core.maxsim import triton_maxsim

        s, idx, lse = triton_maxsim.maxsim_forward(q, d, w.float(), valid, scale_t.float().reshape(1),
                                                   EMPTY_DOC_SCORE)
        if not length_normalize:  # the kernels' online LSE saw the same empty score
            return s, idx, lse
        s = _fill(s, valid, fill)
    else:
        s, idx = scores_torch(q, d, w, valid)
        s = _fill(s, valid, fill) if length_normalize else s
    return s, idx, torch.logsumexp(scale_t.to(s.dtype) * s, dim=1)


def _grads(backend: str, q, d, w, valid, idx, g):
    if backend == "triton":
        from .core.maxsim import triton_maxsim

        return triton_maxsim.maxsim_backward(q, d, w.float(), idx, g.float(), valid)
    return grads_torch(q, d, w, idx, g)


class MaxSimCEFn(torch.autograd.Function):
    """Per-query losses ``lse_i - scale ((1 - eps) S_{i, t_i} + eps mean_j S_ij)`` [N] (0 where ``t_i`` is
    ignored; ``eps`` the label smoothing, the mean a row mean of the saved scores) of token vectors
    ``q`` [N, Lq, D] and ``d`` [M, Ld, D] (already normalised when the loss normalises), query-token weights
    ``w`` [N, Lq], document-token validity ``valid`` [M, Ld], targets ``t`` [N] (ignored rows hold any
    column) and ``keep`` [N] bool, and the scale ``scale_t`` (a 0-dim tensor; its gradient is returned
    when it requires one). Saves ``S`` [N, M], the argmax indices [N, Lq, M] and ``lse`` [N]."""

    @staticmethod
    def forward(ctx, q, d, scale_t, w, valid, t, keep, fill, length_normalize, backend, eps=0.0):
        s, idx, lse = _scores(backend, q, d, w, valid, scale_t, fill, length_normalize)
        sc = scale_t.to(s.dtype)
        rows = torch.arange(q.shape[0], device=q.device)
        picked = s[rows, t] if not eps else (1 - eps) * s[rows, t] + eps * s.mean(dim=1)
        loss = torch.where(keep, lse.to(s.dtype) - sc * picked, torch.zeros((), dtype=s.dtype, device=q.device))
        ctx.save_for_backward(q, d, scale_t, w, valid, t, keep, s, idx, lse)
        ctx.backend, ctx.eps = backend, eps
        return loss

    @staticmethod
    @first_order("MaxSimCEFn")
    def backward(ctx, g):
        q, d, scale_t, w, valid, t, keep, s, idx, lse = ctx.saved_tensors
        dt = s.dtype
        sc = scale_t.detach().to(dt)
        g = torch.where(keep, g.to(dt), torch.zeros((), dtype=dt, device=g.device))
        p = torch.exp(sc * s - lse.to(dt)[:, None])
        rows = torch.arange(q.shape[0], device=q.device)
        eps = ctx.eps
        gs = p - eps / s.shape[1] if eps else p.clone()  # the uniform part of a smoothed target
        gs[rows, t] -= 1.0 - eps
        empty = ~valid.any(dim=1)
        gs = (sc * g)[:, None] * gs.masked_fill(empty[None, :], 0.0)
        dscale = None
        if ctx.needs_input_grad[2]:
            ps = (p * s.masked_fill(empty[None, :], 0.0)).sum(dim=1) - (1 - eps) * s[rows, t]
            if eps:  # (an empty document's fill score is a logit of the softmax too)
                ps = ps - eps * s.mean(dim=1)
            dscale = (g * ps).sum().to(scale_t.dtype)
        dq = dd = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dq, dd = _grads(ctx.backend, q, d, w, valid, idx, gs)
            dq, dd = dq.to(q.dtype), dd.to(d.dtype)
        return dq, dd, dscale, None, None, None, None, None, None, None, None


class _ScoresFn(torch.autograd.Function):
    """``S`` [N, M] of :func:`maxsim_scores` with the same saved index and backward."""

    @staticmethod
    def forward(ctx, q, d, w, valid, fill, backend):
        if backend == "triton":
            from .core.maxsim import triton_maxsim

            one = torch.ones(1, dtype=torch.float32, device=q.device)
            s, idx, _ = triton_maxsim.maxsim_forward(q, d, w.float(), valid, one, EMPTY_DOC_SCORE)
        else:
            s, idx = scores_torch(q, d, w, valid)
        s = _fill(s, valid, fill)
        ctx.save_for_backward(q, d, w, valid, idx)
        ctx.backend = backend
        return s

    @staticmethod
    @first_order("_ScoresFn")
    def backward(ctx, g):
        q, d, w, valid, idx = ctx.saved_tensors
        g = g.masked_fill(~valid.any(dim=1)[None, :], 0.0)
        g = g.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        dq, dd = _grads(ctx.backend, q, d, w, valid, idx, g)
        return dq.to(q.dtype), dd.to(d.dtype), None, None, None, None


# --- the public functions ---------------------------------------------------------------------------

def _prepare(query_tokens, doc_tokens, query_mask, doc_mask, normalize, length_normalize):
    query_tokens = _tokens("query_tokens", query_tokens)
    doc_tokens = _tokens("doc_tokens", doc_tokens)
    V.same_dim("query_tokens", query_tokens, "doc_tokens", doc_tokens)
    V.same_device(query_tokens=query_tokens, doc_tokens=doc_tokens)
    V.same_precision("query_tokens", query_tokens, "doc_tokens", doc_tokens)
    V.flag("normalize", normalize)
    V.flag("length_normalize", length_normalize)
    dev = query_tokens.device
    n, lq, _ = query_tokens.shape
    m, ld, _ = doc_tokens.shape
    query_mask = _mask("query_mask", query_mask, (n, lq), dev, weights=True)
    doc_mask = _mask("doc_mask", doc_mask, (m, ld), dev, weights=False)
    return query_tokens, doc_tokens, query_mask, doc_mask


def _unit(x: Tensor, normalize: bool) -> Tensor:
    """Token vectors L2-normalised (overflow-free, ``x / max(||x||, 1e-12)``) in the input dtype."""
    if not normalize:
        return x
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return ref._unit(x, True, dt).to(x.dtype)


@autocast_off
def maxsim_scores(query_tokens: Tensor, doc_tokens: Tensor, *, query_mask: Tensor | None = None,
                  doc_mask: Tensor | None = None, length_normalize: bool = False, normalize: bool = False,
                  backend: str = "auto") -> Tensor:
    """MaxSim scores ``S_ij = sum_a w_ia max_b <q_ia, d_jb>`` [N, M] (float32; float64 for float64
    inputs) without the [N·Lq, M·Ld] token similarities, differentiable (the module docstring states the
    gradient rule at ties). The same scores as sentence-transformers' ``colbert_scores`` /
    ``mean_colbert_scores`` (``length_normalize=True``) for one document per group.

    Args:
        query_tokens: [N, Lq, D] query token vectors (float16 / bfloat16 / float32 / float64).
        doc_tokens: [M, Ld, D] document token vectors, the same dtype family.
        query_mask: [N, Lq] bool (or 0 / 1 integer) mask of real query tokens, or float weights
            (multiplied into each token's maximum, as sentence-transformers does); None: every token.
        doc_mask: [M, Ld] bool (or 0 / 1 integer) mask of real document tokens; None: every token.
            A document without any valid token scores ``EMPTY_DOC_SCORE`` (-1e9; divided by the query's
            count under ``length_normalize``).
        length_normalize: divide each query's sum by its count of non-zero ``query_mask`` entries
            (MeanMaxSim). Default False.
        normalize: L2-normalise every token first. Default False here (scores of the vectors as given).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` / ``"reference"``.
    """
    query_tokens, doc_tokens, query_mask, doc_mask = _prepare(query_tokens, doc_tokens, query_mask, doc_mask,
                                                              normalize, length_normalize)
    be = _backend(backend, query_tokens, doc_tokens)
    n, lq, _ = query_tokens.shape
    m, ld, _ = doc_tokens.shape
    dt = torch.float64 if query_tokens.dtype == torch.float64 else torch.float32
    dev = query_tokens.device
    w = query_weights(query_mask, n, lq, length_normalize, dt, dev)
    valid = _valid(doc_mask, m, ld, dev)
    if be == "reference":
        q = ref._unit(query_tokens, normalize, torch.float64)
        d = ref._unit(doc_tokens, normalize, torch.float64)
        return reference_scores(q, d, w.double(), valid, empty_scores(w.double(), length_normalize))
    return _ScoresFn.apply(_unit(query_tokens, normalize), _unit(doc_tokens, normalize), w, valid,
                           empty_scores(w, length_normalize), be)


def _backend(backend: str, query_tokens: Tensor, doc_tokens: Tensor) -> str:
    """``resolve`` for op "maxsim", with the kernels' limit on Lq: "auto" takes the PyTorch path above
    it, an explicit "triton" raises."""
    be = resolve(backend, query_tokens, doc_tokens, op="maxsim")
    if be == "triton":
        from .core.maxsim.triton_maxsim import MAX_LQ

        if query_tokens.shape[1] > MAX_LQ:
            if backend == "triton":
                raise ValueError(f'backend="triton" takes at most {MAX_LQ} query tokens (query_tokens has '
                                 f'{query_tokens.shape[1]}); use backend="torch" or "auto"')
            return "torch"
    return be


def _gather_docs(docs: Tensor, valid: Tensor, grp, name: str) -> tuple[Tensor, Tensor, int, list[int]]:
    """Every rank's documents and validity, padded to the longest document of any rank."""
    ld = torch.tensor([docs.shape[1]], dtype=torch.int64, device=docs.device)
    dist.all_reduce(ld, op=dist.ReduceOp.MAX, group=grp)
    docs, valid = _pad_tokens(docs, valid, int(ld.item()))
    out, off, sizes = D.gather_rows(docs, grp, name=name)
    vout, _, _ = D.gather_rows(valid, grp, name=f"{name} mask")
    return out, vout, off, sizes


@D.agreed(ragged=("query_tokens", "doc_tokens", "query_mask", "doc_mask", "negatives", "negative_mask"))
@autocast_off
def maxsim_info_nce(query_tokens: Tensor, doc_tokens: Tensor, target: Tensor | None = None, *,
                    query_mask: Tensor | None = None, doc_mask: Tensor | None = None,
                    negatives: Tensor | None = None, negative_mask: Tensor | None = None,
                    temperature=None, scale=None, length_normalize: bool = False, normalize: bool = True,
                    reduction: str = "mean", ignore_index: int = -100, backend: str = "auto",
                    gather=False, label_smoothing: float = 0.0) -> Tensor:
    """In-batch-negatives cross-entropy over late-interaction (MaxSim) scores, the drop-in for
    ``F.cross_entropy(scale * colbert_scores(q, d), target)`` without the N·Lq x M·Ld token similarities.

    ``S_ij = sum_a w_ia max_{b: doc_mask_jb} <q_ia, d_jb>`` (unit tokens when ``normalize``), and
    ``loss_i = logsumexp_j (scale S_ij) - scale S_{i, target_i}`` over the documents and then the
    negatives. Memory O(N·Lq·D + M·Ld·D + N·Lq·M); the module docstring gives the tie rule.

    Args:
        query_tokens: [N, Lq, D] query token vectors (float16 / bfloat16 / float32 / float64).
        doc_tokens: [M, Ld, D] document token vectors; document i is query i's positive by default.
        target: [N] integer column per query (columns: the documents, then the negatives; under
            ``gather`` the gathered columns); None: ``arange(N)`` (plus this rank's row offset under
            ``gather``). Rows equal to ``ignore_index`` contribute 0 and leave the mean's denominator.
        query_mask: [N, Lq] bool (or 0 / 1 integer) mask of real query tokens, or float weights; None:
            every token.
        doc_mask: [M, Ld] bool (or 0 / 1 integer) mask of real document tokens; None: every token. A
            document without any valid token scores -1e9 (``EMPTY_DOC_SCORE``) before the scale (divided by the
            query's count under ``length_normalize``).
        negatives: [K, Ln, D] hard-negative documents (any Ln), columns M .. M + K - 1 of every query;
            ``negative_mask`` [K, Ln] their mask. None: none.
        temperature / scale: at most one (``scale = 1 / temperature``); neither means scale 1 (the
            default of PyLate and sentence-transformers for MaxSim, whose scores range over [-Lq, Lq]). A
            float or a 0-dim tensor (differentiable).
        length_normalize: MeanMaxSim: each query's sum divided by its count of non-zero mask entries.
        normalize: L2-normalise every token (``x / max(||x||, 1e-12)``). Default True; False when the
            encoder already normalises (sentence-transformers' multi-vector models do).
        reduction: ``"mean"`` (over the non-ignored rows), ``"sum"`` or ``"none"`` ([N]).
        ignore_index: the target value of an ignored row (default -100).
        backend: ``"auto"`` (Triton for CUDA tensors that are not float64, when triton is installed;
            else torch), ``"torch"`` (chunked, any device), ``"triton"`` or ``"reference"`` (float64,
            materialised: the test oracle; not with ``gather``).
        gather: False, True (the default process group) or a ProcessGroup: this rank's queries against
            every rank's documents (and negatives), gathered with gradients and padded to the longest
            document of any rank; a mean returns the local sum times ``world / (global non-ignored
            rows)``, a sum the local sum times ``world`` (so DDP's average over ranks is the global-batch
            loss), ``"none"`` the local rows' losses.
        label_smoothing: ``F.cross_entropy``'s, in [0, 1) (default 0): the target ``(1 - eps) onehot + eps / M``
            over every column of the softmax (the documents, then the negatives; a document without tokens
            too, at its fill score), from the row mean of the scores the loss forms anyway (O(N·M)).

    Returns:
        0-dim loss (mean / sum) or [N] per-query losses; float32 (float64 for float64 inputs).
        Gradients come back in each input's dtype; the masks get none.
    """
    query_tokens, doc_tokens, query_mask, doc_mask = _prepare(query_tokens, doc_tokens, query_mask, doc_mask,
                                                              normalize, length_normalize)
    dev = query_tokens.device
    n, lq, dim = query_tokens.shape
    reduction = V.reduction(reduction)
    ignore_index = V.ignore_index(ignore_index)
    dt = torch.float64 if query_tokens.dtype == torch.float64 else torch.float32
    s, _t = V.scale_of(temperature, scale, 1.0, dt, dev)
    eps = V.label_smoothing(label_smoothing)
    if negatives is not None:
        negatives = _tokens("negatives", negatives)
        V.same_dim("query_tokens", query_tokens, "negatives", negatives)
        V.same_device(query_tokens=query_tokens, negatives=negatives)
        V.same_precision("doc_tokens", doc_tokens, "negatives", negatives)
        negative_mask = _mask("negative_mask", negative_mask, tuple(negatives.shape[:2]), dev, weights=False)
    elif negative_mask is not None:
        raise ValueError("negative_mask was given without negatives")
    be = _backend(backend, query_tokens, doc_tokens)
    grp = D.process_group(gather)
    if grp is not None and be == "reference":
        raise ValueError('backend="reference" does not gather; use backend="torch" with gather')
    docs, valid = doc_tokens, _valid(doc_mask, doc_tokens.shape[0], doc_tokens.shape[1], dev)
    negs = None
    if negatives is not None:
        negs = (negatives, _valid(negative_mask, negatives.shape[0], negatives.shape[1], dev))
    if target is not None:  # its shape and dtype: local facts, checked before any collective
        V.target(target, n, None, ignore_index, dev)
    qoff, n_total, world = 0, n, 1
    if grp is not None:
        # the query offset: the default target pairs global query qoff + i with global document qoff + i, as
        # the single-process loss over the concatenated batch does (the documents' offset differs from it
        # when a rank holds more or fewer documents than queries)
        qoff, n_total = D.agree(grp, scale=s, rows=n)
        docs, valid, _, _ = _gather_docs(docs, valid, grp, "doc_tokens")
        if negs is not None:
            negs = _gather_docs(*negs, grp, "negatives")[:2]
        world = D.world_size(grp)
    m_docs = docs.shape[0]
    if negs is not None:
        ld = max(docs.shape[1], negs[0].shape[1])
        docs, valid = _pad_tokens(docs, valid, ld)
        nx, nv = _pad_tokens(negs[0], negs[1], ld)
        docs, valid = torch.cat([docs, nx]), torch.cat([valid, nv])
    m = docs.shape[0]
    if target is None:
        # every rank knows every rank's query count and the documents': each raises (or none does)
        if n_total > m_docs:
            raise ValueError(f"target=None pairs query i with document i, which needs at least {n_total} documents "
                             f"(got {m_docs}{' over the ranks' if grp is not None else ''}); pass target")
        t = torch.arange(qoff, qoff + n, device=dev)
    elif grp is not None and V.readable(target):  # its range against the gathered columns: every rank is told
        # if one fails (a CUDA target's values are not read: nothing to tell, no collective, no host sync)
        t = D.all_checked(grp, lambda: V.target(target, n, m, ignore_index, dev), "maxsim_info_nce")
    else:
        t = V.target(target, n, m, ignore_index, dev)
    keep = t != ignore_index
    if be == "reference":
        return reference(query_tokens, docs, torch.where(keep, t, ignore_index), query_mask=query_mask,
                         doc_mask=valid, scale=s, length_normalize=length_normalize, normalize=normalize,
                         reduction=reduction, ignore_index=ignore_index, label_smoothing=eps)
    w = query_weights(query_mask, n, lq, length_normalize, dt, dev)
    scale_t = s if isinstance(s, Tensor) else torch.tensor(float(s), dtype=dt, device=dev)
    per = MaxSimCEFn.apply(_unit(query_tokens, normalize), _unit(docs, normalize), scale_t.reshape(()), w,
                           valid, torch.where(keep, t, 0), keep, empty_scores(w, length_normalize), length_normalize,
                           be, eps)
    if reduction == "none":
        return per
    total = per.sum()
    if reduction == "sum":
        return total * world
    count = keep.sum().to(per.dtype)
    if grp is not None:
        dist.all_reduce(count, group=grp)
        return total * world / count
    return total / count
