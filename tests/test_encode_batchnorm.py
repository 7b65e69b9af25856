"""encode_in_chunks with normalisation layers that keep running statistics (issue 39): the backward's
recompute of each chunk must not update them a second time. The oracle is plain forwards of the same
chunks (one after another, one graph): same embeddings, same gradients, same running statistics and
``num_batches_tracked``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fused_contrastive as fc
from tests._ranks import gloo_rank


def _net(norm: str, momentum) -> nn.Module:
    torch.manual_seed(0)
    if norm == "bn1d":
        layers = [nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(), nn.Dropout(0.2),
                  nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Linear(8, 5)]
        return nn.Sequential(*layers).double()
    if norm == "bn2d":
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                             nn.Flatten(), nn.Linear(4 * 5 * 5, 5)).double()
    # InstanceNorm with running statistics writes its buffers whenever it gets them
    return nn.Sequential(nn.Unflatten(1, (2, 3)), nn.InstanceNorm1d(2, momentum=momentum, track_running_stats=True),
                         nn.Flatten(), nn.Linear(6, 5)).double()


def _batch(norm: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    shape = (n, 2, 5, 5) if norm == "bn2d" else (n, 6)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _stats(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()
            if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cumulative"])
@pytest.mark.parametrize("norm", ["bn1d", "bn2d", "instancenorm"])
@pytest.mark.parametrize("bound_method", [False, True], ids=["module", "bound_method"])
def test_running_statistics_as_plain_chunk_forwards(norm, momentum, bound_method):
    n, c = 22, 4  # 6 chunks, the last of 2 rows
    model = _net(norm, momentum)
    plain = copy.deepcopy(model)
    x = _batch(norm, n)
    w = torch.randn(n, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    torch.manual_seed(3)
    enc = model.forward if bound_method else model
    got = fc.encode_in_chunks(enc, x, c)
    (got * w).sum().backward()

    torch.manual_seed(3)  # the same RNG stream: the same dropout masks
    want = torch.cat([plain(x[i:i + c]) for i in range(0, n, c)])
    (want * w).sum().backward()

    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
    s_got, s_want = _stats(model), _stats(plain)
    assert s_got.keys() == s_want.keys() and s_got
    for k in s_want:
        assert torch.allclose(s_got[k], s_want[k], rtol=1e-12, atol=1e-14), (k, s_got[k], s_want[k])
    if norm != "instancenorm":  # InstanceNorm does not count its batches
        assert all(int(v) == 6 for k, v in s_got.items() if k.endswith("num_batches_tracked")), s_got


def test_eval_mode_and_no_grad_leave_statistics_alone():
    model = _net("bn1d", 0.1)
    x = _batch("bn1d", 10)
    before = _stats(model)
    model.eval()
    out = fc.encode_in_chunks(model, x, 3)
    out.sum().backward()
    assert all(torch.equal(before[k], v) for k, v in _stats(model).items())
    model.train()
    with torch.no_grad():  # no recompute: one forward per chunk
        fc.encode_in_chunks(model, x, 4)
    assert all(int(v) == 3 for k, v in _stats(model).items() if k.endswith("num_batches_tracked"))


def test_a_failed_recompute_still_puts_the_statistics_back():
    """An exception inside the recompute (here: the encoder raising on its second run) still restores
    the running statistics the forward left."""
    model = _net("bn1d", 0.1)
    calls = []

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("boom")
            return self.m(x)

    out = fc.encode_in_chunks(Flaky(), _batch("bn1d", 8), 4)
    after_forward = _stats(model)
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    assert all(torch.equal(after_forward[k], v) for k, v in _stats(model).items())
    assert all(int(v) == 2 for k, v in after_forward.items() if k.endswith("num_batches_tracked"))


def _ddp_worker(rank: int, world: int, init: str, out) -> None:


    with gloo_rank(rank, world, init, out, timeout=30):
        rows = [12, 7][rank]  # chunk_size 4: rank 0 runs 3 chunks of 4, rank 1 is re-split to 3 + 2 + 2
        model = _net("bn1d", 0.1)
        model[3].p = 0.0  # no dropout: the two runs need no common RNG stream
        plain = copy.deepcopy(model)
        x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
        sizes = []
        model[0].register_forward_hook(lambda m, i, o: sizes.append(i[0].shape[0]))
        ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=True)
        ddp_plain = nn.parallel.DistributedDataParallel(plain, broadcast_buffers=True)
        got = fc.encode_in_chunks(ddp, x, 4)
        got.square().sum().backward()
        bounds = [0, 4, 8, 12] if rank == 0 else [0, 3, 5, 7]
        want = torch.cat([ddp_plain(x[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)])
        want.square().sum().backward()
        s_got, s_want = _stats(model), _stats(plain)
        out.put({"rank": rank, "sizes": sizes,
                 "out": bool(torch.allclose(got, want, rtol=1e-12, atol=1e-12)),
                 "grads": all(torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)
                              for p, q in zip(model.parameters(), plain.parameters(), strict=True)),
                 "stats": all(torch.allclose(s_got[k], s_want[k], rtol=1e-12, atol=1e-14) for k in s_want),
                 "tracked": sorted({int(v) for k, v in s_got.items() if k.endswith("num_batches_tracked")})})


def test_ddp_broadcast_buffers_resplit_and_statistics(tmp_path):
    """DDP with ``broadcast_buffers=True`` (2 gloo ranks, 12 and 7 rows, ``chunk_size=4``): every rank
    runs 3 chunks, the smaller one re-split to 3 + 2 + 2 rows; embeddings, gradients and running
    statistics equal plain DDP forwards of the same chunks, 3 batches tracked (not 6)."""
    from tests._ranks import run_ranks

    for res in run_ranks(_ddp_worker, 2, tmp_path, timeout=120):
        want = [4, 4, 4] if res["rank"] == 0 else [3, 2, 2]
        assert res["sizes"] == want + want[::-1], res  # the forwards, then the recomputes in reverse
        assert res["out"] and res["grads"] and res["stats"] and res["tracked"] == [3], res
