"""The README stays true: CI runs its test command, and it documents every public name."""

from __future__ import annotations

import re
from pathlib import Path

import fused_contrastive as fc
from fused_contrastive import nn as fnn

ROOT = Path(__file__).resolve().parents[1]


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", _readme(), flags=re.S)
    test_cmd = [b for b in blocks if "pytest" in b]
    assert len(test_cmd) == 1
    assert test_cmd[0].strip() in (ROOT / ".ci" / "run").read_text()


def test_every_public_name_is_in_the_readme():
    text = _readme()
    for name in [n for n in fc.__all__ if not n.startswith("__") and n != "nn"] + list(fnn.__all__):
        assert f"{name}(" in text, name
