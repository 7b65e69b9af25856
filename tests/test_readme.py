"""The README stays true: CI runs its test command, it documents every public name, its layout page
(docs/layout.md, linked from it) names every module of the package once, its links stay inside the
repository, and no word of the project's internal process reaches a reader."""

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
    assert "(docs/layout.md)" in _readme(), "the README does not link the layout page"
    layout = (ROOT / "docs" / "layout.md").read_text()
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
    assert not missing, f"modules not described in docs/layout.md: {missing}"
    # each module is described once: a path at the start of its own entry, not listed twice
    entries = re.findall(r"`(fused_contrastive/[\w/]+\.py)`:", layout)
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)


def _pages() -> dict[str, str]:
    pages = {"README.md": _readme()}
    pages.update({f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))})
    return pages


def test_links_resolve_inside_the_repository():
    """Every relative link of the README and the docs pages names a file of the repository (and an
    anchor of a heading there, when it has one); nothing points outside it."""
    def anchors(text: str) -> set[str]:
        out = set()
        for h in re.findall(r"(?m)^#+ (.*)$", text):
            a = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            out.add(a)
        return out

    pages = _pages()
    bad = []
    for name, text in pages.items():
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (base / path).resolve() if path else (ROOT / name).resolve()
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{name}: {target} (outside the repository)")
            elif not dest.exists():
                bad.append(f"{name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                bad.append(f"{name}: {target} (no such heading)")
    assert not bad, bad


def test_no_internal_words():
    """Words of the project's own process mean nothing to a reader."""
    # the path is joined here so that this file itself passes tests/test_structure.py's same check
    words = ["seed 00", "seed document", "these machines", "/".join(["..", "shared"]), "this project's cpu machines"]
    found = [(name, w) for name, text in _pages().items() for w in words if w in text.lower()]
    assert not found, found


def test_first_screen_gets_a_user_going():
    """What it is, the install (from a checkout), the example that replaces F.cross_entropy, when to use it,
    the losses and drop-ins, the main job and the tests, in that order; the rest lives in docs/ (a README a
    user reads to the end: at most ~400 lines)."""
    text = _readme()
    order = ["## Quick start", "### Install", "pip install /path/to/fused-contrastive", "textbook = F.cross_entropy(",
             "fc.info_nce(", "## When to use it", "## API", "### Drop-ins", "## The main job",
             "python -m fused_contrastive bench", "## The tests", "python -m pytest -q"]
    at = [text.find(w) for w in order]
    assert all(i >= 0 for i in at) and at == sorted(at), dict(zip(order, at, strict=True))
    assert not re.search(r"pip install \S*\"fused-contrastive", text), "an install line that is not from a checkout"
    assert text.count("\n") <= 400, f"the README has {text.count(chr(10))} lines"
    headings = re.findall(r"(?m)^#+ .*$", text)
    assert len(headings) == len(set(headings)), "a duplicated heading"


def test_every_env_variable_is_documented():
    text = (ROOT / "docs" / "backends.md").read_text()  # the README links it
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


def test_api_page_signatures_are_the_functions():
    """docs/api.md states each public function's full signature: it is the function's own."""
    import inspect

    text = (ROOT / "docs" / "api.md").read_text()
    stated = dict(re.findall(r"### `(\w+)`\n\n```text\n(.*?)\n```", text))
    names = [n for n in fc.__all__ if not n.startswith("__") and n != "nn"]
    assert sorted(stated) == sorted(names)
    for name in names:
        parts, star = [], False
        for p in inspect.signature(getattr(fc, name)).parameters.values():
            if p.kind == p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            default = "" if p.default is p.empty else "=" + repr(p.default).replace("'", '"')
            parts.append(p.name + default)
        assert stated[name] == f"{name}({', '.join(parts)})", name
