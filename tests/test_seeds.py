"""Parity with the seed documents' formulas (../shared/seeds), written again here from their math,
and with SupContrast's semantics (max shift, 1e-30 fudge, zero-positive anchors, contrast_mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_contrastive as fc
from helpers import assert_close

BACKENDS = ["torch", "reference"]


def seed_simcse_unsup(z: torch.Tensor, t: float = 0.05) -> torch.Tensor:
    """Seeds 000/002: y = i + 1 - (i % 2) * 2; self removed by subtracting 1e12; / 0.05; CE."""
    idx = torch.arange(z.shape[0])
    y = idx + 1 - (idx % 2) * 2
    zn = F.normalize(z, p=2, dim=1)
    sim = zn @ zn.T - torch.eye(z.shape[0]) * 1e12
    return F.cross_entropy(sim / t, y)


def seed_keras_simcse(z: torch.Tensor) -> torch.Tensor:
    """Seed 004: l2-normalise, dot, - eye * 1e12, * 20, categorical cross-entropy from logits."""
    idx = torch.arange(z.shape[0])
    labels = F.one_hot(idx + 1 - 2 * (idx % 2), z.shape[0]).float()
    zn = z / z.norm(dim=1, keepdim=True)
    logits = (zn @ zn.T - torch.eye(z.shape[0]) * 1e12) * 20
    return -(labels * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def seed_simcse_sup(z: torch.Tensor, t: float = 0.05) -> torch.Tensor:
    """Seed 000: anchors rows 0::3; candidates every row with index % 3 != 0; target of anchor k is 2k."""
    rows = torch.arange(0, z.shape[0], 3)
    cols = torch.tensor([i for i in range(z.shape[0]) if i % 3 != 0])
    zn = F.normalize(z, dim=1)
    sim = zn[rows] @ zn[cols].T / t
    return F.cross_entropy(sim, torch.arange(len(rows)) * 2)


def supcontrast(features, labels=None, mask=None, temperature=0.07, base_temperature=0.07, contrast_mode="all"):
    """SupContrast's forward (seed 003), with its max shift and 1e-30."""
    bsz, n_views = features.shape[:2]
    if labels is None and mask is None:
        mask = torch.eye(bsz)
    elif labels is not None:
        mask = (labels.view(-1, 1) == labels.view(1, -1)).float()
    contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
    anchor, anchor_count = (contrast, n_views) if contrast_mode == "all" else (features[:, 0], 1)
    logits = anchor @ contrast.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    mask = mask.repeat(anchor_count, n_views)
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(bsz * anchor_count).view(-1, 1), 0)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True) + 1e-30)
    pos = mask.sum(1)
    pos = torch.where(pos < 1e-6, torch.ones_like(pos), pos)
    mean_log_prob_pos = (mask * log_prob).sum(1) / pos
    loss = -(temperature / base_temperature) * mean_log_prob_pos
    return loss.view(anchor_count, bsz).mean()


def seed_cosent(y_pred: torch.Tensor, y_true: torch.Tensor, lam: float = 20.0) -> torch.Tensor:
    """Seed 001: scores * lambda, pairwise differences masked to y_i > y_j, 0 prepended, logsumexp."""
    y_pred = y_pred * lam
    diff = y_pred[:, None] - y_pred[None, :]  # [i, j] = s_i - s_j, kept where y_i < y_j
    keep = y_true[:, None] < y_true[None, :]
    diff = diff - (~keep).float() * 1e12
    return torch.logsumexp(torch.cat([torch.zeros(1), diff.flatten()]), dim=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 8, 64])
def test_simcse_unsup_seed(backend, n):
    z = torch.randn(n, 32, generator=torch.Generator().manual_seed(n))
    assert_close(fc.simcse_loss(z, backend=backend), seed_simcse_unsup(z), atol=2e-5, rtol=1e-5, what="simcse")
    assert_close(fc.simcse_loss(z, backend=backend), seed_keras_simcse(z), atol=2e-5, rtol=1e-5, what="keras")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 5, 32])
def test_simcse_sup_seed(backend, b):
    z = torch.randn(3 * b, 16, generator=torch.Generator().manual_seed(b))
    assert_close(fc.simcse_sup_loss(z, backend=backend), seed_simcse_sup(z), atol=2e-5, rtol=1e-5, what="sup")


def test_simcse_two_view_is_official_form():
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    cos = F.cosine_similarity(z1[:, None], z2[None, :], dim=-1)
    assert_close(fc.simcse_loss(z1, z2, backend="torch"), F.cross_entropy(cos / 0.05, torch.arange(10)),
                 atol=2e-5, rtol=1e-5)


def test_simcse_sup_hard_negative_weight_is_added_to_own_negative_logit():
    g = torch.Generator().manual_seed(1)
    a, p, n = (torch.randn(6, 8, generator=g) for _ in range(3))
    w = 0.7
    cos = lambda x, y: F.cosine_similarity(x[:, None], y[None, :], dim=-1)  # noqa: E731
    logits = torch.cat([cos(a, p) / 0.05, cos(a, n) / 0.05 + w * torch.eye(6)], dim=1)
    want = F.cross_entropy(logits, torch.arange(6))
    for be in BACKENDS:
        assert_close(fc.simcse_sup_loss(a, p, n, hard_negative_weight=w, backend=be), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["all", "one"])
@pytest.mark.parametrize("kind", ["labels", "mask", "simclr", "zero_positive"])
def test_supcontrast_parity(backend, mode, kind):
    g = torch.Generator().manual_seed(7)
    bsz, views = 12, 2 if kind != "zero_positive" else 1
    feats = F.normalize(torch.randn(bsz, views, 16, generator=g), dim=-1)
    labels = mask = None
    if kind == "labels":
        labels = torch.randint(0, 4, (bsz,), generator=g)
    elif kind == "mask":
        mask = (torch.rand(bsz, bsz, generator=g) < 0.4).float()  # asymmetric on purpose
    elif kind == "zero_positive":
        labels = torch.tensor([0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8])  # singletons: no positive, loss 0
    want = supcontrast(feats, labels=labels, mask=mask, contrast_mode=mode)
    got = fc.supcon_loss(feats, labels, mask, contrast_mode=mode, backend=backend)
    assert_close(got, want, atol=1e-5, rtol=1e-5, what=f"supcon {kind} {mode}")


def test_supcon_zero_positive_anchor_contributes_zero():
    feats = torch.randn(3, 1, 5)
    per = fc.supcon_loss(feats, torch.tensor([0, 1, 1]), reduction="none", backend="torch")
    assert per[0] == 0 and per[1] > 0 and per[2] > 0
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
    got = fc.supcon_loss(feats, labels, variant="in", reduction="none", backend="torch")
    assert_close(got, want, atol=1e-5, rtol=1e-5)


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
def test_cosent_seed(backend):
    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 5, (40,), generator=g).float()
    want = seed_cosent(F.cosine_similarity(u, v), labels)
    assert_close(fc.cosent_loss(u, v, labels, backend=backend), want, atol=1e-4, rtol=1e-5)


def test_cosent_only_label_order_matters_and_ties_add_nothing():
    g = torch.Generator().manual_seed(6)
    s = torch.randn(30, generator=g)
    y = torch.randint(0, 4, (30,), generator=g).float()
    a = fc.cosent_loss_from_scores(s, y, backend="torch")
    b = fc.cosent_loss_from_scores(s, torch.exp(y) * 3 - 7, backend="torch")  # monotone relabelling
    assert_close(a, b, atol=1e-6)
    tied = fc.cosent_loss_from_scores(s, torch.zeros(30), backend="torch")
    assert tied == 0
    # hand-derived: two pairs, y = [0, 1]: log(1 + exp(20 * (s0 - s1)))
    two = fc.cosent_loss_from_scores(torch.tensor([0.3, 0.1]), torch.tensor([0.0, 1.0]), backend="torch")
    assert_close(two, torch.log1p(torch.exp(torch.tensor(20 * 0.2))), atol=1e-6)


def test_cosent_large_batch_matches_pairwise_in_float64():
    g = torch.Generator().manual_seed(8)
    s = torch.rand(3000, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 6, (3000,), generator=g).double()
    s1 = s.clone().requires_grad_()
    s2 = s.clone().requires_grad_()
    a = fc.cosent_loss_from_scores(s1, y, backend="torch")
    b = fc.cosent_loss_from_scores(s2, y, backend="reference")
    a.backward()
    b.backward()
    assert_close(a, b, atol=1e-10, rtol=1e-12)
    assert_close(s1.grad, s2.grad, atol=1e-10, rtol=1e-9)
