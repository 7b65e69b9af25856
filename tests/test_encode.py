"""encode_in_chunks: exact gradients with dropout replayed, one chunk of activations, DDP and gradient
accumulation. The oracle of each test is the same chunks encoded one after another with a full
autograd graph from the same seed (the same RNG stream, hence the same dropout masks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fused_contrastive as fc
from fused_contrastive import encode_in_chunks

N, L, F, D, FF = 256, 8, 16, 32, 64  # batch, sequence length, input features, model width, FFN width


class Encoder(nn.Module):
    """A small transformer sentence encoder with dropout 0.1: tokens [n, L, F] (+ optional padding
    mask) -> mean-pooled [n, D]."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.inp = nn.Linear(F, D)
        layer = nn.TransformerEncoderLayer(D, 4, FF, dropout=dropout, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, batch):
        if isinstance(batch, dict):
            h = self.body(self.inp(batch["tokens"]), src_key_padding_mask=batch["pad"])
            keep = (~batch["pad"]).to(h.dtype)[..., None]
            return (h * keep).sum(1) / keep.sum(1)
        return self.body(self.inp(batch)).mean(1)


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, L, F, generator=g, dtype=dtype)
    return x, torch.randint(0, 20, (N,), generator=g)


def _by_chunks(encoder, batch, c):
    """The oracle's encoding: the chunks one after another, full graph."""
    if isinstance(batch, dict):
        return torch.cat([encoder({k: v[i:i + c] for k, v in batch.items()}) for i in range(0, N, c)])
    n = batch.shape[0]
    return torch.cat([encoder(batch[i:i + c]) for i in range(0, n, c)])


def _step(params, loss_fn, encode, seed=1):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = loss_fn(encode)
    loss.backward()
    return loss.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def _losses(enc, enc2, logit_scale, x, labels):
    """loss_fn(encode) per loss of the issue; ``encode(module, batch)`` -> [n, D]."""
    half = N // 2
    return {
        "simcse_interleaved": lambda e: fc.simcse_loss(e(enc, x[:half].repeat_interleave(2, 0))),
        "simcse_two_view": lambda e: fc.simcse_loss(e(enc, x), e(enc, x)),
        "info_nce_hard_negatives": lambda e: fc.info_nce(
            e(enc, x[:half]), torch.cat([e(enc, x[half:]), e(enc, x[:half].flip(1))]),
            torch.arange(half)),
        "supcon": lambda e: fc.supcon_loss(torch.stack([e(enc, x), e(enc, x)], dim=1), labels),
        "clip_learnable_scale": lambda e: fc.clip_loss(e(enc, x), e(enc2, x.flip(1)), logit_scale.exp()),
    }


LOSSES = ["simcse_interleaved", "simcse_two_view", "info_nce_hard_negatives", "supcon", "clip_learnable_scale"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [64, 48])  # divides the batch, and does not
@pytest.mark.parametrize("loss", LOSSES)
def test_gradients_equal_the_chunks_with_full_graph(loss, chunk, dtype):
    torch.manual_seed(0)
    enc, enc2 = Encoder().to(dtype), Encoder().to(dtype)
    logit_scale = nn.Parameter(torch.tensor(2.0, dtype=dtype))
    params = [*enc.parameters(), *enc2.parameters(), logit_scale]
    x, labels = _data(dtype)
    fn = _losses(enc, enc2, logit_scale, x, labels)[loss]
    want_loss, want = _step(params, fn, lambda m, b: _by_chunks(m, b, chunk))
    got_loss, got = _step(params, fn, lambda m, b: encode_in_chunks(m, b, chunk))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_loss, want_loss, **tol)
    used = [i for i, g in enumerate(want) if g.abs().sum() > 0]
    assert len(used) >= len(list(enc.parameters())) - 1  # the loss reaches the encoder (not vacuous)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"parameter {i}: {m}")


def test_dict_inputs():
    torch.manual_seed(0)
    enc = Encoder()
    x, _ = _data(torch.float32)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[::3, 5:] = True  # some padded sequences
    batch = {"tokens": x, "pad": pad}
    params = list(enc.parameters())

    def fn(e):
        return fc.simcse_loss(e(enc, batch), e(enc, batch))

    _, want = _step(params, fn, lambda m, b: _by_chunks(m, b, 48))
    _, got = _step(params, fn, lambda m, b: encode_in_chunks(m, b, 48))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_dropout_equals_the_full_batch(dtype):
    torch.manual_seed(0)
    enc = Encoder().to(dtype).eval()  # dropout off
    x, labels = _data(dtype)
    params = list(enc.parameters())

    def fn(e):
        return fc.supcon_loss(torch.stack([e(enc, x), e(enc, x.flip(1))], dim=1), labels)

    want_loss, want = _step(params, fn, lambda m, b: m(b))
    got_loss, got = _step(params, fn, lambda m, b: encode_in_chunks(m, b, 40))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_loss, want_loss, **tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)


def test_rng_replay_is_necessary():
    """Without the replay the backward's dropout masks differ from the forward's: the gradients are
    wrong by far more than round-off. (So the equality above proves the replay is present.)"""
    torch.manual_seed(0)
    enc = Encoder()
    x, _ = _data(torch.float32)
    params = list(enc.parameters())

    def fn(e):
        return fc.simcse_loss(e(enc, x[:128].repeat_interleave(2, 0)))

    _, want = _step(params, fn, lambda m, b: _by_chunks(m, b, 64))
    _, bad = _step(params, fn, lambda m, b: encode_in_chunks(m, b, 64, preserve_rng_state=False))
    rel = max(float((g - w).norm() / w.norm()) for g, w in zip(bad, want, strict=True) if w.norm() > 0)
    assert rel > 1e-2, rel


def test_gradient_accumulation():
    torch.manual_seed(0)
    enc = Encoder()
    x, _ = _data(torch.float32)
    params = list(enc.parameters())

    def accumulate(encode):
        for p in params:
            p.grad = None
        for k, seed in ((0, 1), (1, 2)):  # two micro-batches, gradients summed
            torch.manual_seed(seed)
            part = x[k * 128:(k + 1) * 128]
            fc.simcse_loss(encode(enc, part), encode(enc, part)).backward()
        return [p.grad.clone() for p in params]

    want = accumulate(lambda m, b: _by_chunks(m, b, 32))
    got = accumulate(lambda m, b: encode_in_chunks(m, b, 32))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


class _Largest(TorchDispatchMode):
    """Records the largest tensor (elements) any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(fn) -> int:
    with _Largest() as rec:
        fn()
    return rec.largest


def test_activation_memory_scales_with_the_chunk(monkeypatch, route):
    """The largest tensor of a cached step is that of one chunk's ordinary step (or of the loss on the
    [N, D] embeddings), not of the batch: with 8 chunks it is several times smaller."""
    route(TILE_ELEMENTS="4096")  # the loss's own tiles stay small
    torch.manual_seed(0)
    enc = Encoder()
    x, _ = _data(torch.float32)
    c = 32

    def loss_of(z):
        return fc.simcse_loss(z[: N // 2], z[N // 2:])

    cached = _largest(lambda: loss_of(encode_in_chunks(enc, x, c)).backward())
    full = _largest(lambda: loss_of(enc(x)).backward())
    one_chunk = _largest(lambda: enc(x[:c]).sum().backward())
    z = enc(x).detach().requires_grad_()
    loss_only = _largest(lambda: loss_of(z).backward())
    assert cached <= max(one_chunk, loss_only), (cached, one_chunk, loss_only)
    assert full >= 4 * cached, (full, cached)


def test_ddp_all_reduces_once_per_step(tmp_path):
    """Under DDP the chunks' parameter gradients are summed by autograd before DDP sees them: one
    all-reduce per bucket per step, as without chunks (gloo, one process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(Encoder())
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        x, _ = _data(torch.float32)
        per_step = []
        for encode in (lambda b: ddp(b), lambda b: encode_in_chunks(ddp, b, 32)):  # 4 chunks per call
            calls.clear()
            torch.manual_seed(1)
            fc.simcse_loss(encode(x[:128]), encode(x[:128])).backward()
            assert calls and len(calls) == len(set(calls)), calls  # each bucket once
            per_step.append(sorted(calls))
        assert per_step[0] == per_step[1], per_step
    finally:
        dist.destroy_process_group()


def test_no_grad_and_errors():
    torch.manual_seed(0)
    enc = Encoder().eval()
    x, _ = _data(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(encode_in_chunks(enc, x, 100), enc(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_size"):
        encode_in_chunks(enc, x, 0)
    with pytest.raises(TypeError, match="chunk_size"):
        encode_in_chunks(enc, x, 2.0)
    with pytest.raises(ValueError, match="dim 0"):
        encode_in_chunks(lambda b: b["a"], {"a": x, "b": x[:3]}, 4)
    with pytest.raises(TypeError, match="embeddings tensor"):
        encode_in_chunks(lambda b: (b.mean(1),), x, 64)


def test_autocast_state_is_replayed():
    """Under CPU autocast (bfloat16) the recomputed chunks run in the same autocast state as their
    first run: the gradients equal the chunk-by-chunk oracle's under the same autocast."""
    torch.manual_seed(0)
    enc = Encoder()
    x, _ = _data(torch.float32)
    params = list(enc.parameters())

    def fn(e):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = e(enc, x[:128].repeat_interleave(2, 0))
        assert z.dtype == torch.bfloat16  # the encoder did run under autocast
        return fc.simcse_loss(z)

    _, want = _step(params, fn, lambda m, b: _by_chunks(m, b, 64))
    _, got = _step(params, fn, lambda m, b: encode_in_chunks(m, b, 64))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
