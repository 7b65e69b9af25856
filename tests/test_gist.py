"""Guided in-batch negatives (``gist_loss``, ``info_nce(guide=, ids=)``) on the merged-block core against
the definition written here from sentence-transformers' description (broadcast cosines, masks, one
concatenated score matrix, cross-entropy), float64: loss and every gradient (the temperature's too),
both reductions, one row chunk and many chunks, the margin strategies incl. negative guide
similarities, ties at the threshold, all-masked rows, NaN guides, hard-negative columns, the contrast
flags, gather over 2 and 3 gloo ranks with uneven sizes, the memory bound, Matryoshka levels and
autocast (the Triton kernels: tests/test_triton_guided.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from fused_contrastive.losses.guided import gist_loss
from tests._ranks import gloo_rank, run_ranks

TOL = dict(rtol=1e-11, atol=1e-12)


def _r(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cos(x, y):
    return F.cosine_similarity(x[:, None, :], y[None, :, :], dim=-1)


def gist_definition(a, p_all, negs, ga, gp_all, gns, t, strategy="absolute", margin=0.0, ca=True, cp=True, off=0,
                    a_cols=None, ga_cols=None):
    """Per-row GISTEmbed losses of rows ``a`` (global rows off..off+B) from the definition; ``a_cols`` /
    ``ga_cols``: the anchor-anchor block's columns (default ``a`` / ``ga``: this rank's anchors)."""
    b = a.shape[0]
    rows = torch.arange(b)
    gpos = _cos(ga, gp_all)[rows, off + rows]
    theta = gpos - margin if strategy == "absolute" else gpos - gpos.abs() * margin

    def block(x, y, gx, gy, protect):
        drop = _cos(gx, gy) > theta[:, None]
        if protect:
            drop[rows, off + rows] = False
        return (_cos(x, y) / t).masked_fill(drop, -math.inf)  # masked after the division: no inf * 0

    scores = [block(a, p_all, ga, gp_all, True)]
    if ca:
        scores.append(block(a, a if a_cols is None else a_cols, ga, ga if ga_cols is None else ga_cols, False))
    if cp:
        scores.append(block(p_all[off:off + b], p_all, gp_all[off:off + b], gp_all, False))
    scores += [block(a, x, ga, gx, False) for x, gx in zip(negs, gns, strict=True)]
    return F.cross_entropy(torch.cat(scores, dim=1), rows + off, reduction="none")


def _inputs(b=10, d=6, dg=3, n_neg=1, seed=0, m_neg=None):
    a, p = _r(b, d, seed=seed), _r(b, d, seed=seed + 1)
    negs = [_r(m_neg or b, d, seed=seed + 2 + k) for k in range(n_neg)]
    # guides in a low dimension: cosines of both signs, masks that drop some negatives and keep others
    ga, gp = _r(b, dg, seed=seed + 10), _r(b, dg, seed=seed + 11)
    gns = [_r(m_neg or b, dg, seed=seed + 12 + k) for k in range(n_neg)]
    return a, p, negs, ga, gp, gns


CONFIGS = {
    "absolute-0": dict(strategy="absolute", margin=0.0),
    "absolute-0.3": dict(strategy="absolute", margin=0.3),
    "relative-0.2": dict(strategy="relative", margin=0.2),
    "absolute-negative-margin": dict(strategy="absolute", margin=-0.1),
    "no-anchors": dict(strategy="absolute", margin=0.1, ca=False),
    "no-positives": dict(strategy="relative", margin=0.1, cp=False),
    "neither": dict(strategy="absolute", margin=0.0, ca=False, cp=False),
}


def _call(a, p, negs, ga, gp, gns, t, cfg, **kw):
    neg = negs if len(negs) != 1 else negs[0]
    guide = (ga, gp, gns if len(gns) != 1 else gns[0]) if negs else (ga, gp)
    return gist_loss(a, p, neg if negs else None, guide=guide, temperature=t, margin_strategy=cfg["strategy"],
                     margin=cfg["margin"], contrast_anchors=cfg.get("ca", True),
                     contrast_positives=cfg.get("cp", True), **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n_neg", [0, 1, 2])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("path", ["torch-one-chunk", "torch-many-chunks", "reference"])
def test_gist_loss_equals_the_definition(path, cfg, n_neg, reduction, monkeypatch, route):
    backend = path.split("-")[0]
    if path == "torch-many-chunks":
        route(TILE_ELEMENTS="24")  # 1 row of up to 40 columns per chunk
    c = CONFIGS[cfg]
    a, p, negs, ga, gp, gns = _inputs(n_neg=n_neg, m_neg=7 if n_neg == 2 else None)
    leaves = [x.clone().requires_grad_() for x in (a, p, *negs)]
    t = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    got = _call(leaves[0], leaves[1], leaves[2:], ga, gp, gns, t, c, reduction=reduction, backend=backend)
    ref_leaves = [x.clone().requires_grad_() for x in (a, p, *negs)]
    t2 = t.detach().clone().requires_grad_()
    per = gist_definition(ref_leaves[0], ref_leaves[1], ref_leaves[2:], ga, gp, gns, t2, c["strategy"], c["margin"],
                          c.get("ca", True), c.get("cp", True))
    want = {"mean": per.mean(), "sum": per.sum(), "none": per}[reduction]
    torch.testing.assert_close(got, want, **TOL)
    up = torch.linspace(0.5, 1.5, a.shape[0], dtype=torch.float64) if reduction == "none" else torch.tensor(1.0)
    g1 = torch.autograd.grad((got * up).sum(), [*leaves, t])
    g2 = torch.autograd.grad((want * up).sum(), [*ref_leaves, t2])
    for x, y in zip(g1, g2, strict=True):
        torch.testing.assert_close(x, y, **TOL)


def test_the_inputs_mask_some_negatives_and_keep_others():
    # the parametrised cases above are not vacuous: the guide drops some in-batch negatives, keeps others
    a, p, negs, ga, gp, gns = _inputs()
    rows = torch.arange(a.shape[0])
    gpos = _cos(ga, gp)[rows, rows]
    drop = _cos(ga, gp) > gpos[:, None]
    drop[rows, rows] = False
    frac = drop.double().mean().item()
    assert 0.2 < frac < 0.8, frac
    assert (_cos(ga, gp) < 0).any()  # negative guide similarities: the relative rule's sign matters
    assert (gpos < 0).any()


def test_relative_margin_is_sign_independent():
    # gpos < 0: the threshold gpos - |gpos| m is below gpos (a larger margin drops more), as in
    # sentence-transformers 6.2; "gpos * (1 - m)" would be above it
    a, p, negs, ga, gp, gns = _inputs()
    for m in (0.0, 0.5):
        c = dict(strategy="relative", margin=m)
        got = _call(a, p, [], ga, gp, [], 0.1, c, reduction="none")
        want = gist_definition(a, p, [], ga, gp, [], 0.1, "relative", m)
        torch.testing.assert_close(got, want, **TOL)
    loose = _call(a, p, [], ga, gp, [], 0.1, dict(strategy="relative", margin=0.0), reduction="none")
    strict = _call(a, p, [], ga, gp, [], 0.1, dict(strategy="relative", margin=0.5), reduction="none")
    assert (strict <= loose + 1e-12).all()  # more dropped negatives, smaller loss, on every row


def test_ties_at_the_threshold_are_kept():
    # exactly representable guide cosines: column j with cos(ga_i, gp_j) == gpos_i stays (strict >)
    e1 = torch.tensor([1.0, 0, 0], dtype=torch.float64)
    v = torch.tensor([3.0, 4.0, 0], dtype=torch.float64)  # cos with e1 = 0.6 exactly as computed
    w = torch.tensor([4.0, 3.0, 0], dtype=torch.float64)  # cos with e1 = 0.8 > 0.6: dropped
    ga = torch.stack([e1, e1, e1])
    gp = torch.stack([v, v, w])  # row 0's positive v: column 1 (v) ties, column 2 (w) is above
    a, p = _r(3, 4, seed=3), _r(3, 4, seed=4)
    t = 0.5
    got = gist_loss(a, p, guide=(ga, gp), temperature=t, contrast_anchors=False, contrast_positives=False,
                    reduction="none")
    cos = F.normalize(a, dim=1) @ F.normalize(p, dim=1).T / t
    # row 0 (gpos 0.6): keeps columns 0 (target) and 1 (tie), drops 2 (0.8 > 0.6)
    want0 = torch.logsumexp(cos[0, :2], 0) - cos[0, 0]
    # row 2 (gpos 0.8): columns 0, 1 at 0.6 are kept, column 2 is the target
    want2 = torch.logsumexp(cos[2], 0) - cos[2, 2]
    torch.testing.assert_close(got[0], want0, **TOL)
    torch.testing.assert_close(got[2], want2, **TOL)
    torch.testing.assert_close(got, gist_definition(a, p, [], ga, gp, [], t, ca=False, cp=False), **TOL)


def test_all_masked_rows_contribute_zero_not_nan():
    a, p, negs, ga, gp, gns = _inputs()
    leaves = [x.clone().requires_grad_() for x in (a, p, negs[0])]
    # margin 3: theta < -1 <= every guide cosine, every column but the protected positive is dropped
    loss = gist_loss(leaves[0], leaves[1], leaves[2], guide=(ga, gp, gns[0]), margin=3.0, reduction="none")
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    for x in leaves:
        assert torch.equal(x.grad, torch.zeros_like(x.grad))


def test_nan_guide_gives_nan_loss_not_an_unmasked_row():
    a, p, negs, ga, gp, gns = _inputs()
    bad = ga.clone()
    bad[2, 1] = float("nan")
    # anchors' guide is a column set of the anchor-anchor block: every row reads it
    out = gist_loss(a, p, guide=(bad, gp), reduction="none")
    assert torch.isnan(out).all()
    # without that block only row 2 (its threshold) is NaN
    out = gist_loss(a, p, guide=(bad, gp), reduction="none", contrast_anchors=False)
    assert torch.isnan(out[2]) and torch.isfinite(out[torch.arange(10) != 2]).all()
    torch.testing.assert_close(out[torch.arange(10) != 2],
                               gist_definition(a, p, [], ga, gp, [], 0.01, ca=False)[torch.arange(10) != 2], **TOL)
    assert torch.isnan(gist_loss(a, p, guide=(bad, gp), backend="reference")).item()
    badp = gp.clone()
    badp[0, 0] = float("inf")
    assert torch.isnan(gist_loss(a, p, guide=(ga, badp), contrast_anchors=False)).item()


def test_memory_stays_far_below_the_score_matrix():
    from fused_contrastive.core import tile_elements
    from tests.test_memory import LargestTensor

    b, d, dg = 4096, 16, 8
    a, p, n = (_r(b, d, seed=s).float().requires_grad_() for s in (1, 2, 3))
    ga, gp, gn = (_r(b, dg, seed=s).float() for s in (4, 5, 6))
    with LargestTensor() as probe:
        gist_loss(a, p, n, guide=(ga, gp, gn), backend="torch").backward()
    # the textbook builds B x 4B scores (and 4 B x B guide matrices): here one tile of the budget at most
    assert probe.largest <= tile_elements() <= b * 4 * b // 32, (probe.largest, probe.op)


def test_matryoshka_levels_use_the_same_guide_mask():
    a, p, negs, ga, gp, gns = _inputs(d=8)
    dims, weights = [8, 3, 5], [1.0, 0.5, 2.0]
    la, lp, ln = (x.clone().requires_grad_() for x in (a, p, negs[0]))
    got, per = gist_loss(la, lp, ln, guide=(ga, gp, gns[0]), temperature=0.1, matryoshka_dims=dims,
                         matryoshka_weights=weights, return_level_losses=True)
    ra, rp, rn = (x.clone().requires_grad_() for x in (a, p, negs[0]))
    levels = [gist_definition(ra[:, :k], rp[:, :k], [rn[:, :k]], ga, gp, gns, 0.1).mean() for k in dims]
    want = sum(w * v for w, v in zip(weights, levels, strict=True))
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(per, torch.stack(levels).detach(), **TOL)
    for x, y in zip(torch.autograd.grad(got, [la, lp, ln]), torch.autograd.grad(want, [ra, rp, rn]), strict=True):
        torch.testing.assert_close(x, y, **TOL)


def test_autocast_bf16_training_step():
    torch.manual_seed(0)
    enc = torch.nn.Linear(12, 8)
    x, y, z = (_r(16, 12, seed=s).float() for s in (1, 2, 3))
    gx, gy, gz = (_r(16, 4, seed=s).float() for s in (4, 5, 6))

    def step(amp: bool):
        enc.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = gist_loss(enc(x), enc(y), enc(z), guide=(gx, gy, gz), temperature=0.05)
        loss.backward()
        return loss.detach(), enc.weight.grad.clone()

    l32, g32 = step(False)
    l16, g16 = step(True)
    assert l16.dtype == torch.float32 and torch.isfinite(g16).all()
    assert abs(l16 - l32) < 0.05 * abs(l32) + 1e-3
    assert (g16 - g32).norm() < 0.1 * g32.norm()


def test_gist_argument_errors():
    a, p, negs, ga, gp, gns = _inputs()
    with pytest.raises(ValueError, match="margin_strategy must be one of"):
        gist_loss(a, p, guide=(ga, gp), margin_strategy="bogus")
    with pytest.raises(ValueError, match="margin must be finite"):
        gist_loss(a, p, guide=(ga, gp), margin=float("nan"))
    with pytest.raises(TypeError, match="guide must be a sequence"):
        gist_loss(a, p, guide=ga)
    with pytest.raises(ValueError, match="guide_negatives exactly when negatives"):
        gist_loss(a, p, negs[0], guide=(ga, gp))
    with pytest.raises(ValueError, match=r"guide\[1\] \(guide_positives\) must have 10 rows"):
        gist_loss(a, p, guide=(ga, gp[:4]))
    with pytest.raises(ValueError, match="positives must have 10 rows"):
        gist_loss(a, p[:5], guide=(ga, gp))
    with pytest.raises(ValueError, match=r"guide\[2\] \(guide_negatives\) must match negatives"):
        gist_loss(a, p, negs[0], guide=(ga, gp, gns[0][:3]))


# ---------------------------------------------------------------------------------------------
# info_nce(guide=, ids=)
# ---------------------------------------------------------------------------------------------


def info_nce_definition(q, k, target, gq=None, gk=None, qid=None, kid=None, t=0.1, strategy="absolute", margin=0.0,
                        exclude_self=False, ignore_index=-100):
    n, m = q.shape[0], k.shape[0]
    valid = target != ignore_index
    tt = torch.where(valid, target, 0)
    logits = _cos(q, k) / t
    drop = torch.zeros(n, m, dtype=torch.bool)
    if gq is not None:
        g = _cos(gq, gk)
        gpos = g[torch.arange(n), tt]
        theta = gpos - margin if strategy == "absolute" else gpos - gpos.abs() * margin
        drop |= g > theta[:, None]
    if qid is not None:
        drop |= qid[:, None] == kid[None, :]
    drop[torch.arange(n), tt] = False
    if exclude_self:
        drop[torch.arange(n), torch.arange(n)] = True
    per = F.cross_entropy(logits.masked_fill(drop, -math.inf), tt, reduction="none")
    return torch.where(valid, per, 0.0), valid


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("what", ["guide", "ids", "both", "both-relative"])
def test_info_nce_masks_equal_the_definition(what, reduction, monkeypatch, route):
    route(TILE_ELEMENTS="30")
    n, m = 9, 13
    q, k = _r(n, 6, seed=1), _r(m, 6, seed=2)
    gq, gk = _r(n, 3, seed=3), _r(m, 3, seed=4)
    qid, kid = torch.arange(n) % 4, torch.arange(m) % 4
    target = torch.tensor([0, 5, 12, -100, 3, 3, 7, 1, 9])
    kw, dkw = {}, {}
    if what != "ids":
        kw["guide"] = (gq, gk)
        dkw.update(gq=gq, gk=gk)
    if what != "guide":
        kw["ids"] = (qid, kid)
        dkw.update(qid=qid, kid=kid)
    if what == "both-relative":
        kw.update(guide_margin=0.3, guide_margin_strategy="relative")
        dkw.update(margin=0.3, strategy="relative")
    qa, ka, s = q.clone().requires_grad_(), k.clone().requires_grad_(), torch.tensor(8.0, dtype=torch.float64,
                                                                                      requires_grad=True)
    got = fc.info_nce(qa, ka, target, scale=s, reduction=reduction, **kw)
    qr, kr, sr = q.clone().requires_grad_(), k.clone().requires_grad_(), s.detach().clone().requires_grad_()
    per, valid = info_nce_definition(qr, kr, target, t=1 / sr, **dkw)
    want = {"mean": per.sum() / valid.sum(), "sum": per.sum(), "none": per}[reduction]
    torch.testing.assert_close(got, want, **TOL)
    for x, y in zip(torch.autograd.grad(got.sum(), [qa, ka, s]), torch.autograd.grad(want.sum(), [qr, kr, sr]),
                    strict=True):
        torch.testing.assert_close(x, y, **TOL)


def test_info_nce_ids_mask_duplicates_without_keys():
    # keys=None: the own column is excluded, duplicates by id too, the target (the row's pair) kept
    z = _r(8, 5, seed=7)
    ids = torch.tensor([0, 1, 0, 2, 3, 3, 4, 0])
    target = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])
    got = fc.info_nce(z, None, target, ids=ids, temperature=0.2, reduction="none")
    want, _ = info_nce_definition(z, z, target, qid=ids, kid=ids, t=0.2, exclude_self=True)
    torch.testing.assert_close(got, want, **TOL)
    # without the mask rows 0, 2, 7 (id 0) see each other: the values differ
    plain = fc.info_nce(z, None, target, temperature=0.2, reduction="none")
    assert not torch.allclose(plain[[0, 2, 7]], got[[0, 2, 7]])
    torch.testing.assert_close(plain[[1, 3]], got[[1, 3]], **TOL)  # ids 1, 2 are unique


def test_info_nce_guide_errors():
    q, k = _r(4, 3, seed=1), _r(4, 3, seed=2)
    g = _r(4, 2, seed=3)
    with pytest.raises(TypeError, match="guide must be a pair"):
        fc.info_nce(q, k, guide=g)
    with pytest.raises(TypeError, match="guide must be one tensor when keys is None"):
        fc.info_nce(q, None, torch.tensor([1, 0, 3, 2]), guide=(g, g))
    with pytest.raises(ValueError, match="not supported with symmetric=True"):
        fc.info_nce(q, k, symmetric=True, ids=(torch.arange(4), torch.arange(4)))
    with pytest.raises(ValueError, match=r"ids\[1\] \(keys\) must have shape \[4\]"):
        fc.info_nce(q, k, ids=(torch.arange(4), torch.arange(3)))
    with pytest.raises(TypeError, match="must hold integer ids"):
        fc.info_nce(q, k, ids=(torch.arange(4.0), torch.arange(4)))
    with pytest.raises(ValueError, match="guide_margin_strategy must be one of"):
        fc.info_nce(q, k, guide=(g, g), guide_margin_strategy="x")


def test_info_nce_guide_with_matryoshka_levels():
    q, k = _r(7, 8, seed=1), _r(7, 8, seed=2)
    gq, gk = _r(7, 3, seed=3), _r(7, 3, seed=4)
    got = fc.info_nce(q, k, guide=(gq, gk), temperature=0.1, matryoshka_dims=[8, 4])
    want = sum(info_nce_definition(F.normalize(q[:, :d], dim=1), F.normalize(k[:, :d], dim=1), torch.arange(7),
                                   gq, gk, t=0.1)[0].mean() for d in (8, 4))
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("what", ["guide", "ids"])
@pytest.mark.parametrize("layout", ["columns", "interleaved", "no-negatives"])
def test_simcse_sup_masks_equal_the_definition(what, layout):
    b = 8
    a, p, n = _r(b, 6, seed=1), _r(b, 6, seed=2), _r(b, 6, seed=3)
    ga, gp, gn = _r(b, 3, seed=4), _r(b, 3, seed=5), _r(b, 3, seed=6)
    ia, ip, inn = torch.arange(b) % 3, torch.arange(b) % 4, torch.arange(b) % 2
    negs = layout != "no-negatives"
    keys = torch.cat([p, n]) if negs else p
    dkw = dict(gq=ga, gk=torch.cat([gp, gn]) if negs else gp) if what == "guide" else \
        dict(qid=ia, kid=torch.cat([ip, inn]) if negs else ip)
    per, _ = info_nce_definition(a, keys, torch.arange(b), t=0.1, margin=0.05, **dkw)
    m = dict(guide=(ga, gp, gn), ids=(ia, ip, inn))[what]
    kw = {what: m, **({"guide_margin": 0.05} if what == "guide" else {})}  # a margin without guide= raises
    if layout == "interleaved":
        trip = torch.stack([a, p, n], 1).reshape(3 * b, 6)
        mt = torch.stack(list(m), 1).reshape(3 * b, *m[0].shape[1:])
        got = fc.simcse_sup_loss(trip, temperature=0.1, reduction="none", **dict(kw, **{what: mt}))
    elif layout == "columns":
        got = fc.simcse_sup_loss(a, p, n, temperature=0.1, reduction="none", **kw)
    else:
        got = fc.simcse_sup_loss(a, p, temperature=0.1, reduction="none", **dict(kw, **{what: m[:2]}))
    torch.testing.assert_close(got, per, **TOL)
    with pytest.raises(ValueError, match="hard_negative_weight"):
        fc.simcse_sup_loss(a, p, n, hard_negative_weight=1.0, **kw)


@pytest.mark.parametrize("what", ["guide", "ids"])
def test_simcse_masks_equal_the_definition(what):
    z = _r(12, 6, seed=1)
    g, ids = _r(12, 3, seed=2), torch.tensor([0, 1, 2, 3, 0, 5, 6, 2, 8, 9, 0, 11])
    t = torch.arange(12) ^ 1
    dkw = dict(gq=g, gk=g) if what == "guide" else dict(qid=ids, kid=ids)
    per, _ = info_nce_definition(z, z, t, t=0.05, exclude_self=True, **dkw)
    got = fc.simcse_loss(z, reduction="none", **{what: g if what == "guide" else ids})
    torch.testing.assert_close(got, per, **TOL)
    # the two-view form: pairs for z1 and z2
    z1, z2 = z[0::2], z[1::2]
    m = (g[0::2], g[1::2]) if what == "guide" else (ids[0::2], ids[1::2])
    dkw = dict(gq=m[0], gk=m[1]) if what == "guide" else dict(qid=m[0], kid=m[1])
    per, _ = info_nce_definition(z1, z2, torch.arange(6), t=0.05, **dkw)
    torch.testing.assert_close(fc.simcse_loss(z1, z2, reduction="none", **{what: m}), per, **TOL)


# ---------------------------------------------------------------------------------------------
# gather over gloo ranks
# ---------------------------------------------------------------------------------------------


def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:

    with gloo_rank(rank, world, init, out):
        total, off, b = sum(sizes), sum(sizes[:rank]), sizes[rank]
        a, p, negs, ga, gp, gns = _inputs(b=total, n_neg=1)
        mine = slice(off, off + b)
        la, lp, ln = (x[mine].clone().requires_grad_() for x in (a, p, negs[0]))
        loss = gist_loss(la, lp, ln, guide=(ga[mine], gp[mine], gns[0][mine]), temperature=0.1, margin=0.05,
                         gather=True, anchor_anchor="local")
        loss.backward()
        # anchor_anchor="local" (sentence-transformers' gather_across_devices): every rank's rows, its own
        # anchors in the anchor-anchor block, over the total
        ra, rp, rn = (x.clone().requires_grad_() for x in (a, p, negs[0]))
        parts = []
        for r in range(world):
            o, s = sum(sizes[:r]), slice(sum(sizes[:r]), sum(sizes[:r + 1]))
            parts.append(gist_definition(ra[s], rp, [rn], ga[s], gp, gns, 0.1, margin=0.05, off=o))
        want = torch.cat(parts).mean()
        want.backward()
        ok = all(torch.allclose(x.grad, y.grad[mine] * world, rtol=1e-10, atol=1e-12)
                 for x, y in ((la, ra), (lp, rp), (ln, rn)))
        # simcse_sup_loss with a guide: this rank's anchors against [every rank's positives; negatives]
        sup = fc.simcse_sup_loss(a[mine], p[mine], negs[0][mine], guide=(ga[mine], gp[mine], gns[0][mine]),
                                 temperature=0.1, guide_margin=0.05, gather=True, reduction="none")
        sup_want, _ = info_nce_definition(a[mine], torch.cat([p, negs[0]]), torch.arange(b) + off, ga[mine],
                                          torch.cat([gp, gns[0]]), t=0.1, margin=0.05)
        ok = ok and torch.allclose(sup, sup_want, rtol=1e-10, atol=1e-12)
        out.put({"rank": rank, "loss": float(loss), "want": float(want), "grads": ok})


@pytest.mark.parametrize("sizes", [[5, 3], [2, 4, 3]], ids=["2-ranks", "3-ranks"])
def test_gather_over_ranks_with_uneven_sizes(sizes, tmp_path):
    world = len(sizes)
    results = run_ranks(_gather_worker, world, tmp_path, sizes, timeout=180)
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["grads"], r
    # a rank returns its local share times world: the mean over ranks is the global loss
    mean = sum(r["loss"] for r in results) / world
    assert abs(mean - results[0]["want"]) < 1e-10


def test_warnings_are_clean_on_the_default_path():
    a, p, negs, ga, gp, gns = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gist_loss(a, p, negs[0], guide=(ga, gp, gns[0]))


# ---------------------------------------------------------------------------------------------
# exact duplicates tie with the positive: kept, as sentence-transformers decides it
# ---------------------------------------------------------------------------------------------


def _duplicated(kind: str, seed: int, dtype=torch.float64, b=12, d=6, dg=5):
    """GIST inputs where row 1 repeats row 0's positive ("positive": the same positive text twice) or
    row 0's whole (anchor, positive) pair ("pair"), and row 5 repeats row 4's."""
    a, p, negs, ga, gp, gns = _inputs(b=b, d=d, dg=dg, seed=seed)
    for i, j in ((0, 1), (4, 5)):
        p[j], gp[j] = p[i], gp[i]
        if kind == "pair":
            a[j], ga[j] = a[i], ga[i]
    return [x.to(dtype) for x in (a, p, negs[0], ga, gp, gns[0])]


def _old_threshold_decides_differently(ga, gp) -> bool:
    """Whether the former threshold (a separate row-by-row dot product) puts a duplicate of a row's
    positive on the other side than the tie (the tile's own product, kept)."""
    ua, up = F.normalize(ga, dim=1), F.normalize(gp, dim=1)
    tile, sep = ua @ up.T, (ua * up).sum(1)
    return any(bool(tile[i, j] > sep[i]) for i, j in ((0, 1), (1, 0), (4, 5), (5, 4)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["positive", "pair"])
def test_exact_duplicates_tie_and_are_kept_on_every_backend(kind, dtype, monkeypatch, route):
    # sentence-transformers' rule: gpos_i is the diagonal of the same guide matrix it thresholds, so
    # the duplicate of row i's positive (guide cosine == gpos_i exactly) is kept (strict >); the
    # definition here (cosine_similarity matrices, as theirs) decides it so. Every backend and the
    # row-chunked torch sweep equal it on 25 seeds; the former separate-dot threshold would not (checked)
    tol = TOL if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    flipped = 0
    for seed in range(25):
        a, p, n, ga, gp, gn = _duplicated(kind, seed, dtype)
        flipped += _old_threshold_decides_differently(ga, gp)
        want = gist_definition(a, p, [n], ga, gp, [gn], 0.05, margin=0.0)
        assert want.dtype == dtype
        for backend, tiles in (("torch", None), ("torch", "24"), ("reference", None)):
            if tiles:
                route(TILE_ELEMENTS=tiles)  # one row per chunk
            else:
                route(TILE_ELEMENTS=None)
            for red in ("none", "mean"):
                got = gist_loss(a, p, n, guide=(ga, gp, gn), temperature=0.05, reduction=red, backend=backend)
                torch.testing.assert_close(got, want if red == "none" else want.mean(), **tol,
                                           msg=lambda m, s=seed, be=backend, t=tiles: f"seed {s} {be} {t}: {m}")
    assert flipped >= 2, flipped  # the test is not vacuous: the former threshold flipped some ties


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_info_nce_guide_duplicates_of_the_target_are_kept(dtype):
    # info_nce(guide=): the same rule, the threshold the target entry of the same guide products
    flipped = 0
    tol = TOL if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for seed in range(25):
        a, p, _, ga, gp, _ = _duplicated("positive", seed, dtype)
        flipped += _old_threshold_decides_differently(ga, gp)
        want, _ = info_nce_definition(a, p, torch.arange(a.shape[0]), ga, gp, t=0.05)
        for backend in ("torch", "reference"):
            got = fc.info_nce(a, p, guide=(ga, gp), temperature=0.05, reduction="none", backend=backend)
            torch.testing.assert_close(got, want.to(got.dtype), **tol)
    assert flipped >= 2, flipped


# ---------------------------------------------------------------------------------------------
# gather=True is the global batch: the anchor-anchor block against every rank's anchors
# ---------------------------------------------------------------------------------------------

GLOBAL_DIMS, GLOBAL_WEIGHTS = [6, 3, 4], [1.0, 0.5, 2.0]


def _global_definition(a, p, n, ga, gp, gn, t, sizes, margin, dims=None, weights=None):
    """The float64 global-batch GIST loss (mean over every rank's rows; the anchor-anchor block against
    every anchor), optionally summed over Matryoshka levels (prefixes, re-normalised by the cosine)."""
    total, out = sum(sizes), 0
    for d, w in zip(dims or [a.shape[1]], weights or [1.0], strict=True):
        parts = []
        for r in range(len(sizes)):
            o = sum(sizes[:r])
            s = slice(o, o + sizes[r])
            parts.append(gist_definition(a[s, :d], p[:, :d], [n[:, :d]], ga[s], gp, [gn], t, margin=margin, off=o,
                                         a_cols=a[:, :d], ga_cols=ga))
        out = out + w * torch.cat(parts).sum() / total
    return out


def _global_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with gloo_rank(rank, world, init, out):
        total, off, b = sum(sizes), sum(sizes[:rank]), sizes[rank]
        a, p, negs, ga, gp, gns = _inputs(b=total, n_neg=1, d=8, seed=3)
        n, gn = negs[0], gns[0]
        mine = slice(off, off + b)
        res = {"rank": rank}
        for case, kw in (("default", {}), ("matryoshka", dict(matryoshka_dims=GLOBAL_DIMS,
                                                              matryoshka_weights=GLOBAL_WEIGHTS))):
            for backend in ("torch", "reference", "triton"):
                # the kernels (interpreted) take float32: the same inputs rounded, against the float64 truth
                dt = torch.float32 if backend == "triton" else torch.float64
                la, lp, ln = (x[mine].to(dt).clone().requires_grad_() for x in (a, p, n))
                t = torch.tensor(0.1, dtype=dt, requires_grad=True)  # a learnable temperature
                loss = gist_loss(la, lp, ln, guide=(ga[mine].to(dt), gp[mine].to(dt), gn[mine].to(dt)), temperature=t,
                                 margin=0.05, gather=True, backend=backend, **kw)
                loss.backward()
                ra, rp, rn = (x.clone().requires_grad_() for x in (a, p, n))
                t2 = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
                want = _global_definition(ra, rp, rn, ga, gp, gn, t2, sizes, 0.05,
                                          kw.get("matryoshka_dims"), kw.get("matryoshka_weights"))
                want.backward()
                # the rank average is the global loss, DDP's gradient average the global gradient
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                tg = t.grad.clone()
                dist.all_reduce(tg)
                grad_err = max(float((x.grad / world - y.grad[mine]).abs().max()) for x, y in
                               ((la, ra), (lp, rp), (ln, rn)))
                res[(case, backend)] = dict(loss_err=abs(float(mean) / world - float(want)), loss=float(want),
                                            grad_err=grad_err, t_err=abs(float(tg) / world - float(t2.grad)),
                                            scale=max(float(y.grad.abs().max()) for y in (ra, rp, rn)))
            # the former semantics (a local anchor-anchor block) is not the global loss: the test can tell
            la, lp, ln = (x[mine].clone() for x in (a, p, n))
            local = gist_loss(la, lp, ln, guide=(ga[mine], gp[mine], gn[mine]), temperature=0.1, margin=0.05,
                              gather=True, anchor_anchor="local", **kw).detach()
            dist.all_reduce(local)
            res[(case, "local_err")] = abs(float(local) / world - res[(case, "torch")]["loss"])
        out.put(res)


def test_gather_is_the_global_batch_with_uneven_sizes(tmp_path):
    # gist_loss(gather=True) keeps the library's contract (README "gather"): with uneven local batches,
    # Matryoshka levels and a learnable temperature, the rank average of the loss is the float64 global
    # loss and the gradients are its gradients (the anchor-anchor block against every rank's anchors), on the
    # torch sweep, the reference and the Triton kernels (interpreted, float32)
    results = run_ranks(_global_worker, 2, tmp_path, [7, 4], timeout=240)
    for r in results:
        assert "error" not in r, r.get("error")
        for case in ("default", "matryoshka"):
            for backend in ("torch", "reference", "triton"):
                e = r[(case, backend)]
                tol = 1e-12 if backend != "triton" else 2e-5  # float32 inputs: their rounding, scaled
                assert e["loss"] > 0.1 and e["scale"] > 1e-3, (r["rank"], case, backend, e)
                assert e["loss_err"] < tol * max(1.0, e["loss"]), (case, backend, e)
                assert e["grad_err"] < tol * max(1.0, e["scale"]), (case, backend, e)
                assert e["t_err"] < tol * 100, (case, backend, e)
            assert r[(case, "local_err")] > 1e-4, (case, r[(case, "local_err")])  # not vacuous
