"""``bench/gpu_session.py``: a lent GPU's steps sequenced within one budget. Checked here with stand-in steps
(small Python commands): each step's output lands in its own file as it prints, a failing step is recorded
with its exit status, a step that outlives the budget is killed with its process group and its output so far
kept, a step that would start with too little time left is listed as not run, and the summary file says the
same. The real steps' commands are parsed by the scripts' own parsers, so a renamed flag fails here and not
on the GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from fused_contrastive import __main__ as cli

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gs():
    return _load("gpu_session")


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_steps_run_in_order_and_the_budget_ends_them(gs, tmp_path):
    steps = [
        gs.Step("first", _py("print('one'); print('two')"), "prints"),
        gs.Step("fails", _py("import sys; print('about to fail', flush=True); sys.exit(3)"), "exits 3"),
        gs.Step("sleeps", _py("import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"), "too long"),
        gs.Step("late", _py("print('never')"), "no time left"),
    ]
    t0 = time.monotonic()
    summary = gs.run_session(steps, tmp_path, budget=6.0, min_step=2.0)
    assert time.monotonic() - t0 < 30  # the sleeper was killed at the budget, not waited for
    got = {r["step"]: r for r in summary["steps"]}
    assert list(got) == ["first", "fails", "sleeps"] and summary["not_run"] == ["late"]
    assert got["first"]["status"] == "ok" and got["first"]["rc"] == 0
    assert got["fails"]["status"] == "exit 3" and got["fails"]["rc"] == 3
    assert got["sleeps"]["status"] == "timed out" and got["sleeps"]["rc"] is None
    assert 3.0 < got["sleeps"]["wall_s"] < 7.0, got["sleeps"]
    first = (tmp_path / "first.txt").read_text()
    assert first.startswith("$ ") and "one\ntwo\n" in first and "# exit 0" in first
    assert "about to fail" in (tmp_path / "fails.txt").read_text()
    slept = (tmp_path / "sleeps.txt").read_text()
    assert "# TIMED OUT after" in slept
    pid = int(re.search(r"pid (\d+)", slept)[1])
    with pytest.raises(ProcessLookupError):  # its process group was killed
        os.kill(pid, 0)
    assert not (tmp_path / "late.txt").exists()
    assert json.loads((tmp_path / "session.json").read_text()) == json.loads(json.dumps(summary))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fails.txt", "first.txt", "session.json", "sleeps.txt"]


def test_the_steps_see_the_checkout_package(gs, tmp_path):
    # bench/ scripts run as files import fused_contrastive: the checkout's, with nothing installed there
    step = gs.Step("where", _py("import fused_contrastive; print(fused_contrastive.__file__)"), "import")
    (row,) = gs.run_session([step], tmp_path, budget=60.0, min_step=1.0)["steps"]
    assert row["status"] == "ok"
    assert str(ROOT / "fused_contrastive") in (tmp_path / "where.txt").read_text()


def test_the_verdict_step_gets_the_budget_left(gs):
    (validate,) = [s for s in gs.STEPS if s.name == "validate"]
    assert validate.command(1000.0)[-2:] == ["--budget", "240"]  # its cap
    assert validate.command(200.0)[-2:] == ["--budget", "160"]  # what is left, less the margin
    assert validate.command(10.0)[-2:] == ["--budget", "30"]  # never below 30


def test_every_step_parses_with_its_own_script(gs):
    profile = _load("gpu_profile").build_parser()
    parser, _ = cli.build_parser()
    for step in gs.STEPS:
        argv = step.command(540.0, "OUT")
        if argv[1:4] == ["-m", "fused_contrastive", "bench-gpu"]:
            args = parser.parse_args(argv[3:])
            assert args.budget == step.budget_cap and args.out == f"OUT/{step.name}", step
            if step.name == "levers":  # every lever is a form bench-gpu knows, and nothing else is timed
                from fused_contrastive.bench.gpu import FORM_BY_NAME
                assert args.forms.split(",") == list(gs.LEVERS) and set(gs.LEVERS) <= set(FORM_BY_NAME)
                assert args.no_peers and args.no_compile
            if step.name == "maxsim_levers":  # MaxSim's forms, at MaxSim's own sizes
                from fused_contrastive.bench.gpu import FORM_BY_NAME
                assert args.losses == "maxsim" and args.forms.split(",") == list(gs.MAXSIM_LEVERS)
                assert all(FORM_BY_NAME[f].applies("maxsim", 4096, 128) for f in gs.MAXSIM_LEVERS)
                assert args.no_peers and args.no_compile and args.sizes is None
        elif argv[1:3] == ["-m", "fused_contrastive"]:
            args = parser.parse_args(argv[3:])
            assert args.gpu_validate and args.budget == 240.0 and args.jobs == 8, step
        else:
            assert argv[1] == "bench/gpu_profile.py", step
            profile.parse_args(argv[2:])  # SystemExit(2) on a flag the script does not have
    # the device tool returns files named in letters, digits, '.', '_' and '-' (at most eight: pack() below)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", s.name) for s in gs.STEPS)
    assert len({s.name for s in gs.STEPS}) == len(gs.STEPS)


def test_the_readme_lists_the_steps(gs):
    # the README's GPU commands are the session's steps (one place to look, the same flags)
    readme = (ROOT / "docs" / "gpu-measurements.md").read_text()  # the README links its GPU commands there
    block = readme[readme.index("## Running on a GPU"):readme.index("## Measured on an H200")]
    listed = {" ".join(line.split("#")[0].split()) for line in block.splitlines()
              if line.startswith("python bench/gpu_profile.py")}
    ours = {" ".join(["python", *s.argv[1:]]).replace("--losses  ", '--losses "" ') for s in gs.STEPS
            if s.argv[1] == "bench/gpu_profile.py"}
    assert listed == ours, (listed ^ ours)
    assert "python bench/gpu_session.py --out" in block


def test_unknown_steps_are_refused_by_name(gs, capsys):
    with pytest.raises(SystemExit, match="--steps: unknown step.*nope"):
        gs.main(["--steps", "validate,nope", "--list"])
    assert gs.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(s.name in out for s in gs.STEPS)


def test_more_files_than_the_device_returns_are_packed_into_one_archive(gs, tmp_path):
    import tarfile

    (tmp_path / "sub").mkdir()
    want = {f"f{i}.txt": f"file {i}\n" for i in range(6)} | {"sub/a.jsonl": "{}\n", "sub/b.png": "png"}
    for name, text in want.items():
        (tmp_path / name).write_text(text)
    assert gs.pack(tmp_path) == []  # eight files: they all come back as they are
    (tmp_path / "session.json").write_text("{}")
    packed = gs.pack(tmp_path)
    assert sorted(packed) == sorted(want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.json", gs.PACK]  # the empty sub/ removed too
    with tarfile.open(tmp_path / gs.PACK) as tar:
        got = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert got == want
