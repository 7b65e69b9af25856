"""siglip_loss(image_groups=, text_groups=): every pair sharing a group id is a positive, weighted as
siglip-kernel's SigLIP+ (v_ij = 1/(2 k_i) + 1/(2 k'_j) on positives, 1 on negatives), normalised by N. Against
the float64 definition written here as a loop over pairs, siglip-kernel's own SigLIP+ under the Triton
interpreter, and the plain loss for unique groups; every backend, every gradient, gather over ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from tests._ranks import gloo_rank, run_ranks
from tests.conftest import EVERY_BACKEND, leaf, use_backend

BACKENDS = EVERY_BACKEND
IG = torch.tensor([0, 1, 1, 2, 3, 7, 4])  # image 5's group 7 has no text: only negatives
TG = torch.tensor([1, 0, 0, 2, 5, 1, 9, 2, 0, 3, 4])  # 11 texts: group 0 thrice, 1 twice, 2 twice


def definition(x, y, s, b, ig, tg, *, normalize=True):
    """Per image: -sum_j v_ij log sigmoid(label_ij z_ij), label +1 where the ids are equal."""
    x, y = x.double(), y.double()
    if normalize:
        x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
    z = s * (x @ y.T) + b
    rows = []
    for i in range(len(x)):
        total = 0.0
        for j in range(len(y)):
            if ig[i] == tg[j]:
                k, kp = int((tg == ig[i]).sum()), int((ig == tg[j]).sum())
                total = total - (0.5 / k + 0.5 / kp) * F.logsigmoid(z[i, j])
            else:
                total = total - F.logsigmoid(-z[i, j])
        rows.append(total)
    return torch.stack(rows)


def _inputs(n=7, m=11, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(m, d, generator=g, dtype=torch.float64)


def _tol(be):
    return dict(rtol=2e-5, atol=5e-6) if be == "triton" else dict(rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_the_definition_with_every_gradient(which, reduction, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    x, y = _inputs()
    s, b = torch.tensor(5.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)
    ours = [leaf(v, dt) for v in (x, y)] + [leaf(s), leaf(b)]
    got = fc.siglip_loss(*ours, image_groups=IG, text_groups=TG, reduction=reduction, backend=be)
    ref = [leaf(v) for v in (x, y, s, b)]
    per = definition(*ref, IG, TG)
    want = {"mean": per.sum() / 7, "sum": per.sum(), "none": per}[reduction]
    w = torch.linspace(-1.0, 2.0, 7, dtype=torch.float64) if reduction == "none" else 1.0
    (got.double() * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, c in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), c.grad, **_tol(be))


@pytest.mark.parametrize("which", BACKENDS)
def test_raw_dots_and_number_scale(which, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    x, y = _inputs(seed=2)
    x, y = x / 3, y / 3
    ours = [leaf(v, dt) for v in (x, y)]
    got = fc.siglip_loss(*ours, 2.0, 0.5, image_groups=IG, text_groups=TG, normalize=False, backend=be)
    ref = [leaf(v) for v in (x, y)]
    want = definition(*ref, 2.0, 0.5, IG, TG, normalize=False).sum() / 7
    got.backward()
    want.backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, c in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), c.grad, **_tol(be))


@pytest.mark.parametrize("which", BACKENDS)
def test_unique_groups_give_the_plain_loss(which, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    x, y = _inputs(m=7)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])  # any ids: the pairs are where they match
    ours = [leaf(v, dt) for v in (x, y)]
    got = fc.siglip_loss(*ours, 10.0, -10.0, image_groups=perm * 10, text_groups=perm * 10, backend=be)
    plain = [leaf(v, dt) for v in (x, y)]
    want = fc.siglip_loss(*plain, 10.0, -10.0, backend=be)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, **_tol(be))
    for a, c in zip(ours, plain, strict=True):
        torch.testing.assert_close(a.grad, c.grad, **_tol(be))


def test_siglip_kernel_siglip_plus_gives_the_same_loss(monkeypatch):
    # its SigLIP+ (symmetric soft weighting) divides the same sum by N M; its reference module needs CUDA,
    # its fused function runs under the Triton interpreter (fp32: torch.matmul and an elementwise kernel)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    plus = pytest.importorskip("siglip_kernel.fused_siglip_plus")
    x, y = (v.float() for v in _inputs())
    lt, b = torch.tensor(1.6, requires_grad=True), torch.tensor(-1.5, requires_grad=True)
    xs, ys = leaf(x, torch.float32), leaf(y, torch.float32)
    theirs = plus.fused_siglip_plus_loss(F.normalize(xs, dim=1), F.normalize(ys, dim=1), lt, b, IG, TG)
    theirs.backward()
    ox, oy, ot, ob = leaf(x, torch.float32), leaf(y, torch.float32), leaf(lt, torch.float32), leaf(b, torch.float32)
    ours = fc.siglip_loss(ox, oy, ot.exp(), ob, image_groups=IG, text_groups=TG)
    (ours / 11).backward()
    want = definition(x, y, float(lt.detach().exp()), float(b.detach()), IG, TG).sum() / 7
    assert float(ours) == pytest.approx(float(want), rel=1e-6)
    assert float(theirs) * 11 == pytest.approx(float(want), rel=1e-5)
    for a, c in ((ox, xs), (oy, ys), (ot, lt), (ob, b)):
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-4, atol=1e-6)


def test_errors_name_the_argument():
    x, y = _inputs()
    with pytest.raises(ValueError, match="text_groups is None but image_groups is given"):
        fc.siglip_loss(x, y, 10.0, image_groups=IG)
    with pytest.raises(ValueError, match="image_groups is None but text_groups is given"):
        fc.siglip_loss(x, y, 10.0, text_groups=TG)
    with pytest.raises(ValueError, match=r"image_groups must have shape \[7\]"):
        fc.siglip_loss(x, y, 10.0, image_groups=IG[:5], text_groups=TG)
    with pytest.raises(ValueError, match=r"text_groups must have shape \[11\]"):
        fc.siglip_loss(x, y, 10.0, image_groups=IG, text_groups=TG[:, None])
    with pytest.raises(TypeError, match="text_groups must hold integer group ids"):
        fc.siglip_loss(x, y, 10.0, image_groups=IG, text_groups=TG.float())
    with pytest.raises(TypeError, match="image_groups must be a torch.Tensor"):
        fc.siglip_loss(x, y, 10.0, image_groups=[0] * 7, text_groups=TG)
    with pytest.raises(ValueError, match="text must have as many rows as image"):  # without groups: the pairs
        fc.siglip_loss(x, y, 10.0)
    with pytest.raises(ValueError, match="text has embedding dimension 4 but image has 5"):
        fc.siglip_loss(x, y[:, :4], 10.0, image_groups=IG, text_groups=TG)


def _gather_worker(rank: int, world: int, init: str, out) -> None:

    with gloo_rank(rank, world, init, out):
        x, y = _inputs()
        imgs, txts = (slice(0, 4), slice(0, 5)) if rank == 0 else (slice(4, 7), slice(5, 11))
        res = {"rank": rank}
        for be in ("torch", "triton", "reference"):
            dt = torch.float32 if be == "triton" else torch.float64
            lx, ly = leaf(x[imgs], dt), leaf(y[txts], dt)
            s = leaf(torch.tensor(4.0))
            loss = fc.siglip_loss(lx, ly, s, -1.0, image_groups=IG[imgs], text_groups=TG[txts], gather=True,
                                  backend=be)
            loss.backward()
            res[be] = (float(loss), lx.grad.double().tolist(), ly.grad.double().tolist(), float(s.grad))
        out.put(res)


def test_gather_counts_every_ranks_groups(tmp_path):
    results = run_ranks(_gather_worker, 2, tmp_path, timeout=240)
    x, y, s = leaf(_inputs()[0]), leaf(_inputs()[1]), leaf(torch.tensor(4.0))
    want = definition(x, y, s, -1.0, IG, TG).sum() / 7
    want.backward()
    for be in ("torch", "triton", "reference"):
        tol = _tol(be)
        assert sum(r[be][0] for r in results) / 2 == pytest.approx(float(want), rel=tol["rtol"], abs=tol["atol"])
        gx = torch.tensor(results[0][be][1] + results[1][be][1], dtype=torch.float64) / 2
        gy = torch.tensor(results[0][be][2] + results[1][be][2], dtype=torch.float64) / 2
        torch.testing.assert_close(gx, x.grad, rtol=tol["rtol"], atol=tol["atol"])
        torch.testing.assert_close(gy, y.grad, rtol=tol["rtol"], atol=tol["atol"])
        assert (results[0][be][3] + results[1][be][3]) / 2 == pytest.approx(float(s.grad), rel=tol["rtol"] * 10)


def test_module_forward_takes_the_groups():
    x, y = _inputs()
    mod = fc.nn.SigLIPLoss(5.0, -2.0)
    torch.testing.assert_close(mod(x, y, IG, TG), definition(x, y, 5.0, -2.0, IG, TG).sum() / 7, rtol=1e-10, atol=0)
