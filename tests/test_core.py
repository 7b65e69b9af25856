"""The core op itself (``_spec.py`` contract) on the torch backend against a naive materialised
computation: anchors as a slice of the contrast set at an offset, bias columns, dense masks, and
every output in vector mode with arbitrary upstream gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_contrastive import _torch_core
from fused_contrastive._spec import CoreSpec, CoreTensors
from helpers import assert_close


def naive(a, b, s, spec, t):
    """Materialised logits -> (LSE, LSEcol, LSEpos), differentiable, float64."""
    ah = F.normalize(a, dim=1, eps=spec.eps) if spec.normalize else a
    bh = ah if b is None else (F.normalize(b, dim=1, eps=spec.eps) if spec.normalize else b)
    n, m = ah.shape[0], bh.shape[0]
    l = s * (ah @ bh.T)
    if t.bias_col is not None:
        l = l + spec.bias * F.one_hot(t.bias_col, m).to(l.dtype)
    if spec.exclude_self:
        own = torch.arange(m)[None, :] == (torch.arange(n) + spec.offset)[:, None]
        l = l.masked_fill(own, float("-inf"))
    lse = torch.logsumexp(l, dim=1)
    lse_col = torch.logsumexp(l, dim=0) if spec.want_col else None
    lse_pos = None
    if spec.want_pos:
        if t.pos_mask is not None:
            n0, m0 = t.pos_mask.shape
            w = t.pos_mask[torch.arange(n)[:, None] % n0, torch.arange(m)[None, :] % m0]
        else:
            w = (t.row_labels[:, None] == t.col_labels[None, :]).to(l.dtype)
        lse_pos = torch.logsumexp(l + torch.log(w), dim=1)
    return lse, lse_col, lse_pos


@pytest.mark.parametrize("offset", [0, 5, 17])
@pytest.mark.parametrize("pos", ["labels", "mask"])
@pytest.mark.parametrize("tile", ["50", "1000000"])
def test_slice_at_offset_vector_mode(offset, pos, tile, monkeypatch):
    monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", tile)
    g = torch.Generator().manual_seed(offset)
    m, n, d = 30, 13, 6
    b = torch.randn(m, d, generator=g, dtype=torch.float64)
    spec = CoreSpec(exclude_self=True, offset=offset, want_pos=True, want_col=True)
    labels = torch.randint(0, 3, (m,), generator=g)
    t = CoreTensors(row_labels=labels[offset:offset + n], col_labels=labels) if pos == "labels" else \
        CoreTensors(pos_mask=torch.rand(7, 10, generator=g, dtype=torch.float64))
    s = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    bb = b.clone().requires_grad_()
    upstream = [torch.randn(k, generator=g, dtype=torch.float64) for k in (n, m, n)]

    def grads(fn):
        for x in (bb, s):
            x.grad = None
        outs = fn(bb[offset:offset + n], bb, s, spec, t)
        total = sum((o * u).nan_to_num(neginf=0.0).sum() for o, u in zip(outs, upstream))
        total.backward()
        return [o.detach() for o in outs], bb.grad.clone(), s.grad.clone()

    got, gb, gs = grads(_torch_core.core)
    want, wb, ws = grads(naive)
    for x, y, name in zip(got, want, ["LSE", "LSEcol", "LSEpos"]):
        assert_close(x, y, atol=1e-10, what=name)
    assert_close(gb, wb, atol=1e-10, what="dB")
    assert_close(gs, ws, atol=1e-10, what="ds")


def test_bias_column_and_queue_grad_cols():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(20, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias_col = torch.randint(0, 20, (9,), generator=g)
    spec = CoreSpec(bias=0.7, grad_cols=12)
    t = CoreTensors(bias_col=bias_col)
    s = torch.tensor(5.0, dtype=torch.float64)
    lse, _, _ = _torch_core.core(a, b, s, spec, t)
    want, _, _ = naive(a, b, s, spec, t)
    assert_close(lse, want, atol=1e-12, what="LSE")
    lse.sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    want.sum().backward()
    assert_close(ga, a.grad, atol=1e-12, what="dA")
    assert_close(gb[:12], b.grad[:12], atol=1e-12, what="dB (grad columns)")
    assert (gb[12:] == 0).all(), "columns past grad_cols get no gradient"
