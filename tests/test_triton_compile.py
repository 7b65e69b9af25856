"""Every Triton kernel, with every shipped launch config, compiles ahead of time for sm_80 and sm_90.

No GPU is needed: ``triton.compile`` with ``GPUTarget("cuda", cc, 32)`` lowers to PTX and runs the
ptxas bundled with triton on the host. For every kernel x config (``_triton_core.CONFIGS``) x input
dtype x arch, with every optional term of the kernel switched on (the most registers), we check:

* it compiles, with 0 bytes of register spills (ptxas ``-v``, same flags as triton's own call);
* the PTX uses tensor cores for the matmuls: ``mma.sync`` on sm_80, ``wgmma.mma_async`` on sm_90
  (and no ``mma.sync`` fallback there);
* the shared memory fits the architecture (163 KB on sm_80 / A100, 227 KB on sm_90 / H100).

conftest.py turns the interpreter on for the whole session (the jit functions are then interpreted
and cannot be compiled), so the compiles run in one subprocess with ``TRITON_INTERPRET=0`` (two
worker processes: the machine has two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from concurrent.futures import ProcessPoolExecutor

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(80).path
        assert os.access(ptxas, os.X_OK), ptxas
    except Exception as e:  # no NVIDIA backend / no ptxas on this machine
        print(json.dumps({"skip": f"ptxas unavailable: {type(e).__name__}: {e}"}))
        sys.exit(0)

    from fused_contrastive import _triton_core as T

    if __name__ == "__main__":
        jobs = T.aot_jobs()
        with ProcessPoolExecutor(max_workers=2) as ex:
            results = list(ex.map(T.aot_run_job, jobs))
        configs = sorted({(k, a, dt, db) for (k, a, dt, db) in T.CONFIGS})
        print(json.dumps({"results": results, "configs": configs}))
    """
)

SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def test_every_shipped_config_was_compiled(compiled):
    # each (kernel, arch, dtype, D bucket) of the table is covered by at least one compile
    have = {(r["kernel"].replace("lse_", ""), "sm90" if r["cc"] >= 90 else "sm80", r["dtype"], bucket)
            for r in compiled["results"] for bucket in r["buckets"]}
    missing = [tuple(c) for c in compiled["configs"] if tuple(c) not in have]
    assert not missing, f"shipped configs never compiled: {missing}"
    assert {r["kernel"] for r in compiled["results"]} == {"row_norm", "lse_fwd", "lse_bwd_rows", "lse_bwd_cols"}
    assert {r["cc"] for r in compiled["results"]} == {80, 90}


def _label(r):
    return f"{r['kernel']} sm_{r['cc']} {r['dtype']} D={r['d']} {r['variant']} block={r['block']} warps={r['num_warps']}"


def test_no_register_spills(compiled):
    bad = [f"{_label(r)}: {r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads ({r['regs']} regs)"
           for r in compiled["results"] if r["spill_stores"] or r["spill_loads"]]
    assert not bad, "\n".join(bad)


def test_tensor_cores_for_the_matmuls(compiled):
    bad = []
    for r in compiled["results"]:
        if r["kernel"] == "row_norm":  # the O(N*D) prologue has no matmul
            continue
        if r["cc"] == 80 and not r["n_mma"]:
            bad.append(f"{_label(r)}: no mma.sync")
        if r["cc"] == 90 and (not r["n_wgmma"] or r["n_mma"]):
            bad.append(f"{_label(r)}: {r['n_wgmma']} wgmma, {r['n_mma']} mma.sync (want wgmma only)")
    assert not bad, "\n".join(bad)


def test_shared_memory_fits(compiled):
    bad = [f"{_label(r)}: {r['shared']} B" for r in compiled["results"] if r["shared"] > SMEM_LIMIT[r["cc"]]]
    assert not bad, "\n".join(bad)
