"""The sm_80 / sm_90 compiles of the SET split (``SPLIT_SET``: SupCon L_out's ``c.set_i w_ij`` subtracted inside
the 16-bit gradient tiles; tests/test_peaked_supcon.py has its numerics on the interpreter): every launch
that takes it, recorded as SupCon L_out's core-op call makes it (labels, and a float mask; B is A and
A != B; the fused kernels, the panel path's cuBLAS form and epilogue GEMM: the triangular sweep, the
recomputing sweep from known statistics and fp16's two-pass eager sweep), compiles without spills, within
shared memory and on tensor cores."""

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
    import torch
    from fused_contrastive import core, routes
    from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
    from fused_contrastive.tools import compile_survey

    meta = torch.device("meta")
    n, d = 4096, 768

    def record(arch, dt, pos, same, reduce):
        a = torch.empty(n, d, dtype=dt, device=meta, requires_grad=True)
        b = None if same else torch.empty(2 * n, d, dtype=dt, device=meta, requires_grad=True)
        m = n if same else 2 * n
        if pos == "labels":
            data = CoreData(row_labels=torch.empty(n, dtype=torch.int64, device=meta),
                            col_labels=torch.empty(m, dtype=torch.int64, device=meta))
        else:
            data = CoreData(pos_mask=torch.empty(n // 2, n // 2, device=meta))
        coef = Coeffs(lse=torch.empty(n, device=meta), set=torch.empty(n, device=meta))
        s = torch.empty((), device=meta, requires_grad=True)
        with compile_survey.recording(arch) as launches:
            out = core.run("triton", a, b, s, CoreSpec(exclude_self=True), data, coef, reduce)
            torch.autograd.grad(out if reduce else out.sum(), [x for x in (a, b, s) if x is not None])
        return launches

    # (dtype, positives, B is A, summed): the triangular sweep, the recomputing sweep, fp16's two-pass eager one
    bf, hf = torch.bfloat16, torch.float16
    CALLS = ((bf, "labels", True, True), (bf, "mask", True, True), (hf, "labels", True, True),
             (bf, "labels", False, False), (bf, "mask", False, False), (hf, "labels", False, True))
    out = []
    hooks = routes.override(DENSE="0", PANEL_ROWS=1024)  # several panels
    hooks.__enter__()
    for path, gemm in (("fused", None), ("panel", "cublas"), ("panel", "epilogue")):
        os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = path
        if gemm:
            os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = gemm
        for cc, arch in compile_survey.TARGETS:
            seen = set()
            for dt, pos, same, reduce in CALLS:
                for x in record(arch, dt, pos, same, reduce):
                    if not x.constexprs.get("SPLIT_SET"):
                        continue
                    key = (x.name, str(dt), x.constexprs.get("POS_KIND"), x.constexprs.get("SYM"),
                           x.constexprs.get("TRI"), x.constexprs.get("EAGER"))
                    if key in seen:
                        continue
                    seen.add(key)
                    r = compile_survey.compile_launch(x, cc)
                    r.update(path=path, gemm=gemm, dtype=str(dt), pos_kind=x.constexprs["POS_KIND"],
                             sym=bool(x.constexprs.get("SYM")), tri=bool(x.constexprs.get("TRI")),
                             eager=bool(x.constexprs.get("EAGER")))
                    out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_COMPILE, 1500)


def test_set_split_launches_compile_without_spills(compiled):
    # every form that takes the split, on both archs: the fused row (symmetric and not) and column kernels, the
    # panel kernel (triangular, known statistics, fp16's eager sweep) and the epilogue GEMM's MODE 0
    forms = {(r["cc"], r["kernel"], r["sym"], r["tri"], r["eager"]) for r in compiled}
    for cc in (80, 90):
        assert {(cc, "lse_bwd_rows", True, False, False), (cc, "lse_bwd_rows", False, False, False),
                (cc, "lse_bwd_cols", False, False, False), (cc, "panel_dl", True, True, False),
                (cc, "panel_dl", False, False, False), (cc, "panel_dl", False, False, True),
                (cc, "epi_gemm", True, True, False), (cc, "epi_gemm", False, False, False)} <= forms, forms
    assert {r["pos_kind"] for r in compiled} == {1, 2}
    assert_no_spills_within_smem(compiled)
    # the kernels whose tile feeds a matmul of their own (the panel kernel hands its tile to cuBLAS)
    assert_tensor_cores([r for r in compiled if r["kernel"] != "panel_dl"])
