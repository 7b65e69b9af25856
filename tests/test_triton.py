"""backend="triton" against the reference backend, under the Triton CPU interpreter.

conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the kernels of
``fused_contrastive.kernels.lse`` run on CPU tensors (slowly: shapes stay <= 256 rows).

Accuracy rule: for every output (the loss, the gradient of every embedding and of a tensor
temperature) the triton error against a float64 ground truth (the reference backend on the same
values in float64) may not exceed twice the error of PyTorch computing the same loss in the input
dtype (the reference backend with its compute dtype forced to that dtype), plus a small slack.

Every launch runs with its outputs poisoned with NaN (``_triton_core.POISON_OUTPUTS``) and every
input is a view into a NaN-padded buffer (rows past N and columns past D are NaN), so an unwritten
output element or an out-of-bounds read turns into a NaN and fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from typing import Callable, Dict, Optional

import pytest
import torch
from helpers import assert_close

import fused_contrastive as fc
from fused_contrastive import _reference
from fused_contrastive._cases import CASES as REGISTRY
from fused_contrastive._cases import compare
from fused_contrastive._spec import CoreSpec, CoreTensors

_triton_core = pytest.importorskip("fused_contrastive._triton_core")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SLACK = 1e-5  # relative; fp32 errors here are ~1e-7, a masking or indexing bug is >= 1e-3


@pytest.fixture(autouse=True)
def _poison_and_quiet(monkeypatch):
    """Poison every kernel output; silence numpy's overflow / log(0) warnings of the interpreter."""
    monkeypatch.setattr(_triton_core, "POISON_OUTPUTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_interpreter_is_on():
    # the whole module is meaningless if the kernels are compiled for a GPU that is not there
    assert _triton_core._interpreted()
    assert _triton_core._upcast(torch.bfloat16) and not _triton_core._upcast(torch.float16)


# ------------------------------------------------------------------------------------------------
# helpers: canary inputs, ground truth, the one assert helper
# ------------------------------------------------------------------------------------------------


def canary(x: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    """``x`` as a leaf view into a NaN-filled buffer with 5 extra rows and 7 extra columns."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    buf = torch.full((flat.shape[0] + 5, flat.shape[1] + 7), float("nan"), dtype=x.dtype)
    buf[: flat.shape[0], : flat.shape[1]] = flat
    view = buf[: flat.shape[0], : flat.shape[1]].unflatten(0, lead)  # row stride D + 7
    return view.detach().requires_grad_(requires_grad)


def _max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the finite entries of ``want`` (matching infinities count 0)."""
    got, want = got.detach().double(), want.detach().double()
    fin = torch.isfinite(want)
    return float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0


def assert_as_accurate(name: str, got, torch_same, truth, slack: float = SLACK):
    """Triton's error vs float64 <= 2 x PyTorch's same-dtype error + slack x max |truth|, checked
    elementwise by the shared ``helpers.assert_close`` (it names the worst index)."""
    assert got is not None and truth is not None, f"{name}: missing gradient"
    fin = truth.detach()[torch.isfinite(truth.detach())]
    scale = float(fin.abs().max()) if fin.numel() else 1.0
    e_pt = _max_abs_err(torch_same, truth) if torch_same is not None else 0.0
    assert_close(got, truth, atol=2 * e_pt + slack * max(scale, 1e-30),
                 what=f"{name} (PyTorch same-dtype error {e_pt:.3g})")


def _same_dtype_reference(monkeypatch, dtype):
    """Make the reference backend compute in ``dtype`` (PyTorch's own error in that dtype)."""
    monkeypatch.setattr(_reference, "_dt", lambda *xs: dtype)


def evaluate(fn: Callable, inputs: Dict[str, torch.Tensor], temp: Optional[torch.Tensor], backend: str,
             dtype=None, weights: Optional[torch.Tensor] = None):
    """Run fn(backend, **inputs, temp) -> loss; return (loss, {name: grad}) for inputs needing grad.

    ``dtype`` casts the floating inputs (None keeps them); the temperature follows float64 when the
    inputs are float64.
    """
    xs = {}
    for k, v in inputs.items():
        if v.is_floating_point():
            c = v.detach().to(dtype) if dtype is not None else v
            xs[k] = c.requires_grad_(v.requires_grad) if dtype is not None else c
        else:
            xs[k] = v
    tt = None
    if temp is not None:
        tt = temp.detach().to(torch.float64 if dtype == torch.float64 else temp.dtype).requires_grad_(
            temp.requires_grad)
    out = fn(backend, tt, **xs)
    w = weights if weights is not None else torch.ones(out.shape, dtype=torch.float64)
    leaves = {k: v for k, v in xs.items() if v.is_floating_point() and v.requires_grad}
    if tt is not None and tt.requires_grad:
        leaves["temperature"] = tt
    grads = torch.autograd.grad((out * w.to(out.dtype)).sum(), list(leaves.values()), allow_unused=True)
    return out, dict(zip(leaves, grads))


def check_loss(monkeypatch, fn, inputs, temp, dtype, reduction_none: bool, zero_grad_atol: Optional[float] = None):
    """Compare triton, the same-dtype PyTorch run and the float64 truth for one loss call.

    ``zero_grad_atol``: the embedding gradients are exactly 0 (D = 1: a normalised 1-D row is +-1),
    so only rounding noise is left; check |grad| <= atol instead of a relative error.
    """
    lowp = {k: (canary(v.to(dtype)) if v.is_floating_point() else v) for k, v in inputs.items()}
    weights = None
    if reduction_none:  # per-row losses: a random upstream gradient (the vector-mode backward)
        shape = fn("reference", temp.detach(), **{k: v.detach() for k, v in lowp.items()}).shape
        weights = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out_tri, g_tri = evaluate(fn, lowp, temp, "triton", weights=weights)
    out_64, g_64 = evaluate(fn, lowp, temp, "reference", dtype=torch.float64, weights=weights)
    with monkeypatch.context() as m:
        _same_dtype_reference(m, dtype)
        out_pt, g_pt = evaluate(fn, lowp, temp, "reference", dtype=dtype, weights=weights)
    assert out_tri.dtype == torch.float32
    assert_as_accurate("loss", out_tri, out_pt, out_64)
    assert set(g_tri) == set(g_64) == {*(k for k, v in inputs.items() if v.is_floating_point()), "temperature"}
    for k in g_64:
        if k != "temperature":
            assert g_tri[k] is not None and g_tri[k].dtype == dtype, f"grad of {k}: dtype {g_tri[k].dtype}"
            if zero_grad_atol is not None:
                # the noise is ~ rounding x |dL/dx_hat| / ||x||: bound it relative to s / min ||x||
                worst = g_tri[k].abs().max().item()
                bound = zero_grad_atol / temp.item() / inputs[k].abs().min().item()
                assert worst <= bound, f"grad {k}: {worst:.3e} should be 0 up to rounding ({bound:.1e})"
                continue
        assert_as_accurate(f"grad {k}", g_tri[k], g_pt[k], g_64[k])


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def temperature(t=0.07):
    return torch.tensor(t, requires_grad=True)


# ------------------------------------------------------------------------------------------------
# 1. every loss, every dtype
# ------------------------------------------------------------------------------------------------

# 1a. The project's shared case registry (the cases of ``python -m fused_contrastive check``), with
# its own accuracy rule (``_cases.compare``): every InfoNCE-family case, each dtype, one ragged shape
# per (case, dtype) rotating through: 97 x 100 (prime rows, resident D), 130 x 300 (rows past a
# 128-block, D streamed in 64-wide chunks), 100 x 3 (a tiny, padded D).
INFONCE_CASES = [c for c in REGISTRY if c.infonce_family]
ROTATION = [(97, 100), (130, 300), (100, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", INFONCE_CASES, ids=[c.name for c in INFONCE_CASES])
def test_registry_case_matches_reference(case, dtype):
    n, d = ROTATION[(INFONCE_CASES.index(case) + DTYPES.index(dtype)) % len(ROTATION)]
    c = compare(case, n, d, dtype, "triton")
    assert c.ok, (n, d, c)


# 1b. Cases of this file: every loss variant, inputs as views into NaN-padded buffers, the same-dtype
# error measured with PyTorch really computing in that dtype.

# Each case: (id, builder) with builder() -> (fn(backend, temp, **tensors), tensors, reduction_none).
# Shapes are ragged on purpose: 97 / 130 rows straddle the 64- and 128-row blocks, 100 / 300 columns
# D straddle the 64-wide D chunks (300 takes the scratch-accumulator path, 100 the resident one).


def _labels(n, k, seed=1):
    return torch.randint(0, k, (n,), generator=torch.Generator().manual_seed(seed))


def _case_info_nce_keys():
    tgt = _labels(97, 130)
    tgt[5] = -100  # an ignored row leaves the mean
    fn = lambda be, T, q, k: fc.info_nce(q, k, tgt, temperature=T, backend=be)
    return fn, dict(q=rand(97, 100), k=rand(130, 100, seed=1)), False


def _case_info_nce_self():
    # keys=None: A is B (symmetric backward), self excluded, target the next row
    tgt = (torch.arange(130) + 1) % 130
    fn = lambda be, T, q: fc.info_nce(q, None, tgt, temperature=T, reduction="none", backend=be)
    return fn, dict(q=rand(130, 300)), True


def _case_simcse_interleaved():
    fn = lambda be, T, z: fc.simcse_loss(z, temperature=T, backend=be)
    return fn, dict(z=rand(100, 300)), False


def _case_simcse_two_view():
    fn = lambda be, T, z1, z2: fc.simcse_loss(z1, z2, temperature=T, reduction="none", backend=be)
    return fn, dict(z1=rand(97, 100), z2=rand(97, 100, seed=1)), True


def _case_simcse_sup():
    # hard negatives: the bias column N + i (one logit per row shifted by the weight)
    fn = lambda be, T, a, p, n: fc.simcse_sup_loss(a, p, n, temperature=T, hard_negative_weight=0.7,
                                                    backend=be)
    return fn, dict(a=rand(97, 100), p=rand(97, 100, seed=1), n=rand(97, 100, seed=2)), False


def _case_simcse_sup_interleaved():
    fn = lambda be, T, x: fc.simcse_sup_loss(x, temperature=T, hard_negative_weight=-0.3,
                                             reduction="none", backend=be)
    return fn, dict(x=rand(3 * 33, 3)), True


def _case_clip():
    # row and column LSE from one pass (column partials merged across programs)
    fn = lambda be, T, x, y: fc.clip_loss(x, y, 1.0 / T, backend=be)
    return fn, dict(x=rand(130, 300), y=rand(130, 300, seed=1)), False


def _case_clip_none():
    fn = lambda be, T, x, y: fc.clip_loss(x, y, 1.0 / T, reduction="none", backend=be)
    return fn, dict(x=rand(100, 100), y=rand(100, 100, seed=1)), True


def _case_clip_self():
    # CLIP-style symmetric loss of A against itself: the symmetric backward with a column LSE. The
    # diagonal (cosine 1) is every row's target: a temperature of 0.49 keeps the per-row losses O(1)
    # (at 0.07 they are ~1e-4 = LSE - l_ii, pure cancellation, for every backend)
    fn = lambda be, T, x: fc.info_nce(x, None, symmetric=True, exclude_self=False, temperature=7 * T,
                                      reduction="none", backend=be)
    return fn, dict(x=rand(97, 300)), True


def _supcon(variant, kind, red="mean", mode="all"):
    bsz, views, d = 33, 3, 100
    lab = _labels(bsz, 4)
    mask = (torch.rand(bsz, bsz, generator=torch.Generator().manual_seed(3)) > 0.6).float()
    mask.fill_diagonal_(1)  # every anchor has its other views as positives ...
    if variant == "out":
        # ... but one: a zero-positive anchor contributes 0. (Not for L_in: the reference backend's
        # gradient is NaN there, 0 * d logsumexp(-inf row); the core-level test below covers L_in.)
        mask[0] = 0
    queue, qlab = rand(40, d, seed=5), _labels(40, 4, seed=6)

    def fn(be, T, f):
        kw = dict(temperature=T, variant=variant, reduction=red, contrast_mode=mode, backend=be)
        if kind == "labels":
            return fc.supcon_loss(f, lab, **kw)
        if kind == "mask":
            return fc.supcon_loss(f, mask=mask, **kw)
        if kind == "queue":
            return fc.supcon_loss(f, lab, queue=queue, queue_labels=qlab, **kw)
        return fc.supcon_loss(f, **kw)  # SimCLR

    return lambda: (fn, dict(f=rand(bsz, views, d)), red == "none")


def _case_dscl(queue: bool):
    def build():
        lab = _labels(45, 5)
        q, ql = rand(30, 300, seed=8), _labels(30, 5, seed=9)
        kw = dict(queue=q, queue_labels=ql) if queue else {}
        fn = lambda be, T, f: fc.dscl_loss(f, lab, temperature=T, backend=be, **kw)
        return fn, dict(f=rand(45, 2, 300)), False
    return build


CASES = {
    "info_nce-keys": _case_info_nce_keys,
    "info_nce-self-none": _case_info_nce_self,
    "simcse-interleaved": _case_simcse_interleaved,
    "simcse-two-view-none": _case_simcse_two_view,
    "simcse_sup": _case_simcse_sup,
    "simcse_sup-interleaved-none": _case_simcse_sup_interleaved,
    "clip": _case_clip,
    "clip-none": _case_clip_none,
    "clip-self-none": _case_clip_self,
    "supcon-out-labels": _supcon("out", "labels"),
    "supcon-in-labels-none": _supcon("in", "labels", "none"),
    "supcon-out-mask-none": _supcon("out", "mask", "none"),
    "supcon-in-mask": _supcon("in", "mask"),
    "supcon-in-queue": _supcon("in", "queue"),
    "supcon-out-queue-none": _supcon("out", "queue", "none"),
    "supcon-in-simclr-one": _supcon("in", "simclr", mode="one"),
    "dscl": _case_dscl(False),
    "dscl-queue": _case_dscl(True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_matches_reference(monkeypatch, case, dtype):
    fn, inputs, none = CASES[case]()
    check_loss(monkeypatch, fn, inputs, temperature(), dtype, none)


# ------------------------------------------------------------------------------------------------
# 2. ragged shapes of the core op (through info_nce, the plainest loss)
# ------------------------------------------------------------------------------------------------

# N: 1 and 3 (a single partial block), 97 / 100 / 130 (straddle 64- and 128-row blocks).
# D: 1 and 3 (one tiny chunk, padded to 16 for tl.dot), 100 (one resident chunk, masked tail),
#    300 (five 64-wide chunks, the streaming accumulator path). M = N + 29 (never equal to N).
SHAPES_F32 = [(n, d) for n in (1, 3, 97, 100, 130) for d in (1, 3, 100, 300)]
SHAPES_LOWP = [(1, 300), (3, 1), (97, 100), (130, 3)]


def _info_nce_case(n, d, none):
    m = n + 29
    tgt = _labels(n, m, seed=n + d)
    red = "none" if none else "mean"
    fn = lambda be, T, q, k: fc.info_nce(q, k, tgt, temperature=T, reduction=red, backend=be)
    return fn, dict(q=rand(n, d, seed=d), k=rand(m, d, seed=d + 1))


@pytest.mark.parametrize("n,d", SHAPES_F32)
def test_ragged_shapes_fp32(monkeypatch, n, d):
    none = (n + d) % 2 == 0  # alternate vector and weighted mode
    fn, inputs = _info_nce_case(n, d, none)
    check_loss(monkeypatch, fn, inputs, temperature(0.1), torch.float32, none, 1e-5 if d == 1 else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n,d", SHAPES_LOWP)
def test_ragged_shapes_low_precision(monkeypatch, n, d, dtype):
    fn, inputs = _info_nce_case(n, d, True)
    check_loss(monkeypatch, fn, inputs, temperature(0.1), dtype, True, 1e-5 if d == 1 else None)


@pytest.mark.parametrize("d", [20, 300])
def test_normalize_false_and_tiny_rows(monkeypatch, d):
    # raw dot products (no normalisation) ...
    q, k = rand(40, d) * 0.2, rand(50, d, seed=1) * 0.2
    fn = lambda be, T, q, k: fc.info_nce(q, k, _labels(40, 50), temperature=T, normalize=False,
                                         backend=be)
    check_loss(monkeypatch, fn, dict(q=q, k=k), temperature(0.5 * d / 20), torch.float32, False)
    # ... and rows whose norm is clamped to eps: a zero row, and a tiny non-zero one (its gradient
    # is g / eps, without the projection term), in both accumulator paths (D = 20 and 300)
    q2, k2 = rand(40, d), rand(50, d, seed=1)
    q2[7], q2[8], k2[9] = 0, 4e-14, 4e-14  # norms 1.8e-13 (D = 20) and 6.9e-13 (D = 300) < eps
    fn2 = lambda be, T, q, k: fc.info_nce(q, k, _labels(40, 50), temperature=T, backend=be)
    check_loss(monkeypatch, fn2, dict(q=q2, k=k2), temperature(0.5), torch.float32, False)


def test_column_partials_several_row_blocks_per_program(monkeypatch):
    # one forward program walks all row blocks of CLIP, merging its column partials in place
    monkeypatch.setattr(_triton_core, "COL_PARTIAL_PROGRAMS", 1)
    fn, inputs, _ = _case_clip()
    check_loss(monkeypatch, fn, inputs, temperature(), torch.float32, False)


# ------------------------------------------------------------------------------------------------
# 3. the core op directly: vector outputs, -inf rows, NaN, determinism, .grad
# ------------------------------------------------------------------------------------------------


def _core_both(a, b, s, spec, t):
    from fused_contrastive import _torch_core

    return _triton_core.core(a, b, s, spec, t), _torch_core.core(a, b, s, spec, t)


def test_core_vector_outputs_match_torch_core():
    a, b = canary(rand(100, 30)), canary(rand(70, 30, seed=1))
    s = torch.tensor(10.0)
    lab_a, lab_b = _labels(100, 3), _labels(70, 3, seed=2)
    spec = CoreSpec(want_col=True, want_pos=True, exclude_self=True, offset=5, bias=0.3)
    t = CoreTensors(row_labels=lab_a, col_labels=lab_b, bias_col=_labels(100, 70, seed=4))
    (l1, c1, p1), (l2, c2, p2) = _core_both(a, b, s, spec, t)
    for name, x, y in (("LSE", l1, l2), ("LSEcol", c1, c2), ("LSEpos", p1, p2)):
        assert_as_accurate(name, x, None, y, slack=2e-6)


def test_all_excluded_row_keeps_minus_inf_and_zero_grad():
    # N = 1 with A as B and the self column excluded: no column left, LSE = -inf, no NaN anywhere
    a = canary(rand(1, 5))
    s = torch.tensor(3.0, requires_grad=True)
    (lse, _, _), (ref, _, _) = _core_both(a, None, s, CoreSpec(exclude_self=True, same=True), CoreTensors())
    assert lse.item() == float("-inf") and ref.item() == float("-inf")
    ga, gs = torch.autograd.grad(lse, (a, s), grad_outputs=torch.ones_like(lse))
    assert torch.equal(ga, torch.zeros_like(ga)) and gs.item() == 0.0


@pytest.mark.parametrize("kind", ["labels", "mask"])
def test_zero_positive_rows(kind):
    # SupCon L_in rows without positives: LSEpos = -inf; weighted mode drops them (weight 0) and the
    # vector backward zeroes their upstream gradient: no NaN, and the torch core agrees
    from fused_contrastive import _torch_core

    lab = torch.arange(20) // 2
    lab[:6] = torch.arange(100, 106)  # rows 0..5 have no positive
    mask = (lab[:, None] == lab[None, :]).float()
    for weighted in (False, True):
        res = []
        for impl in (_triton_core, _torch_core):
            a = canary(rand(20, 8))
            s = torch.tensor(5.0, requires_grad=True)
            spec = CoreSpec(exclude_self=True, same=True, want_pos=True)
            t = CoreTensors(row_labels=lab, col_labels=lab) if kind == "labels" else CoreTensors(pos_mask=mask)
            if weighted:
                t.w_row, t.w_pos = torch.ones(20), (lab < 100).float()
                out = impl.core(a, None, s, spec, t)
                total = out
            else:
                out = impl.core(a, None, s, spec, t)[2]
                total = torch.where(torch.isinf(out), 0.0, out).sum()
            res.append((out, *torch.autograd.grad(total, (a, s))))
        for x, y in zip(*res):
            assert torch.isfinite(y).all() or torch.isinf(y).any()
            assert torch.isfinite(x).all() or torch.equal(torch.isinf(x), torch.isinf(y))
            assert_as_accurate("zero-positive rows", x, None, y, slack=2e-6)


@pytest.mark.parametrize("where", ["anchor", "key"])
def test_nan_input_gives_nan(where):
    q, k = rand(50, 40), rand(60, 40, seed=1)
    (q if where == "anchor" else k)[7, 3] = float("nan")
    q, k = canary(q), canary(k)
    out = fc.info_nce(q, k, _labels(50, 60), reduction="none", backend="triton")
    ref = fc.info_nce(q, k, _labels(50, 60), reduction="none", backend="reference")
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (torch.isnan(out).nonzero(), torch.isnan(ref).nonzero())
    assert torch.isnan(out).any()
    # the masked self column of A-is-B must not hide a NaN either
    z = rand(64, 40)
    z[10, 0] = float("nan")
    loss = fc.simcse_loss(canary(z), backend="triton")
    assert torch.isnan(loss)


@pytest.mark.parametrize("case", ["clip", "info_nce-self-none", "supcon-in-mask", "dscl-queue"])
def test_backward_is_bitwise_deterministic(case):
    fn, inputs, _ = CASES[case]()
    runs = []
    for _ in range(2):
        xs = {k: canary(v) for k, v in inputs.items()}
        T = temperature()
        out = fn("triton", T, **xs)
        grads = torch.autograd.grad(out.sum(), [*xs.values(), T])
        runs.append((out, grads))
    assert torch.equal(runs[0][0], runs[1][0])
    for g0, g1 in zip(runs[0][1], runs[1][1]):
        assert torch.equal(g0, g1)


def test_grad_is_none_for_inputs_without_grad():
    q = canary(rand(30, 16))
    k = canary(rand(40, 16, seed=1), requires_grad=False)
    T = torch.tensor(0.1)  # a tensor temperature that does not require grad
    fc.info_nce(q, k, _labels(30, 40), temperature=T, backend="triton").backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert k.grad is None and T.grad is None
    # only the keys require grad (the dA kernel then only runs for nothing: it is skipped)
    q2 = canary(rand(30, 16), requires_grad=False)
    k2 = canary(rand(40, 16, seed=1))
    T2 = torch.tensor(0.1, requires_grad=True)
    fc.info_nce(q2, k2, _labels(30, 40), temperature=T2, backend="triton").backward()
    assert q2.grad is None and k2.grad is not None and T2.grad is not None
    # supcon with a queue: the queue never gets a gradient
    f = canary(rand(10, 2, 16))
    queue = canary(rand(12, 16, seed=3))
    fc.supcon_loss(f, _labels(10, 3), queue=queue, queue_labels=_labels(12, 3), backend="triton").backward()
    assert queue.grad is None and f.grad is not None


def test_float64_is_rejected():
    q = rand(4, 8).double()
    with pytest.raises(TypeError, match="float64"):
        fc.info_nce(q, q.clone(), backend="triton")


def test_cpu_without_interpreter_raises():
    code = textwrap.dedent(
        """
        import torch, fused_contrastive as fc
        from fused_contrastive import _triton_core  # importing touches no GPU driver
        from fused_contrastive._spec import CoreSpec, CoreTensors
        for call in (lambda: fc.info_nce(torch.randn(4, 8), torch.randn(5, 8), backend="triton"),
                     lambda: _triton_core.core(torch.randn(4, 8), None, torch.tensor(2.0), CoreSpec(same=True),
                                               CoreTensors())):
            try:
                call()
            except RuntimeError as e:
                assert "TRITON_INTERPRET" in str(e), e
            else:
                raise AssertionError("no error")
        print("OK")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]
