"""The sm_80 / sm_90 compiles of the fused forward with the target split (``kernels/lse.py`` ``lse_fwd_kernel``'s
SPLIT_T without TRI; tests/test_clip_loss.py and tests/test_tri_loss.py have its numerics on the interpreter): every
launch that takes it, recorded as the losses' core-op calls make them on the fused route (InfoNCE: row statistics
only; CLIP: the column statistics with their target entry apart too, A != B and B is A; the additive margin's
bias column), in both 16-bit dtypes and fp32 (whose tiles cancel as theirs do) and every D bucket, compiles without
spills, within shared memory and on tensor cores."""

from __future__ import annotations

import textwrap

import pytest

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script

_COMPILE = textwrap.dedent(
    """
    import json, os, warnings
    warnings.simplefilter("ignore")
    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "fused"
    import torch
    from fused_contrastive import core, routes
    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
    from fused_contrastive.tools import compile_survey

    meta = torch.device("meta")
    n = 4096

    def record(arch, dt, d, form):
        a = torch.empty(n, d, dtype=dt, device=meta, requires_grad=True)
        b = None if form == "clip_self" else torch.empty(n, d, dtype=dt, device=meta, requires_grad=True)
        s = torch.empty((), device=meta, requires_grad=True)
        data = CoreData(target=torch.empty(n, dtype=torch.int64, device=meta))
        spec = CoreSpec(margin=0.3) if form == "clip_margin" else CoreSpec()
        coef = Coeffs(lse=0.5, col=0.5, tgt=1.0) if form.startswith("clip") else Coeffs(lse=1.0, tgt=1.0)
        with compile_survey.recording(arch) as launches:
            core.run("triton", a, b, s, spec, data, coef, True).backward()
        return launches

    out = []
    with routes.override(DENSE="0"):
        for cc, arch in compile_survey.TARGETS:
            seen = set()
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                for d in (64, 128, 768):
                    for form in ("info_nce", "clip", "clip_margin", "clip_self"):
                        for x in record(arch, dt, d, form):
                            if x.name != "lse_fwd" or not x.constexprs.get("SPLIT_T"):
                                continue
                            key = (str(dt), form, tuple(sorted(x.constexprs.items())), x.num_warps, x.num_stages)
                            if key in seen:
                                continue
                            seen.add(key)
                            r = compile_survey.compile_launch(x, cc)
                            r.update(dtype=str(dt), d=d, form=form, want_col=bool(x.constexprs["WANT_COL"]),
                                     has_bias=bool(x.constexprs["HAS_BIAS"]))
                            out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_COMPILE, 1500)


def test_split_forward_launches_compile_without_spills(compiled):
    # every form, on both archs and in both 16-bit dtypes: row statistics alone and with the column term (the
    # margin's bias column, B is A)
    forms = {(r["cc"], r["dtype"], r["form"]) for r in compiled}
    assert forms >= {(cc, dt, f) for cc in (80, 90) for dt in ("torch.bfloat16", "torch.float16", "torch.float32")
                     for f in ("info_nce", "clip", "clip_margin")}, forms
    assert {(r["cc"], r["want_col"], r["has_bias"]) for r in compiled} == {
        (cc, col, bias) for cc in (80, 90) for col, bias in ((False, False), (True, False), (True, True))}
    assert_no_spills_within_smem(compiled)
    assert_tensor_cores(compiled)
