"""Every Triton kernel, with every shipped launch config, compiles ahead of time for sm_80 and sm_90.

No GPU is needed: ``triton.compile`` with ``GPUTarget("cuda", cc, 32)`` lowers to PTX and runs the
ptxas bundled with triton on the host (``fused_contrastive.tools.compile_survey``). For every kernel x config
(``core/triton_shared/configs.CONFIGS``) x input dtype x arch, with every optional term of the kernel
switched on (the most registers), we check:

* it compiles, with 0 bytes of register spills (ptxas ``-v``, same flags as triton's own call);
* the PTX uses tensor cores for the matmuls: ``mma.sync`` on sm_80, ``wgmma.mma_async`` on sm_90
  (and no ``mma.sync`` fallback there);
* the shared memory fits the architecture (163 KB on sm_80 / A100, 227 KB on sm_90 / H100);
* no scalar 16-bit global load (the operands are read in vectors).

conftest.py turns the interpreter on for the whole session (the jit functions are then interpreted
and cannot be compiled), so the compiles run in one subprocess with ``TRITON_INTERPRET=0`` (two
worker processes: the machine has two cores).
"""

from __future__ import annotations

import textwrap

import pytest

from tests._compiles import SMEM_LIMIT, run_compile_script

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

_SCRIPT = textwrap.dedent(
    """
    import json
    from concurrent.futures import ProcessPoolExecutor

    from fused_contrastive.core.triton_shared.configs import CONFIGS
    from fused_contrastive.tools import compile_survey

    if __name__ == "__main__":
        with ProcessPoolExecutor(max_workers=2) as ex:
            results = list(ex.map(compile_survey.run_job, compile_survey.jobs()))
        print(json.dumps({"results": results, "configs": sorted(CONFIGS)}))
    """
)

@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_SCRIPT, 900)


def test_every_shipped_config_was_compiled(compiled):
    # each (kernel, arch, dtype, D bucket) of the table is covered by at least one compile with that
    # config's tiles, warps and stages; the positives' forward ("fwd_pos") by one with the positives on
    from fused_contrastive.core.triton_shared.configs import CONFIGS

    def covers(r, key) -> bool:
        k, arch, dt, bucket = key
        cfg = CONFIGS[key]
        kernel = "lse_fwd" if k.startswith("fwd") else "lse_" + k
        return (r["kernel"] == kernel and ("sm90" if r["cc"] >= 90 else "sm80") == arch and r["dtype"] == dt
                and bucket in r["buckets"] and r["num_warps"] == cfg.num_warps
                and r["num_stages"] == cfg.num_stages and r["block"].startswith(f"M{cfg.block_m} N{cfg.block_n} ")
                and (k != "fwd_pos" or r["variant"] == "full")
                and (k != "fwd" or r["variant"] in ("full", "nopos")))  # with the column term and the bias

    missing = [tuple(c) for c in compiled["configs"]
               if not any(covers(r, tuple(c)) for r in compiled["results"])]
    assert not missing, f"shipped configs never compiled: {missing}"
    # the forward's configs without positives were compiled without them: "fwd" with the column term
    # and the bias ("nopos"), the sm_90 row-statistics tiles ("fwd_wide") by the "wide" feature set
    assert any(r["variant"] == "nopos" for r in compiled["results"])
    # the backward with each row's target column split out of its tiles (what a loss with a target runs)
    assert {(r["kernel"], r["variant"]) for r in compiled["results"] if "split" in r["variant"]} == {
        ("lse_bwd_rows", "split"), ("lse_bwd_cols", "split"), ("lse_bwd_rows", "sym_split")}
    wide = [r for r in compiled["results"] if r["variant"] == "wide"]
    assert {(r["cc"], r["dtype"]) for r in wide} == {(90, "fp16"), (90, "bf16")}
    assert all(r["block"].startswith("M128 N256 ") and r["num_warps"] == 8 for r in wide)
    assert {r["kernel"] for r in compiled["results"]} == {"row_norm", "lse_fwd", "lse_bwd_rows", "lse_bwd_cols",
                                                          "pair_cos_fwd", "pair_cos_bwd", "cosent_scan_fwd",
                                                          "cosent_scan_bwd", "siglip_fwd", "siglip_bwd_rows",
                                                          "siglip_bwd_cols"}
    # CoSENT's kernels for every embedding dtype and arch
    cos = {(r["kernel"], r["cc"], r["dtype"]) for r in compiled["results"] if r["variant"] == "cosent"}
    assert {(k, cc, dt) for k in ("pair_cos_fwd", "pair_cos_bwd") for cc in (80, 90)
            for dt in ("fp32", "fp16", "bf16")} <= cos
    assert {r["cc"] for r in compiled["results"]} == {80, 90}


def test_siglip_kernels_compiled_for_every_dtype_arch_and_d_bucket(compiled):
    have = {(r["kernel"], r["cc"], r["dtype"], bucket) for r in compiled["results"] if r["variant"] == "siglip"
            for bucket in r["buckets"]}
    want = {(k, cc, dt, bucket) for k in ("siglip_fwd", "siglip_bwd_rows", "siglip_bwd_cols") for cc in (80, 90)
            for dt in ("fp32", "fp16", "bf16") for bucket in ("d64", "d128", "big")}
    assert not want - have, f"SigLIP compiles missing: {sorted(want - have)}"


def _label(r):
    return (f"{r['kernel']} sm_{r['cc']} {r['dtype']} D={r['d']} {r['variant']} block={r['block']} "
            f"warps={r['num_warps']}")


def test_no_register_spills(compiled):
    bad = [f"{_label(r)}: {r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads ({r['regs']} regs)"
           for r in compiled["results"] if r["spill_stores"] or r["spill_loads"]]
    assert not bad, "\n".join(bad)


def test_tensor_cores_for_the_matmuls(compiled):
    bad = []
    for r in compiled["results"]:
        if r["kernel"] == "row_norm" or r["variant"] == "cosent":  # O(N*D) and O(B) kernels: no matmul
            continue
        if r["cc"] == 80 and not r["n_mma"]:
            bad.append(f"{_label(r)}: no mma.sync")
        if r["cc"] == 90 and (not r["n_wgmma"] or r["n_mma"]):
            bad.append(f"{_label(r)}: {r['n_wgmma']} wgmma, {r['n_mma']} mma.sync (want wgmma only)")
    assert not bad, "\n".join(bad)


def test_no_scalar_16_bit_loads(compiled):
    # every global read of a 16-bit operand is a vector (16-byte loads or the pipeline's cp.async): a mask the
    # compiler cannot prove constant over 8 elements turns each element into its own load (the Matryoshka
    # kernels had 24-48 per kernel), which the GPU model does not price
    bad = [f"{_label(r)}: {r['ld_b16']} scalar 16-bit loads" for r in compiled["results"] if r["ld_b16"]]
    assert not bad, "\n".join(bad)


def test_shared_memory_fits(compiled):
    bad = [f"{_label(r)}: {r['shared']} B" for r in compiled["results"] if r["shared"] > SMEM_LIMIT[r["cc"]]]
    assert not bad, "\n".join(bad)
