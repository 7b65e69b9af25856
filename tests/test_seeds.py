"""Parity with the seed documents' formulas, the textbook formulas and the peers
(``fused_contrastive.testing.baselines``: written once, shared with the benchmark), and with
SupContrast's semantics (max shift, 1e-30 fudge, zero-positive anchors, contrast_mode); plus
definitions written out here as loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from fused_contrastive.testing import BASELINES, CASE_BY_NAME, assert_close, make_inputs
from fused_contrastive.testing import baselines as B
from fused_contrastive.testing.accuracy import run

BACKENDS = ["torch", "reference"]
PAIRS = [(case, b) for case, bl in BASELINES.items() for b in bl]


@pytest.mark.parametrize("case,baseline", PAIRS, ids=[f"{c}-{b.name}" for c, b in PAIRS])
def test_every_baseline_equals_the_loss(case, baseline):
    """Each benchmark contender computes the same loss as this library (so the benchmark compares
    like with like): forward value and input gradients against the torch backend, float64."""
    if (why := B.available(baseline)) is not None:
        pytest.skip(why)  # only a peer package that is not installed (the test extra installs it)
    c = CASE_BY_NAME[case]
    tensors, kwargs = make_inputs(c, 24, 16, seed=3)
    want_loss, want_grads = run(c, (tensors, kwargs), "torch", torch.float64)
    x = {k: v.double().requires_grad_() for k, v in tensors.items()}
    got = baseline.fn({**x, **kwargs})
    got.backward()
    assert_close(got, want_loss, atol=1e-9, rtol=1e-9, what=f"{baseline.name} loss")
    for k, v in x.items():
        assert_close(v.grad, want_grads[k], atol=1e-9, rtol=1e-7, what=f"{baseline.name} grad {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 8, 64])
def test_simcse_unsup_seeds(backend, n):
    z = torch.randn(n, 32, generator=torch.Generator().manual_seed(n))
    got = fc.simcse_loss(z, backend=backend)
    assert_close(got, B.seed_simcse_unsup(z), atol=2e-5, rtol=1e-5, what="seeds 000/002")
    assert_close(got, B.seed_keras_simcse(z), atol=2e-5, rtol=1e-5, what="seed 004")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 5, 32])
def test_simcse_sup_seed(backend, b):
    z = torch.randn(3 * b, 16, generator=torch.Generator().manual_seed(b))
    assert_close(fc.simcse_sup_loss(z, backend=backend), B.seed_simcse_sup(z), atol=2e-5, rtol=1e-5, what="sup")


def test_simcse_sup_hard_negative_weight_is_added_to_own_negative_logit():
    g = torch.Generator().manual_seed(1)
    a, p, n = (torch.randn(6, 8, generator=g) for _ in range(3))
    w = 0.7
    def cos(x, y):
        return F.cosine_similarity(x[:, None], y[None, :], dim=-1)

    logits = torch.cat([cos(a, p) / 0.05, cos(a, n) / 0.05 + w * torch.eye(6)], dim=1)
    want = F.cross_entropy(logits, torch.arange(6))
    for be in BACKENDS:
        assert_close(fc.simcse_sup_loss(a, p, n, hard_negative_weight=w, backend=be), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["all", "one"])
@pytest.mark.parametrize("kind", ["labels", "mask", "simclr", "zero_positive"])
def test_supcontrast_parity(backend, mode, kind):
    g = torch.Generator().manual_seed(7)
    bsz = 12
    feats = F.normalize(torch.randn(bsz, 2 if kind != "zero_positive" else 1, 16, generator=g), dim=-1)
    labels = mask = None
    if kind == "labels":
        labels = torch.randint(0, 4, (bsz,), generator=g)
    elif kind == "mask":
        mask = (torch.rand(bsz, bsz, generator=g) < 0.4).float()  # asymmetric on purpose
    elif kind == "zero_positive":
        labels = torch.tensor([0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8])  # singletons: no positive, loss 0
    want = B.supcontrast(feats, labels=labels, mask=mask, contrast_mode=mode)
    got = fc.supcon_loss(feats, labels, mask, contrast_mode=mode, backend=backend)
    assert_close(got, want, atol=1e-5, rtol=1e-5, what=f"supcon {kind} {mode}")


def test_supcon_zero_positive_anchor_contributes_zero():
    feats = torch.randn(3, 1, 5, generator=torch.Generator().manual_seed(0))
    per = fc.supcon_loss(feats, torch.tensor([0, 1, 1]), reduction="none", backend="torch")
    assert per[0] == 0
    # anchors 1 and 2 have each other as their one positive: -log softmax over the other two rows
    c = F.normalize(feats[:, 0].double(), dim=1)
    for i, j in ((1, 2), (2, 1)):
        logits = c[i] @ c.T / 0.07
        logits[i] = float("-inf")
        assert_close(per[i].double(), -torch.log_softmax(logits, dim=0)[j], atol=1e-5, rtol=1e-5)
    assert_close(fc.supcon_loss(feats, torch.tensor([0, 1, 1]), backend="torch"), per.sum() / 3, atol=1e-6)


def test_supcon_in_is_log_of_mean_positive_probability():
    """L_in per anchor: -log((1/|P|) sum_p p_ip), written out with a python loop."""
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(6, 2, 4, generator=g)
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    c = F.normalize(torch.cat([feats[:, 0], feats[:, 1]]), dim=1)
    lab = labels.repeat(2)
    per = []
    for i in range(12):
        logits = c[i] @ c.T / 0.07
        logits[i] = float("-inf")
        p = torch.softmax(logits, dim=0)
        pos = [j for j in range(12) if j != i and lab[j] == lab[i]]
        per.append(-torch.log(p[pos].mean()))
    want = torch.stack(per)
    for be in BACKENDS:
        got = fc.supcon_loss(feats, labels, variant="in", reduction="none", backend=be)
        assert_close(got, want, atol=1e-5, rtol=1e-5, what=be)


def test_dscl_by_its_definition():
    """DSCL per anchor with an explicit loop: own view-1 weight 1, other positives beta/(|P|-1)."""
    g = torch.Generator().manual_seed(3)
    bsz, beta, t = 8, 8.0, 0.1
    feats = torch.randn(bsz, 2, 6, generator=g)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    c = F.normalize(torch.cat([feats[:, 0], feats[:, 1]]), dim=1)
    lab = labels.repeat(2)
    per = []
    for i in range(bsz):
        logits = c[i] @ c.T / t
        logits[i] = float("-inf")
        logp = torch.log_softmax(logits, dim=0)
        pos = [j for j in range(2 * bsz) if j != i and lab[j] == lab[i]]
        others = [j for j in pos if j != bsz + i]
        num = logp[bsz + i] + sum(beta / len(others) * logp[j] for j in others)
        per.append(-num / (1 + (beta if others else 0.0)))
    want = torch.stack(per).mean()
    for be in BACKENDS:
        assert_close(fc.dscl_loss(feats, labels, beta=beta, temperature=t, backend=be), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [40, 2000])  # the pair tile (B^2 <= tile budget) and the sorted path
def test_cosent_seed(backend, b):
    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(b, 16, generator=g), torch.randn(b, 16, generator=g)
    labels = torch.randint(0, 5, (b,), generator=g).float()
    want = B.seed_cosent(F.cosine_similarity(u, v), labels)
    assert_close(fc.cosent_loss(u, v, labels, backend=backend), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("b", [30, 3000])
def test_cosent_only_label_order_matters_and_ties_add_nothing(b):
    g = torch.Generator().manual_seed(6)
    s = torch.randn(b, generator=g)
    y = torch.randint(0, 4, (b,), generator=g).float()
    a = fc.cosent_loss_from_scores(s, y, backend="torch")
    c = fc.cosent_loss_from_scores(s, torch.exp(y) * 3 - 7, backend="torch")  # monotone relabelling
    assert_close(a, c, atol=1e-5, rtol=1e-6)
    assert fc.cosent_loss_from_scores(s, torch.zeros(b), backend="torch") == 0
    # hand-derived: two pairs, y = [0, 1]: log(1 + exp(20 * (s0 - s1)))
    two = fc.cosent_loss_from_scores(torch.tensor([0.3, 0.1]), torch.tensor([0.0, 1.0]), backend="torch")
    assert_close(two, torch.log1p(torch.exp(torch.tensor(20 * 0.2))), atol=1e-6)


def test_cosent_all_tied_or_single_pair_is_zero_with_zero_gradient():
    for b in (1, 5):
        for scores in (torch.randn(b, dtype=torch.float64),):
            s = scores.clone().requires_grad_()
            loss = fc.cosent_loss_from_scores(s, torch.ones(b), backend="torch")
            loss.backward()
            assert loss.item() == 0.0 and torch.equal(s.grad, torch.zeros_like(s))


@pytest.mark.parametrize("b", [200, 3000])
def test_cosent_large_batch_matches_pairwise_in_float64(b):
    g = torch.Generator().manual_seed(8)
    s = torch.rand(b, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 6, (b,), generator=g).double()
    s1, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()
    a = fc.cosent_loss_from_scores(s1, y, backend="torch")
    c = fc.cosent_loss_from_scores(s2, y, backend="reference")
    a.backward()
    c.backward()
    assert_close(a, c, atol=1e-10, rtol=1e-12)
    assert_close(s1.grad, s2.grad, atol=1e-10, rtol=1e-9)
