"""Matryoshka levels on a loss: ``matryoshka_dims=``, ``matryoshka_weights=``, ``return_level_losses=``.

A loss decorated with :func:`leveled` computes, when ``matryoshka_dims`` is given,

    loss = sum_k w_k loss(truncate_renormalise(x, d_k))      for every embedding argument x

with ``truncate_renormalise(x, d) = F.normalize(x[..., :d])``: sentence-transformers' ``MatryoshkaLoss``
semantics (each level re-normalises its prefix, so ``normalize=False`` makes no difference to a level).

Routes:

* torch and triton backends: the loss body runs once with the levels (``_levels``), the core op
  computing every level in one pass over D (``core/matryoshka/torch_levels.py`` on PyTorch, the kernels of
  ``kernels/matryoshka.py`` on Triton) and the body returning one value per level ([K] or [K, N]);
* the reference backend, and ``torch.compile`` / ``torch.export`` tracing: the definition, K calls of
  the loss on truncated, re-normalised inputs (the oracle; under tracing each call is the plain
  custom op).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from .._backend import resolve

_EPS = 1e-12


@dataclass(frozen=True)
class Levels:
    """Validated levels: ``dims`` ascending, ``weights`` aligned with them, ``order[i]`` the position in
    ``dims`` of the user's i-th level."""

    dims: tuple[int, ...]
    weights: tuple[float, ...]
    order: tuple[int, ...]

    @property
    def core(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """What the core op takes (``core.run(levels=...)``)."""
        return self.dims, self.weights


def levels(matryoshka_dims, matryoshka_weights, d: int) -> Levels:
    """Check ``matryoshka_dims`` (distinct integers in [1, D], any order) and ``matryoshka_weights``
    (finite numbers, one per dim; None: all 1) against the embedding size ``d``."""
    if isinstance(matryoshka_dims, (int, Tensor)) or not hasattr(matryoshka_dims, "__len__"):
        raise TypeError(f"matryoshka_dims must be a sequence of ints (e.g. [768, 512, 256]), got "
                        f"{type(matryoshka_dims).__name__}")
    dims = list(matryoshka_dims)
    if not dims:
        raise ValueError("matryoshka_dims must hold at least one dimension")
    for v in dims:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"matryoshka_dims must hold ints, got {v!r} ({type(v).__name__})")
        if v <= 0:
            raise ValueError(f"matryoshka_dims must be > 0, got {v}")
        if v > d:
            raise ValueError(f"matryoshka_dims must not exceed the embedding dimension {d}, got {v}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"matryoshka_dims must not repeat a dimension, got {dims}")
    if matryoshka_weights is None:
        weights = [1.0] * len(dims)
    else:
        if isinstance(matryoshka_weights, (int, float, Tensor)) or not hasattr(matryoshka_weights, "__len__"):
            raise TypeError(f"matryoshka_weights must be a sequence of numbers, got "
                            f"{type(matryoshka_weights).__name__}")
        weights = list(matryoshka_weights)
        if len(weights) != len(dims):
            raise ValueError(f"matryoshka_weights must have one weight per dimension ({len(dims)}), got "
                             f"{len(weights)}")
        for v in weights:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"matryoshka_weights must hold finite numbers, got {v!r}")
    asc: list[int] = []  # argsort by comparisons: under torch.compile(dynamic=True) the dims may arrive as
    for i in range(len(dims)):  # SymInts, which Dynamo compares (one guard each) but cannot sort by key
        k = len(asc)
        while k > 0 and dims[asc[k - 1]] > dims[i]:
            k -= 1
        asc.insert(k, i)
    pos = {i: p for p, i in enumerate(asc)}
    return Levels(tuple(dims[i] for i in asc), tuple(float(weights[i]) for i in asc),
                  tuple(pos[i] for i in range(len(dims))))


def shrink(x: Tensor | None, d: int) -> Tensor | None:
    """``F.normalize(x[..., :d])`` (sentence-transformers' ``shrink``); None stays None."""
    return None if x is None else F.normalize(x[..., :d], p=2, dim=-1, eps=_EPS)


def combine(per: Tensor, lv: Levels) -> Tensor:
    """``sum_k w_k per[k]`` over the leading level dimension."""
    w = torch.tensor(lv.weights, dtype=per.dtype, device=per.device)
    return (per * w.reshape(-1, *([1] * (per.dim() - 1)))).sum(0)


def leveled(*embedding_args: str, views: tuple[str, ...] = (), one_pass: bool = True,
            per_level_if: tuple[str, ...] = ()):
    """Give a loss ``matryoshka_dims`` / ``matryoshka_weights`` / ``return_level_losses`` (keyword-only).

    ``embedding_args``: the names of the arguments that are embeddings (each is truncated on the
    reference route; the first gives D); ``views``: those of them shaped [bsz, n_views, ...] (trailing
    dims are flattened into D first, as the loss does; a sequence of tensors is truncated tensor by
    tensor). The loss body takes ``_levels`` (a :class:`Levels` or None) and, given levels, returns one
    value per level (leading dimension K); with ``one_pass=False`` (or when one of the arguments named
    in ``per_level_if`` is not None) it is called once per level instead.
    """
    def deco(fn):
        sig = inspect.signature(fn)
        extra = [
            inspect.Parameter("matryoshka_dims", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="Sequence[int] | None"),
            inspect.Parameter("matryoshka_weights", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="Sequence[float] | None"),
            inspect.Parameter("return_level_losses", inspect.Parameter.KEYWORD_ONLY, default=False,
                              annotation="bool"),
        ]
        public = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "_levels"] + extra)

        def flat(name, x):
            if name in views and isinstance(x, Tensor) and x.dim() > 3:
                return x.reshape(x.shape[0], x.shape[1], -1)
            return x

        @functools.wraps(fn)
        def wrapper(*args, matryoshka_dims=None, matryoshka_weights=None, return_level_losses=False, **kwargs):
            if not isinstance(return_level_losses, bool):
                raise TypeError(f"return_level_losses must be a bool, got {type(return_level_losses).__name__}")
            if matryoshka_dims is None:
                if matryoshka_weights is not None:
                    raise ValueError("matryoshka_weights needs matryoshka_dims")
                if return_level_losses:
                    raise ValueError("return_level_losses needs matryoshka_dims (the levels to report)")
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            first = flat(embedding_args[0], bound.arguments.get(embedding_args[0]))
            if not isinstance(first, Tensor) or first.dim() < 2 or first.shape[-1] == 0:
                return fn(*args, **kwargs)  # the loss's own validation names the problem
            lv = levels(matryoshka_dims, matryoshka_weights, first.shape[-1])
            tensors = [bound.arguments.get(name) for name in embedding_args]
            be = resolve(bound.arguments.get("backend", "auto"),
                         *[t for t in tensors if isinstance(t, Tensor)])
            if lv.dims == (first.shape[-1],) and bound.arguments.get("normalize", True) is True:
                per = fn(*args, **kwargs)[None]  # one level at full D is the plain loss itself
            elif be == "reference" or ops.tracing_route() or not one_pass \
                    or any(bound.arguments.get(name) is not None for name in per_level_if):
                per = []
                for d in lv.dims:
                    call = dict(bound.arguments)
                    for name in embedding_args:
                        x = call.get(name)
                        if isinstance(x, Tensor):
                            call[name] = shrink(flat(name, x), d)
                        elif isinstance(x, (list, tuple)) and x and all(isinstance(t, Tensor) for t in x):
                            call[name] = [shrink(flat(name, t), d) for t in x]
                    per.append(fn(**call))
                per = torch.stack(per)
            else:
                per = fn(*args, _levels=lv, **kwargs)
            loss = combine(per, lv)
            if return_level_losses:
                return loss, per.detach()[list(lv.order)]
            return loss

        wrapper.__signature__ = public
        return wrapper
    return deco
