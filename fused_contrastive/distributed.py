"""Rows of every rank, with gradients that flow back to the rank that produced them: the primitive under
the losses' ``gather=`` option (``losses.py`` places each rank's rows at its offset).

:func:`gather_rows` is an all-gather along dim 0 on PyTorch's functional collectives
(``all_gather_single_autograd``: its backward is a reduce-scatter, so each rank's rows receive the sum
over ranks of the gradients computed for them), for local batches of unequal size (the last batch of
an epoch): every rank pads to the largest local size, and the padding is cut out of the result. A
small collective of the shapes and dtypes runs first, so a rank whose embedding dimension or dtype
differs gets the same ``ValueError`` on every rank instead of a hang or a garbled gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_sum", "gather_rows", "process_group", "row_offset", "world_size"]

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
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    sizes = [int(t) for t in torch.cat(every).cpu()]
    return sum(sizes[:dist.get_rank(group)]), sum(sizes)


def all_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum over ranks of ``x`` (no gradient: counts and denominators)."""
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x
