"""Late interaction (``fused_contrastive.maxsim``): the loss and every gradient against a float64 oracle
written here from the definition (Python loops over query tokens and documents, the tie broken at the
first maximising token by hand), masks, float weights, MeanMaxSim, empty documents, ties, hard
negatives, ignored rows, gather over 2 and 3 gloo ranks with uneven sizes, an autocast bf16 step,
``encode_in_chunks``, the module form, the errors, and the memory claim (no tensor of N·Lq·M·Ld
entries, or even of N·Lq·M·Ld / 4, is ever created)."""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from fused_contrastive import maxsim as MS
from tests._ranks import run_ranks
from tests.test_memory import LargestTensor

F64 = torch.float64


def oracle(q, d, target, qmask=None, dmask=None, scale=1.0, length_normalize=False, normalize=True,
           reduction="mean", ignore_index=-100):
    """The definition, one (query, document) pair at a time in float64: unit tokens, for every query
    token the largest dot product over the valid document tokens (``torch.max`` over a Python list of
    scalars is not used: the first maximum is found by a comparison loop), weighted and summed; then the
    cross-entropy of ``scale * S`` by its own log-sum-exp."""
    q, d = q.to(F64), d.to(F64)
    if normalize:
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        d = d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    n, lq, _ = q.shape
    m, ld, _ = d.shape
    w = torch.ones(n, lq, dtype=F64) if qmask is None else qmask.to(F64)
    if qmask is not None and not qmask.is_floating_point():
        w = (qmask != 0).to(F64)
    count = (w != 0).sum(1).clamp(min=1).to(F64)
    if length_normalize:
        w = w / count[:, None]
    valid = torch.ones(m, ld, dtype=torch.bool) if dmask is None else dmask.bool()
    rows = []
    for i in range(n):
        row = []
        for j in range(m):
            toks = [b for b in range(ld) if valid[j, b]]
            if not toks:  # sentence-transformers' fill, divided by the count like every MeanMaxSim score
                row.append(torch.tensor(-1e9, dtype=F64) / (count[i] if length_normalize else 1.0))
                continue
            total = torch.zeros((), dtype=F64)
            for a in range(lq):
                best = None
                for b in toks:
                    v = q[i, a] @ d[j, b]
                    if best is None or v.detach() > best.detach():
                        best = v
                total = total + w[i, a] * best
            row.append(total)
        rows.append(torch.stack(row))
    z = scale * torch.stack(rows)
    per = []
    for i in range(n):
        t = int(target[i])
        per.append(torch.zeros((), dtype=F64) if t == ignore_index else torch.logsumexp(z[i], 0) - z[i, t])
    per = torch.stack(per)
    keep = (target != ignore_index).sum()
    return per if reduction == "none" else per.sum() if reduction == "sum" else per.sum() / keep


def _data(n=4, m=5, lq=3, ld=6, d=8, k=0, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, lq, d, generator=g, dtype=F64).to(dtype).requires_grad_()
    docs = torch.randn(m, ld, d, generator=g, dtype=F64).to(dtype).requires_grad_()
    qm = torch.rand(n, lq, generator=g) > 0.3
    qm[:, 0] = True
    dm = torch.rand(m, ld, generator=g) > 0.3
    dm[:, 0] = True
    neg = torch.randn(k, ld + 2, d, generator=g, dtype=F64).to(dtype).requires_grad_() if k else None
    nm = (torch.rand(k, ld + 2, generator=g) > 0.3) if k else None
    if k:
        nm[:, 1] = True
    return q, docs, qm, dm, neg, nm


def _grads(out, leaves):
    return torch.autograd.grad(out, [x for x in leaves if x is not None], allow_unused=True)


def _close(a, b, tol=1e-10):
    assert torch.allclose(a.to(F64), b.to(F64), rtol=tol, atol=tol), (a, b)


CASES = {
    "plain": dict(),
    "masks": dict(masks=True),
    "mean_maxsim": dict(masks=True, length_normalize=True),
    "raw_dots": dict(masks=True, normalize=False, scale=0.5),
    "negatives": dict(masks=True, k=3, target=[0, 1, 6, 7]),
    "ignored_sum": dict(masks=True, target=[0, -100, 2, 4], reduction="sum"),
    "none": dict(masks=True, reduction="none", scale=5.0),
}


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_match_the_definition(name, backend):
    c = CASES[name]
    q, d, qm, dm, neg, nm = _data(k=c.get("k", 0))
    if not c.get("masks"):
        qm = dm = None
    t = torch.tensor(c.get("target", range(4)))
    sc = torch.tensor(c.get("scale", 2.0), dtype=F64, requires_grad=True)
    kw = dict(length_normalize=c.get("length_normalize", False), normalize=c.get("normalize", True),
              reduction=c.get("reduction", "mean"))
    out = MS.maxsim_info_nce(q, d, t, query_mask=qm, doc_mask=dm, negatives=neg, negative_mask=nm, scale=sc,
                             backend=backend, **kw)
    if neg is not None:  # the oracle takes the negatives as more documents, padded with invalid tokens
        dd = torch.cat([F.pad(d, (0, 0, 0, 2)), neg])
        dmm = torch.cat([F.pad(dm, (0, 2)), nm])
    else:
        dd, dmm = d, dm
    want = oracle(q, dd, t, qm, dmm, sc, **kw)
    _close(out, want)
    if out.dim():
        out, want = (out * torch.arange(1, 5)).sum(), (want * torch.arange(1, 5)).sum()
    for g, h in zip(_grads(out, [q, d, neg, sc]), _grads(want, [q, d, neg, sc]), strict=True):
        _close(g, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["masks", "mean_maxsim", "negatives", "none"])
def test_the_triton_kernels_under_the_loss(name, dtype):
    """The loss on backend="triton" (the interpreter) against the float64 oracle of the same rounded
    inputs: the loss to fp32 accumulation, the gradients to the input dtype's rounding (the kernels
    return them in it; dd's one-hot operand is rounded once)."""
    c = CASES[name]
    q, d, qm, dm, neg, nm = _data(k=c.get("k", 0), dtype=dtype)
    t = torch.tensor(c.get("target", range(4)))
    kw = dict(length_normalize=c.get("length_normalize", False), reduction=c.get("reduction", "mean"))
    out = MS.maxsim_info_nce(q, d, t, query_mask=qm, doc_mask=dm, negatives=neg, negative_mask=nm, scale=2.0,
                             backend="triton", **kw)
    q64, d64 = q.detach().double().requires_grad_(), d.detach().double().requires_grad_()
    n64 = neg.detach().double().requires_grad_() if neg is not None else None
    dd = torch.cat([F.pad(d64, (0, 0, 0, 2)), n64]) if neg is not None else d64
    dmm = torch.cat([F.pad(dm, (0, 2)), nm]) if neg is not None else dm
    # the kernels see the unit tokens rounded to the input dtype: so does the oracle
    unit = lambda x: (x / x.norm(dim=-1, keepdim=True)).to(dtype).double()  # noqa: E731
    want = oracle(unit(q64), unit(dd), t, qm, dmm, 2.0, normalize=False, **kw)
    assert torch.allclose(out.double(), want.detach(), rtol=2e-5, atol=2e-5), (out, want)
    if out.dim():
        out = (out * torch.arange(1, 5)).sum()
    got = torch.autograd.grad(out, [x for x in (q, d, neg) if x is not None])
    want = MS.maxsim_info_nce(q64, d64, t, query_mask=qm, doc_mask=dm, negatives=n64, negative_mask=nm, scale=2.0,
                              backend="reference", **kw)
    if want.dim():
        want = (want * torch.arange(1, 5)).sum()
    ref_g = torch.autograd.grad(want, [x for x in (q64, d64, n64) if x is not None])
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    for a, b in zip(got, ref_g, strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).abs().max() <= tol * b.abs().max(), ((a.double() - b).abs().max(), b.abs().max())


def test_float_query_weights_and_scores():
    q, d, qm, dm, _, _ = _data()
    wts = torch.rand(4, 3, generator=torch.Generator().manual_seed(3), dtype=F64) * qm
    s = MS.maxsim_scores(q, d, query_mask=wts, doc_mask=dm, backend="torch")
    loss = MS.maxsim_info_nce(q, d, query_mask=wts, doc_mask=dm, normalize=False, backend="torch")
    want = oracle(q, d, torch.arange(4), wts, dm, normalize=False)
    _close(loss, want)
    _close(s, MS.maxsim_scores(q, d, query_mask=wts, doc_mask=dm, backend="reference"))


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_empty_document_scores_minus_1e9_and_gets_no_gradient(backend, length_normalize):
    q, d, qm, dm, _, _ = _data()
    dm[3] = False
    dtype = F64 if backend == "torch" else torch.float32
    q, d = q.detach().to(dtype).requires_grad_(), d.detach().to(dtype).requires_grad_()
    s = MS.maxsim_scores(q, d, query_mask=qm, doc_mask=dm, length_normalize=length_normalize, backend=backend)
    count = qm.sum(1).to(s.dtype)
    assert torch.equal(s[:, 3], -1e9 / count if length_normalize else torch.full_like(s[:, 3], -1e9))
    for t in ([0, 1, 2, 4], [0, 1, 2, 3]):  # the empty document as a negative, then as a positive
        t = torch.tensor(t)
        loss = MS.maxsim_info_nce(q, d, t, query_mask=qm, doc_mask=dm, length_normalize=length_normalize,
                                  backend=backend)
        want = oracle(q, d, t, qm, dm, length_normalize=length_normalize)
        assert torch.allclose(loss.double(), want, rtol=1e-6), (loss, want)
        (gd,) = torch.autograd.grad(loss, d)
        assert torch.all(gd[3] == 0) and gd[0].abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_ties_send_the_gradient_to_the_first_maximising_token(backend):
    """Document 0 holds the same vector at tokens 1 and 3 (an exact tie for every query token that
    picks it): only token 1 may receive gradient, and the loss equals the oracle's."""
    q, d, _, _, _, _ = _data(n=2, m=2, lq=2, ld=4, d=4)
    with torch.no_grad():
        d[0, 3] = d[0, 1]
        q[0, 0] = d[0, 1] * 3.0  # query token (0, 0) picks the tied pair of document 0
    loss = MS.maxsim_info_nce(q, d, normalize=False, backend=backend)
    _close(loss, oracle(q, d, torch.arange(2), normalize=False))
    (gd,) = torch.autograd.grad(loss, d)
    assert gd[0, 1].abs().sum() > 0 and torch.all(gd[0, 3] == 0)


def test_the_planted_defect_of_a_wrong_tie_rule_is_caught():
    """An oracle that split the tied gradient evenly (amax's rule) differs from ours at a tie: the
    comparison above can fail."""
    q, d, _, _, _, _ = _data(n=2, m=2, lq=2, ld=4, d=4)
    with torch.no_grad():
        d[0, 3] = d[0, 1]
        q[0, 0] = d[0, 1] * 3.0
    sims = torch.einsum("nad,mbd->nmab", q, d)
    s_even = sims.amax(-1).sum(-1)
    loss_even = F.cross_entropy(s_even, torch.arange(2))
    (g_even,) = torch.autograd.grad(loss_even, d)
    (g_ours,) = torch.autograd.grad(MS.maxsim_info_nce(q, d, normalize=False, backend="torch"), d)
    assert not torch.allclose(g_even, g_ours)


def test_chunked_path_matches_across_chunk_sizes_and_never_builds_the_token_similarities(monkeypatch):
    n, m, lq, ld, dim = 12, 10, 4, 7, 6
    q, d, qm, dm, neg, nm = _data(n, m, lq, ld, dim, k=2, seed=5, dtype=torch.float32)
    t = torch.arange(n) % (m + 2)
    want = MS.maxsim_info_nce(q, d, t, query_mask=qm, doc_mask=dm, negatives=neg, negative_mask=nm, scale=3.0,
                              backend="reference")
    gw = _grads(want, [q, d, neg])
    monkeypatch.setattr(MS, "CHUNK_ELEMENTS", 64)  # many chunks along both axes
    cols = m + 2
    full = n * lq * cols * (ld + 2)
    with LargestTensor() as probe:
        out = MS.maxsim_info_nce(q, d, t, query_mask=qm, doc_mask=dm, negatives=neg, negative_mask=nm, scale=3.0,
                                 backend="torch")
        g = _grads(out, [q, d, neg])
    assert probe.largest < full / 4, (probe.largest, probe.op, full)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5)
    for a, b in zip(g, gw, strict=True):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)
    with LargestTensor() as probe_ref:  # the probe sees the materialised similarities
        MS.maxsim_info_nce(q, d, t, query_mask=qm, doc_mask=dm, negatives=neg, negative_mask=nm,
                           backend="reference").backward()
    assert probe_ref.largest >= full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_and_an_autocast_step(dtype):
    torch.manual_seed(0)
    enc = torch.nn.Linear(8, 8).to(F64)
    x_q, x_d = torch.randn(6, 4, 8, dtype=F64), torch.randn(6, 5, 8, dtype=F64)
    loss64 = MS.maxsim_info_nce(enc(x_q), enc(x_d), scale=4.0, backend="torch")
    g64 = torch.autograd.grad(loss64, enc.weight)[0]
    enc32 = torch.nn.Linear(8, 8)
    enc32.load_state_dict({k: v.float() for k, v in enc.state_dict().items()})
    with torch.autocast("cpu", dtype=dtype):
        qt, dt = enc32(x_q.float()), enc32(x_d.float())
        assert qt.dtype == dtype
        loss = MS.maxsim_info_nce(qt, dt, scale=4.0, backend="torch")
    assert loss.dtype == torch.float32
    loss.backward()
    g = enc32.weight.grad
    assert torch.isfinite(g).all()
    # 16-bit activations: the loss and gradient within that dtype's rounding of the float64 step
    eps = torch.finfo(dtype).eps
    assert abs(loss.item() - loss64.item()) < 40 * eps * max(1.0, loss64.item())
    assert (g.double() - g64).abs().max() < 40 * eps * g64.abs().max()


def test_encode_in_chunks_gives_the_same_gradients():
    torch.manual_seed(1)
    enc = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()).to(F64)
    xq, xd = torch.randn(7, 3, 6, dtype=F64), torch.randn(7, 4, 6, dtype=F64)
    loss = MS.maxsim_info_nce(enc(xq), enc(xd), backend="torch")
    want = torch.autograd.grad(loss, list(enc.parameters()))
    loss2 = MS.maxsim_info_nce(fc.encode_in_chunks(enc, xq, 3), fc.encode_in_chunks(enc, xd, 2), backend="torch")
    got = torch.autograd.grad(loss2, list(enc.parameters()))
    _close(loss2, loss)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


def test_module_form_and_learnable_scale():
    q, d, qm, dm, _, _ = _data()
    mod = fc.nn.MaxSimInfoNCELoss(scale=2.0, learn_scale=True, length_normalize=True, backend="torch")
    out = mod(q, d, query_mask=qm, doc_mask=dm)
    sc = torch.tensor(math.log(2.0), dtype=F64, requires_grad=True)
    want = oracle(q, d, torch.arange(4), qm, dm, sc.exp(), length_normalize=True)
    _close(out, want)
    out.backward()
    (gs,) = torch.autograd.grad(want, sc)
    _close(mod.log_scale.grad.double(), gs, 1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda q, d: MS.maxsim_info_nce(q[0], d), "query_tokens must have 3 dimensions"),
    (lambda q, d: MS.maxsim_info_nce(q, d[..., :3]), "doc_tokens"),
    (lambda q, d: MS.maxsim_info_nce(q, d, query_mask=torch.ones(4, 2, dtype=torch.bool)),
     "query_mask must have shape"),
    (lambda q, d: MS.maxsim_info_nce(q, d, doc_mask=torch.ones(5, 6)), "doc_mask must be a bool"),
    (lambda q, d: MS.maxsim_info_nce(q, d[:3]), "at least 4 documents"),
    (lambda q, d: MS.maxsim_info_nce(q, d, negative_mask=torch.ones(2, 2, dtype=torch.bool)),
     "negative_mask was given"),
    (lambda q, d: MS.maxsim_info_nce(q, d, temperature=0.1, scale=10.0), "at most one of temperature and scale"),
    (lambda q, d: MS.maxsim_info_nce(q, d, torch.tensor([0, 1, 2, 9])), "target\\[3\\] = 9 is out of range"),
    (lambda q, d: MS.maxsim_info_nce(q, d, backend="cuda"), "backend must be one of"),
    (lambda q, d: MS.maxsim_info_nce(q.float(), d), "query_tokens"),
])
def test_errors_name_the_argument(call, match):
    q, d, _, _, _, _ = _data()
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, d)


# --- gather over gloo ranks ---------------------------------------------------------------------------

def _gather_worker(rank, world, init, sizes, out):
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        n_all, lens = sum(sizes), [5, 7, 6]
        g = torch.Generator().manual_seed(0)
        q = torch.randn(n_all, 3, 4, generator=g, dtype=F64)
        docs = [torch.randn(n, lens[r], 4, generator=g, dtype=F64) for r, n in enumerate(sizes)]
        masks = [torch.rand(n, lens[r], generator=g) > 0.3 for r, n in enumerate(sizes)]
        for mk in masks:
            mk[:, 0] = True
        negs = [torch.randn(2, 3, 4, generator=g, dtype=F64) for _ in sizes]
        off = sum(sizes[:rank])
        ql = q[off:off + sizes[rank]].clone().requires_grad_()
        dl = docs[rank].clone().requires_grad_()
        nl = negs[rank].clone().requires_grad_()
        loss = MS.maxsim_info_nce(ql, dl, doc_mask=masks[rank], negatives=nl, scale=3.0, backend="torch", gather=True)
        loss.backward()
        # the global-batch loss on one process, from the oracle: every document padded to the longest
        ld = max(lens)
        all_d = torch.cat([F.pad(x, (0, 0, 0, ld - x.shape[1])) for x in docs] + [F.pad(x, (0, 0, 0, ld - 3))
                                                                                 for x in negs])
        all_m = torch.cat([F.pad(x, (0, ld - x.shape[1])) for x in masks] +
                          [F.pad(torch.ones(2, 3, dtype=torch.bool), (0, ld - 3)) for _ in negs])
        qa, da = q.clone().requires_grad_(), all_d.clone().requires_grad_()
        want = oracle(qa, da, torch.arange(n_all), None, all_m, 3.0)
        want.backward()
        # DDP averages over ranks: the rank's loss times world / world; gradients of its own rows
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach().float())
        out.put({"rank": rank, "mean": float(sum(losses) / world), "want": float(want),
                 "gq": float((ql.grad / world - qa.grad[off:off + sizes[rank]]).abs().max())})
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        out.put({"rank": rank, "error": traceback.format_exc()})


@pytest.mark.parametrize("sizes", [[3, 2], [2, 4, 1]])
def test_gather_over_gloo_ranks_with_uneven_sizes(tmp_path, sizes):
    for r in run_ranks(_gather_worker, len(sizes), tmp_path, sizes, timeout=150):
        assert abs(r["mean"] - r["want"]) < 1e-6, r
        assert r["gq"] < 1e-9, r
