"""CONTRIBUTING.md's recipe for a new loss is what a loss really takes: ``am_softmax_loss`` (added by the
recipe) is mentioned in no file outside it, and every file the recipe names exists and names the
public losses it is about."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import fused_contrastive as fc
from fused_contrastive import losses

ROOT = Path(__file__).resolve().parent.parent


def _recipe_files() -> set[str]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text[text.index("## A new loss: the recipe"):text.index("## A new field of the core op")]
    paths = set()
    for p in re.findall(r"`([\w./<>-]+\.(?:py|md))(?:::\w+)?`", section):
        if "<family>" in p or not (p == "README.md" or p.startswith(("fused_contrastive/", "tests/", "docs/"))):
            continue  # the family module (the loss's own), and paths written relative to a package
        paths.add(p)
    return paths


def test_every_recipe_file_exists():
    files = _recipe_files()
    assert {"fused_contrastive/core/reference.py", "fused_contrastive/testing/cases.py", "fused_contrastive/nn.py",
            "fused_contrastive/testing/baselines.py", "README.md", "docs/api.md"} <= files, files
    for f in files:
        assert (ROOT / f).is_file(), f"CONTRIBUTING.md names {f}, which does not exist"


def _mentions(pattern: str) -> set[str]:
    out = subprocess.run(["git", "grep", "-l", "-E", pattern], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode in (0, 1), out.stderr
    return set(out.stdout.split())


def test_the_last_loss_added_touched_only_the_recipe():
    """``am_softmax_loss`` / ``AMSoftmaxLoss`` appear only in the recipe's numbered files (not the
    hand-written gather cells: its split is a fact), the family module that defines it and its own test
    module: nothing else had to learn its name."""
    family = Path(losses.cross_entropy.__file__).relative_to(ROOT).as_posix()
    hand_cells = {"tests/test_distributed.py", "tests/_training_matrix.py"}
    allowed = (_recipe_files() - hand_cells) | {family, "CONTRIBUTING.md", "tests/test_am_softmax.py",
                                                 "tests/test_contributing.py"}
    touched = {f for f in _mentions(r"am_softmax|AMSoftmax") if not f.startswith("bench/results/")}  # measurements
    assert touched, "git grep found nothing: not a checkout?"
    assert touched <= allowed, f"outside CONTRIBUTING.md's recipe: {sorted(touched - allowed)}"


def test_the_package_exports_every_loss_of_the_losses_package():
    assert set(losses.__all__) <= set(fc.__all__)
    for name in losses.__all__:
        assert getattr(fc, name) is getattr(losses, name)


def test_its_multi_process_cells_come_from_the_registry():
    """Its gather parity cell and its DDP training-matrix cell are generated from ``gather_split`` (and,
    for the matrix, its benchmark formula as the textbook), not written by hand."""
    import _training_matrix
    from test_distributed import registry_cells

    assert "am_softmax_loss[am_softmax]" in _training_matrix.BY_NAME
    assert "case:am_softmax" in [name for name, *_ in registry_cells([3, 2], 0)]
