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
