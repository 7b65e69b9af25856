"""The epilogue GEMM's tile-loop forms (``triton_panel.EPI_FORMS``, env ``FUSED_CONTRASTIVE_EPI_FORM``;
``kernels/panel.py`` ``epi_gemm_kernel`` PERSIST / TMA): one program per tile (the default), a persistent
grid walking the tiles in one flattened loop, and the persistent grid with TMA operand tiles.

Under the CPU interpreter (conftest.py) with small tiles (16 x 32, 32-wide D steps; D = 72 is not a multiple
of them) and 3 programs, so every program walks several tiles of a ragged grid: every mode the persistent
forms take (the one pass and its split target column, the statistics forward, known statistics, the
triangular sweep, SigLIP's one pass and its losses sweep) gives outputs bitwise equal to the tiles form's
(the same products in the same order, the same epilogue), and the loss and gradients against float64
(THE accuracy rule). The compile test lowers every persistent launch for sm_80 / sm_90: no spills, tensor
cores, TMA copies on sm_90 in the TMA form (and no cp.async operand copies), one CTA per SM."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from triton.tools.tensor_descriptor import TensorDescriptor

import fused_contrastive as fc
from fused_contrastive.core import triton_backend, triton_panel
from fused_contrastive.core.triton_configs import EPI_PERSIST_STAGES, LaunchConfig
from fused_contrastive.testing import CASE_BY_NAME, compare
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script

SMALL = LaunchConfig(16, 32, 32, 4, 2)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """The panel path's epilogue GEMM in 40-row panels of 16 x 32 tiles, outputs poisoned with NaN."""
    monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "panel")
    monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", "epilogue")
    monkeypatch.setattr(triton_panel, "PANEL_ROWS", 40)
    monkeypatch.setattr(triton_backend, "POISON_OUTPUTS", True)
    for name in list(triton_panel.EPI_GEMM):
        monkeypatch.setitem(triton_panel.EPI_GEMM, name, SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _run(loss: str, dtype=torch.bfloat16, n: int = 97, d: int = 72):
    """Loss and gradients of one fwd + bwd, and the epilogue GEMM launches it made."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    seen = []
    orig = triton_backend._launch

    def launch(x):
        seen.append(x)
        orig(x)

    triton_backend._launch, prev = launch, triton_backend._launch
    try:
        if loss == "info_nce":
            out = fc.info_nce(q, k, torch.arange(n), backend="triton")
        elif loss == "clip":
            out = fc.clip_loss(q, k, 10.0, backend="triton")
        elif loss == "simcse":  # interleaved pairs, B is A: the triangular sweep (statistics, known statistics)
            out = fc.simcse_loss(q[: n - n % 2], backend="triton")
        elif loss == "siglip":
            out = fc.siglip_loss(q, k, torch.tensor(5.0), torch.tensor(-2.0), backend="triton")
        else:  # per-row SigLIP losses: the losses sweep (MODE 4), then the gradient sweep (tiles form)
            out = fc.siglip_loss(q, k, torch.tensor(5.0), torch.tensor(-2.0), reduction="none",
                                 backend="triton").sum()
        out.backward()
    finally:
        triton_backend._launch = prev
    outs = [t for t in (out.detach(), q.grad, k.grad) if t is not None]
    return outs, [x for x in seen if x.name.startswith("epi_gemm")]


LOSSES = {"info_nce": {1}, "clip": {0, 3}, "simcse": {0, 3}, "siglip": {5}, "siglip_rows": {4}}


@pytest.mark.parametrize("form", ["persistent", "tma"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_forms_equal_the_tiles_form_bitwise(loss, form, monkeypatch):
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, "tiles")
    want, tiles = _run(loss)
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, form)
    got, launches = _run(loss)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (loss, form, float((a.float() - b.float()).abs().max()))
    assert max(x.grid[0] for x in tiles) > 3  # programs that walk several tiles below
    persistent = [x for x in launches if x.constexprs["PERSIST"]]
    assert {x.constexprs["MODE"] for x in persistent} == LOSSES[loss], [x.name for x in launches]
    assert all(x.grid[0] <= 3 and x.constexprs["TMA"] == (form == "tma") for x in persistent)
    assert max(x.grid[0] for x in persistent) == 3  # EPI_PROGRAMS on the interpreter (a panel may have fewer)
    assert all(isinstance(x.args["X"], TensorDescriptor) == (form == "tma") for x in persistent)
    # the tiles form stays where the persistent compile spilled (SigLIP's gradient sweep for per-row
    # losses) and for the one pass's redo (MODE 2)
    rest = {(x.name, x.constexprs["MODE"], x.constexprs["HAS_G"]) for x in launches if not x.constexprs["PERSIST"]}
    assert rest <= {("epi_gemm_redo", 2, False), ("epi_gemm_redo", 2, True), ("epi_gemm_siglip", 4, True)}, rest
    assert all(x.constexprs["TMA"] is False for x in launches if not x.constexprs["PERSIST"])


def _gist(gdt):
    """GISTEmbed's loss and gradients on the guided blocks' epilogue GEMM (40-row panels of 16 x 32 tiles),
    and its guided_epi launches."""
    from fused_contrastive.core import triton_guided_panel as TGP
    from fused_contrastive.losses.guided import gist_loss

    g = torch.Generator().manual_seed(1)
    a, p, n = (torch.randn(r, 72, generator=g).bfloat16().requires_grad_() for r in (97, 97, 83))
    guides = tuple(torch.randn(r, 21, generator=g).to(gdt) for r in (97, 97, 83))
    seen = []
    orig = triton_backend._launch

    def launch(x):
        seen.append(x)
        orig(x)

    triton_backend._launch, prev = launch, triton_backend._launch
    prev_rows, TGP.PANEL_ROWS = TGP.PANEL_ROWS, 40
    try:
        loss = gist_loss(a, p, n, guide=guides, temperature=0.05, backend="triton")
        loss.backward()
    finally:
        triton_backend._launch, TGP.PANEL_ROWS = prev, prev_rows
    return [loss.detach(), a.grad, p.grad, n.grad], [x for x in seen if x.name.startswith("guided_epi")]


@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float32], ids=["bf16-guides", "fp32-guides"])
def test_guided_persistent_form_equals_the_tiles_form_bitwise(gdt, monkeypatch):
    # the guided blocks' epilogue GEMM (GIST's four blocks, its split target block): "persistent" and "tma"
    # both run its persistent form (no descriptors for the guides), bitwise the tiles form's results
    from fused_contrastive.core import triton_guided_panel as TGP

    for name in list(TGP.GUIDED_EPI):
        monkeypatch.setitem(TGP.GUIDED_EPI, name, SMALL)
    # every block persistent here (the interpreter runs sm_80's table, where some keep the tiles form: the
    # compile test below checks that table)
    for key in list(TGP.GUIDED_PERSIST_STAGES):
        monkeypatch.setitem(TGP.GUIDED_PERSIST_STAGES, key, 2)
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, "tiles")
    want, tiles = _gist(gdt)
    assert max(x.grid[0] for x in tiles if x.name == "guided_epi") > 3
    for form in ("persistent", "tma"):
        monkeypatch.setenv(triton_panel.EPI_FORM_ENV, form)
        got, launches = _gist(gdt)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (form, float((a.float() - b.float()).abs().max()))
        epi = [x for x in launches if x.name == "guided_epi"]
        assert epi and all(x.constexprs["PERSIST"] and x.grid[0] <= 3 for x in epi), [x.grid for x in epi]
        assert not any(x.constexprs["PERSIST"] for x in launches if x.name == "guided_epi_redo")


@pytest.mark.parametrize("form", ["persistent", "tma"])
@pytest.mark.parametrize("name", ["info_nce", "clip_scale"])
def test_forms_against_float64(name, form, monkeypatch):
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, form)
    c = compare(CASE_BY_NAME[name], 97, 72, torch.bfloat16, "triton", canary=True)
    assert c.ok, c


def test_tma_needs_aligned_rows_and_the_env_is_checked(monkeypatch):
    # D = 13 in bf16: 26-byte rows, which TMA cannot copy: the persistent form with cp.async copies instead
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, "tma")
    got, launches = _run("info_nce", d=13)
    assert {(x.constexprs["PERSIST"], x.constexprs["TMA"]) for x in launches if x.name == "epi_gemm"} == {
        (True, False)}
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, "tiles")
    want, _ = _run("info_nce", d=13)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.setenv(triton_panel.EPI_FORM_ENV, "warp")
    with pytest.raises(ValueError, match=triton_panel.EPI_FORM_ENV):
        _run("info_nce")


_COMPILE = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from fused_contrastive import core
    from fused_contrastive.core import triton_panel
    from fused_contrastive.core.triton_siglip import TritonSigLipFn
    from fused_contrastive.tools import aot

    meta = torch.device("meta")
    n = 4096
    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "panel"
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "epilogue"

    def record(arch, loss):
        with aot.recording(arch) as launches:
            if loss in ("info_nce", "clip", "simcse"):  # the losses' own core-op calls, as the model runs them
                a, b, scale, spec, data, coef, reduce = aot.core_call(loss, n, 768, torch.bfloat16)
                out = core.run("triton", a, b, scale, spec, data, coef, reduce)
                torch.autograd.grad(out, [x for x in (a, b) if x is not None and x.requires_grad])
            else:  # SigLIP's mean (its one pass) and per-row losses (a losses sweep, then a gradient sweep)
                q = torch.empty(n, 768, dtype=torch.bfloat16, device=meta, requires_grad=True)
                k = torch.empty(n, 768, dtype=torch.bfloat16, device=meta, requires_grad=True)
                s = torch.empty((), device=meta, requires_grad=True)
                b = torch.empty((), device=meta, requires_grad=True)
                TritonSigLipFn.apply(q, k, s, b, True, 1e-12, 0, loss == "siglip", 1.0 / n).sum().backward()
        return launches

    def record_guided(arch, gdt, variant, d=768, dg=384):
        # GIST's four blocks (the threshold rule, the split target block) and info_nce's ids-and-self block
        from fused_contrastive.core.blocks import Block, Masks, merged_lse
        a, p, ng = (torch.empty(n, d, dtype=torch.bfloat16, device=meta).requires_grad_() for _ in range(3))
        s = torch.empty((), device=meta, requires_grad=True)
        w = torch.empty(n, device=meta)
        i64 = torch.empty(n, dtype=torch.int64, device=meta)
        with aot.recording(arch) as launches:
            if variant == "gist":
                gs = tuple(torch.empty(n, dg, dtype=gdt, device=meta) for _ in range(3))
                blocks = [Block(0, 1, protect=True), Block(0, 0), Block(1, 1), Block(0, 2)]
                masks = Masks(guides=gs, target=i64, rule=("absolute", 0.0))
                merged_lse([a, p, ng], blocks, n, s, masks, weights=w, minus_target=True, backend="triton")
            else:
                gs = tuple(torch.empty(n, dg, dtype=gdt, device=meta) for _ in range(2))
                masks = Masks(guides=gs, ids=(i64, i64), target=i64, rule=("absolute", 0.0))
                merged_lse([a, p], [Block(0, 1, protect=True, exclude=0)], n, s, masks, weights=w,
                           minus_target=True, backend="triton")
        return launches

    out = []
    os.environ["FUSED_CONTRASTIVE_EPI_FORM"] = "persistent"
    for cc, arch in aot.TARGETS:
        for gname, gdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            for variant in ("gist", "ids"):
                seen = set()
                for x in record_guided(arch, gdt, variant):
                    if x.name != "guided_epi":
                        continue
                    key = (x.constexprs["BLOCK_M"], x.constexprs["SPLIT_T"], x.constexprs["PERSIST"])
                    if key in seen:
                        continue
                    seen.add(key)
                    r = aot.compile_launch(x, cc)
                    r.update(form="guided", guide=gname, loss=variant, split=x.constexprs["SPLIT_T"],
                             persist=x.constexprs["PERSIST"], grid=x.grid[0], block_m=x.constexprs["BLOCK_M"])
                    out.append(r)
    for form in ("persistent", "tma"):
        os.environ["FUSED_CONTRASTIVE_EPI_FORM"] = form
        triton_panel.PANEL_ROWS = 1024  # several panels (the triangular sweep's among them)
        for cc, arch in aot.TARGETS:
            seen = set()
            for loss in ("info_nce", "clip", "simcse", "siglip", "siglip_rows"):
                for x in record(arch, loss):
                    key = (x.name, x.constexprs.get("MODE"), x.constexprs.get("HAS_G"), x.constexprs.get("TRI"))
                    if not x.name.startswith("epi_gemm") or key in seen:
                        continue
                    seen.add(key)
                    keep = {}
                    r = aot.compile_launch(x, cc, keep)
                    r.update(form=form, loss=loss, mode=x.constexprs["MODE"], has_g=x.constexprs["HAS_G"],
                             persist=x.constexprs["PERSIST"], tma_flag=x.constexprs["TMA"], grid=x.grid[0],
                             cp_async=keep["kernel"].asm["ttgir"].count("async_copy_global_to_local"))
                    out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_COMPILE, 900, FUSED_CONTRASTIVE_DENSE="0")


def test_persistent_forms_compile_without_spills(compiled):
    compiled = [r for r in compiled if r["form"] != "guided"]
    persistent = [r for r in compiled if r["persist"]]
    # every mode the persistent forms take, on both archs and in both forms
    assert {(r["form"], r["cc"], r["mode"]) for r in persistent} == {
        (f, cc, m) for f in ("persistent", "tma") for cc in (80, 90) for m in (0, 1, 3, 4, 5)}
    assert_no_spills_within_smem(persistent)
    assert_tensor_cores(persistent)
    # one program per SM (an H100's 132, an A100's 108): every compile is too large for two CTAs of its warps
    assert all(r["grid"] == {90: 132, 80: 108}[r["cc"]] for r in persistent), persistent
    assert all(r["regs"] * 32 * r["num_warps"] * 2 > 65536 for r in persistent), persistent
    # operands: TMA copies in the TMA form on sm_90 (no cp.async); cp.async pipelines elsewhere
    for r in persistent:
        tma = r["form"] == "tma" and r["cc"] == 90
        assert r["tma_flag"] == tma, r
        assert (r["tma"] > 0 and r["cp_async"] == 0) if tma else (r["tma"] == 0 and r["cp_async"] > 0), r
        assert r["num_stages"] >= 2, r
    # the launches that keep the tiles form: the one pass's redo, and SigLIP's gradient sweep of per-row
    # losses, whose persistent compile spilled at every depth (EPI_PERSIST_STAGES)
    assert {(r["mode"], r["has_g"]) for r in compiled if not r["persist"]} == {(2, True), (4, True)}
    assert all(v is None for (name, _, _), v in EPI_PERSIST_STAGES.items() if name == "siglip_bwd")


def test_guided_persistent_form_compiles_without_spills(compiled):
    guided = [r for r in compiled if r["form"] == "guided"]
    # GIST's blocks (the split target block and, with 16-bit guides, the 128-row blocks) and the ids block
    assert {(r["cc"], r["guide"], r["loss"]) for r in guided} == {
        (cc, g, v) for cc in (80, 90) for g in ("bf16", "fp32") for v in ("gist", "ids")}
    assert_no_spills_within_smem(guided)
    assert_tensor_cores(guided)
    persistent = [r for r in guided if r["persist"]]
    assert all(r["grid"] == {90: 132, 80: 108}[r["cc"]] and r["regs"] * 32 * r["num_warps"] * 2 > 65536
               for r in persistent), persistent
    # every block persistent on sm_90; on sm_80 the blocks whose persistent compile spilled keep the tiles form
    # (GUIDED_PERSIST_STAGES: 16-bit guides' 128-row blocks, fp32 guides' split target block)
    assert all(r["persist"] for r in guided if r["cc"] == 90)
    assert {(r["guide"], r["block_m"], r["split"]) for r in guided if r["cc"] == 80 and not r["persist"]} == {
        ("bf16", 128, False), ("fp32", 64, True)}


def test_the_gpu_model_refuses_the_persistent_forms():
    # bench/gpu_model.py prices the tiles form only: a persistent launch is refused by name, not priced wrong
    script = textwrap.dedent(
        """
        import json, os, sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, BENCH)
        os.environ["FUSED_CONTRASTIVE_EPI_FORM"] = "persistent"
        import gpu_model as GM
        launches, _ = GM.run_triton("info_nce", 4096, 768, GM.GPUS["H100"], "panel-epilogue")
        persistent = [x for x in launches if x.constexprs.get("PERSIST")]
        try:
            GM.kernel_model(persistent[0], GM.GPUS["H100"])
            print(json.dumps([len(persistent), "priced"]))
        except NotImplementedError as e:
            print(json.dumps([len(persistent), str(e)]))
        """
    )
    bench = Path(__file__).resolve().parent.parent / "bench"
    n, msg = run_compile_script(script.replace("BENCH", repr(str(bench))), 600)
    assert n > 0 and "does not price the persistent tile loop" in msg, (n, msg)
