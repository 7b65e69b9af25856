"""`python -m fused_contrastive check`: the table, the exit code, and that it can fail."""

from __future__ import annotations

import subprocess
import sys

from fused_contrastive import __main__ as cli
from fused_contrastive import _torch_core


def test_check_subprocess_passes_and_prints_a_row_per_case():
    out = subprocess.run([sys.executable, "-m", "fused_contrastive", "check", "--shapes", "5x3",
                          "--dtypes", "float32", "--backends", "torch"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.endswith("PASS")]
    from fused_contrastive._cases import CASES

    assert len(rows) == len(CASES)
    assert "all passed" in out.stdout


def test_check_fails_on_a_wrong_backend(monkeypatch, capsys):
    """Break the torch core's LSE guard (shift every LSE by 0.01): the check must exit 1."""
    orig = _torch_core._lse_rows
    monkeypatch.setattr(_torch_core, "_lse_rows", lambda x: orig(x) + 0.01)
    code = cli.main(["check", "--shapes", "9x4", "--dtypes", "float32", "--backends", "torch",
                     "--losses", "info_nce,supcon_out"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out


def test_default_command_is_check(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "check", lambda argv: seen.append(argv) or 0)
    assert cli.main([]) == 0 and seen == [[]]
