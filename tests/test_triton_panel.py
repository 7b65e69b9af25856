"""The panel path of backend="triton" (``core/lse/triton_panel.py`` + ``kernels/panel.py``), the fp16
pre-scale of every gradient tile and the compact dense positive mask.

Under the CPU interpreter (conftest.py) the panel path's GEMMs are ``torch.mm`` on CPU tensors and its
Triton kernel runs interpreted; ``FUSED_CONTRASTIVE_TRITON_PATH=panel`` forces the path (on the CPU
"auto" takes the fused kernels, which tests/test_triton.py covers) and the switchboard's ``PANEL_ROWS``
forces small panels, so every test runs several panels with a ragged last one. Every kernel output is
poisoned with NaN before its launch and the registry inputs are views into NaN-padded buffers, as in
tests/test_triton.py. The compile tests lower the panel kernel (and the fused kernels with a 1-byte
mask) for sm_80 / sm_90 in a subprocess with ``TRITON_INTERPRET=0``.
"""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from test_memory import LargestTensor  # tests/ is on sys.path (rootdir-relative imports, no package)

import fused_contrastive as fc
from fused_contrastive.core.lse import torch_chunked, triton_function
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.testing import CASE_BY_NAME, CASES, assert_close, compare
from fused_contrastive.testing.accuracy import make_inputs, run
from tests._compiles import run_compile_script
from tests._flops import MatmulFlops
from tests._wide import WideTensors

CORE_CASES = [c for c in CASES if c.op == "core"]
PANEL = 40  # rows per panel in the parity tests: 97 rows -> 40 + 40 + 17, 130 -> 4 panels


@pytest.fixture(autouse=True)
def _panel_path(monkeypatch, route):
    """The panel path with small panels, kernels (not the dense path), outputs poisoned, quiet numpy."""
    route(DENSE="0", PANEL_ROWS=PANEL)
    # the path through the environment: test_path_choice reads the variable itself (an override would win)
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "panel")
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


class _Launches:
    """Records the names (and args) of the launches while still running them."""

    def __init__(self, monkeypatch):
        self.launches = []
        orig = TL._launch

        def launch(x):
            self.launches.append(x)
            orig(x)

        monkeypatch.setattr(TL, "_launch", launch)

    @property
    def names(self) -> list[str]:
        return [x.name for x in self.launches]


# 1. Every InfoNCE-family case of the registry on the panel path, fp32, against the float64 reference
# (THE accuracy rule of testing.accuracy). Shapes rotate: 97 x 100 (prime rows: panels 40 + 40 + 17,
# D not a power of two), 130 x 300 (4 panels, D streamed), 100 x 3 (a tiny D).
ROTATION = [(97, 100), (130, 300), (100, 3)]


@pytest.mark.parametrize("case", CORE_CASES, ids=[c.name for c in CORE_CASES])
def test_registry_case_fp32(case, monkeypatch):
    n, d = ROTATION[CORE_CASES.index(case) % len(ROTATION)]
    rec = _Launches(monkeypatch)
    c = compare(case, n, d, torch.float32, "triton", canary=True)
    assert c.ok, (n, d, c)
    # the backward really ran on panels (several, unless the case has <= PANEL anchor rows, as
    # supcon_one's N / 3), no fused backward kernel
    panels = [x for x in rec.launches if x.name == "panel_dl"]
    rows = max(x.args["r0"] + x.args["P"] for x in panels)
    assert len(panels) >= min(2, -(-rows // PANEL)), rec.names
    assert not {"lse_bwd_rows", "lse_bwd_cols"} & set(rec.names), rec.names


# 16-bit operands on the cases that switch on each kernel branch: EAGER (info_nce, simcse_sup_hard with
# a bias column, dscl_queue with label positives and grad_cols), a column term (clip_scale), the
# symmetric path with a column term (clip_self) and with a dense mask (supcon_mask_in).
LOWP = ["info_nce", "simcse_sup_hard", "dscl_queue", "clip_scale", "clip_self", "supcon_mask_in"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", LOWP)
def test_registry_case_low_precision(name, dtype):
    c = compare(CASE_BY_NAME[name], 97, 100, dtype, "triton", canary=True)
    assert c.ok, c


@pytest.mark.parametrize("mode", ["eager", "column", "per_row"])
def test_core_every_term_against_the_chunked_path(mode):
    """Mixed coefficients, exclude_self with an offset, a bias column, label positives, grad_cols, a
    tensor temperature: the eager sweep (summed, no column term) and the recomputing backward (a column
    term; a per-row output)."""
    reduce = mode != "per_row"
    a, b = torch.randn(100, 30), torch.randn(70, 30, generator=torch.Generator().manual_seed(1))
    s = torch.tensor(10.0)
    g = torch.Generator().manual_seed(2)
    lab_a, lab_b = torch.randint(0, 3, (100,), generator=g), torch.randint(0, 3, (70,), generator=g)
    spec = CoreSpec(exclude_self=True, offset=5, bias=0.3, grad_cols=50)
    data = CoreData(row_labels=lab_a, col_labels=lab_b, bias_col=torch.randint(0, 70, (100,), generator=g))
    coef = Coeffs(lse=torch.rand(100, generator=g), pos=-0.5,
                  col=torch.rand(70, generator=g) if mode == "column" else None)
    res = []
    for impl, dt in ((triton_function, torch.float32), (torch_chunked, torch.float64)):
        x = [v.to(dt).requires_grad_() for v in (a, b, s)]
        out = impl.core(*x, spec, data, coef, reduce)
        res.append((out, *torch.autograd.grad(out.sum(), x)))
    for got, want, what in zip(res[0], res[1], ("loss", "dA", "dB", "ds"), strict=True):
        assert_close(got, want, atol=2e-5, rtol=2e-5, what=what)
    assert torch.equal(res[0][2][50:], torch.zeros_like(res[0][2][50:]))  # queue rows: no gradient


def test_normalize_false_and_clamped_rows():
    # raw dot products, a zero row and a tiny row (clamped to eps: gradient g / eps, no projection), and
    # rows of norm ~1e30 (the per-row power of two keeps the GEMM's products finite)
    q, k = torch.randn(40, 20) * 0.2, torch.randn(50, 20, generator=torch.Generator().manual_seed(1)) * 0.2
    tgt = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(2))
    got = fc.info_nce(q, k, tgt, temperature=0.5, normalize=False, backend="triton")
    want = fc.info_nce(q.double(), k.double(), tgt, temperature=0.5, normalize=False, backend="reference")
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="normalize=False")
    q2, k2 = torch.randn(40, 20), torch.randn(50, 20, generator=torch.Generator().manual_seed(1))
    q2[7], q2[8], k2[9], k2[10] = 0, 4e-14, 4e-14, 0
    grads = []
    for be, dt in (("triton", torch.float32), ("reference", torch.float64)):
        a, b = q2.to(dt).clone().requires_grad_(), k2.to(dt).clone().requires_grad_()
        fc.info_nce(a, b, tgt, temperature=0.5, backend=be).backward()
        grads.append((a.grad, b.grad))
    for g, w in zip(*grads, strict=True):
        assert_close(g, w, atol=1e-5 * float(w.abs().max()), what="clamped rows")
    big = fc.info_nce(q * 1e30, k * 1e30, backend="triton")
    assert_close(big, fc.info_nce(q.double(), k.double(), backend="reference"), atol=1e-5, rtol=1e-5, what="1e30")


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


def test_second_backward_through_a_retained_graph():
    # the eager sweep's gradients are used once; a second backward recomputes from the saved statistics
    q = torch.randn(70, 24).requires_grad_()
    k = torch.randn(90, 24, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss = fc.info_nce(q, k, torch.arange(70), temperature=0.1, backend="triton")
    g1 = torch.autograd.grad(loss, (q, k), retain_graph=True)
    g2 = torch.autograd.grad(loss, (q, k))
    ref = torch.autograd.grad(fc.info_nce(q.double(), k.double(), torch.arange(70), temperature=0.1,
                                          backend="reference"), (q, k))
    for x, y, r in zip(g1, g2, ref, strict=True):
        assert_close(x, r, atol=1e-6, rtol=1e-5, what="first backward")
        assert_close(y, r, atol=1e-6, rtol=1e-5, what="second backward")


def test_frozen_keys_and_no_grad():
    q, k = torch.randn(50, 16).requires_grad_(), torch.randn(60, 16, generator=torch.Generator().manual_seed(1))
    t = torch.tensor(0.1)
    fc.info_nce(q, k, torch.arange(50), temperature=t, backend="triton").backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and k.grad is None and t.grad is None
    with torch.no_grad():  # nothing needs a gradient: the fused forward, no sweep
        out = fc.info_nce(q, k, torch.arange(50), backend="triton")
    assert_close(out, fc.info_nce(q.double(), k.double(), torch.arange(50), backend="reference"),
                 atol=1e-5, rtol=1e-5, what="no_grad")


def test_nan_input_gives_nan():
    q, k = torch.randn(50, 40), torch.randn(60, 40, generator=torch.Generator().manual_seed(1))
    k[7, 3] = float("nan")
    out = fc.info_nce(q.requires_grad_(), k, torch.arange(50), reduction="sum", backend="triton")
    assert torch.isnan(out)


# 1b. The one-pass sweep (kernels/panel.py, ONE_PASS) and its exact two-pass fallback


def test_one_pass_sweep_and_its_fallback(monkeypatch):
    """Temperature 0.01 (|s| = 100), keys clustered around a direction u: rows 0-31 sit at cosine ~0.95
    to their key (logits reach ~c - 5: one pass), rows 32-63 point away from u (every cosine ~-0.9:
    logits ~c - 190, where exp(l - c) underflows even in fp32, so without the exact two-pass fallback
    their LSE would be -inf). Loss and both gradients against float64; the row weights W the kernel
    returns against W_i = exp(|s| - 56 - LSE_i) (the kernel's shifted bound m = c - 56; mean reduction:
    g_i / gscale = 1) from float64 logits."""
    g = torch.Generator().manual_seed(0)
    n, m, d, s = 64, 80, 32, 100.0
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    k = u + 0.2 * torch.randn(m, d, generator=g) / d ** 0.5
    q = torch.cat([k[:32] + 0.05 * torch.randn(32, d, generator=g) / d ** 0.5,
                   -u + 0.2 * torch.randn(32, d, generator=g) / d ** 0.5])
    rec = _Launches(monkeypatch)
    res = []
    for be, dt in (("triton", torch.float32), ("reference", torch.float64)):
        a, b = q.to(dt).requires_grad_(), k.to(dt).requires_grad_()
        loss = fc.info_nce(a, b, torch.arange(n), temperature=1 / s, backend=be)
        res.append((loss, *torch.autograd.grad(loss, (a, b))))
    for got, want, what in zip(res[0], res[1], ("loss", "dq", "dk"), strict=True):
        assert_close(got, want, atol=2e-5, rtol=2e-5, what=what)
    panels = [x for x in rec.launches if x.name == "panel_dl"]
    assert panels and all(x.constexprs["ONE_PASS"] for x in panels)
    w = torch.cat([x.args["W_OUT"] for x in panels]).double()
    qh, kh = F.normalize(q.double(), dim=1), F.normalize(k.double(), dim=1)
    lse = torch.logsumexp(s * qh @ kh.T, dim=1)
    # far from the redo threshold m + log(2^-64) = c - 100.4 on either side
    assert (lse[:32] - s > -40).all() and (lse[32:] - s < -150).all(), lse - s
    assert_close(w[:32], torch.exp(s - 56 - lse[:32]), rtol=1e-4, atol=0, what="one-pass row weights")
    assert torch.equal(w[32:], torch.ones(32, dtype=torch.float64))  # the fallback's rows: W = 1


def test_one_pass_is_chosen_where_documented(monkeypatch):
    rec = _Launches(monkeypatch)
    q, k = torch.randn(50, 16).requires_grad_(), torch.randn(60, 16).requires_grad_()
    expect = {}
    for name, dt, kw in (("unit rows", torch.float32, {}), ("bf16", torch.bfloat16, {}),
                         ("fp16", torch.float16, {}), ("raw dots", torch.float32, dict(normalize=False))):
        rec.launches.clear()
        fc.info_nce(q.to(dt), k.to(dt), torch.arange(50), **kw, backend="triton").backward()
        expect[name] = {x.constexprs["ONE_PASS"] for x in rec.launches if x.name == "panel_dl"}
    assert expect == {"unit rows": {True}, "bf16": {True}, "fp16": {False}, "raw dots": {False}}
    rec.launches.clear()
    feats = torch.randn(60, 16).requires_grad_()
    fc.supcon_loss(feats.reshape(30, 2, 16), torch.arange(30) % 4, variant="in", backend="triton").backward()
    assert {x.constexprs["ONE_PASS"] for x in rec.launches if x.name == "panel_dl"} == {False}  # LSEpos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_at_logit_scale_100_never_redoes(dtype, monkeypatch):
    """Ordinary data (random unit rows, best cosine of a row ~0.3-0.6) at temperature 0.01, i.e. logit
    scale |s| = 100, in 2 panels: every row block takes the single pass. The passes are counted from
    the row weights the kernel returns: the two-pass redo writes W = 1 exactly, the single pass
    W_i = exp(|s| - 56 - LSE_i), checked to 1e-4 (LSE_i spans 19-51 here, so a redone row's 1 fails
    that too). Every LSE_i < |s| - 44.4: the former bound c = |s| redid every row. Loss and gradients
    against float64."""
    g = torch.Generator().manual_seed(7)
    n, m, d, s = 64, 80, 64, 100.0
    q, k = torch.randn(n, d, generator=g).to(dtype), torch.randn(m, d, generator=g).to(dtype)
    rec = _Launches(monkeypatch)
    res = []
    for be, dt in (("triton", dtype), ("reference", torch.float64)):
        a, b = q.to(dt).requires_grad_(), k.to(dt).requires_grad_()
        loss = fc.info_nce(a, b, torch.arange(n), temperature=1 / s, backend=be)
        res.append((loss, *torch.autograd.grad(loss, (a, b))))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for got, want, what in zip(res[0], res[1], ("loss", "dq", "dk"), strict=True):
        assert_close(got.detach().double(), want.detach(), atol=tol * float(want.detach().abs().max()), rtol=tol,
                     what=what)
    panels = [x for x in rec.launches if x.name == "panel_dl"]
    assert len(panels) == 2 and all(x.constexprs["ONE_PASS"] for x in panels)
    w = torch.cat([x.args["W_OUT"] for x in panels]).double()
    lse = torch.logsumexp(s * F.normalize(q.double(), dim=1) @ F.normalize(k.double(), dim=1).T, dim=1)
    assert (lse.max() - s < -44.4).all()  # the former bound c = |s| redid every row
    redone = int((w == 1).sum())
    assert redone == 0, f"{redone} of {n} rows took the two-pass redo"
    assert_close(w, torch.exp(s - 56 - lse), rtol=1e-4 if dtype == torch.float32 else 2e-3, atol=0,
                 what="one-pass row weights")


# 1c. The epilogue GEMM (kernels/panel.py ``epi_gemm_kernel``): the panel's products in registers and the
# per-logit work as the GEMM's epilogue, forced here (FUSED_CONTRASTIVE_PANEL_GEMM=epilogue; "auto" takes
# it on CUDA only). Every core case of the registry in bf16 (half of them in fp16 too) against float64 (THE
# accuracy rule), the route per case as documented, the one-pass redo at |s| = 100, the only N x M tensor a
# 16-bit one.

EPI_CORE = [c for c in CORE_CASES]
# every case in bf16, over the first two ROTATION shapes; fp16 (the same kernels with the other operand type
# and its pre-scale) on half of them, at 97 x 100 (three panels, D ragged against the 64-wide steps) only: the
# 130 x 300 shape's D streaming in the row kernels is the same code in both 16-bit types (CI time: 90 runs
# took 7 minutes)
EPI_RUNS = [(c, torch.bfloat16) for c in EPI_CORE] + [(c, torch.float16) for i, c in enumerate(EPI_CORE)
                                                      if i % 4 in (1, 2)]


@pytest.mark.parametrize("case,dtype", EPI_RUNS, ids=[f"{c.name}-{'bf16' if t == torch.bfloat16 else 'fp16'}"
                                                      for c, t in EPI_RUNS])
def test_epilogue_gemm_registry_case(case, dtype, monkeypatch, route):
    route(PANEL_GEMM="epilogue")
    n, d = ROTATION[EPI_CORE.index(case) % 2] if dtype == torch.bfloat16 else ROTATION[0]
    rec = _Launches(monkeypatch)
    c = compare(case, n, d, dtype, "triton", canary=True)
    assert c.ok, (n, d, c)
    tiles = [x for x in rec.launches if x.name in ("epi_gemm", "panel_dl")]
    assert tiles and not {"lse_bwd_rows", "lse_bwd_cols"} & set(rec.names), rec.names
    # the epilogue GEMM forms every tile except an eager two-pass sweep's (positives' softmax, fp16) and
    # those of a loss that runs the core op in fp32 (uniformity's kernel dtype)
    cublas = [x for x in tiles if x.name == "panel_dl"]
    assert all((x.constexprs["EAGER"] and not x.constexprs["ONE_PASS"]) or x.args["DL"].dtype == torch.float32
               for x in cublas), rec.names


def test_epilogue_gemm_is_chosen_where_documented(monkeypatch):
    rec = _Launches(monkeypatch)
    q, k = torch.randn(50, 16).requires_grad_(), torch.randn(60, 16).requires_grad_()

    def kernels(gemm, dt, loss="info_nce"):
        rec.launches.clear()
        if gemm is None:
            monkeypatch.delenv("FUSED_CONTRASTIVE_PANEL_GEMM", raising=False)
        else:
            monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", gemm)
        if loss == "info_nce":
            fc.info_nce(q.to(dt), k.to(dt), torch.arange(50), backend="triton").backward()
        else:
            fc.clip_loss(q[:50].to(dt), k[:50].to(dt), 10.0, backend="triton").backward()
        return {(x.name, x.constexprs.get("MODE")) for x in rec.launches if x.name.startswith(("epi", "panel_dl"))}

    # the one pass: MODE 1, its redo (MODE 2) and the per-row bookkeeping around it (epi_rows, twice per panel)
    one_pass = {("epi_gemm", 1), ("epi_gemm_redo", 2), ("epi_rows", None)}
    assert kernels("epilogue", torch.bfloat16) == one_pass
    assert sum(x.name == "epi_rows" for x in rec.launches) == 2 * sum(x.name == "epi_gemm" for x in rec.launches)
    # CLIP: the statistics forward (MODE 3), then the backward from known statistics (MODE 0)
    assert kernels("epilogue", torch.bfloat16, "clip") == {("epi_gemm_stats", 3), ("epi_gemm", 0)}
    # fp16 with a target: off the one pass, the split statistics forward and the recomputing backward (the exact
    # target weights) where the two-pass eager sweep ran before
    assert kernels("epilogue", torch.float16) == {("epi_gemm_stats", 3), ("epi_gemm", 0)}
    assert kernels("epilogue", torch.float16, "clip") == {("epi_gemm_stats", 3), ("epi_gemm", 0)}
    assert kernels("epilogue", torch.float32) == {("panel_dl", None)}  # fp32 GEMMs stay cuBLAS
    assert kernels("cublas", torch.bfloat16) == {("panel_dl", None)}
    assert kernels(None, torch.bfloat16) == {("panel_dl", None)}  # auto on the CPU
    assert panels.use_epilogue(torch.device("meta"), torch.bfloat16)  # auto where CUDA would run
    monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", "triton")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_PANEL_GEMM"):
        panels.use_epilogue(torch.device("cpu"), torch.bfloat16)


SIGLIP_CASES = [c for c in CASES if c.op == "siglip" or c.fn.__name__ == "siglip_loss"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", SIGLIP_CASES, ids=[c.name for c in SIGLIP_CASES])
def test_epilogue_gemm_siglip(case, dtype, monkeypatch, route):
    """SigLIP's sigmoid loss on the epilogue GEMM in several panels, against float64; the fused kernels do
    not run. A summed loss (mean, sum) takes one sweep (MODE 5: the losses and the gradient tile for an
    upstream 1, scaled in the backward); per-row losses two (MODE 4: the losses, then the gradient tile
    for the upstream vector)."""
    route(PANEL_GEMM="epilogue")
    rec = _Launches(monkeypatch)
    c = compare(case, 97, 100, dtype, "triton", canary=True)
    assert c.ok, c
    sweeps = [x for x in rec.launches if x.name == "epi_gemm_siglip"]
    summed = make_inputs(case, 4, 4, 0)[1].get("reduction", "mean") != "none"
    want = [5] * 3 if summed else [4] * 6  # 3 panels of 40 + 40 + 17 rows
    assert [x.constexprs["MODE"] for x in sweeps] == want, rec.names
    assert all(x.constexprs["HAS_G"] == (x.constexprs["MODE"] == 5 or i >= 3) for i, x in enumerate(sweeps))
    assert not {"siglip_fwd", "siglip_bwd_rows", "siglip_bwd_cols"} & set(rec.names), rec.names
    # fp32 keeps the fused kernels
    rec.launches.clear()
    assert compare(case, 40, 16, torch.float32, "triton").ok
    assert "siglip_fwd" in rec.names and "epi_gemm_siglip" not in rec.names, rec.names


def test_epilogue_gemm_siglip_eager_scales_by_the_upstream_gradient(monkeypatch, route):
    """The one-pass SigLIP sweep (MODE 5) forms the gradients of a summed loss for an upstream 1 in the
    forward; the backward scales them by the upstream scalar (here 0.37), a second backward (retain_graph)
    recomputes them by the two-sweep route, and a forward without gradients forms the losses alone (MODE 4,
    no gradient tile). Each against the float64 definition (tests/test_siglip.py ``_truth``)."""
    from test_siglip import _truth

    route(PANEL_GEMM="epilogue")
    rec = _Launches(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(97, 40, generator=g, dtype=torch.float64)
    y64 = torch.randn(97, 40, generator=g, dtype=torch.float64)
    s64 = torch.tensor(7.5, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    xr, yr = x64.bfloat16().double().requires_grad_(), y64.bfloat16().double().requires_grad_()
    want_loss = _truth(xr, yr, s64, b64, reduction="sum")
    want = torch.autograd.grad(0.37 * want_loss, (xr, yr, s64, b64))
    x, y = x64.bfloat16().requires_grad_(), y64.bfloat16().requires_grad_()
    s, b = torch.tensor(7.5, requires_grad=True), torch.tensor(-3.0, requires_grad=True)
    loss = fc.siglip_loss(x, y, s, b, reduction="sum", backend="triton")
    assert [t.constexprs["MODE"] for t in rec.launches if t.name == "epi_gemm_siglip"] == [5] * 3
    rec.launches.clear()
    first = torch.autograd.grad(0.37 * loss, (x, y, s, b), retain_graph=True)
    assert not [t for t in rec.launches if t.name == "epi_gemm_siglip"], rec.names  # the forward had them
    second = torch.autograd.grad(0.37 * loss, (x, y, s, b))
    assert [t.constexprs["MODE"] for t in rec.launches if t.name == "epi_gemm_siglip"] == [4] * 3
    assert_close(loss.double(), want_loss, rtol=2e-3, atol=0, what="loss")
    for got in (first, second):
        for name, gg, ww in zip(("image", "text", "scale", "bias"), got, want, strict=True):
            assert gg.dtype == (torch.bfloat16 if gg.dim() else torch.float32), name
            tol = 2e-2 * float(ww.abs().max())  # bf16 gradient tiles and outputs
            assert_close(gg.double(), ww, rtol=0, atol=tol, what=f"grad {name}")
    rec.launches.clear()
    with torch.no_grad():
        plain = fc.siglip_loss(x, y, s, b, reduction="sum", backend="triton")
    sweeps = [t for t in rec.launches if t.name == "epi_gemm_siglip"]
    assert [(t.constexprs["MODE"], t.constexprs["HAS_G"]) for t in sweeps] == [(4, False)] * 3, rec.names
    assert torch.equal(plain, loss.detach())  # the same loss sums in the same order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_epilogue_gemm_siglip_eager_offset_wider_texts(dtype, monkeypatch, route):
    """The one pass (MODE 5) where the positives sit at column ``offset + i`` of a wider text set (the
    layout ``gather=`` hands it: this rank's images against every rank's texts), raw rows (no
    normalisation), a learnable scale and bias: loss and all four gradients against float64 autograd of the
    definition (tests/test_siglip.py ``_truth``)."""
    from test_siglip import _truth

    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn

    route(PANEL_GEMM="epilogue")
    rec = _Launches(monkeypatch)
    g = torch.Generator().manual_seed(11)
    x64 = (torch.randn(100, 24, generator=g, dtype=torch.float64) * 0.3).to(dtype).double()
    y64 = (torch.randn(150, 24, generator=g, dtype=torch.float64) * 0.3).to(dtype).double()
    leaves64 = [x64.requires_grad_(), y64.requires_grad_(), torch.tensor(3.0, dtype=torch.float64, requires_grad=True),
                torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)]
    want_loss = _truth(*leaves64, normalize=False, reduction="sum", offset=19) / 100
    want = torch.autograd.grad(want_loss, leaves64)
    leaves = [x64.detach().to(dtype).requires_grad_(), y64.detach().to(dtype).requires_grad_(),
              torch.tensor(3.0, requires_grad=True), torch.tensor(-2.0, requires_grad=True)]
    loss = TritonSigLipFn.apply(*leaves, False, 1e-12, 19, True, 1.0 / 100)
    got = torch.autograd.grad(loss, leaves)
    assert [t.constexprs["MODE"] for t in rec.launches if t.name == "epi_gemm_siglip"] == [5] * 3, rec.names
    assert_close(loss.double(), want_loss, rtol=2e-3, atol=0, what="loss")
    for name, gg, ww in zip(("image", "text", "scale", "bias"), got, want, strict=True):
        assert_close(gg.double(), ww, rtol=0, atol=2e-2 * float(ww.abs().max()), what=f"grad {name}")


@pytest.mark.parametrize("learn", [False, True], ids=["fixed", "learned-scale"])
def test_epilogue_gemm_one_pass_redo(learn, monkeypatch, route):
    """The one-pass epilogue's redo (MODE 2), in bf16 at |s| = 100: rows 0-31 near their keys (one pass),
    rows 32-63 pointing away from every key (logits ~c - 190: exp(l - m) underflows, z_i = 0 < 2^-64),
    which the redo launch recomputes with the row's own largest logit as the shift. Loss and every
    gradient against float64 on the same rounded inputs; the row weights against W_i = exp(SHIFT_i - LSE_i)
    from float64 logits, SHIFT the fixed m = |s| - 56 on rows 0-31 and the row's largest logit on 32-63."""
    route(PANEL_GEMM="epilogue")
    g = torch.Generator().manual_seed(0)
    n, m, d, s = 64, 80, 32, 100.0
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    k = (u + 0.2 * torch.randn(m, d, generator=g) / d ** 0.5).bfloat16()
    q = torch.cat([k[:32].float() + 0.05 * torch.randn(32, d, generator=g) / d ** 0.5,
                   -u + 0.2 * torch.randn(32, d, generator=g) / d ** 0.5]).bfloat16()
    weights = []
    orig = panels._epi_panel

    def spy(*args, **kw):
        out = orig(*args, **kw)
        weights.append(out[0].clone())
        return out

    monkeypatch.setattr(panels, "_epi_panel", spy)
    rec = _Launches(monkeypatch)
    res = []
    for be, dt in (("triton", torch.bfloat16), ("reference", torch.float64)):
        a, b = q.to(dt).requires_grad_(), k.to(dt).requires_grad_()
        t = torch.tensor(1 / s, dtype=torch.float64 if dt == torch.float64 else torch.float32, requires_grad=True)
        loss = fc.info_nce(a, b, torch.arange(n), temperature=t if learn else 1 / s, backend=be)
        res.append((loss, *torch.autograd.grad(loss, (a, b, t) if learn else (a, b))))
    for got, want, what in zip(res[0], res[1], ("loss", "dq", "dk", "dt"), strict=False):
        want = want.detach()
        assert_close(got.detach().double(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2, what=what)
    redo = [x for x in rec.launches if x.name == "epi_gemm_redo"]
    assert redo and sum(int(x.args["BAD"].sum()) for x in redo) == 32  # exactly the far rows
    w = torch.cat(weights).double()
    qh, kh = F.normalize(q.double(), dim=1), F.normalize(k.double(), dim=1)
    logits = s * qh @ kh.T
    lse = torch.logsumexp(logits, dim=1)
    shift = torch.cat([torch.full((32,), s - 56, dtype=torch.float64), logits[32:].amax(1)])
    # mean reduction: g_i / gscale = 1, so W_i = 1 / z_i
    assert_close(w, torch.exp(shift - lse), rtol=2e-2, atol=0, what="row weights g_i / (gscale z_i)")


@pytest.mark.parametrize("name", ["info_nce", "clip", "simcse"])
def test_epilogue_gemm_writes_no_wide_n_by_m_tensor(name, monkeypatch, route):
    """On the epilogue route the only [P, M]-shaped tensor any op creates is the 16-bit gradient tile: the
    probe records the element size of every newly stored 2-d tensor of P rows and at least M / 2 columns
    (the triangular sweep's panels narrow with each panel). The
    cuBLAS form creates its fp32 products panel (4 bytes): seen by the same probe, so the check can fail."""
    monkeypatch.setattr(TL, "POISON_OUTPUTS", False)
    p, n, d = 64, 256, 32  # four panels
    route(PANEL_ROWS=p)
    route(TILE_ELEMENTS=str(p * n))
    probe = WideTensors(p, n // 2)
    monkeypatch.setattr(panels, "_mm32", probe.counted(panels._mm32, "_mm32"))
    monkeypatch.setattr(panels, "_addmm32_", probe.counted(panels._addmm32_, "_addmm32_"))
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(n, d, torch.Generator().manual_seed(0))
    widths, seen = {}, {}
    for gemm in ("epilogue", "cublas"):
        route(PANEL_GEMM=gemm)
        probe.seen = []
        with probe:
            run(case, (tensors, kwargs), "triton", torch.bfloat16)
        widths[gemm] = {size for _, size, _ in probe.seen}
        seen[gemm] = probe.seen
    assert widths["epilogue"] == {2}, seen["epilogue"]
    assert 4 in widths["cublas"], seen["cublas"]  # the products panel of the cuBLAS form


# 1b'. The fp32-output GEMMs of 16-bit operands (panels.gemm_routes): the probe, its cached
# verdict and every fallback, forced on the CPU with stand-ins for the out_dtype calls (the CPU has
# none: torch 2.13 "Could not run 'aten::mm.dtype' ... CPU")


def _stand_ins(mm_kind: str, addmm_kind: str, calls: dict):
    """Stand-ins for torch.mm / torch.addmm with out_dtype: "ok" (an fp32 result of fp32 accumulation,
    as cuBLAS gives), "raises" (as a torch without the overload or with pytorch #154086's check),
    "mismatch" (a 16-bit product widened: the precision the fallback exists to keep)."""

    def mm(x, y):
        calls["mm"] += 1
        if mm_kind == "raises":
            raise RuntimeError("self and mat2 must have the same dtype")
        if mm_kind == "mismatch":
            return torch.mm(x, y).float()
        return torch.mm(x.double(), y.double()).float()

    def addmm(acc, x, y):
        calls["addmm"] += 1
        if addmm_kind == "raises":
            raise RuntimeError("self and mat2 must have the same dtype")
        acc.add_(torch.mm(x, y).float() if addmm_kind == "mismatch" else torch.mm(x.double(), y.double()).float())

    return {"mm": mm, "addmm": addmm}


ROUTE_CASES = {  # (mm stand-in, addmm stand-in) -> the routes the probe must pick
    ("ok", "ok"): ("native", "native"),
    ("raises", "raises"): ("upcast", "upcast"),
    ("mismatch", "mismatch"): ("upcast", "upcast"),
    ("ok", "raises"): ("native", "mm_add"),
    ("ok", "mismatch"): ("native", "mm_add"),
}


@pytest.mark.parametrize("kinds", list(ROUTE_CASES), ids=["-".join(k) for k in ROUTE_CASES])
def test_gemm_probe_routes_against_float64(kinds, monkeypatch):
    """Probe forced on the CPU: the route per verdict, a warning per failed op (once: the verdict is
    cached per device and dtype), the stand-in never called again after it failed, and on every route
    the eager sweep (dB through the accumulator, 3 panels) and the triangular sweep (offsets r0 > 0,
    the off-diagonal update) against float64, bf16 operands."""
    calls = {"mm": 0, "addmm": 0}
    monkeypatch.setattr(panels, "GEMM_PROBE_DEVICES", ("cpu",))
    monkeypatch.setattr(panels, "_GEMM_ROUTES", {})
    monkeypatch.setattr(panels, "NATIVE_GEMMS", _stand_ins(*kinds, calls))
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(97, 24, generator=gen).to(torch.bfloat16)
    k = torch.randn(90, 24, generator=gen).to(torch.bfloat16)
    rec = _Launches(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = []
        for be, dt in (("triton", torch.bfloat16), ("reference", torch.float64)):
            a, b = q.to(dt).requires_grad_(), k.to(dt).requires_grad_()
            l1 = fc.info_nce(a, b, torch.arange(90).repeat(2)[:97], temperature=0.1, backend=be)
            l2 = fc.simcse_loss(b, temperature=0.1, backend=be)  # B is A: the triangular sweep
            res.append((l1, l2, *torch.autograd.grad(l1 + l2, (a, b))))
    fails = [w for w in caught if "fp32-output" in str(w.message)]
    assert panels.gemm_routes(torch.device("cpu"), torch.bfloat16) == ROUTE_CASES[kinds]
    assert len(fails) == sum(x != "ok" for x in kinds), [str(w.message) for w in fails]
    probes = {"mm": 1, "addmm": 1}
    for op, kind in zip(("mm", "addmm"), kinds, strict=True):
        if kind != "ok":  # the probe's call only
            assert calls[op] == probes[op], calls
        else:  # the probe's call and the sweeps'
            assert calls[op] > probes[op] + 2, calls
    if kinds == ("ok", "raises"):  # mm_add: the accumulator updates go through the native mm
        assert calls["mm"] > 6, calls
    # each route's GEMM directly: fp32 accuracy against float64 (a 16-bit output would be ~2^-9 off)
    x = torch.randn(50, 300, generator=gen).to(torch.bfloat16)
    y = torch.randn(40, 300, generator=gen).to(torch.bfloat16)
    acc0 = torch.randn(50, 40, generator=gen)
    acc = acc0.clone()
    panels._addmm32_(acc, x, y.T)
    want = x.double() @ y.double().T
    bound = (x.double().abs() @ y.double().abs().T) * 2.0 ** -18 + acc0.abs().double() * 2.0 ** -22
    assert ((panels._mm32(x, y.T).double() - want).abs() <= bound).all(), f"mm route {kinds}"
    assert ((acc.double() - acc0.double() - want).abs() <= bound).all(), f"addmm route {kinds}"
    tri = [x for x in rec.launches if x.name == "panel_dl" and x.constexprs["TRI"]]
    assert len(tri) == 3 and len(rec.launches) > len(tri) + 3  # 90 rows: triangular panels 40 + 40 + 10
    # the losses to fp32 accuracy (the logits GEMM's fp32 output: a 16-bit one is off by ~1e-2 here),
    # the bf16 gradients to a few bf16 roundings
    for got, want, what in zip(res[0], res[1], ("info_nce", "simcse", "dq", "dk"), strict=True):
        tol = 1e-5 if want.dim() == 0 else 2e-2
        assert_close(got.detach().double(), want.detach(), atol=tol * float(want.detach().abs().max()), rtol=tol,
                     what=f"{what} {kinds}")



def test_gemm_probe_waits_for_an_eager_call(monkeypatch):
    """While torch.compile traces (fake tensors: no values to compare), no probe runs and nothing is
    cached: the fallback, whose product is the float64 one to fp32 accuracy; the next eager call probes."""
    calls = {"mm": 0, "addmm": 0}
    monkeypatch.setattr(panels, "GEMM_PROBE_DEVICES", ("cpu",))
    monkeypatch.setattr(panels, "_GEMM_ROUTES", {})
    monkeypatch.setattr(panels, "NATIVE_GEMMS", _stand_ins("ok", "ok", calls))
    x = torch.randn(30, 200, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = panels._mm32(x, x.T)
    assert calls == {"mm": 0, "addmm": 0} and panels._GEMM_ROUTES == {}
    want = x.double() @ x.double().T
    assert ((got.double() - want).abs() <= (x.double().abs() @ x.double().abs().T) * 2.0 ** -18).all()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert panels.gemm_routes(torch.device("cpu"), torch.bfloat16) == ("native", "native")
    assert calls == {"mm": 1, "addmm": 1}


# 1c. The triangular sweep of symmetric logits (B is A without a bias; the triangular fused forward,
# triton_fused._lse_fwd with tri, and triton_panel.tri_backward)


def _tri_fwd(rec) -> bool:
    """Whether the recorded launches include the triangular forward (lse_fwd with TRI)."""
    return any(x.name == "lse_fwd" and x.constexprs.get("TRI") for x in rec.launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", ["sum", "per_row", "raw", "self_in"])
def test_triangular_sweep_against_float64(mode, dtype, monkeypatch):
    """B is A: per-row coefficients, a tensor temperature, a zero row and a tiny row (clamped norms; not fp16);
    97 rows in panels of 40 + 40 + 17 (the last panel has no rows below it). "raw": normalize=False;
    "self_in": the own column kept (the diagonal block's l_ii). Loss, dA and ds against the torch_chunked
    path in float64; the launches are the triangular sweep's."""
    rec = _Launches(monkeypatch)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(97, 40, generator=g)
    if dtype != torch.float16:  # fp16 cannot hold a clamped row's gradient g / eps (~1e10)
        a[11], a[12] = 0, 3e-13
    if mode == "raw":
        a = a * 0.3
    spec = CoreSpec(exclude_self=mode != "self_in", normalize=mode != "raw")
    coef = Coeffs(lse=torch.rand(97, generator=g) + 0.5)
    reduce = mode != "per_row"
    w = torch.rand(97, generator=g)  # upstream weights of the per-row output
    res = []
    for impl, dt in ((triton_function, dtype), (torch_chunked, torch.float64)):
        x = a.to(dtype).to(dt).requires_grad_()
        s = torch.tensor(7.0, dtype=dt if dt == torch.float64 else torch.float32, requires_grad=True)
        out = impl.core(x, None, s, spec, CoreData(), coef, reduce)
        tot = out.sum() if reduce else (out * w.to(out.dtype)).sum()
        res.append((out, *torch.autograd.grad(tot, (x, s))))
    assert _tri_fwd(rec) and [x.constexprs["TRI"] for x in rec.launches if x.name == "lse_fwd"] == [True], rec.names
    assert {x.constexprs["TRI"] for x in rec.launches if x.name == "panel_dl"} == {True}
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    for got, want, what in zip(res[0], res[1], ("loss", "dA", "ds"), strict=True):
        got, want = got.detach().double(), want.detach()
        # the clamped rows' gradients (~1 / eps = 1e10) get their own scale: one scale for all rows
        # would hide the rest (a missing off-diagonal update passed that way)
        parts = [None] if what != "dA" else \
            [(torch.arange(97) != 11) & (torch.arange(97) != 12), (torch.arange(97) == 11) | (torch.arange(97) == 12)]
        for sel in parts:
            w_, g_ = (want, got) if sel is None else (want[sel], got[sel])
            scale = float(w_.abs().max())
            assert_close(g_, w_, atol=tol * max(scale, 1.0), rtol=tol, what=f"{what} ({mode})")


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("exclude_self", [True, False], ids=["self_out", "self_in"])
def test_triangular_sweep_tiny_batches(n, exclude_self, monkeypatch, route):
    # panels of 2 rows: a last panel of one row, and N = 1 with its own column out (no column at all:
    # LSE -inf, as the torch_chunked path gives); per-row outputs with distinct upstream weights
    route(PANEL_ROWS=2)
    rec = _Launches(monkeypatch)
    a = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
    res = []
    for impl, dt in ((triton_function, torch.float32), (torch_chunked, torch.float64)):
        x = a.to(dt).requires_grad_()
        s = torch.tensor(3.0, dtype=dt, requires_grad=True)
        out = impl.core(x, None, s, CoreSpec(exclude_self=exclude_self), CoreData(), Coeffs(1.0), False)
        w = torch.arange(1, n + 1, dtype=dt)
        tot = (torch.where(torch.isfinite(out), out, 0.0) * w).sum()
        res.append((out.detach(), *torch.autograd.grad(tot, (x, s), allow_unused=True)))
    # the triangular forward, then the triangular backward's panels
    assert _tri_fwd(rec) and rec.names.count("panel_dl") == -(-n // 2), rec.names
    assert torch.equal(torch.isfinite(res[0][0]), torch.isfinite(res[1][0]))
    for got, want, what in zip(res[0], res[1], ("lse", "dA", "ds"), strict=True):
        if want is None:
            assert got is None or not got.any(), what
            continue
        assert_close(torch.where(torch.isfinite(got), got, 0.0).double(), torch.where(torch.isfinite(want), want, 0.0),
                     atol=2e-6, rtol=2e-6, what=what)


def test_triangular_sweep_is_chosen_where_documented(monkeypatch):
    rec = _Launches(monkeypatch)
    feats = torch.randn(60, 16).requires_grad_()

    def tri(fn) -> bool:
        rec.launches.clear()
        fn().backward()
        return _tri_fwd(rec)

    assert tri(lambda: fc.simcse_loss(feats, backend="triton"))  # symmetric SimCSE
    tgt = (torch.arange(60) + 1) % 60
    assert tri(lambda: fc.info_nce(feats, None, tgt, backend="triton"))
    # uniformity runs on augmented rows [2t x, -t|x|^2, 1] against [x, 1, -t|x|^2] (exact for zero rows):
    # A and B differ, so not the triangular sweep
    assert not tri(lambda: fc.uniformity(feats, backend="triton"))
    # a column term (CLIP of A against itself) or a softmax over positives: not the triangular sweep
    assert not tri(lambda: fc.info_nce(feats, None, symmetric=True, exclude_self=False, backend="triton"))
    assert not tri(lambda: fc.supcon_loss(feats.reshape(30, 2, 16), torch.arange(30) % 4, variant="in",
                                          backend="triton"))
    assert not tri(lambda: fc.info_nce(feats, torch.randn(70, 16), torch.arange(60), backend="triton"))


def test_triangular_sweep_matmul_flops(monkeypatch):
    """The GEMM FLOPs of a forward + backward of symmetric logits, counted by a dispatch mode on
    aten.mm / addmm: the forward has none (the triangular fused forward: half a unit inside the
    kernel); per backward panel [r0, r1) of P rows and C = N - r0 columns, the logits (2 P C D),
    H @ A[r0:] (2 P C D) and H[:, P:]^T @ A_P (2 P (C - P) D) - 1.5 matmul units plus half the diagonal
    blocks; with the forward, 2 units where the eager sweep spends 3."""
    n, d, p = 130, 24, 40
    feats = torch.randn(n, d).requires_grad_()
    with MatmulFlops() as counted:
        fc.simcse_loss(feats, backend="triton").backward()
    hand = 0
    for r0 in range(0, n, p):
        pp, c = min(p, n - r0), n - r0
        hand += 2 * 2 * pp * c * d + 2 * pp * (c - pp) * d
    unit = 2 * n * n * d
    assert counted.flops == hand, (counted.flops, hand)
    assert 1.5 * unit < hand < 2 * unit  # 1.5 units + the diagonal blocks (P / N of a unit)


def test_panel_blocks_rule():
    # (rows per program, chunk) from the documented rule: the most rows that still give `programs`
    assert panels.panel_blocks(1216, 264) == (4, 512)  # N = 65536 on an H100 (132 SMs)
    assert panels.panel_blocks(320, 264) == (1, 2048)  # N = 131072
    assert panels.panel_blocks(40, 1) == (16, 128)  # the interpreter
    assert panels.panel_blocks(40, 8) == (4, 512)


@pytest.mark.parametrize("programs", [8, 10 ** 6], ids=["4-rows", "1-row"])
@pytest.mark.parametrize("name", ["info_nce", "supcon_mask_in", "clip_scale"])
def test_narrow_blocks(name, programs, monkeypatch, route):
    """The GPU's block shapes (4 x 512 and 1 x 2048 here) on the one-pass, two-pass and column paths."""
    route(PANEL_PROGRAMS=programs)
    rec = _Launches(monkeypatch)
    c = compare(CASE_BY_NAME[name], 97, 100, torch.float32, "triton", canary=True)
    assert c.ok, c
    want = panels.panel_blocks(PANEL, programs)
    assert {(x.constexprs["BLOCK_R"], x.constexprs["BLOCK_C"]) for x in rec.launches if x.name == "panel_dl"} == {want}


# 2. Which path runs


def test_path_choice(monkeypatch):
    x = torch.empty(4, 4)
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "auto")
    assert not panels.use_panel(x, 1 << 20, 1 << 20)  # CPU: the fused kernels whatever the size
    assert not panels.use_panel(torch.empty(4, 4, device="meta"), 1 << 20, 1 << 20)
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "fused")
    assert not panels.use_panel(x, 8, 8)
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "panel")
    assert panels.use_panel(x, 8, 8)
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "gemm")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_TRITON_PATH"):
        panels.use_panel(x, 8, 8)


def test_forced_fused_path_launches_no_panel(monkeypatch, route):
    route(TRITON_PATH="fused")
    rec = _Launches(monkeypatch)
    q = torch.randn(40, 16).requires_grad_()
    fc.info_nce(q, torch.randn(50, 16), torch.arange(40), backend="triton").backward()
    assert "panel_dl" not in rec.names and "lse_bwd_rows" in rec.names


def test_panel_height_formula(monkeypatch, route):
    """The documented budget: at N = M = 131072, D = 768, bf16 the whole extra memory < 0.72 GB."""
    route(PANEL_ROWS=None)
    n = m = 131072
    d = 768
    p = panels.panel_rows(n, m, d, torch.bfloat16, True)
    extra = 4 * m * d + p * ((4 + 2) * m + (4 + 4) * d + 16) + 64 * (n + m)  # + O(N + M) vectors, generously
    assert p == 320 and extra < 0.72e9, (p, extra)
    assert panels.panel_rows(65536, 65536, d, torch.bfloat16, True) == 1216
    route(PANEL_BUDGET="1000")  # a budget too small: the floor
    assert panels.panel_rows(n, m, d, torch.bfloat16, True) == panels.P_MIN


# 3. Memory: no tensor larger than one panel (P x M), with D <= P so the O(M D) accumulator is smaller


@pytest.mark.parametrize("name", ["info_nce", "clip", "simcse", "supcon_mask_in", "dscl_queue"])
def test_no_tensor_larger_than_a_panel(name, monkeypatch, route):
    monkeypatch.setattr(TL, "POISON_OUTPUTS", False)
    p, n, d = 64, 256, 32  # four panels
    route(PANEL_ROWS=p)
    # the O(N*D) positive terms (core/linear_terms.py) take a one-tile shortcut within the tile budget: hold
    # them to one panel's size as well
    route(TILE_ELEMENTS=str(p * n))
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(n, d, torch.Generator().manual_seed(0))
    rec = _Launches(monkeypatch)
    with LargestTensor() as probe:
        run(case, (tensors, kwargs), "triton", torch.float32)
    launched = [x for x in rec.launches if x.name == "panel_dl"]
    assert len(launched) >= 2 and all(x.args["P"] <= p for x in launched)
    m = launched[0].args["M"]  # the contrast set's rows (a queue, views, ...)
    assert m >= n
    assert probe.largest <= p * m, f"largest tensor {probe.largest} > P x M = {p * m} ({probe.op})"


@pytest.mark.parametrize("name", ["info_nce", "simcse", "clip"])
def test_one_logits_panel_alive_at_a_time(name, monkeypatch, route):
    # the workspace formula counts one [P, M] fp32 panel: when the next panel's logits GEMM runs, no
    # earlier panel may still be referenced (weak references to every GEMM output of the sweep)
    import gc
    import weakref

    monkeypatch.setattr(TL, "POISON_OUTPUTS", False)
    route(PANEL_ROWS=64)
    alive: list[weakref.ref] = []
    orig = panels._mm32
    counts = []

    def mm32(x, y):
        gc.collect()
        counts.append(sum(r() is not None for r in alive))
        out = orig(x, y)
        if out.shape[0] <= 64 and out.shape[1] >= 128:  # a logits panel (not the dA GEMM's [P, D])
            alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(panels, "_mm32", mm32)
    case = CASE_BY_NAME[name]
    tensors, kwargs = case.build(320, 32, torch.Generator().manual_seed(0))  # five panels
    run(case, (tensors, kwargs), "triton", torch.float32)
    assert len(alive) >= 4 and max(counts) == 0, counts


# 4. fp16 pre-scale: p ~ 1/M is subnormal in fp16 for most entries at large M


def _fp16_problem(m: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 16, generator=g).half()
    k = torch.randn(m, 16, generator=g).half()
    w = torch.full((16,), 1e-3)  # per-row upstream weights: most rows 1e-3 of the largest (as in a
    w[0] = 1.0                   # weighted mean), so dl / gscale ~ 1e-3 / M
    return q, k, 20.0, w


def _rows(q, k, s):
    qd, kd = q.double(), k.double()
    qh, kh = qd / qd.norm(dim=1, keepdim=True), kd / kd.norm(dim=1, keepdim=True)
    return qd, qh, kh, torch.softmax(s * qh @ kh.T, dim=1)


def _norm_bwd(da_hat, qd, qh):
    return (da_hat - qh * (da_hat * qh).sum(1, keepdim=True)) / qd.norm(dim=1, keepdim=True)


def _no_prescale_emulation(q, k, s, w):
    """dL/dq of sum_i w_i LSE_i with the gradient tile cast to fp16 WITHOUT a pre-scale (dl / gscale
    rounded through fp16, subnormals included, gscale = max w = 1), the normalised keys rounded to fp16
    as the kernels' operand, float64 elsewhere. Written from the math, independently of the kernels."""
    qd, qh, kh, p = _rows(q, k, s)
    dl = w.double()[:, None] * p
    return _norm_bwd(s * (dl.half().double() @ kh.half().double()), qd, qh)


def _truth(q, k, s, w):
    qd, qh, kh, p = _rows(q, k, s)
    return _norm_bwd(s * ((w.double()[:, None] * p) @ kh), qd, qh)


def _row_rel(x, y):
    """The largest relative error of a row (every row's gradient counts, whatever its weight)."""
    return float(((x.double() - y).norm(dim=1) / y.norm(dim=1)).max())


@pytest.mark.parametrize("path", ["panel", "fused"])
def test_fp16_prescale_beats_the_plain_cast(path, monkeypatch, route):
    m = 8192  # p ~ 1/8192 = 1.2e-4, and 1e-3 of it for the light rows: far below fp16's 6.1e-5
    route(TRITON_PATH=path)
    route(PANEL_ROWS=8)  # two panels
    q, k, s, w = _fp16_problem(m)
    truth = _truth(q, k, s, w)
    x = q.clone().requires_grad_()
    out = triton_function.core(x, k, s, CoreSpec(), CoreData(), Coeffs(lse=w), True)
    got = torch.autograd.grad(out, x)[0]
    plain = _no_prescale_emulation(q, k, s, w).half()  # returned in fp16, as the kernels' gradient
    e_got, e_plain = _row_rel(got, truth), _row_rel(plain, truth)
    # pre-scaled: the fp16 rounding of the operands and the result (2^-11 each); the plain cast loses
    # the light rows' weights to fp16 subnormals
    assert e_got < 3e-3 and e_plain > 5 * e_got, (e_got, e_plain)


# 5. The compact dense mask


@pytest.mark.parametrize("path", ["panel", "fused"])
@pytest.mark.parametrize("kind", ["bool", "uint8", "weights"])
def test_dense_mask_is_compact(kind, path, monkeypatch, route):
    """A 0/1 mask reaches the kernels as 1 byte per entry (bool: the user's storage viewed as uint8, no
    copy); general weights as float32. Values match the reference in every case."""
    route(TRITON_PATH=path)
    g = torch.Generator().manual_seed(0)
    bsz = 40
    feats = torch.randn(bsz, 2, 24, generator=g)
    m01 = torch.rand(bsz, bsz, generator=g) < 0.3
    mask = {"bool": m01, "uint8": m01.to(torch.uint8),
            "weights": m01.float() * torch.rand(bsz, bsz, generator=g) * 2}[kind]
    rec = _Launches(monkeypatch)
    res = []
    for be, dt in (("triton", torch.float32), ("reference", torch.float64)):
        x = feats.to(dt).requires_grad_()
        loss = fc.supcon_loss(x, mask=mask, variant="in", backend=be)
        res.append((loss, torch.autograd.grad(loss, x)[0]))
    assert_close(res[0][0], res[1][0], atol=1e-5, rtol=1e-5, what="loss")
    assert_close(res[0][1], res[1][1], atol=1e-5, rtol=1e-5, what="grad")
    masks = [x.args["POS_MASK"] for x in rec.launches if x.constexprs.get("POS_KIND") == 2]
    assert masks, rec.names
    for pm in masks:
        assert pm.dtype == (torch.float32 if kind == "weights" else torch.uint8) and pm.shape == (bsz, bsz)
        if kind != "weights":
            assert pm.data_ptr() == mask.data_ptr()  # the user's 1-byte storage itself: no copy
            assert torch.equal(pm.bool(), m01)


# 6. Compiles for sm_80 / sm_90 (no GPU: triton.compile + the bundled ptxas), in a subprocess


_COMPILE = textwrap.dedent(
    """
    import json, os
    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "panel"
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "cublas"  # the panel kernel first; the epilogue GEMM below
    import contextlib, dataclasses
    import torch
    from fused_contrastive import core, routes
    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
    from fused_contrastive.tools import compile_survey

    hooks = contextlib.ExitStack()

    def hook(**values):  # the switchboard's hooks for what follows (the previous ones undone)
        hooks.close()
        hooks.enter_context(routes.override(**values))

    sig = compile_survey._sig_type  # tools/compile_survey.py knows no 1-byte pointers yet: the compact mask is "*u8"
    compile_survey._sig_type = lambda v: "*u8" if isinstance(v, torch.Tensor) and v.dtype == torch.uint8 else sig(v)
    meta = torch.device("meta")
    n = m = 4096

    def record(arch, dtype, variant, d=768):
        a = torch.empty(n, d, dtype=dtype, device=meta, requires_grad=True)
        b = None if variant in ("sym", "tri") else torch.empty(m, d, dtype=dtype, device=meta, requires_grad=True)
        s = torch.empty((), device=meta, requires_grad=True)
        mask = torch.empty(n // 2, m // 2, dtype=torch.uint8, device=meta)
        if variant == "sym":  # every term of the symmetric path
            spec, data, coef = CoreSpec(exclude_self=True), CoreData(pos_mask=mask), Coeffs(1.0, col=1.0, pos=1.0)
        elif variant == "tri":  # the triangular sweep (symmetric SimCSE)
            spec, data, coef = CoreSpec(exclude_self=True), CoreData(), Coeffs(1.0)
        elif variant == "stats":  # the column term without positives: the epilogue GEMM's statistics forward
            spec = CoreSpec(exclude_self=True, offset=3, bias=0.5)
            data, coef = CoreData(bias_col=torch.empty(n, dtype=torch.int64, device=meta)), Coeffs(1.0, col=1.0)
        elif variant in ("clip", "rows"):  # CLIP, and InfoNCE's per-row losses: the statistics forward with SPLIT_T
            spec, data = CoreSpec(), CoreData()
            coef = Coeffs(0.5, col=0.5) if variant == "clip" else Coeffs(1.0)
        elif variant == "margin":  # LaBSE's symmetric additive margin: SPLIT_T with the margin's bias column
            spec, data, coef = CoreSpec(margin=0.35), CoreData(), Coeffs(0.5, col=0.5)
        elif variant.startswith("onepass"):  # every term the one-pass sweep takes
            spec = CoreSpec(exclude_self=True, offset=3, bias=0.5, grad_cols=m // 2)
            data, coef = CoreData(bias_col=torch.empty(n, dtype=torch.int64, device=meta)), Coeffs(1.0)
        else:  # every term of the non-symmetric paths (EAGER: no column term)
            spec = CoreSpec(exclude_self=True, offset=3, bias=0.5, grad_cols=m // 2)
            data = CoreData(pos_mask=mask, bias_col=torch.empty(n, dtype=torch.int64, device=meta))
            coef = Coeffs(1.0, pos=1.0, col=1.0 if variant == "col" else None)
        # with a target term, as the losses call it: the log-sum-exp kernels leave each row's target
        # column out of their tiles (SPLIT_T, core.PiecesFn) where no softmax over positives runs
        data = dataclasses.replace(data, target=torch.empty(n, dtype=torch.int64, device=meta))
        coef = dataclasses.replace(coef, tgt=1.0)
        with compile_survey.recording(arch) as launches:
            core.run("triton", a, b, s, spec, data, coef, variant != "rows").sum().backward()
        return launches

    out = []
    for cc, arch in compile_survey.TARGETS:
        for variant, dtypes in (("eager", (torch.bfloat16, torch.float16, torch.float32)),
                                ("col", (torch.bfloat16,)), ("sym", (torch.bfloat16, torch.float16)),
                                ("onepass", (torch.bfloat16, torch.float32)), ("onepass-r4", (torch.bfloat16,)),
                                ("onepass-r1", (torch.bfloat16,)),
                                ("tri", (torch.bfloat16, torch.float16, torch.float32))):
            # the GPU's narrow blocks (4 x 512, 1 x 2048) as the block rule picks them for 4096 rows
            hook(PANEL_PROGRAMS={"onepass-r4": 1024, "onepass-r1": 10 ** 6}.get(variant),
                 PANEL_ROWS=1024 if variant == "tri" else None)  # several triangular panels
            for dt in dtypes:
                for x in record(arch, dt, variant):
                    # the panel kernels, and the fused forward with the 1-byte mask
                    if (x.name in ("panel_dl", "panel_rows")
                            or (x.name == "lse_fwd" and variant in ("col", "tri"))):
                        r = compile_survey.compile_launch(x, cc)
                        r.update(variant=variant, dtype=str(dt), one_pass=bool(x.constexprs.get("ONE_PASS")),
                                 block_r=x.constexprs.get("BLOCK_R"), tri=bool(x.constexprs.get("TRI")),
                                 split=bool(x.constexprs.get("SPLIT_T")))
                        out.append(r)
    hook()
    # the epilogue GEMM: every mode (one pass and its redo, known statistics: the column term, the
    # symmetric and the triangular forms) in every 16-bit dtype it takes
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "epilogue"
    for cc, arch in compile_survey.TARGETS:
        for variant, dtypes in (("onepass", (torch.bfloat16,)), ("col", (torch.bfloat16, torch.float16)),
                                ("stats", (torch.bfloat16, torch.float16)), ("clip", (torch.bfloat16, torch.float16)),
                                ("rows", (torch.bfloat16, torch.float16)), ("margin", (torch.bfloat16, torch.float16)),
                                ("sym", (torch.bfloat16, torch.float16)), ("tri", (torch.bfloat16, torch.float16))):
            hook(PANEL_ROWS=1024 if variant == "tri" else None)
            for dt in dtypes:
                for x in record(arch, dt, variant):
                    if x.name in ("epi_rows", "target_rows", "stats_merge"):  # the row kernels around the
                        r = compile_survey.compile_launch(x, cc)  # one pass, the statistics merge (and the target
                        # term's:
                        r.update(variant=variant, dtype=str(dt), finish=x.constexprs.get("FINISH"),  # every
                                 bwd=x.constexprs.get("BWD"), acc=x.constexprs.get("ACC"))  # loss here has one)
                        out.append(r)
                    if x.name.startswith("epi_gemm"):
                        keep = {}
                        r = compile_survey.compile_launch(x, cc, keep)
                        ttgir = keep["kernel"].asm["ttgir"]
                        r.update(variant=variant, dtype=str(dt), mode=x.constexprs["MODE"],
                                 tri=bool(x.constexprs["TRI"]), cp_async=ttgir.count("async_copy_global_to_local"),
                                 split=bool(x.constexprs["SPLIT_T"]))
                        out.append(r)
    hook()
    # SigLIP on the epilogue GEMM: per-row losses (MODE 4: the losses, then the gradient tile) and the mean
    # (MODE 5: both in one pass)
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn
    for cc, arch in compile_survey.TARGETS:
        for dt, reduce in ((torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True),
                           (torch.float16, True)):
            x = torch.empty(n, 768, dtype=dt, device=meta, requires_grad=True)
            y = torch.empty(m, 768, dtype=dt, device=meta, requires_grad=True)
            sc = torch.empty((), device=meta, requires_grad=True)
            bi = torch.empty((), device=meta, requires_grad=True)
            with compile_survey.recording(arch) as launches:
                TritonSigLipFn.apply(x, y, sc, bi, True, 1e-12, 0, reduce, 1.0 / n).sum().backward()
            for x in launches:
                if x.name.startswith("epi_gemm"):
                    keep = {}
                    r = compile_survey.compile_launch(x, cc, keep)
                    r.update(variant="siglip", dtype=str(dt), mode=x.constexprs["MODE"], tri=False,
                             cp_async=keep["kernel"].asm["ttgir"].count("async_copy_global_to_local"))
                    out.append(r)
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "cublas"
    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "fused"
    for cc, arch in compile_survey.TARGETS:  # the fused backward kernels with the 1-byte mask
        for x in record(arch, torch.bfloat16, "col"):
            if x.name in ("lse_bwd_rows", "lse_bwd_cols"):
                r = compile_survey.compile_launch(x, cc)
                r.update(variant="fused-u8", dtype="bf16", split=bool(x.constexprs["SPLIT_T"]))
                out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    # the tiles form of every launch (the persistent and TMA forms, SigLIP's one-pass default on sm_90
    # among them, are tests/test_epi_forms_compile.py's)
    return run_compile_script(_COMPILE, 900, FUSED_CONTRASTIVE_DENSE="0", FUSED_CONTRASTIVE_EPI_FORM="tiles")


def test_panel_kernel_compiles_without_spills(compiled):
    panel = [r for r in compiled if r["kernel"] == "panel_dl"]
    variants = ("eager", "col", "sym", "onepass", "onepass-r4", "onepass-r1", "tri")
    assert {(r["cc"], r["variant"]) for r in panel} == {(cc, v) for cc in (80, 90) for v in variants}
    assert {r["variant"] for r in panel if r["tri"]} == {"tri"}
    # the triangular forward (the fused forward kernel with TRI), every dtype
    tri = {(r["cc"], r["dtype"]) for r in compiled if r["kernel"] == "lse_fwd" and r["tri"]}
    assert tri == {(cc, str(dt)) for cc in (80, 90) for dt in (torch.bfloat16, torch.float16, torch.float32)}
    assert {r["variant"] for r in panel if r["one_pass"]} == {"onepass", "onepass-r4", "onepass-r1"}
    assert {r["block_r"] for r in panel if r["variant"].startswith("onepass")} == {16, 4, 1}
    assert {r["cc"] for r in compiled if r["kernel"] == "panel_rows"} == {80, 90}
    # each row's target column left out of the tiles (a loss with a target term; never beside a softmax
    # over positives, which "eager", "col" and "sym" carry)
    assert all(r["split"] == (r["variant"] in ("onepass", "onepass-r4", "onepass-r1", "tri")) for r in panel), panel
    bad = [r for r in compiled if r["spill_stores"] or r["spill_loads"]]
    assert not bad, bad
    assert all(r["shared"] <= 163 * 1024 for r in compiled)


def test_epilogue_gemm_compiles_pipelined_on_tensor_cores_without_spills(compiled):
    epi = [r for r in compiled if r["kernel"].startswith("epi_gemm")]
    want = {(cc, v, dt) for cc in (80, 90) for v, dts in (("onepass", ("torch.bfloat16",)),
                                                          ("col", ("torch.bfloat16", "torch.float16")),
                                                          ("stats", ("torch.bfloat16", "torch.float16")),
                                                          ("clip", ("torch.bfloat16", "torch.float16")),
                                                          ("rows", ("torch.bfloat16", "torch.float16")),
                                                          ("margin", ("torch.bfloat16", "torch.float16")),
                                                          ("sym", ("torch.bfloat16", "torch.float16")),
                                                          ("tri", ("torch.bfloat16", "torch.float16")),
                                                          ("siglip", ("torch.bfloat16", "torch.float16")))
            for dt in dts}
    assert {(r["cc"], r["variant"], r["dtype"]) for r in epi} == want
    # modes: 0 known statistics, 1 one pass, 2 its redo, 3 the statistics forward (the column term; the
    # triangular sweep), 4 SigLIP, 5 its one pass; the symmetric variant's softmax over positives keeps the
    # fused forward
    assert {(r["variant"], r["mode"]) for r in epi} == {("onepass", 1), ("onepass", 2), ("col", 0), ("stats", 0),
                                                       ("stats", 3), ("clip", 0), ("clip", 3), ("rows", 0),
                                                       ("rows", 3), ("margin", 0), ("margin", 3), ("sym", 0),
                                                       ("tri", 0), ("tri", 3),
                                                       ("siglip", 4), ("siglip", 5)}
    # SigLIP's forward (losses only) and backward (the gradient tile) are two compiles of MODE 4, its one
    # pass (both) one of MODE 5, per arch and dtype
    assert sorted(r["mode"] for r in epi if r["variant"] == "siglip") == [4] * 8 + [5] * 4
    assert {r["variant"] for r in epi if r["tri"]} == {"tri"}
    # the gradient tiles' modes with each row's target column split out, as a loss with a target runs them
    # (not beside a softmax over positives: "col" and "sym" carry one), and the statistics forward with a target term
    # (MODE 3: the target entry out of the row and column statistics; with a bias column, "stats", or a margin's)
    assert all(r.get("split", False) == (r["mode"] in (0, 1, 2, 3) and r["variant"] not in ("col", "sym"))
               for r in epi if r["variant"] != "siglip"), epi
    bad = [r for r in epi if r["spill_stores"] or r["spill_loads"]]
    assert not bad, bad
    # tensor cores (wgmma on sm_90, mma.sync on sm_80) fed by cp.async (the software pipeline), in the
    # shared memory of each target (sm_80 163 KB, sm_90 227 KB per block)
    assert all(r["tc"] == ("wgmma" if r["cc"] == 90 else "mma") for r in epi), epi
    assert all(r["cp_async"] > 0 and r["num_stages"] >= 2 for r in epi), epi
    assert all(r["shared"] <= (227 if r["cc"] == 90 else 163) * 1024 for r in epi), epi


def test_row_kernels_compile_without_spills(compiled):
    """The one pass's per-row bookkeeping (epi_rows, before and after the redo) and the target term's row
    kernel (its forward, and its backward adding into the other pieces' fp32 gradient) on both archs."""
    rows = [r for r in compiled if r["kernel"] in ("epi_rows", "target_rows", "stats_merge")]
    assert {(r["cc"], r["finish"]) for r in rows if r["kernel"] == "epi_rows"} == {
        (cc, f) for cc in (80, 90) for f in (False, True)}
    # the statistics merge: the rows' (ACC off) and the columns' (ACC on: into their statistics so far)
    assert {(r["cc"], r["acc"]) for r in rows if r["kernel"] == "stats_merge"} == {
        (cc, acc) for cc in (80, 90) for acc in (False, True)}
    assert {(r["cc"], r["bwd"], r["acc"]) for r in rows if r["kernel"] == "target_rows"} == {
        (cc, bwd, acc) for cc in (80, 90) for bwd, acc in ((False, False), (True, True))}
    bad = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not bad, bad


def test_one_byte_mask_kernels_use_tensor_cores(compiled):
    fused = [r for r in compiled
             if r["kernel"] not in ("panel_dl", "panel_rows", "epi_rows", "target_rows", "stats_merge")
             and not r["kernel"].startswith("epi_gemm")]
    assert {r["kernel"] for r in fused} == {"lse_fwd", "lse_bwd_rows", "lse_bwd_cols"}
    for r in fused:
        assert (r["n_wgmma"] and not r["n_mma"]) if r["cc"] == 90 else r["n_mma"], r
