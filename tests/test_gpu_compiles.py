"""bench/gpu_compiles.py: it records every route's launches on the meta device, compiles each distinct one once,
and fails when one does not compile (planted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gc():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("gpu_compiles", ROOT / "bench" / "gpu_compiles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_family_is_recorded_and_each_launch_once(gc):
    found, broken = gc.collect([4096], [90])
    assert not broken
    names = {lz.name for lz, _, _ in found.values()}
    # the one pass's row kernels (which Triton 3.6 could not compile), the guided blocks', SigLIP's, the
    # Matryoshka kernels' and MaxSim's
    assert {"epi_gemm", "epi_rows", "guided_epi", "guided_rows", "epi_gemm_siglip", "mat_fwd", "mat_epi",
            "maxsim_fwd", "siglip_pass"} <= names, names
    assert len(found) == len({k for k in found})  # keyed: identical launches once


def test_a_launch_that_does_not_compile_fails_the_run(gc, monkeypatch, capsys):
    calls = []

    def compile_launch(lz, cc):
        calls.append(lz.name)
        if lz.name == "epi_rows":
            raise RuntimeError("PassManager::run failed")
        return {"regs": 64, "spill": 0, "tc": "none"}

    monkeypatch.setattr(gc.compile_survey, "compile_launch", compile_launch)
    monkeypatch.setattr(gc, "recordings", lambda sizes, d=768: [
        r for r in gc.__dict__["_all_recordings"](sizes, d) if r[0].startswith("info_nce N=4096 panel")])
    assert gc.main(["--n", "4096", "--cc", "90", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "epi_rows" in out and "FAIL RuntimeError: PassManager::run failed" in out
    assert f"{calls.count('epi_rows')} failed" in out and calls.count("epi_rows") >= 1
