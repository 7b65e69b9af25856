"""Every ```python block of README.md and docs/*.md runs as written, on the CPU, in a fresh namespace:
a reader can paste it. A block that cannot run here (a distributed launch, a download) starts with a
``# not run: <why>`` line; it must still compile, and such blocks stay few."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = "# not run:"
MAX_NOT_RUN = 2  # the distributed launch and the sentence-transformers model download


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"(?m)^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.DOTALL):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return out


BLOCKS = _blocks()


def test_blocks_are_found():
    assert len(BLOCKS) >= 8 and any(w.startswith("README.md") for w, _ in BLOCKS)


def test_few_blocks_are_not_run_and_each_says_why():
    skipped = [(w, src.splitlines()[0]) for w, src in BLOCKS if src.startswith(NOT_RUN)]
    assert all(len(first) > len(NOT_RUN) + 10 for _, first in skipped), skipped
    assert len(skipped) <= MAX_NOT_RUN, skipped
    # a "not run" marker anywhere but the first line would be ignored here: say so rather than pass
    assert not [w for w, src in BLOCKS if NOT_RUN in src and not src.startswith(NOT_RUN)]


@pytest.mark.parametrize("where, src", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_runs(where, src, monkeypatch, tmp_path, capsys):
    code = compile(src, where, "exec")  # every block compiles, run or not
    if src.startswith(NOT_RUN):
        pytest.skip(src.splitlines()[0])
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    monkeypatch.delenv("FUSED_CONTRASTIVE_BACKEND", raising=False)
    exec(code, {"__name__": "__main__"})
