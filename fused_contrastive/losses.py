"""Public contrastive losses. Each is the core op (masked row log-sum-exp over scaled cosines, see
``_spec.py``) plus an O(N*D) positive term written in plain PyTorch (autograd differentiates it).

Common keyword arguments:

* ``normalize`` (default True): L2-normalise rows inside the loss (``x / max(||x||, 1e-12)``, like
  ``F.normalize``). With False the raw dot products are used.
* ``reduction``: ``"mean"`` (default), ``"sum"`` or ``"none"`` (per-anchor losses).
* ``backend``: ``"auto"`` (default; env ``FUSED_CONTRASTIVE_BACKEND`` overrides it, then triton
  for CUDA tensors that are not float64 when triton imports, else torch), ``"torch"`` (chunked, O(N*D) memory, any device),
  ``"triton"`` (fused kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"reference"``
  (materialises the logits; the test oracle).

Embeddings may be float16, bfloat16, float32 or float64, contiguous or not. Accumulation is in
float32 (float64 for float64 inputs); the loss is float32 (float64 for float64 inputs) and gradients
come back in each input's dtype. ``temperature`` / ``scale`` may be a Python number or a 0-dim tensor;
a tensor that requires grad gets its exact gradient. Tensor values are validated only on CPU (reading
a CUDA value would be a host sync).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _reference as ref
from . import _validate as V
from ._dispatch import run_core
from ._spec import CoreSpec, CoreTensors, compute_dtype

__all__ = [
    "info_nce",
    "simcse_loss",
    "simcse_sup_loss",
    "supcon_loss",
    "dscl_loss",
    "clip_loss",
]

_EPS = 1e-12
_DEFAULT_TEMPERATURE = 0.05


# ----------------------------------------------------------------------------------------------
# shared plumbing
# ----------------------------------------------------------------------------------------------


def _unit(x: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    """Rows of ``x`` in the compute dtype, L2-normalised if asked (differentiable)."""
    x = x.to(dt)
    return F.normalize(x, dim=1, eps=_EPS) if normalize else x


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    return (x * y).sum(dim=1)


def _times(c: Tensor, x: Tensor) -> Tensor:
    """c * x with 0 wherever c == 0 (so 0 * inf and 0 * nan of unused rows never leak)."""
    return torch.where(c != 0, c * x, torch.zeros((), dtype=x.dtype, device=x.device))


class _PairCos(torch.autograd.Function):
    """``out_i = <x_hat_i, y_hat_{idx_i}>`` (cosine of row i of x with row idx_i of y).

    The positive logit of the CE-shaped losses. Written as a Function so that it saves only its
    inputs (no normalised or gathered [N, D] copies) and works in row chunks: the O(N*D) memory of
    the losses stays a small multiple of the inputs.
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, idx: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, y, idx)
        ctx.normalize, ctx.dt = normalize, dt
        out = torch.empty(x.shape[0], dtype=dt, device=x.device)
        for r0, r1 in _chunks(x.shape[0], x.shape[1]):
            xr, yr = x[r0:r1].to(dt), y[idx[r0:r1]].to(dt)
            dot = torch.linalg.vecdot(xr, yr, dim=1)
            if normalize:
                dot = dot / (_norm(xr) * _norm(yr))
            out[r0:r1] = dot
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, y, idx = ctx.saved_tensors
        dt = ctx.dt
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if need_x else None
        gy = torch.zeros(y.shape, dtype=dt, device=y.device) if need_y else None
        for r0, r1 in _chunks(x.shape[0], x.shape[1]):
            xr, yr, gr = x[r0:r1].to(dt), y[idx[r0:r1]].to(dt), g[r0:r1].to(dt)[:, None]
            if ctx.normalize:
                nx, ny = _norm(xr)[:, None], _norm(yr)[:, None]
                xh, yh = xr / nx, yr / ny
                c = torch.linalg.vecdot(xh, yh, dim=1)[:, None]
                # d<x/|x|, y/|y|>/dx = (y_hat - x_hat c) / |x| (the projection vanishes when |x| < eps)
                cx = torch.where(nx > _EPS, c, torch.zeros_like(c))
                cy = torch.where(ny > _EPS, c, torch.zeros_like(c))
                if need_x:
                    gx[r0:r1] = (gr * (yh - xh * cx) / nx).to(x.dtype)
                if need_y:
                    gy.index_add_(0, idx[r0:r1], gr * (xh - yh * cy) / ny)
            else:
                if need_x:
                    gx[r0:r1] = (gr * yr).to(x.dtype)
                if need_y:
                    gy.index_add_(0, idx[r0:r1], gr * xr)
        return gx, (gy.to(y.dtype) if need_y else None), None, None, None


def _norm(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x, dim=1).clamp_min(_EPS)


def _chunks(n: int, d: int, elems: int = 1 << 20):
    step = max(1, elems // max(d, 1))
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)


def _pair_cos(x: Tensor, y: Tensor, idx: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    return _PairCos.apply(x, y, idx, normalize, dt)


def _scale_of(temperature, scale, default_t: float, device) -> Tuple[Tensor, Tensor]:
    """(s, t): both 0-dim tensors, s = 1 / t, keeping the autograd link to the given one."""
    if temperature is not None and scale is not None:
        raise ValueError("give at most one of temperature and scale (scale = 1 / temperature)")
    if scale is not None:
        V.positive_number("scale", scale, device=device)
        s = V.as_scalar_tensor(scale, device)
        return s, 1.0 / s
    if temperature is None:
        temperature = default_t
    V.positive_number("temperature", temperature, device=device)
    t = V.as_scalar_tensor(temperature, device)
    return 1.0 / t, t


def _assemble(
    backend: str,
    a: Tensor,
    b: Optional[Tensor],
    s: Tensor,
    spec: CoreSpec,
    tensors: CoreTensors,
    reduction: str,
    rest: Tensor,
    c_row: Tensor,
    c_col: Optional[Tensor] = None,
    c_pos: Optional[Tensor] = None,
    denom=None,
) -> Tensor:
    """Per-row loss ``c_row*LSE + c_col*LSEcol + c_pos*LSEpos - rest``, reduced.

    ``c_*`` are constant per-row coefficients (zero drops a row's term, infinities included);
    ``rest`` is the differentiable O(N*D) positive part (already zero where a row is dropped).
    mean divides the sum by ``denom``.
    """
    if reduction == "none":
        lse, lse_col, lse_pos = run_core(backend, a, b, s, spec, tensors)
        out = _times(c_row, lse)
        if c_col is not None:
            out = out + _times(c_col, lse_col)
        if c_pos is not None:
            out = out + _times(c_pos, lse_pos)
        return out - rest
    tensors.w_row, tensors.w_col, tensors.w_pos = c_row, c_col, c_pos
    total = run_core(backend, a, b, s, spec, tensors) - rest.sum()
    if reduction == "mean":
        total = total / denom
    return total


def _flatten_views(name: str, features: Tensor) -> Tensor:
    """[bsz, n_views, ...] -> [bsz, n_views, D]; [bsz, D] -> [bsz, 1, D]."""
    if not isinstance(features, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(features).__name__}")
    if features.dim() == 2:
        features = features.unsqueeze(1)
    elif features.dim() > 3:
        features = features.reshape(features.shape[0], features.shape[1], -1)
    return V.embeddings(name, features, ndim=3)


def _class_sums(labels: Tensor, vecs: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(inverse index of each label, per-class vector sums, per-class counts)."""
    uniq, inv = torch.unique(labels, return_inverse=True)
    sums = vecs.new_zeros(uniq.shape[0], vecs.shape[1]).index_add(0, inv, vecs)
    counts = torch.zeros(uniq.shape[0], dtype=vecs.dtype, device=vecs.device).index_add_(
        0, inv, torch.ones_like(inv, dtype=vecs.dtype)
    )
    return inv, sums, counts


# ----------------------------------------------------------------------------------------------
# InfoNCE / cross-entropy over cosine logits
# ----------------------------------------------------------------------------------------------


def info_nce(
    query: Tensor,
    keys: Optional[Tensor] = None,
    target: Optional[Tensor] = None,
    *,
    temperature=None,
    scale=None,
    exclude_self: Optional[bool] = None,
    symmetric: bool = False,
    normalize: bool = True,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
) -> Tensor:
    """InfoNCE / in-batch-negatives loss, the drop-in for
    ``F.cross_entropy(cos(query, keys) / temperature, target, reduction=..., ignore_index=...)``
    without ever materialising the N x M logits.

    Args:
        query: [N, D] anchors.
        keys: [M, D] contrast set; None means ``keys = query`` (and then ``exclude_self`` defaults
            to True, removing logit (i, i) from the softmax).
        target: [N] integer column index per row; None means ``arange(N)``. Rows equal to
            ``ignore_index`` contribute 0 and leave the mean's denominator.
        temperature / scale: give at most one (``scale = 1 / temperature``); neither means
            temperature 0.05. A float or a 0-dim tensor (differentiable).
        exclude_self: remove column ``i`` from row ``i``'s softmax (a target equal to the excluded
            column gives an infinite loss, as the textbook formula does).
        symmetric: CLIP loss, ``(row CE + column CE) / 2``; needs N == M and ``target=None``.
            With ``reduction="none"`` returns ``(row_i + col_i) / 2`` per pair.

    Returns:
        0-dim loss (mean/sum) or [N] per-row losses (none).
    """
    query = V.embeddings("query", query)
    dev = query.device
    if keys is not None:
        keys = V.embeddings("keys", keys)
        V.same_dim("query", query, "keys", keys)
        V.same_device(query=query, keys=keys)
    reduction = V.reduction(reduction)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if exclude_self is None:
        exclude_self = keys is None
    n = query.shape[0]
    m = n if keys is None else keys.shape[0]
    s, _ = _scale_of(temperature, scale, _DEFAULT_TEMPERATURE, dev)
    if symmetric:
        if target is not None:
            raise ValueError("target must be None when symmetric=True (the pairs are the diagonal)")
        if n != m:
            raise ValueError(f"symmetric=True needs as many keys as queries, got query {n} and keys {m}")
    if target is None:
        if keys is None and exclude_self and not symmetric:
            raise ValueError(
                "target=None with keys=None means every row's target is its own excluded column; "
                "pass target (e.g. the index of each row's positive) or keys"
            )
        if symmetric and keys is None and exclude_self:
            raise ValueError("symmetric=True with keys=None needs exclude_self=False")
        target = torch.arange(n, device=dev)
    else:
        target = V.target(target, n, m, ignore_index, dev)
    be = V.backend(backend, query, *([keys] if keys is not None else []))
    if be == "reference":
        return ref.info_nce(query, keys, target, s, exclude_self, symmetric, normalize, reduction, ignore_index)

    dt = compute_dtype(query, keys)
    valid = target != ignore_index
    tgt = torch.where(valid, target, torch.zeros_like(target))
    pos = s.to(dt) * _pair_cos(query, query if keys is None else keys, tgt, normalize, dt)
    if exclude_self:
        # the target column is the excluded self column: its logit is -inf, so the loss is +inf
        pos = torch.where(tgt == torch.arange(n, device=dev), torch.full_like(pos, float("-inf")), pos)
    spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=exclude_self, same=keys is None,
                    want_col=symmetric)
    if symmetric:
        half = torch.full((n,), 0.5, dtype=dt, device=dev)
        return _assemble(be, query, keys, s, spec, CoreTensors(), reduction, rest=pos, c_row=half,
                         c_col=half, denom=n)
    w = valid.to(dt)
    return _assemble(be, query, keys, s, spec, CoreTensors(), reduction,
                     rest=torch.where(valid, pos, torch.zeros_like(pos)), c_row=w, denom=w.sum())


def clip_loss(a: Tensor, b: Tensor, logit_scale, *, normalize: bool = True, reduction: str = "mean",
              backend: str = "auto") -> Tensor:
    """CLIP loss: ``info_nce(a, b, symmetric=True, scale=logit_scale)``.

    Args:
        a: [N, D] e.g. image embeddings; b: [N, D] text embeddings (pair i is (a_i, b_i)).
        logit_scale: the multiplier of the cosines (already exponentiated, e.g. ``exp(log_scale)``),
            a float or a 0-dim tensor.
    """
    return info_nce(a, b, symmetric=True, scale=logit_scale, normalize=normalize, reduction=reduction,
                    backend=backend)


# ----------------------------------------------------------------------------------------------
# SimCSE
# ----------------------------------------------------------------------------------------------


def simcse_loss(z1: Tensor, z2: Optional[Tensor] = None, *, temperature=0.05, normalize: bool = True,
                reduction: str = "mean", backend: str = "auto") -> Tensor:
    """Unsupervised SimCSE.

    * ``z2=None``: ``z1`` is the interleaved batch [2B, D] (rows 2i and 2i+1 are two dropout views of
      sentence i); every row is an anchor, its partner ``i xor 1`` the positive, itself excluded.
    * ``z2`` [B, D]: the official two-view form ``CE(cos(z1, z2) / t, arange(B))``.

    Returns a 0-dim loss, or per-anchor losses ([2B] or [B]) with ``reduction="none"``.
    """
    if z2 is None:
        z1 = V.embeddings("z1", z1)
        if z1.shape[0] % 2:
            raise ValueError(f"z1 must hold interleaved pairs (an even number of rows), got {z1.shape[0]}")
        target = torch.arange(z1.shape[0], device=z1.device) ^ 1
        return info_nce(z1, None, target, temperature=temperature, exclude_self=True, normalize=normalize,
                        reduction=reduction, backend=backend)
    z1 = V.embeddings("z1", z1)
    z2 = V.embeddings("z2", z2)
    if z1.shape != z2.shape:
        raise ValueError(f"z2 must have the shape of z1 {tuple(z1.shape)}, got {tuple(z2.shape)}")
    return info_nce(z1, z2, None, temperature=temperature, normalize=normalize, reduction=reduction,
                    backend=backend)


def simcse_sup_loss(anchor: Tensor, positive: Optional[Tensor] = None, negative: Optional[Tensor] = None,
                    *, temperature=0.05, hard_negative_weight: float = 0.0, normalize: bool = True,
                    reduction: str = "mean", backend: str = "auto") -> Tensor:
    """Supervised SimCSE (NLI triplets).

    * ``positive=None``: ``anchor`` is the interleaved triplets [3B, D]: rows 3k, 3k+1, 3k+2 are
      (x, x+, x-) of example k.
    * otherwise ``anchor``, ``positive``, ``negative`` are [B, D] each; ``negative=None`` drops the
      hard negatives (then it is the two-view InfoNCE).

    Logits of anchor i are ``[cos(a_i, p_j) / t for j] ++ [cos(a_i, n_j) / t for j]`` (B x 2B), target
    i, and ``hard_negative_weight`` is added to the logit of anchor i's own negative n_i (as in the
    official SimCSE code). Returns a 0-dim loss or [B] per-anchor losses.
    """
    if not isinstance(hard_negative_weight, (int, float)) or isinstance(hard_negative_weight, bool):
        raise TypeError(f"hard_negative_weight must be a float, got {type(hard_negative_weight).__name__}")
    if positive is None:
        if negative is not None:
            raise ValueError("negative needs positive: pass anchor, positive and negative, or only the "
                             "interleaved [3B, D] anchor")
        anchor = V.embeddings("anchor", anchor)
        if anchor.shape[0] % 3:
            raise ValueError(f"anchor must hold interleaved triplets (rows a multiple of 3), got {anchor.shape[0]}")
        anchor, positive, negative = anchor[0::3], anchor[1::3], anchor[2::3]
    anchor = V.embeddings("anchor", anchor)
    positive = V.embeddings("positive", positive)
    if positive.shape != anchor.shape:
        raise ValueError(f"positive must have the shape of anchor {tuple(anchor.shape)}, got {tuple(positive.shape)}")
    if negative is None:
        return info_nce(anchor, positive, None, temperature=temperature, normalize=normalize,
                        reduction=reduction, backend=backend)
    negative = V.embeddings("negative", negative)
    if negative.shape != anchor.shape:
        raise ValueError(f"negative must have the shape of anchor {tuple(anchor.shape)}, got {tuple(negative.shape)}")
    V.same_device(anchor=anchor, positive=positive, negative=negative)
    reduction = V.reduction(reduction)
    dev = anchor.device
    s, _ = _scale_of(temperature, None, _DEFAULT_TEMPERATURE, dev)
    be = V.backend(backend, anchor, positive, negative)
    if be == "reference":
        return ref.simcse_sup(anchor, positive, negative, s, float(hard_negative_weight), normalize, reduction)
    n = anchor.shape[0]
    dt = compute_dtype(anchor, positive, negative)
    keys = torch.cat([positive, negative.to(positive.dtype)], dim=0)
    pos = s.to(dt) * _pair_cos(anchor, positive, torch.arange(n, device=dev), normalize, dt)
    spec = CoreSpec(normalize=normalize, eps=_EPS, bias=float(hard_negative_weight))
    t = CoreTensors(bias_col=torch.arange(n, 2 * n, device=dev))
    ones = torch.ones(n, dtype=dt, device=dev)
    return _assemble(be, anchor, keys, s, spec, t, reduction, rest=pos, c_row=ones, denom=n)


# ----------------------------------------------------------------------------------------------
# SupCon and DSCL
# ----------------------------------------------------------------------------------------------


def _queue_args(queue, queue_labels, labels, d: int, device, has_mask: bool):
    if queue is None:
        if queue_labels is not None:
            raise ValueError("queue_labels given without queue")
        return None, None
    queue = V.embeddings("queue", queue)
    if queue.shape[1] != d:
        raise ValueError(f"queue has embedding dimension {queue.shape[1]} but features have {d}")
    if queue.device != device:
        raise ValueError(f"queue is on {queue.device} but features are on {device}")
    if has_mask:
        raise ValueError("queue needs labels (with queue_labels), not mask")
    if queue_labels is None:
        if labels is not None:
            raise ValueError("queue_labels is required when labels are given with a queue")
        return queue, None
    if labels is None:
        raise ValueError("queue_labels given but labels is None")
    return queue, V.labels("queue_labels", queue_labels, queue.shape[0], device)


def supcon_loss(
    features: Tensor,
    labels: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    *,
    temperature=0.07,
    base_temperature: float = 0.07,
    contrast_mode: str = "all",
    variant: str = "out",
    queue: Optional[Tensor] = None,
    queue_labels: Optional[Tensor] = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020) with SupContrast's semantics.

    Args:
        features: [bsz, n_views, D] (or [bsz, D] for one view); trailing dims past 3 are flattened.
            The contrast set is the views concatenated view-major: row ``v * bsz + k`` is view v of k.
        labels: [bsz] integer classes; or ``mask`` [bsz, bsz] non-negative weights, ``mask[i, j]``
            > 0 when j is a positive of i (may be asymmetric; not both). Neither: SimCLR
            (positives are the other views of the same sample).
        contrast_mode: ``"all"`` (every view is an anchor) or ``"one"`` (only view 0).
        variant: ``"out"`` (L_out: mean of positive log-probabilities) or ``"in"`` (L_in: log of the
            mean positive probability).
        queue: [K, D] extra contrast columns (a memory bank; no gradient reaches it) with
            ``queue_labels`` [K] (needed when labels are given; without labels queue rows are
            negatives only).

    The per-anchor loss is multiplied by ``temperature / base_temperature``; an anchor with no
    positive contributes 0 and still counts in the mean (over all anchors). Returns a 0-dim loss or
    per-anchor losses [n_anchors] (view-major) with ``reduction="none"``.
    """
    features = _flatten_views("features", features)
    bsz, n_views, d = features.shape
    dev = features.device
    reduction = V.reduction(reduction)
    if contrast_mode not in ("all", "one"):
        raise ValueError(f"contrast_mode must be 'all' or 'one', got {contrast_mode!r}")
    if variant not in ("out", "in"):
        raise ValueError(f"variant must be 'out' or 'in', got {variant!r}")
    if labels is not None and mask is not None:
        raise ValueError("give labels or mask, not both")
    if labels is not None:
        labels = V.labels("labels", labels, bsz, dev)
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.shape != (bsz, bsz):
            raise ValueError(f"mask must have shape [{bsz}, {bsz}], got {tuple(mask.shape)}")
        if mask.device != dev:
            raise ValueError(f"mask is on {mask.device} but features are on {dev}")
        if mask.is_complex():
            raise TypeError(f"mask must be bool or real, got {mask.dtype}")
    queue, queue_labels = _queue_args(queue, queue_labels, labels, d, dev, mask is not None)
    if not isinstance(base_temperature, (int, float)) or not base_temperature > 0:
        raise ValueError(f"base_temperature must be a number > 0, got {base_temperature!r}")
    s, t = _scale_of(temperature, None, 0.07, dev)
    be = V.backend(backend, features, *([queue] if queue is not None else []))
    if be == "reference":
        return ref.supcon(features, labels, mask, s, t, float(base_temperature), contrast_mode, variant,
                          queue, queue_labels, normalize, reduction)

    dt = compute_dtype(features, queue)
    contrast = torch.cat(torch.unbind(features, dim=1), dim=0)  # [V*bsz, D], view-major
    n_contrast = contrast.shape[0]
    n = n_contrast if contrast_mode == "all" else bsz
    c_hat = _unit(contrast, normalize, dt)
    a_hat = c_hat[:n]
    self_dot = _rowdot(a_hat, a_hat)
    tensors = CoreTensors()
    if mask is not None:
        w = mask.to(dt)
        idx = torch.arange(n, device=dev) % bsz
        w_self = w[idx, idx]
        n_pos = n_views * w.sum(dim=1)[idx] - w_self
        view_sum = c_hat.reshape(n_views, bsz, d).sum(dim=0)  # sum over views of each sample
        pos_sum = _rowdot(a_hat, (w @ view_sum)[idx]) - w_self * self_dot
        tensors.pos_mask = w
    else:
        row_lab = labels if labels is not None else torch.arange(bsz, device=dev)
        col_lab = row_lab.repeat(n_views)
        bank = c_hat
        if queue is not None:
            q_hat = _unit(queue.detach(), normalize, dt)
            bank = torch.cat([c_hat, q_hat])
            # SimCLR with a queue: queue rows are negatives only (-1 never equals an arange label)
            q_lab = queue_labels if queue_labels is not None else torch.full((queue.shape[0],), -1, device=dev)
            col_lab = torch.cat([col_lab, q_lab])
        inv, sums, counts = _class_sums(col_lab, bank)
        row_inv = inv[:n]
        n_pos = counts[row_inv] - 1
        pos_sum = _rowdot(a_hat, sums[row_inv]) - self_dot
        tensors.row_labels, tensors.col_labels = col_lab[:n], col_lab
    has_pos = n_pos > 0
    safe_n = torch.where(has_pos, n_pos, torch.ones_like(n_pos))
    s_dt = s.to(dt)
    factor = (t / base_temperature).to(dt)
    hp = has_pos.to(dt)
    spec_kw = dict(normalize=normalize, eps=_EPS, exclude_self=True, offset=0,
                   same=contrast_mode == "all" and queue is None, want_pos=variant == "in")
    core_b = None
    if not spec_kw["same"]:
        core_b = contrast if queue is None else torch.cat([contrast, queue.detach().to(contrast.dtype)])
    spec = CoreSpec(grad_cols=n_contrast if queue is not None else None, **spec_kw)
    if variant == "out":
        rest = torch.where(has_pos, s_dt * pos_sum / safe_n, torch.zeros_like(pos_sum))
        out = _assemble(be, contrast[:n] if core_b is not None else contrast, core_b, s, spec, tensors,
                        reduction, rest=rest, c_row=hp, denom=n)
    else:
        rest = torch.where(has_pos, -torch.log(safe_n), torch.zeros_like(safe_n))
        out = _assemble(be, contrast[:n] if core_b is not None else contrast, core_b, s, spec, tensors,
                        reduction, rest=rest, c_row=hp, c_pos=-hp, denom=n)
    return factor * out


def dscl_loss(
    features: Tensor,
    labels: Tensor,
    *,
    beta: float = 8.0,
    temperature=0.07,
    base_temperature: Optional[float] = None,
    queue: Optional[Tensor] = None,
    queue_labels: Optional[Tensor] = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
) -> Tensor:
    """Decoupled supervised contrastive loss (DSCL, Xuan et al., AAAI 2024).

    Args:
        features: [bsz, 2, D]; anchors are view 0, the contrast set is ``[view 0; view 1; queue]``.
        labels: [bsz] integer classes; positives of anchor i are the contrast rows with its label,
            itself excluded (so its own view 1 is always one).
        beta: weight of the other positives: anchor i's own view 1 has weight 1, each of the other
            ``|P_i| - 1`` positives ``beta / (|P_i| - 1)``.
        base_temperature: None means equal to ``temperature``.
        queue / queue_labels: [K, D] / [K] memory bank columns (no gradient).

    Per anchor: ``-(t / t_base) * sum_j w_ij log p_ij / sum_j w_ij``. Returns a 0-dim loss (mean over
    anchors) or [bsz] per-anchor losses.
    """
    features = _flatten_views("features", features)
    bsz, n_views, d = features.shape
    dev = features.device
    if n_views != 2:
        raise ValueError(f"features must be [bsz, 2, D] (two views), got {tuple(features.shape)}")
    if labels is None:
        raise ValueError("labels is required by dscl_loss")
    labels = V.labels("labels", labels, bsz, dev)
    reduction = V.reduction(reduction)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")
    queue, queue_labels = _queue_args(queue, queue_labels, labels, d, dev, False)
    s, t = _scale_of(temperature, None, 0.07, dev)
    if base_temperature is not None and not (isinstance(base_temperature, (int, float)) and base_temperature > 0):
        raise ValueError(f"base_temperature must be a number > 0 or None, got {base_temperature!r}")
    be = V.backend(backend, features, *([queue] if queue is not None else []))
    if be == "reference":
        return ref.dscl(features, labels, s, t, base_temperature, float(beta), queue, queue_labels,
                        normalize, reduction)

    dt = compute_dtype(features, queue)
    contrast = torch.cat([features[:, 0], features[:, 1]], dim=0)  # [2*bsz, D]
    col_lab = labels.repeat(2)
    c_hat = _unit(contrast, normalize, dt)
    bank = c_hat
    if queue is not None:
        bank = torch.cat([c_hat, _unit(queue.detach(), normalize, dt)])
        col_lab = torch.cat([col_lab, queue_labels])
    a_hat, v1_hat = c_hat[:bsz], c_hat[bsz:]
    inv, sums, counts = _class_sums(col_lab, bank)
    n_pos = counts[inv[:bsz]] - 1  # >= 1: the own view 1
    s_dt = s.to(dt)
    own = s_dt * _rowdot(a_hat, v1_hat)
    all_pos = s_dt * (_rowdot(a_hat, sums[inv[:bsz]]) - _rowdot(a_hat, a_hat))
    others = n_pos - 1
    has_others = others > 0
    w_other = torch.where(has_others, beta / torch.where(has_others, others, torch.ones_like(others)),
                          torch.zeros_like(others))
    w_sum = 1 + torch.where(has_others, torch.full_like(others, beta), torch.zeros_like(others))
    rest = (own + w_other * (all_pos - own)) / w_sum
    core_b = torch.cat([contrast, queue.detach().to(contrast.dtype)]) if queue is not None else contrast
    spec = CoreSpec(normalize=normalize, eps=_EPS, exclude_self=True, offset=0,
                    grad_cols=contrast.shape[0] if queue is not None else None)
    ones = torch.ones(bsz, dtype=dt, device=dev)
    out = _assemble(be, features[:, 0], core_b, s, spec, CoreTensors(), reduction, rest=rest, c_row=ones,
                    denom=bsz)
    tb = t if base_temperature is None else base_temperature
    return (t / tb).to(dt) * out
