"""The core op's contract (``core/spec.py``) on both torch paths against a naive materialised
computation written here from the definitions, in float64: every statistic, per-row and summed
output, tensor and number coefficients and scales, anchors as a slice of the contrast set, bias
columns, label and tiled-mask positives, queue columns and raw (unnormalised) rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_contrastive import core
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec
from fused_contrastive.testing import assert_close


def naive(a, b, s, spec, data, coef, reduce):
    """Materialised logits -> the per-row loss of the contract (or its sum), differentiable."""
    ah = F.normalize(a, dim=1, eps=spec.eps) if spec.normalize else a
    bh = ah if b is None else (F.normalize(b, dim=1, eps=spec.eps) if spec.normalize else b)
    n, m = ah.shape[0], bh.shape[0]
    l = s * (ah @ bh.T)
    if data.bias_col is not None:
        l = l + spec.bias * F.one_hot(data.bias_col, m).to(l.dtype)
    own = torch.zeros(n, m, dtype=torch.bool)
    if spec.exclude_self:
        own = torch.arange(m)[None, :] == (torch.arange(n) + spec.offset)[:, None]
        l = l.masked_fill(own, float("-inf"))
    if data.pos_mask is not None:
        n0, m0 = data.pos_mask.shape
        w = data.pos_mask[torch.arange(n)[:, None] % n0, torch.arange(m)[None, :] % m0].to(l.dtype)
    elif data.row_labels is not None:
        w = (data.row_labels[:, None] == data.col_labels[None, :]).to(l.dtype)
    else:
        w = torch.zeros_like(l)
    w = w.masked_fill(own, 0.0)
    l_tgt = l.gather(1, data.target[:, None])[:, 0] if data.target is not None else None
    if spec.exclude_target:  # out of every log-sum-exp; the target term keeps the logit read above
        l = l.masked_fill(torch.arange(m)[None, :] == data.target[:, None], float("-inf"))

    def term(c, v):
        c = torch.as_tensor(c, dtype=v.dtype).expand_as(v)
        return torch.where(c != 0, c * v, torch.zeros_like(v))

    rows = term(coef.lse, torch.logsumexp(l, dim=1))
    cols = term(coef.col, torch.logsumexp(l, dim=0)) if coef.col is not None else None
    if coef.pos is not None:
        rows = rows + term(coef.pos, torch.logsumexp(l + torch.log(w), dim=1))
    if coef.tgt is not None:
        rows = rows - term(coef.tgt, l_tgt)
    if coef.set is not None:
        rows = rows - term(coef.set, (w * torch.where(w != 0, l, torch.zeros_like(l))).sum(dim=1))
    if not reduce:
        return rows + cols if cols is not None else rows
    return rows.sum() + (cols.sum() if cols is not None else 0.0)


def _grads(fn, leaves, out_args, upstream):
    for x in leaves:
        x.grad = None
    out = fn(*out_args)
    total = out if out.dim() == 0 else (out * upstream).sum()
    total.backward()
    return out.detach(), [x.grad.clone() if x.grad is not None else None for x in leaves]


def _compare(make, upstream, path):
    """Run the problem from ``make()`` through core.run and through the naive formula; compare."""
    got_leaves, got_args = make()
    want_leaves, want_args = make()
    got = _grads(lambda *args: core.run("torch", *args), got_leaves, got_args, upstream)
    want = _grads(naive, want_leaves, want_args, upstream)
    assert_close(got[0], want[0], atol=1e-10, rtol=1e-10, what=f"{path}: output")
    for i, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        assert (g is None) == (w is None), f"{path}: gradient {i} presence"
        if g is not None:
            assert_close(g, w, atol=1e-10, rtol=1e-9, what=f"{path}: gradient {i}")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("tensor_coef", [True, False])
def test_cross_entropy_with_ignored_rows(path, reduce, tensor_coef):
    n, m, d = 13, 21, 6
    target = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(1))

    def make():
        a, b = _rand(n, d, seed=2).requires_grad_(), _rand(m, d, seed=3).requires_grad_()
        s = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
        w = (torch.arange(n) % 4 != 0).double() * 0.7 if tensor_coef else 0.5
        return [a, b, s], [a, b, s, CoreSpec(), CoreData(target=target), Coeffs(lse=w, tgt=w), reduce]

    _compare(make, _rand(n, seed=4), path)


@pytest.mark.parametrize("positives", ["labels", "mask"])
def test_b_is_a_every_row_statistic(path, positives):
    # B is A (the symmetric path), own column excluded, all row statistics with mixed-sign coefficients
    n, d = 17, 5
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 4, (n,), generator=g)
    data = CoreData(target=(torch.arange(n) + 1) % n, row_labels=labels, col_labels=labels) \
        if positives == "labels" else CoreData(target=(torch.arange(n) + 1) % n,
                                               pos_mask=torch.rand(6, 6, generator=g, dtype=torch.float64))

    def make():
        a = _rand(n, d, seed=6).requires_grad_()
        coef = Coeffs(lse=_rand(n, seed=7).abs(), pos=-_rand(n, seed=8).abs(), tgt=0.3, set=_rand(n, seed=9))
        return [a], [a, None, 3.0, CoreSpec(exclude_self=True), data, coef, False]

    _compare(make, _rand(n, seed=10), path)


@pytest.mark.parametrize("offset", [0, 5, 17])
def test_anchors_a_slice_of_the_contrast_set(path, offset):
    # A = B[offset : offset + N] as a view (the dense path shares B's rows), own column at offset + i,
    # a column term, a bias column, label positives; summed output
    m, n, d = 30, 13, 6
    g = torch.Generator().manual_seed(offset)
    labels = torch.randint(0, 3, (m,), generator=g)
    bias_col = torch.randint(0, m, (n,), generator=g)

    def make():
        b = _rand(m, d, seed=11).requires_grad_()
        s = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
        spec = CoreSpec(exclude_self=True, offset=offset, bias=0.7)
        data = CoreData(target=(torch.arange(n) + offset + 1) % m, bias_col=bias_col,
                        row_labels=labels[offset:offset + n], col_labels=labels)
        coef = Coeffs(lse=1.0, col=_rand(m, seed=12).abs(), pos=-0.5, tgt=0.25, set=_rand(n, seed=13))
        return [b, s], [b[offset:offset + n], b, s, spec, data, coef, True]

    _compare(make, None, path)


def test_queue_columns_get_no_gradient(path):
    n, k, d = 9, 7, 5
    g = torch.Generator().manual_seed(14)
    labels = torch.randint(0, 3, (n + k,), generator=g)
    queue = _rand(k, d, seed=15)

    def make():
        a = _rand(n, d, seed=16).requires_grad_()
        b = torch.cat([a, queue])  # gradient flows to a only, through both roles
        data = CoreData(row_labels=labels[:n], col_labels=labels)
        coef = Coeffs(lse=1.0, set=_rand(n, seed=17))
        return [a], [a, b, 6.0, CoreSpec(exclude_self=True, grad_cols=n), data, coef, True]

    _compare(make, None, path)


def test_raw_rows_and_zero_rows(path):
    # normalize=False (raw dot products), and with normalisation a zero row and a tiny row whose
    # norm is clamped to eps (its gradient is g / eps, without the projection)
    n, d = 11, 4

    def make_raw():
        a, b = (_rand(n, d, seed=18) * 0.3).requires_grad_(), (_rand(n, d, seed=19) * 0.3).requires_grad_()
        return [a, b], [a, b, 1.5, CoreSpec(normalize=False), CoreData(target=torch.arange(n)),
                        Coeffs(lse=1.0, tgt=1.0), False]

    _compare(make_raw, _rand(n, seed=20), path)

    def make_tiny():
        a0, b = _rand(n, d, seed=21), _rand(n, d, seed=22).requires_grad_()
        a0[2], a0[3] = 0.0, 1e-14
        a = a0.requires_grad_()
        return [a, b], [a, b, 2.0, CoreSpec(), CoreData(target=torch.arange(n)), Coeffs(lse=1.0, tgt=1.0), True]

    _compare(make_tiny, None, path)


def test_a_row_with_every_column_excluded_is_minus_inf_without_nan(path):
    # N = M = 1 with the own column excluded: LSE = -inf; a zero coefficient drops it, gradient 0
    a = _rand(1, 5, seed=23).requires_grad_()
    s = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    out = core.run("torch", a, None, s, CoreSpec(exclude_self=True), CoreData(), Coeffs(lse=0.0), False)
    assert out.item() == 0.0
    out.sum().backward()
    assert torch.equal(a.grad, torch.zeros_like(a)) and s.grad.item() == 0.0


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("same", [False, True])
def test_exclude_target_reads_the_target_then_leaves_it_out(path, reduce, same):
    """CoreSpec.exclude_target (DCL's "positive in the numerator only") with targets that are no
    involution, a column term (B != A) and tensor coefficients; B is A with its own column excluded."""
    n, m = (9, 9) if same else (9, 13)
    g = torch.Generator().manual_seed(30)
    target = torch.randint(0, m, (n,), generator=g)
    if same:
        target = torch.where(target == torch.arange(n), (target + 1) % n, target)
    c = torch.rand(n, generator=g, dtype=torch.float64) + 0.5

    def make():
        a = _rand(n, 6, seed=31).requires_grad_()
        b = None if same else _rand(m, 6, seed=32).requires_grad_()
        s = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
        spec = CoreSpec(exclude_self=same, exclude_target=True)
        coef = Coeffs(lse=c, tgt=c * 0.7) if same or not reduce else Coeffs(lse=c, col=0.25, tgt=c * 0.7)
        leaves = [a, s] if same else [a, b, s]
        return leaves, (a, b, s, spec, CoreData(target=target), coef, reduce)

    _compare(make, None if reduce else _rand(n, seed=33), path)


def test_exclude_target_needs_a_target_and_no_bias():
    a = _rand(4, 3, seed=1)
    with pytest.raises(ValueError, match="exclude_target needs CoreData.target"):
        core.run("torch", a, None, 1.0, CoreSpec(exclude_target=True), CoreData(), Coeffs(lse=1.0), True)
    with pytest.raises(ValueError, match="bias column"):
        core.run("torch", a, a, 1.0, CoreSpec(exclude_target=True, bias=0.5),
                 CoreData(target=torch.arange(4), bias_col=torch.arange(4)), Coeffs(lse=1.0), True)

