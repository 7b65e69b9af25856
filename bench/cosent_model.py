"""A MODEL (not a measurement) of CoSENT's GPU cost per training step on each backend: launches and
bytes moved, counted on data-less tensors, no GPU needed.

Both paths run forward + backward (``torch.autograd.grad``: the gradients, not their accumulation
into ``.grad``) of ``cosent_loss(u, v, labels, scale=<tensor>)`` on the ``meta``
device (which takes the same host branches as CUDA). Counted:

* torch backend: every ATen op under a ``TorchDispatchMode`` is one kernel launch; its bytes are the
  sizes of its tensor inputs + outputs (each op reads its inputs from and writes its outputs to HBM:
  no cache reuse between ops, no fusion). Views and metadata ops are not counted.
* triton backend: the same for the ATen ops around the kernels (sort, casts, the scale's dot), plus
  each recorded kernel launch with the bytes its design reads and writes: ``pair_cos_fwd`` reads U and
  V twice (the max-|entry| pass and the sums: an upper bound, the second read of a 16-row block is
  likely an L2 hit), ``pair_cos_bwd`` reads U and V once per needed gradient and writes them; the scans
  read per score x twice (shifted), ORDER twice, labels twice and Z (bwd), and write Z / DX.

Assumptions printed with the result: bf16 embeddings, float32 labels, H100 at 3.35 TB/s HBM and
~4 us per launch (host overhead). The scans are single-program kernels: one SM walks B / 1024 blocks in
order, so their time is latency, not bandwidth (not modelled beyond the bytes).

Usage: python bench/cosent_model.py [--b 65536] [--d 768]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_contrastive as fc
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.tools import compile_survey

_FREE = {"aten.view", "aten._unsafe_view", "aten.expand", "aten.t", "aten.detach", "aten.alias", "aten.slice",
         "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.as_strided", "aten.transpose", "aten.permute",
         "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.lift_fresh", "aten.reshape"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name not in _FREE:
            ts = [a for a in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
            self.ops.append((name, sum(t.numel() * t.element_size() for t in ts)))
        return out


def _inputs(b: int, d: int):
    meta = torch.device("meta")
    u = torch.empty(b, d, dtype=torch.bfloat16, device=meta, requires_grad=True)
    v = torch.empty(b, d, dtype=torch.bfloat16, device=meta, requires_grad=True)
    return u, v, torch.empty(b, device=meta), torch.empty((), device=meta, requires_grad=True)


def torch_path(b: int, d: int):
    u, v, y, s = _inputs(b, d)
    with _Count() as c:
        torch.autograd.grad(fc.cosent_loss(u, v, y, scale=s, backend="torch"), (u, v, s))
    return c.ops


def _kernel_bytes(launch: TL.Launch, b: int, d: int) -> int:
    emb = b * d * 2  # one bf16 [B, D] tensor
    if launch.name == "pair_cos_fwd":
        return 4 * emb + 3 * b * 4
    if launch.name == "pair_cos_bwd":
        return 4 * emb + 2 * emb + 6 * b * 4
    per = 2 * 4 + 2 * 8 + 2 * 4 + 4 + (4 if launch.name.endswith("bwd") else 0)  # x, order, labels, z, dx
    return b * per


def triton_path(b: int, d: int):
    from fused_contrastive.core.cosent.triton_cosent import TritonPairCosentFn

    u, v, y, s = _inputs(b, d)
    with compile_survey.recording("sm90") as launches, _Count() as c:
        torch.autograd.grad(TritonPairCosentFn.apply(u, v, y, s, True, 1e-12), (u, v, s))
    return c.ops + [(f"triton:{lz.name}", _kernel_bytes(lz, b, d)) for lz in launches]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=65536)
    ap.add_argument("--d", type=int, default=768)
    a = ap.parse_args()
    bw, launch_s = 3.35e12, 4e-6
    print(f"MODEL, not a measurement: CoSENT forward + backward, B = {a.b}, D = {a.d}, bf16 embeddings, "
          f"float32 labels, tensor scale; H100 HBM {bw / 1e12:.2f} TB/s, {launch_s * 1e6:.0f} us per launch, "
          "every op reads its inputs and writes its outputs once (no fusion, no cache reuse)")
    for name, ops in (("torch", torch_path(a.b, a.d)), ("triton", triton_path(a.b, a.d))):
        total = sum(n for _, n in ops)
        kinds: dict[str, int] = {}
        for op, _ in ops:
            kinds[op] = kinds.get(op, 0) + 1
        top = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:6])
        t = total / bw + len(ops) * launch_s
        print(f"{name:7s} launches {len(ops):5d}  bytes {total / 1e9:7.3f} GB  "
              f"modelled {t * 1e3:6.2f} ms (bytes {total / bw * 1e3:.2f} + launches {len(ops) * launch_s * 1e3:.2f})"
              f"  most frequent: {top}")


if __name__ == "__main__":
    main()
