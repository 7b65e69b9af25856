"""examples/ddp_gloo.py, the README's runnable DDP example: 2 gloo processes with ``gather=True`` train to
the textbook loss of the global batch. The script checks itself against a one-process run of the library;
here both are checked against an independent float64 computation of the textbook formula
(``F.cross_entropy`` over the full cosine matrix of the global batch, the same SGD steps)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_gloo.py"


def _example():
    spec = importlib.util.spec_from_file_location("ddp_gloo_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _textbook_run(ex, steps: int, batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training in float64 with the textbook loss over the whole global batch."""
    model = ex.make_encoder().double()
    opt = torch.optim.SGD(model.parameters(), lr=ex.LR)
    losses = []
    for q, k in ex.make_batches(steps, batch):
        zq, zk = F.normalize(model(q.double()), dim=-1), F.normalize(model(k.double()), dim=-1)
        loss = F.cross_entropy(zq @ zk.T / ex.TEMPERATURE, torch.arange(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().flatten() for n, p in model.named_parameters()}


def test_ddp_on_two_gloo_ranks_is_the_global_batch_loss(tmp_path):
    steps, batch = 3, 48
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--world", "2", "--steps", str(steps), "--batch", str(batch),
                           "--json", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to float32 round-off" in proc.stdout
    run = json.loads(out.read_text())
    ex = _example()
    assert [ex.rows_of(r, 2, batch).stop - ex.rows_of(r, 2, batch).start for r in range(2)] == [32, 16]  # unequal
    want_losses, want_weights = _textbook_run(ex, steps, batch)
    assert min(want_losses) > 0.5, want_losses  # a loss far from 0: the negatives matter
    per_rank = run["rank_losses"]
    assert len(per_rank) == 2 and per_rank[0] != per_rank[1]  # each rank returns its own part
    for s in range(steps):
        avg = (per_rank[0][s] + per_rank[1][s]) / 2
        assert abs(avg - want_losses[s]) <= 2e-6 * want_losses[s], (s, avg, want_losses[s])
        assert abs(run["single_losses"][s] - want_losses[s]) <= 2e-6 * want_losses[s], s
    for name, want in want_weights.items():
        for got in (run["ddp_weights"][name], run["single_weights"][name]):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-5)
    # the weights moved: the comparison is of a training run, not of the initial weights
    init = {n: p.detach().flatten().double() for n, p in ex.make_encoder().named_parameters()}
    assert max((want_weights[n] - init[n]).abs().max().item() for n in init) > 1e-3
