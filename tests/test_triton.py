"""backend="triton" against the float64 ground truth, under the Triton CPU interpreter.

conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the kernels of
``fused_contrastive.kernels.lse`` run on CPU tensors (slowly: shapes stay <= 256 rows). Every test
here runs with the dense one-tile path switched off (``FUSED_CONTRASTIVE_DENSE=0``), so the kernels
run even for these small problems, with every kernel output poisoned with NaN before the launch
(``TL.POISON_OUTPUTS``) and, in the registry tests, every input a view into a NaN-padded
buffer (``testing.accuracy``'s canary): an unwritten output element or an out-of-bounds read turns
into a NaN and fails THE accuracy rule.

When triton is not installed the module is skipped with that reason; when triton imports but the
kernels do not, the import below fails and so does the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

import fused_contrastive as fc
from fused_contrastive.core.lse import torch_chunked, triton_function
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.testing import CASE_BY_NAME, CASES, SLACK, assert_close, compare
from fused_contrastive.testing.accuracy import run

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CORE_CASES = [c for c in CASES if c.op == "core"]


@pytest.fixture(autouse=True)
def _kernels_poisoned_and_quiet(monkeypatch, route):
    """Kernels, not the dense path; every output poisoned; numpy's overflow warnings of the interpreter
    silenced."""
    route(DENSE="0")
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_interpreter_is_on():
    # the whole module is meaningless if the kernels are compiled for a GPU that is not there
    assert TL.interpreted()
    assert TL._upcast(torch.bfloat16) and not TL._upcast(torch.float16)


# 1. Every InfoNCE-family case of the registry, each dtype, one ragged shape per (case, dtype)
# rotating through: 97 x 100 (prime rows, resident D), 130 x 300 (rows past a 128-block, D streamed in
# 64-wide chunks), 100 x 3 (a tiny, padded D).
ROTATION = [(97, 100), (130, 300), (100, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", CORE_CASES, ids=[c.name for c in CORE_CASES])
def test_registry_case(case, dtype):
    n, d = ROTATION[(CORE_CASES.index(case) + DTYPES.index(dtype)) % len(ROTATION)]
    c = compare(case, n, d, dtype, "triton", canary=True)
    assert c.ok, (n, d, c)


# 2. Ragged shapes of the core op through the plainest per-row case. N: 1 and 3 (a single partial
# block), 97 / 100 / 130 (straddle 64- and 128-row blocks). D: 1 and 3 (one tiny chunk, padded to 16
# for tl.dot), 100 (one resident chunk, masked tail), 300 (five 64-wide chunks, the streaming
# accumulator path). M = N + 29 (never equal to N).
SHAPES_F32 = [(n, d) for n in (1, 3, 97, 100, 130) for d in (1, 3, 100, 300)]
SHAPES_LOWP = [(1, 300), (3, 1), (97, 100), (130, 3)]


def _check_ragged(name: str, n: int, d: int, dtype: torch.dtype) -> None:
    case = CASE_BY_NAME[name]
    if d > 1:
        c = compare(case, n, d, dtype, "triton", canary=True)
        assert c.ok, c
        return
    # D = 1: every normalised row is +-1, so the embedding gradients are exactly 0 and only rounding
    # noise is left, of order eps * |dL/dx_hat| / ||x||: bound it by 1e-5 * s / min |x| instead of the
    # relative rule (the loss and the temperature gradient still go through THE rule)
    tensors, kwargs = case.build(n, d, torch.Generator().manual_seed(0))
    loss, grads = run(case, (tensors, kwargs), "triton", dtype, canary=True)
    truth, _ = run(case, ({k: v.to(dtype).double() for k, v in tensors.items()}, kwargs), "reference",
                   torch.float64)
    assert_close(loss, truth, atol=SLACK[dtype] * 10, rtol=SLACK[dtype] * 10, what="loss")
    s = 1 / float(tensors["temperature"])
    for k, v in tensors.items():
        if v.dim() > 0:
            bound = 1e-5 * s / float(v.abs().min())
            assert float(grads[k].abs().max()) <= bound, (k, float(grads[k].abs().max()), bound)


@pytest.mark.parametrize("n,d", SHAPES_F32)
def test_ragged_shapes_fp32(n, d):
    _check_ragged("info_nce_none" if (n + d) % 2 == 0 else "info_nce_target", n, d, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n,d", SHAPES_LOWP)
def test_ragged_shapes_low_precision(n, d, dtype):
    _check_ragged("info_nce_none", n, d, dtype)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _labels(n, k, seed=1):
    return torch.randint(0, k, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("d", [20, 300])
def test_normalize_false_and_clamped_rows(d):
    # raw dot products (no normalisation), both accumulator paths (D = 20 and 300) ...
    q, k = _rand(40, d) * 0.2, _rand(50, d, seed=1) * 0.2
    tgt = _labels(40, 50)
    kw = dict(temperature=0.5 * d / 20, normalize=False)
    for x in ((q, k),):
        got = fc.info_nce(*x, tgt, backend="triton", **kw)
        want = fc.info_nce(*(v.double() for v in x), tgt, backend="reference", **kw)
        assert_close(got, want, atol=1e-5, rtol=1e-5, what="normalize=False")
    # ... and rows whose norm is clamped to eps: a zero row and a tiny non-zero one (its gradient is
    # g / eps, without the projection term)
    q2, k2 = _rand(40, d), _rand(50, d, seed=1)
    q2[7], q2[8], k2[9] = 0, 4e-14, 4e-14
    grads = []
    for be, dt in (("triton", torch.float32), ("reference", torch.float64)):
        a, b = q2.detach().to(dt).clone().requires_grad_(), k2.detach().to(dt).clone().requires_grad_()
        fc.info_nce(a, b, tgt, temperature=0.5, backend=be).backward()
        grads.append((a.grad, b.grad))
    for g, w in zip(*grads, strict=True):
        assert_close(g, w, atol=1e-5 * float(w.abs().max()), what="clamped rows")


def test_column_partials_several_row_blocks_per_program(monkeypatch, route):
    # one forward program walks all row blocks of CLIP, merging its column partials in place
    route(COL_PARTIAL_PROGRAMS=1)
    c = compare(CASE_BY_NAME["clip_scale"], 130, 300, torch.float32, "triton", canary=True)
    assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name,key", [("info_nce", "fwd_wide"), ("simcse", "fwd_wide"), ("info_nce_none", "fwd_wide"),
                                      ("clip_scale", "fwd"), ("simcse_sup_hard", "fwd")])
def test_sm90_forward_tiles(monkeypatch, name, key, dtype):
    # the interpreter runs the sm_80 table; here the sm_90 one, whose row-statistics forward takes
    # 128 x 256 tiles for D > 128 ("fwd_wide"): 200 rows (a ragged second row block) against ragged
    # columns, D = 300 (five 64-wide chunks, a masked tail), against float64
    from fused_contrastive.core.triton_shared.configs import CONFIGS, DTYPE_NAMES

    monkeypatch.setattr(TL, "_arch", lambda dev: "sm90")
    seen = []
    launch = TL._launch

    def spy(l):
        seen.append(l)
        return launch(l)

    monkeypatch.setattr(TL, "_launch", spy)
    c = compare(CASE_BY_NAME[name], 200, 300, dtype, "triton", canary=True)
    assert c.ok, c
    cfg = CONFIGS[(key, "sm90", DTYPE_NAMES[dtype], "big")]
    fwd = [l for l in seen if l.name == "lse_fwd"]
    # (with the target split, SPLIT_T, at most SPLIT_FWD_MAX_WARPS warps: its 16-warp tile spilled; with the
    # column term too, at most SPLIT_COL_MAX_BLOCK_N_SM90 columns: its 128 x 128 tile spilled)
    from fused_contrastive.core.lse.triton_fused import SPLIT_COL_MAX_BLOCK_N_SM90, SPLIT_FWD_MAX_WARPS

    def want(l):
        if not l.constexprs["SPLIT_T"]:
            return cfg.block_m, cfg.block_n, cfg.num_warps
        bn = min(cfg.block_n, SPLIT_COL_MAX_BLOCK_N_SM90) if l.constexprs["WANT_COL"] else cfg.block_n
        return cfg.block_m, bn, min(cfg.num_warps, SPLIT_FWD_MAX_WARPS)

    assert fwd and all((l.constexprs["BLOCK_M"], l.constexprs["BLOCK_N"], l.num_warps) == want(l) for l in fwd)
    if key == "fwd_wide":  # the wide tile is what this test is for
        assert all(l.constexprs["BLOCK_N"] == 256 for l in fwd)


# 3. The core op directly


@pytest.mark.parametrize("reduce", [True, False])
def test_core_matches_the_chunked_path(reduce):
    """Every log-sum-exp term with mixed coefficients, an offset, a bias column, label positives."""
    a, b = _rand(100, 30), _rand(70, 30, seed=1)
    s = torch.tensor(10.0)
    lab_a, lab_b = _labels(100, 3), _labels(70, 3, seed=2)
    spec = CoreSpec(exclude_self=True, offset=5, bias=0.3)
    data = CoreData(row_labels=lab_a, col_labels=lab_b, bias_col=_labels(100, 70, seed=4))
    coef = Coeffs(lse=_rand(100, seed=5).abs(), pos=-0.5, col=_rand(70, seed=6).abs() if reduce else None)
    got = triton_function.core(a, b, s, spec, data, coef, reduce)
    want = torch_chunked.core(a.double(), b.double(), s.double(), spec, data, coef, reduce)
    assert_close(got, want, atol=2e-5, rtol=2e-5, what="core")


def test_all_excluded_row_keeps_minus_inf_and_zero_grad():
    # N = 1 with A as B and the self column excluded: no column left, LSE = -inf, no NaN anywhere
    a = _rand(1, 5).requires_grad_()
    s = torch.tensor(3.0, requires_grad=True)
    lse = triton_function.TritonCoreFn.apply(a, None, s, CoreSpec(exclude_self=True), CoreData(), Coeffs(lse=1.0),
                                            False)
    assert lse.item() == float("-inf")
    ga, gs = torch.autograd.grad(lse, (a, s), grad_outputs=torch.ones_like(lse))
    assert torch.equal(ga, torch.zeros_like(ga)) and gs.item() == 0.0


@pytest.mark.parametrize("kind", ["labels", "mask"])
def test_zero_positive_rows(kind):
    # SupCon L_in rows without positives: LSEpos = -inf; a zero coefficient drops them and the backward
    # zeroes their upstream gradient: no NaN, and the torch_chunked path agrees
    lab = torch.arange(20) // 2
    lab[:6] = torch.arange(100, 106)  # rows 0..5 have no positive
    data = CoreData(row_labels=lab, col_labels=lab) if kind == "labels" else \
        CoreData(pos_mask=(lab[:, None] == lab[None, :]).float())
    hp = (lab < 100).float()
    res = []
    for impl, dt in ((triton_function, torch.float32), (torch_chunked, torch.float64)):
        a = _rand(20, 8).to(dt).requires_grad_()
        s = torch.tensor(5.0, dtype=dt, requires_grad=True)
        out = impl.core(a, None, s, CoreSpec(exclude_self=True), data, Coeffs(lse=hp, pos=-hp), False)
        res.append((out, *torch.autograd.grad(out.sum(), (a, s))))
    for x, y in zip(*res, strict=True):
        assert torch.isfinite(x).all()
        assert_close(x, y, atol=1e-5, rtol=1e-5, what="zero-positive rows")


@pytest.mark.parametrize("where", ["anchor", "key"])
def test_nan_input_gives_nan(where):
    q, k = _rand(50, 40), _rand(60, 40, seed=1)
    (q if where == "anchor" else k)[7, 3] = float("nan")
    out = fc.info_nce(q, k, _labels(50, 60), reduction="none", backend="triton")
    ref = fc.info_nce(q, k, _labels(50, 60), reduction="none", backend="reference")
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (torch.isnan(out).nonzero(), torch.isnan(ref).nonzero())
    assert torch.isnan(out).any()
    # the masked self column of A-is-B must not hide a NaN either
    z = _rand(64, 40)
    z[10, 0] = float("nan")
    assert torch.isnan(fc.simcse_loss(z, backend="triton"))


def test_huge_finite_rows():
    # the prologue's scaled sum of squares and the normalised copies: rows of norm ~1e31 are finite
    q, k = _rand(100, 64) * 1e30, _rand(100, 64, seed=1) * 1e30
    got = fc.info_nce(q, k, backend="triton")
    want = fc.info_nce(q.double() / 1e30, k.double() / 1e30, backend="reference")
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="1e30 rows")


@pytest.mark.parametrize("case", ["clip_scale", "info_nce_self_none", "supcon_mask_in", "dscl_queue"])
def test_backward_is_bitwise_deterministic(case):
    c = CASE_BY_NAME[case]
    tensors, kwargs = c.build(100, 300, torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        x = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        out = c.fn(**x, **kwargs, backend="triton")
        runs.append((out, torch.autograd.grad(out.sum(), list(x.values()))))
    assert torch.equal(runs[0][0], runs[1][0])
    for g0, g1 in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(g0, g1)


def test_grad_is_none_for_inputs_without_grad():
    q = _rand(30, 16).requires_grad_()
    k = _rand(40, 16, seed=1)
    t = torch.tensor(0.1)  # a tensor temperature that does not require grad
    fc.info_nce(q, k, _labels(30, 40), temperature=t, backend="triton").backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert k.grad is None and t.grad is None
    # only the keys require grad
    q2, k2 = _rand(30, 16), _rand(40, 16, seed=1).requires_grad_()
    t2 = torch.tensor(0.1, requires_grad=True)
    fc.info_nce(q2, k2, _labels(30, 40), temperature=t2, backend="triton").backward()
    assert q2.grad is None and k2.grad is not None and t2.grad is not None
    # supcon with a queue: the queue never gets a gradient
    f, queue = _rand(10, 2, 16).requires_grad_(), _rand(12, 16, seed=3).requires_grad_()
    fc.supcon_loss(f, _labels(10, 3), queue=queue, queue_labels=_labels(12, 3), backend="triton").backward()
    assert queue.grad is None and f.grad is not None


def test_small_problems_take_the_dense_path(monkeypatch, route):
    """With the dense path on (the default), a problem that fits the tile budget runs one tile on the
    triton backend too: no kernel is launched."""
    route(DENSE="1")

    def no_launch(_):
        raise AssertionError("a kernel was launched for a problem that fits the tile budget")

    monkeypatch.setattr(TL, "_launch", no_launch)
    q, k = _rand(30, 16).requires_grad_(), _rand(40, 16, seed=1).requires_grad_()
    got = fc.info_nce(q, k, _labels(30, 40), backend="triton")
    got.backward()
    want = fc.info_nce(q, k, _labels(30, 40), backend="reference")
    assert_close(got, want, atol=1e-5, what="dense on triton")


def test_float64_is_rejected():
    q = _rand(4, 8).double()
    with pytest.raises(TypeError, match="float64"):
        fc.info_nce(q, q.clone(), backend="triton")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=180, check=False)


def test_cpu_without_interpreter_is_a_value_error():
    r = _run("""
        import torch, fused_contrastive as fc
        from fused_contrastive.core.triton_shared import launch as TL  # importing touches no GPU driver
        try:
            fc.info_nce(torch.randn(4, 8), torch.randn(5, 8), backend="triton")
        except ValueError as e:
            assert "backend" in str(e) and "TRITON_INTERPRET" in str(e), e
        else:
            raise AssertionError("no error")
        print("OK")
        """, TRITON_INTERPRET="0")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


def test_broken_kernels_are_loud_not_a_silent_fallback():
    """triton installed but the kernels module failing to import: an explicit triton backend raises an
    ImportError that says so (and "auto" on a GPU would too) instead of quietly running another backend."""
    r = _run("""
        import sys
        sys.modules["fused_contrastive.kernels.lse"] = None  # what a broken install looks like
        import torch, fused_contrastive as fc
        from fused_contrastive._backend import triton_status
        st = triton_status()
        assert st.installed and st.error, st
        try:
            fc.info_nce(torch.randn(4, 8), torch.randn(5, 8), backend="triton")
        except ImportError as e:
            assert "kernels do not import" in str(e), e
        else:
            raise AssertionError("no error")
        print("OK")
        """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


# Degenerate rows (zero, norm below eps, duplicated) planted in every case the kernels run, float32,
# under THE rule as in test_properties (gradients in the sphere's coordinates).
@pytest.mark.parametrize("case", [c for c in CASES if c.has_triton], ids=lambda c: c.name)
def test_degenerate_rows_match_the_reference(case):
    from test_properties import check_degenerate

    check_degenerate(case, 13, 8, 5, ["zero", "tiny", "dup", "dup"], torch.float32, "triton")
