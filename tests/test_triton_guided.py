"""The guided (GISTEmbed) / id-masked blocks on the Triton kernels (``kernels/guided.py``): under the CPU
interpreter, ragged shapes (N, M, D and the guide dimension off every tile edge) against the float64
definition of tests/test_gist.py, loss and every gradient, fp32 / fp16 / bf16, the resident and the
streaming accumulator; all-masked rows exactly 0; NaN guides; and every guided kernel compiled for
sm_80 and sm_90 with every mask on: 0 spills, tensor-core instructions, shared memory within the
architecture's."""

from __future__ import annotations

import textwrap

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive.losses.guided import gist_loss
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script
from tests.test_gist import gist_definition, info_nce_definition

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)


def _r(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# fp32: tf32x3 dots (~fp32); 16-bit: the operands are rounded to the dtype, so the definition is run on
# the rounded inputs and the tolerance covers the fp16 / bf16 rounding of the softmax-weighted tile
TOLS = {torch.float32: (2e-5, 2e-4), torch.float16: (2e-3, 2e-2), torch.bfloat16: (1e-2, 6e-2)}


def _check(got, want, dtype, what=""):
    lt, gt = TOLS[dtype]
    scale = want.abs().max().clamp_min(1e-3)
    err = (got.double() - want).abs().max()
    assert err <= lt * scale if what == "loss" else err <= gt * scale, (what, float(err), float(scale))


@pytest.mark.parametrize("dtype,d", [(torch.float32, 20), (torch.float16, 20), (torch.bfloat16, 20),
                                     (torch.float16, 144)], ids=["fp32", "fp16-resident", "bf16-resident",
                                                                 "fp16-streaming"])
@pytest.mark.parametrize("cfg", [dict(margin=0.05), dict(margin_strategy="relative", margin=0.2, ca=False),
                                 dict(margin=0.0, cp=False)], ids=["absolute", "relative-no-anchors",
                                                                   "no-positives"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gist_on_triton_equals_the_definition(dtype, d, cfg, reduction):
    b, m, dg = 37, 29, 21  # nothing on a tile edge; the guide's 21 = one 16-wide chunk and a ragged one
    a, p, n = (_r(rows, d, seed=s).to(dtype) for rows, s in ((b, 1), (b, 2), (m, 3)))
    ga, gp, gn = (_r(rows, dg, seed=s).float() for rows, s in ((b, 4), (b, 5), (m, 6)))
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, n))
    t = torch.tensor(0.07, requires_grad=True)
    strat = cfg.get("margin_strategy", "absolute")
    got = gist_loss(la, lp, ln, guide=(ga, gp, gn), temperature=t, margin_strategy=strat, margin=cfg["margin"],
                    contrast_anchors=cfg.get("ca", True), contrast_positives=cfg.get("cp", True), reduction=reduction,
                    backend="triton")
    assert got.dtype == torch.float32
    ra, rp, rn = (x.double().requires_grad_() for x in (a, p, n))
    t2 = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    per = gist_definition(ra, rp, [rn], ga.double(), gp.double(), [gn.double()], t2, strat, cfg["margin"],
                          cfg.get("ca", True), cfg.get("cp", True))
    want = per.mean() if reduction == "mean" else per
    _check(got, want.detach(), dtype, "loss")
    up = torch.linspace(0.5, 1.5, b, dtype=torch.float64) if reduction == "none" else torch.tensor(1.0)
    g1 = torch.autograd.grad((got * up.float()).sum(), [la, lp, ln, t])
    g2 = torch.autograd.grad((want * up).sum(), [ra, rp, rn, t2])
    for x, y, name in zip(g1, g2, ("anchors", "positives", "negatives", "temperature"), strict=True):
        assert x.dtype == (dtype if name != "temperature" else torch.float32)
        _check(x, y, dtype, name)


def test_16_bit_guides_run_the_guide_dot_in_16_bit():
    # guides on axis vectors: cosines exactly 0 or 1 in any precision, so the bf16 guide tile and the
    # float64 definition drop the same columns (margin 0.1: no compare near its threshold)
    b, d = 24, 16
    a, p, n = (_r(b, d, seed=s).to(torch.bfloat16) for s in (1, 2, 3))
    cl = torch.arange(3 * b) % 5
    g = torch.eye(16)[torch.cat([cl[:b], cl[b:2 * b].roll(1), cl[2 * b:]])]
    ga, gp, gn = g[:b].to(torch.bfloat16), g[b:2 * b].to(torch.bfloat16), g[2 * b:].to(torch.bfloat16)
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, n))
    got = gist_loss(la, lp, ln, guide=(ga, gp, gn), temperature=0.05, margin=0.1, backend="triton", reduction="none")
    ra, rp, rn = (x.double().requires_grad_() for x in (a, p, n))
    want = gist_definition(ra, rp, [rn], ga.double(), gp.double(), [gn.double()], 0.05, margin=0.1)
    _check(got, want.detach(), torch.bfloat16, "loss")
    for x, y in zip(torch.autograd.grad(got.sum(), [la, lp, ln]), torch.autograd.grad(want.sum(), [ra, rp, rn]),
                    strict=True):
        _check(x, y, torch.bfloat16)


@pytest.mark.parametrize("what", ["guide", "ids", "both"])
def test_info_nce_masks_on_triton_equal_the_definition(what):
    nq, mk = 19, 23
    q, k = _r(nq, 12, seed=1).float(), _r(mk, 12, seed=2).float()
    gq, gk = _r(nq, 5, seed=3).float(), _r(mk, 5, seed=4).float()
    qid, kid = torch.arange(nq) % 5, torch.arange(mk) % 5
    target = (torch.arange(nq) * 3) % mk
    target[4] = -100
    kw, dkw = {}, {}
    if what != "ids":
        kw["guide"], dkw = (gq, gk), dict(gq=gq.double(), gk=gk.double())
    if what != "guide":
        kw["ids"] = (qid, kid)
        dkw.update(qid=qid, kid=kid)
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = fc.info_nce(qa, ka, target, temperature=0.1, backend="triton", **kw)
    qr, kr = q.double().requires_grad_(), k.double().requires_grad_()
    per, valid = info_nce_definition(qr, kr, target, t=0.1, **dkw)
    want = per.sum() / valid.sum()
    _check(got, want.detach(), torch.float32, "loss")
    for x, y in zip(torch.autograd.grad(got, [qa, ka]), torch.autograd.grad(want, [qr, kr]), strict=True):
        _check(x, y, torch.float32)


def test_all_masked_rows_are_exactly_zero_on_triton():
    a, p = _r(9, 16, seed=1).float(), _r(9, 16, seed=2).float()
    ga, gp = _r(9, 4, seed=3).float(), _r(9, 4, seed=4).float()
    la, lp = a.clone().requires_grad_(), p.clone().requires_grad_()
    out = gist_loss(la, lp, guide=(ga, gp), margin=3.0, reduction="none", backend="triton")
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(la.grad, torch.zeros_like(la.grad)) and torch.equal(lp.grad, torch.zeros_like(lp.grad))


def test_nan_guide_gives_nan_on_triton():
    a, p = _r(9, 16, seed=1).float(), _r(9, 16, seed=2).float()
    ga, gp = _r(9, 4, seed=3).float(), _r(9, 4, seed=4).float()
    ga[3, 0] = float("nan")
    out = gist_loss(a, p, guide=(ga, gp), reduction="none", contrast_anchors=False, backend="triton")
    assert torch.isnan(out[3]) and torch.isfinite(out[torch.arange(9) != 3]).all()


def test_triton_and_torch_paths_agree_on_float32():
    a, p, n = (_r(40, 24, seed=s).float() for s in (1, 2, 3))
    ga, gp, gn = (_r(40, 8, seed=s).float() for s in (4, 5, 6))
    x = gist_loss(a, p, n, guide=(ga, gp, gn), margin=0.02, backend="triton")
    y = gist_loss(a, p, n, guide=(ga, gp, gn), margin=0.02, backend="torch")
    torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# ahead-of-time compiles (no GPU): every guided kernel, sm_80 and sm_90, every mask on
# ---------------------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import json
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from fused_contrastive.core.guided import triton_blocks as TG
    from fused_contrastive.tools import compile_survey

    DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
    # the mask sets the losses launch: GIST's protected anchor-positive block and its other blocks (fp32 or
    # 16-bit guides), info_nce's id mask with the own column, and every mask at once
    VARIANTS = {"gist-target": dict(guide=True, protect=True), "gist-other": dict(guide=True),
                "ids-self": dict(ids=True, protect=True, exclude=True),
                "all": dict(guide=True, ids=True, protect=True, exclude=True),
                "gist-rule": dict(guide=True, protect=True, rule=True)}

    def record(fam, dt, d, variant, gdt, n=4096, dg=384):
        v = VARIANTS[variant]
        meta = torch.device("meta")
        a, b = torch.empty(n, d, dtype=dt, device=meta), torch.empty(n, d, dtype=dt, device=meta)
        i64 = dict(dtype=torch.int64, device=meta)
        g = v.get("guide", False)
        ga = torch.empty(n, dg, dtype=gdt, device=meta) if g else None
        gb = torch.empty(n, dg, dtype=gdt, device=meta) if g else None
        theta = torch.empty(n, device=meta) if g else None
        if v.get("rule"):  # the threshold read from the guide tiles: guided_theta_kernel per launch config
            theta = TG.ThetaSource(ga, gb, torch.empty(n, **i64), "absolute", 0.0)
        mk = TG.BlockMasks(ga=ga, gb=gb, theta=theta,
                           idr=torch.empty(n, **i64) if v.get("ids") else None,
                           idc=torch.empty(n, **i64) if v.get("ids") else None,
                           tgt=torch.empty(n, **i64) if v.get("protect") else None,
                           exclude=0 if v.get("exclude") else None)
        s = torch.empty((), device=meta)
        with compile_survey.recording(fam) as launches:
            lse, tl, p = TG.block_fwd(a, b, s, mk, True, 1e-12)
            gr = torch.empty(n, device=meta)
            TG.block_bwd(p, s, mk, True, 1e-12, lse, gr, gr if v.get("protect") else None, True, True, True)
        if v.get("rule"):  # its guided kernels are gist-target's: only the theta launches, one per config
            seen, out = set(), []
            for x in launches:
                key = tuple(sorted(x.constexprs.items())) + (x.num_warps,)
                if x.name == "theta_guided" and key not in seen:
                    seen.add(key)
                    out.append(x)
            return out
        return [x for x in launches if x.name.startswith("guided")]

    def job(args):
        cc, fam, dname, d, variant, gname, i = args
        out = compile_survey.compile_launch(record(fam, DT[dname], d, variant, DT[gname])[i], cc)
        out.update(dtype=dname, d=d, variant=variant, guide=gname)
        return out

    if __name__ == "__main__":
        # fp32 inputs take one config for every D (triton_shared.configs._T32): D = 768 covers them
        shapes = [("bf16", 64), ("bf16", 128), ("bf16", 768), ("fp32", 768)]
        jobs = [(cc, fam, dn, d, v, gn, i) for cc, fam in compile_survey.TARGETS for v in ("gist-target", "gist-other")
                for gn in DT for dn, d in shapes for i in range(3)]
        jobs += [(cc, fam, dn, 768, v, "fp32", i) for cc, fam in compile_survey.TARGETS for v in ("ids-self", "all")
                 for dn in DT for i in range(3)]
        jobs += [(cc, fam, dn, d, "gist-rule", gn, i) for cc, fam in compile_survey.TARGETS for gn in DT
                 for dn, d in shapes
                 for i in range(len(record(fam, DT[dn], d, "gist-rule", DT[gn])))]
        with ProcessPoolExecutor(max_workers=2) as ex:
            print(json.dumps(list(ex.map(job, jobs))))
    """
)

@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_SCRIPT, 900)


def test_every_guided_kernel_compiles_without_spills(compiled):
    # fp16 runs bf16's code with another operand type (the same registers): bf16 and fp32 are compiled
    kinds = {(r["kernel"], r["cc"], r["dtype"], r["d"], r["variant"], r["guide"]) for r in compiled
             if r["variant"] != "gist-rule"}
    assert len(kinds) == 3 * 2 * (2 * 2 * 4 + 2 * 2), len(kinds)
    # guided_theta_kernel (GIST's threshold from the guide tiles), at every config the guided kernels use
    theta = {(r["cc"], r["dtype"], r["d"], r["guide"]) for r in compiled if r["variant"] == "gist-rule"}
    assert len(theta) == 2 * 4 * 2, theta
    assert all(r["kernel"] == "theta_guided" for r in compiled if r["variant"] == "gist-rule")
    assert_no_spills_within_smem(compiled)


def test_guided_kernels_use_tensor_cores(compiled):
    assert_tensor_cores(compiled)


@pytest.mark.parametrize("kind", ["positive", "pair"])
def test_exact_duplicates_tie_and_are_kept_on_triton(kind):
    # rows 1 and 33 repeat row 0's / row 32's positive (and, "pair", its anchor), guide and model rows bit
    # for bit; the threshold is the kernels' own guide product of the target (guided_theta_kernel on the
    # comparing kernel's tiles), so the duplicates tie exactly and are kept in the forward and in both
    # recomputing backward kernels: loss and every gradient equal the definition, which keeps them
    b, m, d, dg = 37, 29, 20, 21
    a, p, n = (_r(rows, d, seed=s).float() for rows, s in ((b, 1), (b, 2), (m, 3)))
    ga, gp, gn = (_r(rows, dg, seed=s).float() for rows, s in ((b, 4), (b, 5), (m, 6)))
    for i, j in ((0, 1), (32, 33)):
        p[j], gp[j] = p[i], gp[i]
        if kind == "pair":
            a[j], ga[j] = a[i], ga[i]
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, n))
    got = gist_loss(la, lp, ln, guide=(ga, gp, gn), temperature=1.0, reduction="none", backend="triton")
    ra, rp, rn = (x.double().requires_grad_() for x in (a, p, n))
    want = gist_definition(ra, rp, [rn], ga.double(), gp.double(), [gn.double()], 1.0)
    _check(got, want.detach(), torch.float32, "loss")
    # not vacuous: the tie decides these rows (dropping the duplicates changes their loss)
    dropped = gist_definition(a.double(), p.double(), [n.double()], ga.double(), gp.double(), [gn.double()], 1.0,
                              margin=1e-9)
    for i in (0, 1, 32, 33):
        assert abs(float(want[i] - dropped[i])) > 1e-3, (i, float(want[i]), float(dropped[i]))
    up = torch.linspace(0.5, 1.5, b, dtype=torch.float64)
    g1 = torch.autograd.grad((got.double() * up).sum(), [la, lp, ln])
    g2 = torch.autograd.grad((want * up).sum(), [ra, rp, rn])
    for x, y, w in zip(g1, g2, "apn", strict=True):
        _check(x, y, torch.float32, w)
