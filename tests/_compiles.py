"""Shared by the tests that compile kernels ahead of time for sm_80 / sm_90 (no GPU): run a compile script
in a fresh process (``TRITON_INTERPRET=0``: triton must be imported in compile mode) and check its records
(``fused_contrastive.tools.compile_survey.compile_launch``: registers, spill bytes, shared memory, tensor-core kind)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: Shared memory per block the parts allow (opt-in maximum): A100 163 KiB, H100 227 KiB.
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


def run_compile_script(script: str, timeout: int = 900, **env: str):
    """The JSON the script prints on its last line (it fails the test with the script's stderr)."""
    r = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="0", **env),
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_no_spills_within_smem(records: list[dict]) -> None:
    for r in records:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared"] <= SMEM_LIMIT[r["cc"]], r


def assert_tensor_cores(records: list[dict]) -> None:
    """wgmma (and no mma.sync) on sm_90, mma.sync on sm_80."""
    for r in records:
        if r["cc"] >= 90:
            assert r["tc"] == "wgmma" and r["n_mma"] == 0, r
        else:
            assert r["tc"] == "mma" and r["n_mma"] > 0, r
