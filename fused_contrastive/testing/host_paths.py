"""Which registry cases exercise every branch of the core op's host code: the cases a slow whole-path
check (the symbolic host-code trace of ``tests/test_compile.py``) needs to run, instead of all of them.

The host code (``core.run``, the operators, the backends' launch code) branches on the *structure* of a
call, never on values: which spec flags are set, which ``CoreData`` tensors are present, whether each
coefficient is absent, a number or a tensor, whether the output is reduced, the scale's kind, whether B
is A, the input dtype, and the routes chosen from several of these at once (the triangular sweep, the
eager backward). :func:`host_features` lists those facts of a case as ``(what, value)`` pairs;
:func:`covering_cases` picks, greedily, cases until every pair that any core-op case has is covered.
"""

from __future__ import annotations

from dataclasses import fields

import torch

__all__ = ["covering_cases", "host_features"]


def _kind(x) -> str:
    if x is None:
        return "absent"
    if isinstance(x, torch.Tensor):
        return f"tensor{x.dim()}" + ("_grad" if x.requires_grad else "")
    return "number"


def host_features(name: str) -> frozenset[tuple[str, object]]:
    """The structural facts of registry case ``name``'s core-op call (see the module docstring)."""
    from ..tools.compile_survey import core_call

    a, b, scale, spec, data, coef, reduce = core_call(name, 16, 8)
    out = {("a.dtype", str(a.dtype)), ("b", "none" if b is None else "is_a" if b is a else "other"),
           ("scale", _kind(scale)), ("reduce", bool(reduce))}
    for f in fields(spec):
        v = getattr(spec, f.name)
        out.add((f"spec.{f.name}", v if isinstance(v, bool) else v not in (None, f.default)))
    out |= {(f"data.{f.name}", _kind(getattr(data, f.name))) for f in fields(data)}
    out |= {(f"coef.{f.name}", _kind(getattr(coef, f.name))) for f in fields(coef)}
    # the routes the backends choose from several facts at once (each taken and not taken)
    tri = (b is None and data.bias_col is None and not spec.exclude_target  # (both are a bias column)
           and coef.col is None and coef.pos is None and coef.set is None)
    out.add(("route.triangular", tri))  # symmetric logits, nothing by column: the triangular sweep
    out.add(("route.eager_backward", bool(reduce) and coef.col is None and not tri))  # panel: gradients in the forward
    return frozenset(out)


def covering_cases(names: list[str]) -> list[str]:
    """A small subset of ``names`` (core-op cases) whose features together are every feature of
    ``names``: greedy set cover, ties broken by registry order (deterministic)."""
    feats = {n: host_features(n) for n in names}
    left = set().union(*feats.values())
    chosen: list[str] = []
    while left:
        best = max(names, key=lambda n: (len(feats[n] & left), -names.index(n)))
        chosen.append(best)
        left -= feats[best]
    return chosen
