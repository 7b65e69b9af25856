"""Every loss on the torch backend against the reference backend (the oracle, written from the math),
over ragged shapes, dtypes, reductions and awkward inputs."""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive._cases import CASES, CASE_BY_NAME, compare
from helpers import assert_close, loss_and_grads

# N: 1 (a single row: degenerate softmax), 2, 3 (odd, smaller than any chunk), 97 (prime), 128 (a
# power of two), 257 (one past it). D: 1 (all cosines are +-1), 3, 100 (not a multiple of 8), 768 (BERT).
SHAPES = [(n, d) for n in (1, 2, 3, 97, 128, 257) for d in (1, 3, 100, 768)]


@pytest.mark.parametrize("n,d", SHAPES, ids=[f"{n}x{d}" for n, d in SHAPES])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_matches_reference_float32(case, n, d):
    c = compare(case, n, d, torch.float32, "torch")
    assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_half_within_pytorch_same_dtype_error(case, dtype):
    """Error against float64 truth within twice PyTorch's own error in that dtype (plus slack)."""
    c = compare(case, 97, 64, dtype, "torch")
    assert c.ok, c


def test_small_tiles_exercise_chunking(monkeypatch):
    """A tile budget of 300 elements splits N=97 into many row chunks and symmetric blocks."""
    monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", "300")
    for case in CASES:
        c = compare(case, 97, 16, torch.float32, "torch")
        assert c.ok, (case.name, c)


@pytest.mark.parametrize("name", ["info_nce", "info_nce_self", "clip", "simcse", "simcse_sup", "supcon_in",
                                  "supcon_mask_in", "supcon_one", "supcon_queue", "dscl_queue", "cosent_scores"])
def test_gradcheck_float64(name):
    """Analytic gradients of the torch backend (eager, symmetric and recompute paths) against finite
    differences, in float64."""
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(7, 4, torch.Generator().manual_seed(3))
    keys = list(tensors)
    inputs = tuple(tensors[k].double().requires_grad_() for k in keys)

    def f(*xs):
        out = case.fn(**dict(zip(keys, xs)), **kwargs, backend="torch")
        return out

    # nondet_tol: a second backward through the same graph takes the recompute path, which differs
    # from the eager gradients by rounding only
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, nondet_tol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("keys_none", [False, True])
def test_info_nce_is_cross_entropy(reduction, keys_none):
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
    cos = torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(kk, dim=1).T
    if keys_none:
        cos = cos.masked_fill(torch.eye(50, dtype=torch.bool), float("-inf"))
    want = torch.nn.functional.cross_entropy(cos / 0.1, target, reduction=reduction, ignore_index=-1)
    got = fc.info_nce(q, k, target, temperature=0.1, reduction=reduction, ignore_index=-1, backend="torch")
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="loss")


def test_clip_reduction_none_is_mean_of_row_and_column_ce():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(9, 5, generator=g), torch.randn(9, 5, generator=g)
    logits = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T * 10.0
    t = torch.arange(9)
    want = (torch.nn.functional.cross_entropy(logits, t, reduction="none")
            + torch.nn.functional.cross_entropy(logits.T, t, reduction="none")) / 2
    got = fc.clip_loss(a, b, 10.0, reduction="none", backend="torch")
    assert_close(got, want, atol=1e-5, what="per-pair clip")


def test_non_contiguous_inputs():
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


@pytest.mark.parametrize("name", ["info_nce", "simcse", "supcon_out", "supcon_in", "dscl", "cosent"])
def test_zero_vectors_and_duplicate_rows(name):
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
def test_nan_input_gives_nan_loss(backend):
    q = torch.randn(10, 4)
    q[3, 1] = float("nan")
    assert torch.isnan(fc.info_nce(q, torch.randn(10, 4), backend=backend))
    assert torch.isnan(fc.simcse_loss(q, backend=backend))
    f = torch.randn(5, 2, 4)
    f[4, 1, 0] = float("nan")
    assert torch.isnan(fc.supcon_loss(f, torch.tensor([0, 0, 1, 1, 2]), variant="in", backend=backend))
    assert torch.isnan(fc.cosent_loss_from_scores(torch.tensor([0.1, float("nan"), 0.3]),
                                                  torch.tensor([0.0, 1.0, 2.0]), backend=backend))


def test_grad_is_none_for_inputs_not_requiring_grad():
    q = torch.randn(10, 4, requires_grad=True)
    k = torch.randn(10, 4)
    t = torch.tensor(0.1)
    fc.info_nce(q, k, temperature=t, backend="torch").backward()
    assert q.grad is not None and k.grad is None and t.grad is None
    feats = torch.randn(5, 2, 4)
    t2 = torch.tensor(0.1, requires_grad=True)
    fc.supcon_loss(feats, torch.tensor([0, 0, 1, 1, 2]), temperature=t2, backend="torch").backward()
    assert t2.grad is not None and feats.grad is None


def test_retain_graph_second_backward_matches():
    """The eager path scales its stored gradients in place once; a second backward recomputes."""
    q = torch.randn(20, 6, requires_grad=True)
    k = torch.randn(20, 6, requires_grad=True)
    loss = fc.info_nce(q, k, backend="torch")
    loss.backward(retain_graph=True)
    g1 = q.grad.clone()
    q.grad = None
    loss.backward()
    assert_close(q.grad, g1, atol=1e-6, what="second backward")


def test_dtypes_of_outputs():
    q = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
    loss = fc.info_nce(q, q.detach().clone().requires_grad_(), backend="torch")
    assert loss.dtype == torch.float32
    loss.backward()
    assert q.grad.dtype == torch.bfloat16


def test_backend_env_overrides_auto(monkeypatch):
    q = torch.randn(6, 4)
    monkeypatch.setenv("FUSED_CONTRASTIVE_BACKEND", "reference")
    import fused_contrastive._reference as ref

    called = []
    orig = ref.info_nce
    monkeypatch.setattr(ref, "info_nce", lambda *a, **k: called.append(1) or orig(*a, **k))
    fc.info_nce(q, torch.randn(6, 4))
    assert called == [1]
    monkeypatch.setenv("FUSED_CONTRASTIVE_BACKEND", "nope")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_BACKEND"):
        fc.info_nce(q, torch.randn(6, 4))


def test_auto_backend_rule():
    from fused_contrastive._validate import auto_backend

    assert auto_backend(on_cuda=True, has_float64=False, triton_ok=True) == "triton"
    assert auto_backend(on_cuda=True, has_float64=True, triton_ok=True) == "torch"  # kernels take no float64
    assert auto_backend(on_cuda=True, has_float64=False, triton_ok=False) == "torch"
    assert auto_backend(on_cuda=False, has_float64=False, triton_ok=True) == "torch"


def test_cosent_auto_never_routes_to_triton(monkeypatch):
    """On CUDA "auto" resolves to triton; CoSENT (no kernel) must then run its torch path."""
    from fused_contrastive import _validate

    monkeypatch.setattr(_validate, "backend", lambda name, *t: "triton")
    s, y = torch.randn(20), torch.randint(0, 3, (20,)).float()
    got = fc.cosent_loss_from_scores(s, y)
    want = fc.cosent_loss_from_scores(s, y, backend="reference")
    assert_close(got, want, atol=1e-5)
