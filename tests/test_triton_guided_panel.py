"""The guided blocks' epilogue-GEMM route (``core/guided/triton_panel.py``, ``kernels/guided.py``
``guided_epi_kernel``): the CUDA route of a summed bf16 GISTEmbed / guided InfoNCE loss, run here under the
CPU interpreter with the route forced (``FUSED_CONTRASTIVE_TRITON_PATH=panel``,
``FUSED_CONTRASTIVE_PANEL_GEMM=epilogue``) on ragged shapes over several panels. Loss and every gradient
against the float64 definition of tests/test_gist.py on the bf16-rounded inputs; all-excluded rows exactly
0; a peaked softmax (the target's gradient formed in fp32, not from a bf16 tile); the exact redo of rows whose
every exponential underflows the fixed shift; ids with the own column; a block whose rows start past 0 (the
gathered positives); where the route is taken; that no wide N x M tensor is created; and the kernels'
sm_80 / sm_90 compiles (0 spills, tensor cores)."""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive import routes
from fused_contrastive.core.guided import triton_panel as TGP
from fused_contrastive.core.guided.torch_blocks import Block, Masks, merged_lse
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.losses.guided import gist_loss
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script
from tests._wide import WideTensors
from tests.test_gist import gist_definition, info_nce_definition

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

BF = torch.bfloat16


def _r(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture
def route(monkeypatch, route):
    """Force the route (the CPU takes the fused kernels on "auto") with 64-row panels, and count the
    launches by name."""
    route(TRITON_PATH="panel")
    route(PANEL_GEMM="epilogue")
    route(GUIDED_PANEL_ROWS=64)
    names: Counter = Counter()
    orig = TL._launch

    def rec(launch):
        names[launch.name] += 1
        if launch.name == "guided_epi":  # by row tile: 64, or 128 for 16-bit guides without the split target
            names[f"guided_epi/{launch.constexprs['BLOCK_M']}"] += 1
        if launch.name == "guided_epi_redo":  # rows the redo rewrites (per block)
            names["redone rows"] += int(launch.args["BAD"].sum())
        return orig(launch)

    monkeypatch.setattr(TL, "_launch", rec)
    return names


def _close(got, want, rel, what):
    """|got - want| <= rel * max |want| (scale-aware: relative to the largest entry of the true tensor)."""
    scale = want.abs().max().clamp_min(1e-30)
    err = (got.double() - want).abs().max()
    assert err <= rel * scale, (what, float(err), float(scale))


def _gist_case(b=150, m=131, d=72, dg=21, gdt=torch.float32, seed=0):
    a, p, n = (_r(rows, d, seed=seed + s).to(BF) for rows, s in ((b, 1), (b, 2), (m, 3)))
    ga, gp, gn = (_r(rows, dg, seed=seed + s).to(gdt) for rows, s in ((b, 4), (b, 5), (m, 6)))
    return a, p, n, ga, gp, gn


def _gist_vs_definition(a, p, n, ga, gp, gn, temperature, rel_loss, rel_grad, **kw):
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, n))
    t = torch.tensor(temperature, requires_grad=True)
    got = gist_loss(la, lp, ln, guide=(ga, gp, gn), temperature=t, backend="triton", **kw)
    got.backward()
    ra, rp, rn = (x.double().requires_grad_() for x in (a, p, n))
    t2 = torch.tensor(temperature, dtype=torch.float64, requires_grad=True)
    strat = kw.get("margin_strategy", "absolute")
    want = gist_definition(ra, rp, [rn], ga.double(), gp.double(), [gn.double()], t2, strat, kw.get("margin", 0.0),
                           kw.get("contrast_anchors", True), kw.get("contrast_positives", True)).mean()
    want.backward()
    _close(got.detach().reshape(1), want.detach().reshape(1), rel_loss, "loss")
    for name, x, y in (("anchors", la.grad, ra.grad), ("positives", lp.grad, rp.grad), ("negatives", ln.grad, rn.grad),
                       ("temperature", t.grad, t2.grad)):
        assert x.dtype == (BF if name != "temperature" else torch.float32), name
        _close(x, y, rel_grad, name)
    return got, (la.grad, lp.grad, ln.grad, t.grad)


@pytest.mark.parametrize("cfg", [dict(margin=0.05),
                                 dict(margin_strategy="relative", margin=0.2, contrast_anchors=False),
                                 dict(margin=0.0, contrast_positives=False)],
                         ids=["absolute", "relative-no-anchors", "no-positives"])
def test_gist_on_the_route_equals_the_definition(cfg, route):
    # 150 rows in three panels of 64, 131 negatives, D = 72 (a ragged k-step), guide D = 21: nothing on an edge
    a, p, n, ga, gp, gn = _gist_case()
    got, grads = _gist_vs_definition(a, p, n, ga, gp, gn, 0.05, 1e-4, 2e-2, **cfg)
    assert route["guided_epi"] == 3 * (2 + cfg.get("contrast_anchors", True) + cfg.get("contrast_positives", True))
    assert not any(k.startswith("guided_fwd") or k.startswith("guided_bwd") for k in route), route
    # the same call again: bitwise the same loss and gradients (fixed orders, no atomics on the CPU)
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, n))
    t = torch.tensor(0.05, requires_grad=True)
    again = gist_loss(la, lp, ln, guide=(ga, gp, gn), temperature=t, backend="triton", **cfg)
    again.backward()
    assert torch.equal(again, got)
    for x, y in zip((la.grad, lp.grad, ln.grad, t.grad), grads, strict=True):
        assert torch.equal(x, y)


def test_16_bit_guides_on_the_route(route):
    # guides on axis vectors: cosines exactly 0 or 1 in any precision, so the bf16 guide tile and the
    # float64 definition drop the same columns (margin 0.1: no compare near its threshold)
    # (the blocks without the split target take 128-row tiles with 16-bit guides: panels of 128 rows)
    b, d = 150, 40
    a, p, n = (_r(b, d, seed=s).to(BF) for s in (1, 2, 3))
    cl = torch.arange(3 * b) % 5
    g = torch.eye(16)[torch.cat([cl[:b], cl[b:2 * b].roll(1), cl[2 * b:]])].to(BF)
    _gist_vs_definition(a, p, n, g[:b], g[b:2 * b], g[2 * b:], 0.05, 1e-4, 2e-2, margin=0.1)
    assert route["guided_epi"] == 8 and route["guided_epi/128"] == 6 and route["guided_epi/64"] == 2, route


def test_exact_duplicates_of_the_target_tie_and_are_kept_on_the_route(route):
    # rows 1 and 70 repeat row 0's / row 69's positive, model and guide rows bit for bit (70: in the second
    # panel and another row tile); the threshold is the route's own guide product of the target (each block's
    # tiles and k-steps), so the duplicates tie exactly and are kept in every block that holds them. fp32
    # guides (tf32x3 dots): the float64 definition decides every other column as the kernel does (16-bit
    # guides round the unit guide rows, which moves columns near a threshold: see the axis-vector test)
    gdt = torch.float32
    b, m, d, dg = 150, 40, 32, 12
    a, p, n = (_r(rows, d, seed=s).to(BF) for rows, s in ((b, 1), (b, 2), (m, 3)))
    ga, gp, gn = (_r(rows, dg, seed=s).to(gdt) for rows, s in ((b, 4), (b, 5), (m, 6)))
    for i, j in ((0, 1), (69, 70)):
        p[j], gp[j] = p[i], gp[i]
        a[i], a[j] = p[i], p[i]  # anchors on their positive: the tie decides about half of these rows' softmax
    got, _ = _gist_vs_definition(a, p, n, ga, gp, gn, 0.05, 1e-4, 2e-2)
    # not vacuous: dropping the duplicates (an epsilon of margin) changes the loss by far more than the error
    dropped = gist_definition(a.double(), p.double(), [n.double()], ga.double(), gp.double(), [gn.double()], 0.05,
                              margin=1e-9).mean()
    kept = gist_definition(a.double(), p.double(), [n.double()], ga.double(), gp.double(), [gn.double()], 0.05).mean()
    assert abs(float(kept - dropped)) > 1e-3 * abs(float(kept))
    assert abs(float(got.detach()) - float(kept)) < 1e-5 * abs(float(kept))


def test_all_excluded_rows_are_exactly_zero_on_the_route(route):
    # margin 3: every in-batch and hard negative is excluded, each row keeps its target alone: the loss is
    # log1p(0) = 0 and every gradient exactly 0 (the target's coefficient is -W zx = 0, its tile entry 0)
    a, p, n, ga, gp, gn = _gist_case(b=70, m=50)
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, n))
    out = gist_loss(la, lp, ln, guide=(ga, gp, gn), margin=3.0, backend="triton")
    out.backward()
    assert out.item() == 0.0
    for x in (la.grad, lp.grad, ln.grad):
        assert torch.count_nonzero(x) == 0
    assert route["guided_epi"] > 0


def test_peaked_softmax_keeps_the_target_gradient_exact(route):
    # positives close to the anchors at temperature 0.05: p_t ~ 1 - 3e-4 on average, so the true gradient is
    # O(1 - p_t). A bf16 tile holding e_t would make the target's coefficient W e_t - w carry its rounding,
    # ~2^-9 p_t: several times the gradient itself. The route keeps e_t out of the tile (fp32 partials,
    # coefficient -W zx): the error stays a small fraction of max |grad|
    b, m, d = 100, 60, 64
    a = _r(b, d, seed=1)
    p = a + 0.6 * _r(b, d, seed=2)
    a, p, n = a.to(BF), p.to(BF), _r(m, d, seed=3).to(BF)
    ga, gp, gn = a.float() + 0.01 * _r(b, d, seed=4).float(), p.float(), n.float()
    per = gist_definition(a.double(), p.double(), [n.double()], ga.double(), gp.double(), [gn.double()], 0.05)
    assert float(per.max()) < 3e-3 and float(per.mean()) < 5e-4  # peaked: every row's p_t > 0.997
    _gist_vs_definition(a, p, n, ga, gp, gn, 0.05, 1e-3, 2e-2)


def test_rows_below_the_fixed_shift_are_redone_exactly(route):
    # temperature 0.005 (|s| = 200): a row whose every logit is below |s| - 100.4 (cosines below 0.498)
    # has z_i < 2^-64 at the fixed shift and is redone with its own maximum. Rows 0..39 keep their
    # positive close (cos ~ 0.99), the others are random in D = 64 (|cos| ~ 0.1): redone
    b, m, d = 130, 70, 64
    a = _r(b, d, seed=1)
    p = _r(b, d, seed=2)
    p[:40] = a[:40] + 0.1 * p[:40]
    a, p, n = a.to(BF), p.to(BF), _r(m, d, seed=3).to(BF)
    ga, gp, gn = (_r(rows, 12, seed=s).float() for rows, s in ((b, 4), (b, 5), (m, 6)))
    _gist_vs_definition(a, p, n, ga, gp, gn, 0.005, 1e-4, 2e-2, margin=0.1)
    # the redo is launched per block and panel (its row tiles without such a row return at once); here it
    # rewrites the 90 far rows in each of the four blocks
    assert route["guided_epi_redo"] == route["guided_epi"] == 3 * 4
    assert route["redone rows"] == 90 * 4, route


@pytest.mark.parametrize("what", ["guide", "ids-self"])
def test_info_nce_masks_on_the_route(what, route):
    nq, mk = 140, 140
    q, k = _r(nq, 48, seed=1).to(BF), _r(mk, 48, seed=2).to(BF)
    gq, gk = _r(nq, 9, seed=3).float(), _r(mk, 9, seed=4).float()
    target = (torch.arange(nq) * 3 + 1) % mk
    target[4] = -100
    kw, dkw = {}, {}
    if what == "guide":
        kw["guide"], dkw = (gq, gk), dict(gq=gq.double(), gk=gk.double())
    else:  # duplicate ids and the own column (keys are the queries)
        k = q
        ids = torch.arange(nq) % 7
        kw["ids"] = (ids, ids)
        kw["exclude_self"] = True
        dkw = dict(qid=ids, kid=ids, exclude_self=True)
        target = torch.where(target == torch.arange(nq), (target + 1) % mk, target)
        target[4] = -100
        # the target must not be a duplicate id of its row in the definition (kept either way there)
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = fc.info_nce(qa, ka if what == "guide" else qa, target, temperature=0.1, backend="triton", **kw)
    qr = q.double().requires_grad_()
    kr = k.double().requires_grad_() if what == "guide" else qr
    per, valid = info_nce_definition(qr, kr, target, t=0.1, **dkw)
    want = per.sum() / valid.sum()
    _close(got.detach().reshape(1), want.detach().reshape(1), 1e-4, "loss")
    leaves = [qa, ka] if what == "guide" else [qa]
    wleaves = [qr, kr] if what == "guide" else [qr]
    for x, y in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, wleaves), strict=True):
        _close(x, y, 2e-2, "grad")
    assert route["guided_epi"] > 0


def test_a_block_whose_rows_start_past_zero(route):
    # the positive-positive block of gathered positives: rows p_all[off : off + n] against all of p_all,
    # merged with an anchor-positive block whose targets are off + i (merged_lse directly, against the
    # torch backend's sweep in float64 on the same bf16 values)
    n, tot, off, d = 70, 200, 90, 40
    a = _r(n, d, seed=1).to(BF)
    p_all = _r(tot, d, seed=2).to(BF)
    ga, gp = _r(n, 10, seed=3).float(), _r(tot, 10, seed=4).float()
    blocks = [Block(rows=0, cols=1, protect=True), Block(rows=1, cols=1, row_start=off)]
    masks = Masks(guides=(ga, gp), target=torch.arange(n) + off, rule=("absolute", 0.02))
    w = torch.linspace(0.2, 1.0, n)
    xa, xp = a.clone().requires_grad_(), p_all.clone().requires_grad_()
    got = merged_lse([xa, xp], blocks, n, 20.0, masks, weights=w, minus_target=True, backend="triton")
    ga64, gp64 = xa.detach().double().requires_grad_(), xp.detach().double().requires_grad_()
    masks64 = Masks(guides=(ga.double(), gp.double()), target=masks.target, rule=masks.rule)
    want = merged_lse([ga64, gp64], blocks, n, 20.0, masks64, weights=w.double(), minus_target=True,
                      backend="torch")
    _close(got.detach().reshape(1), want.detach().reshape(1), 1e-4, "loss")
    for x, y in zip(torch.autograd.grad(got, [xa, xp]), torch.autograd.grad(want, [ga64, gp64]), strict=True):
        _close(x, y, 2e-2, "grad")
    assert route["guided_epi"] == 4  # two panels of 64 rows, two blocks


def test_nan_guide_row_on_the_route(route):
    a, p, n, ga, gp, gn = _gist_case(b=70, m=50)
    ga[3, 0] = float("nan")
    la = a.clone().requires_grad_()
    out = gist_loss(la, p, n, guide=(ga, gp, gn), backend="triton")
    assert torch.isnan(out)
    (g,) = torch.autograd.grad(out, [la])
    assert torch.isfinite(g).all()  # the NaN row's loss does not depend on the inputs
    assert route["guided_epi"] > 0


def test_where_the_route_is_taken(monkeypatch):
    names: Counter = Counter()
    orig = TL._launch
    monkeypatch.setattr(TL, "_launch", lambda lz: (names.update([lz.name]), orig(lz))[1])
    a, p, n, ga, gp, gn = _gist_case(b=40, m=30, d=16, dg=8)

    def run(dtype=BF, **kw):
        names.clear()
        xs = [x.to(dtype).requires_grad_() for x in (a, p, n)]
        out = gist_loss(*xs, guide=(ga, gp, gn), backend="triton", **kw)
        out.sum().backward()
        return "guided_epi" in names

    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "auto")
    assert not run()  # the CPU: "auto" takes the panel path only for CUDA tensors
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "panel")
    monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", "epilogue")
    assert run()
    assert not run(reduction="none")  # per-row output: the recomputing fused kernels
    assert not run(torch.float16)  # fp16 cannot hold e^56: the fused kernels
    assert not run(torch.float32)
    assert not run(normalize=False)  # no bound on the logits without unit rows
    monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", "cublas")
    assert not run()
    # the rule for CUDA / meta tensors (what a GPU takes): the panel path from 2^24 logits, then the
    # epilogue GEMM from EPILOGUE_MIN_ELEMENTS["guided", cc]
    monkeypatch.setenv("FUSED_CONTRASTIVE_TRITON_PATH", "auto")
    monkeypatch.setenv("FUSED_CONTRASTIVE_PANEL_GEMM", "auto")
    monkeypatch.setattr(panels, "EPILOGUE_DEVICES", ("cuda", "meta", "cpu"))
    monkeypatch.setattr(panels, "use_panel", lambda x, nn, mm: nn * mm >= panels.MIN_ELEMENTS)
    from fused_contrastive.core.guided.torch_blocks import _Config

    for rows, want in ((1024, False), (4096, True)):
        xs = [torch.empty(rows, 8, dtype=BF)] * 2
        cfg = _Config((Block(0, 1, protect=True),), rows, True, 1e-12, True)
        assert TGP.use_guided_panel(xs, cfg, torch.ones(rows)) == want, rows


def test_the_route_writes_no_wide_n_by_m_tensor(route, monkeypatch):
    """Every [P, M]-shaped tensor created on the route is the 16-bit tile: a probe records the element size
    of every new 2-d tensor of P rows and at least M / 2 columns (the GEMM helpers' internals not counted:
    the CPU's "upcast" route copies the tile to fp32 for torch.mm, CUDA's native route reads it as it is).
    The probe sees the fp32 tiles of the per-row torch sweep, so it can fail."""
    b, m = 128, 120
    probe = WideTensors(64, m // 2)
    monkeypatch.setattr(panels, "_mm32", probe.counted(panels._mm32, "mm32"))
    monkeypatch.setattr(panels, "_addmm32_", probe.counted(panels._addmm32_, "addmm32"))
    a, p, n, ga, gp, gn = _gist_case(b=b, m=m, d=32, dg=8)
    xs = [x.clone().requires_grad_() for x in (a, p, n)]
    with probe:
        gist_loss(*xs, guide=(ga, gp, gn), backend="triton").backward()
    tiles = [s for s in probe.seen if s[0] != "mm32"]  # mm32's [P, D] outputs are narrow: not recorded
    assert route["guided_epi"] > 0 and tiles, probe.seen  # the probe saw the tiles
    assert all(size == 2 for _, size, _ in tiles), tiles
    # the same probe on the torch backend's sweep (fp32 tiles of 64-row chunks) sees 4-byte tensors
    probe.seen.clear()
    monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", str(64 * b))  # 64-row chunks (b is the widest block)
    xs = [x.detach().float().requires_grad_() for x in (a, p, n)]
    with probe:
        gist_loss(*xs, guide=(ga, gp, gn), backend="torch").backward()
    assert any(size == 4 for _, size, _ in probe.seen), probe.seen


def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:
    import os

    import torch.distributed as dist

    from tests._ranks import gloo_rank
    from tests.test_gist import _global_definition

    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "panel"
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "epilogue"
    hooks = routes.override(GUIDED_PANEL_ROWS=64)  # for the worker's life (a reference keeps it entered)
    hooks.__enter__()
    torch.set_num_threads(1)
    with gloo_rank(rank, world, init, out):
        names: Counter = Counter()
        orig = TL._launch
        TL._launch = lambda lz: (names.update([lz.name]), orig(lz))[1]
        total, off, b = sum(sizes), sum(sizes[:rank]), sizes[rank]
        a, p, n, ga, gp, gn = _gist_case(b=total, m=total, d=40, dg=10, seed=7)
        mine = slice(off, off + b)
        la, lp, ln = (x[mine].clone().requires_grad_() for x in (a, p, n))
        t = torch.tensor(0.05, requires_grad=True)
        loss = gist_loss(la, lp, ln, guide=(ga[mine], gp[mine], gn[mine]), temperature=t, margin=0.05, gather=True,
                         backend="triton")
        loss.backward()
        ra, rp, rn = (x.double().requires_grad_() for x in (a, p, n))
        t2 = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
        want = _global_definition(ra, rp, rn, ga.double(), gp.double(), gn.double(), t2, sizes, 0.05)
        want.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the rank average is the global loss, DDP's gradient average the global gradient
        tg = t.grad.clone()
        dist.all_reduce(tg)
        errs = {name: float((x.grad.double() / world - y.grad[mine]).abs().max() / y.grad.abs().max())
                for name, x, y in (("anchors", la, ra), ("positives", lp, rp), ("negatives", ln, rn))}
        errs["temperature"] = abs(float(tg) / world - float(t2.grad)) / abs(float(t2.grad))
        out.put({"rank": rank, "loss_err": abs(float(mean) / world - float(want)) / abs(float(want)), "errs": errs,
                 "epi": names["guided_epi"]})


def test_gather_over_ranks_on_the_route(tmp_path):
    # gist_loss(gather=True) on the route, two gloo ranks with uneven batches (130 and 70 rows: three and two
    # panels): the anchor-anchor block against every rank's anchors, the positive-positive block's rows
    # starting at the rank's offset; the rank average against the float64 global loss and its gradients
    from tests._ranks import run_ranks

    results = run_ranks(_gather_worker, 2, tmp_path, [130, 70], timeout=300)
    for r in results:
        assert r["epi"] == 4 * (3 if r["rank"] == 0 else 2), r
        assert r["loss_err"] < 1e-4, r
        assert all(e < 2e-2 for e in r["errs"].values()), r


_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    from concurrent.futures import ProcessPoolExecutor

    os.environ["FUSED_CONTRASTIVE_TRITON_PATH"] = "panel"
    os.environ["FUSED_CONTRASTIVE_PANEL_GEMM"] = "epilogue"

    import torch

    from fused_contrastive.core.guided.torch_blocks import Block, Masks, merged_lse
    from fused_contrastive.tools import compile_survey

    DT = {"bf16": torch.bfloat16, "fp32": torch.float32}

    def record(fam, gname, variant, n=4096, d=768, dg=384):
        # the route's launches of GIST (four blocks, the threshold rule) and of info_nce with a guide, ids
        # and the own column, bf16 model embeddings, guides in gname
        meta = torch.device("meta")
        gdt = DT[gname]
        a, p, ng = (torch.empty(n, d, dtype=torch.bfloat16, device=meta).requires_grad_() for _ in range(3))
        s = torch.empty((), device=meta, requires_grad=True)
        w = torch.empty(n, device=meta)
        i64 = torch.empty(n, dtype=torch.int64, device=meta)
        with compile_survey.recording(fam) as launches:
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
        seen, out = set(), []
        for x in launches:
            key = (x.name, tuple(sorted(x.constexprs.items())), x.num_warps)
            if x.name.startswith(("guided_epi", "guided_rows", "guided_acc")) and key not in seen:
                seen.add(key)
                out.append(x)
        return out

    def job(args):
        cc, fam, gname, variant, i = args
        lz = record(fam, gname, variant)[i]
        out = compile_survey.compile_launch(lz, cc)
        c = lz.constexprs
        # guided_rows (the merge over the blocks): "merge" before the redo, "finish" after it
        # guided_acc (a row tensor's panel into its accumulator): "acc", with or without the target's term
        mode = c["MODE"] if "MODE" in c else ("acc" if "HAS_T" in c else ("finish" if c["FINISH"] else "merge"))
        out.update(guide=gname, variant=variant, split=bool(c.get("SPLIT_T", c.get("SPLIT", c.get("HAS_T")))),
                   mode=mode, kernel=lz.name)
        return out

    if __name__ == "__main__":
        jobs = [(cc, fam, g, v, i) for cc, fam in compile_survey.TARGETS for g in DT for v in ("gist", "ids")
                for i in range(len(record(fam, g, v)))]
        with ProcessPoolExecutor(max_workers=2) as ex:
            print(json.dumps(list(ex.map(job, jobs))))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_SCRIPT, 900)


def test_route_kernels_compile_without_spills(compiled):
    # per arch and guide dtype: GIST's split (target) and plain blocks, info_nce's ids-and-self block, each
    # in MODE 1 (the one pass) and MODE 2 (the redo); the merge over the blocks before and after the redo
    epi = [r for r in compiled if r["kernel"] not in ("guided_rows", "guided_acc")]
    kinds = {(r["cc"], r["guide"], r["variant"], r["split"], r["mode"]) for r in epi}
    assert len(kinds) == 2 * 2 * 3 * 2 == len(epi), sorted(kinds)
    rows = {(r["cc"], r["guide"], r["variant"], r["split"], r["mode"])
            for r in compiled if r["kernel"] == "guided_rows"}
    assert rows == {(cc, g, v, True, m) for cc in (80, 90) for g in ("bf16", "fp32") for v in ("gist", "ids")
                    for m in ("merge", "finish")}, sorted(rows)
    # GIST's anchors (with the target's term) and positives (without); ids' anchors (with it)
    accs = {(r["cc"], r["guide"], r["variant"], r["split"]) for r in compiled if r["kernel"] == "guided_acc"}
    assert accs == {(cc, g, v, t) for cc in (80, 90) for g in ("bf16", "fp32") for v, t in
                    (("gist", True), ("gist", False), ("ids", True))}, sorted(accs)
    assert_no_spills_within_smem(compiled)


def test_route_kernels_use_tensor_cores(compiled):
    # (the merge and the accumulation are row kernels: no matmul)
    assert_tensor_cores([r for r in compiled if r["kernel"] not in ("guided_rows", "guided_acc")])
