"""The package's import structure, read from the source (every ``import`` statement, the ones inside
functions too): no module imports itself back through others, ``core/`` (the op every loss runs
on) depends on nothing above it, and no family of ``core/`` (or of ``kernels/``) imports another: what two
families share lives in the shared modules."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "fused_contrastive"

# what core/ may import from the rest of the package: leaves that import nothing of the package
# the leaf helpers every autograd Function wears (_amp: autocast; _first_order: double backward) and the kernels
# and the switchboard (routes: the one reader of the FUSED_CONTRASTIVE_* variables)
CORE_MAY_IMPORT = {"fused_contrastive._amp", "fused_contrastive._first_order", "fused_contrastive._tracing",
                   "fused_contrastive.kernels", "fused_contrastive.routes"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from . import x`` resolves to the module x when it is one;
    ``fused_contrastive.kernels``, shipped from ``kernels/``, stays as it is)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("fused_contrastive") and t != name:
                out.add(t.split(".kernels")[0] + ".kernels" if ".kernels" in t else t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    g = _graph()
    # core.run imports the Triton Function inside a function (triton is optional): still an edge
    assert "fused_contrastive.core.lse.triton_function" in g["fused_contrastive.core"]
    assert "fused_contrastive.core" in g["fused_contrastive.losses._scope"]  # `from .. import core`
    assert "fused_contrastive.losses.cross_entropy" in g["fused_contrastive.losses"]  # `from . import x`
    assert "fused_contrastive._tracing" in g["fused_contrastive.core"]
    assert "fused_contrastive.core.triton_shared.launch" in g["fused_contrastive.core.lse.triton_panel"]


def test_no_import_cycle_in_the_package():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (move what the lower module needs into a leaf): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_core_imports_nothing_above_it():
    bad = {}
    for m, deps in _graph().items():
        if m == "fused_contrastive.core" or m.startswith("fused_contrastive.core."):
            up = {d for d in deps if not d.startswith("fused_contrastive.core") and d not in CORE_MAY_IMPORT}
            if up:
                bad[m] = sorted(up)
    assert not bad, f"core/ modules importing from above core/: {bad}"


#: The families of ``core/``: one folder each, holding its PyTorch path (``torch_*.py``) and its Triton host
#: (``triton_*.py``). Everything else of ``core/`` is shared: the top-level modules (``spec``, ``norms``, ``tiles``,
#: ``linear_terms``, ``reference``) and ``triton_shared/``; ``core/__init__.py`` (``run``) dispatches to the families.
CORE_FAMILIES = ("lse", "matryoshka", "guided", "siglip", "cosent", "maxsim")
#: ``kernels/`` mirrors them: each family's device code in one file; ``common.py`` (shared jit helpers),
#: ``panel.py`` (the panel kernels and the epilogue GEMM every panel route launches), ``target.py`` (the linear
#: terms' row kernels), ``logit_pass.py`` (the one pass's in-place pass over cuBLAS's fp16 cosines) and ``gluon_epi.py``
#: (the Gluon form of the epilogue GEMM's statistics mode, sm_90) are shared.
KERNEL_FAMILIES = CORE_FAMILIES
KERNELS_SHARED = ("common", "panel", "target", "logit_pass", "gluon_epi")


def _core_family(mod: str) -> str | None:
    """The family of a ``fused_contrastive.core`` module, "shared" for the rest of core/, None outside it."""
    parts = mod.split(".")
    if parts[:2] != ["fused_contrastive", "core"]:
        return None
    if len(parts) == 2:
        return "run"
    return parts[2] if parts[2] in CORE_FAMILIES else "shared"


def _family_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        fm = _core_family(m)
        if fm is None or fm == "run":
            continue
        for d in deps:
            fd = _core_family(d)
            if fd in (None, "shared") and d != "fused_contrastive.core":
                continue
            if fd == "run" or (fd != fm):
                bad.append(f"{m} -> {d}")
    return sorted(bad)


def _kernel_imports() -> dict[str, set[str]]:
    """Each kernel file's imports of other kernel files (``from .x import ...``)."""
    out = {}
    for p in (ROOT / "kernels").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fused_contrastive.kernels."):
                deps.add(node.module.rsplit(".", 1)[1])
        out[p.stem] = deps
    return out


def _kernel_violations(imports: dict[str, set[str]]) -> list[str]:
    bad = []
    for k, deps in imports.items():
        if k == "__init__":
            continue
        for d in deps:
            if d in KERNELS_SHARED:
                continue
            bad.append(f"kernels/{k}.py -> kernels/{d}.py")
    return sorted(bad)


def test_every_core_module_is_a_family_or_shared():
    """A module of core/ sits in a family folder or is shared, nothing in between: a new folder is a family
    (add it to CORE_FAMILIES) or shared machinery (under triton_shared/)."""
    core = PKG / "core"
    folders = {p.name for p in core.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(CORE_FAMILIES) | {"triton_shared"}, folders
    for fam in CORE_FAMILIES:
        names = [p.stem for p in (core / fam).glob("*.py") if p.stem != "__init__"]
        assert names and all(n.startswith(("torch_", "triton_")) or n == "library_route" for n in names), (fam, names)
    kernel_files = {p.stem for p in (ROOT / "kernels").glob("*.py")} - {"__init__"}
    assert kernel_files == set(KERNEL_FAMILIES) | set(KERNELS_SHARED), kernel_files


def test_no_core_family_imports_another():
    bad = _family_violations(_graph())
    assert not bad, "a family of core/ imports another (move what they share to core/ or core/triton_shared/): " + \
        "; ".join(bad)


def test_the_family_check_finds_a_planted_cross_family_import():
    g = {m: set(d) for m, d in _graph().items()}
    assert not _family_violations(g)
    g["fused_contrastive.core.guided.torch_blocks"].add("fused_contrastive.core.lse.torch_chunked")
    assert _family_violations(g) == [
        "fused_contrastive.core.guided.torch_blocks -> fused_contrastive.core.lse.torch_chunked"]
    g = {m: set(d) for m, d in _graph().items()}
    g["fused_contrastive.core.triton_shared.panels"].add("fused_contrastive.core.siglip.triton_sweep")
    assert _family_violations(g) == [
        "fused_contrastive.core.triton_shared.panels -> fused_contrastive.core.siglip.triton_sweep"]


def test_no_kernel_file_imports_another_familys():
    imports = _kernel_imports()
    assert imports["panel"] == {"common"} and "common" in imports["guided"], imports  # the reader sees the edges
    bad = _kernel_violations(imports)
    assert not bad, "a kernel file imports another family's kernels (move the helper to kernels/common.py): " + \
        "; ".join(bad)


def test_the_kernel_check_finds_a_planted_import():
    imports = {k: set(v) for k, v in _kernel_imports().items()}
    imports["panel"].add("siglip")  # what kernels/panel.py did before its SigLIP helpers moved to common.py
    imports["common"].add("panel")  # a shared file leaning on another shared file is fine
    assert _kernel_violations(imports) == ["kernels/panel.py -> kernels/siglip.py"]


def _environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read a ``FUSED_CONTRASTIVE_*`` variable from the environment themselves:
    ``os.environ.get(k)``, ``os.getenv(k)``, ``os.environ[k]`` (read) or ``k in os.environ``, with ``k`` a string
    starting with FUSED_CONTRASTIVE_ or a name ending in ``ENV`` (the modules' constants for the names). Writes (a
    child process's environment, a save-and-restore helper's ``name`` argument) are not reads."""
    def key(node) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("FUSED_CONTRASTIVE_")
        if isinstance(node, ast.JoinedStr):
            return any(key(v) for v in node.values)
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        return name.endswith("ENV")

    def environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and key(node.args[0]):
            f = node.func
            if isinstance(f, ast.Attribute) and ((f.attr == "get" and environ(f.value)) or f.attr == "getenv"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and environ(node.value) and isinstance(node.ctx, ast.Load) \
                and key(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and key(node.left) and any(environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_switchboard_reads_the_environment():
    """Every ``FUSED_CONTRASTIVE_*`` read in the package goes through ``fused_contrastive/routes.py``."""
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        if p == PKG / "routes.py":
            continue
        bad += [f"{p.relative_to(ROOT)}:{n}" for n in _environment_reads(p.read_text())]
    assert not bad, "reads of FUSED_CONTRASTIVE_* outside routes.py (use routes.setting): " + ", ".join(bad)
    assert "os.environ.get(" in (PKG / "routes.py").read_text(), "the switchboard itself reads nothing?"


def test_the_read_check_finds_planted_reads():
    planted = (
        "import os\n"
        "a = os.environ.get('FUSED_CONTRASTIVE_DENSE', '1')\n"
        "b = os.getenv('FUSED_CONTRASTIVE_TRITON_PATH')\n"
        "c = os.environ[EPI_FORM_ENV]\n"
        "d = 'FUSED_CONTRASTIVE_AOT_LIB' in os.environ\n"
        "os.environ['FUSED_CONTRASTIVE_DENSE'] = '0'\n"  # a write
        "env = dict(os.environ, FUSED_CONTRASTIVE_LIBCUDA='x')\n"  # a child's environment
        "e = os.environ.get('TRITON_CACHE_DIR')\n")  # not ours
    assert _environment_reads(planted) == [2, 3, 4, 5]


def test_nothing_points_outside_the_repository():
    """Code, docs and build files cite the repository's own design notes (``docs/``), never a path or a
    document outside it."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"/work/|\.\./shared|\bDESIGN\.md\b|\bGPU_REVIEW\.md\b|\bSTYLE\.md\b|\.\./seeds")
    hits = []
    for f in files:
        if f == "tests/test_structure.py" or not f.endswith((".py", ".md", ".c", ".h", ".txt", ".toml", ".cfg",
                                                            ".yaml", ".cmake")):
            continue
        for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{f}:{i}: {line.strip()[:100]}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
