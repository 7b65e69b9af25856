"""Traces the host code of the core op on data-less tensors and prints a JSON report (run as a script by
``tests/test_compile.py``, in its own process: triton must be imported *without* the interpreter, so
that ``wrap_triton`` turns the kernel launches into graph nodes).

For the registry cases that together take every branch of the core op's host code
(``testing.host_paths.covering_cases``: every spec flag, data tensor, coefficient kind, reduction, scale
kind, B-is-A and dtype that any case has, in a fraction of the cases; CoSENT's two operators too), on both
backends (or the one ``--backend`` names),
``make_fx(tracing_mode="symbolic")`` traces

* ``eager``: ``core.run`` forward and its autograd backward (the path of an uncompiled training step);
* ``op``: the implementation of ``fused_contrastive::core`` (forward + gradients in one call; for
  per-row output also ``core_backward``), i.e. what runs inside a compiled graph;
* ``triton_op`` (triton backend): the ``fused_contrastive::triton_core`` operator under
  functionalization, as Inductor decomposes it (Triton's mutation analysis warns that it cannot
  find a GPU driver and assumes every pointer argument is written: harmless for a trace).

Any ``.item()``, ``bool(tensor)``, data-dependent shape or storage access raises during such a trace,
so an entry without ``error`` is host code that never reads device data: the condition for CUDA
graphs. The tensors are fake tensors over the ``meta`` device, which stands in for CUDA: this
PyTorch build has no CUDA device guard, so fake ``cuda`` tensors cannot even be indexed here; every
branch of the host code that is taken for CUDA tensors is taken for meta tensors too (both are "not
the CPU"). ``--plant`` adds a ``.item()`` to the row normalisation and to the target logits (both backends) to show
that the trace catches one.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FUSED_CONTRASTIVE_DENSE"] = "0"  # the chunked and kernel paths, not the one-tile path

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fused_contrastive import core, ops
from fused_contrastive.core import norms
from fused_contrastive.testing import CASES
from fused_contrastive.testing.host_paths import covering_cases
from fused_contrastive.tools.compile_survey import core_call

N, D = 96, 40


def _leaf(x, grad: bool):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device="meta", requires_grad=grad and x.is_floating_point())


def _flat(case: str, backend: str, grad: bool) -> list:
    a, b, scale, spec, data, coef, reduce = core_call(case, N, D)
    if backend == "triton" and a.dtype == torch.float64:  # uniformity: float64 on torch, float32 on triton
        a, b = a.float(), None if b is None else b.float()
    need = [True, b is not None, isinstance(scale, torch.Tensor)]
    flat = list(ops._flatten(backend, a, b, scale, spec, data, coef, reduce, need))
    pos = ops._POS
    for k in ("a", "b", "scale_t"):  # the differentiable inputs: fresh leaves (a may be a view of b)
        flat[pos[k]] = _leaf(flat[pos[k]], grad)
    for i in ops._TENSOR_ARGS:  # CoreData's tensors
        if ops._NAMES[i] not in ("a", "b", "scale_t"):
            flat[i] = _leaf(flat[i], False)
    flat[pos["coef_t"]] = [_leaf(c, False) for c in flat[pos["coef_t"]]]
    return flat


def _kernels(g) -> list[str]:
    """Names of the Triton kernels launched in the graph, in order."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []
    for n in g.graph.nodes:
        if "triton_kernel_wrapper" in str(n.target):
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            names.append(getattr(getattr(k, "fn", k), "__name__", str(k)))
    return names


def _trace(fn, *args) -> dict:
    try:
        g = make_fx(fn, tracing_mode="symbolic")(*args)
    except Exception as e:  # noqa: BLE001 - the report carries the error
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    names = _kernels(g)
    return {"nodes": len(g.graph.nodes), "kernels": len(names), "names": sorted(set(names))}


def _functional(op):
    """``op`` (a ``triton_op``) as Inductor lowers it: under functionalization the operator decomposes
    into its host code, and each launch becomes a ``triton_kernel_wrapper`` node (outside
    functionalization it stays one opaque node)."""
    def run(*flat):
        def wrap(x):
            if isinstance(x, torch.Tensor):
                return FunctionalTensor.to_functional(x)
            return [wrap(y) for y in x] if isinstance(x, list) else x  # Tensor[] arguments too

        with FunctionalTensorMode():
            args = [wrap(x) for x in flat]
            out = op(*args)
        return [torch._from_functional_tensor(o.elem) for o in out]
    return run


def _functional_triton_op(*flat):
    return _functional(ops._triton_core_op())(*flat)


def _eager_step(*flat):
    backend, a, b, scale, spec, data, coef, reduce, _ = ops._unflatten(flat)
    out = core.run(backend, a, b, scale, spec, data, coef, reduce)
    xs = [x for x in (a, b, scale) if isinstance(x, torch.Tensor) and x.requires_grad]
    return torch.autograd.grad(out.sum(), xs)


def main(plant: bool, backends: tuple[str, ...] = ("torch", "triton")) -> dict:
    if plant:
        orig = norms.normalize_rows

        def planted(x, *args, **kwargs):
            if float(x.float().sum()) > 1e300:  # a host read: what the trace must refuse
                pass
            return orig(x, *args, **kwargs)

        norms.normalize_rows = planted
        for mod in (core.torch_chunked, core.linear_terms):
            mod.normalize_rows = planted
        # the triton backend's target term normalises in its row kernel: the read is planted where both
        # backends turn the target cosines into logits too
        orig_tgt = core.linear_terms._target_from_cos

        def planted_tgt(cos, *args, **kwargs):
            if float(cos.float().sum()) > 1e300:
                pass
            return orig_tgt(cos, *args, **kwargs)

        core.linear_terms._target_from_cos = planted_tgt

    report = {}
    for case in covering_cases([c.name for c in CASES if c.op == "core"]):
        for backend in backends:
            key = f"{case}/{backend}"
            report[f"{key}/eager"] = _trace(_eager_step, *_flat(case, backend, grad=True))
            flat = _flat(case, backend, grad=False)
            report[f"{key}/op"] = _trace(lambda *f: ops._core_impl(*f), *flat)
            if not flat[ops._POS["reduce"]]:  # per-row output: the recomputing backward operator
                go = torch.empty(flat[0].shape[0], device="meta")
                report[f"{key}/op_backward"] = _trace(lambda *f: ops._core_backward_impl(*f), *flat, go)
            if backend == "triton":
                report[f"{key}/triton_op"] = _trace(_functional_triton_op, *flat)
        if plant:  # one case shows it
            break
    b = 3000  # above the pair-tile size: the sorted path of the torch backend
    for backend in backends:
        args = (torch.empty(b, D, device="meta"), torch.empty(b, D, device="meta"), torch.empty(b, device="meta"),
                torch.empty((), device="meta"), 0.0, True, 1e-12, backend, [True, True, True])
        report[f"cosent/{backend}/op"] = _trace(lambda *a: ops._cosent_pairs_impl(*a), *args)
        sargs = (torch.empty(b, device="meta"), torch.empty(b, device="meta"), torch.empty((), device="meta"), 0.0,
                 backend, [True, True])
        report[f"cosent_scores/{backend}/op"] = _trace(lambda *a: ops._cosent_scores_impl(*a), *sargs)
        if backend == "triton":
            report["cosent/triton/triton_op"] = _trace(_functional(ops._triton_cosent_op("pairs")), *args)
            report["cosent_scores/triton/triton_op"] = _trace(_functional(ops._triton_cosent_op("scores")), *sargs)
    return report


if __name__ == "__main__":
    only = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else None
    json.dump(main("--plant" in sys.argv, (only,) if only else ("torch", "triton")), sys.stdout, indent=1)
