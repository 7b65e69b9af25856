"""The PyTorch paths' loss and gradients in a saturated softmax (``testing.cases.REGIMES["saturated"]``: the target's
logit ``log N + margin`` above the rest, ``1 - p_t`` of 1e-4 at a margin of 9 and 1e-6 at 13) against float64 on the
same rounded rows.

The one-tile path (``core/lse/torch_dense.py``: the CPU's default below 2^21 logits and CUDA's up to 2^24 for losses
without a column term, the batches most users train with) forms its tiles in fp32 whatever the inputs' dtype. There
``LSE_i - l_it`` and ``p_t - 1`` cancel as they did in the kernels' 16-bit tiles: InfoNCE's per-row loss was 0.12 off
float64 at margin 13 and CLIP's 1.0 (0.047 at margin 9), CLIP's gradients 0.047 of the largest where bf16's own
rounding of the float64 gradient is 0.003. The split (``_split``: the other entries' log-sum-exp of the log-softmax
tile gives ``log(1 - p_t)``; the loss is ``softplus(log(1 - p_t) - log p_t)``, the target's weight ``-(1 - p_t)``)
keeps both: the loss within 1.1e-5 of float64, the gradients within bf16's / fp16's own rounding of them. The chunked
path (``core/lse/torch_chunked.py``: the CPU's past 2^21 logits, O(N D) memory) splits the same way in its row chunks,
its symmetric blocks (B is A: both roles of a block hold target entries) and CLIP's column statistics, and its
backward takes ``target_split.exact_weights`` at the target entries: it was worse, per-row losses up to 4.3x off and
gradients 0.06-0.1 of the largest at margin 13; now as the one-tile path. Tested in 16-row chunks (and blocks)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fused_contrastive.core.lse import torch_chunked, torch_dense
from fused_contrastive.testing import CASE_BY_NAME
from fused_contrastive.testing import cases as C
from fused_contrastive.testing.accuracy import make_inputs

#: the loss's relative error, every entry (measured 3.5e-8 to 1.1e-5)
LOSS_TOL = 1e-4
#: the gradients' largest error over the largest true gradient, beyond the dtype's own rounding of the float64 gradient
#: (measured 0 to 2.1e-3; the unsplit form 7.9e-3)
GRAD_TOL = 4e-3
#: the temperature's gradient (one fp32 number)
SCALE_TOL = 1e-4

CASES = {"info_nce": "temperature", "clip": "logit_scale", "simcse": "temperature", "info_nce_smoothed": "temperature",
         "clip_smoothed": "logit_scale"}


#: the PyTorch paths: the one tile, and the chunked path in 16-row chunks of the 128-row problems
PATHS = {"dense": dict(DENSE="1"), "chunked": dict(DENSE="0", TILE_ELEMENTS=str(16 * 128))}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def errors(case: str, dtype, margin: float, reduction: str | None, n: int = 128) -> tuple[float, list[float]]:
    """(the loss's largest relative error, each gradient's largest error over its largest entry less ``dtype``'s own
    rounding of the float64 gradient; the scale's last) of the torch backend against float64, D = 112."""
    C.REGIME_MARGIN["saturated"] = margin
    tensors, kwargs = make_inputs(CASE_BY_NAME[case], n, 112, seed=3, regime="saturated")
    if reduction is not None:
        kwargs = dict(kwargs, reduction=reduction)
    key = CASES[case]
    scale = float(tensors.pop(key) if key in tensors else kwargs.pop(key))  # (a learned scale: fp32, last)
    out = []
    for backend, dt in (("torch", dtype), ("reference", torch.float64)):
        xs = {k: v.to(dtype).to(dt).requires_grad_() for k, v in tensors.items()}
        sc = torch.tensor(scale, dtype=torch.float32 if dt != torch.float64 else dt, requires_grad=True)
        loss = CASE_BY_NAME[case].fn(**xs, backend=backend, **dict(kwargs, **{key: sc}))
        out.append((loss.detach().double(),
                    [g.double() for g in torch.autograd.grad(loss.sum(), [*xs.values(), sc])]))
    (got, ggot), (want, gwant) = out
    # (rows whose loss is 0 in float64, the ignored ones: their loss must be 0)
    loss_err = float(torch.where(want != 0, (got - want).abs() / want.abs().clamp(min=1e-300), got.abs()).max())
    grad_errs = []
    for g, w in zip(ggot, gwant, strict=True):
        own = float((w.to(dtype).double() - w).abs().max() / w.abs().max()) if w.dim() else 0.0
        grad_errs.append(float((g - w).abs().max() / w.abs().max()) - own)
    return loss_err, grad_errs


@pytest.mark.parametrize("margin", [9.0, 13.0])
@pytest.mark.parametrize("reduction", [None, "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_torch_paths_against_float64(path, case, dtype, reduction, margin, route, launches, monkeypatch):
    route(**PATHS[path])
    used = set()
    for mod, fn in ((torch_dense, "DenseCoreFn"), (torch_chunked, "ChunkedCoreFn")):
        cls = getattr(mod, fn)
        monkeypatch.setattr(cls, "forward", staticmethod(
            lambda *a, _f=cls.forward, _n=fn: (used.add(_n), _f(*a))[1]))
    loss_err, grad_errs = errors(case, dtype, margin, reduction)
    assert used == {"DenseCoreFn" if path == "dense" else "ChunkedCoreFn"}, used
    assert not launches  # (the torch backend: no kernel ran)
    assert loss_err <= LOSS_TOL, f"{case} {dtype} margin {margin}: the loss off float64 by {loss_err:.3g}"
    for i, err in enumerate(grad_errs[:-1]):
        assert err <= GRAD_TOL, f"{case} {dtype}: gradient {i} off by {err:.3g} beyond the dtype's own rounding"
    assert grad_errs[-1] <= SCALE_TOL, f"{case} {dtype}: the temperature's gradient off by {grad_errs[-1]:.3g}"


@pytest.mark.parametrize("case,reduction", [("info_nce", "none"), ("clip", None)])
def test_the_unsplit_form_misses(case, reduction, monkeypatch, route):
    """Planted: the split taking no row (the plain log-softmax tile's ``-lsm_t`` and ``p_t - 1``) misses the bounds at
    margin 13: the loss by more than 1e-2 (0.024 / 0.12), the embeddings' gradients (7.9e-3 beyond bf16's own rounding)
    and the temperature's (5e-3 to 9e-3)."""

    def unsplit(lsm, idx, dim, keep=None):
        lt = lsm.gather(dim, idx).squeeze(dim)
        return -lt, torch.zeros_like(lt, dtype=torch.bool), torch.zeros_like(lt)

    monkeypatch.setattr(torch_dense, "_split", unsplit)
    route(**PATHS["dense"])
    loss_err, grad_errs = errors(case, torch.bfloat16, 13.0, reduction)
    assert loss_err > 1e-2 and max(grad_errs[:-1]) > GRAD_TOL and grad_errs[-1] > 10 * SCALE_TOL, (loss_err, grad_errs)
    # the chunked path's, with its split off
    monkeypatch.setattr(torch_chunked, "split_target", lambda *a: None)
    route(**PATHS["chunked"])
    loss_err, grad_errs = errors(case, torch.bfloat16, 13.0, reduction)
    assert loss_err > 1e-2 and max(grad_errs[:-1]) > GRAD_TOL and grad_errs[-1] > 10 * SCALE_TOL, (loss_err, grad_errs)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_column_term_with_more_columns_than_rows(path, route):
    """The core op with CLIP's terms and M > N (columns past the rows have no pair; the first N columns' pairs split),
    bf16 rows at temperature 0.02 with positives at cosine ~0.999, against the definition written here in float64:
    ``sum_i c (LSE_i + LSEcol_i - 2 l_ii) + sum_{j >= N} c LSEcol_j``."""
    from fused_contrastive import core
    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec

    route(**PATHS[path])

    g = torch.Generator().manual_seed(5)
    q = torch.nn.functional.normalize(torch.randn(24, 32, generator=g, dtype=torch.float64), dim=1)
    k = torch.randn(40, 32, generator=g, dtype=torch.float64)
    k[:24] = q + 0.03 * torch.randn(24, 32, generator=g, dtype=torch.float64)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    c, s = 0.5 / 24, 50.0
    a, b = q.float().requires_grad_(), k.float().requires_grad_()
    got = core.run("torch", a, b, s, CoreSpec(), CoreData(target=torch.arange(24)), Coeffs(lse=c, col=c, tgt=2 * c),
                   True)
    ga, gb = torch.autograd.grad(got, [a, b])
    a64, b64 = q.double().requires_grad_(), k.double().requires_grad_()
    logits = s * torch.nn.functional.normalize(a64, dim=1) @ torch.nn.functional.normalize(b64, dim=1).T
    want = c * (logits.logsumexp(1).sum() + logits.logsumexp(0).sum() - 2 * logits.diagonal().sum())
    wa, wb = torch.autograd.grad(want, [a64, b64])
    assert float((got.double() - want).abs() / want) <= LOSS_TOL, (float(got), float(want))
    for x, y in ((ga, wa), (gb, wb)):
        assert float((x.double() - y).abs().max() / y.abs().max()) <= 1e-4
