"""The merge of the epilogue GEMM's statistics partials (``kernels/panel.py`` ``stats_merge_kernel``) on the
Triton interpreter, against float64 ``logsumexp`` of the definition: ``LSE_o = log sum_k Z[o, k]
exp(MX[o, k])`` over each output's partials, the rows' laid out along a row of the partials buffer and the
columns' down a column of it, and with ACC merged into the statistics so far by ``logaddexp``.

Partials that stress it: empty ones (``Z = 0`` with ``MX = -inf``: a tile whose every logit is masked),
outputs whose every partial is empty (-inf, no NaN), a previous value of -inf under ACC, logits of
+-80 (``exp`` of the raw maxima would overflow fp32), more partials than one step of the loop, and
output counts that are not multiples of the block."""

from __future__ import annotations

import pytest
import torch
import triton
from fused_contrastive.kernels import panel as KP

from fused_contrastive.core.triton_shared.configs import STATS_MERGE_BLOCK_O, STATS_MERGE_BLOCK_P


def _partials(n_out: int, n_part: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mx = torch.randn(n_out, n_part, generator=g, dtype=torch.float64) * 40  # maxima of +-80 and beyond
    z = torch.rand(n_out, n_part, generator=g, dtype=torch.float64) * 50 + 1  # each partial counts the max: >= 1
    empty = torch.rand(n_out, n_part, generator=g) < 0.3
    mx[empty], z[empty] = float("-inf"), 0.0
    mx[1], z[1] = float("-inf"), 0.0  # an output without any logit
    return mx, z


def _truth(mx, z):
    return torch.logsumexp(mx + torch.log(z), dim=1)


def _merge(mx, z, out, rows: bool, acc: bool):
    """The kernel on fp32 copies: ``rows`` the outputs along the first dim of a [n_out, n_part] buffer,
    else along the second of its transpose (the columns' layout, [n_part, n_out])."""
    n_out, n_part = mx.shape
    if rows:
        m32, z32, so, sp = mx.float().contiguous(), z.float().contiguous(), n_part, 1
    else:
        m32, z32, so, sp = mx.T.float().contiguous(), z.T.float().contiguous(), 1, n_out
    KP.stats_merge_kernel[(triton.cdiv(n_out, STATS_MERGE_BLOCK_O),)](
        m32, z32, out, n_out, n_part, so, sp, BLOCK_O=STATS_MERGE_BLOCK_O, BLOCK_P=STATS_MERGE_BLOCK_P, ACC=acc)
    return out


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "columns"])
@pytest.mark.parametrize("n_out,n_part", [(70, 3), (33, 150)])
def test_merge_matches_float64_logsumexp(rows, n_out, n_part):
    mx, z = _partials(n_out, n_part, seed=n_out)
    got = _merge(mx, z, torch.full((n_out,), float("nan")), rows, acc=False).double()
    want = _truth(mx, z)
    assert got[1] == float("-inf") and want[1] == float("-inf")
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    torch.testing.assert_close(got[fin], want[fin], rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "columns"])
def test_merge_into_previous_statistics(rows):
    """ACC: ``logaddexp`` with what OUT holds (a panel's column statistics merged into the earlier
    panels'), -inf there included (a column no panel has reached yet)."""
    mx, z = _partials(45, 70, seed=5)
    prev = torch.randn(45, dtype=torch.float64) * 30
    prev[0] = float("-inf")
    prev[1] = float("-inf")  # and no partial either: stays -inf
    got = _merge(mx, z, prev.float().clone(), rows, acc=True).double()
    want = torch.logaddexp(prev.float().double(), _truth(mx, z))
    assert got[1] == float("-inf")
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and not got.isnan().any()
    torch.testing.assert_close(got[fin], want[fin], rtol=2e-6, atol=1e-5)
