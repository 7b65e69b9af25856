"""GIST and ``info_nce(guide=, ids=)`` under ``torch.compile`` / ``torch.export``: the merged-block core
as the registered operator ``fused_contrastive::merged_lse`` (O(B*D) memory when traced, as eagerly).

* ``opcheck`` of ``merged_lse`` / ``merged_lse_backward`` on the arguments the losses hand them
  (summed and per-row output, guide rule, ids, own column, an offset row block, a learnable scale;
  the torch sweep on one and many row chunks, the Triton kernels under the interpreter);
* compiled (fullgraph, dynamic N) equals eager in float64, N changes without a recompile, with
  Matryoshka levels, a learnable temperature and the Triton backend;
* the compiled step allocates nothing near B x 4B (a TorchDispatchMode sees every tensor the compiled
  graph's ops create), while the same probe sees the materialised definition's matrices;
* ``torch.export`` of a GIST module: the exported graph calls the operator.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from test_compile import _compiled_parity
from test_memory import LargestTensor
from torch.utils._pytree import tree_map

import fused_contrastive as fc
from fused_contrastive import ops

D = 5


def _randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=dtype)


def _gist_inputs(n: int, seed: int = 0, dtype=torch.float64, dg: int = 3):
    g = torch.Generator().manual_seed(seed)
    a, p, ng = (_randn(g, n, D, dtype=dtype).requires_grad_() for _ in range(3))
    guide = tuple(_randn(g, n, dg) for _ in range(3))
    return a, p, ng, guide


def _gist(reduction="mean", **kw):
    def fn(a, p, ng, guide, t):
        return fc.gist_loss(a, p, ng, guide=guide, temperature=t, margin=0.05, reduction=reduction, **kw)
    return fn


def _info_nce_guided(q, k, guide, ids, t):
    return fc.info_nce(q, k, guide=guide, ids=ids, temperature=t, guide_margin=0.02, reduction="none")


def _guided_nce_inputs(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, k = (_randn(g, n, D).requires_grad_() for _ in range(2))
    ids = torch.randint(0, max(2, n // 3), (n,), generator=g)
    return q, k, (_randn(g, n, 3), _randn(g, n, 3)), (ids, ids)


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------


def _captured(call) -> list[tuple]:
    """The flat ``merged_lse`` arguments of every operator call ``call()`` makes (under ``ops.forced``)."""
    seen = []
    flatten = ops._merged_flatten

    def record(*args):
        seen.append(flatten(*args))
        return seen[-1]

    ops._merged_flatten = record
    try:
        with ops.forced():
            call()
    finally:
        ops._merged_flatten = flatten
    assert seen, "the loss never reached fused_contrastive::merged_lse"
    return seen


def _opcheck(args: tuple, **tol) -> None:
    torch.library.opcheck(torch.ops.fused_contrastive.merged_lse.default, args, **tol)
    if args[5] is None:  # per-row output: the recomputing backward operator too (inputs detached: no double backward)
        go = torch.linspace(0.5, 1.5, args[16], dtype=args[0][0].dtype)
        plain = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, args)
        torch.library.opcheck(torch.ops.fused_contrastive.merged_lse_backward.default, (*plain, go), **tol)


_OPCHECK_CALLS = {
    "gist_mean_learnable_t": lambda: _gist()(*_gist_inputs(9), torch.tensor(0.05, dtype=torch.float64,
                                                                              requires_grad=True)),
    "gist_none_relative": lambda: _gist(reduction="none", margin_strategy="relative")(*_gist_inputs(9), 0.01),
    "gist_smoothed_mean_learnable_t": lambda: _gist(label_smoothing=0.1)(
        *_gist_inputs(9), torch.tensor(0.05, dtype=torch.float64, requires_grad=True)),
    "gist_smoothed_none": lambda: _gist(reduction="none", label_smoothing=0.2)(*_gist_inputs(9), 0.05),
    "info_nce_guide_ids_smoothed": lambda: fc.info_nce(*_guided_nce_inputs(10)[:2], guide=_guided_nce_inputs(10)[2],
                                                       ids=_guided_nce_inputs(10)[3], label_smoothing=0.1),
    "gist_no_negatives_sum": lambda: (lambda a, p, _, g: fc.gist_loss(a, p, guide=g[:2], reduction="sum"))(
        *_gist_inputs(8)),
    "info_nce_guide_ids": lambda: _info_nce_guided(*_guided_nce_inputs(10), 0.05),
    "info_nce_self_guide": lambda: fc.info_nce(_gist_inputs(10)[0], guide=_gist_inputs(10)[3][0],
                                               target=(torch.arange(10) + 1) % 10, reduction="none"),
}


@pytest.mark.parametrize("name", sorted(_OPCHECK_CALLS))
def test_opcheck_merged_lse(name, path):
    for args in _captured(_OPCHECK_CALLS[name]):
        _opcheck(args)


def test_opcheck_merged_lse_offset_rows():
    # the positive-positive block's rows start at the rank's offset under gather: built here directly
    from fused_contrastive.core.guided.torch_blocks import Block, Masks, _Config

    g = torch.Generator().manual_seed(3)
    x0, x1 = _randn(g, 6, D).requires_grad_(), _randn(g, 10, D).requires_grad_()
    gd = (_randn(g, 6, 3), _randn(g, 10, 3))
    cfg = _Config((Block(0, 1, protect=True), Block(1, 1, row_start=4, exclude=4)), 6, True, 1e-12, True)
    masks = Masks(guides=gd, target=torch.arange(6) + 4, rule=("absolute", 0.05))
    for w in (None, torch.full((6,), 0.25, dtype=torch.float64)):
        _opcheck(ops._merged_flatten([x0, x1], cfg, masks, 20.0, w, "torch"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_opcheck_merged_lse_triton_interpreted(reduction, smoothing):
    a, p, ng, guide = _gist_inputs(9, dtype=torch.float32)
    guide = tuple(x.float() for x in guide)
    for args in _captured(lambda: fc.gist_loss(a, p, ng, guide=guide, margin=0.05, reduction=reduction,
                                               backend="triton", label_smoothing=smoothing)):
        assert args[-3] == smoothing  # the operator carries the option
        assert args[-2] == "triton"
        _opcheck(args, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# compiled == eager
# ------------------------------------------------------------------------------------------------


def _parity(fn, build, backend="aot_eager", sizes=(11, 17, 23), tol=None) -> None:
    """``fn(*args)`` compiled equals eager (``test_compile._compiled_parity``: fullgraph, dynamic, no
    recompile when N changes); ``build(n) -> (args, leaves)``, the gradients taken for the leaves."""
    def as_dicts(n):
        args, leaves = build(n)
        pos = [next(i for i, a in enumerate(args) if a is x) for x in leaves]
        return {f"arg{i}": args[i] for i in pos}, list(args)

    def call(tensors, args):
        full = list(args)
        for k, v in tensors.items():
            full[int(k[3:])] = v
        return fn(*full)

    _compiled_parity(call, as_dicts, backend, sizes, tol)


def _gist_build(dtype=torch.float64):
    def build(n):
        a, p, ng, guide = _gist_inputs(n, seed=n, dtype=dtype)
        t = torch.tensor(0.05, dtype=dtype, requires_grad=True)
        return (a, p, ng, tuple(x.to(dtype) for x in guide), t), (a, p, ng, t)
    return build


@pytest.mark.parametrize("kw", [dict(reduction="mean"), dict(reduction="none"),
                                dict(reduction="mean", matryoshka_dims=[5, 3]),
                                dict(reduction="sum", contrast_anchors=False),
                                dict(reduction="mean", label_smoothing=0.1, matryoshka_dims=[5, 3])], ids=str)
def test_compiled_gist_matches_eager(kw, path):
    _parity(_gist(**kw), _gist_build())


def test_compiled_guided_info_nce_matches_eager(path):
    def build(n):
        q, k, guide, ids = _guided_nce_inputs(n, seed=n)
        return (q, k, guide, ids, 0.05), (q, k)

    _parity(_info_nce_guided, build)


def test_compiled_gist_inductor():
    _parity(_gist(), _gist_build(), backend="inductor", sizes=(11, 17))


def test_compiled_gist_triton_interpreted():
    set_tol = dict(rtol=1e-5, atol=1e-6)

    def fn(a, p, ng, guide, t):
        return fc.gist_loss(a, p, ng, guide=guide, temperature=t, margin=0.05, backend="triton")

    _parity(fn, _gist_build(torch.float32), sizes=(9, 14), tol=set_tol)


def test_the_traced_graph_calls_the_operator_not_the_definition():
    a, p, ng, guide = _gist_inputs(12)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda a, p, ng, ga, gp, gn: _gist()(a, p, ng, (ga, gp, gn), 0.05), tracing_mode="symbolic")
    with ops.forced():
        graph = gm(a, p, ng, *guide).graph
    targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    assert any("merged_lse" in t for t in targets), targets
    assert not any(t.startswith("aten.mm") or t.startswith("aten.logsumexp") for t in targets), targets


# ------------------------------------------------------------------------------------------------
# memory under compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_traced_gist_step_memory(backend, reduction):
    """The traced training step (forward and backward, ``make_fx`` with symbolic shapes under the
    tracing route: the graph a compiled step runs) creates nothing near the B x 4B scores when its
    ops run; the operator's own work is the eager torch sweep, bounded by the tile budget
    (tests/test_gist.py). The same probe catches the definition's matrices (the reference backend)."""
    b = 2048
    a, p, ng, guide = _gist_inputs(b, dtype=torch.float32)
    ga, gp, gn = (x.float() for x in guide)

    def step(a, p, ng, ga, gp, gn):
        loss = fc.gist_loss(a, p, ng, guide=(ga, gp, gn), temperature=0.05, backend=backend,
                            reduction=reduction).sum()
        return (loss, *torch.autograd.grad(loss, [a, p, ng]))

    args = (a, p, ng, ga, gp, gn)
    with ops.forced():
        gm = torch.fx.experimental.proxy_tensor.make_fx(step, tracing_mode="symbolic")(*args)
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    with LargestTensor() as probe:
        got = gm(*args)
    want = step(*args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    if backend == "torch":
        assert any("merged_lse" in t for t in targets), targets
        assert probe.largest <= 4 * b * D, f"largest tensor {probe.largest} elements from {probe.op}"
    else:
        assert probe.largest >= b * b, probe.largest


def test_export_gist_module():
    class Step(torch.nn.Module):
        def forward(self, a, p, ga, gp):
            return fc.gist_loss(a, p, guide=(ga, gp), temperature=0.05, margin=0.05)

    g = torch.Generator().manual_seed(5)
    args = (_randn(g, 12, D), _randn(g, 12, D), _randn(g, 12, 3), _randn(g, 12, 3))
    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(Step(), args, dynamic_shapes=({0: batch}, {0: batch}, {0: batch}, {0: batch}))
    targets = [str(node.target) for node in ep.graph.nodes if node.op == "call_function"]
    assert any("merged_lse" in t for t in targets), targets
    for n in (12, 7):
        xs = (_randn(g, n, D), _randn(g, n, D), _randn(g, n, 3), _randn(g, n, 3))
        torch.testing.assert_close(ep.module()(*xs), Step()(*xs), rtol=1e-12, atol=1e-12)
