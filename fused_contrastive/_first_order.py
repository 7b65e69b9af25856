"""Double backward through the custom autograd Functions.

Their backwards are hand-written gradients, not differentiable themselves. Without a mark, a
``torch.autograd.grad(loss, x, create_graph=True)`` through one returns gradients that do not require grad (or,
where the backward happens to use differentiable ops on detached pieces, a second-order graph that is wrong), so
a gradient penalty silently adds nothing. :func:`first_order` marks such a backward: a plain backward is
unchanged; under ``create_graph=True`` its gradients come back attached to a node that raises, naming double
backward, as soon as something differentiates them. The reference backend (plain PyTorch ops) is the path whose
gradients are differentiable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

MESSAGE = ("{name}: double backward (differentiating a gradient computed with create_graph=True, e.g. a "
           "gradient penalty) is not supported by this path: its gradients are hand-written, not differentiable. "
           "backend=\"reference\" (plain PyTorch ops) gives differentiable gradients")


def first_order(name: str) -> Callable:
    """Decorator of a Function's ``backward``: first-order only, with an error naming double backward (and
    ``name``, the loss or Function) raised when its gradients are differentiated."""
    def deco(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            # a plain backward (create_graph=False), or the backward called directly by the registered
            # operators' code (a context of their own, not autograd's node)
            if not torch.is_grad_enabled() or not isinstance(ctx, torch.autograd.function.BackwardCFunction):
                return out
            wanted = any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads) or any(
                getattr(ctx, "needs_input_grad", ()))
            if not wanted:
                return out
            outs = out if isinstance(out, tuple) else (out,)
            err = torch._C._functions.DelayedError(MESSAGE.format(name=name).encode(), len(outs))

            def attach(v):
                if isinstance(v, torch.Tensor):
                    v = v.detach()
                    v.requires_grad_(True)
                return v
            got = err(*[attach(v) for v in outs])
            got = got if isinstance(got, tuple) else (got,)
            # (DelayedError passes None through; a non-tensor output keeps its place)
            return tuple(got) if isinstance(out, tuple) else got[0]
        return wrapper
    return deco
