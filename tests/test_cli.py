"""The command line: `check` (its table, its exit code, that it can fail) and the traps of the first
release (unknown names, malformed options, --version, --help)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import fused_contrastive as fc
from fused_contrastive import __main__ as cli
from fused_contrastive.testing import CASES


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fused_contrastive", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_check_passes_and_prints_a_row_per_case_backend_path():
    out = _cli("check", "--shapes", "5x3", "--dtypes", "float32", "--backends", "torch")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.endswith("PASS")]
    assert len(rows) == 2 * len(CASES)  # dense and chunked
    assert {r.split()[1] for r in rows} == {"torch/dense", "torch/chunked"}
    assert "all passed" in out.stdout


def test_check_fails_on_a_wrong_backend(monkeypatch, capsys):
    """Shift every core-op result by 0.01: check must print FAIL and exit 1."""
    from fused_contrastive import core

    orig = core.run
    monkeypatch.setattr(core, "run", lambda *a, **k: orig(*a, **k) + 0.01)
    code = cli.main(["check", "--shapes", "9x4", "--dtypes", "float32", "--backends", "torch",
                     "--losses", "info_nce,supcon_out"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "PASS" not in out


def test_default_command_is_check(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "check", lambda args, parser: seen.append(args.command) or 0)
    assert cli.main([]) == 0 and seen == ["check"]


@pytest.mark.parametrize("args,needle", [
    (["check", "--losses", "simcse_2vew"], "valid: info_nce"),
    (["check", "--losses", ""], "unknown case"),
    (["check", "--dtypes", "fp32"], "valid: float32"),
    (["check", "--shapes", "4by8"], "not NxD"),
    (["check", "--shapes", "0x8"], ">= 1"),
    (["check", "--backends", "cuda"], "valid: torch, triton"),
    (["bench", "--losses", "supcon"], "valid: info_nce"),
    (["bench", "--sizes", "3,5"], "even numbers"),
    (["bench", "--repeats", "0"], "must be > 0"),
    (["bench", "--dtype", "fp32"], "invalid choice"),
    (["bench-encode", "--chunk", "0"], "--chunk must be >= 1"),
    (["bench-encode", "--batch", "33"], "must be even"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_options_exit_2_with_a_message_and_no_traceback(args, needle):
    out = _cli(*args)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def _in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m fused_contrastive ARGS`` in this process (argparse's exits caught): ``(exit code,
    stdout, stderr)``. The sub-commands' help and usage errors, without an interpreter start each."""
    with pytest.raises(SystemExit) as stop:
        cli.main(list(args))
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def test_version_and_help(capsys):
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"fused-contrastive {fc.__version__}"
    out = _cli("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage:")
    assert ("{check,bench,bench-encode,bench-gather,bench-matryoshka,bench-gist,bench-st-step,bench-maxsim,"
            "bench-gpu}" in out.stdout)
    for sub in cli.COMMANDS:  # every sub-command named in the top-level help, its own help plain text
        assert sub in out.stdout.split("usage:")[1].split("\n\n")[0], sub
    for sub, option in (("check", "--losses"), ("bench", "--losses"), ("bench-encode", "--chunk"),
                        ("bench-gather", "--world"), ("bench-matryoshka", "--dims"), ("bench-gist", "--guide-dim"),
                        ("bench-st-step", "--batches"), ("bench-maxsim", "--no-peers"), ("bench-gpu", "--forms")):
        code, text, _ = _in_process(capsys, sub, "--help")
        assert code == 0 and option in text, (sub, text)
        for markup in ("``", ":func:", ":class:", "python -m fused_contrastive"):
            assert markup not in text, (sub, markup)


@pytest.mark.parametrize("sub", ["check", "bench", "bench-encode", "bench-gather", "bench-matryoshka", "bench-gist",
                                 "bench-st-step", "bench-maxsim"])
def test_an_unknown_option_is_answered_by_the_sub_commands_usage(sub, capsys):
    if sub == "check":  # one through the real entry point: a clean usage error, no traceback
        out = _cli(sub, "--foo")
        code, err = out.returncode, out.stderr
        assert "Traceback" not in err
    else:
        code, _, err = _in_process(capsys, sub, "--foo")
    assert code == 2
    assert err.startswith(f"usage: fused-contrastive {sub} "), err
    assert f"fused-contrastive {sub}: error: unrecognized arguments: --foo" in err


def test_console_script_is_installed():
    exe = shutil.which("fused-contrastive")
    assert exe is not None, "pip install -e . installs the fused-contrastive command"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and fc.__version__ in out.stdout


def test_check_list_names_every_case(capsys):
    assert cli.main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == [c.name for c in CASES]


def test_bench_encode_end_to_end():
    """bench-encode runs both steps and prints their times, peaks and the ratios."""
    out = _cli("bench-encode", "--batch", "32", "--chunk", "8", "--seq", "4", "--repeats", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    firsts = [line.split()[:1] for line in lines]
    assert ["plain"] in firsts and ["cached"] in firsts
    assert "cached / plain: time" in out.stdout and "peak memory" in out.stdout


def test_bench_gather_computes_bytes_per_rank():
    """bench-gather: info_nce at N = 65536, D = 768, bf16, 8 ranks gathers 96 MiB of keys; a ring sends
    7/8 of it forward and backward (hand-derived: 65536 * 768 * 2 B = 96 MiB; 7/8 = 84 MiB)."""
    out = _cli("bench-gather", "--n", "65536", "--d", "768", "--dtype", "bfloat16", "--world", "8")
    assert out.returncode == 0, out.stderr
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("info_nce"))
    assert row[1:] == ["84", "84", "192"], row
    assert "COMPUTED" in out.stdout


def test_check_rejects_a_device_this_machine_lacks_up_front():
    """One usage error (exit 2) naming --device, before any case runs: no FAIL row per case, no
    traceback."""
    import torch

    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    for dev, says in ((missing, "--device"), ("tpu", "not a torch device")):
        r = _cli("check", "--device", dev, "--losses", "info_nce_target", "--shapes", "3x2")
        assert r.returncode == 2, (dev, r.returncode, r.stdout[-500:])
        assert "--device" in r.stderr and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "FAIL" not in r.stdout, r.stdout


def test_check_says_how_long_it_takes(monkeypatch, capsys):
    """check's help and first line say how long the default run takes (as measured: 948 rows in 29.7 s on an idle
    2-core CPU); its first line's row count is the rows it then checks, and the last line the time."""
    import re
    import types

    from fused_contrastive import testing

    assert "30 seconds" in cli.DEFAULT_CHECK_TIME and "busy" in cli.DEFAULT_CHECK_TIME
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert cli.DEFAULT_CHECK_TIME in readme  # the README's "Check a new machine" says the same
    code, text, _ = _in_process(capsys, "check", "--help")
    assert code == 0 and cli.DEFAULT_CHECK_TIME in " ".join(text.split())
    # every row passes instantly: the plan, not the losses, is under test here
    monkeypatch.setattr(testing, "compare", lambda *a, **k: types.SimpleNamespace(
        ok=True, loss_err=0.0, loss_tol=1.0, grad_err=0.0, grad_tol=1.0))
    assert cli.main(["check", "--backends", "torch"]) == 0
    out = capsys.readouterr().out
    first = re.search(r"^(\d+) rows to check \(with the default options: (.*)\)$", out, re.MULTILINE)
    assert first and first.group(2).startswith(cli.DEFAULT_CHECK_TIME), out[:400]
    passed = [line for line in out.splitlines() if line.endswith("PASS")]
    # every case of the registry runs on the torch backend's two paths in the default dtypes and shapes
    assert int(first.group(1)) == len(passed) > 2 * len(testing.CASES)
    assert re.search(rf"^{len(passed)} rows, all passed in [\d.]+ s$", out, re.MULTILINE)


def test_the_cli_hides_torchs_numpy_warning_only(tmp_path):
    """Without NumPy (an install without an extra) torch warns "Failed to initialize NumPy" at import: the
    command line silences that one message in its own process; importing the library keeps it."""
    import os

    stub = tmp_path / "numpy"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False,
                              env=env)

    bare = run("-c", "import fused_contrastive; import numpy")
    assert "Failed to initialize NumPy" in bare.stderr, bare.stderr  # the stub blocks NumPy; torch warns
    assert "ModuleNotFoundError" in bare.stderr
    for args in (["--version"], ["check", "--losses", "info_nce", "--shapes", "4x3", "--dtypes", "float32"]):
        out = run("-m", "fused_contrastive", *args)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "NumPy" not in out.stderr, (args, out.stderr)
