"""qwen3_embedding_loss against the Qwen3-Embedding InfoNCE written here from the paper's formula (a loop over
rows and candidates in float64), memeff's MemoryEfficientQwen3Loss (under the Triton interpreter) and
gist_loss, on every backend, with every gradient, Matryoshka levels and gather over ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from tests._ranks import gloo_rank, run_ranks
from tests.conftest import EVERY_BACKEND, leaf, use_backend

BACKENDS = EVERY_BACKEND


def definition(q, d, h, tau, margin, *, qq=True, dd=True, normalize=True):
    """Per-row losses: Z_i sums e^{s/tau} over the positive and every kept candidate (q-d with j != i, the
    row's own hard negatives, q-q and d-d with j != i); a candidate is kept when its cosine (no gradient)
    is <= cos(q_i, d_i) + margin. The logits are cosines, raw dot products with normalize=False."""
    q, d = q.double(), d.double()
    h = None if h is None else h.double()
    cq, cd = F.normalize(q.detach(), dim=-1), F.normalize(d.detach(), dim=-1)
    lq, ld = (F.normalize(q, dim=-1), F.normalize(d, dim=-1)) if normalize else (q, d)
    rows = []
    for i in range(len(q)):
        bound = float((cq[i] * cd[i]).sum()) + margin
        pos = (lq[i] * ld[i]).sum() / tau
        terms = [pos]

        def add(a, b, ca, cb, skip=None, bound=bound, terms=terms):
            for j in range(len(b)):
                if j != skip and float((ca * cb[j]).sum()) <= bound:
                    terms.append((a * b[j]).sum() / tau)

        add(lq[i], ld, cq[i], cd, skip=i)
        if h is not None:
            lh = F.normalize(h[i], dim=-1) if normalize else h[i]
            add(lq[i], lh, cq[i], F.normalize(h[i].detach(), dim=-1))
        if qq:
            add(lq[i], lq, cq[i], cq, skip=i)
        if dd:
            add(ld[i], ld, cd[i], cd, skip=i)
        rows.append(torch.logsumexp(torch.stack(terms), 0) - pos)
    return torch.stack(rows)


def _inputs(n=8, k=3, dim=6, seed=0):
    # documents near their queries and negatives near them too: the mask drops some candidates and keeps others
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, dim, generator=g, dtype=torch.float64)
    d = q + 0.9 * torch.randn(n, dim, generator=g, dtype=torch.float64)
    h = q[:, None] + 1.2 * torch.randn(n, k, dim, generator=g, dtype=torch.float64)
    return q, d, h


def _tol(be):
    return dict(rtol=2e-5, atol=2e-6) if be == "triton" else dict(rtol=1e-10, atol=1e-12)


def test_the_inputs_mask_some_candidates_and_keep_others():
    q, d, h = _inputs()
    cq, cd = F.normalize(q, dim=1), F.normalize(d, dim=1)
    bound = (cq * cd).sum(1, keepdim=True) + 0.1
    off = ~torch.eye(8, dtype=torch.bool)
    for c in (cq @ cd.T, cq @ cq.T, cd @ cd.T):
        assert 0 < int(((c > bound) & off).sum()) < int(off.sum())
    ch = torch.einsum("nd,nkd->nk", cq, F.normalize(h, dim=2))
    assert 0 < int((ch > bound).sum()) < ch.numel()


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("negs", [True, False], ids=["row_negatives", "no_row_negatives"])
def test_equals_the_definition_with_every_gradient(which, reduction, negs, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    q, d, h = _inputs()
    temp = torch.tensor(0.07, dtype=torch.float64)
    base = (q, d, h, temp) if negs else (q, d, temp)
    ours = [leaf(x, dt) for x in base]
    got = fc.qwen3_embedding_loss(ours[0], ours[1], ours[2] if negs else None, temperature=ours[-1],
                                  reduction=reduction, backend=be)
    ref = [leaf(x) for x in base]
    per = definition(ref[0], ref[1], ref[2] if negs else None, ref[-1], 0.1)
    want = {"mean": per.mean(), "sum": per.sum(), "none": per}[reduction]
    w = torch.linspace(-1.0, 2.0, 8, dtype=torch.float64) if reduction == "none" else 1.0
    (got.double() * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **_tol(be))


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize("qq,dd,normalize,margin", [(False, False, True, 0.1), (True, False, True, -0.05),
                                                     (False, True, False, 0.2), (True, True, True, 5.0)])
def test_blocks_margins_and_raw_dots(which, qq, dd, normalize, margin, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    q, d, h = _inputs(seed=3)
    if not normalize:  # raw dot products of O(1): rows scaled down
        q, d, h = q / 3, d / 3, h / 3
    ours = [leaf(x, dt) for x in (q, d, h)]
    got = fc.qwen3_embedding_loss(*ours, temperature=0.5, margin=margin, query_query=qq, doc_doc=dd,
                                  normalize=normalize, backend=be)
    ref = [leaf(x) for x in (q, d, h)]
    want = definition(*ref, 0.5, margin, qq=qq, dd=dd, normalize=normalize).mean()
    got.backward()
    want.backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **_tol(be))


def test_a_margin_of_2_masks_nothing_hand_derived():
    # every cosine is <= 1 < cos(q_i, d_i) + 2: Z_i is the sum over all candidates (own columns of q-q / d-d out)
    q, d, h = _inputs()
    qn, dn, hn = F.normalize(q, dim=1), F.normalize(d, dim=1), F.normalize(h, dim=2)
    eye = torch.eye(8, dtype=torch.bool)
    own = torch.einsum("nd,nkd->nk", qn, hn)
    qq, dd = (qn @ qn.T).masked_fill(eye, -torch.inf), (dn @ dn.T).masked_fill(eye, -torch.inf)
    logits = torch.cat([qn @ dn.T, own, qq, dd], 1) / 0.05
    want = F.cross_entropy(logits, torch.arange(8))
    torch.testing.assert_close(fc.qwen3_embedding_loss(q, d, h, margin=2.0), want, rtol=1e-12, atol=0)


def test_gist_with_its_own_embeddings_as_guide_is_the_same_loss_without_row_negatives():
    # the check: gist_loss(q, d, guide=(q, d), margin=-m) equals it where no cos(q_i, d_i) >= 1 - m (there
    # the guide rule itself drops the own q-q / d-d columns; this loss always does)
    g = torch.Generator().manual_seed(5)
    q, d = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randn(12, 6, generator=g, dtype=torch.float64)
    assert float((F.normalize(q, dim=1) * F.normalize(d, dim=1)).sum(1).max()) < 0.9
    for be in ("torch", "reference"):
        gist = fc.gist_loss(q, d, guide=(q, d), margin=-0.1, temperature=0.05, reduction="none", backend=be)
        torch.testing.assert_close(fc.qwen3_embedding_loss(q, d, backend=be, reduction="none"), gist, rtol=1e-12,
                                   atol=1e-12)
    # a pair at cosine 0.95: gist keeps its own q-q / d-d columns (1 <= 0.95 + 0.1), this loss drops them
    d2 = d.clone()
    d2[0] = q[0] + 0.05 * d[0]
    gist = fc.gist_loss(q, d2, guide=(q, d2), margin=-0.1, temperature=0.05, reduction="none")
    ours = fc.qwen3_embedding_loss(q, d2, reduction="none")
    torch.testing.assert_close(ours, definition(q, d2, None, 0.05, 0.1), rtol=1e-12, atol=1e-12)
    assert float(gist[0]) > float(ours[0]) + 1.0


@pytest.fixture
def memeff_on_cpu(monkeypatch):
    """memeff runs under the Triton interpreter once its CUDA-only input checks are off."""
    import importlib
    import pkgutil

    memeff = pytest.importorskip("memeff")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for m in pkgutil.iter_modules(memeff.__path__):
        mod = importlib.import_module(f"memeff.{m.name}")
        if hasattr(mod, "_validate_features"):
            monkeypatch.setattr(mod, "_validate_features", lambda *a, **k: None)
    return memeff


@pytest.mark.parametrize("qq,dd,negs", [(True, True, True), (False, False, True), (True, False, False)])
def test_memeff_qwen3_loss_gives_the_same_value(memeff_on_cpu, qq, dd, negs):
    q, d, h = (x.float() for x in _inputs(n=16, dim=16))
    peer = memeff_on_cpu.MemoryEfficientQwen3Loss(temperature=0.05, margin=0.1, use_qq_negatives=qq,
                                                  use_dd_negatives=dd, stable=False)
    theirs = peer(q, d, h if negs else None)  # values only: its backward's atomics are not the interpreter's
    ours = fc.qwen3_embedding_loss(q, d, h if negs else None, temperature=0.05, margin=0.1, query_query=qq,
                                   doc_doc=dd)
    want = definition(q, d, h if negs else None, 0.05, 0.1, qq=qq, dd=dd).mean()
    assert float(theirs) == pytest.approx(float(want), rel=2e-5)
    assert float(ours) == pytest.approx(float(want), rel=2e-6)


@pytest.mark.parametrize("which", ["reference", "torch-dense", "triton"])
def test_matryoshka_levels_mask_by_each_levels_cosines(which, monkeypatch):
    be = use_backend(which, monkeypatch)
    dt = torch.float32 if be == "triton" else torch.float64
    q, d, h = _inputs()
    ours = [leaf(x, dt) for x in (q, d, h)]
    got = fc.qwen3_embedding_loss(*ours, backend=be, matryoshka_dims=[6, 3], matryoshka_weights=[1.0, 0.5])
    ref = [leaf(x) for x in (q, d, h)]
    want = sum(w * definition(*(x[..., :k] for x in ref), 0.05, 0.1).mean() for k, w in ((6, 1.0), (3, 0.5)))
    got.backward()
    want.backward()
    torch.testing.assert_close(got.double(), want, **_tol(be))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **_tol(be))


def test_errors_name_the_argument():
    q, d, h = _inputs()
    with pytest.raises(ValueError, match="margin must be finite"):
        fc.qwen3_embedding_loss(q, d, margin=float("nan"))
    with pytest.raises(ValueError, match="docs must have as many rows as query"):
        fc.qwen3_embedding_loss(q, d[:5])
    with pytest.raises(ValueError, match=r"row_negatives must have shape \[8, K, 6\]"):
        fc.qwen3_embedding_loss(q, d, h[:4])
    with pytest.raises(TypeError, match="query_query must be a bool"):
        fc.qwen3_embedding_loss(q, d, query_query=1)
    with pytest.raises(TypeError, match="doc_doc must be a bool"):
        fc.qwen3_embedding_loss(q, d, doc_doc="yes")
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        fc.qwen3_embedding_loss(q, d, temperature=0.0)
    with pytest.raises(TypeError, match="query is torch.float64 but docs is torch.float32"):
        fc.qwen3_embedding_loss(q, d.float())
    with pytest.raises(ValueError, match="margin must be finite"):
        fc.nn.Qwen3EmbeddingLoss(margin=float("inf"))


def test_module_form():
    q, d, h = _inputs()
    mod = fc.nn.Qwen3EmbeddingLoss(0.1, margin=0.05, doc_doc=False)
    torch.testing.assert_close(mod(q, d, h), definition(q, d, h, 0.1, 0.05, dd=False).mean(), rtol=1e-12, atol=0)


def _gather_worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:

    with gloo_rank(rank, world, init, out):
        total, off, b = sum(sizes), sum(sizes[:rank]), sizes[rank]
        q, d, h = _inputs(n=total)
        mine = slice(off, off + b)
        res = {"rank": rank}
        for be in ("torch", "triton", "reference"):
            dt = torch.float32 if be == "triton" else torch.float64
            lq, ld, lh = (leaf(x[mine], dt) for x in (q, d, h))
            loss = fc.qwen3_embedding_loss(lq, ld, lh, temperature=0.1, gather=True, backend=be)
            loss.backward()
            # plain lists: no shared memory through the queue
            res[be] = (float(loss.detach()), *(v.grad.double().tolist() for v in (lq, ld, lh)))
        out.put(res)


def test_gather_is_the_global_batch_loss(tmp_path):
    sizes = [5, 3]
    results = run_ranks(_gather_worker, 2, tmp_path, sizes, timeout=240)
    ref = [leaf(x) for x in _inputs(n=8)]
    want = definition(*ref, 0.1, 0.1).mean()
    want.backward()
    for be in ("torch", "triton", "reference"):
        tol = _tol(be)
        mean = sum(r[be][0] for r in results) / 2
        assert mean == pytest.approx(float(want.detach()), rel=tol["rtol"], abs=tol["atol"]), be
        # DDP averages the ranks' gradients: rank r's rows hold its queries', documents' (the d-d and q-d blocks
        # reach other ranks' documents: summed through the gather's backward) and row negatives' gradients
        for k, x in enumerate(ref):
            got = torch.tensor(results[0][be][1 + k] + results[1][be][1 + k], dtype=torch.float64) / 2
            torch.testing.assert_close(got, x.grad, rtol=tol["rtol"], atol=tol["atol"] * 10)
