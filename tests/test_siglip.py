"""``siglip_loss``: SigLIP's sigmoid loss on every backend.

Checked against (1) a float64 formula written here from the definition (``_truth``: softplus terms
summed element by element from the label matrix), (2) open_clip's own ``SigLipLoss`` (its ``loss.py``
loaded by file path: ``import open_clip`` would import torchvision, which cannot load beside the CPU
torch here) and (3) the project's accuracy rule (``testing.compare``: float64 ground truth, tolerance
from PyTorch's own same-dtype error) for every dtype. Sizes: N = 1 (the only term is the positive),
3 (smaller than any block), 97 (prime), 257 (one past a power of two); D = 3 (not a multiple of 8)
and 100.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from fused_contrastive.testing import CASE_BY_NAME, assert_close, compare
from tests._ranks import gloo_rank

SIZES = [1, 3, 97, 257]
BACKENDS = ["torch", "reference"]


def _truth(image, text, s, b, normalize=True, reduction="mean", offset=0):
    """The definition in float64: ``sum_ij softplus(-label_ij z_ij)`` with ``softplus(t) = log(1 + e^t)``
    as ``logaddexp(0, t)`` (exact for any t), the positive of row i at column offset + i."""
    x, y = image.double(), text.double()
    if normalize:
        x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
        y = y / y.norm(dim=1, keepdim=True).clamp_min(1e-12)
    s = s.double() if isinstance(s, torch.Tensor) else s
    b = b.double() if isinstance(b, torch.Tensor) else b
    n, m = x.shape[0], y.shape[0]
    z = s * (x @ y.T) + b
    label = torch.tensor([[1.0 if j == offset + i else -1.0 for j in range(m)] for i in range(n)],
                         dtype=torch.float64)
    per = torch.logaddexp(torch.zeros_like(z), -label * z).sum(dim=1)
    return {"none": per, "sum": per.sum(), "mean": per.sum() / n}[reduction]


def triton_against_truth(x64, y64, dtype, s0, b0, learn, reduction, seed):
    """``(got, want, got_grads, want_grads)``: the triton backend's SigLIP loss of the ``dtype`` copies of the
    float64 rows ``x64`` / ``y64`` (already rounded to ``dtype``) against :func:`_truth` on the float64 ones, at scale
    ``s0`` and bias ``b0`` (learnable leaves with ``learn``); the gradients of a weighted sum (per-row losses: each
    row's upstream gradient its own, weights drawn from ``seed + 1``)."""
    leaves64 = [x64.requires_grad_(), y64.requires_grad_()]
    leaves = [x64.detach().to(dtype).requires_grad_(), y64.detach().to(dtype).requires_grad_()]
    if learn:
        leaves64 += [torch.tensor(s0, dtype=torch.float64, requires_grad=True),
                     torch.tensor(b0, dtype=torch.float64, requires_grad=True)]
        leaves += [torch.tensor(s0, requires_grad=True), torch.tensor(b0, requires_grad=True)]
        s64, b64, s, b = leaves64[2], leaves64[3], leaves[2], leaves[3]
    else:
        s64 = s = s0
        b64 = b = b0
    want = _truth(leaves64[0], leaves64[1], s64, b64, reduction=reduction)
    got = fc.siglip_loss(leaves[0], leaves[1], s, b, reduction=reduction, backend="triton")
    wts = torch.rand(got.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    want_g = torch.autograd.grad((want * wts).sum(), leaves64)
    got_g = torch.autograd.grad((got * wts.float()).sum(), leaves)
    return got, want, got_g, want_g


def _leaves(n, d, seed=0, dtype=torch.float64, scale=10.0, bias=-10.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    y = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    return x, y, s, b


def _value_and_grads(loss, leaves, seed=1):
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(loss.dtype)
    return [loss.detach()] + list(torch.autograd.grad((loss * w).sum(), leaves))


def _check_all(got, want, tol, what=""):
    names = ["loss", "grad image", "grad text", "grad logit_scale", "grad logit_bias"]
    for name, g, w in zip(names, got, want, strict=True):
        assert_close(g, w, atol=tol, rtol=tol, what=f"{what} {name}")


# ------------------------------------------------------------------------------------------------
# against the definition, float64, every backend and path
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n", SIZES)
def test_torch_matches_the_definition(n, reduction, path):
    x, y, s, b = _leaves(n, 3 if n > 3 else 100, seed=n)
    want = _value_and_grads(_truth(x, y, s, b, reduction=reduction), (x, y, s, b))
    got = _value_and_grads(fc.siglip_loss(x, y, s, b, reduction=reduction, backend="torch"), (x, y, s, b))
    _check_all(got, want, 1e-11, f"{path} N={n}")


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_reference_matches_the_definition(n, normalize):
    x, y, s, b = _leaves(n, 5, seed=n, scale=1.7, bias=0.3)
    want = _value_and_grads(_truth(x, y, s, b, normalize=normalize), (x, y, s, b))
    got = _value_and_grads(fc.siglip_loss(x, y, s, b, normalize=normalize, backend="reference"), (x, y, s, b))
    _check_all(got, want, 1e-11, f"N={n}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_normalize_false_uses_raw_dot_products(reduction, path):
    x, y, s, b = _leaves(97, 6, seed=4, scale=0.3, bias=1.5)
    want = _value_and_grads(_truth(x, y, s, b, normalize=False, reduction=reduction), (x, y, s, b))
    got = _value_and_grads(fc.siglip_loss(x, y, s, b, normalize=False, reduction=reduction, backend="torch"),
                           (x, y, s, b))
    _check_all(got, want, 1e-11, path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_number_scale_and_bias(backend, path):
    x, y, _, _ = _leaves(40, 8, seed=2)
    want = _value_and_grads(_truth(x, y, 7.0, -2.5), (x, y))
    got = _value_and_grads(fc.siglip_loss(x, y, 7.0, -2.5, backend=backend), (x, y))
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, atol=1e-12, rtol=1e-11, what=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_scale_and_bias_stay_finite(backend, path):
    """s = 1e4 and |b| = 1e3: logits of +-1e4, where a naive log(1 + exp(z)) overflows."""
    x, y, s, b = _leaves(30, 4, seed=3, scale=1e4, bias=-1e3)
    want = _value_and_grads(_truth(x, y, s, b), (x, y, s, b))
    got = _value_and_grads(fc.siglip_loss(x, y, s, b, backend=backend), (x, y, s, b))
    assert all(torch.isfinite(t).all() for t in got)
    _check_all(got, want, 1e-9, backend)
    xf, yf = x.detach().float().requires_grad_(), y.detach().float().requires_grad_()
    sf, bf = s.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    out = _value_and_grads(fc.siglip_loss(xf, yf, sf, bf, backend=backend), (xf, yf, sf, bf))
    assert all(torch.isfinite(t).all() for t in out)


# ------------------------------------------------------------------------------------------------
# the accuracy rule in every dtype (registry cases: also what `check` runs)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", ["siglip", "siglip_learn", "siglip_raw_none"])
def test_accuracy_rule_every_dtype(name, dtype, path):
    for n, d in [(3, 100), (97, 3)]:
        c = compare(CASE_BY_NAME[name], n, d, dtype, "torch", canary=True)
        assert c.ok, f"N={n} D={d}: {c}"


# ------------------------------------------------------------------------------------------------
# against open_clip's SigLipLoss (its loss.py, loaded by file path)
# ------------------------------------------------------------------------------------------------


def _open_clip_loss_module():
    spec = importlib.util.find_spec("open_clip")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("open_clip is not installed (pip install --no-deps open-clip-torch): peer comparison skipped")
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    mod_spec = importlib.util.spec_from_file_location("_open_clip_loss_by_path", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", SIZES)
def test_matches_open_clip_siglip_loss(n, backend, path):
    """open_clip receives normalised features (its models normalise before the loss); ours normalises
    inside, so the gradients are compared with respect to the raw features."""
    oc = _open_clip_loss_module().SigLipLoss()
    x, y, s, b = _leaves(n, 3 if n > 3 else 100, seed=10 + n, scale=10.0, bias=-10.0)
    want_loss = oc(F.normalize(x, dim=1), F.normalize(y, dim=1), s, b)
    want = [want_loss.detach()] + list(torch.autograd.grad(want_loss, (x, y, s, b)))
    got_loss = fc.siglip_loss(x, y, s, b, backend=backend)
    got = [got_loss.detach()] + list(torch.autograd.grad(got_loss, (x, y, s, b)))
    _check_all(got, want, 1e-10, f"{backend} N={n}")


def test_matches_open_clip_unnormalised_float32(path):
    """normalize=False on open_clip's exact inputs (raw rows), float32, learnable scale and bias."""
    oc = _open_clip_loss_module().SigLipLoss()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(97, 16, generator=g).requires_grad_()
    y = torch.randn(97, 16, generator=g).requires_grad_()
    s = torch.tensor(0.25, requires_grad=True)
    b = torch.tensor(-2.0, requires_grad=True)
    want_loss = oc(x.double(), y.double(), s.double(), b.double())
    want = [want_loss.detach()] + list(torch.autograd.grad(want_loss, (x, y, s, b)))
    got_loss = fc.siglip_loss(x, y, s, b, normalize=False, backend="torch")
    got = [got_loss.detach()] + list(torch.autograd.grad(got_loss, (x, y, s, b)))
    assert got_loss.dtype == torch.float32 and got[1].dtype == torch.float32 and got[3].dtype == torch.float32
    _check_all(got, want, 1e-4, "float32")


# ------------------------------------------------------------------------------------------------
# autograd contract, determinism, memory
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_is_none_exactly_where_not_required(backend, path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 5, generator=g, requires_grad=True)
    y = torch.randn(20, 5, generator=g)  # frozen tower
    s = torch.tensor(3.0)
    b = torch.tensor(-1.0, requires_grad=True)
    fc.siglip_loss(x, y, s, b, backend=backend).backward()
    assert x.grad is not None and b.grad is not None
    assert y.grad is None and s.grad is None
    assert x.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and b.grad.shape == ()


def test_half_inputs_give_float32_loss_and_half_grads(path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 10, generator=g).to(torch.bfloat16).requires_grad_()
    y = torch.randn(33, 10, generator=g).to(torch.float16).requires_grad_()
    loss = fc.siglip_loss(x, y, 10.0, -10.0, backend="torch")
    loss.backward()
    assert loss.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16 and y.grad.dtype == torch.float16


def test_backward_twice_with_retain_graph(path):
    x, y, s, b = _leaves(50, 7, seed=8)
    loss = fc.siglip_loss(x, y, s, b, backend="torch")
    first = torch.autograd.grad(loss, (x, y, s, b), retain_graph=True)
    second = torch.autograd.grad(loss, (x, y, s, b))
    for a, c in zip(first, second, strict=True):
        assert_close(a, c, atol=1e-14, rtol=1e-13, what="second backward")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_deterministic_bitwise(reduction, monkeypatch, route):
    route(TILE_ELEMENTS="1000")  # many row chunks
    runs = []
    for _ in range(2):
        x, y, s, b = _leaves(97, 33, seed=9, dtype=torch.float32)
        runs.append(_value_and_grads(fc.siglip_loss(x, y, s.float(), b.float(), reduction=reduction,
                                                    backend="torch"), (x, y, s, b)))
    for a, c in zip(*runs, strict=True):
        assert torch.equal(a, c)


def test_torch_backend_never_allocates_n_by_n():
    from test_memory import LargestTensor

    n, d = 4096, 32  # N x N = 16.8 M elements > the default tile budget of 2 M
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, requires_grad=True)
    y = torch.randn(n, d, generator=g, requires_grad=True)
    s = torch.tensor(10.0, requires_grad=True)
    b = torch.tensor(-10.0, requires_grad=True)
    for reduction in ("mean", "none"):
        with LargestTensor() as probe:
            loss = fc.siglip_loss(x, y, s, b, reduction=reduction, backend="torch")
            (loss if loss.dim() == 0 else loss.sum()).backward()
        assert probe.largest <= n * n // 8, f"{reduction}: largest tensor {probe.largest} from {probe.op}"
    with LargestTensor() as probe:  # the probe does see the reference's logits
        fc.siglip_loss(x, y, s, b, backend="reference")
    assert probe.largest >= n * n


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,err,needle", [
    (dict(image=[[1.0]]), TypeError, "image must be a torch.Tensor"),
    (dict(text=torch.ones(4, 3, dtype=torch.int64)), TypeError, "text must be float16"),
    (dict(image=torch.randn(4)), ValueError, "image must have 2 dimensions"),
    (dict(text=torch.randn(4, 5)), ValueError, "text has embedding dimension 5"),
    (dict(text=torch.randn(5, 3)), ValueError, "text must have as many rows as image"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be finite and > 0"),
    (dict(logit_scale=-2.0), ValueError, "logit_scale must be finite and > 0"),
    (dict(logit_scale=math.inf), ValueError, "logit_scale must be finite"),
    (dict(logit_scale=torch.tensor(float("nan"))), ValueError, "logit_scale must be finite"),
    (dict(logit_scale=torch.ones(2)), ValueError, "logit_scale must be a float or a 0-dim tensor"),
    (dict(logit_scale="10"), TypeError, "logit_scale must be a float or a 0-dim tensor"),
    (dict(logit_bias=-math.inf), ValueError, "logit_bias must be finite"),
    (dict(logit_bias=math.nan), ValueError, "logit_bias must be finite"),
    (dict(logit_bias=torch.tensor(math.inf)), ValueError, "logit_bias must be finite"),
    (dict(logit_bias=torch.tensor(1)), TypeError, "logit_bias must be a floating tensor"),
    (dict(logit_bias="0"), TypeError, "logit_bias must be a float or a 0-dim tensor"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(normalize=1), TypeError, "normalize must be a bool"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(gather=True), (ValueError, RuntimeError), "gather"),
])
def test_bad_arguments_name_the_argument(kwargs, err, needle):
    args = dict(image=torch.randn(4, 3), text=torch.randn(4, 3), logit_scale=10.0, logit_bias=-10.0)
    args.update(kwargs)
    with pytest.raises(err, match=needle):
        fc.siglip_loss(**args)


def test_negative_bias_and_zero_bias_are_fine():
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    for bias in (0.0, 3.0, -10.0, torch.tensor(0.0)):
        assert torch.isfinite(fc.siglip_loss(x, y, 10.0, bias))


# ------------------------------------------------------------------------------------------------
# nn.SigLIPLoss
# ------------------------------------------------------------------------------------------------


def test_module_learns_scale_and_bias():
    """Parameters initialised as the paper (scale 10 via log, bias -10); the loss equals the definition
    with exp(log scale), and both parameters get the definition's gradients."""
    m = fc.nn.SigLIPLoss()
    assert math.isclose(float(m.logit_scale.detach().exp()), 10.0, rel_tol=1e-6)
    assert float(m.logit_bias.detach()) == -10.0
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(33, 8, generator=g), torch.randn(33, 8, generator=g)
    loss = m(x, y)
    loss.backward()
    t = torch.tensor(math.log(10.0), dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-10.0, dtype=torch.float64, requires_grad=True)
    want = _truth(x, y, t.exp(), b)
    wt, wb = torch.autograd.grad(want, (t, b))
    assert_close(loss, want, atol=1e-6, rtol=1e-6, what="loss")
    assert_close(m.logit_scale.grad, wt, atol=1e-5, rtol=1e-5, what="grad log scale")
    assert_close(m.logit_bias.grad, wb, atol=1e-5, rtol=1e-5, what="grad bias")
    assert set(dict(m.named_parameters())) == {"logit_scale", "logit_bias"}


def test_module_options_and_init_errors():
    m = fc.nn.SigLIPLoss(init_scale=2.0, init_bias=0.5, reduction="none", normalize=False, backend="reference")
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    assert_close(m(x, y), _truth(x, y, 2.0, 0.5, normalize=False, reduction="none"), atol=1e-5, rtol=1e-5,
                 what="options")
    with pytest.raises(ValueError, match="init_scale"):
        fc.nn.SigLIPLoss(init_scale=0.0)
    with pytest.raises(ValueError, match="init_bias"):
        fc.nn.SigLIPLoss(init_bias=math.nan)


# ------------------------------------------------------------------------------------------------
# gather: a spawned gloo run (the helpers of test_distributed.py)
# ------------------------------------------------------------------------------------------------


def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:
    with gloo_rank(rank, world, init, out, timeout=60):
        g = torch.Generator().manual_seed(0)
        n = sum(sizes)
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
        y = torch.randn(n, 6, generator=g, dtype=torch.float64)
        off = sum(sizes[:rank])
        res = {"rank": rank, "cases": {}}
        for be in ("torch", "reference"):
            for reduction in ("mean", "sum", "none"):
                s = torch.tensor(5.0, dtype=torch.float64, requires_grad=True)
                b = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
                xl = x[off:off + sizes[rank]].clone().requires_grad_()
                yl = y[off:off + sizes[rank]].clone().requires_grad_()
                got = fc.siglip_loss(xl, yl, s, b, reduction=reduction, gather=True, backend=be)
                total = got if got.dim() == 0 else got.sum()
                gx, gy, gs, gb = torch.autograd.grad(total, (xl, yl, s, b))
                # plain lists through the queue (a shared tensor dies with this process)
                res["cases"][f"{be}/{reduction}"] = dict(
                    loss=got.detach().tolist(), gx=gx.tolist(), gy=gy.tolist(), gs=float(gs), gb=float(gb))
        out.put(res)


def test_gather_matches_the_global_batch(tmp_path):
    from tests._ranks import run_ranks

    sizes = [5, 3]
    world = len(sizes)
    results = run_ranks(_gather_worker, world, tmp_path, sizes, timeout=150)
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.randn(n, 6, generator=g, dtype=torch.float64)
    for reduction in ("mean", "sum", "none"):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        s = torch.tensor(5.0, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
        want = _truth(xs, ys, s, b, reduction=reduction)
        wx, wy, ws, wb = torch.autograd.grad(want if want.dim() == 0 else want.sum(), (xs, ys, s, b))
        for be in ("torch", "reference"):
            got = [{k: torch.tensor(v, dtype=torch.float64) for k, v in r["cases"][f"{be}/{reduction}"].items()}
                   for r in results]
            what = f"{be}/{reduction}"
            if reduction == "none":  # each rank's rows of the global per-image losses
                assert_close(torch.cat([c["loss"] for c in got]), want, atol=1e-12, rtol=1e-12, what=what)
            else:  # the average over ranks is the global loss
                assert_close(sum(c["loss"] for c in got) / world, want, atol=1e-12, rtol=1e-12, what=what)
            # every rank backpropagates its own value; DDP averages the replicated scale / bias gradients,
            # and each rank's rows receive the sum over ranks (world copies of the average's gradient)
            k = 1.0 if reduction == "none" else float(world)
            assert_close(torch.cat([c["gx"] for c in got]), k * wx, atol=1e-11, rtol=1e-10, what=f"{what} grad image")
            assert_close(torch.cat([c["gy"] for c in got]), k * wy, atol=1e-11, rtol=1e-10, what=f"{what} grad text")
            gs = sum(c["gs"] for c in got) / k
            gb = sum(c["gb"] for c in got) / k
            assert_close(gs, ws, atol=1e-11, rtol=1e-10, what=f"{what} grad logit_scale")
            assert_close(gb, wb, atol=1e-11, rtol=1e-10, what=f"{what} grad logit_bias")


# ------------------------------------------------------------------------------------------------
# the offset of the positives (what gather passes): every backend's Function directly
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 5, 19])
def test_positive_offset_on_a_wider_text_set(offset, path):
    """Images [N] against texts [M > N] with the positives at columns offset + i (this rank's rows of a
    gathered batch), per-image losses and every gradient, torch Function against the definition."""
    from fused_contrastive.core.siglip.torch_siglip import SigLipFn

    g = torch.Generator().manual_seed(offset)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(26, 5, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    want = _value_and_grads(_truth(x, y, s, b, reduction="none", offset=offset), (x, y, s, b))
    got = _value_and_grads(SigLipFn.apply(x, y, s, b, True, 1e-12, offset, False, 1.0), (x, y, s, b))
    _check_all(got, want, 1e-11, f"offset {offset}")


# ------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (conftest.py sets TRITON_INTERPRET=1): inputs are views into
# NaN-padded buffers (canary) and every kernel output is pre-filled with NaN (poison)
# ------------------------------------------------------------------------------------------------

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")


@pytest.fixture
def poison(monkeypatch):
    from fused_contrastive.core.triton_shared import launch as TL

    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["siglip", "siglip_learn", "siglip_raw_none"])
def test_triton_parity_fp32(name, n, poison):
    # D = 100: not a power of two, several D chunks of the fp32 tiles
    c = compare(CASE_BY_NAME[name], n, 100 if n < 97 else 3, torch.float32, "triton", canary=True)
    assert c.ok, c


@pytest.mark.parametrize("n,d", [(97, 100), (70, 150)], ids=["resident", "streaming"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_triton_parity_half(dtype, n, d, poison):
    """D = 100 keeps the backward accumulator in registers; D = 150 (> 128) streams it through the
    fp32 scratch rows."""
    for name in ("siglip", "siglip_learn"):
        c = compare(CASE_BY_NAME[name], n, d, dtype, "triton", canary=True)
        assert c.ok, f"{name}: {c}"


@pytest.mark.parametrize("offset", [0, 19])
def test_triton_positive_offset(offset, poison):
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn

    g = torch.Generator().manual_seed(offset)
    x64 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    y64 = torch.randn(90, 5, generator=g, dtype=torch.float64)
    leaves64 = [x64.requires_grad_(), y64.requires_grad_(), torch.tensor(4.0, dtype=torch.float64, requires_grad=True),
                torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)]
    want = _value_and_grads(_truth(*leaves64, reduction="none", offset=offset), leaves64)
    leaves = [t.detach().float().requires_grad_() for t in leaves64]
    got = _value_and_grads(TritonSigLipFn.apply(*leaves, True, 1e-12, offset, False, 1.0), leaves)
    _check_all(got, want, 2e-5, f"offset {offset}")


def test_triton_huge_scale_and_open_clip(poison):
    """s = 1e4 (logits of +-1e4) stays finite; and the value and all four gradients equal open_clip's
    SigLipLoss (float64) to float32 accuracy."""
    oc = _open_clip_loss_module().SigLipLoss()
    for scale, bias, tol in ((1e4, -1e3, 2e-3), (10.0, -10.0, 2e-5)):
        x, y, s, b = _leaves(45, 20, seed=6, scale=scale, bias=bias)
        want_loss = oc(F.normalize(x, dim=1), F.normalize(y, dim=1), s, b)
        want = [want_loss.detach()] + list(torch.autograd.grad(want_loss, (x, y, s, b)))
        leaves = [t.detach().float().requires_grad_() for t in (x, y, s, b)]
        got_loss = fc.siglip_loss(*leaves, backend="triton")
        got = [got_loss.detach()] + list(torch.autograd.grad(got_loss, leaves))
        assert all(torch.isfinite(t).all() for t in got)
        _check_all(got, want, tol, f"scale {scale}")


def test_triton_deterministic_bitwise(poison):
    runs = []
    for _ in range(2):
        x, y, s, b = _leaves(150, 40, seed=9, dtype=torch.float32)
        leaves = [x, y, s.float().detach().requires_grad_(), b.float().detach().requires_grad_()]
        runs.append(_value_and_grads(fc.siglip_loss(*leaves, reduction="none", backend="triton"), leaves))
    for a, c in zip(*runs, strict=True):
        assert torch.equal(a, c)


def test_triton_grad_is_none_exactly_where_not_required(poison):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 5, generator=g)
    y = torch.randn(20, 5, generator=g, requires_grad=True)
    s = torch.tensor(3.0, requires_grad=True)
    fc.siglip_loss(x, y, s, -1.0, backend="triton").backward()
    assert x.grad is None and y.grad is not None and s.grad is not None


def test_triton_rejects_float64():
    with pytest.raises(TypeError, match="float64"):
        fc.siglip_loss(torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64), 1.0, 0.0,
                       backend="triton")
