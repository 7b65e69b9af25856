"""torch.compile, torch.export and host-sync freedom: the losses through the registered operators of
``fused_contrastive.ops``.

* ``opcheck`` of every operator on the arguments the registry's cases hand it (dense and chunked
  problems, the Triton backend under the interpreter);
* every case and every ``nn`` module compiles with ``fullgraph=True`` (0 graph breaks), its compiled
  loss and gradients equal eager ones (float64), and changing N does not recompile (``dynamic=True``);
* ``torch.export`` of a module calling ``info_nce``;
* the host code of both backends traced on data-less tensors (``tests/trace_host_code.py``): no host
  read anywhere, and the Triton launches appear as ``triton_kernel_wrapper`` nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import set_path
from torch.utils._pytree import tree_map

import fused_contrastive as fc
from fused_contrastive import nn as fnn
from fused_contrastive import ops
from fused_contrastive.testing import CASES, make_inputs

CORE_CASES = [c for c in CASES if c.op == "core"]
COSENT_CASES = [c for c in CASES if c.op == "cosent"]
NAMES = [c.name for c in CASES]
D = 5  # an odd D: no size of the inputs equals another by accident (dynamo's duck sizing would tie them)


def _double(tensors: dict) -> dict:
    return {k: v.double().requires_grad_() for k, v in tensors.items()}


def _loss_and_grads(fn, tensors: dict, *args):
    out = fn(tensors, *args)
    return out, torch.autograd.grad(out.sum(), list(tensors.values()))


def _assert_close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------


def _captured_core_args(case, n: int, backend: str, dtype=torch.float64) -> list[tuple]:
    """The flat arguments of ``fused_contrastive::core`` for every core-op call of ``case`` at N (inputs
    of ``dtype`` that require grad; ``tools.compile_survey.core_calls``, the one capture of the registry's calls)."""
    from fused_contrastive.tools.compile_survey import core_calls

    return [ops._flatten(backend, a, b, scale, spec, data, coef, reduce, ops._needs(a, b, scale))
            for a, b, scale, spec, data, coef, reduce in core_calls(case.name, n, D, dtype, "cpu", traced=True)]


@pytest.mark.parametrize("name", [c.name for c in CORE_CASES])
def test_opcheck_core(name, path, monkeypatch):
    case = next(c for c in CORE_CASES if c.name == name)
    for args in _captured_core_args(case, 13, "torch"):
        torch.library.opcheck(torch.ops.fused_contrastive.core.default, args)
        if not args[ops._POS["reduce"]]:  # per-row output: its backward operator too (inputs detached: no double
            go = torch.randn(args[0].shape[0], dtype=torch.float64)  # backward)
            plain = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, args)
            torch.library.opcheck(torch.ops.fused_contrastive.core_backward.default, (*plain, go))


@pytest.mark.parametrize("name", ["info_nce_none", "clip_scale", "supcon_in", "dscl_queue"])
def test_opcheck_core_triton_interpreted(name, monkeypatch):
    """The Triton kernels (interpreter, float32) inside the operator: the chunk-free kernel path."""
    set_path(monkeypatch, "chunked")
    case = next(c for c in CORE_CASES if c.name == name)
    for args in _captured_core_args(case, 9, "triton", torch.float32):
        assert args[ops._POS["backend"]] == "triton"
        torch.library.opcheck(torch.ops.fused_contrastive.core.default, args, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [c.name for c in COSENT_CASES])
@pytest.mark.parametrize("n", [7, 600])  # the B x B pair tile and the sorted scan
def test_opcheck_cosent(name, n):
    case = next(c for c in COSENT_CASES if c.name == name)
    t, kw = make_inputs(case, n, D)
    t = _double(t)
    if name == "cosent":
        op = torch.ops.fused_contrastive.cosent_pairs.default
        args = (t["u"], t["v"], kw["labels"], None, 20.0, True, 1e-12, "torch", [True, True, False])
    else:
        op = torch.ops.fused_contrastive.cosent_scores.default
        args = (t["scores"], kw["labels"], t["scale"], 0.0, "torch", [True, True])
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("tensors", [True, False], ids=["tensor_scale_bias", "float_scale_bias"])
def test_opcheck_siglip(reduce, tensors, path):
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(17, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    st = torch.tensor(7.0, dtype=torch.float64, requires_grad=True) if tensors else None
    bt = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True) if tensors else None
    args = (x, y, st, 0.0 if tensors else 7.0, bt, 0.0 if tensors else -2.0, True, 1e-12, 3, reduce, 1 / 17, "torch",
            [True, True, tensors, tensors])
    torch.library.opcheck(torch.ops.fused_contrastive.siglip.default, args)
    if not reduce:
        go = torch.randn(17, generator=g, dtype=torch.float64)
        torch.library.opcheck(torch.ops.fused_contrastive.siglip_backward.default,
                              (*[a.detach() if isinstance(a, torch.Tensor) else a for a in args[:9]], 1 / 17, "torch",
                               [True, True, tensors, tensors], go))


def test_the_operator_arguments_are_derived_from_the_spec():
    """The flat arguments are the spec's fields (one place to add a field), and flatten / unflatten
    round-trip every field at a non-default value."""
    from dataclasses import fields

    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec

    want = (["a", "b", "scale_t", "scale_f"] + [f.name for f in fields(CoreData)] + ["coef_t", "coef_v"]
            + [f.name for f in fields(CoreSpec)] + ["reduce", "backend", "need"])
    assert [a.name for a in torch.ops.fused_contrastive.core.default._schema.arguments] == want
    a, b, s = torch.randn(4, 3), torch.randn(6, 3), torch.tensor(2.0)
    spec = CoreSpec(normalize=False, eps=1e-9, exclude_self=True, offset=2, bias=0.5, grad_cols=5,
                    exclude_target=True, margin=0.25)  # every field off its default (not a valid problem)
    data = CoreData(target=torch.arange(4), bias_col=torch.arange(4), row_labels=torch.arange(4),
                    col_labels=torch.arange(6), pos_mask=torch.ones(4, 6))
    coef = Coeffs(lse=torch.ones(4), col=0.5, pos=None, tgt=torch.full((4,), 2.0), set=-1.0)
    assert {f.name for f in fields(CoreSpec)} <= {k for k, v in vars(spec).items() if v != getattr(CoreSpec(), k)}
    back = ops._unflatten(ops._flatten("torch", a, b, s, spec, data, coef, True, [True, False, True]))
    assert back[0] == "torch" and back[1] is a and back[2] is b and back[3] is s and back[4] == spec
    assert all(getattr(back[5], f.name) is getattr(data, f.name) for f in fields(CoreData))
    for f in fields(Coeffs):
        got, want_c = getattr(back[6], f.name), getattr(coef, f.name)
        assert got is want_c if isinstance(want_c, torch.Tensor) else got == want_c, f.name
    assert back[7] is True and back[8] == [True, False, True]


def test_a_new_spec_field_reaches_the_operator(monkeypatch):
    """Adding a CoreSpec field is one line in spec.py: the schema grows by it (its type from the
    annotation); a type the operator cannot carry is refused naming where to add it."""
    from dataclasses import field, make_dataclass

    from fused_contrastive.core.spec import CoreSpec

    extended = make_dataclass("CoreSpec", [("target_before_exclusion", "bool", field(default=False))],
                              bases=(CoreSpec,), frozen=True)
    monkeypatch.setattr(ops, "CoreSpec", extended)
    layout = ops._layout()
    assert ("target_before_exclusion", "bool") in [(n, t) for n, t, _ in layout]
    assert [n for n, _, _ in layout][-4:] == ["target_before_exclusion", "reduce", "backend", "need"]
    bad = make_dataclass("CoreSpec", [("weights", "list[float]", field(default=None))], bases=(CoreSpec,), frozen=True)
    monkeypatch.setattr(ops, "CoreSpec", bad)
    with pytest.raises(TypeError, match="_SPEC_TYPES"):
        ops._layout()


def test_triton_op_has_the_core_schema():
    """``triton_core`` infers its schema from a typed signature; it must stay ``core``'s."""
    pytest.importorskip("triton")
    core = torch.ops.fused_contrastive.core.default._schema
    tri = ops._triton_core_op().default._schema
    assert [(a.name, str(a.type)) for a in tri.arguments] == [(a.name, str(a.type)) for a in core.arguments]
    assert [str(r.type) for r in tri.returns] == [str(r.type) for r in core.returns]
    for name in ("scores", "pairs"):  # CoSENT's triton_ops: the schemas of the opaque operators
        plain = getattr(torch.ops.fused_contrastive, f"cosent_{name}").default._schema
        tri = ops._triton_cosent_op(name).default._schema
        assert [(a.name, str(a.type)) for a in tri.arguments] == [(a.name, str(a.type)) for a in plain.arguments]


# ------------------------------------------------------------------------------------------------
# compile: graph breaks, parity, recompiles
# ------------------------------------------------------------------------------------------------


def _case_fn(case, backend: str = "torch"):
    def fn(tensors, kw):
        return case.fn(**tensors, **kw, backend=backend)
    return fn


@pytest.mark.parametrize("name", NAMES)
def test_no_graph_break(name):
    case = CASES[NAMES.index(name)]
    tensors, kw = make_inputs(case, 11, D)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(_case_fn(case))(_double(tensors), kw)
    assert ex.graph_break_count == 0, [str(r.reason) for r in ex.break_reasons]
    assert ex.graph_count == 1


def _compiled_parity(fn, build, backend: str, sizes=(24, 40, 57), tol: dict | None = None) -> None:
    """``fn(tensors, kw)`` compiled (fullgraph, dynamic) equals eager at every N (to ``tol``, default
    float64 round-off), and only the first N compiles."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for n in sizes:
        tensors, kw = build(n)
        want, want_g = _loss_and_grads(fn, tensors, kw)
        got, got_g = _loss_and_grads(compiled, tensors, kw)
        close = _assert_close if tol is None else (
            lambda x, y, what: torch.testing.assert_close(x, y, **tol, msg=lambda m: f"{what}: {m}"))
        close(got, want, f"loss at N={n}")
        for k, g, w in zip(tensors, got_g, want_g, strict=True):
            close(g, w, f"grad of {k} at N={n}")
        frames.append(counter.frame_count)
    assert frames[0] >= 1
    assert frames[1:] == [frames[0]] * (len(sizes) - 1), f"recompiled when N changed: frames {frames}"


@pytest.mark.parametrize("name", NAMES)
def test_compiled_matches_eager_aot_eager(name, path):
    case = CASES[NAMES.index(name)]

    def build(n):
        tensors, kw = make_inputs(case, n, D)
        return _double(tensors), kw

    _compiled_parity(_case_fn(case), build, "aot_eager")


# one case per public loss function under Inductor (its CPU C++ compile takes seconds per graph)
_INDUCTOR = [c.name for c in CASES if c.inductor]  # one per public loss function (tests/test_registry.py)


@pytest.mark.parametrize("name", _INDUCTOR)
def test_compiled_matches_eager_inductor(name):
    case = CASES[NAMES.index(name)]

    def build(n):
        tensors, kw = make_inputs(case, n, D)
        return _double(tensors), kw

    _compiled_parity(_case_fn(case), build, "inductor", sizes=(24, 40))


@pytest.mark.parametrize("name", ["info_nce_self_none", "supcon_in", "clip_scale", "cosent", "cosent_scores"])
def test_compiled_triton_interpreted(name, monkeypatch):
    """backend="triton" under compile on this CPU: the kernels run (interpreted) inside the opaque
    ``core`` operator; equal to eager."""
    set_path(monkeypatch, "chunked")
    case = CASES[NAMES.index(name)]

    def build(n):
        tensors, kw = make_inputs(case, n, D)
        return {k: v.requires_grad_() for k, v in tensors.items()}, kw

    def close(got, want, what):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")

    fn = _case_fn(case, "triton")
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for n in (9, 14):
        tensors, kw = build(n)
        want, want_g = _loss_and_grads(fn, tensors, kw)
        got, got_g = _loss_and_grads(compiled, tensors, kw)
        close(got, want, "loss")
        for k, g, w in zip(tensors, got_g, want_g, strict=True):
            close(g, w, f"grad of {k}")


def _module_inputs(n: int, g: torch.Generator):
    """``{class name: (module, differentiable inputs, other inputs)}`` (inputs by forward's parameter
    names, float64). The derived modules (``nn.DERIVED``) from their function's Inductor case in the
    registry: the case's options go to the constructor, its tensors to forward (embeddings [.., D]
    differentiable; labels, targets, guides not); the hand-written ones (learnable parameters) here."""
    import inspect

    out = {}
    for cls, fn in fnn.DERIVED.items():
        case = next(c for c in CASES if c.fn is fn and c.inductor)
        tensors, kw = case.build(n, D, g)
        init = set(inspect.signature(cls).parameters)
        args = {**tensors, **kw}
        unknown = set(args) - init - set(inspect.signature(cls.forward).parameters)
        assert not unknown, f"{case.name}: {sorted(unknown)} are neither {cls.__name__}'s options nor its inputs"
        as64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                    tuple(x.double() for x in v) if isinstance(v, tuple) else v) for k, v in args.items()}
        mod = cls(**{k: v for k, v in as64.items() if k in init})
        fwd = {k: v for k, v in as64.items() if k not in init}
        xs = {k: v for k, v in fwd.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2}
        out[cls.__name__] = (mod, xs, {k: v for k, v in fwd.items() if k not in xs})

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    out["CLIPLoss"] = (fnn.CLIPLoss().double(), {"a": r(n, D), "b": r(n, D)}, {})
    out["SigLIPLoss"] = (fnn.SigLIPLoss().double(), {"image": r(n, D), "text": r(n, D)}, {})
    # late interaction: [N, Lq, D] queries against [N, Ld, D] documents with padding masks, learnable scale
    qmask = torch.arange(4)[None, :] < (torch.arange(n)[:, None] % 4 + 1)
    dmask = torch.arange(5)[None, :] < (torch.arange(n)[:, None] % 5 + 1)
    out["MaxSimInfoNCELoss"] = (fnn.MaxSimInfoNCELoss(2.0, learn_scale=True).double(),
                                {"query_tokens": r(n, 4, D), "doc_tokens": r(n, 5, D)},
                                {"query_mask": qmask, "doc_mask": dmask})
    return out


#: modules whose loss has no registered operator yet: torch.compile traces their host code, which
#: specialises on the batch's shapes (chunk counts), so they compile (below) but not fullgraph with dynamic
#: shapes
NOT_AN_OPERATOR = {"MaxSimInfoNCELoss": "late interaction's chunked host code has no registered operator yet"}
_MODULES = [m for m in fnn.__all__ if m != "loss_module" and m not in NOT_AN_OPERATOR]


@pytest.mark.parametrize("module", _MODULES)
def test_nn_module_compiles(module):
    assert set(_module_inputs(3, torch.Generator())) == set(_MODULES) | set(NOT_AN_OPERATOR), (
        "a hand-written module (not in nn.DERIVED) needs its inputs in _module_inputs")

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    frames = []
    for n in (12, 20, 33):
        mod, xs, rest = _module_inputs(n, torch.Generator().manual_seed(n))[module]
        assert xs, f"{module}: no differentiable input"
        xs = {k: x.requires_grad_() for k, x in xs.items()}
        leaves = list(xs.values()) + list(mod.parameters())
        if n == 12:
            ex = torch._dynamo.explain(mod)(**xs, **rest)
            assert ex.graph_break_count == 0, [str(r.reason) for r in ex.break_reasons]
            torch._dynamo.reset()
        compiled = torch.compile(mod, backend=counter, fullgraph=True, dynamic=True)
        want = mod(**xs, **rest).sum()
        want_g = torch.autograd.grad(want, leaves, allow_unused=True)  # a queue takes no gradient
        got = compiled(**xs, **rest).sum()
        got_g = torch.autograd.grad(got, leaves, allow_unused=True)
        _assert_close(got, want, f"{module} loss")
        assert want_g[0] is not None, module
        for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
            assert (a is None) == (b is None), (module, i)
            if a is not None:
                _assert_close(a, b, f"{module} grad {i}")
        frames.append(counter.frame_count)
    assert frames[1:] == [frames[0]] * 2, f"recompiled when N changed: frames {frames}"


@pytest.mark.parametrize("module", sorted(NOT_AN_OPERATOR))
def test_modules_without_an_operator_compile_to_the_eager_values(module):
    """torch.compile (static shapes, graph breaks allowed) of a module whose loss is not a registered
    operator: the compiled step's loss and gradients are the eager ones, at two batch sizes."""
    for n in (12, 20):
        mod, xs, rest = _module_inputs(n, torch.Generator().manual_seed(n))[module]
        xs = {k: x.requires_grad_() for k, x in xs.items()}
        leaves = list(xs.values()) + list(mod.parameters())
        compiled = torch.compile(mod, backend="aot_eager")
        want = mod(**xs, **rest).sum()
        want_g = torch.autograd.grad(want, leaves)
        got = compiled(**xs, **rest).sum()
        got_g = torch.autograd.grad(got, leaves)
        _assert_close(got, want, f"{module} loss")
        for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
            _assert_close(a, b, f"{module} grad {i}")


def test_no_grad_compiled_forward_matches():
    """Under no_grad the operator forms no gradients (and returns the same loss)."""
    q, k = torch.randn(30, D, dtype=torch.float64), torch.randn(30, D, dtype=torch.float64)
    f = torch.compile(lambda q, k: fc.info_nce(q, k, reduction="sum"), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        _assert_close(f(q, k), fc.info_nce(q, k, reduction="sum"), "no_grad loss")


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------


class _Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fc.info_nce(self.proj(x), self.proj(y), temperature=0.05)


@pytest.mark.parametrize("strict", [False, True])
def test_export_info_nce(strict):
    torch.manual_seed(0)
    model = _Tower()
    x, y = torch.randn(12, 16), torch.randn(12, 16)
    n = torch.export.Dim("n", min=2)
    ep = torch.export.export(model, (x, y), dynamic_shapes=({0: n}, {0: n}), strict=strict)
    targets = [str(node.target) for node in ep.graph.nodes if node.op == "call_function"]
    assert "fused_contrastive.core.default" in targets
    for rows in (12, 31):  # a batch size other than the traced one
        x, y = torch.randn(rows, 16), torch.randn(rows, 16)
        torch.testing.assert_close(ep.module()(x, y), model(x, y), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# host code traced on data-less tensors
# ------------------------------------------------------------------------------------------------


def _trace_report(*flags: str, env_extra: dict[str, str] | None = None) -> dict:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    script = Path(__file__).with_name("trace_host_code.py")
    res = subprocess.run([sys.executable, str(script), *flags], check=False, capture_output=True, text=True,
                         env=env, timeout=900, cwd=script.parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _traced() -> list[str]:
    """The cases the trace runs: together they take every branch of the host code (tests/test_registry.py
    checks the cover)."""
    from fused_contrastive.testing.host_paths import covering_cases

    return covering_cases([c.name for c in CORE_CASES])


def test_host_code_never_reads_device_data():
    report = _trace_report()
    traced = _traced()
    want = {f"{c}/{b}/{r}" for c in traced for b in ("torch", "triton") for r in ("eager", "op")}
    assert want <= set(report)
    errors = {k: v["error"] for k, v in report.items() if "error" in v}
    assert not errors, errors
    for key, entry in report.items():
        _case, backend, route = key.split("/")
        if backend == "torch":
            assert entry["kernels"] == 0, key
        elif _case.startswith("cosent"):  # the scans (and the pair-cosine kernels) forward and backward
            assert entry["kernels"] == (4 if _case == "cosent" else 2), (key, entry)
        elif _case.startswith("uniformity") and route in ("op", "triton_op"):
            # raw augmented rows (no row-norm kernel) and per-row output (its backward is op_backward)
            assert entry["kernels"] >= 1, (key, entry)
        else:  # the launches are graph nodes: the row norms, the forward, at least one backward kernel
            assert entry["kernels"] >= (2 if route in ("op", "triton_op") else 3), (key, entry)
    assert {k.rsplit("/", 1)[0] for k in report if k.endswith("/triton_op")} == \
        {f"{c}/triton" for c in traced} | {"cosent/triton", "cosent_scores/triton"}


def test_panel_path_host_code_never_reads_device_data():
    """The same trace on the triton backend's panel path (what ``auto`` takes on CUDA for large N x M),
    with a workspace budget that gives panels of 64 rows: 2 panels of the 96 traced rows, the eager,
    the recomputing and the triangular sweeps all traced without a host read."""
    report = _trace_report("--backend", "triton", env_extra={"FUSED_CONTRASTIVE_TRITON_PATH": "panel",
                                                             "FUSED_CONTRASTIVE_PANEL_BUDGET": "1"})
    triton = {k: v for k, v in report.items() if "/triton/" in k and not k.startswith("cosent")}
    assert {k.split("/")[0] for k in triton} == set(_traced())
    errors = {k: v["error"] for k, v in triton.items() if "error" in v}
    assert not errors, errors
    # a forward + backward forms the panels' gradient tiles (the eager, recomputing or triangular sweep:
    # the panel kernel, or the epilogue GEMM where the route takes it), and the triangular sweep is what
    # symmetric SimCSE takes
    for key, v in triton.items():
        if key.endswith(("/eager", "/op_backward")):
            assert {"panel_dl_kernel", "epi_gemm_kernel"} & set(v["names"]), (key, v)
    # (its forward: the fused forward kernel with TRI, its backward the triangular panels)
    from fused_contrastive.testing.host_paths import host_features

    tri = [c for c in _traced() if ("route.triangular", True) in host_features(c)]
    assert tri, "no traced case takes the triangular sweep"
    for c in tri:
        assert "lse_fwd_kernel" in triton[f"{c}/triton/eager"]["names"], triton[f"{c}/triton/eager"]


def test_host_code_trace_catches_a_host_read():
    """The same trace with an ``.item()``-like read planted in the row normalisation fails on every
    route: the check above can fail."""
    report = _trace_report("--plant")
    report = {k: v for k, v in report.items() if not k.startswith("cosent")}  # (no row normalisation there)
    assert report and all("error" in v for v in report.values()), report
    assert all("data-dependent" in v["error"] or "DataDependent" in v["error"] for v in report.values()), report


def test_mark_dynamic_batch_does_not_recompile():
    """The other way to ask for a dynamic batch: mark_dynamic on N, default compile options."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda q, k: fc.info_nce(q, k, temperature=0.05), backend=counter, fullgraph=True)
    frames = []
    for n in (24, 40, 57):
        q = torch.randn(n, D, dtype=torch.float64, requires_grad=True)
        k = torch.randn(n, D, dtype=torch.float64, requires_grad=True)
        torch._dynamo.mark_dynamic(q, 0)
        torch._dynamo.mark_dynamic(k, 0)
        got = f(q, k)
        _assert_close(got, fc.info_nce(q, k, temperature=0.05), f"loss at N={n}")
        frames.append(counter.frame_count)
    assert frames[1:] == [frames[0]] * 2, frames
