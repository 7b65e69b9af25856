"""The case registry tells the truth: every fact a test or the benchmark needs about a case is on the
case, and a missing registration fails here with "add X to Y" (not as a StopIteration, a wrong
threshold or a silently smaller test elsewhere)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_contrastive as fc
from fused_contrastive import nn as fnn
from fused_contrastive.testing import BENCH_CASES, CASES, make_inputs, run, shapes_for
from fused_contrastive.testing.baselines import formula_of

CASES_PY = "fused_contrastive/testing/cases.py"

# public functions that are not losses over embeddings with a module form (and why)
FUNCTION_ONLY = {
    "cosent_loss_from_scores": "takes precomputed scores; CoSENTLoss is the embedding form",
    "uniformity": "a metric (also usable as a loss, but reported, not configured)",
    "alignment": "a metric",
    "encode_in_chunks": "not a loss",
}


# public loss functions without a "gradcheck" case (and why)
NO_GRADCHECK = {
    "dclw_loss": "no gradient flows through its weight w (the paper's definition): finite differences see w move",
    "encode_in_chunks": "not a loss",
}


def _public_losses() -> dict[str, object]:
    return {name: getattr(fc, name) for name in fc.__all__
            if inspect.isfunction(getattr(fc, name)) and name not in NOT_EMBEDDING_LOSSES}


#: public functions outside the [rows, D] embedding-loss registry: an encoder wrapper, and late interaction
#: (token tensors [N, L, D] with masks; its cases, its float64 definition and its backends are
#: tests/test_maxsim.py's and tests/test_triton_maxsim.py's)
NOT_EMBEDDING_LOSSES = ("encode_in_chunks", "maxsim_info_nce", "maxsim_scores")


def test_every_public_loss_has_cases_and_one_inductor_case():
    by_fn: dict[object, list] = {}
    for c in CASES:
        by_fn.setdefault(c.fn, []).append(c)
    for name, fn in _public_losses().items():
        cases = by_fn.get(fn, [])
        assert cases, f"{name} has no case: add its cases to CASES in {CASES_PY}"
        marked = [c.name for c in cases if c.inductor]
        assert len(marked) == 1, (f"{name}: mark exactly one of its cases inductor=True in {CASES_PY} "
                                  f"(the Inductor compile test runs it); marked: {marked}")


def test_every_benchmark_case_has_its_formula():
    for c in BENCH_CASES:
        formula_of(c.name)  # raises "add Baseline(..., kind='formula') ... to BASELINES in baselines.py"
        assert c.logits is not None or c.op == "cosent", (
            f"{c.name}: a benchmark case needs logits= (the textbook FLOPs its contenders are credited with)")


def test_formula_of_names_the_fix_when_missing():
    with pytest.raises(KeyError, match="add Baseline.*baselines.py"):
        formula_of("no_such_case")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_min_n_is_the_smallest_defined_problem(case):
    if case.min_n > 1:
        with pytest.raises(ValueError, match=f"needs N >= {case.min_n}"):
            make_inputs(case, case.min_n - 1, 3)
    # at min_n the definition gives a finite loss (reference backend, float64)
    loss, _ = run(case, make_inputs(case, case.min_n, 3), "reference", torch.float64)
    assert torch.isfinite(loss).all(), (case.name, loss)
    assert all(n >= case.min_n for n, _ in shapes_for(case))


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("case", [c for c in CASES if c.op == "core"], ids=lambda c: c.name)
def test_contrast_set_size_is_what_the_reference_builds(case):
    """``case.cols(n)`` (the memory test's M) against the logits the naive reference materialises: a 2-D
    tensor with M columns and at least one row per ... anchor group exists, and none is wider."""
    n = 12
    inputs = make_inputs(case, n, 5)
    with _Shapes() as rec:
        run(case, inputs, "reference", torch.float64)
    m = case.cols(n)
    widths = {s[-1] for s in rec.shapes if len(s) == 2 and s[0] > 1}
    assert m in widths, f"{case.name}: cols({n}) = {m}, the reference's 2-D tensors have widths {sorted(widths)}"
    assert max(widths) <= max(m, 5), f"{case.name}: the reference builds width {max(widths)} > cols({n}) = {m}"


def test_every_public_loss_has_a_module_or_a_reason():
    modules = {fn for fn in fnn.DERIVED.values()} | {fc.clip_loss, fc.siglip_loss}  # the two learn parameters
    for name, fn in _public_losses().items():
        assert fn in modules or name in FUNCTION_ONLY, (
            f"{name} has no module form: add `X = loss_module(...)` (one line) to fused_contrastive/nn.py, or "
            "list it in FUNCTION_ONLY in tests/test_registry.py with the reason")
    for cls in fnn.DERIVED:
        assert cls.__name__ in fnn.__all__, f"{cls.__name__} missing from fused_contrastive.nn.__all__"


@pytest.mark.parametrize("cls", list(fnn.DERIVED), ids=lambda c: c.__name__)
def test_derived_modules_take_their_functions_options(cls):
    """The derived constructor's options are the function's keyword-only options, with its defaults."""
    fn = fnn.DERIVED[cls]
    fwd = inspect.signature(cls.forward).parameters  # per-batch inputs (a queue, a guide) are forward's
    fn_opts = {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY
               and k not in fwd}
    init = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
    # and, where the function takes a temperature, learn_temperature (the module owns log(temperature))
    assert init == {**fn_opts, **({"learn_temperature": False} if "temperature" in fn_opts else {})}


def test_the_host_code_trace_cases_cover_every_structural_fact():
    """The symbolic host-code trace (tests/test_compile.py) runs only ``covering_cases``: together they
    must have every (what, value) fact of every core-op case, and the facts are the call's own (checked
    by hand on three cases)."""
    from fused_contrastive.testing.host_paths import covering_cases, host_features

    names = [c.name for c in CASES if c.op == "core"]
    chosen = covering_cases(names)
    assert set(chosen) <= set(names) and len(chosen) < len(names)
    covered = set().union(*(host_features(c) for c in chosen))
    for n in names:
        assert host_features(n) <= covered, f"{n}: {sorted(host_features(n) - covered, key=str)} not traced"
    simcse, clip, dcl = host_features("simcse"), host_features("clip"), host_features("dcl")
    # interleaved SimCSE: B is A, its own column excluded, symmetric logits (the triangular sweep)
    assert {("b", "none"), ("spec.exclude_self", True), ("route.triangular", True), ("coef.col", "absent")} <= simcse
    # CLIP: a column LSE (a number coefficient) against a second tensor: not triangular
    assert {("b", "other"), ("coef.col", "number"), ("route.triangular", False)} <= clip
    # DCL: B is A but its target column is excluded (a bias column): not triangular either
    assert {("b", "none"), ("spec.exclude_target", True), ("route.triangular", False)} <= dcl


def _called_in(path: str, scope: str) -> set[str]:
    """The ``fc.<name>(...)`` calls written inside the function or assignment ``scope`` of a test file
    (parsed, not run)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent / path).read_text())
    nodes = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == scope) or
             (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == scope for t in n.targets)) or
             (isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == scope)]
    assert nodes, f"tests/{path} has no {scope}"
    return {n.func.attr for n in ast.walk(nodes[0]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "fc"}


def test_every_gathering_loss_has_its_multi_process_cells():
    """A public loss that takes ``gather=`` has a cell in the gather parity test (every rank's value and
    gradients against one process with the global batch) and in the training-step matrix (DDP over gloo
    with a real encoder). A case with a ``gather_split`` fact gets both from the registry (the matrix's
    when the case is benchmarked with [N, D] embeddings: its formula is the textbook); the hand-written
    cells hold the splits that are not a fact yet (targets, masks, queues, views)."""
    import _training_matrix

    gathering = {n for n, fn in _public_losses().items() if "gather" in inspect.signature(fn).parameters}
    assert {"info_nce", "dcl_loss", "supcon_loss", "cosent_loss", "siglip_loss"} <= gathering
    generated = {c.fn.__name__ for c in CASES if c.gather_split is not None}
    parity = _called_in("test_distributed.py", "_cases") | _called_in("test_siglip.py", "_gather_worker") | generated
    matrix = {c.name.split("[")[0] for c in _training_matrix.CELLS if "[" in c.name}
    for called, where in ((parity, "_cases in tests/test_distributed.py (or gather_split= on one of its cases)"),
                          (_called_in("_training_matrix.py", "CELLS") | matrix,
                           "CELLS in tests/_training_matrix.py (or gather_split= on a benchmarked case)")):
        missing = gathering - called
        assert not missing, f"add a gather=True cell for {sorted(missing)} to {where}"


def test_every_public_loss_has_a_gradcheck_case():
    """The test families a case takes are its ``families`` (tests/test_losses.py reads them, no hand
    list): every public loss function has a "gradcheck" case, or a reason here."""
    checked = {c.fn for c in CASES if "gradcheck" in c.families}
    for name, fn in _public_losses().items():
        assert fn in checked or name in NO_GRADCHECK, (
            f"{name}: add families=frozenset({{'gradcheck'}}) to one of its cases in {CASES_PY}, or list it in "
            "NO_GRADCHECK in tests/test_registry.py with the reason")
    known = {"gradcheck", "degenerate_rows", "huge_rows"}
    for c in CASES:
        assert c.families <= known, f"{c.name}: unknown test families {sorted(c.families - known)}"


@pytest.mark.parametrize("case", [c for c in CASES if c.op == "core"], ids=lambda c: c.name)
def test_core_calls_is_what_the_loss_makes(case):
    from fused_contrastive.tools.compile_survey import core_calls

    calls = core_calls(case.name, 8, 4)  # raises when the loss makes another number of calls
    assert len(calls) == case.core_calls >= 1


def test_a_wrong_core_calls_names_the_fix(monkeypatch):
    import dataclasses

    from fused_contrastive.testing import CASE_BY_NAME
    from fused_contrastive.tools.compile_survey import core_calls

    monkeypatch.setitem(CASE_BY_NAME, "clip", dataclasses.replace(CASE_BY_NAME["clip"], core_calls=2))
    with pytest.raises(RuntimeError, match="core_calls=2 but the loss made 1 core-op call.*set core_calls"):
        core_calls("clip", 8, 4)
