"""CONTRIBUTING.md's recipe for a new loss is what a loss really takes: ``am_softmax_loss`` (added by the
recipe) is mentioned in no file outside it, and every file the recipe names exists and names the
public losses it is about."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import fused_contrastive as fc
from fused_contrastive import losses

ROOT = Path(__file__).resolve().parent.parent


def _recipe_files() -> set[str]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text[text.index("## A new loss: the recipe"):text.index("## A new option on an existing loss")]
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
    # (measurements name it; so do later tests that run a route over every loss of the registry, e.g. the fp16
    # pass's, whose case list is not the recipe's business, CLIP's saturated-loss test, whose symmetric margin
    # case is this loss's, and the AOT library's margin split, whose route test runs it)
    later_route_tests = {"tests/test_logit_pass.py", "tests/test_logit_pass_compile.py", "tests/test_clip_loss.py",
                         "tests/test_cmake_build.py"}
    touched = {f for f in _mentions(r"am_softmax|AMSoftmax") if not f.startswith("bench/results/")} - later_route_tests
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


def _section(title: str) -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _paths(section: str) -> set[str]:
    return set(re.findall(r"`((?:fused_contrastive|kernels|tests|docs)/[\w./<>-]+\.(?:py|md))`", section))


@pytest.mark.parametrize("title", ["## A new option on an existing loss: the recipe", "## A new family: the recipe",
                                   "## A new route: the recipe"])
def test_the_new_recipes_name_files_of_the_tree(title):
    """Every file the option / family / route recipes name exists; a ``<family>`` path exists for every family
    of core/ (``<name>`` and ``<option>`` stand for the new file's own name)."""
    import test_structure

    section = _section(title)
    paths = _paths(section)
    assert paths, title
    for p in paths:
        if "<name>" in p or "<option>" in p:
            continue
        for fam in (test_structure.CORE_FAMILIES if "<family>" in p else [None]):
            f = p.replace("<family>", fam) if fam else p
            if f.startswith("fused_contrastive/losses/") and fam:
                continue  # the loss modules are grouped by kind of loss, not by core family
            assert (ROOT / f).exists(), f"CONTRIBUTING.md ({title}) names {f}, which does not exist"


def test_every_family_has_the_recipes_shape():
    """What the family recipe asks is what each family of the tree has: a folder of core/ with its
    ``__init__.py`` and ``torch_*`` / ``triton_*`` files (MaxSim's PyTorch path is its public module), and a
    file of kernels/."""
    import test_structure

    for fam in test_structure.CORE_FAMILIES:
        folder = ROOT / "fused_contrastive" / "core" / fam
        files = {p.name for p in folder.glob("*.py")}
        assert "__init__.py" in files, fam
        assert any(f.startswith("triton_") for f in files), (fam, files)
        assert fam == "maxsim" or any(f.startswith("torch_") for f in files), (fam, files)
        assert (ROOT / "kernels" / f"{fam}.py").is_file(), fam


def test_the_route_recipe_matches_the_switchboard():
    """The route recipe's places are real: routes.ROUTES rows name a setting, SETTINGS rows a kind and a
    default, and override is the context manager the recipe's test uses."""
    from fused_contrastive import routes

    section = _section("## A new route: the recipe")
    for name in ("routes.setting", "routes.override", "Route", "SETTINGS", "Setting"):
        assert name in section, name
    assert all(r.setting for r in routes.ROUTES)
    assert all(s.kind in ("choice", "int", "flag", "text") for s in routes.SETTINGS.values())
    with routes.override(MATRYOSHKA_ROUTE="suffix"):
        assert routes.setting("MATRYOSHKA_ROUTE") == "suffix"
