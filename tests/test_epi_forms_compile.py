"""The sm_80 / sm_90 compiles of the epilogue GEMMs' persistent tile loops (``triton_shared/panels.py``
``EPI_FORMS``, env
``FUSED_CONTRASTIVE_EPI_FORM``; their interpreter parity is tests/test_epi_forms.py): every persistent launch
the losses make (InfoNCE's one pass, CLIP's statistics forward and known statistics, SimCSE's triangular
sweep, SigLIP's one pass and losses sweep, GIST's and the ids blocks of the guided route) without spills,
on tensor cores, TMA copies and no cp.async operand copies on sm_90 in the TMA form, one CTA per SM; the
launches whose persistent compile spilled keep the tiles form. And the GPU model refuses a persistent
launch rather than price it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from fused_contrastive.core.triton_shared.configs import EPI_PERSIST_STAGES
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script

_COMPILE = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from fused_contrastive import core, routes
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn
    from fused_contrastive.tools import compile_survey

    meta = torch.device("meta")
    n = 4096
    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "panel"
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "epilogue"

    def record(arch, loss):
        with compile_survey.recording(arch) as launches:
            if loss in ("info_nce", "clip", "simcse"):  # the losses' own core-op calls, as the model runs them
                a, b, scale, spec, data, coef, reduce = compile_survey.core_call(loss, n, 768, torch.bfloat16)
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
        from fused_contrastive.core.guided.torch_blocks import Block, Masks, merged_lse
        a, p, ng = (torch.empty(n, d, dtype=torch.bfloat16, device=meta).requires_grad_() for _ in range(3))
        s = torch.empty((), device=meta, requires_grad=True)
        w = torch.empty(n, device=meta)
        i64 = torch.empty(n, dtype=torch.int64, device=meta)
        with compile_survey.recording(arch) as launches:
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
    for cc, arch in compile_survey.TARGETS:
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
                    r = compile_survey.compile_launch(x, cc)
                    r.update(form="guided", guide=gname, loss=variant, split=x.constexprs["SPLIT_T"],
                             persist=x.constexprs["PERSIST"], grid=x.grid[0], block_m=x.constexprs["BLOCK_M"])
                    out.append(r)
    hooks = routes.override(PANEL_ROWS=1024)  # several panels (the triangular sweep's among them), to the end
    hooks.__enter__()
    for form in ("persistent", "tma"):
        os.environ["FUSED_CONTRASTIVE_EPI_FORM"] = form
        for cc, arch in compile_survey.TARGETS:
            seen = set()
            for loss in ("info_nce", "clip", "simcse", "siglip", "siglip_rows"):
                for x in record(arch, loss):
                    key = (x.name, x.constexprs.get("MODE"), x.constexprs.get("HAS_G"), x.constexprs.get("TRI"))
                    if not x.name.startswith("epi_gemm") or key in seen:
                        continue
                    seen.add(key)
                    keep = {}
                    r = compile_survey.compile_launch(x, cc, keep)
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
    # the launches that keep the tiles form: the one pass's redo, SigLIP's gradient sweep of per-row losses, whose
    # persistent compile spilled at every depth, and CLIP's split statistics forward where TMA is asked on sm_90
    # (32 + 56 bytes spilled; EPI_PERSIST_STAGES)
    assert {(r["mode"], r["has_g"]) for r in compiled if not r["persist"]} == {(2, True), (4, True), (3, False)}
    assert {(r["form"], r["cc"], r["loss"]) for r in compiled if not r["persist"] and r["mode"] == 3} == {
        ("tma", 90, "clip")}
    assert all(v is None for (name, _, _), v in EPI_PERSIST_STAGES.items() if name == "siglip_bwd")
    assert EPI_PERSIST_STAGES[("stats_split", "sm90", True)] is None


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
