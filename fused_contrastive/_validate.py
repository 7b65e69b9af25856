"""Input checks of every public function: each error names the offending argument.

Tensor *values* (a target's range, a tensor temperature's sign) are checked for CPU tensors only:
reading a CUDA value is a host sync on every training step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("mean", "sum", "none")

#: A scalar option: a Python number or a 0-dim tensor (differentiable when it requires grad).
Number = float | int | Tensor


def embeddings(name: str, x, *, ndim: int = 2, shape_hint: str | None = None) -> Tensor:
    """A floating tensor of ``ndim`` dims with no empty dimension."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != ndim:
        want = shape_hint or f"{ndim} dimensions"
        raise ValueError(f"{name} must have {want}, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def views(name: str, features) -> Tensor:
    """SupContrast's features: [bsz, n_views, D] (trailing dims flattened into D) or [bsz, D] (one view)."""
    if not isinstance(features, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(features).__name__}")
    if features.dim() == 2:
        features = features.unsqueeze(1)
    elif features.dim() > 3:
        features = features.reshape(features.shape[0], features.shape[1], -1)
    hint = "shape [bsz, n_views, D] or [bsz, D]"
    return embeddings(name, features, ndim=3, shape_hint=hint)


def same_device(**tensors: Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if isinstance(v, Tensor)]
    if not items:
        return
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{k} is on {v.device} but {items[0][0]} is on {dev}; put them on one device")


def paired(name_a: str, a: Tensor, name_b: str, b) -> Tensor:
    """``b`` as the partner of the validated embeddings ``a`` (row i of one is paired with row i of the
    other): embeddings of ``a``'s embedding dimension and row count, on ``a``'s device."""
    b = embeddings(name_b, b)
    same_dim(name_a, a, name_b, b)
    same_device(**{name_a: a, name_b: b})
    same_precision(name_a, a, name_b, b)  # one rule for every loss: float64 with float64 only
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{name_b} must have as many rows as {name_a} (pair i is ({name_a}_i, {name_b}_i)), "
                         f"got {name_a} {a.shape[0]} and {name_b} {b.shape[0]}")
    return b


def readable(t: Tensor) -> bool:
    """Whether a tensor's values may be read for validation: on the CPU (no host-device sync) and not
    while ``torch.compile`` / ``torch.export`` trace the call (a read would break the graph; the
    values are then not checked)."""
    return t.device.type == "cpu" and not (torch.compiler.is_compiling() or torch.compiler.is_exporting())


def same_dim(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"{name_b} has embedding dimension {b.shape[-1]} but {name_a} has {a.shape[-1]}")


def number(name: str, v, *, low: float, strict: bool, allow_tensor: bool = False) -> Number:
    """A finite number ``> low`` (``>= low`` when not ``strict``); a 0-dim floating tensor when
    ``allow_tensor`` (its value is checked when it is on the CPU). Returns the value unchanged
    (a float for Python numbers)."""
    rel = ">" if strict else ">="
    if isinstance(v, Tensor):
        if not allow_tensor:
            raise TypeError(f"{name} must be a float, got a tensor")
        if v.dim() != 0:  # a [1] tensor would broadcast the loss to shape [1]: 0-dim, as documented
            raise ValueError(f"{name} must be a float or a 0-dim tensor, got shape {tuple(v.shape)} "
                             f"(use .reshape(()) or .squeeze())")
        if not v.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {v.dtype}")
        if readable(v):
            val = float(v.detach())
            if not (math.isfinite(val) and (val > low if strict else val >= low)):
                raise ValueError(f"{name} must be finite and {rel} {low:g}, got {val}")
        return v.reshape(())
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        kind = "a float or a 0-dim tensor" if allow_tensor else "a float"
        raise TypeError(f"{name} must be {kind}, got {type(v).__name__}")
    # comparisons, not math.isfinite: they also trace under torch.compile(dynamic=True), where a
    # Python float argument arrives as a symbolic float (NaN fails both)
    if not (v < math.inf and (v > low if strict else v >= low)):
        raise ValueError(f"{name} must be finite and {rel} {low:g}, got {v}")
    return v if isinstance(v, float) else float(v)


def positive_number(name: str, v, *, device: torch.device) -> Number:
    """A finite number > 0 or a 0-dim floating tensor (on ``device`` or the CPU; value checked on CPU)."""
    out = number(name, v, low=0.0, strict=True, allow_tensor=True)
    if isinstance(out, Tensor) and out.device != device and out.device.type != "cpu":
        raise ValueError(f"{name} is on {out.device} but the embeddings are on {device}")
    return out


def scale_of(temperature, scale, default_temperature: float, dtype: torch.dtype, device: torch.device, *,
             t_name: str = "temperature", s_name: str = "scale") -> tuple[Number, Number]:
    """``(s, t)`` with ``s = 1 / t`` from whichever of temperature / scale is given (neither: the
    default temperature). Python numbers stay Python floats (exact in float64); a tensor is moved to
    ``device`` and ``dtype`` (the compute dtype) before the reciprocal, keeping its autograd link."""
    if temperature is not None and scale is not None:
        raise ValueError(f"give at most one of {t_name} and {s_name} ({s_name} = 1 / {t_name})")
    if scale is not None:
        s = positive_number(s_name, scale, device=device)
        if isinstance(s, Tensor):
            s = s.to(device=device, dtype=dtype)
        return s, 1.0 / s
    t = positive_number(t_name, default_temperature if temperature is None else temperature, device=device)
    if isinstance(t, Tensor):
        t = t.to(device=device, dtype=dtype)
    return 1.0 / t, t


def labels(name: str, y, n: int, device: torch.device) -> Tensor:
    """Class labels [n]: an integer or bool dtype (bool: two classes), returned as int64."""
    if not isinstance(y, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer class labels, got {type(y).__name__}")
    if y.is_floating_point() or y.is_complex():
        raise TypeError(f"{name} must have an integer or bool dtype, got {y.dtype}")
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(y.shape)}")
    if y.device != device:
        raise ValueError(f"{name} is on {y.device} but the embeddings are on {device}")
    return y.long()


def real_labels(name: str, y, n: int, device: torch.device) -> Tensor:
    """Order-comparable labels (CoSENT's similarity grades): any real, integer or bool dtype (bool as
    0 / 1: False below True), [n]."""
    if not isinstance(y, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    if y.is_complex():
        raise TypeError(f"{name} must be real, got {y.dtype}")
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(y.shape)}")
    if y.device != device:
        raise ValueError(f"{name} is on {y.device} but the scores are on {device}")
    return y.to(torch.int64) if y.dtype == torch.bool else y


def target(y, n: int, m: int | None, ignore_index: int, device: torch.device) -> Tensor:
    """Class-index target in [0, m) or ``ignore_index``. The range is checked for CPU tensors (not
    with ``m`` None: the shape and dtype only); on CUDA an out-of-range index trips the gather's
    device-side assert instead of a host sync."""
    if not isinstance(y, Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(y).__name__}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices (int64), got {y.dtype}; "
                        "class probabilities are not supported")
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(f"target must have shape [{n}] (one index per query row), got {tuple(y.shape)}")
    if y.device != device:
        raise ValueError(f"target is on {y.device} but query is on {device}")
    y = y.long()
    if m is not None and readable(y):
        bad = (y != ignore_index) & ((y < 0) | (y >= m))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target[{i}] = {int(y[i])} is out of range: must be in [0, {m}) or "
                             f"ignore_index={ignore_index}")
    return y


def target_not_excluded(y: Tensor, ignore_index: int, what: str | None = None) -> None:
    """With ``exclude_self``, an explicit target equal to the row's own (excluded) column would give an
    infinite loss: an error for CPU targets (row ``i``'s own column is ``i``; ``what`` says which column
    that is when ``y`` was shifted to another numbering). CUDA values are not read (no host sync): there
    such a row's loss is inf."""
    if not readable(y):
        return
    own = (y == torch.arange(y.shape[0], device=y.device)) & (y != ignore_index)
    if bool(own.any()):
        i = int(own.nonzero()[0, 0])
        named = f"target[{i}] = {i} is row {i}'s own column" if what is None else \
            f"target[{i}] names row {i}'s own column, {what}"
        raise ValueError(f"{named}, which exclude_self=True removes from its softmax (the loss would be inf): pass "
                         f"the index of row {i}'s positive, or exclude_self=False")


def same_precision(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """float64 inputs run in float64: mixing one with a lower precision would silently promote the other
    (16 / 32-bit mixes, e.g. autocast outputs beside float32 rows, compute in float32 as documented)."""
    if (a.dtype == torch.float64) != (b.dtype == torch.float64):
        raise TypeError(f"{name_a} is {a.dtype} but {name_b} is {b.dtype}: pass both in float64, or neither")


def backend(v) -> str:
    """A backend name (whether it can run on the inputs is checked when they are known)."""
    from ._backend import BACKENDS

    if not isinstance(v, str) or v not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {v!r}")
    return v


def reduction(r) -> str:
    if r not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {r!r}")
    return r


def ignore_index(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"ignore_index must be an int, got {type(v).__name__}")
    return v


def flag(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def choice(name: str, v, options: tuple[str, ...]) -> str:
    if v not in options:
        raise ValueError(f"{name} must be one of {options}, got {v!r}")
    return v


def mask(m, bsz: int, device: torch.device, cols: int | None = None) -> Tensor:
    """SupContrast's [bsz, bsz] positive mask (``[bsz, cols]`` when given: this rank's rows of the
    global mask under ``gather``; ``cols=-1``: any column count): bool or real, non-negative weights."""
    if not isinstance(m, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(m).__name__}")
    if m.is_complex():
        raise TypeError(f"mask must be bool or real, got {m.dtype}")
    if cols == -1:  # under gather: this rank's rows, any columns (checked on every rank by D.agree)
        if m.dim() != 2 or m.shape[0] != bsz:
            raise ValueError(f"mask must have shape [{bsz}, global bsz] with gather (this rank's rows of the "
                             f"global mask), got {tuple(m.shape)}")
    elif cols is not None and m.shape != (bsz, cols):
        raise ValueError(f"mask must have shape [{bsz}, {cols}] with gather (this rank's rows of the global "
                         f"[global bsz, global bsz] mask), got {tuple(m.shape)}")
    if cols is None and m.shape != (bsz, bsz):
        raise ValueError(f"mask must have shape [{bsz}, {bsz}] (bsz = features.shape[0]), got {tuple(m.shape)}")
    if m.device != device:
        raise ValueError(f"mask is on {m.device} but features are on {device}")
    if readable(m) and m.dtype != torch.bool and m.numel():
        # amax / amin reduce without a temporary of the mask's size (NaN propagates through both), so
        # the check allocates nothing N x M (tests/test_triton_panel.py measures it); the scan for the
        # offending entry runs only on the error path
        if m.is_floating_point() and not all(math.isfinite(float(x)) for x in torch.aminmax(m)):
            i, j = (int(x) for x in (~torch.isfinite(m)).nonzero()[0])
            raise ValueError(f"mask must be finite (weights of the positives), got mask[{i}, {j}] = {float(m[i, j])}")
        if float(m.amin()) < 0:
            raise ValueError("mask must be non-negative (weights of the positives)")
    return m


def queue(q, queue_labels, labels_: Tensor | None, d: int, device: torch.device, has_mask: bool
          ) -> tuple[Tensor | None, Tensor | None]:
    """A memory bank [K, D] and its labels [K]: labels are needed exactly when the loss has labels."""
    if q is None:
        if queue_labels is not None:
            raise ValueError("queue_labels given without queue")
        return None, None
    q = embeddings("queue", q)
    if q.shape[1] != d:
        raise ValueError(f"queue has embedding dimension {q.shape[1]} but features have {d}")
    if q.device != device:
        raise ValueError(f"queue is on {q.device} but features are on {device}")
    if has_mask:
        raise ValueError("queue needs labels (with queue_labels), not mask")
    if queue_labels is None:
        if labels_ is not None:
            raise ValueError("queue_labels is required when labels are given with a queue")
        return q, None
    if labels_ is None:
        raise ValueError("queue_labels given but labels is None")
    return q, labels(name="queue_labels", y=queue_labels, n=q.shape[0], device=device)


def label_smoothing(v) -> float:
    """``F.cross_entropy``'s ``label_smoothing``: a float in [0, 1)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"label_smoothing must be a float in [0, 1), got {type(v).__name__}")
    if not 0.0 <= v < 1.0:  # also False for NaN
        raise ValueError(f"label_smoothing must be in [0, 1), got {v}")
    return float(v)


def tau_plus(v, n: int, device: torch.device) -> float | Tensor:
    """The debiased loss's class prior: a float in [0, 1), or a floating [N] tensor of per-row priors on
    the query's device (its values checked in [0, 1) when it is on the CPU). A tensor is detached: no
    gradient flows into a prior."""
    if isinstance(v, Tensor):
        if not v.is_floating_point():
            raise TypeError(f"tau_plus must be a float or a floating tensor, got {v.dtype}")
        if v.dim() != 1 or v.shape[0] != n:
            raise ValueError(f"tau_plus as a tensor must have shape [{n}] (one prior per query row), got "
                             f"{tuple(v.shape)}")
        if v.device != device:
            raise ValueError(f"tau_plus is on {v.device} but query is on {device}")
        v = v.detach()
        if readable(v):
            bad = ~((v >= 0) & (v < 1))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"tau_plus must be in [0, 1), got tau_plus[{i}] = {float(v[i])}")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"tau_plus must be a float in [0, 1) or an [N] tensor, got {type(v).__name__}")
    if not 0.0 <= v < 1.0:
        raise ValueError(f"tau_plus must be in [0, 1), got {v}")
    return float(v)
