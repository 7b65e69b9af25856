"""The ahead-of-time C library (CMakeLists.txt): configure with Ninja into a fresh build directory, build,
run ctest. ctest covers the C API on a mock libcuda (error codes: no driver, no device, no context,
unsupported arch / dtype / shape / mode), ``python -m fused_contrastive.aot check`` (every launch of the C
API against the Python launcher's launches for the same problem: kernel variant, grid, block, shared
memory, every argument value; the launched cubins byte-identical to a fresh ``triton.compile``), and a
consumer project built with ``find_package(fused_contrastive)`` against the installed tree.

CI builds the reduced set (sm_80 + sm_90, bf16, D classes 128 and big: the resident and the streaming
backward); the default build compiles every dtype and D class. Skipped only when cmake/ninja or the CUDA
toolkit's cuda.h are absent; with them present any failure fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cuda_include() -> str | None:
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", "/opt/cuda"):
        if base and (Path(base) / "include" / "cuda.h").is_file():
            return str(Path(base) / "include")
    return None


def _run(cmd, cwd, timeout):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-6000:]}\n{r.stderr[-4000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    missing = [t for t in ("cmake", "ninja") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the C library is not built")
    inc = _cuda_include()
    if inc is None:
        pytest.skip("the CUDA toolkit headers (cuda.h) are not installed: the C library is not built")
    bdir = tmp_path_factory.mktemp("cmake_build")
    env_py = sys.executable
    _run(["cmake", "-S", str(ROOT), "-B", str(bdir), "-G", "Ninja", f"-DFC_PYTHON={env_py}",
          f"-DFC_CUDA_INCLUDE_DIR={inc}", "-DFC_ARCHS=80;90", "-DFC_DTYPES=bf16", "-DFC_DCLASSES=128;big"],
         ROOT, 300)
    _run(["cmake", "--build", str(bdir)], ROOT, 900)
    return bdir


def test_ctest_passes(build):
    out = _run(["ctest", "--test-dir", str(build), "--output-on-failure"], ROOT, 900)
    assert "100% tests passed" in out
    # the tests that must exist (a renamed or dropped test would otherwise pass silently)
    for name in ("fc_no_driver", "fc_no_device", "fc_no_context", "fc_arch_75", "fc_d_not_16",
                 "fc_dtype_fp32_not_built", "fc_python_parity", "fc_consumer_run"):
        assert f" {name} " in out, name
    assert "Passed" in out


def test_manifest_covers_the_python_launcher(build):
    """The generated argument layout of every kernel the Python launcher launches for a covered mode is
    the jit function's parameters minus the launch's constexprs, in order (recorded here on meta tensors
    under the interpreter, whose bf16 UPCAST flag differs from the GPU build's, so only layouts compare);
    both archs have variants; the library embeds them."""
    from fused_contrastive import aot

    man = json.loads((build / "gen" / "manifest.json").read_text())
    built = {(v["cc"], v["variant"]) for v in man["variants"]}
    for cc in (80, 90):
        for mode in aot.MODES:
            for d in (112, 784):
                for ln in aot.record(mode, "bf16", 300, 200, d, aot._ARCH_FAMILY[cc]):
                    params = [k for k in ln.fn.arg_names if k not in ln.constexprs]
                    assert [p["name"] for p in man["layouts"][ln.name]] == params
    per_arch = {cc: len({v for c, v in built if c == cc}) for cc in (80, 90)}
    assert per_arch[80] > 0 and per_arch[90] > 0
    cubins = sum((build / "gen" / f).stat().st_size for f in {v["file"] for v in man["variants"] if v["cc"] == 80})
    assert (build / "libfused_contrastive_kernels.so").stat().st_size > cubins > 0


def test_exported_symbols_are_the_c_api(build):
    """Only the fc_* entry points are exported (the cubin blobs and the tables stay hidden)."""
    if shutil.which("nm") is None:
        pytest.skip("nm not installed")
    lib = build / "libfused_contrastive_kernels.so"
    out = _run(["nm", "-D", "--defined-only", str(lib)], ROOT, 60)
    syms = sorted(line.split()[-1] for line in out.splitlines() if " T " in line or " D " in line or " R " in line)
    header = (ROOT / "include" / "fused_contrastive.h").read_text()
    assert syms and all(s.startswith("fc_") and f" {s}(" in header.replace("*", " ") for s in syms), syms
