"""info_nce(row_negatives=): row i's own K negatives beside the shared columns, on every backend, against
the float64 definition written here (the logits ``[s cos(q_i, k_j) | s cos(q_i, n_ik)]`` materialised,
``F.cross_entropy``), losses and every gradient (query, keys, row negatives, a tensor temperature)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from tests._ranks import gloo_rank, run_ranks
from tests.conftest import EVERY_BACKEND, leaf, use_backend

BACKENDS = EVERY_BACKEND


def definition(q, k, n, t, temperature, *, exclude_self=False, normalize=True, ignore_index=-100,
               reduction="mean"):
    """The textbook form in float64: row i's logits are the shared ones then its own K."""
    q, k, n = q.double(), k.double(), n.double()
    if normalize:
        q, k, n = F.normalize(q, dim=-1), F.normalize(k, dim=-1), F.normalize(n, dim=-1)
    t_ = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    shared = q @ k.T / t_
    if exclude_self:
        shared = shared.masked_fill(torch.eye(len(q), k.shape[0], dtype=torch.bool), float("-inf"))
    own = torch.einsum("nd,nkd->nk", q, n) / t_
    return F.cross_entropy(torch.cat([shared, own], 1), t, ignore_index=ignore_index, reduction=reduction)


def _inputs(n=7, m=9, k=3, d=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=dtype), torch.randn(m, d, generator=g, dtype=dtype),
            torch.randn(n, k, d, generator=g, dtype=dtype))


def _tol(be):
    # the triton kernels take float32 (float64 runs on torch): compared with the float64 definition
    return dict(rtol=2e-5, atol=2e-6) if be == "triton" else dict(rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_the_definition_with_every_gradient(which, reduction, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    q, k, n = _inputs()
    t = torch.tensor([3, 0, 8, -100, 1, 1, 5])  # an ignored row, a target shared by two rows
    temp = torch.tensor(0.2, dtype=torch.float64)
    ours = [leaf(x, dt) for x in (q, k, n, temp)]
    got = fc.info_nce(ours[0], ours[1], t, row_negatives=ours[2], temperature=ours[3], reduction=reduction,
                      backend=be)
    ref = [leaf(x) for x in (q, k, n, temp)]
    want = definition(*ref[:3], t, ref[3], reduction=reduction)
    if reduction == "none":  # F.cross_entropy's ignored row is 0, as ours
        w = torch.linspace(-1.0, 2.0, len(t), dtype=torch.float64)
        (got.double() * w).sum().backward()
        (want * w).sum().backward()
    else:
        got.backward()
        want.backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **_tol(be))
    assert ours[1].grad[[2, 4, 6, 7]].abs().sum() > 0  # the keys get gradients through the shared part


@pytest.mark.parametrize("which", BACKENDS)
def test_keys_none_excludes_the_own_column_and_raw_dots(which, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    q, _, n = _inputs(n=8, k=2)
    t = torch.arange(8) ^ 1
    for normalize in (True, False):
        a, b = leaf(q, dt), leaf(n, dt)
        got = fc.info_nce(a, None, t, row_negatives=b, temperature=0.5, normalize=normalize, backend=be)
        a2, b2 = leaf(q), leaf(n)
        want = definition(a2, a2, b2, t, 0.5, exclude_self=True, normalize=normalize)
        got.backward()
        want.backward()
        torch.testing.assert_close(got.double(), want, **_tol(be))
        torch.testing.assert_close(a.grad.double(), a2.grad, **_tol(be))
        torch.testing.assert_close(b.grad.double(), b2.grad, **_tol(be))


@pytest.mark.parametrize("which", ["reference", "torch-dense", "triton"])
def test_matryoshka_levels_truncate_the_row_negatives_too(which, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    q, k, n = _inputs(d=6)
    t = torch.arange(7)
    ours = [leaf(x, dt) for x in (q, k, n)]
    got = fc.info_nce(*ours[:2], t, row_negatives=ours[2], backend=be, matryoshka_dims=[6, 2, 4],
                      matryoshka_weights=[1.0, 0.5, 2.0])
    ref = [leaf(x) for x in (q, k, n)]
    want = sum(w * definition(*(x[..., :d] for x in ref), t, 0.05) for d, w in ((6, 1.0), (2, 0.5), (4, 2.0)))
    got.backward()
    want.backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **_tol(be))


def test_a_row_negative_far_below_changes_nothing_and_one_high_dominates():
    # hand-derived: with a negative of logit -inf-ish the loss is the plain info_nce; with K copies of the
    # target key as negatives row i's loss is log(1 + K e^{l_t} / sum_j e^{l_ij}) + CE_i
    q, k, _ = _inputs()
    t = torch.arange(7)
    plain = fc.info_nce(q, k, t, reduction="none")
    far = -F.normalize(q, dim=1)[:, None, :]  # cos = -1: e^{-40} against e^{+-20}
    got = fc.info_nce(q, k, t, row_negatives=far, reduction="none", temperature=0.05)
    cos = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T
    lse = torch.logsumexp(cos / 0.05, dim=1)
    torch.testing.assert_close(got, torch.logaddexp(plain, -20.0 - cos.diagonal() / 0.05), rtol=1e-12, atol=0)
    copies = k[:7, None, :].expand(7, 3, 5)
    got = fc.info_nce(q, k, t, row_negatives=copies, reduction="none")
    want = torch.log(torch.exp(lse) + 3 * torch.exp(cos.diagonal() / 0.05)) - cos.diagonal() / 0.05
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_errors_name_the_argument():
    q, k, n = _inputs()
    with pytest.raises(ValueError, match=r"row_negatives must have shape \[7, K, 5\]"):
        fc.info_nce(q, k, row_negatives=n[:5])
    with pytest.raises(ValueError, match=r"row_negatives must have shape \[7, K, 5\]"):
        fc.info_nce(q, k, row_negatives=n[..., :4])
    with pytest.raises(ValueError, match="row_negatives must have shape"):
        fc.info_nce(q, k, row_negatives=n[:, 0])
    with pytest.raises(ValueError, match="row_negatives must not be empty"):
        fc.info_nce(q, k, row_negatives=n[:, :0])
    with pytest.raises(TypeError, match="row_negatives must be float16"):
        fc.info_nce(q, k, row_negatives=n.long())
    with pytest.raises(TypeError, match="query is torch.float64 but row_negatives is torch.float32"):
        fc.info_nce(q, k, row_negatives=n.float())
    with pytest.raises(ValueError, match="row_negatives .* not supported with symmetric=True"):
        fc.info_nce(q, k[:7], symmetric=True, row_negatives=n)
    with pytest.raises(ValueError, match="row_negatives .* not supported with guide= / ids="):
        fc.info_nce(q, k, row_negatives=n, ids=(torch.arange(7), torch.arange(9)))
    # not yet combined with the options whose uniform part / negatives' count the row's own columns would join
    # (raised, never silently dropped)
    with pytest.raises(ValueError, match="label_smoothing is not supported with row_negatives"):
        fc.info_nce(q, k, row_negatives=n, label_smoothing=0.1)
    with pytest.raises(ValueError, match="tau_plus is not supported with row_negatives"):
        fc.info_nce(q, k, row_negatives=n, tau_plus=0.1)


def test_module_takes_them_per_batch():
    q, k, n = _inputs()
    t = torch.arange(7)
    mod = fc.nn.InfoNCELoss(0.1)
    torch.testing.assert_close(mod(q, k, t, row_negatives=n), definition(q, k, n, t, 0.1), rtol=1e-12, atol=0)


def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:

    with gloo_rank(rank, world, init, out):
        total, off, b = sum(sizes), sum(sizes[:rank]), sizes[rank]
        q, k, n = _inputs(n=total, m=total, k=2)
        mine = slice(off, off + b)
        res = {"rank": rank}
        for be in ("torch", "triton", "reference"):
            dt = torch.float32 if be == "triton" else torch.float64
            lq, lk, ln = (leaf(x[mine], dt) for x in (q, k, n))
            loss = fc.info_nce(lq, lk, row_negatives=ln, temperature=0.1, gather=True, backend=be)
            loss.backward()
            rq, rk, rn = (leaf(x) for x in (q, k, n))
            want = definition(rq, rk, rn, torch.arange(total), 0.1)
            want.backward()
            tol = _tol(be)
            # a rank's value is its share times world; its gradients are world x its rows' global ones
            # (DDP averages) -- the keys' too, though their gradient comes from every rank's rows
            ok = all(torch.allclose(x.grad.double(), y.grad[mine] * world, rtol=tol["rtol"], atol=tol["atol"] * 10)
                     for x, y in ((lq, rq), (ln, rn)))
            res[be] = (float(loss), float(want), ok, lk.grad.double().tolist())  # plain lists: no shared memory
        out.put(res)


def test_gather_keeps_row_negatives_with_their_row(tmp_path):
    sizes = [4, 3]
    results = run_ranks(_gather_worker, 2, tmp_path, sizes, timeout=240)
    q, k, n = _inputs(n=7, m=7, k=2)
    rk = leaf(k)
    definition(q, rk, n, torch.arange(7), 0.1).backward()
    for be in ("torch", "triton", "reference"):
        assert all(r[be][2] for r in results), be
        mean = sum(r[be][0] for r in results) / 2
        assert abs(mean - results[0][be][1]) < (1e-5 if be == "triton" else 1e-12), be
        # the keys' gradient: every rank's rows reach every key; DDP's average of the ranks' grads
        avg = torch.tensor(results[0][be][3] + results[1][be][3], dtype=torch.float64) / 2
        torch.testing.assert_close(avg, rk.grad, **(_tol(be) | {"atol": 1e-5 if be == "triton" else 1e-12}))
