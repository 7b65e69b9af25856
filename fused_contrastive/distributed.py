"""Rows of every rank, with gradients that flow back to the rank that produced them: the primitive under
the losses' ``gather=`` option (``losses/_scope.py`` places each rank's rows at its offset).

:func:`gather_rows` is an all-gather along dim 0 on PyTorch's functional collectives
(``all_gather_single_autograd``: its backward is a reduce-scatter, so each rank's rows receive the sum
over ranks of the gradients computed for them), for local batches of unequal size (the last batch of
an epoch): every rank pads to the largest local size, and the padding is cut out of the result. A
small collective of the shapes and dtypes runs first, so a rank whose embedding dimension or dtype
differs gets the same ``ValueError`` on every rank instead of a hang or a garbled gather.

Every public loss that takes ``gather=`` wears :func:`agreed`, and calls :func:`agree` after it has
validated its arguments and before any other collective: one all-gather of a status word, the scale
and the local sizes. An argument error on one rank thus reaches every rank in that first exchange
(the failing rank raises its own error, every other rank a ``ValueError`` naming the rank and the
error) instead of leaving the healthy ranks blocked in the gather until the process-group timeout;
ranks whose temperatures differ (two objectives silently mixed) fail there too.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["agree", "agreed", "all_sum", "gather_rows", "process_group", "row_offset", "world_size"]

_F = TypeVar("_F", bound=Callable)
_CALL = threading.local()  # the gathered loss call in progress on this thread (see ``agreed``)


class _Call:
    def __init__(self, name: str, grp: dist.ProcessGroup):
        self.name, self.grp, self.done = name, grp, False


def _exchange_device(grp: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives take tensors: CUDA for NCCL, XPU for XCCL, else the host (gloo,
    or a ``cpu:gloo,cuda:nccl`` group)."""
    backend = str(dist.get_backend(grp))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "xccl":
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _exchange(call: _Call, failure: BaseException | None, scale=None, rows: int | None = None,
              cols: int | None = None) -> list[list[float]]:
    """The first collective of a gathered loss call: per rank ``[failed, scale, rows, cols]`` (NaN /
    -1 where not given). When a rank failed, a second exchange carries the errors' text, and every
    healthy rank raises naming them; the failing rank returns (its caller re-raises its own error)."""
    call.done = True
    grp = call.grp
    dev = _exchange_device(grp)
    if isinstance(scale, Tensor):
        sv = scale.detach().reshape(1).to(device=dev, dtype=torch.float64)
    else:
        sv = torch.tensor([math.nan if scale is None else float(scale)], dtype=torch.float64, device=dev)
    head = torch.tensor([1.0 if failure is not None else 0.0], dtype=torch.float64, device=dev)
    tail = torch.tensor([-1.0 if rows is None else float(rows), -1.0 if cols is None else float(cols)],
                        dtype=torch.float64, device=dev)
    mine = torch.cat([head, sv, tail])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(grp))]
    dist.all_gather(every, mine, group=grp)
    table = torch.stack(every).cpu().tolist()
    if any(row[0] for row in table):
        text = None if failure is None else f"{type(failure).__name__}: {failure}"
        texts: list[str | None] = [None] * len(table)
        dist.all_gather_object(texts, text, group=grp)
        if failure is not None:
            return table
        bad = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t is not None)
        raise ValueError(f"{call.name}(gather=...): another rank rejected its arguments, so no rank gathers "
                         f"(this is rank {dist.get_rank(grp)}): {bad}")
    scales = [row[1] for row in table]
    if not all(math.isnan(x) for x in scales) and any(x != scales[0] for x in scales):
        desc = ", ".join(f"rank {r}: {x:.9g}" for r, x in enumerate(scales))
        raise ValueError(f"{call.name}(gather=...): the ranks were given different temperatures / scales "
                         f"({desc} as scale = 1 / temperature); a gathered loss needs one on every rank")
    return table


def agreed(fn: _F) -> _F:
    """Decorator of a public loss with a ``gather=`` keyword: under a process group, an exception raised
    before the loss's first collective (its argument checks) is announced to every rank in that
    collective, which the healthy ranks are waiting in (see the module docstring)."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        gather = kwargs.get("gather", False)
        if gather is False or gather is None or getattr(_CALL, "call", None) is not None \
                or not (dist.is_available() and dist.is_initialized()):
            return fn(*args, **kwargs)
        grp = process_group(gather)
        call = _CALL.call = _Call(name, grp)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not call.done:
                _exchange(call, exc)
                exc.add_note(f"{name}(gather=...): every rank of the process group was told, and raises too")
            raise
        finally:
            _CALL.call = None

    return wrapper  # type: ignore[return-value]


def agree(grp: dist.ProcessGroup, *, scale=None, rows: int | None = None,
          cols: int | None = None) -> tuple[int, int]:
    """The first collective of a gathered loss, after its argument checks (see :func:`agreed`).

    Args:
        grp: the process group.
        scale: this rank's scale (1 / temperature; float or 0-dim tensor), checked equal on every rank.
        rows: this rank's local batch size, when the loss needs its offset in the global batch.
        cols: the columns of a per-rank ``[rows, global rows]`` argument (SupCon's mask), checked to
            equal the global row count on every rank.

    Returns:
        ``(this rank's row offset, the global row count)`` (``(0, 0)`` without ``rows``).
    """
    call = getattr(_CALL, "call", None)
    if call is None or call.done or call.grp is not grp:
        call = _Call("loss", grp)
    table = _exchange(call, None, scale, rows, cols)
    sizes = [int(row[2]) for row in table]
    total = sum(sizes) if rows is not None else 0
    if cols is not None:
        wrong = [f"rank {r}: {int(row[3])}" for r, row in enumerate(table) if int(row[3]) != total]
        if wrong:
            raise ValueError(f"mask must have the global batch size ({total}) as its columns on every rank "
                             f"under gather (this rank's rows of the global mask); got {', '.join(wrong)}")
    return (sum(sizes[:dist.get_rank(grp)]), total) if rows is not None else (0, 0)


def _first_collective(grp: dist.ProcessGroup) -> None:
    """A collective of a gathered loss call that did not :func:`agree` first: agree now (status only)."""
    call = getattr(_CALL, "call", None)
    if call is not None and not call.done:
        _exchange(call, None)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)


def process_group(gather) -> dist.ProcessGroup | None:
    """The process group of a ``gather`` argument: None for False, the default group for True, the
    group itself for a ``ProcessGroup``. Raises when torch.distributed is not initialised."""
    if gather is False or gather is None:
        return None
    if not (gather is True or isinstance(gather, dist.ProcessGroup)):
        raise TypeError(f"gather must be False, True or a torch.distributed ProcessGroup, got {type(gather).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("gather=True needs torch.distributed initialised on every rank "
                         "(torch.distributed.init_process_group) before the loss is called")
    return dist.group.WORLD if gather is True else gather


def _code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        raise TypeError(f"gather_rows: unsupported dtype {dtype}") from None


def gather_rows(x: Tensor, group: dist.ProcessGroup | None = None, *, name: str = "x") -> tuple[Tensor, int, list[int]]:
    """Every rank's ``x`` concatenated along dim 0 in rank order.

    Args:
        x: [n_r, ...] this rank's rows (n_r may differ between ranks; the other dims and the dtype
            must not).
        group: the process group (None: the default group).
        name: the argument name used in error messages.

    Returns:
        ``(rows [sum n_r, ...], this rank's row offset, [n_0, n_1, ...])``. Differentiable in ``x``: the
        gradient of the result's rows ``[offset, offset + n_r)`` computed on *every* rank is summed into
        this rank's ``x`` (the all-gather's backward is a reduce-scatter).

    The sizes are exchanged first and read on the host (one small synchronisation per call: the output
    shape depends on them).
    """
    group = group if group is not None else dist.group.WORLD
    _first_collective(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    shape = list(x.shape[1:])
    if len(shape) > 3:
        raise ValueError(f"{name}: gather_rows takes tensors of at most 4 dims, got {tuple(x.shape)}")
    mine = torch.tensor([x.shape[0], x.dim(), _code(x.dtype)] + shape + [-1] * (3 - len(shape)),
                        dtype=torch.int64, device=x.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu().tolist()
    sizes = [row[0] for row in table]
    if any(row[1:] != table[0][1:] for row in table):
        desc = ", ".join(f"rank {r}: {_DTYPES[row[2]]} {row[3:3 + row[1] - 1]}" for r, row in enumerate(table))
        raise ValueError(f"{name} must have the same dtype and trailing shape on every rank (only dim 0 may "
                         f"differ); got {desc}")
    top = max(sizes)
    if x.shape[0] < top:
        x = torch.cat([x, x.new_zeros((top - x.shape[0], *shape))])
    if world == 1:
        out = x
    else:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_gather_single_autograd

        out = all_gather_single_autograd(x.contiguous(), 0, group)
        if isinstance(out, AsyncCollectiveTensor):
            # a plain tensor (the wait keeps the autograd link): the backends inspect storages, which
            # the asynchronous wrapper does not expose
            out = out.wait()
    if any(s != top for s in sizes):
        out = torch.cat([out[r * top:r * top + s] for r, s in enumerate(sizes)])
    return out, sum(sizes[:rank]), sizes


def world_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def row_offset(n: int, device, group: dist.ProcessGroup) -> tuple[int, int]:
    """(this rank's row offset, the total rows) when every rank holds ``n`` rows of a global batch."""
    _first_collective(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    sizes = [int(t) for t in torch.cat(every).cpu()]
    return sum(sizes[:dist.get_rank(group)]), sum(sizes)


def all_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum over ranks of ``x`` (no gradient: counts and denominators)."""
    _first_collective(group)
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x
