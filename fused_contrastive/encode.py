"""Batches beyond activation memory: :func:`encode_in_chunks`, exact gradient caching around any loss.

With the loss at O(N*D) memory, the encoder's activations bound the batch. Gradient caching (GradCache,
Gao et al. 2021) embeds the batch chunk by chunk without keeping activations, runs the loss on the
embeddings, and backpropagates each chunk's embedding gradient through a re-run of that chunk. That
is what PyTorch's non-reentrant activation checkpointing does when it wraps each chunk of the encoder
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``): the forward keeps only the chunk's
inputs and output; when autograd reaches a chunk's output in ``loss.backward()``, the chunk's forward
is recomputed with the RNG state of its first run (``preserve_rng_state=True``: the same dropout masks,
which SimCSE depends on) and under the same autocast state, and its backward runs at once, so at most
one chunk's activations are alive. Parameters collect one gradient per step (autograd sums the chunks
before a parameter's gradient is accumulated), so DDP all-reduces once per step.

Normalisation layers with running statistics (``BatchNorm*``, ``SyncBatchNorm``, ``InstanceNorm*``
with ``track_running_stats=True``) in training mode would update them twice per chunk, once in the
forward and once in the recompute; their buffers are put back after the recompute (which normalises
with the batch statistics, as the forward did: all their backward reads), so the running statistics
end as one plain forward of each chunk leaves them. This needs the layers to be found: ``encoder`` an ``nn.Module``
(DDP included) or a bound method of one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import checkpoint as _checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["encode_in_chunks"]

Batch = Tensor | Mapping[str, Any] | tuple | list


def _batch_size(leaves: list, what: str) -> int:
    sizes = {x.shape[0] for x in leaves if isinstance(x, Tensor) and x.dim() > 0}
    if not sizes:
        raise ValueError(f"{what} holds no tensor with a batch dimension (dim 0) to split")
    if len(sizes) > 1:
        raise ValueError(f"every tensor of {what} must have the same size along dim 0 (the batch), got {sorted(sizes)}")
    return sizes.pop()


def _extra_devices(encoder, leaves: list) -> list[Tensor]:
    """One empty tensor per CUDA device the encoder's parameters use that no input tensor is on:
    ``checkpoint`` replays the RNG of the devices of its tensor arguments, so these make it replay
    every CUDA device the encoder runs dropout on."""
    if not isinstance(encoder, nn.Module):
        return []
    have = {x.device for x in leaves if isinstance(x, Tensor)}
    devs = {p.device for p in encoder.parameters() if p.device.type == "cuda"} - have
    return [torch.empty(0, device=d) for d in sorted(devs, key=str)]


def _running_stat_layers(encoder) -> list[nn.Module]:
    """The normalisation layers with running statistics of ``encoder`` (an ``nn.Module``, or a bound
    method of one); [] for another callable."""
    module = encoder if isinstance(encoder, nn.Module) else getattr(encoder, "__self__", None)
    if not isinstance(module, nn.Module):
        return []
    return [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]


class _StatsUntouched:
    """The recompute of a chunk: its layers in training mode normalise as in the forward (batch
    statistics, which is all their backward reads) and their running statistics are put back after it,
    as the forward left them. A class, not a generator: ``checkpoint`` enters the one object its
    ``context_fn`` gave at every recompute, and a second backward through a retained graph recomputes
    again (a generator-based context manager can be entered once)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.saved: list[list[tuple[Tensor, Tensor]]] = []

    def __enter__(self) -> None:
        self.saved.append([(b, b.detach().clone()) for m in self.layers if m.training and m.track_running_stats
                           for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None])

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for b, v in self.saved.pop():
                b.copy_(v)


def _ddp_chunk_count(encoder, n: int, chunk_size: int) -> int | None:
    """For a ``DistributedDataParallel`` encoder that syncs buffers in its forward (``broadcast_buffers``,
    the default, with a module that has buffers): every forward is a collective, so every rank must run
    the same number of chunk forwards (and recomputes). Returns that number, the largest chunk count
    over the ranks (one all-reduce on the encoder's process group); None when chunks may differ."""
    from torch.nn.parallel import DistributedDataParallel

    if not (isinstance(encoder, DistributedDataParallel) and torch.is_grad_enabled()
            and encoder.will_sync_module_buffers()):
        return None
    import torch.distributed as dist

    dev = next((b.device for b in encoder.module.buffers()), torch.device("cpu"))
    if dist.get_backend(encoder.process_group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    # [chunks, -rows]: the MAX gives the most chunks and the fewest rows of any rank
    stats = torch.tensor([-(-n // chunk_size), -n], dtype=torch.int64, device=dev)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=encoder.process_group)
    chunks, fewest = int(stats[0]), -int(stats[1])
    if fewest < chunks:
        raise ValueError(f"encode_in_chunks with a DistributedDataParallel encoder that broadcasts buffers runs "
                         f"the same number of chunk forwards on every rank ({chunks} here, from chunk_size="
                         f"{chunk_size}), but a rank has only {fewest} rows: raise chunk_size to at least "
                         f"{-(-n // fewest) if fewest else n}, or wrap the model with broadcast_buffers=False")
    return chunks


def encode_in_chunks(encoder: Callable[[Any], Tensor], batch: Batch, chunk_size: int, *,
                     preserve_rng_state: bool = True) -> Tensor:
    """Embeddings of ``batch`` computed ``chunk_size`` examples at a time, with the activation memory of
    one chunk, and exact gradients: ``loss(encode_in_chunks(encoder, batch, c)).backward()`` gives the
    same parameter gradients as encoding the same chunks one after another with a full autograd graph
    (the same RNG stream, so the same dropout masks), for any loss of this library or any function of
    the embeddings.

    Args:
        encoder: an ``nn.Module`` or callable mapping one chunk of ``batch`` (the same structure, every
            tensor sliced along dim 0) to its ``[n, D]`` embeddings tensor (or ``[n, L, D]`` token
            embeddings for late interaction, ``fused_contrastive.maxsim``: L the same in every chunk).
        batch: a tensor ``[N, ...]``, or a dict / tuple / list of tensors that share the batch size N
            along dim 0 (e.g. a tokenizer's output; non-tensor entries are passed to every chunk
            unchanged).
        chunk_size: examples per chunk (>= 1); the last chunk may be smaller.
        preserve_rng_state: replay each chunk's RNG state (CPU, and the CUDA devices of the inputs and
            of the encoder's parameters) when it is recomputed in the backward. Default True; False
            only for encoders without randomness (saves the state capture).

    Returns:
        ``[N, D]`` (or ``[N, L, D]``) embeddings, connected to autograd when grad mode is on. Under ``torch.no_grad()``
        the chunks are simply encoded one after another.

    Several inputs per example (anchor, positive and negative texts; two dropout views of the same
    sentences) are several calls; the backward recomputes each call's chunks in reverse order. The
    encoder's forward runs twice per chunk (once here, once in the backward), so a step costs about
    one extra forward over a step without chunks. Running statistics of normalisation layers (BatchNorm)
    are updated once per chunk, as plain forwards of the chunks would (the recompute leaves them alone;
    see the module docstring), also when ``encoder`` is a function wrapping a module (its layers are found
    as the chunks run).

    Under ``DistributedDataParallel`` with ``broadcast_buffers=True`` (its default) and a module that has
    buffers, every forward is a collective, so every rank runs as many chunks as the rank with the most
    rows needs (``ceil(N_max / chunk_size)``); a rank whose batch needs fewer chunks splits it into that
    many near-equal chunks instead of ``chunk_size``-row ones (sizes differing by at most one, larger
    first: with ``chunk_size=4`` and 12 rows on another rank, 7 rows become 3 + 2 + 2, not 4 + 3), and
    a rank with fewer rows than that count raises.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not callable(encoder):
        raise TypeError(f"encoder must be an nn.Module or a callable, got {type(encoder).__name__}")
    leaves, spec = tree_flatten(batch)
    n = _batch_size(leaves, "batch")
    same = _ddp_chunk_count(encoder, n, chunk_size)  # under DDP a rank without rows makes every rank raise
    if n == 0:
        raise ValueError("batch has 0 rows (dim 0 of its tensors): there is nothing to encode")

    def chunk_of(start: int) -> list:
        return [x[start:start + chunk_size] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves]

    k = sum(1 for x in leaves if isinstance(x, Tensor) and x.dim() > 0)

    def run(*tensors: Tensor) -> Tensor:
        it = iter(tensors[:k])  # the rest are the device markers of _extra_devices
        args = [next(it) if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves]
        rows = tensors[0].shape[0]
        try:
            out = encoder(tree_unflatten(args, spec))
        except ValueError as exc:
            if rows == 1 and "more than 1 value per channel" in str(exc):
                raise ValueError(f"encode_in_chunks: a chunk of 1 row (the last one: {n} rows in chunks of "
                                 f"{chunk_size}) reached a normalisation layer in training mode, which needs more "
                                 f"than one row; choose a chunk_size that leaves at least 2 rows in the last "
                                 f"chunk") from exc
            raise
        if not isinstance(out, Tensor) or out.dim() < 2 or out.shape[0] != rows:
            what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(f"encoder must return the [n, D] embeddings tensor of its chunk (n = {rows}; or "
                            f"[n, L, D] token embeddings), got {what}")
        return out

    outs = []
    extra = _extra_devices(encoder, leaves) if preserve_rng_state else []
    layers = _running_stat_layers(encoder) if torch.is_grad_enabled() else []
    # another callable (``lambda b: model(**b)``, a partial) hides its module: the normalisation layers it runs
    # are found while the chunks' forwards run (a global forward hook for their duration), so the recomputes
    # leave their running statistics alone as a module's (they were updated twice per chunk)
    discover = torch.is_grad_enabled() and not isinstance(encoder, nn.Module) \
        and not isinstance(getattr(encoder, "__self__", None), nn.Module)
    more = {"context_fn": lambda: (contextlib.nullcontext(), _StatsUntouched(layers))} if layers or discover else {}
    hook = None
    if discover:
        def found(module, _inputs):
            if isinstance(module, _NormBase) and module.track_running_stats and all(module is not m for m in layers):
                layers.append(module)
        hook = nn.modules.module.register_module_forward_pre_hook(found)
    starts = list(range(0, n, chunk_size))
    if same is not None and same != len(starts):
        # as many chunks as the rank with the most (each rank has at least that many rows), as even as possible
        q, r = divmod(n, same)
        sizes = [q + (i < r) for i in range(same)]
        starts = [sum(sizes[:i]) for i in range(same)]
        bounds = dict(zip(starts, sizes, strict=True))

        def chunk_of(start: int) -> list:  # noqa: F811 - the uneven split replaces the fixed one
            return [x[start:start + bounds[start]] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves]

    try:
        for start in starts:
            tensors = [x for x in chunk_of(start) if isinstance(x, Tensor) and x.dim() > 0]
            if torch.is_grad_enabled():
                outs.append(_checkpoint.checkpoint(run, *tensors, *extra, use_reentrant=False,
                                                   preserve_rng_state=preserve_rng_state, **more))
            else:
                outs.append(run(*tensors))
    finally:
        if hook is not None:
            hook.remove()
    shapes = {tuple(o.shape[1:]) for o in outs}
    if len(shapes) > 1:
        raise ValueError(f"encoder returned chunks of different trailing shapes {sorted(shapes)}: token embeddings "
                         "[n, L, D] must share L across chunks (pad the batch to one length before chunking)")
    return torch.cat(outs) if len(outs) > 1 else outs[0]
