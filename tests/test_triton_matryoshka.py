"""The Matryoshka kernels (``kernels/matryoshka.py``, ``core/matryoshka/triton_levels.py``): every level from one
walk along D, forward and backward, under the Triton interpreter (conftest) against the definition
``sum_k w_k loss(F.normalize(x[..., :d_k]))`` in float64 (the plain reference loss per level), loss and every
gradient (temperature / logit scale included); ragged shapes and boundaries off every tile edge; 16-bit
inputs; K = 1 to 8; the sm_80 / sm_90 compiles (0 spills, tensor cores)."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_matryoshka import CASES, TEMPS, _inputs

import fused_contrastive as fc
from fused_contrastive import core
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

F64 = torch.float64
DIMS = [8, 3, 13, 5]  # unsorted; 13 = D; 3 and 5 inside the first D chunk, 8 off every edge
WEIGHTS = [1.0, 0.5, 2.0, -0.25]
# fp32: tf32x3 dots (~fp32); 16-bit: the definition runs on the rounded inputs, the tolerance covers the
# rounding of the gradient operand (the suffix sums H^r) to the input dtype
TOLS = {torch.float32: (2e-5, 2e-4), torch.float16: (2e-3, 2e-2), torch.bfloat16: (1e-2, 6e-2)}


def _check(got, want, dtype, what=""):
    lt, gt = TOLS[dtype]
    scale = want.abs().max().clamp_min(1e-3)
    err = (got.double() - want).abs().max()
    assert err <= (lt if what == "loss" else gt) * scale, (what, float(err), float(scale))


def _shrink(x, d):
    return None if x is None else F.normalize(x[..., :d], dim=-1, eps=1e-12)


def _run(name, reduction, route, dtype, dims=DIMS, weights=WEIGHTS):
    """(value, gradients) of case ``name`` (tests/test_matryoshka.py) with a tensor temperature: route
    "triton" (matryoshka_dims on the Triton backend, inputs in ``dtype``) or "def" (the definition on the
    same inputs in float64)."""
    fn, xs, kw, tkey = _inputs()[name]
    xs = [None if x is None else x.to(dtype) for x in xs]
    kw = dict(kw)
    if route == "def":
        xs = [None if x is None else x.double() for x in xs]
        kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    xs = [None if x is None else x.clone().requires_grad_() for x in xs]
    t = None
    if tkey is not None:
        t = torch.tensor(TEMPS[tkey], dtype=F64 if route == "def" else torch.float32, requires_grad=True)
        kw[tkey] = t
    if name != "cosent":
        kw["reduction"] = reduction
    if route == "triton":
        out = fn(*xs, backend="triton", matryoshka_dims=dims, matryoshka_weights=weights, **kw)
    else:
        out = sum(w * fn(*[_shrink(x, d) for x in xs], backend="reference", **kw)
                  for d, w in zip(dims, weights, strict=True))
    up = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * up).sum().backward()
    grads = [x.grad for x in xs if x is not None and x.grad is not None]
    if t is not None:
        grads.append(t.grad)
    return out.detach(), grads


@pytest.mark.parametrize("name,reduction", [(c, r) for c in CASES for r in ("mean", "none")
                                            if c != "cosent" or r == "mean"])
def test_every_loss_with_levels_on_triton_equals_the_definition(name, reduction):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernels take the levels
        got, g_got = _run(name, reduction, "triton", torch.float32)
    want, g_want = _run(name, reduction, "def", torch.float32)
    assert got.dtype == torch.float32
    _check(got, want, torch.float32, "loss")
    assert len(g_got) == len(g_want) > 0
    for i, (a, b) in enumerate(zip(g_got, g_want, strict=True)):
        _check(a, b, torch.float32, f"grad {i}")


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


RAGGED = (20, 64, 100, 144)  # D = 144: 20 and 100 off the 16- and 64-wide chunk edges, 64 on one
# every boundary a multiple of 16 (the kernels take ALIGNED: 16-byte operand loads), 48 and 80 inside 32- and
# 64-wide D chunks
ALIGNED = (16, 48, 80, 144)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("loss", ["info_nce", "clip", "supcon_in"])
def test_ragged_shapes_and_16_bit_inputs(dtype, loss):
    _ragged_case(dtype, loss, RAGGED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loss", ["info_nce", "clip"])
def test_boundaries_on_16_wide_chunks(dtype, loss):
    _ragged_case(dtype, loss, ALIGNED)


def test_level_boundaries_flag_and_tensor():
    # ALIGNED is set for boundaries that are all multiples of 16 only; the kernels' DIMS tensor is cached per
    # (levels, device): on CUDA a fresh one was a host-to-device copy per call, so two calls with the same
    # levels share it and other levels get their own
    from fused_contrastive.core.matryoshka import triton_levels as TM

    a = torch.zeros(4, 144)

    def levels(dims):
        return TM._Levels(a, None, CoreSpec(), CoreData(target=torch.arange(4)), False, dims)

    assert {d: TM._flags(levels(d), CoreSpec())["ALIGNED"] for d in (RAGGED, ALIGNED)} == {RAGGED: False,
                                                                                           ALIGNED: True}
    first = levels(ALIGNED).dims_t
    assert levels(ALIGNED).dims_t is first and levels(RAGGED).dims_t is not first
    assert first.tolist() == [0, *ALIGNED] and first.dtype == torch.int32


def _ragged_case(dtype, loss, dims):
    n, m, d = 37, 29, 144  # nothing on a tile edge
    q, k = _r(n, d, seed=1).to(dtype), _r(m if loss == "info_nce" else n, d, seed=2).to(dtype)
    tgt = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(3))
    lab = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(4))
    weights = [0.5, 1.0, 2.0, 1.0]

    def call(x, y, t, be, dims=dims, w=weights):
        if loss == "info_nce":
            return fc.info_nce(x, y, target=tgt, temperature=t, backend=be, matryoshka_dims=dims,
                               matryoshka_weights=w)
        if loss == "clip":
            return fc.clip_loss(x, y, logit_scale=t, backend=be, matryoshka_dims=dims, matryoshka_weights=w)
        return fc.supcon_loss(torch.stack([x, y], 1), labels=lab, variant="in", temperature=t, backend=be,
                              matryoshka_dims=dims, matryoshka_weights=w)

    tv = 10.0 if loss == "clip" else 0.1
    lq, lk = q.clone().requires_grad_(), k.clone().requires_grad_()
    t = torch.tensor(tv, requires_grad=True)
    got = call(lq, lk, t, "triton")
    rq, rk = q.double().requires_grad_(), k.double().requires_grad_()
    t2 = torch.tensor(tv, dtype=F64, requires_grad=True)
    want = sum(w * call(_shrink(rq, dd), _shrink(rk, dd), t2, "reference", None, None)
               for dd, w in zip(dims, weights, strict=True))
    _check(got, want.detach(), dtype, "loss")
    g1 = torch.autograd.grad(got, [lq, lk, t])
    g2 = torch.autograd.grad(want, [rq, rk, t2])
    for x, y, what in zip(g1, g2, ("q", "k", "temperature"), strict=True):
        assert x.dtype == (dtype if what != "temperature" else torch.float32)
        _check(x, y, dtype, what)


def test_eight_levels():
    # K = 8, unsorted, several boundaries inside one 16-wide D chunk (4, 6, 9, 13). (A 1-wide level is
    # ill-conditioned in float32 on every path: its normalisation backward cancels two terms of size
    # 1 / |x_i0|; the PyTorch one-pass path is off by 4e-5 on a gradient of 0.14 there.)
    dims = [34, 4, 6, 9, 13, 17, 21, 27]
    w = [1.0, 0.3, -0.5, 0.7, 1.1, 0.2, 0.9, 1.3]
    q, k = _r(23, 34, seed=5).float(), _r(19, 34, seed=6).float()
    tgt = torch.randint(0, 19, (23,), generator=torch.Generator().manual_seed(7))
    lq, lk = q.clone().requires_grad_(), k.clone().requires_grad_()
    got, per = fc.info_nce(lq, lk, target=tgt, backend="triton", matryoshka_dims=dims, matryoshka_weights=w,
                           return_level_losses=True)
    got.backward()
    rq, rk = q.double().requires_grad_(), k.double().requires_grad_()
    each = [fc.info_nce(_shrink(rq, d), _shrink(rk, d), target=tgt, backend="reference") for d in dims]
    want = sum(wi * e for wi, e in zip(w, each, strict=True))
    want.backward()
    _check(got, want.detach(), torch.float32, "loss")
    _check(per, torch.stack(each).detach(), torch.float32, "loss")  # the per-level losses, in the user's order
    _check(lq.grad, rq.grad, torch.float32)
    _check(lk.grad, rk.grad, torch.float32)


def test_core_levels_on_triton_equal_the_torch_pass():
    # the core op itself, every optional term: bias column, own column, a queue (grad_cols), per-row output
    n, m, d = 21, 30, 40
    a, b = _r(n, d, seed=8).float(), _r(m, d, seed=9).float()
    spec = CoreSpec(exclude_self=True, offset=3, bias=-0.7, grad_cols=24)
    own = torch.arange(n) + 3
    tgt = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(10))
    tgt = torch.where(tgt == own, (tgt + 1) % m, tgt)  # not the excluded own column (an infinite loss)
    data = CoreData(target=tgt,
                    bias_col=torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(11)))
    coef = Coeffs(lse=torch.linspace(0.5, 1.0, n), tgt=1.0)
    levels = ((7, 17, 40), (1.0, 0.5, 2.0))
    outs = []
    for be in ("triton", "torch"):
        la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
        s = torch.tensor(6.0, requires_grad=True)
        y = core.run(be, la, lb, s, spec, data, coef, False, levels=levels)
        (y * torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape)).sum().backward()
        # the queue columns' gradient is not defined (grad_cols: they are detached in every loss)
        outs.append((y.detach(), la.grad, lb.grad[:24], s.grad))
    for x, y, what in zip(*outs, ("out", "da", "db", "ds"), strict=True):
        torch.testing.assert_close(x, y.float(), rtol=2e-4, atol=2e-5, msg=what)


def test_clamped_prefix_rows():
    # a row whose short prefixes are zero (clamped to eps: divided by eps, no projection) and a zero row,
    # against the PyTorch one-pass path (the definition normalises twice, F.normalize then the loss's own
    # cosine, so its gradient at a zero prefix carries a second 1 / eps factor: 1e24 against 1e12)
    q, k = _r(9, 24, seed=12).float(), _r(9, 24, seed=13).float()
    q[2, :10] = 0.0
    k[4] = 0.0
    res = []
    for be in ("triton", "torch"):
        lq, lk = q.clone().requires_grad_(), k.clone().requires_grad_()
        got = fc.info_nce(lq, lk, backend=be, matryoshka_dims=[4, 10, 24])
        got.backward()
        res.append((got.detach(), lq.grad, lk.grad))
    assert res[0][1][2].abs().max() > 1e11 and res[0][2][4].abs().max() > 1e11  # the 1 / eps of the clamp
    for x, y in zip(*res, strict=True):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# ahead-of-time compiles (no GPU): the three kernels for sm_80 and sm_90
# ---------------------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import json
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from fused_contrastive.core.triton_shared import launch as TL
    from fused_contrastive.core.matryoshka import triton_levels as TM
    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
    from fused_contrastive.tools import compile_survey

    DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
    DIMS = {1: (768,), 5: (64, 128, 256, 512, 768), 8: (32, 64, 96, 128, 256, 384, 512, 768)}

    def record(fam, dt, k, variant, n=4096, d=768):
        meta = torch.device("meta")
        a, b = torch.empty(n, d, dtype=dt, device=meta), torch.empty(n, d, dtype=dt, device=meta)
        i64 = dict(dtype=torch.int64, device=meta)
        data, coef = CoreData(target=torch.empty(n, **i64)), Coeffs(lse=1.0)
        spec = CoreSpec(exclude_self=variant == "self")
        if variant == "col":
            coef = Coeffs(lse=1.0, col=1.0)
        if variant in ("pos", "set"):  # SupCon in (the positives' softmax) / out (the positive-set term)
            data = CoreData(row_labels=torch.empty(n, **i64), col_labels=torch.empty(n, **i64))
            coef = Coeffs(lse=1.0, pos=-1.0) if variant == "pos" else Coeffs(lse=1.0, set=-1.0)
        s = torch.empty((), device=meta)
        with compile_survey.recording(fam) as launches:
            lv = TM._Levels(a, b, spec, data, coef.pos is not None, DIMS[k])
            # 16-bit rows with a target take the target split's forward (SPLIT_T), as TritonLevelsFn runs them
            split = coef.pos is None and dt != torch.float32
            lse, lc, lp = TM._fwd(lv, s, spec, coef.col is not None, data.target if split else None,
                                  torch.empty(k, n, device=meta) if split else None)
            g = torch.empty(k, n, device=meta)
            if variant == "set":  # the SET term's weights in the gradient tiles (HAS_SET), its positives' fields
                lv.p = TL.with_positives(lv.p, lv.p.a, lv.p.b, spec, data)
            TM._bwd(lv, s, spec, lse, lc, lp, g, g if lc is not None else None, g if lp is not None else None,
                    True, True, True, g_set=g if variant == "set" else None)
        return [x for x in launches if x.name.startswith("mat_")]

    def job(args):
        cc, fam, dname, k, variant, i = args
        out = compile_survey.compile_launch(record(fam, DT[dname], k, variant)[i], cc)
        out.update(dtype=dname, k=k, variant=variant)
        return out

    if __name__ == "__main__":
        # fp16 runs bf16's code with another operand type; the variants: plain cross-entropy at K = 1, 5, 8,
        # the column LSE (CLIP), the positives' softmax (SupCon in) and the own column at K = 8
        jobs = [(cc, fam, dn, k, "ce", i) for cc, fam in compile_survey.TARGETS for dn in DT for k in DIMS
                for i in range(3)]
        jobs += [(cc, fam, dn, 8, v, i) for cc, fam in compile_survey.TARGETS for dn in DT
                 for v in ("col", "pos", "self", "set")
                 for i in range(3)]
        with ProcessPoolExecutor(max_workers=2) as ex:
            print(json.dumps(list(ex.map(job, jobs))))
    """
)

@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_SCRIPT, 1200)


def test_every_matryoshka_kernel_compiles_without_spills(compiled):
    kinds = {(r["kernel"], r["cc"], r["dtype"], r["k"], r["variant"]) for r in compiled}
    assert len(kinds) == 2 * 2 * (3 + 4) * 3, len(kinds)
    assert_no_spills_within_smem(compiled)


def test_matryoshka_kernels_use_tensor_cores(compiled):
    assert_tensor_cores(compiled)


def test_matryoshka_operands_load_in_16_byte_vectors(compiled):
    # the compiled levels (768, 512, ..., 32) are multiples of 16: every operand read is a 16-byte
    # cp.async of the software pipeline or a 16-byte vector load, none a scalar 16-bit load (before
    # ALIGNED: 24-48 scalar ld.global.b16 per kernel and no cp.async)
    for r in compiled:
        assert r["ld_b16"] == 0 and r["cp_async_16"] > 0, r


def test_panel_sized_problems_take_one_panel_call_per_level(monkeypatch, route):
    # where the plain op takes the panel path (forced here; on CUDA N * M >= 2^24) the levels run as one
    # plain call per level (bench/gpu_model.py --matryoshka models that faster than the Matryoshka kernels)
    from fused_contrastive.core.matryoshka import triton_levels as TM

    route(TRITON_PATH="panel")
    monkeypatch.setattr(TM, "run", lambda *a, **k: pytest.fail("the Matryoshka kernels ran"))
    q, k = _r(37, 40, seed=14).float(), _r(29, 40, seed=15).float()
    tgt = torch.randint(0, 29, (37,), generator=torch.Generator().manual_seed(16))
    lq, lk = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = fc.info_nce(lq, lk, target=tgt, backend="triton", matryoshka_dims=[40, 9, 20], matryoshka_weights=[1, 2, 3])
    got.backward()
    rq, rk = q.double().requires_grad_(), k.double().requires_grad_()
    want = sum(w * fc.info_nce(_shrink(rq, d), _shrink(rk, d), target=tgt, backend="reference")
               for d, w in ((40, 1), (9, 2), (20, 3)))
    want.backward()
    _check(got, want.detach(), torch.float32, "loss")
    _check(lq.grad, rq.grad, torch.float32)
    _check(lk.grad, rk.grad, torch.float32)


def test_more_than_eight_levels_take_one_call_per_level(monkeypatch):
    # the kernels are compiled and checked up to 8 levels; 9 run as plain Triton calls, still the definition
    from fused_contrastive.core.matryoshka import triton_levels as TM

    monkeypatch.setattr(TM, "run", lambda *a, **k: pytest.fail("the Matryoshka kernels ran"))
    dims = [2, 4, 6, 8, 10, 12, 14, 16, 18]
    q, k = _r(11, 18, seed=17).float(), _r(11, 18, seed=18).float()
    lq, lk = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = fc.info_nce(lq, lk, backend="triton", matryoshka_dims=dims)
    got.backward()
    rq, rk = q.double().requires_grad_(), k.double().requires_grad_()
    want = sum(fc.info_nce(_shrink(rq, d), _shrink(rk, d), backend="reference") for d in dims)
    want.backward()
    _check(got, want.detach(), torch.float32, "loss")
    _check(lq.grad, rq.grad, torch.float32)
    _check(lk.grad, rk.grad, torch.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_gradients_in_a_saturated_softmax(seed, monkeypatch, route):
    """Temperature 0.05 with positives at cosine ~0.8 (trained embeddings; 1 - p_target ~ 1e-4 at N = 48):
    the target term ``p_it - 1`` cancels, and formed after ``p_it`` was rounded to bf16 (as the kernels did
    until the target joined the tile, HAS_TGT) it lost 3.2-9.6e-2 of max |grad| (seeds 0-2). Now within
    2e-2 of max |grad| against the float64 definition on the same bf16 inputs (0.85-1.3e-2 when the target
    entry was still rounded with its tile; with it split out in fp32 and the inverse norms folded into the
    tile, 3.4-8.2e-3 here, where the interpreter's bf16 casts truncate; 3.2e-3 at most rounded to nearest as on the
    GPU: tests/test_matryoshka_target_split.py holds that tighter bound)."""
    route(DENSE="0")
    route(TRITON_PATH="fused")
    assert max(saturated_errors(seed)) <= 2e-2


def saturated_errors(seed: int) -> list[float]:
    """max |error| / max |grad| of both bf16 gradients of Matryoshka InfoNCE on the triton backend against the
    float64 definition on the same bf16 inputs, temperature 0.05, positives at cosine ~0.8 (N = 48, levels
    16 / 32 / 64)."""
    g = torch.Generator().manual_seed(seed)
    q0 = torch.randn(48, 64, generator=g)
    k0 = q0 + 0.5 * torch.randn(48, 64, generator=g)
    grads = {}
    for name, dtype, backend in (("truth", torch.float64, "reference"), ("got", torch.bfloat16, "triton")):
        q = q0.to(torch.bfloat16).to(dtype).requires_grad_()
        k = k0.to(torch.bfloat16).to(dtype).requires_grad_()
        fc.info_nce(q, k, temperature=0.05, matryoshka_dims=[16, 32, 64], backend=backend).backward()
        grads[name] = (q.grad.double(), k.grad.double())
    return [float((got - want).abs().max() / want.abs().max())
            for got, want in zip(grads["got"], grads["truth"], strict=True)]
