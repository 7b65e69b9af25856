"""The fp16 pass's kernel (``kernels/logit_pass.py``, ``PANEL_GEMM=fp16pass``) compiles ahead of time for sm_80 and
sm_90 (no GPU: ``tools.compile_survey.compile_launch``) in every flag combination the registry's one-pass losses
launch it with (recorded on the meta device at N = 4096, D = 768): 0 bytes of register spills, no scalar 16-bit
global load where the tile's rows are 16-byte aligned (the fp16 cosines read in vectors), the shared memory
within each part's limit."""

from __future__ import annotations

import textwrap

import pytest

from tests._compiles import assert_no_spills_within_smem, run_compile_script

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

_SCRIPT = textwrap.dedent(
    """
    import json

    import torch

    from fused_contrastive import core, routes
    from fused_contrastive.tools import compile_survey

    FLAGS = ("HAS_BIAS", "BIAS_COS", "EXCLUDE_SELF", "NEED_DS", "SPLIT_T")
    out, seen = [], set()
    for cc, arch in compile_survey.TARGETS:
        # a tensor temperature and label targets; both views' self and partner out (a bias column); a queue;
        # supervised SimCSE's hard negatives (a bias column, a tensor temperature)
        for case in ("info_nce_target", "dclw", "dscl_queue", "simcse_sup_hard"):
            a, b, scale, spec, data, coef, reduce = compile_survey.core_call(case, 4096, 768)
            with routes.override(PANEL_GEMM="fp16pass", TRITON_PATH="panel", DENSE=False), \\
                    compile_survey.recording(arch) as launches:
                res = core.run("triton", a, b, scale, spec, data, coef, reduce)
                torch.autograd.grad(res if reduce else res.sum(),
                                    [x for x in (a, b, scale) if isinstance(x, torch.Tensor) and x.requires_grad])
            passes = [x for x in launches if x.name == "logit_pass"]
            assert passes, (case, sorted({x.name for x in launches}))
            # the target margin's bias in cosine units (am_softmax_loss with symmetric=False) on dclw's launch
            if case == "dclw":
                passes.append(passes[0]._replace(constexprs=dict(passes[0].constexprs, BIAS_COS=True)))
            for x in passes:
                flags = tuple(k for k in FLAGS if x.constexprs[k])
                if (cc, flags) in seen:
                    continue
                seen.add((cc, flags))
                r = compile_survey.compile_launch(x, cc)
                r.update(case=case, flags=flags, m=x.args["M"])
                out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_SCRIPT, 900)


def test_logit_pass_compiles_without_spills_in_vectors(compiled):
    assert {r["cc"] for r in compiled} == {80, 90}
    for cc in (80, 90):
        flags = set().union(*(r["flags"] for r in compiled if r["cc"] == cc))
        assert flags == {"HAS_BIAS", "BIAS_COS", "EXCLUDE_SELF", "NEED_DS", "SPLIT_T"}, (cc, flags)
    assert_no_spills_within_smem(compiled)
    # 16-byte loads of the cosines where the tile's rows are 16-byte aligned (M a multiple of 8, as the
    # specialisation on M's and the row stride's divisibility by 16 proves); a ragged M (info_nce_target's
    # N + 3 columns, dscl_queue's) reads them one by one, as any kernel would read such a tile
    aligned = [r for r in compiled if r["m"] % 8 == 0]
    assert {r["cc"] for r in aligned} == {80, 90} and len(aligned) < len(compiled)
    assert all(r["ld_b16"] == 0 for r in aligned), [(r["cc"], r["flags"], r["ld_b16"]) for r in aligned]


#: SigLIP's fp16 pass (``siglip_pass_kernel``, ``SIGLIP_EPILOGUE=fp16pass``): the launches of ``TritonSigLipFn`` on
#: the panel path recorded on the meta device, bf16 and fp16, N = 4096 (and a ragged 4099-column text set), D = 768:
#: the one pass of a summed loss (losses, the gradient tile, ds / db partials) and the per-row losses' forward
#: (losses only) and gradient sweep (the tile only)
_SIGLIP_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    from unittest import mock

    import torch

    from fused_contrastive import routes
    from fused_contrastive.core.siglip.triton_siglip import TritonSigLipFn
    from fused_contrastive.tools import compile_survey

    out, seen = [], set()
    for cc, arch in compile_survey.TARGETS:
        for dt in (torch.bfloat16, torch.float16):
            for m in (4096, 4099):
                x = torch.empty((4096, 768), dtype=dt, device="meta", requires_grad=True)
                y = torch.empty((m, 768), dtype=dt, device="meta", requires_grad=True)
                sc = torch.empty((), device="meta", requires_grad=True)
                bi = torch.empty((), device="meta", requires_grad=True)
                with routes.override(SIGLIP_EPILOGUE="fp16pass", TRITON_PATH="panel", PANEL_GEMM="epilogue"), \\
                        compile_survey.recording(arch) as launches:
                    for reduce in (True, False):
                        res = TritonSigLipFn.apply(x, y, sc, bi, True, 1e-12, 0, reduce, 1.0)
                        torch.autograd.grad(res if reduce else res.sum(), [x, y, sc, bi])
                passes = [p for p in launches if p.name == "siglip_pass"]
                assert passes and not [p for p in launches if p.name == "epi_gemm_siglip"], \\
                    sorted({p.name for p in launches})
                for p in passes:
                    key = (cc, str(dt), m, p.constexprs["WANT_LOSS"], p.constexprs["HAS_G"])
                    if key in seen:
                        continue
                    seen.add(key)
                    r = compile_survey.compile_launch(p, cc)
                    r.update(dtype=str(dt), m=m, want_loss=p.constexprs["WANT_LOSS"], has_g=p.constexprs["HAS_G"])
                    out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def siglip_compiled():
    return run_compile_script(_SIGLIP_SCRIPT, 900)


def test_siglip_pass_compiles_without_spills_in_vectors(siglip_compiled):
    assert {r["cc"] for r in siglip_compiled} == {80, 90}
    kinds = {(r["cc"], r["dtype"], r["want_loss"], r["has_g"]) for r in siglip_compiled}
    for cc in (80, 90):  # the one pass, the forward, the gradient sweep; bf16 and fp16
        for dt in ("torch.bfloat16", "torch.float16"):
            assert {(cc, dt, True, True), (cc, dt, True, False), (cc, dt, False, True)} <= kinds, kinds
    assert_no_spills_within_smem(siglip_compiled)
    aligned = [r for r in siglip_compiled if r["m"] % 8 == 0]
    assert aligned and len(aligned) < len(siglip_compiled)
    assert all(r["ld_b16"] == 0 for r in aligned), [(r["cc"], r["dtype"], r["ld_b16"]) for r in aligned]
