"""fused_contrastive.distributed.gather_rows on real processes: gloo on loopback, 2 and 3 ranks with
unequal local sizes. The oracle is the single-process computation over the concatenated rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fused_contrastive as fc
from fused_contrastive.distributed import gather_rows, process_group
from tests._ranks import gloo_rank, run_ranks, timed_calls

D = 6


def _worker(rank: int, world: int, init: str, sizes: list[int], out) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        n = sum(sizes)
        full = torch.randn(n, D, generator=g, dtype=torch.float64)
        w = torch.randn(n, D, generator=g, dtype=torch.float64)
        off = sum(sizes[:rank])
        x = full[off:off + sizes[rank]].clone().requires_grad_()
        rows, offset, got_sizes = gather_rows(x)
        res = {"rank": rank, "rows": torch.equal(rows.detach(), full), "offset": offset == off,
               "sizes": got_sizes == sizes}
        # a loss that couples every rank's rows; every rank computes it, so the gather's backward sums
        # world copies of the single-process gradient into each rank's rows
        ((rows * w).sum() ** 2 / 7).backward()
        ref = full.clone().requires_grad_()
        ((ref * w).sum() ** 2 / 7).backward()
        res["grad"] = torch.allclose(x.grad, world * ref.grad[off:off + sizes[rank]], rtol=1e-12, atol=1e-12)
        try:  # the last rank passes another embedding dimension: every rank must get the error
            gather_rows(torch.randn(2, D + (rank == world - 1)), name="query")
            res["dim_error"] = None
        except ValueError as e:
            res["dim_error"] = str(e)
        try:
            gather_rows(torch.randn(2, D, dtype=torch.float64 if rank == 0 else torch.float32), name="keys")
            res["dtype_error"] = None
        except ValueError as e:
            res["dtype_error"] = str(e)
        out.put(res)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [[5, 3], [4, 0, 7]], ids=["2ranks", "3ranks_one_empty"])
def test_gather_rows_values_gradients_and_errors(sizes, tmp_path):
    world = len(sizes)
    results = run_ranks(_worker, world, tmp_path, sizes, timeout=120)
    assert sorted(r["rank"] for r in results) == list(range(world))
    for r in results:
        assert r["rows"] and r["offset"] and r["sizes"] and r["grad"], r
        assert r["dim_error"] is not None and "query" in r["dim_error"] and "same dtype and trailing shape" \
            in r["dim_error"], r
        assert r["dtype_error"] is not None and "keys" in r["dtype_error"], r


def test_process_group_arguments():
    assert process_group(False) is None
    with pytest.raises(ValueError, match="init_process_group"):
        process_group(True)
    with pytest.raises(TypeError, match="gather"):
        process_group("yes")


# ------------------------------------------------------------------------------------------------
# the losses' gather= option: every rank's value and gradients against the single-process loss over
# the concatenated global batch
# ------------------------------------------------------------------------------------------------


def _split(x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    off = sum(sizes[:rank])
    return x[off:off + sizes[rank]]


def _loss_inputs(sizes: list[int], g: torch.Generator):
    """The global inputs of every configuration (float64), and the per-rank targets."""
    d = D
    n = sum(sizes)
    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    ksizes = [s + 1 for s in sizes]  # more keys than queries on every rank
    q, k = r(n, d), r(sum(ksizes), d)
    # targets: each rank's rows point into its own keys; some ignored
    local_t = [torch.randint(0, ks, (s,), generator=g) for s, ks in zip(sizes, ksizes, strict=True)]
    for t in local_t:
        t[::3] = -100
    glob_t = torch.cat([torch.where(t >= 0, t + sum(ksizes[:i]), t) for i, t in enumerate(local_t)])
    # keys=None: each row's target is another row of its own rank (local index; global = + offset)
    local_self_t = [(torch.arange(s) + 1) % max(s, 1) for s in sizes]
    self_t = torch.cat([t + sum(sizes[:i]) for i, t in enumerate(local_self_t)])
    z = r(2 * n, d)  # interleaved pairs: rank i holds 2 * sizes[i] rows
    zsizes = [2 * s for s in sizes]
    a, p, ng = r(n, d), r(n, d), r(n, d)
    temp = torch.tensor(0.1, dtype=torch.float64)
    return q, k, local_t, glob_t, local_self_t, self_t, z, zsizes, a, p, ng, temp, ksizes


def _cases(sizes, rank, g):
    """(name, single-process loss (closure over global leaves), rank loss (closure over local leaves),
    global leaves, local leaves, the leaf index of a learnable scale or None)."""
    q, k, local_t, glob_t, local_self_t, self_t, z, zsizes, a, p, ng, temp, ksizes = _loss_inputs(sizes, g)
    def mine(x, sz):
        return _split(x, sz, rank)

    out = []

    def add(name, glob_fn, rank_fn, glob, local):
        out.append((name, glob_fn, rank_fn, glob, local))

    add("info_nce_mean", lambda q_, k_: fc.info_nce(q_, k_, temperature=0.05),
        lambda q_, k_: fc.info_nce(q_, k_, temperature=0.05, gather=True),
        [q, k], [mine(q, sizes), mine(k, ksizes)])
    add("info_nce_target_ignore_sum",
        lambda q_, k_: fc.info_nce(q_, k_, glob_t, temperature=0.05, reduction="sum"),
        lambda q_, k_: fc.info_nce(q_, k_, local_t[rank], temperature=0.05, reduction="sum", gather=True),
        [q, k], [mine(q, sizes), mine(k, ksizes)])
    add("info_nce_ignore_mean",
        lambda q_, k_: fc.info_nce(q_, k_, glob_t, temperature=0.05),
        lambda q_, k_: fc.info_nce(q_, k_, local_t[rank], temperature=0.05, gather=True),
        [q, k], [mine(q, sizes), mine(k, ksizes)])
    add("info_nce_self_learnable_t",
        lambda q_, t_: fc.info_nce(q_, None, self_t, temperature=t_),
        lambda q_, t_: fc.info_nce(q_, None, local_self_t[rank], temperature=t_, gather=True),
        [q, temp], [mine(q, sizes), temp])
    add("clip_learnable_scale", lambda a_, p_, s_: fc.clip_loss(a_, p_, s_),
        lambda a_, p_, s_: fc.clip_loss(a_, p_, s_, gather=True),
        [a, p, temp * 100], [mine(a, sizes), mine(p, sizes), temp * 100])
    add("simcse_interleaved", lambda z_: fc.simcse_loss(z_), lambda z_: fc.simcse_loss(z_, gather=True),
        [z], [mine(z, zsizes)])
    add("simcse_two_view", lambda a_, p_: fc.simcse_loss(a_, p_), lambda a_, p_: fc.simcse_loss(a_, p_, gather=True),
        [a, p], [mine(a, sizes), mine(p, sizes)])
    add("simcse_sup_hard_negatives",
        lambda a_, p_, n_: fc.simcse_sup_loss(a_, p_, n_, hard_negative_weight=1.0),
        lambda a_, p_, n_: fc.simcse_sup_loss(a_, p_, n_, hard_negative_weight=1.0, gather=True),
        [a, p, ng], [mine(a, sizes), mine(p, sizes), mine(ng, sizes)])
    add("dcl", lambda a_, p_: fc.dcl_loss(a_, p_), lambda a_, p_: fc.dcl_loss(a_, p_, gather=True),
        [a, p], [mine(a, sizes), mine(p, sizes)])
    add("dclw_sum_learnable_t", lambda a_, p_, t_: fc.dclw_loss(a_, p_, temperature=t_, reduction="sum"),
        lambda a_, p_, t_: fc.dclw_loss(a_, p_, temperature=t_, reduction="sum", gather=True),
        [a, p, temp], [mine(a, sizes), mine(p, sizes), temp])
    nn_ = sum(sizes)
    feats = torch.randn(nn_, 2, D, generator=g, dtype=torch.float64)
    feats3 = torch.randn(nn_, 3, D, generator=g, dtype=torch.float64)
    lab = torch.randint(0, 3, (nn_,), generator=g)
    pmask = (torch.rand(nn_, nn_, generator=g) < 0.4).double() * torch.rand(nn_, nn_, generator=g, dtype=torch.float64)
    qsizes = [2 + i for i in range(len(sizes))]
    queue = torch.randn(sum(qsizes), D, generator=g, dtype=torch.float64)
    qlab = torch.randint(0, 3, (sum(qsizes),), generator=g)
    lab_r, mask_r, q_r, ql_r = mine(lab, sizes), mine(pmask, sizes), mine(queue, qsizes), mine(qlab, qsizes)
    add("supcon_labels_out", lambda f_: fc.supcon_loss(f_, lab), lambda f_: fc.supcon_loss(f_, lab_r, gather=True),
        [feats], [mine(feats, sizes)])
    add("supcon_mask_in_none", lambda f_: fc.supcon_loss(f_, mask=pmask, variant="in", reduction="sum"),
        lambda f_: fc.supcon_loss(f_, mask=mask_r, variant="in", reduction="sum", gather=True),
        [feats], [mine(feats, sizes)])
    add("supcon_one_3views_learnable_t", lambda f_, t_: fc.supcon_loss(f_, lab, contrast_mode="one", temperature=t_),
        lambda f_, t_: fc.supcon_loss(f_, lab_r, contrast_mode="one", temperature=t_, gather=True),
        [feats3, temp], [mine(feats3, sizes), temp])
    add("supcon_simclr", lambda f_: fc.supcon_loss(f_), lambda f_: fc.supcon_loss(f_, gather=True),
        [feats], [mine(feats, sizes)])
    add("supcon_queue_in", lambda f_: fc.supcon_loss(f_, lab, queue=queue, queue_labels=qlab, variant="in"),
        lambda f_: fc.supcon_loss(f_, lab_r, queue=q_r, queue_labels=ql_r, variant="in", gather=True),
        [feats], [mine(feats, sizes)])
    add("dscl", lambda f_: fc.dscl_loss(f_, lab), lambda f_: fc.dscl_loss(f_, lab_r, gather=True),
        [feats], [mine(feats, sizes)])
    add("dscl_queue_learnable_t", lambda f_, t_: fc.dscl_loss(f_, lab, queue=queue, queue_labels=qlab, temperature=t_),
        lambda f_, t_: fc.dscl_loss(f_, lab_r, queue=q_r, queue_labels=ql_r, temperature=t_, gather=True),
        [feats, temp], [mine(feats, sizes), temp])
    torch.manual_seed(0)  # the same encoder weights on every rank (as DDP keeps them)
    lin = torch.nn.Linear(D, D).double()
    add("encode_in_chunks_then_gather",
        lambda x_: fc.simcse_loss(lin(x_), lin(x_.flip(1))),
        lambda x_: fc.simcse_loss(fc.encode_in_chunks(lin, x_, 2), fc.encode_in_chunks(lin, x_.flip(1), 2),
                                  gather=True),
        [a], [mine(a, sizes)])
    y = torch.randint(0, 4, (sum(sizes),), generator=g).double()
    add("cosent_learnable_scale", lambda a_, p_, s_: fc.cosent_loss(a_, p_, y, scale=s_),
        lambda a_, p_, s_: fc.cosent_loss(a_, p_, mine(y, sizes), scale=s_, gather=True),
        [a, p, temp * 200], [mine(a, sizes), mine(p, sizes), temp * 200])
    add("cosent_scores", lambda x_: fc.cosent_loss_from_scores(x_, y),
        lambda x_: fc.cosent_loss_from_scores(x_, mine(y, sizes), gather=True),
        [a[:, 0]], [mine(a[:, 0], sizes)])
    # GIST without the anchor-anchor block (which stays local under gather): every other block contrasts
    # with every rank's positives / negatives, so the global batch is the truth
    gg = [torch.randn(sum(sizes), 3, generator=g, dtype=torch.float64) for _ in range(3)]
    add("gist_no_anchor_block",
        lambda a_, p_, n_: fc.gist_loss(a_, p_, n_, guide=tuple(gg), temperature=0.1, margin=0.05,
                                        contrast_anchors=False),
        lambda a_, p_, n_: fc.gist_loss(a_, p_, n_, guide=tuple(mine(x, sizes) for x in gg), temperature=0.1,
                                        margin=0.05, contrast_anchors=False, gather=True),
        [a, p, ng], [mine(a, sizes), mine(p, sizes), mine(ng, sizes)])
    return out


def registry_cells(sizes, rank, seed: int = 0):
    """The parity cells generated from the registry: every case with a ``gather_split`` fact, built at the
    global batch (float64) and split by its rows ("pairs": two rows per example); 0-dim tensors and the
    other options are replicated. Same tuples as :func:`_cases`."""
    from fused_contrastive.testing import CASES

    out = []
    for case in CASES:
        if case.gather_split is None:
            continue
        per = 2 if case.gather_split == "pairs" else 1
        total = per * sum(sizes)
        rows = [per * s for s in sizes]
        tensors, kw = case.build(total, D, torch.Generator().manual_seed(seed))
        assert kw.get("reduction", "mean") != "none", f"{case.name}: gather_split needs a reduced loss"

        def as64(v):
            return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        def local(v, _total=total, _rows=rows, _name=case.name):
            split = isinstance(v, torch.Tensor) and v.dim() >= 1
            assert not split or v.shape[0] == _total, f"{_name}: an input of {v.shape[0]} rows, not {_total}"
            return _split(v, _rows, rank) if split else v

        keys = list(tensors)
        glob = [as64(tensors[k]) for k in keys]
        kw64 = {k: as64(v) for k, v in kw.items()}
        kw_local = {k: local(v) for k, v in kw64.items()}

        def glob_fn(*xs, _fn=case.fn, _keys=keys, _kw=kw64):
            return _fn(**dict(zip(_keys, xs, strict=True)), **_kw)

        def rank_fn(*xs, _fn=case.fn, _keys=keys, _kw=kw_local):
            return _fn(**dict(zip(_keys, xs, strict=True)), **_kw, gather=True)

        out.append((f"case:{case.name}", glob_fn, rank_fn, glob, [local(x) for x in glob]))
    return out


def _loss_worker(rank: int, world: int, init: str, sizes: list[int], backends: list[str], out) -> None:
    with gloo_rank(rank, world, init, out, timeout=60):
        res = {"rank": rank, "cases": {}}
        for be in backends:
            for name, glob_fn, rank_fn, glob, local in (_cases(sizes, rank, torch.Generator().manual_seed(0))
                                                        + registry_cells(sizes, rank)):
                gl = [x.clone().requires_grad_() for x in glob]
                lo = [x.clone().requires_grad_() for x in local]
                want = glob_fn(*gl)
                want_g = torch.autograd.grad(want, gl)
                got = rank_fn(*lo)
                got_g = torch.autograd.grad(got, lo)
                entry = {"loss": float(got.detach()), "want": float(want.detach()), "grads_ok": True,
                         "scalar_grads": []}
                for i, (x, gg, wg) in enumerate(zip(local, got_g, want_g, strict=True)):
                    if x.dim() == 0:  # a replicated (learnable) scalar: DDP averages it over ranks
                        entry["scalar_grads"].append((float(gg), float(wg)))
                        continue
                    sl = next(s for s in (sizes, [2 * s for s in sizes], [s + 1 for s in sizes])
                              if sum(s) == glob[i].shape[0])
                    want_local = world * _split(wg, sl, rank)  # every rank backpropagates its own loss
                    if not torch.allclose(gg, want_local, rtol=1e-9, atol=1e-11):
                        entry["grads_ok"] = False
                        entry["err"] = float((gg - want_local).abs().max())
                res["cases"][f"{be}/{name}"] = entry
        out.put(res)


@pytest.mark.parametrize("sizes", [[5, 3], [4, 2, 7], [4, 4]], ids=["2ranks", "3ranks", "2ranks_equal"])
def test_losses_with_gather_match_the_global_batch(sizes, tmp_path):
    world = len(sizes)
    results = run_ranks(_loss_worker, world, tmp_path, sizes, ["torch", "reference"], timeout=150)
    names = results[0]["cases"].keys()
    for name in names:
        entries = [r["cases"][name] for r in results]
        # the average over ranks of the returned values is the single-process loss
        avg = sum(e["loss"] for e in entries) / world
        assert abs(avg - entries[0]["want"]) <= 1e-9 * max(1.0, abs(entries[0]["want"])), (name, avg, entries)
        for e in entries:
            assert e["grads_ok"], (name, e)
        # a replicated scalar's gradient, averaged over ranks (what DDP does), is the single-process one
        for i in range(len(entries[0]["scalar_grads"])):
            g_avg = sum(e["scalar_grads"][i][0] for e in entries) / world
            want = entries[0]["scalar_grads"][i][1]
            assert abs(g_avg - want) <= 1e-9 * max(1.0, abs(want)), (name, g_avg, want)


@pytest.mark.parametrize("call", [
    lambda: fc.info_nce(torch.randn(4, 3), torch.randn(4, 3), gather=True),
    lambda: fc.supcon_loss(torch.randn(4, 2, 3), torch.arange(4), gather=True),
    lambda: fc.cosent_loss(torch.randn(4, 3), torch.randn(4, 3), torch.arange(4.0), gather=True),
    lambda: fc.nn.CLIPLoss(gather=True)(torch.randn(4, 3), torch.randn(4, 3)),
], ids=["info_nce", "supcon", "cosent", "CLIPLoss"])
def test_gather_without_a_process_group_says_so(call):
    with pytest.raises(ValueError, match="init_process_group"):
        call()


# ------------------------------------------------------------------------------------------------
# one rank's bad arguments: every rank raises at once (no rank waits in a gather for the timeout)
# ------------------------------------------------------------------------------------------------

BAD_RANK = 1


def _bad_calls(rank: int):
    """(name, call, what the bad rank's own error says). The bad rank gets the bad arguments, the others
    good ones; a "mismatch" case gives every rank valid arguments that disagree between ranks."""
    g = torch.Generator().manual_seed(rank)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    bad = rank == BAD_RANK
    n = 4 + rank  # uneven local batches
    return [
        ("info_nce ndim", lambda: fc.info_nce(r(n, 1, 5) if bad else r(n, 5), r(n, 5), gather=True), "query"),
        ("supcon labels length",
         lambda: fc.supcon_loss(r(n, 2, 5), torch.arange(n + bad), gather=True), "labels"),
        ("simcse temperature", lambda: fc.simcse_loss(r(n, 5), r(n, 5), temperature=-1.0 if bad else 0.05,
                                                      gather=True), "temperature"),
        ("cosent scale", lambda: fc.cosent_loss(r(n, 5), r(n, 5), torch.rand(n, generator=g),
                                                scale=0.0 if bad else 20.0, gather=True), "scale"),
        ("siglip text rows", lambda: fc.siglip_loss(r(n, 5), r(n + bad, 5), 10.0, -10.0, gather=True), "text"),
        ("supcon mask columns mismatch", lambda: fc.supcon_loss(
            r(n, 2, 5), mask=torch.ones(n, sum(4 + k for k in range(3)) + bad), gather=True), "mask"),
        ("clip scale mismatch", lambda: fc.clip_loss(r(n, 5), r(n, 5), 20.0 + bad, gather=True), "scale"),
    ]


def _bad_rank_worker(rank: int, world: int, init: str, out) -> None:

    # a short process-group timeout: without the fix, the healthy ranks fail the test in seconds, not hang
    with gloo_rank(rank, world, init, out, timeout=20):
        res = {"rank": rank, "cases": timed_calls((name, call) for name, call, _ in _bad_calls(rank))}
        # the ranks are still in step: a good gathered call gives every rank the global batch
        x = torch.full((2 + rank, 3), float(rank))
        rows, off, sizes = gather_rows(x)
        res["after"] = (rows[:, 0].tolist(), off, sizes)
        out.put(res)


def test_one_ranks_bad_arguments_make_every_rank_raise_promptly(tmp_path):
    """A wrong ndim, a label-length mismatch, a bad temperature or scale, a wrong row count or mask
    width on rank 1 only: rank 1 raises its own error (naming the argument), ranks 0 and 2 raise a
    ValueError naming rank 1 and that error, each within seconds; ranks given different scales, or mask
    widths other than the global batch, all raise the same error; afterwards the ranks are in step."""
    world = 3
    results = run_ranks(_bad_rank_worker, world, tmp_path, timeout=120)
    for name, _, arg in _bad_calls(0):
        for res in results:
            err, took = res["cases"][name]
            assert err is not None, (name, res["rank"], "did not raise")
            kind, text, notes = err
            assert took < 10, (name, res["rank"], took)
            if name.endswith("mismatch"):  # found in the exchange: the same error on every rank
                assert kind == "ValueError" and arg in text and "rank 1" in text, (name, err)
            elif res["rank"] == BAD_RANK:
                assert arg in text and "every rank" in notes, (name, err)
            else:
                assert kind == "ValueError" and "rank 1:" in text and arg in text, (name, res["rank"], err)
    want = [0.0] * 2 + [1.0] * 3 + [2.0] * 4
    for res in results:
        assert res["after"] == (want, sum(2 + k for k in range(res["rank"])), [2, 3, 4]), res
