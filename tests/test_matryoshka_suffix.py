"""The Matryoshka levels' suffix backward (env ``FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE=suffix``:
``kernels/matryoshka.py`` ``mat_epi_kernel``, one walk along D per tile writing the suffix sums
``H^r = sum_{k >= r} G^k``, then cuBLAS per segment; ``core/matryoshka/triton_levels._bwd_suffix``) under the Triton
interpreter, against the definition ``sum_k w_k loss(F.normalize(x[..., :d_k]))`` in float64 on the same
16-bit inputs: loss and every gradient (temperature / logit scale included), in several panels of rows and
several tiles per panel, ragged shapes and boundaries; planted defects in the kernel's suffix sums and in the
host's normalisation backward fail the same checks; the routes the env variable selects; the panel height
within the byte budget; and the sm_80 / sm_90 compiles (0 spills, tensor cores, 16-byte operand copies)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_triton_matryoshka import ALIGNED, RAGGED, _check, _r, _ragged_case, _run, _shrink, saturated_errors

import fused_contrastive as fc
from fused_contrastive.core.matryoshka import triton_levels as TM
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.core.triton_shared.configs import MATRYOSHKA_SUFFIX_LEVELS, LaunchConfig
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from fused_contrastive.kernels import matryoshka as KM


@pytest.fixture
def suffix(monkeypatch, route):
    """The suffix route with 16 x 16 tiles and 16-row panels (several of each at the tests' sizes); the
    launches, recorded."""
    route(MATRYOSHKA_ROUTE="suffix")
    monkeypatch.setattr(TM, "SUFFIX_CONFIG", LaunchConfig(16, 16, 16, 4, 1))
    route(PANEL_ROWS=16)
    launches = []
    orig = TL._launch

    def record(launch):
        launches.append(launch)
        return orig(launch)

    monkeypatch.setattr(TL, "_launch", record)
    return launches


def _panels(launches):
    return [(x.args["r0"], x.args["P"], x.grid[0]) for x in launches if x.name == "mat_epi"]


@pytest.mark.parametrize("dtype,loss,dims", [
    (torch.bfloat16, "info_nce", ALIGNED), (torch.bfloat16, "clip", ALIGNED), (torch.bfloat16, "supcon_in", ALIGNED),
    (torch.float16, "info_nce", RAGGED)], ids=["bf16-info_nce", "bf16-clip", "bf16-supcon_in", "fp16-info_nce-ragged"])
def test_suffix_backward_equals_the_definition(suffix, dtype, loss, dims):
    _ragged_case(dtype, loss, dims)  # N = 37 (M = 29 for info_nce), D = 144: nothing on a tile edge
    names = {x.name for x in suffix}
    assert "mat_epi" in names and not names & {"mat_bwd_rows", "mat_bwd_cols"}, names
    # one backward, every row in exactly one panel of 16, each panel's 16 x 16 tiles all launched (SupCon's
    # two views are one 74-row input against itself)
    n, m = {"info_nce": (37, 29), "clip": (37, 37), "supcon_in": (74, 74)}[loss]
    assert _panels(suffix) == [(r0, min(16, n - r0), triton.cdiv(m, 16)) for r0 in range(0, n, 16)]


@pytest.mark.parametrize("name", ["info_nce", "info_nce_ignore", "info_nce_self", "info_nce_symmetric", "clip",
                                  "supcon_in", "supcon_out"])
def test_every_case_with_levels_on_the_suffix_route(suffix, name):
    # the cases of tests/test_matryoshka.py (7 rows, D = 13, levels 8 / 3 / 13 / 5 unsorted with a negative
    # weight) in bf16: the own column excluded, a target ignored, both directions, positives
    got, g_got = _run(name, "mean", "triton", torch.bfloat16)
    want, g_want = _run(name, "mean", "def", torch.bfloat16)
    assert any(x.name == "mat_epi" for x in suffix)
    _check(got, want, torch.bfloat16, "loss")
    assert len(g_got) == len(g_want) > 0
    for i, (a, b) in enumerate(zip(g_got, g_want, strict=True)):
        _check(a, b, torch.bfloat16, f"grad {i}")


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_gradients_in_a_saturated_softmax(suffix, seed, monkeypatch):
    """The peaked softmax of tests/test_triton_matryoshka.py (temperature 0.05, positives at cosine ~0.8):
    the target term joins each level's tile in fp32 before the tile is parked in bf16, so ``p_it - 1`` is
    rounded once, as a value; within 2e-2 of max |grad| of the float64 definition on the same bf16 inputs."""
    assert max(saturated_errors(seed)) <= 2e-2
    assert _panels(suffix)


@triton.jit
def _parks_nothing(k: tl.constexpr, x, p0, p1, p2, p3, p4, p5, p6):
    return p0, p1, p2, p3, p4, p5, p6


def test_planted_defects_fail(suffix, monkeypatch):
    # the suffix sums without the parked levels (every H^r = G^top): the gradients fail the definition
    with monkeypatch.context() as mp:
        mp.setattr(KM, "_park", _parks_nothing)
        with pytest.raises(AssertionError, match=r"^\('(q|k|temperature)', "):
            _ragged_case(torch.bfloat16, "info_nce", ALIGNED)
    # the normalisation backward without the levels' scalars (rho): also caught
    finish = TM._finish
    with monkeypatch.context() as mp:
        mp.setattr(TM, "_finish", lambda x, acc, nx, rho, *a: finish(x, acc, nx, torch.zeros_like(rho), *a))
        with pytest.raises(AssertionError, match=r"^\('(q|k|temperature)', "):
            _ragged_case(torch.bfloat16, "info_nce", ALIGNED)
    _ragged_case(torch.bfloat16, "info_nce", ALIGNED)  # and without the plants it passes


TARGET = torch.randint(0, 25, (21,), generator=torch.Generator().manual_seed(33))


def _levels_call(dtype, dims):
    q, k = _r(21, 40, seed=31).to(dtype).requires_grad_(), _r(25, 40, seed=32).to(dtype).requires_grad_()
    fc.info_nce(q, k, target=TARGET, backend="triton", matryoshka_dims=dims).backward()
    return q.grad, k.grad


@pytest.mark.parametrize("choice,dtype,dims,want", [
    ("suffix", torch.bfloat16, [8, 16, 40], {"mat_fwd", "mat_epi"}),
    ("suffix", torch.float32, [8, 16, 40], {"mat_fwd", "mat_bwd_rows", "mat_bwd_cols"}),  # 16-bit only
    ("suffix", torch.bfloat16, [4, 8, 12, 16, 24, 40], {"mat_fwd", "mat_bwd_rows", "mat_bwd_cols"}),  # > 5 levels
    ("kernels", torch.bfloat16, [8, 16, 40], {"mat_fwd", "mat_bwd_rows", "mat_bwd_cols"}),
    ("auto", torch.bfloat16, [8, 16, 40], {"mat_fwd", "mat_bwd_rows", "mat_bwd_cols"}),  # CPU: no panel path
    ("calls", torch.bfloat16, [8, 16, 40], set()),
])
def test_the_route_variable_selects_the_kernels(suffix, route, choice, dtype, dims, want):
    assert MATRYOSHKA_SUFFIX_LEVELS == 5
    route(MATRYOSHKA_ROUTE=choice)
    route(DENSE="0")  # the plain calls on their kernels, not the one-tile path
    gq, gk = _levels_call(dtype, dims)
    assert {x.name for x in suffix if x.name.startswith("mat_")} == want
    if choice == "calls":
        assert [x.name for x in suffix].count("lse_fwd") == len(dims)  # one plain call per level
    # every route computes the same gradients (the definition's, within 16-bit rounding)
    rq, rk = _r(21, 40, seed=31).to(dtype).double().requires_grad_(), _r(25, 40, seed=32).to(dtype).double()
    rk.requires_grad_()
    sum(fc.info_nce(_shrink(rq, d), _shrink(rk, d), target=TARGET, backend="reference") for d in dims).backward()
    _check(gq, rq.grad, dtype)
    _check(gk, rk.grad, dtype)


def test_an_unknown_route_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE", "fast")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_MATRYOSHKA_ROUTE must be one of .*'suffix'.*'fast'"):
        _levels_call(torch.bfloat16, [8, 40])


def test_the_panel_height_keeps_the_suffix_tiles_within_the_budget(monkeypatch, route):
    route(PANEL_BUDGET=None)
    n = m = 65536
    d, k, e = 768, 5, 2
    budget = panels.BUDGET_BYTES
    p = TM.suffix_rows(n, m, d, k, torch.bfloat16, True)
    # the panel's K bf16 tiles beside dB's fp32 accumulators (4 M D bytes) fit the budget; 64-row multiples
    kp, block = 8, 64  # levels padded to a power of two; the suffix kernel's 64 x 64 tiles

    def allocated(rows):  # the panel's tiles, its row and column scalars and dA rows; dB's accumulators
        return (k * rows * m * e + rows * triton.cdiv(m, block) * kp * 4 + triton.cdiv(rows, block) * kp * m * 4
                + 4 * rows * d + 4 * m * d)

    assert p % 64 == 0 and p >= panels.P_MIN
    assert allocated(p) <= budget < allocated(p + 64), (p, allocated(p), budget)
    assert TM.suffix_rows(100, 29, 40, 3, torch.bfloat16, True) == 100  # a small problem is one panel
    route(PANEL_ROWS=24)
    assert TM.suffix_rows(n, m, d, k, torch.bfloat16, True) == 24


# ---------------------------------------------------------------------------------------------
# ahead-of-time compiles (no GPU)
# ---------------------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import json

    import torch

    from fused_contrastive.core.triton_shared import launch as TL
    from fused_contrastive.core.matryoshka import triton_levels as TM
    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
    from fused_contrastive.tools import compile_survey

    def record(fam, dt, variant, n=4096, d=768, dims=(64, 128, 256, 512, 768)):
        meta = torch.device("meta")
        a, b = torch.empty(n, d, dtype=dt, device=meta), torch.empty(n, d, dtype=dt, device=meta)
        i64 = dict(dtype=torch.int64, device=meta)
        data, coef, tgt = CoreData(), Coeffs(lse=1.0), None
        if variant == "tgt":  # InfoNCE: the target term in the tiles
            tgt = (torch.empty(n, **i64), torch.empty(len(dims), n, device=meta))
        if variant in ("pos", "set"):  # SupCon in: the positives' softmax beside the LSE's; out: the SET term
            data = CoreData(row_labels=torch.empty(n, **i64), col_labels=torch.empty(n, **i64))
            coef = Coeffs(lse=1.0, pos=-1.0) if variant == "pos" else Coeffs(lse=1.0, set=-1.0)
        s = torch.empty((), device=meta)
        with compile_survey.recording(fam) as launches:
            lv = TM._Levels(a, b, CoreSpec(), data, coef.pos is not None, dims)
            lse, lc, lp = TM._fwd(lv, s, CoreSpec(), False)
            g = torch.empty(len(dims), n, device=meta)
            if variant == "set":  # the SET term's weights in the tiles (HAS_SET), its positives' fields
                lv.p = TL.with_positives(lv.p, lv.p.a, lv.p.b, CoreSpec(), data)
            TM._bwd_suffix(lv, s, CoreSpec(), lse, lc, lp, g, None, g if lp is not None else None, True, True, True,
                           tgt, g_set=g if variant == "set" else None, exact=tgt is not None)
        (x,) = {x.name: x for x in launches if x.name == "mat_epi"}.values()
        return x

    out = []
    # the variants that spilled most at other tile shapes (fp16's target term, bf16's positives), one per arch
    for (cc, fam), (dname, dt), variant in zip(compile_survey.TARGETS,
                                               (("bf16", torch.bfloat16), ("fp16", torch.float16)),
                                               ("pos", "tgt"), strict=True):
        r = compile_survey.compile_launch(record(fam, dt, variant), cc)
        r.update(dtype=dname, variant=variant)
        out.append(r)
    # SupCon out's SET weights in the tiles (HAS_SET), bf16, on both
    for cc, fam in compile_survey.TARGETS:
        r = compile_survey.compile_launch(record(fam, torch.bfloat16, "set"), cc)
        r.update(dtype="bf16", variant="set")
        out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_SCRIPT, 900)


def test_the_suffix_kernel_compiles_without_spills(compiled):
    assert {(r["cc"], r["dtype"], r["variant"]) for r in compiled} == {(80, "bf16", "pos"), (90, "fp16", "tgt"),
                                                                       (80, "bf16", "set"), (90, "bf16", "set")}
    assert_no_spills_within_smem(compiled)
    assert_tensor_cores(compiled)
    for r in compiled:
        # the operands arrive in 16-byte cp.async copies of the software pipeline (levels on 64-wide chunks)
        assert r["ld_b16"] == 0 and r["cp_async_16"] > 0 and r["num_stages"] == 3, r
