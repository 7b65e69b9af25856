"""The README stays true: CI runs its test command, it documents every public name, and its layout
section names every module of the package."""

from __future__ import annotations

import re
from pathlib import Path

import fused_contrastive as fc
from fused_contrastive import nn as fnn

ROOT = Path(__file__).resolve().parents[1]


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", _readme(), flags=re.DOTALL)
    test_cmd = [b for b in blocks if "pytest" in b]
    assert len(test_cmd) == 1
    assert test_cmd[0].strip() in (ROOT / ".ci" / "run").read_text()


def test_every_public_name_is_in_the_readme():
    text = _readme()
    for name in [n for n in fc.__all__ if not n.startswith("__") and n != "nn"] + list(fnn.__all__):
        assert f"{name}(" in text, name


def test_layout_section_names_every_module():
    layout = _readme().split("## Layout", 1)[1]
    pkg = ROOT / "fused_contrastive"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.name == "__init__.py" and rel.parent != Path("."):
            name = f"{rel.parent.as_posix()}/"
        elif rel.name == "__main__.py" and rel.parent != Path("."):
            continue  # python -m fused_contrastive.bench: the same CLI
        else:
            name = rel.name if rel.parent == Path(".") else rel.as_posix()
        if name not in layout and rel.name not in layout:
            missing.append(str(rel))
    assert not missing, f"modules not described in the README's layout section: {missing}"


def test_every_env_variable_is_documented():
    text = _readme()
    used = set()
    for path in (ROOT / "fused_contrastive").rglob("*.py"):
        used |= set(re.findall(r"FUSED_CONTRASTIVE_[A-Z_]+", path.read_text()))
    used.discard("FUSED_CONTRASTIVE_TRITON_POISON")  # a test hook, documented where it is defined
    assert used and all(v in text for v in used), sorted(v for v in used if v not in text)


def test_sentence_transformers_extra_and_import_path():
    """The extra brings what SentenceTransformerTrainer needs (sentence-transformers' own "train" extra,
    read from its installed metadata), and the README's commented peer import is the non-deprecated
    module path of the installed sentence-transformers."""
    import importlib
    import importlib.metadata as md
    import re
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ours = " ".join(extra["sentence-transformers"])
    train = [r for r in md.requires("sentence-transformers") or [] if re.search(r'extra\s*==\s*"train"', r)]
    assert train, "sentence-transformers declares no train extra"
    for req in train:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        assert "sentence-transformers[train]" in ours or name in ours, (name, ours)
    peer = re.search(r"# from (sentence_transformers[\w.]*) import (\w+)", _readme())
    assert peer, "README has no commented sentence-transformers import"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        mod = importlib.import_module(peer.group(1))
    assert hasattr(mod, peer.group(2))
