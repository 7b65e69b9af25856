"""What the fault trial found (issue 57), one test per finding that failed before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fused_contrastive as fc
import fused_contrastive.nn as fnn


def _qk(n=8, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


# --- 4: a tensor option of a module belongs to it -----------------------------------------------------


@pytest.mark.parametrize("cls,name,args", [(fnn.InfoNCELoss, "temperature", ()), (fnn.SupConLoss, "temperature", ()),
                                           (fnn.CoSENTLoss, "scale", ())])
def test_a_learnable_option_is_a_parameter_of_the_module(cls, name, args):
    p = nn.Parameter(torch.tensor(0.2))
    m = cls(p)
    assert [n for n, _ in m.named_parameters()] == [name] and name in m.state_dict()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if cls is fnn.SupConLoss:
        loss = m(torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 0, 1, 2, 2]))
    elif cls is fnn.CoSENTLoss:
        q, k = _qk()
        loss = m(q, k, torch.arange(8.0))
    else:
        loss = m(*_qk())
    loss.backward()
    before = float(p)
    opt.step()
    assert p.grad is not None and float(getattr(m, name)) != before  # the optimizer trained it
    # a checkpoint carries it, and a module loaded from it computes with the loaded value
    m2 = cls(nn.Parameter(torch.tensor(0.5)))
    m2.load_state_dict(m.state_dict())
    assert float(getattr(m2, name)) == float(getattr(m, name))


def test_a_tensor_option_moves_with_the_module_and_a_copy_keeps_it():
    m = fnn.InfoNCELoss(torch.tensor(0.05))
    assert list(m.state_dict()) == ["temperature"] and not list(m.parameters())  # a buffer
    assert m.to(torch.float64).temperature.dtype == torch.float64
    q, k = _qk()
    want = fc.info_nce(q, k, temperature=0.05)
    assert torch.allclose(copy.deepcopy(m)(q, k), want)


def test_maxsim_module_keeps_a_learnable_scale():
    s = nn.Parameter(torch.tensor(2.0))
    m = fnn.MaxSimInfoNCELoss(scale=s)
    q, d = torch.randn(3, 4, 5), torch.randn(3, 6, 5)
    loss = m(q, d)
    assert torch.allclose(loss, fc.maxsim.maxsim_info_nce(q, d, scale=2.0))
    loss.backward()
    assert s.grad is not None and [n for n, _ in m.named_parameters()] == ["given_scale"]
    with pytest.raises(ValueError, match="learn_scale"):
        fnn.MaxSimInfoNCELoss(scale=nn.Parameter(torch.tensor(2.0)), learn_scale=True)


def test_siglip_module_refuses_a_bool_scale_as_clip_does():
    with pytest.raises(ValueError, match="init_scale"):
        fnn.SigLIPLoss(init_scale=True)
    with pytest.raises(ValueError, match="init_bias"):
        fnn.SigLIPLoss(init_bias=False)
    with pytest.raises(ValueError, match="init_temperature"):
        fnn.CLIPLoss(init_temperature=True)


# --- 5: a second backward through a retained graph ---------------------------------------------------------


def _gist(dtype=torch.float32, n=6, d=4):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]
    guide = tuple(torch.randn(n, 3, generator=g, dtype=dtype) for _ in range(3))
    return xs, guide


@pytest.mark.parametrize("how", ["torch", "triton", "triton-panel", "info_nce-guide", "info_nce-ids"])
def test_a_second_backward_through_a_retained_graph_adds_the_same_gradients(how, monkeypatch, route):
    route(DENSE="0")
    dtype = torch.float32
    if how == "triton-panel":  # the guided epilogue route (a summed bf16 loss on CUDA), forced on the interpreter
        route(TRITON_PATH="panel")
        route(PANEL_GEMM="epilogue")
        dtype = torch.bfloat16
    (a, p, n), guide = _gist(dtype)
    backend = "torch" if how.startswith(("torch", "info_nce")) else "triton"
    if how == "info_nce-guide":
        loss = fc.info_nce(a, p, guide=guide[:2], backend=backend)
    elif how == "info_nce-ids":
        loss = fc.info_nce(a, p, ids=(torch.tensor([0, 1, 1, 2, 3, 3]), torch.tensor([0, 1, 2, 2, 3, 4])),
                           backend=backend)
    else:
        loss = fc.gist_loss(a, p, n, guide=guide, backend=backend)
    loss.backward(retain_graph=True)
    (3 * loss).backward()  # (crashed: "not enough values to unpack" / the blocks' contexts already released)
    # the same as one backward of 4 x the loss, computed in float64 by the reference backend
    ref = [x.detach().double().requires_grad_() for x in (a, p, n)]
    g64 = [gg.double() for gg in guide]
    if how == "info_nce-guide":
        want = fc.info_nce(ref[0], ref[1], guide=g64[:2], backend="reference")
    elif how == "info_nce-ids":
        want = fc.info_nce(ref[0], ref[1], ids=(torch.tensor([0, 1, 1, 2, 3, 3]), torch.tensor([0, 1, 2, 2, 3, 4])),
                           backend="reference")
    else:
        want = fc.gist_loss(*ref, guide=tuple(g64), backend="reference")
    (4 * want).backward()
    slack = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for x, r in zip((a, p), ref[:2], strict=True):
        err = (x.grad.double() - r.grad).abs().max()
        assert err <= slack * r.grad.abs().max(), (how, float(err), float(r.grad.abs().max()))


def test_a_second_backward_through_chunked_encoding_with_batchnorm():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    x = torch.randn(16, 4)
    z = fc.encode_in_chunks(enc, x, 4)
    stats = enc[1].running_mean.clone(), enc[1].running_var.clone()
    loss = fc.info_nce(z[:8], z[8:])
    loss.backward(retain_graph=True)
    first = enc[0].weight.grad.clone()
    loss.backward()  # (AttributeError: '_GeneratorContextManager' object has no attribute 'args')
    torch.testing.assert_close(enc[0].weight.grad, 2 * first)
    # the recomputes left the running statistics as the forward did
    assert torch.equal(enc[1].running_mean, stats[0]) and torch.equal(enc[1].running_var, stats[1])


# --- 1, 2, 6, 8: gathered calls on 3 gloo ranks with uneven batches ---------------------------------------


def _gathered_calls(rank: int):
    """(name, call) of each fault: a call every rank makes at the same point (the world is 3)."""
    import numpy as np

    def q(n=3 + rank, d=8, seed=rank):
        return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))

    def maxsim_target():  # 1: rank 1's target is out of range, found only after the gathers
        t = torch.arange(3 + rank) + 3 * rank
        if rank == 1:
            t[0] = 999
        return fc.maxsim.maxsim_info_nce(torch.randn(3 + rank, 3, 8), torch.randn(3 + rank, 4, 8), t, gather=True)

    def info_nce_few_keys():  # 1: fewer global keys than queries with the default target
        return fc.info_nce(q(), torch.randn(1 if rank else 3, 8), gather=True)

    def own_column():  # 9: with keys and exclude_self the own column is the global key qoff + i
        # targets index this rank's keys (as many as its queries here: key i is global column qoff + i)
        t = torch.arange(3 + rank)  # on rank 2 every row names its own (excluded) column
        if rank != 2:
            t = (t + 1) % (3 + rank)  # fine on ranks 0 and 1
        return fc.info_nce(q(), q(seed=10 + rank), t, exclude_self=True, gather=True)

    def nan_rows():  # 2: a NaN in one rank's queries: every rank's loss is NaN, so a guard skips everywhere
        x = q()
        if rank == 1:
            x[0, 0] = float("nan")
        loss = fc.info_nce(x.requires_grad_(), q(seed=20 + rank).requires_grad_(), gather=True)
        if torch.isfinite(loss):
            loss.backward()
        return float(loss)

    def no_grad_rank():  # 2: one rank without a graph: every rank raises in the forward, none waits in backward
        with torch.no_grad() if rank == 2 else torch.enable_grad():
            loss = fc.info_nce(q().requires_grad_(), q(seed=30 + rank).requires_grad_(), gather=True)
        loss.backward()

    def weights_array():  # 6: matryoshka_weights as a NumPy array, different on rank 1
        w = np.array([1.0, 0.5]) if rank != 1 else np.array([1.0, 0.25])
        return fc.info_nce(q(), q(seed=40 + rank), matryoshka_dims=[8, 4], matryoshka_weights=w, gather=True)

    def dims_range():  # 6: matryoshka_dims as a range, different on rank 1
        dims = range(8, 0, -4) if rank != 1 else range(8, 0, -2)
        return fc.info_nce(q(), q(seed=50 + rank), matryoshka_dims=dims, gather=True)

    def cosent_int8():  # 9: integer labels of any width are accepted under gather as locally
        return float(fc.cosent_loss(q(), q(seed=60 + rank), torch.arange(3 + rank, dtype=torch.int8), gather=True))

    return [("cosent_int8", cosent_int8), ("maxsim_target", maxsim_target),
            ("info_nce_few_keys", info_nce_few_keys), ("own_column", own_column), ("nan_rows", nan_rows),
            ("no_grad_rank", no_grad_rank), ("weights_array", weights_array), ("dims_range", dims_range)]


def _maxsim_pairs(rank: int, world: int):
    """8: rank r holds 2 + r queries and 4 - r documents: the gathered loss must equal the single-process one."""
    g = torch.Generator().manual_seed(7)
    nq, nd = [2 + r for r in range(world)], [4 - r for r in range(world)]
    q = torch.randn(sum(nq), 3, 5, generator=g, dtype=torch.float64)
    d = torch.randn(sum(nd), 4, 5, generator=g, dtype=torch.float64)
    qo, do = sum(nq[:rank]), sum(nd[:rank])
    mine = fc.maxsim.maxsim_info_nce(q[qo:qo + nq[rank]], d[do:do + nd[rank]], reduction="none", gather=True)
    want = fc.maxsim.maxsim_info_nce(q, d, reduction="none")[qo:qo + nq[rank]]
    return float((mine - want).abs().max())


def _fault_worker(rank: int, world: int, init: str, out) -> None:


    from tests._ranks import gloo_rank, timed_calls

    # a short process-group timeout: a rank left waiting fails in seconds instead of hanging the suite
    with gloo_rank(rank, world, init, out, timeout=15):
        res = {"rank": rank, "cases": timed_calls(_gathered_calls(rank)), "maxsim_pairs": _maxsim_pairs(rank, world)}
        out.put(res)


def test_faults_after_the_agreement_raise_on_every_rank_promptly(tmp_path):
    from tests._ranks import run_ranks

    results = run_ranks(_fault_worker, 3, tmp_path, timeout=150)
    for res in results:
        c = res["cases"]
        for name in ("maxsim_target", "info_nce_few_keys", "own_column", "no_grad_rank", "weights_array",
                     "dims_range"):
            err, took = c[name]
            assert err is not None, (name, res["rank"], "did not raise")
            assert took < 10, (name, res["rank"], took)  # told, not left waiting for the 15 s timeout
        kind, text, notes = c["maxsim_target"][0]
        assert ("target[0] = 999" in text) if res["rank"] == 1 else ("rank 1" in text and "999" in text)
        assert "fewer keys" in c["info_nce_few_keys"][0][1]
        assert ("own column" in c["own_column"][0][1]) if res["rank"] == 2 else ("rank 2" in c["own_column"][0][1]), \
            (res["rank"], c["own_column"])
        assert "(backward)" in c["no_grad_rank"][0][1] and "rank 2" in c["no_grad_rank"][0][1]
        assert "matryoshka_weights" in c["weights_array"][0][1]
        assert "matryoshka_dims" in c["dims_range"][0][1]
        assert c["cosent_int8"][0] is None, c["cosent_int8"]  # (was "gather_rows: unsupported dtype")
        # a NaN on rank 1 makes every rank's loss NaN: the finite guard skipped the backward on all of them
        err, took = c["nan_rows"]
        assert err is None and took < 10, err
        # 8: queries pair with the documents of their global index
        assert res["maxsim_pairs"] < 1e-12, res


# --- 12: the drop-ins accept what their peers accept --------------------------------------------------------


def test_open_clip_drop_ins_take_a_one_element_logit_scale():
    from fused_contrastive.integrations.open_clip import ClipLoss, SigLipLoss

    a, b = (torch.nn.functional.normalize(x, dim=1) for x in _qk())
    s1 = torch.tensor([14.0], requires_grad=True)  # open_clip's models keep it as a [1] parameter
    loss = ClipLoss()(a, b, s1)
    loss.backward()
    torch.testing.assert_close(loss, fc.clip_loss(a, b, 14.0, normalize=False))
    assert s1.grad is not None and s1.grad.shape == (1,)
    got = SigLipLoss()(a, b, torch.tensor([10.0]), torch.tensor([-10.0]))
    torch.testing.assert_close(got, fc.siglip_loss(a, b, 10.0, -10.0, normalize=False))


def test_siglip_loss_takes_no_bias_as_open_clip_does():
    a, b = _qk()
    torch.testing.assert_close(fc.siglip_loss(a, b, 10.0, None), fc.siglip_loss(a, b, 10.0, 0.0))
    torch.testing.assert_close(fc.siglip_loss(a, b, 10.0), fc.siglip_loss(a, b, 10.0, 0.0))


def test_the_clip_module_takes_matryoshka_levels():
    a, b = _qk(d=8)
    m = fnn.CLIPLoss(matryoshka_dims=[8, 4], matryoshka_weights=[1.0, 0.5])
    torch.testing.assert_close(m(a, b), fc.clip_loss(a, b, 1 / 0.07, matryoshka_dims=[8, 4],
                                                     matryoshka_weights=[1.0, 0.5]))
    with pytest.raises(ValueError, match="matryoshka_dims"):
        fnn.CLIPLoss(matryoshka_dims=[0])


# --- 7: a callable around a module updates BatchNorm statistics once per chunk -------------------------------


@pytest.mark.parametrize("wrap", ["lambda", "partial"])
def test_a_function_around_a_module_updates_running_statistics_once_per_chunk(wrap):
    import functools

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    plain = copy.deepcopy(enc)
    x = torch.randn(16, 4)
    for i in range(0, 16, 4):  # what plain forwards of the chunks do to the statistics
        plain(x[i:i + 4])
    fn = (lambda b: enc(b)) if wrap == "lambda" else functools.partial(enc.forward)
    z = fc.encode_in_chunks(fn, x, 4)
    fc.info_nce(z[:8], z[8:]).backward()  # the backward recomputes every chunk
    assert int(enc[1].num_batches_tracked) == 4  # (was 8: the recomputes updated them again)
    torch.testing.assert_close(enc[1].running_mean, plain[1].running_mean)
    torch.testing.assert_close(enc[1].running_var, plain[1].running_var)


# --- 10: maxsim_info_nce compiles with fullgraph and dynamic shapes -----------------------------------------


def test_maxsim_compiles_whole_with_dynamic_shapes():
    torch._dynamo.reset()
    f = torch.compile(fc.maxsim.maxsim_info_nce, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (3,):  # (failed: math.isqrt of a symbolic size in the chunk plan)
        q = torch.randn(n, 4, 5, dtype=torch.float64, requires_grad=True)
        d = torch.randn(n, 6, 5, dtype=torch.float64, requires_grad=True)
        got = f(q, d)
        gq, = torch.autograd.grad(got, q)
        want = fc.maxsim.maxsim_info_nce(q, d, backend="reference")
        wq, = torch.autograd.grad(want, q)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gq, wq)


# --- 9: clear and consistent errors ----------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda a, b: fc.clip_loss(a, b, 10.0), lambda a, b: fc.siglip_loss(a, b, 10.0, -10.0),
    lambda a, b: fc.simcse_loss(a, b), lambda a, b: fc.dcl_loss(a, b),
    lambda a, b: fc.cosent_loss(a, b, torch.arange(6.0)), lambda a, b: fc.info_nce(a, b),
    lambda a, b: fc.gist_loss(a, b, guide=(torch.randn(6, 3), torch.randn(6, 3))),
], ids=["clip", "siglip", "simcse", "dcl", "cosent", "info_nce", "gist"])
def test_float64_beside_a_lower_precision_raises_in_every_loss(call):
    a, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4)
    with pytest.raises(TypeError, match="float64"):  # (clip, siglip, ... promoted silently; info_nce raised)
        call(a, b)


def test_guide_parts_in_different_dtypes_compute_in_the_widest():
    g = torch.Generator().manual_seed(2)
    a, p, n = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    guide = [torch.randn(6, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    want = fc.gist_loss(a, p, n, guide=tuple(guide))
    mixed = (guide[0].float(), guide[1], guide[2].float())  # (a raw matmul dtype error)
    torch.testing.assert_close(fc.gist_loss(a, p, n, guide=mixed), want, rtol=1e-6, atol=1e-6)


def test_a_one_row_chunk_under_batchnorm_names_the_chunking():
    enc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with pytest.raises(ValueError, match="chunk of 1 row.*chunk_size"):
        fc.encode_in_chunks(enc, torch.randn(9, 4), 4)


def test_the_backend_environment_is_part_of_a_gathered_call():
    from fused_contrastive.distributed import _Binder, _Digest

    def loss(x, *, gather=False):
        return x

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSED_CONTRASTIVE_BACKEND", "torch")
        a = _Digest("loss", _Binder(loss), (torch.ones(2),), {})
        mp.delenv("FUSED_CONTRASTIVE_BACKEND")
        b = _Digest("loss", _Binder(loss), (torch.ones(2),), {})
    # two ranks, one with the variable set: their digests differ, and the error names the variable
    assert a.head != b.head and "(FUSED_CONTRASTIVE_BACKEND)" in a.args


@pytest.mark.parametrize("cls,args,t0", [(fnn.InfoNCELoss, (), 0.05), (fnn.SupConLoss, (0.1,), 0.1),
                                         (fnn.SimCSELoss, (), 0.05), (fnn.DCLLoss, (0.2,), 0.2)])
def test_learn_temperature_makes_the_module_own_it(cls, args, t0):
    m = cls(*args, learn_temperature=True)
    assert [n for n, _ in m.named_parameters()] == ["log_temperature"]
    assert float(m.log_temperature.exp()) == pytest.approx(t0)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 2, 4, generator=g) if cls is fnn.SupConLoss else torch.randn(8, 4, generator=g)
    inputs = (x, torch.tensor([0, 1, 0, 1, 2, 2])) if cls is fnn.SupConLoss else \
        (x[:4], x[4:]) if cls in (fnn.InfoNCELoss, fnn.DCLLoss) else (x,)
    fixed = cls(*(args or ()), **({} if args else {"temperature": t0}))
    loss = m(*inputs)
    torch.testing.assert_close(loss, fixed(*inputs))
    loss.backward()
    assert m.log_temperature.grad is not None and m.log_temperature.grad != 0
    with pytest.raises(ValueError, match="learn_temperature"):
        cls(nn.Parameter(torch.tensor(0.1)), learn_temperature=True)
