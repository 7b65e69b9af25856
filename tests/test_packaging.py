"""What a user installs, tested as a user gets it: the wheel and the sdist built from the checkout, the
wheel installed (``--no-deps``) into a fresh virtual environment that cannot see the source tree, and
run there from a temporary directory.

Every other test runs against the editable install of the checkout, which imports from the source tree:
a module missing from the wheel (``fused_contrastive/losses/`` once was, and the installed package did
not import) passes all of them. Here:

* the wheel holds every file of ``fused_contrastive/`` and of ``kernels/`` (as
  ``fused_contrastive/kernels/``); the sdist, unpacked, rebuilds a wheel with the same files;
* each extra's promise holds in its own environment: a fresh venv (no system site-packages) with the
  wheel installed and, in its site-packages, links to exactly the distributions of this interpreter
  that the wheel's own ``Requires-Dist`` pulls in for that extra (the dependency closure, followed
  through the installed distributions' metadata), nothing else. So the base environment has torch and
  its dependencies and no numpy / tabulate / tqdm / sentence-transformers, as after
  ``pip install /path/to/fused-contrastive``, without installing torch again; and the editable install of
  the checkout (its ``.pth`` and finder) is in none of them (asserted: the package imports from the venv).

  - base: the package imports from the venv; every case of the registry (every public loss) forward and
    backward on the torch backend against the float64 reference; no optional library imported;
    ``--version`` (module and console script); every sub-command's ``--help``; ``check`` on a small
    subset; each bench sub-command says which extra it needs in one line, exit 2, no traceback;
  - ``[triton]``: every case with kernels on the triton backend under the interpreter;
  - ``[bench]``: ``bench --quick`` on one loss at one tiny size;
  - ``[sentence-transformers]``: one ``SentenceTransformerTrainer`` step with the drop-in
    ``MultipleNegativesRankingLoss`` on a tiny BERT built offline.

The wheel and the environments are built once for the module.
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from fused_contrastive.__main__ import COMMANDS, NEEDS

ROOT = Path(__file__).resolve().parents[1]
#: top-level folders of the source tree -> where their modules live in the wheel (pyproject.toml's
#: package-dir: kernels/ ships as fused_contrastive.kernels)
PACKAGE_DIRS = {"fused_contrastive": "fused_contrastive", "kernels": "fused_contrastive/kernels"}
#: what the base install must not import (the extras' libraries)
OPTIONAL = ("numpy", "tabulate", "tqdm", "matplotlib", "pytorch_metric_learning", "sentence_transformers",
            "transformers", "datasets", "accelerate", "triton")
#: the sub-commands that need an extra (all of them need [bench])
BENCH_COMMANDS = tuple(c for c in COMMANDS if NEEDS.get(c))
#: not copied into the build's source tree (what .gitignore ignores, for a tree without git metadata)
_NOT_SOURCE = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks",
               "bench_out", "_build", ".ruff_cache"}


def _run(cmd, *, cwd=None, env=None, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def _source_files() -> list[str]:
    """The checkout's files as a clone of it would have them (tracked and new, not ignored)."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        proc = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=False)
        if proc.returncode == 0:  # else (e.g. git refuses the folder's owner): the walk below
            return [f for f in proc.stdout.split("\0") if f and (ROOT / f).is_file()]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in _NOT_SOURCE and not d.endswith(".egg-info") and not d.startswith(".")]
        files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames if not f.endswith(".pyc")]
    return files


def expected_files(root: Path = ROOT) -> set[str]:
    """Every file of the package folders of the source tree (``.py`` modules, and any data file the
    runtime would read: it needs ``package-data``), at its path inside the wheel."""
    out = set()
    for top, dest in PACKAGE_DIRS.items():
        for f in (root / top).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                out.add(f"{dest}/{f.relative_to(root / top).as_posix()}")
    return out


def wheel_files(whl: Path) -> set[str]:
    """The wheel's files, less RECORD (its hashes cover the metadata, which names the build)."""
    with zipfile.ZipFile(whl) as z:
        return {n for n in z.namelist() if not n.endswith(".dist-info/RECORD")}


def build_wheel(src: Path, out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
          "-w", out, src], cwd=src)
    (whl,) = out.glob("*.whl")
    return whl


def build_sdist(src: Path, out: Path) -> Path:
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", out, src], cwd=src)
    (sd,) = out.glob("*.tar.gz")
    return sd


@dataclass
class Built:
    tree: Path
    wheel: Path
    sdist: Path
    wheel_from_sdist: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The wheel and the sdist of a copy of the checkout (the checkout's own build/ and egg-info are not
    read: setuptools would pack stale files left there), and the wheel rebuilt from the unpacked sdist."""
    base = tmp_path_factory.mktemp("packaging")
    tree = base / "src"
    for f in _source_files():
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    whl = build_wheel(tree, base / "wheel")
    sd = build_sdist(tree, base / "sdist")
    with tarfile.open(sd) as t:
        t.extractall(base / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = (base / "unpacked").iterdir()
    return Built(tree, whl, sd, build_wheel(unpacked, base / "wheel-from-sdist"))


def test_wheel_holds_every_module_of_the_source_tree(built):
    want = expected_files(built.tree)
    assert sum(f.endswith(".py") for f in want) > 50 and "fused_contrastive/kernels/__init__.py" in want
    missing = sorted(want - wheel_files(built.wheel))
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the source tree: {missing}"
    # check --gpu-validate's model column: the GPU model's times ship as package data
    assert "fused_contrastive/gpu_model_times.jsonl" in wheel_files(built.wheel)


def test_sdist_rebuilds_the_same_wheel(built):
    a, b = wheel_files(built.wheel), wheel_files(built.wheel_from_sdist)
    assert a == b, f"only in the checkout's wheel: {sorted(a - b)}; only in the sdist's: {sorted(b - a)}"
    with zipfile.ZipFile(built.wheel) as za, zipfile.ZipFile(built.wheel_from_sdist) as zb:
        differ = [n for n in sorted(a) if za.read(n) != zb.read(n)]
    assert not differ, f"files that differ between the two wheels: {differ}"


# ----------------------------------------------------------------------------------------------
# the fresh environments
# ----------------------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, md.Distribution]:
    """This interpreter's distributions by normalised name (the first on sys.path wins, as for imports)."""
    out: dict[str, md.Distribution] = {}
    for d in md.distributions():
        out.setdefault(_norm(d.metadata["Name"]), d)
    return out


def _wheel_metadata(whl: Path):
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(meta).decode())


def closure(requirements: list[str], extras: tuple[str, ...], installed: dict[str, md.Distribution]) -> set[str]:
    """The installed distributions that ``requirements`` (a Requires-Dist list) pull in with ``extras``,
    followed through each distribution's own Requires-Dist. Raises when one is not installed here."""
    env = default_environment()
    todo = [(r, e) for r in requirements for e in ("", *extras)]
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = _norm(req.name)
        for e in ("", *sorted(req.extras)):
            if (name, e) in seen:
                continue
            seen.add((name, e))
            if name not in installed:
                raise LookupError(f"{req.name} (required as {text!r}) is not installed here")
            names.add(name)
            todo += [(r, e) for r in installed[name].requires or ()]
    return names


def link_distributions(site: Path, names: set[str], installed: dict[str, md.Distribution]) -> None:
    """Links in ``site`` to the top-level entries (packages, modules, extension modules, metadata) of
    the installed distributions ``names``, taken from their RECORD files (their .pth files are left out:
    the editable install of the checkout is one)."""
    for name in sorted(names):
        dist = installed[name]
        where = Path(dist.locate_file("")).resolve()
        if dist.files is None:
            raise LookupError(f"{name} has no RECORD: cannot tell its files")
        for f in dist.files:
            if not f.parts or f.parts[0] in ("..", "__pycache__") or f.parts[0].endswith(".pth"):
                continue
            top = site / f.parts[0]
            if not top.exists() and (where / f.parts[0]).exists():
                top.symlink_to(where / f.parts[0])


#: the environments: each extra's libraries (the base: none)
EXTRAS = {"base": (), "triton": ("triton",), "bench": ("bench",), "sentence-transformers": ("sentence-transformers",)}


@dataclass
class Env:
    root: Path
    venvs: dict[str, Path | Exception]
    work: Path
    version: str

    def venv(self, extra: str = "base") -> Path:
        v = self.venvs[extra]
        if isinstance(v, Exception):  # an extra whose libraries this test environment lacks
            pytest.skip(f"the [{extra}] environment cannot be assembled here: {v}")
        return v

    def python(self, extra: str = "base") -> Path:
        return self.venv(extra) / "bin" / "python"

    def environ(self, extra: str = "base", **more: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "TRITON_", "FUSED_CONTRASTIVE_")) and k != "VIRTUAL_ENV"}
        env.update(PATH=str(self.venv(extra) / "bin") + os.pathsep + env.get("PATH", ""),
                   VIRTUAL_ENV=str(self.venv(extra)), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(self.work),
                   MPLCONFIGDIR=str(self.work / "mpl"), HF_HOME=str(self.work / "hf"))
        env.update(more)
        return env

    def run(self, args, extra: str = "base", check: bool = True, timeout: int = 300, **more: str):
        return _run([self.python(extra), *args], cwd=self.work, env=self.environ(extra, **more), check=check,
                    timeout=timeout)

    def probe(self, code: str, extra: str = "base", **more: str) -> dict:
        """Run ``code`` (it fills ``result``) in the environment; ``result`` back, with where the package
        came from and which optional libraries were imported."""
        script = self.work / f"probe_{extra}.py"
        script.write_text(PROBE_HEAD + textwrap.dedent(code) + PROBE_TAIL)
        out = self.run([script], extra, **more).stdout
        return json.loads(out.strip().splitlines()[-1])


PROBE_HEAD = """\
import json, os, sys
import fused_contrastive
where = {"file": fused_contrastive.__file__, "prefix": sys.prefix,
         "editable_finders": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()]}
result = {}
"""
PROBE_TAIL = """
optional = %r
result["where"] = where
result["optional_imported"] = sorted(m for m in optional if m in sys.modules)
print(json.dumps(result))
""" % (OPTIONAL,)


@pytest.fixture(scope="module")
def env(built, tmp_path_factory) -> Env:
    """One fresh venv per extra: the wheel (by this interpreter's pip, ``--no-deps``), and links to the
    installed distributions that the extra's requirements pull in."""
    root = tmp_path_factory.mktemp("fresh")
    installed = _installed()
    meta = _wheel_metadata(built.wheel)
    requires = meta.get_all("Requires-Dist") or []
    venvs: dict[str, Path | Exception] = {}
    for extra, extras in EXTRAS.items():
        try:
            names = closure(requires, extras, installed)
        except LookupError as e:
            venvs[extra] = e
            continue
        names.discard("fused-contrastive")
        if extra == "triton":  # the interpreter (TRITON_INTERPRET=1: no GPU in CI) runs kernels on numpy
            names |= closure(["numpy"], (), installed)
        vdir = root / extra
        venv.EnvBuilder(with_pip=False, symlinks=True).create(vdir)
        python = vdir / "bin" / "python"
        _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q",
              built.wheel])
        site = vdir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        assert site.is_dir(), site
        link_distributions(site, names, installed)
        venvs[extra] = vdir
    work = root / "work"
    work.mkdir()
    return Env(root, venvs, work, meta["Version"])


def _assert_isolated(env: Env, result: dict, extra: str = "base") -> None:
    where, vdir = result["where"], env.venv(extra).resolve()
    assert Path(where["file"]).resolve().is_relative_to(vdir), \
        f"fused_contrastive imported from {where['file']}, not from the fresh venv {vdir}"
    assert Path(where["prefix"]).resolve() == vdir
    assert not where["editable_finders"], where


def test_base_install_imports_and_runs_every_loss(env):
    result = env.probe("""
        import fused_contrastive as fc
        import torch
        from fused_contrastive.testing import CASES, compare
        public = sorted(n for n in fc.__all__ if n not in ("__version__", "nn", "encode_in_chunks"))
        result["public"] = public
        result["covered"] = sorted({c.fn.__name__ for c in CASES})
        result["failures"] = []
        for c in CASES:
            cmp = compare(c, max(16, c.min_n), 16, torch.float32, "torch")
            if not cmp.ok:
                result["failures"].append(f"{c.name}: {cmp}")
        result["cases"] = len(CASES)
        # late interaction (token tensors, outside the [rows, D] registry) against its definition, float64:
        # S_ij = sum_a max_b <q_ia, d_jb>, and the loss F.cross_entropy(scale * S on unit tokens, arange)
        g = torch.Generator().manual_seed(0)
        q, d = torch.randn(3, 4, 8, generator=g, dtype=torch.float64), torch.randn(5, 6, 8, generator=g,
                                                                                 dtype=torch.float64)
        ok = torch.allclose(fc.maxsim_scores(q, d, backend="torch"),
                            torch.einsum("iad,jbd->ijab", q, d).amax(-1).sum(-1), rtol=1e-10, atol=1e-10)
        qn, dn = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(d, dim=-1)
        want = torch.nn.functional.cross_entropy(torch.einsum("iad,jbd->ijab", qn, dn).amax(-1).sum(-1) / 0.5,
                                                 torch.arange(3))
        ok_loss = torch.allclose(fc.maxsim_info_nce(q, d, temperature=0.5, backend="torch"), want, rtol=1e-10,
                                 atol=1e-10)
        if ok and ok_loss:
            result["covered"] = sorted(set(result["covered"]) | {"maxsim_scores", "maxsim_info_nce"})
        else:
            result["failures"].append(f"maxsim_scores {ok}, maxsim_info_nce {ok_loss}")
        result["version"] = fc.__version__
        import fused_contrastive.nn, fused_contrastive.integrations.open_clip  # noqa
    """)
    _assert_isolated(env, result)
    assert set(result["public"]) <= set(result["covered"]), "a public loss that the installed wheel does not run"
    assert result["cases"] > 0 and not result["failures"], result["failures"]
    assert result["version"] == env.version
    assert not result["optional_imported"], f"the base install imported {result['optional_imported']}"


#: torch without numpy (a base install: torch does not require numpy) warns at import, in two lines
_TORCH_NUMPY_WARNING = re.compile(r"UserWarning: Failed to initialize NumPy|^\s+cpu = _conversion_method_template")


def _our_lines(stderr: str) -> list[str]:
    return [x for x in stderr.strip().splitlines() if not _TORCH_NUMPY_WARNING.search(x)]


def test_base_install_command_line(env):
    for cmd in ([env.python(), "-m", "fused_contrastive", "--version"],
                [env.venv() / "bin" / "fused-contrastive", "--version"]):  # the module and the console script
        out = _run(cmd, cwd=env.work, env=env.environ()).stdout
        assert out.strip() == f"fused-contrastive {env.version}"
    out = env.run(["-m", "fused_contrastive", "check", "--shapes", "16x16", "--dtypes", "float32",
                   "--losses", "info_nce,clip,cosent"])
    assert "all passed" in out.stdout, out.stdout
    out = env.run(["-m", "fused_contrastive", "bench", "--quick"], check=False)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    assert len(_our_lines(out.stderr)) == 1, out.stderr

    # every sub-command's --help, each bench sub-command without its extra, check: in one process, so
    # that what they imported can be looked at
    result = env.probe("""
        import contextlib, io
        from fused_contrastive.__main__ import COMMANDS, NEEDS, main
        result["help"], result["missing"] = {}, {}
        for sub in COMMANDS:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    main([sub, "--help"])
                    code = "returned"
                except SystemExit as e:
                    code = e.code
            result["help"][sub] = [code, out.getvalue()]
        for sub in [c for c in COMMANDS if NEEDS.get(c)]:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main([sub])
            result["missing"][sub] = [rc, out.getvalue(), err.getvalue()]
        with contextlib.redirect_stdout(io.StringIO()):
            result["rc"] = main(["check", "--shapes", "16x16", "--dtypes", "float32", "--losses", "info_nce"])
    """)
    _assert_isolated(env, result)
    assert set(result["help"]) == set(COMMANDS)
    for sub, (code, text) in result["help"].items():
        assert code == 0 and text.startswith(f"usage: fused-contrastive {sub}"), (sub, code, text[:300])
    assert set(result["missing"]) == set(BENCH_COMMANDS)
    for sub, (rc, out, err) in result["missing"].items():
        lines = _our_lines(err)
        assert rc == 2 and out == "" and len(lines) == 1, (sub, rc, out, err)
        assert f"fused-contrastive {sub}: needs the [bench] extra" in lines[0] and "pip install" in lines[0], lines
    assert result["rc"] == 0
    assert not result["optional_imported"], f"the base install imported {result['optional_imported']}"


def test_triton_extra_runs_every_kernel_under_the_interpreter(env):
    extra = "triton"
    result = env.probe("""
        import torch
        from fused_contrastive.testing import CASES, compare
        result["failures"], result["ran"] = [], 0
        for c in CASES:
            if not c.has_triton:
                continue
            cmp = compare(c, max(16, c.min_n), 16, torch.float32, "triton")
            result["ran"] += 1
            if not cmp.ok:
                result["failures"].append(f"{c.name}: {cmp}")
        result["triton_interpreted"] = os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules
    """, extra, TRITON_INTERPRET="1")
    _assert_isolated(env, result, extra)
    assert result["triton_interpreted"]
    assert result["ran"] > 0 and not result["failures"], result["failures"]


def test_bench_extra_runs_bench_quick(env):
    extra = "bench"
    out_dir = env.work / "bench_out"
    out = env.run(["-m", "fused_contrastive", "bench", "--quick", "--losses", "info_nce", "--sizes", "8", "--dim", "16",
                   "--backends", "torch", "--repeats", "1", "--min-repeats", "1", "--isolate", "inline",
                   "--no-progress", "--out", out_dir], extra)
    assert (out_dir / "bench.json").is_file() and (out_dir / "bench.txt").is_file(), out.stdout[-2000:]
    rows = json.loads((out_dir / "bench.json").read_text())["rows"]
    assert any(r["contender"] == "torch" and r["status"] == "ok" for r in rows)


def test_sentence_transformers_extra_trains_a_step_with_a_drop_in(env):
    extra = "sentence-transformers"
    result = env.probe("""
        import tempfile
        import torch
        from datasets import Dataset
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        from fused_contrastive.bench.st_step import build_tiny_model, load_model, sentences
        from fused_contrastive.integrations.sentence_transformers import MultipleNegativesRankingLoss
        tmp = tempfile.mkdtemp()
        model = load_model(build_tiny_model(os.path.join(tmp, "bert"), hidden=16, layers=1))
        before = [p.detach().clone() for p in model.parameters()]
        data = Dataset.from_dict({"anchor": sentences(8, 4), "positive": sentences(8, 4, seed=1)})
        args = SentenceTransformerTrainingArguments(
            output_dir=os.path.join(tmp, "out"), max_steps=1, per_device_train_batch_size=8, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                             loss=MultipleNegativesRankingLoss(model))
        trainer.train()
        result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result["changed"] = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    """, extra)
    _assert_isolated(env, result, extra)
    assert len(result["losses"]) == 1 and result["losses"][0] == result["losses"][0] > 0
    assert result["changed"] > 0
