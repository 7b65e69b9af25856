"""Rows of every rank, with gradients that flow back to the rank that produced them: the primitive under
the losses' ``gather=`` option (``losses/_scope.py`` places each rank's rows at its offset).

:func:`gather_rows` is an all-gather along dim 0 on PyTorch's functional collectives
(``all_gather_single_autograd``: its backward is a reduce-scatter, so each rank's rows receive the sum
over ranks of the gradients computed for them), for local batches of unequal size (the last batch of
an epoch): every rank pads to the largest local size, and the padding is cut out of the result. A
small collective of the shapes and dtypes runs first, so a rank whose embedding dimension or dtype
differs gets the same ``ValueError`` on every rank instead of a hang or a garbled gather.

Every public loss that takes ``gather=`` wears :func:`agreed` as its outermost decorator (above
``@leveled``, whose level checks are argument checks too), and calls :func:`agree` after it has validated
its arguments and before any other collective: one all-gather per call of a status word, the scale, the
local sizes and a digest of the whole call. The digest comes from the public function's bound arguments
(``inspect.signature``, defaults applied): one 48-bit hash of the arguments' descriptions (every
option as written, a tensor as its dtype and trailing shape, since dim 0 is the rank's own rows; a
sequence element by element; ``gather`` itself left out), and the value of each 0-dim floating tensor
(a learnable temperature). So:

* an argument error on one rank (anything raised before the exchange: a bad ``matryoshka_dims``, a
  ``backend`` typo, a wrong shape) reaches every rank in that exchange: the failing rank raises its own
  error, every other rank a ``ValueError`` naming the rank and the error, instead of blocking in a
  gather until the process-group timeout;
* ranks whose calls differ (another reduction, Matryoshka levels or weights, GIST margin, mask on one
  rank and labels on another, negatives on some ranks only, another temperature...) raise on every
  rank a ``ValueError`` naming each differing argument and which ranks passed what, instead of mixing
  two objectives silently or hanging in a collective only some ranks reach.

A second, small exchange (the errors' and differing arguments' text) runs only on those error paths.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from . import routes

__all__ = ["agree", "agreed", "all_sum", "gather_rows", "process_group", "row_offset", "world_size"]

_F = TypeVar("_F", bound=Callable)
_CALL = threading.local()  # the gathered loss call in progress on this thread (see ``agreed``)


_VALUES = 32  # 0-dim tensor arguments compared by value: those among a loss's first _VALUES arguments
_UNKNOWN = -1.0  # the digest of a rank whose arguments did not bind (its own TypeError is reported)
_P = inspect.Parameter
_DTYPE_NAMES: dict = {}


def _h48(text: str) -> float:
    """A 48-bit hash of ``text``, exact in float64 (the exchange's dtype); the same in every process."""
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big"))


def describe(v, lead: int = 1) -> str:
    """An argument as the ranks' agreement compares it: numbers, strings, flags and None by value; a
    tensor by dtype and trailing shape (``[*, 8]``: dim 0, this rank's rows, may differ between ranks;
    with ``lead=2`` dim 1 too, ``[*, *, 8]``: a token count padded per rank; values are not read, see
    ``_Digest``); a sequence element by element (list and tuple alike)."""
    t = type(v)
    if v is None or t is bool or t is str:
        return repr(v)
    if t is int:
        return str(v)
    if t is float:
        return repr(v)
    if isinstance(v, Tensor):
        dt = _DTYPE_NAMES.get(v.dtype)
        if dt is None:
            dt = _DTYPE_NAMES[v.dtype] = str(v.dtype).removeprefix("torch.")
        if v.dim() == 0:
            return f"tensor({dt}, 0-dim)"
        lead = min(lead, v.dim())
        return f"tensor({dt}, [{', '.join(['*'] * lead + [str(x) for x in v.shape[lead:]])}])"
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Real):
        return repr(float(v))
    if isinstance(v, range):
        return repr(v)
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(describe(x) for x in v)) + "}"
    if type(v).__module__ == "numpy" and hasattr(v, "tolist"):  # an array or a numpy scalar: by value
        vals = v.tolist()
        if isinstance(vals, list) and v.size > 64:
            return f"ndarray({v.dtype}, {list(v.shape)}, sha256 {hashlib.sha256(v.tobytes()).hexdigest()[:12]})"
        return f"ndarray({v.dtype}, {describe(vals)})" if isinstance(vals, list) else describe(vals)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(describe(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {describe(x)}" for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, torch.device):
        return v.type  # cuda:0 on one rank, cuda:1 on the next
    return type(v).__qualname__


class _Binder:
    """A public function's arguments by name, defaults applied (``inspect.Signature.bind`` without its
    cost, ~50 us a call; a signature with ``*args`` / ``**kwargs`` uses it). ``gather`` and private
    (``_``) parameters are left out."""

    def __init__(self, fn):
        try:
            self.sig: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.sig = None
            return
        ps = list(self.sig.parameters.values())
        self.slow = any(p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) for p in ps)
        self.positional = [p.name for p in ps if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
        self.names = {p.name for p in ps if p.kind != _P.POSITIONAL_ONLY}
        self.keep = [(p.name, p.default) for p in ps if p.name != "gather" and not p.name.startswith("_")]

    def __call__(self, args: tuple, kwargs: dict) -> list[tuple[str, object]] | None:
        """``[(name, value)]`` in signature order, or None when the call does not bind (it raises)."""
        if self.sig is None:
            return None
        if self.slow:
            try:
                bound = self.sig.bind(*args, **kwargs)
            except TypeError:
                return None
            bound.apply_defaults()
            return [(k, v) for k, v in bound.arguments.items() if k != "gather" and not k.startswith("_")]
        if len(args) > len(self.positional):
            return None
        vals = dict(zip(self.positional, args, strict=False))
        for k, v in kwargs.items():
            if k in vals or k not in self.names:
                return None
            vals[k] = v
        out = []
        for k, default in self.keep:
            v = vals.get(k, default)
            if v is _P.empty:
                return None
            out.append((k, v))
        return out


class _Digest:
    """One rank's gathered call: the loss, its arguments' names and descriptions (:func:`describe`),
    one hash of them all (what the exchange compares), and the 0-dim floating tensors among them
    (their values are compared too, on the device: a learnable temperature). The per-argument text
    travels only when the hashes or values differ, to name the arguments."""

    __slots__ = ("args", "descs", "head", "values")

    def __init__(self, name: str, binder: _Binder | None, args: tuple, kwargs: dict, ragged: tuple[str, ...] = ()):
        self.args: list[str] = []
        self.descs: list[str] = []
        self.values: dict[int, Tensor] = {}
        bound = None if binder is None else binder(args, kwargs)
        if bound is None:
            self.head = _UNKNOWN
            return
        for i, (k, v) in enumerate(bound):
            try:
                d = describe(v, 2 if k in ragged else 1)
            except Exception:  # noqa: BLE001 - a description never fails the call
                d = type(v).__qualname__
            self.args.append(k)
            self.descs.append(d)
            if i < _VALUES and isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point():
                self.values[i] = v
        # whether this rank's loss will have a backward: a rank without one (no_grad, inference mode, inputs
        # that do not require grad) would leave the others waiting in the gathers' backward
        leaves = [x for _, v in bound for x in (v if isinstance(v, (list, tuple)) else (v,))]
        graph = torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in leaves)
        # the environment variable that picks the backend: set on one rank only, the ranks would compute on
        # different backends (and fail in a later collective, naming neither)
        self.args.append("(FUSED_CONTRASTIVE_BACKEND)")
        self.descs.append(repr(routes.raw("BACKEND")))
        self.args.append("(backward)")
        self.descs.append("a graph: this rank backpropagates" if graph else
                          "no graph: no_grad, inference mode or inputs that do not require grad")
        self.head = _h48(name + "(" + "; ".join(f"{k}={d}" for k, d in zip(self.args, self.descs, strict=True)) + ")")

    def texts(self) -> list[str]:
        """The descriptions, 0-dim tensors' values included (read on the host: the error path)."""
        out = list(self.descs)
        for i, t in self.values.items():
            out[i] += f" = {float(t.detach())!r}"
        return out


class _Call:
    def __init__(self, name: str, grp: dist.ProcessGroup, digest: _Digest | None = None):
        self.name, self.grp, self.digest, self.done = name, grp, digest, False
        self.table: list[list[float]] | None = None
        self.sent: tuple[bool, int | None, int | None] = (False, None, None)  # (scale given, rows, cols)


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _short(d: str) -> str:
    return d if len(d) <= 160 else d[:157] + "..."


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


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
    """The first collective of a gathered loss call: per rank ``[failed, scale, rows, cols, the call's
    digest, its 0-dim tensor arguments' values...]`` (NaN / -1 where not given). When a rank failed or
    the calls differ, a second exchange carries the errors' text and every argument's description: a
    failing rank returns (its caller re-raises its own error, with a note saying what the other ranks
    were told), every other rank raises a ``ValueError`` naming the failing ranks and the differing
    arguments with the ranks that passed each value."""
    call.done = True
    call.sent = (scale is not None, rows, cols)
    grp = call.grp
    dev = _exchange_device(grp)
    dg = call.digest if call.digest is not None else _Digest(call.name, None, (), {})
    host = [1.0 if failure is not None else 0.0, math.nan, -1.0 if rows is None else float(rows),
            -1.0 if cols is None else float(cols), dg.head, *([math.nan] * _VALUES)]
    fills = {5 + i: t for i, t in dg.values.items()}
    if isinstance(scale, Tensor):
        fills[1] = scale
    elif scale is not None:
        host[1] = float(scale)
    mine = torch.tensor(host, dtype=torch.float64, device=dev)
    if fills:
        idx = torch.tensor(list(fills), device=dev)
        mine[idx] = torch.stack([t.detach().reshape(()).to(device=dev, dtype=torch.float64) for t in fills.values()])
    world = dist.get_world_size(grp)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=grp)
    table = torch.stack(every).cpu().tolist()
    call.table = table
    failed = [r for r, row in enumerate(table) if row[0]]
    known = [r for r, row in enumerate(table) if row[4] != _UNKNOWN]
    differ_any = any(table[r][4] != table[known[0]][4]
                     or not all(_same(x, y) for x, y in zip(table[r][5:], table[known[0]][5:], strict=True))
                     for r in known)
    if failed or differ_any:
        text = None if failure is None else f"{type(failure).__name__}: {failure}"
        notes: list = [None] * world
        dist.all_gather_object(notes, (text, call.name, dg.args, dg.texts()), group=grp)
        parts = []
        if len({(notes[r][1], tuple(notes[r][2])) for r in known}) > 1:
            by: dict[str, list[int]] = {}
            for r in known:
                by.setdefault(notes[r][1], []).append(r)
            parts.append("the ranks called different losses: "
                         + " vs ".join(f"{n} on {_ranks(rs)}" for n, rs in by.items()))
        elif known:
            for i, arg in enumerate(notes[known[0]][2]):
                by = {}
                for r in known:
                    by.setdefault(notes[r][3][i], []).append(r)
                if len(by) > 1:
                    parts.append(f"{arg} differs: "
                                 + " vs ".join(f"{_short(d)} on {_ranks(rs)}" for d, rs in by.items()))
        differ = "; ".join(parts)
        here = dist.get_rank(grp)
        if failure is not None:
            also = f"; the ranks' calls also differ: {differ}" if differ else ""
            others = [r for r in failed if r != here]
            more = f"; {_ranks(others)} failed too" if others else ""
            failure.add_note(f"{call.name}(gather=...): every rank of the process group was told, and raises too "
                             f"(this is rank {here}){more}{also}")
            return table
        head = f"{call.name}(gather=...): "
        if failed:
            bad = "; ".join(f"rank {r}: {notes[r][0]}" for r in failed)
            msg = head + f"another rank rejected its arguments, so no rank gathers (this is rank {here}): {bad}"
            if differ:
                msg += f"; the ranks' calls also differ: {differ}"
        else:
            msg = head + (f"the ranks were called with different arguments, so no rank gathers (this is rank "
                          f"{here}; a gathered loss needs the same call on every rank, only the local batch "
                          f"size may differ): {differ}")
        raise ValueError(msg)
    scales = [row[1] for row in table]
    if not all(math.isnan(x) for x in scales) and any(x != scales[0] for x in scales):
        desc = ", ".join(f"rank {r}: {x:.9g}" for r, x in enumerate(scales))
        raise ValueError(f"{call.name}(gather=...): the ranks were given different temperatures / scales "
                         f"({desc} as scale = 1 / temperature); a gathered loss needs one on every rank")
    return table


def agreed(fn: _F | None = None, *, ragged: tuple[str, ...] = ()) -> _F:
    """Decorator of a public loss with a ``gather=`` keyword, outermost (see the module docstring):
    under a process group, the call's digest (from ``fn``'s signature, so every argument, the
    Matryoshka ones of ``@leveled`` included) goes with the loss's first collective, and an exception
    raised before that collective (an argument check, on one rank or on all) is announced to every rank
    in it, which the healthy ranks are waiting in. ``@agreed(ragged=(names))``: those tensor arguments
    may also differ in dim 1 between ranks (token embeddings padded to each rank's longest sequence)."""
    if fn is None:
        return functools.partial(agreed, ragged=ragged)  # type: ignore[return-value]
    name = fn.__name__
    binder = _Binder(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        gather = kwargs.get("gather", False)
        if gather is False or gather is None or getattr(_CALL, "call", None) is not None \
                or not (dist.is_available() and dist.is_initialized()):
            return fn(*args, **kwargs)
        grp = process_group(gather)
        call = _CALL.call = _Call(name, grp, _Digest(name, binder, args, kwargs, ragged))
        try:
            out = fn(*args, **kwargs)
            if not call.done:  # a body that returned without any collective still agrees (and checks)
                _exchange(call, None)
            return _finite_everywhere(out, grp)
        except Exception as exc:
            if not call.done:
                _exchange(call, exc)  # adds a note to exc; raises a ValueError naming differing arguments
            raise
        finally:
            _CALL.call = None

    return wrapper  # type: ignore[return-value]


def _finite_everywhere(out, grp: dist.ProcessGroup):
    """``out`` (a loss, or a tuple of them), NaN on every rank when any rank's is not finite: one all-reduce of a
    flag, kept on the device (no host read). Without it a NaN in one rank's rows makes only that rank's loss
    non-finite, and the common ``if torch.isfinite(loss): loss.backward()`` leaves the other ranks waiting in
    the gathers' backward."""
    parts = out if isinstance(out, tuple) else (out,)
    tensors = [t for t in parts if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        return out
    dev = _exchange_device(grp)
    ok = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all().to(device=dev, dtype=torch.float32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=grp)
    fixed = [torch.where(ok.to(t.device) > 0, t, torch.full_like(t, math.nan))
             if isinstance(t, Tensor) and t.is_floating_point() else t for t in parts]
    return tuple(fixed) if isinstance(out, tuple) else fixed[0]


def all_checked(grp: dist.ProcessGroup, check: Callable[[], object], what: str):
    """``check()`` (an argument check that needs what a collective told this rank: a target's range against
    the gathered columns) on every rank at once: one all-gather of a flag, read on the host; when any rank's
    check raised, every rank raises (the failing ranks their own error, with a note; the others a ValueError
    naming them and their errors) instead of the healthy ranks waiting in the next collective. Returns
    ``check()``'s value."""
    err, value = None, None
    try:
        value = check()
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        err = exc
    dev = _exchange_device(grp)
    world = dist.get_world_size(grp)
    mine = torch.tensor([0.0 if err is None else 1.0], device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=grp)
    failed = [r for r, x in enumerate(torch.cat(every).cpu().tolist()) if x]
    if not failed:
        return value
    notes: list = [None] * world
    dist.all_gather_object(notes, None if err is None else f"{type(err).__name__}: {err}", group=grp)
    here = dist.get_rank(grp)
    if err is not None:
        err.add_note(f"{what}(gather=...): every rank of the process group was told, and raises too "
                     f"(this is rank {here})")
        raise err
    bad = "; ".join(f"rank {r}: {notes[r]}" for r in failed)
    raise ValueError(f"{what}(gather=...): another rank rejected its arguments (this is rank {here}): {bad}")


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

    Within one call (``@leveled``'s per-level route runs the body once per level) the first exchange's
    table is reused when it already holds what is asked (a scale, the same rows and mask width): one
    exchange per call.
    """
    call = getattr(_CALL, "call", None)
    if call is None or call.grp is not grp:
        call = _Call("loss", grp)
    if call.done and call.table is not None and (scale is None or call.sent[0]) \
            and rows in (None, call.sent[1]) and cols in (None, call.sent[2]):
        table = call.table
    else:
        if call.done:
            call = _Call(call.name, grp, call.digest)
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

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.int16, torch.int8, torch.uint8)


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
