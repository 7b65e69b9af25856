"""Every loss on the torch backend (both paths) against the float64 ground truth under THE accuracy
rule, over ragged shapes and dtypes, plus direct checks against the textbook formulas written here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from fused_contrastive.testing import CASE_BY_NAME, CASES, assert_close, compare, loss_and_grads, shapes_for

_GRID = [(c, n, d) for c in CASES for n, d in shapes_for(c)]


@pytest.mark.parametrize("case,n,d", _GRID, ids=[f"{c.name}-{n}x{d}" for c, n, d in _GRID])
def test_torch_matches_truth_float32(case, n, d, path):
    c = compare(case, n, d, torch.float32, "torch")
    assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_other_dtypes(case, dtype, path):
    """Half inputs: within PyTorch's own error in that dtype; float64: to round-off."""
    c = compare(case, 97, 64, dtype, "torch")
    assert c.ok, c


@pytest.mark.parametrize("name", [c.name for c in CASES if "gradcheck" in c.families])
def test_gradcheck_float64(name, path):
    """Analytic gradients (the torch_dense Function, the torch_chunked eager, symmetric and recompute passes)
    against finite differences, in float64."""
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(7, 4, torch.Generator().manual_seed(3))
    keys = list(tensors)
    inputs = tuple(tensors[k].double().requires_grad_() for k in keys)

    def f(*xs):
        return case.fn(**dict(zip(keys, xs, strict=True)), **kwargs, backend="torch")

    # nondet_tol: a second backward through the same graph takes the recompute path, which differs
    # from the eager gradients by rounding only
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, nondet_tol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("keys_none", [False, True])
def test_info_nce_is_cross_entropy(reduction, keys_none, path):
    """info_nce == F.cross_entropy(cos / t, target), the drop-in promise, written here directly."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(50, 16, generator=g)
    k = None if keys_none else torch.randn(40, 16, generator=g)
    m = 50 if keys_none else 40
    target = torch.randint(0, m, (50,), generator=g)
    if keys_none:
        target = torch.where(target == torch.arange(50), (target + 1) % 50, target)
    target[::7] = -1
    kk = q if keys_none else k
    cos = F.normalize(q, dim=1) @ F.normalize(kk, dim=1).T
    if keys_none:
        cos = cos.masked_fill(torch.eye(50, dtype=torch.bool), float("-inf"))
    want = F.cross_entropy(cos / 0.1, target, reduction=reduction, ignore_index=-1)
    got = fc.info_nce(q, k, target, temperature=0.1, reduction=reduction, ignore_index=-1, backend="torch")
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="loss")


def test_clip_reduction_none_is_mean_of_row_and_column_ce(path):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(9, 5, generator=g), torch.randn(9, 5, generator=g)
    logits = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T * 10.0
    t = torch.arange(9)
    want = (F.cross_entropy(logits, t, reduction="none") + F.cross_entropy(logits.T, t, reduction="none")) / 2
    assert_close(fc.clip_loss(a, b, 10.0, reduction="none", backend="torch"), want, atol=1e-5, what="per-pair clip")


def test_non_contiguous_inputs(path):
    g = torch.Generator().manual_seed(2)
    big = torch.randn(40, 64, generator=g)
    q, k = big[::2, ::2], big[1::2, 1::2]  # strided rows and columns
    assert not q.is_contiguous()
    got, gg = loss_and_grads(fc.info_nce, {"query": q, "keys": k}, "torch")
    want, gw = loss_and_grads(fc.info_nce, {"query": q.contiguous(), "keys": k.contiguous()}, "reference")
    assert_close(got, want, atol=1e-5, what="loss")
    for name in gg:
        assert_close(gg[name], gw[name], atol=1e-5, what=name)
    feats = torch.randn(8, 3, 10, generator=g).transpose(0, 1).contiguous().transpose(0, 1)
    assert not feats.is_contiguous()
    lab = torch.randint(0, 3, (8,), generator=g)
    got, gg = loss_and_grads(fc.supcon_loss, {"features": feats}, "torch", labels=lab)
    want, gw = loss_and_grads(fc.supcon_loss, {"features": feats.contiguous()}, "reference", labels=lab)
    assert_close(got, want, atol=1e-5, what="supcon loss")
    assert_close(gg["features"], gw["features"], atol=1e-5, what="supcon grad")


@pytest.mark.parametrize("name", [c.name for c in CASES if "degenerate_rows" in c.families])
def test_zero_vectors_and_duplicate_rows(name, path):
    """Zero rows normalise to 0 (cosine 0, like F.normalize); duplicated rows are ordinary rows."""
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(12, 8, torch.Generator().manual_seed(4))
    for k, v in tensors.items():
        if v.dim() >= 2:
            v = v.clone()
            v[0] = 0
            v[2] = v[1]
            tensors[k] = v
    got, gg = loss_and_grads(case.fn, tensors, "torch", **kwargs)
    want, gw = loss_and_grads(case.fn, tensors, "reference", **kwargs)
    assert torch.isfinite(got).all()
    assert_close(got, want, atol=1e-4, rtol=1e-5, what="loss")
    for k in gg:
        if gg[k] is not None:
            assert torch.isfinite(gg[k]).all(), k
            assert_close(gg[k], gw[k], atol=1e-4, rtol=1e-4, what=k)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_nan_input_gives_nan_loss(backend, path):
    q = torch.randn(10, 4)
    q[3, 1] = float("nan")
    assert torch.isnan(fc.info_nce(q, torch.randn(10, 4), backend=backend))
    assert torch.isnan(fc.simcse_loss(q, backend=backend))
    f = torch.randn(5, 2, 4)
    f[4, 1, 0] = float("nan")
    assert torch.isnan(fc.supcon_loss(f, torch.tensor([0, 0, 1, 1, 2]), variant="in", backend=backend))
    assert torch.isnan(fc.dscl_loss(f, torch.tensor([0, 0, 1, 1, 2]), backend=backend))
    assert torch.isnan(fc.cosent_loss_from_scores(torch.tensor([0.1, float("nan"), 0.3]),
                                                  torch.tensor([0.0, 1.0, 2.0]), backend=backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("name", [c.name for c in CASES if "huge_rows" in c.families])
def test_huge_finite_rows_give_the_finite_answer(name, dtype, backend, path):
    """Rows whose squared norm overflows the dtype (norms ~1e30 in float32 / bfloat16, ~1e200 in
    float64) are finite inputs. Normalised losses do not depend on the rows' scale, so the answer is
    the float64 loss of the same rows scaled back down (the old paths gave NaN or cosines of 0)."""
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(50, 32, torch.Generator().manual_seed(5))
    big = 1e200 if dtype == torch.float64 else 1e30
    huge = {k: (v.double() * big).to(dtype) if v.dim() > 1 else v for k, v in tensors.items()}
    small = {k: (v.double() / big if v.dim() > 1 else v.double()) for k, v in huge.items()}
    got = case.fn(**huge, **kwargs, backend=backend)
    want = case.fn(**small, **kwargs, backend="reference")
    assert torch.isfinite(got).all(), got
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert_close(got, want, atol=tol, rtol=tol, what=f"{name} {dtype} {backend}")


def test_python_temperature_is_exact_in_float64(path):
    """A Python-number temperature is not rounded to float32 when the inputs are float64 (the old
    path was off by 4e-7 at scale 33.3): the loss equals the float64 formula to round-off."""
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(64, 32, generator=g, dtype=torch.float64), torch.randn(64, 32, generator=g, dtype=torch.float64)
    t = 0.03
    want = F.cross_entropy(F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / t, torch.arange(64))
    for be in ("torch", "reference"):
        assert_close(fc.info_nce(q, k, temperature=t, backend=be), want, atol=1e-13, rtol=1e-13, what=be)
        assert_close(fc.clip_loss(q, k, 1 / t, backend=be) * 2 - fc.info_nce(k, q, temperature=t, backend=be),
                     want, atol=1e-12, rtol=1e-12, what=f"clip {be}")


def test_grad_is_none_for_inputs_not_requiring_grad(path):
    q = torch.randn(10, 4, requires_grad=True)
    k = torch.randn(10, 4)
    t = torch.tensor(0.1)
    fc.info_nce(q, k, temperature=t, backend="torch").backward()
    assert q.grad is not None and k.grad is None and t.grad is None
    feats = torch.randn(5, 2, 4)
    t2 = torch.tensor(0.1, requires_grad=True)
    fc.supcon_loss(feats, torch.tensor([0, 0, 1, 1, 2]), temperature=t2, backend="torch").backward()
    assert t2.grad is not None and feats.grad is None
    bt = torch.tensor(0.2, requires_grad=True)
    fc.supcon_loss(feats, torch.tensor([0, 0, 1, 1, 2]), base_temperature=bt, backend="torch").backward()
    assert bt.grad is not None and feats.grad is None


def test_retain_graph_second_backward_matches(path):
    """The eager torch_chunked path scales its stored gradients once; a second backward recomputes."""
    q = torch.randn(20, 6, requires_grad=True)
    k = torch.randn(20, 6, requires_grad=True)
    loss = fc.info_nce(q, k, backend="torch")
    loss.backward(retain_graph=True)
    g1 = q.grad.clone()
    q.grad = None
    loss.backward()
    assert_close(q.grad, g1, atol=1e-6, what="second backward")


def test_dtypes_of_outputs(path):
    q = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
    loss = fc.info_nce(q, q.detach().clone().requires_grad_(), backend="torch")
    assert loss.dtype == torch.float32
    loss.backward()
    assert q.grad.dtype == torch.bfloat16
    assert fc.info_nce(q.double(), q.double(), backend="torch").dtype == torch.float64


def test_backend_env_overrides_auto(monkeypatch):
    from fused_contrastive.core import reference as ref

    q = torch.randn(6, 4)
    monkeypatch.setenv("FUSED_CONTRASTIVE_BACKEND", "reference")
    called = []
    orig = ref.info_nce
    monkeypatch.setattr(ref, "info_nce", lambda *a, **k: called.append(1) or orig(*a, **k))
    fc.info_nce(q, torch.randn(6, 4))
    assert called == [1]
    monkeypatch.setenv("FUSED_CONTRASTIVE_BACKEND", "nope")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_BACKEND"):
        fc.info_nce(q, torch.randn(6, 4))


def test_auto_backend_rule():
    """auto: torch on CPU tensors; CoSENT never asks for a kernel; float64 never goes to triton."""
    from fused_contrastive._backend import resolve

    cpu = torch.randn(2, 2)
    assert resolve("auto", cpu) == "torch"
    assert resolve("auto", cpu, op="cosent") == "torch"
    meta_cuda_like = torch.empty(2, 2, device="meta")
    assert resolve("auto", meta_cuda_like) == "torch"  # not CUDA
    assert resolve("reference", cpu) == "reference" and resolve("torch", cpu) == "torch"


def test_mean_of_no_rows_is_nan_like_cross_entropy():
    q, k = torch.randn(4, 3), torch.randn(4, 3)
    t = torch.full((4,), -100)
    assert math.isnan(float(fc.info_nce(q, k, t, backend="torch")))
    assert math.isnan(float(F.cross_entropy(q @ k.T, t)))


class _BiasedLogSoftmax:
    """``torch`` as ``torch_dense.py`` sees it, with ``log_softmax`` off by ``delta``: what another CPU's
    vectorised exp / log / sum may round a row's log-sum-exp to."""

    def __init__(self, delta: float):
        self.delta = delta

    def __getattr__(self, name):
        return getattr(torch, name)

    def log_softmax(self, x, dim):
        return torch.log_softmax(x, dim) - self.delta


@pytest.mark.parametrize("n", [257, 513])
@pytest.mark.parametrize("name", ["clip_self", "info_nce_self", "dscl_queue", "simcse_sup_hard", "supcon_in"])
def test_temperature_gradient_does_not_depend_on_the_lse_rounding(name, n, path, monkeypatch):
    """At D = 1 every cosine is +-1, all rows have one structure and the temperature's gradient
    (sum_j p_ij cos_ij - cos_it) cancels to ~1/30 of its terms: a rounding delta of a row's LSE, shared
    by all rows, used to reach the gradient amplified ~30x (2 cases failed the rule on an AMD CPU). The
    backends divide each softmax by its computed sum, so an LSE off by 1e-6 (a few ulp, what another
    CPU's exp / log may give) still meets the rule against the float64 truth."""
    from fused_contrastive.core.lse import torch_chunked, torch_dense

    delta = 1e-6
    biased = torch_chunked._lse_rows
    monkeypatch.setattr(torch_chunked, "_lse_rows", lambda x: biased(x) + delta)
    monkeypatch.setattr(torch_dense, "torch", _BiasedLogSoftmax(delta))
    c = compare(CASE_BY_NAME[name], n, 1, torch.float32, "torch")
    assert c.ok, c
