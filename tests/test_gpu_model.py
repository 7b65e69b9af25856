"""bench/gpu_model.py (a MODEL of GPU times from compiled artefacts): its output parses and its numbers
pass checks computed here independently of the script.

The script compiles kernels (``TRITON_INTERPRET=0``), so it runs in a subprocess (this session runs the
interpreter, see conftest.py), once per module: two GPUs (sm_80 and sm_90) at the two sizes of the
committed table, without the torch backend's op count (its tens of thousands of meta-device ops are
the slow part; the committed output has it and is checked too).

Independent checks: the floor is ``units x 2 N N D / peak`` with the units derived by hand from
docs/core-op.md and docs/panel-path.md (3 for InfoNCE and CLIP, 2 for symmetric
SimCSE) and the peak read from the printed
assumptions; no kernel is faster than its own FLOPs at peak; ``pct_peak = floor / ms``; the naive
formula's fp32 logits are ``N x N x 4`` bytes; the tensor-core FLOPs the TTGIR walk finds equal the
hand formula of each kernel (forward 2NMD, each backward kernel 4NMD); the L2 traffic of the streaming
backward equals the loop structure written out by hand from kernels/lse.py; N = 65536 against 16384
scales the matmul terms by 16.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_model.py"
COMMITTED = ROOT / "bench" / "results" / "gpu_model" / "gpu_model.txt"
UNITS = {"info_nce": 3, "simcse": 2, "clip": 3}  # docs/core-op.md: logits + one GEMM per gradient side; sym: 2
D = 768


def _run(args: list[str]) -> str:
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                       timeout=900, check=False, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


@pytest.fixture(scope="module")
def fresh() -> str:
    return _run(["--sizes", "16384,65536", "--gpus", "A100,H100", "--no-torch", "--no-compare"])


def _records(text: str, matryoshka: bool = False, gist: bool = False) -> list[dict]:
    """The JSON lines: the core-op losses' records, or those of ``--matryoshka`` / ``--gist``."""
    recs = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    kind = "info_nce_matryoshka" if matryoshka else ("gist" if gist else None)
    if kind is None:
        return [r for r in recs if r["loss"] not in ("info_nce_matryoshka", "matryoshka5", "gist", "siglip", "maxsim")]
    return [r for r in recs if r["loss"] == kind]


def _peaks(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"- (\w+): sm_\d+, \d+ SMs, .*? bf16 ([\d.]+) /", text)}


def _check(text: str, gpus: set[str], sizes: set[int], with_torch: bool, tri_target: bool = True) -> None:
    """The independent checks of a model output. ``tri_target``: the output was made since the statistics forward
    on the epilogue GEMM takes each row's target logit from the target term's row kernel (``triton_panel.stats_forward``
    with the target split: one more ``target_rows`` launch in SimCSE's forward, and in CLIP's, where that form runs);
    the committed output predates it."""
    assert "MODEL - not a measurement" in text
    recs = _records(text)
    peaks = _peaks(text)
    assert set(peaks) == gpus
    keys = {"loss", "gpu", "n", "ms", "pct_peak", "floor_ms", "naive_ms"}
    assert {(r["loss"], r["gpu"], r["n"]) for r in recs} == {(lo, g, n) for lo in UNITS for g in gpus for n in sizes}
    for r in recs:
        assert keys <= set(r), r
        n = r["n"]
        floor = UNITS[r["loss"]] * 2 * n * n * D / (peaks[r["gpu"]] * 1e12) * 1e3
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-4, abs=1e-4)
        assert r["ms"] >= r["floor_ms"]
        # the range runs every assumption at its optimistic, then its pessimistic end: it brackets the
        # central figure, for the path triton takes and for each path separately
        for key in ("ms", "fused_ms", "panel_ms", "naive_ms_if_memory"):
            lo, hi = r[f"{key}_range"]
            assert r["floor_ms"] <= lo <= r[key] <= hi, (key, lo, r[key], hi)
        assert r["pct_peak"] == pytest.approx(100 * floor / r["ms"], rel=1e-3)
        assert r["naive_logits_bytes"] == n * n * 4
        if r["naive_fits"]:
            assert r["naive_ms"] is not None and r["naive_ms"] > 0
        else:
            assert r["naive_ms"] is None
        # the path backend="triton" takes on CUDA: the kernels plus the ATen ops around them
        assert r["ms"] == (r["panel_ms"] if r["path"] == "panel" else r["fused_ms"])
        assert sum(k["ms"] for k in r["kernels"]) + r["aten_ms"] == pytest.approx(r["ms"], rel=1e-3)
        assert r["fused_ms"] >= r["floor_ms"] and r["panel_ms"] >= r["floor_ms"]
        if r["panel_form_taken"] == "cublas":
            # launches of the panel path, from the panel-height formula of triton_panel.py's docstring
            # (bf16, default budget 0.70e9)
            p = min(n, (700_000_000 - 4 * n * D) // (6 * n + 8 * D + 16) // 64 * 64)
            panels, chunks = -(-n // p), -(-n // ((1 << 22) // D))
            launches: dict[str, int] = {}
            for k in r["kernels"]:  # grouped by kernel and config: sum per kernel
                launches[k["kernel"]] = launches.get(k["kernel"], 0) + k["launches"]
            assert ("lse_fwd" in launches) == (r["loss"] in ("clip", "simcse")), launches
            if r["loss"] == "simcse":
                # the triangular forward (the fused forward kernel over half the tiles: no GEMM), then the
                # triangular backward: panel [r0, r0 + p) against columns [r0, n), its logits (2 p c D),
                # H @ A[r0:] (2 p c D) and H[:, p:]^T @ A_P (2 p (c - p) D): 1.5 units plus the diagonal blocks
                flops = sum(2 * 2 * min(p, n - r0) * (n - r0) * D + 2 * min(p, n - r0) * (n - r0 - p) * D
                            for r0 in range(0, n, p) if n - r0 > p) + 2 * 2 * (n % p or p) ** 2 * D
                assert r["panel_gemm_flops"] == flops, (r["panel_gemm_flops"], flops)
                assert 1.5 < r["panel_gemm_flops"] / (2 * n * n * D) < 1.5 + p / n + 1e-9
                fwd = next(k for k in r["kernels"] if k["kernel"] == "lse_fwd")
                assert fwd["launches"] == 1 and 0.5 < fwd["flops"] / (2 * n * n * D) < 0.5 + 0.01, fwd
                # the forward's row norms (one launch); per backward panel its rows' norms, and B's chunks;
                # one panel kernel per panel; one row epilogue (dA)
                assert launches["row_norm"] == 1 + panels + chunks, (launches, p)
                assert launches["panel_dl"] == panels and launches["panel_rows"] == 1, launches
            else:
                # the eager sweep of a summed loss without a column term is 3 units (logits, dl @ B,
                # dl^T @ A); CLIP 3 after the fused forward's unit
                assert r["panel_gemm_flops"] == 3 * 2 * n * n * D
                # the row-norm prologue once per panel of A plus once per chunk of 2^22 elements of B (+ A
                # and B in CLIP's fused forward); one panel kernel per panel; one row epilogue per panel
                # plus dB's
                assert launches["row_norm"] == panels + chunks + (2 if r["loss"] == "clip" else 0), (launches, p)
                assert launches["panel_dl"] == panels and launches["panel_rows"] == panels + 1, launches
        else:
            # launches of the panel path (the epilogue GEMM forms the 16-bit tiles), from the panel-height
            # formula of panels.panel_rows (bf16, default budget 0.70e9): the sweep's panels (with the
            # dB accumulator) and the statistics forward's (without)
            per_row = 2 * n + 12 * -(-n // 64) + 8 * D + 16
            p = min(n, (700_000_000 - 4 * n * D) // per_row // 64 * 64)
            ps = min(n, 700_000_000 // per_row // 64 * 64)
            panels, stat_panels, chunks = -(-n // p), -(-n // ps), -(-n // ((1 << 22) // D))
            launches = {}
            for k in r["kernels"]:  # grouped by kernel and config: sum per kernel
                launches[k["kernel"]] = launches.get(k["kernel"], 0) + k["launches"]
            assert "lse_fwd" not in launches and "panel_dl" not in launches, launches
            # the statistics forward (MODE 3) where the statistics come first (CLIP's column term, SimCSE's
            # triangle); InfoNCE's eager one-pass sweep forms them itself
            want_stats = stat_panels if r["loss"] in ("clip", "simcse") else 0
            assert launches.get("epi_gemm_stats", 0) == want_stats, launches
            assert launches["epi_gemm"] == panels, launches
            if r["loss"] == "simcse":
                # the triangular statistics forward: panel [r0, r0 + p) against columns [r0, n), half a unit
                # plus the diagonal blocks (tiles padded to 128); the triangular backward: the epilogue GEMM
                # forms H from the same panel, cuBLAS H @ A[r0:] (2 p c D) and H[:, p:]^T @ A_P (2 p (c - p) D)
                fwd = sum(k["flops"] for k in r["kernels"] if k["kernel"] == "epi_gemm_stats")
                assert 0.5 < fwd / (2 * n * n * D) < 0.5 + ps / n + 0.02, fwd
                flops = sum(2 * min(p, n - r0) * (n - r0) * D + 2 * min(p, n - r0) * max(0, n - r0 - p) * D
                            for r0 in range(0, n, p))
                assert r["panel_gemm_flops"] == flops, (r["panel_gemm_flops"], flops)
                assert r["panel_gemm_flops"] == 2 * n * n * D  # one unit: sum_k P_k (2 c_k - P_k) = N^2
                # row norms: the forward's (B's chunks, each statistics panel's rows) and the backward's
                assert launches["row_norm"] == 2 * chunks + stat_panels + panels, (launches, p, ps)
                assert launches["panel_rows"] == 1, launches
            else:
                # the logits in the epilogue GEMM (1 unit, Triton), dl @ B and dl^T @ A in cuBLAS (2 units)
                assert r["panel_gemm_flops"] == 2 * 2 * n * n * D
                # the row-norm prologue once per panel of A plus once per chunk of 2^22 elements of B, in the
                # sweep and (CLIP) in the statistics forward; one row epilogue per panel plus dB's
                fwd_norms = stat_panels + chunks if r["loss"] == "clip" else 0
                assert launches["row_norm"] == panels + chunks + fwd_norms, (launches, p)
                assert launches["panel_rows"] == panels + 1, launches
                # InfoNCE's one-pass sweep: one redo launch per panel (its programs return at once), and the
                # per-row bookkeeping (epi_rows) before and after it
                assert launches.get("epi_gemm_redo", 0) == (panels if r["loss"] == "info_nce" else 0), launches
                assert launches.get("epi_rows", 0) == (2 * panels if r["loss"] == "info_nce" else 0), launches
        # the target term (each of these losses has one): its row kernel's forward and backward, on every path,
        # and (tri_target) the split statistics forward's target logits on the epilogue GEMM (SimCSE's triangle, CLIP)
        extra = tri_target and r["loss"] in ("simcse", "clip") and r["panel_form_taken"] == "epilogue"
        assert launches["target_rows"] == 2 + extra, launches
        # which panel form "auto" takes is decided by measurements (fused_contrastive/routes.py and its test),
        # not by the model: it prints the form it would prefer, and what it prices is the form taken
        assert r["panel_ms"] == (r["panel_epilogue_ms"] if r["panel_form_taken"] == "epilogue" else
                                 r["panel_cublas_ms"])
        assert r["panel_norm_launches"] == 0  # no ATen norms (core/norms.py) on the panel path
        for k in r["kernels"] + r["fused_kernels"]:
            assert k["ms"] * 1e-3 >= k["flops"] / (peaks[r["gpu"]] * 1e12), k
            hand = {"lse_fwd": 2 * n * n * D, "lse_bwd_rows": 4 * n * n * D, "lse_bwd_cols": 4 * n * n * D}
            tri = r["loss"] == "simcse" and k in r["kernels"]  # the triangular forward: checked above
            if k["kernel"] in hand and not tri:
                assert k["flops"] == hand[k["kernel"]], k
        if with_torch:
            assert r["torch_ms"] > 0 and r["torch_launches"] > 0
    by = {(r["loss"], r["gpu"], r["n"]): r for r in recs}
    for lo in UNITS:
        for g in gpus:
            small, big = by[(lo, g, 16384)], by[(lo, g, 65536)]
            assert big["floor_ms"] / small["floor_ms"] == pytest.approx(16, rel=1e-3)
            assert big["naive_gemm_flops"] == 16 * small["naive_gemm_flops"]
            assert big["naive_gemm_ms"] / small["naive_gemm_ms"] == pytest.approx(16, rel=0.02)
            for kb, ks in zip(big["fused_kernels"], small["fused_kernels"], strict=True):
                if kb["kernel"].startswith("lse_"):
                    assert kb["flops"] == 16 * ks["flops"]
                    # matmul-bound kernels scale with the work (the wave tail of a small grid aside)
                    assert 8 <= kb["ms"] / ks["ms"] <= 24, (lo, g, kb, ks)


def test_fresh_output_passes_the_independent_checks(fresh):
    _check(fresh, {"A100", "H100"}, {16384, 65536}, with_torch=False)


def test_committed_output_passes_the_independent_checks():
    text = COMMITTED.read_text()
    assert text.startswith("$ python bench/gpu_model.py")  # the command that produced it
    _check(text, {"A100", "H100", "H200"}, {16384, 65536}, with_torch=True, tri_target=False)


def test_streaming_backward_l2_bytes_follow_the_loop_structure(fresh):
    # kernels/lse.py, lse_bwd_rows with D > 128 (streaming): per 64 x 64 tile the recompute loads both
    # operand tiles over all of D, _accumulate loads the column operand again and read-modify-writes
    # the fp32 scratch rows (the first column tile only stores). Plus per column tile the inverse
    # norms of the columns. Block sizes: core/triton_shared/configs.py (bwd, "big": 64 x 64 x 64, bf16).
    bm = bn = 64
    es = 2
    for r in _records(fresh):
        if r["loss"] != "info_nce":
            continue
        n = r["n"]
        rows = next(k for k in r["fused_kernels"] if k["kernel"] == "lse_bwd_rows")
        assert rows["block"] == "M64 N64 D64"
        tiles = (n // bm) * (n // bn)
        per_tile = (bm + 2 * bn) * D * es + 2 * bm * D * 4
        hand = tiles * per_tile
        assert rows["l2_bytes"] == pytest.approx(hand, rel=0.02), (rows["l2_bytes"], hand)


def test_ttgir_walk_counts_ops_times_enclosing_trip_counts():
    # a hand-written TTGIR: an outer loop over M (step 64), an inner loop over D (step 32) with one
    # 64x32 bf16 load, one dot 64x64x32, one exp and one multiply of a 64x64 tile and an integer address
    # op per inner iteration; after it a compare, a select, a row reduction, a constant and a masked store
    code = r'''
import json, sys
sys.path.insert(0, "bench")
import gpu_model as G
ir = """#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 8]}>
module {
  tt.func public @k() {
    %r = scf.for %j0 = %c0_i32 to %M step %c64_i32 iter_args(%x = %y) -> (f32)  : i32 {
      %q = scf.for %d0 = %c0_i32 to %D step %c32_i32 iter_args(%z = %w) -> (f32)  : i32 {
        %a = tt.load %p : tensor<64x32x!tt.ptr<bf16>, #blocked>
        %c = tt.dot %a1, %b1, %acc : tensor<64x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<32x64xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<64x64xf32, #mma>
        %e = math.exp %c : tensor<64x64xf32, #mma>
        %i = arith.addi %u, %u : tensor<64x32xi32, #blocked>
        %f = arith.mulf %c, %c : tensor<64x64xf32, #mma>
        scf.yield %z : f32
      }
      %g = arith.cmpi slt, %u, %u : tensor<64x64xi32, #mma>
      %h = arith.select %g, %c, %c : tensor<64x64xi1, #mma>, tensor<64x64xf32, #mma>
      %s = "tt.reduce"(%h) <{axis = 1 : i32}> ({
      ^bb0(%s0: f32, %s1: f32):
        %s2 = arith.addf %s0, %s1 : f32
        tt.reduce.return %s2 : f32
      }) : (tensor<64x64xf32, #mma>) -> tensor<64xf32, #ttg.slice<{dim = 1, parent = #mma}>>
      %k = arith.constant dense<0.0> : tensor<64x64xf32, #mma>
      %m1 = arith.cmpi slt, %u2, %u2 : tensor<64xi32, #blocked>
      %m2 = arith.andi %m1, %m1 : tensor<64xi1, #blocked>
      tt.store %o, %v, %m2 : tensor<64x!tt.ptr<f32>, #blocked>
      scf.yield %x : f32
    }
    tt.return
  }
}"""
print(json.dumps(G.walk_ttgir(ir, dict(M=640, D=96))))
'''  # noqa: E501 (one line of TTGIR as Triton prints it)
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    w = json.loads(r.stdout.strip().splitlines()[-1])
    outer, inner = 640 // 64, 96 // 32
    assert w["gload"] == outer * inner * 64 * 32 * 2
    assert w["flops"] == outer * inner * 2 * 64 * 64 * 32
    assert w["exp"] == outer * inner * 64 * 64
    assert w["gstore"] == outer * 64 * 4
    # ALU elements: the float op in the D loop (not its integer address op), and per column tile the
    # compare, the select and the 64 x 64 elements the reduction reads (not its scalar body, not a constant,
    # not the store's mask: two integer ops that only feed a memory access, one per vector on the GPU)
    assert w["alu"] == outer * inner * 64 * 64 + outer * 3 * 64 * 64


def test_readme_table_is_the_committed_model_output():
    # the README's table of modelled times quotes the committed output (rounded as printed there)
    recs = {(r["loss"], r["gpu"], r["n"]): r for r in _records(COMMITTED.read_text())}
    readme = (ROOT / "docs" / "kernels.md").read_text()
    pat = re.compile(r"^\| (\w+) \| (A100|H100|H200) \| (\d+) \| ([\d.]+) ms \| ([\d.]+) ms \| ([\d.]+) ms \| "
                     r"([\d.]+) ms \(([\d.]+)-([\d.]+)\) \| (\d+) % \|$", re.MULTILINE)
    rows = pat.findall(readme)
    assert len(rows) >= 12, "the README's table of modelled times is missing"
    for loss, gpu, n, floor, naive, fused, panel, lo, hi, pct in rows:
        r = recs[(loss, gpu, int(n))]
        want = (f"{r['floor_ms']:.1f}", f"{r['naive_ms']:.1f}", f"{r['fused_ms']:.1f}", f"{r['panel_ms']:.1f}",
                f"{r['panel_ms_range'][0]:.1f}", f"{r['panel_ms_range'][1]:.1f}", f"{r['panel_pct_peak']:.0f}")
        assert (floor, naive, fused, panel, lo, hi, pct) == want, (loss, gpu, n)


def _assumed(text: str) -> dict[str, tuple[float, float, float, str]]:
    """The printed assumed values: name -> (optimistic, central, pessimistic, source)."""
    pat = re.compile(r"^  - (\w+) = ([\d.]+) / ([\d.]+) / ([\d.]+): .*\n      source: (.+)$", re.MULTILINE)
    return {m[1]: (float(m[2]), float(m[3]), float(m[4]), m[5]) for m in pat.finditer(text)}


def test_every_assumption_is_printed_with_a_source_that_quotes_its_values(fresh):
    # a value changed without its printed source fails here: the source must quote all three values
    got = _assumed(fresh)
    assert set(got) >= {"hbm_stream", "hbm_unpipelined", "l2_frac", "cublas_spread", "gemm_k0", "splitk"}, got
    for name, (opt, cen, pes, src) in got.items():
        assert len(src) > 40, (name, src)
        assert f"{pes:g} / {cen:g} / {opt:g} (pessimistic / central / optimistic)" in " ".join(src.split()), (name, src)
    assert got == _assumed(COMMITTED.read_text()), "the committed output was made with other assumptions"


def test_gemm_time_follows_the_printed_assumptions_by_hand(fresh):
    # InfoNCE's dB update on H100 at N = 65536 (panel of P rows): addmm [65536, 768] += [65536, P] @ [P, 768],
    # bf16 operands, fp32 accumulator. By hand from the printed values: efficiency = 0.72 x spread x
    # (K / (K + K0)) / (8192 / (8192 + K0)) (768 / 128 x 65536 / 256 output tiles is far above 2 x 132:
    # no split-K); bytes = operands + accumulator read and write at hbm_stream x 3.35 TB/s; time = the max
    code = r'''
import json, sys, torch
sys.path.insert(0, "bench")
import gpu_model as G
out = {}
for scn in G.SCENARIOS:
    with G.scenario(scn):
        out[scn] = [G.gemm_seconds(65536, 768, 1216, torch.bfloat16, True, 4, G.GPUS["H100"]),
                    G.gemm_seconds(1216, 768, 65536, torch.bfloat16, False, 4, G.GPUS["H100"])]
print(json.dumps(out))
'''
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    a = _assumed(fresh)
    peak = _peaks(fresh)["H100"] * 1e12
    for i, scn in enumerate(("optimistic", "central", "pessimistic")):
        hbm, spread, k0, splitk = a["hbm_stream"][i], a["cublas_spread"][i], a["gemm_k0"][i], a["splitk"][i]

        def eff(k, tiles, spread=spread, k0=k0, splitk=splitk):
            e = 0.72 * spread * (k / (k + k0)) / (8192 / (8192 + k0))
            return e * (splitk if tiles < 2 * 132 else 1.0)

        m, n, k, p = 65536, 768, 1216, 1216
        flops = 2 * m * n * k
        db = max(flops / (peak * eff(k, (m // 128) * (n // 256))),
                 ((m * p + p * n) * 2 + 2 * m * n * 4) / (hbm * 3.35e12))
        # dA: [1216, 65536] @ [65536, 768]: 10 x 3 output tiles, long K: split-K
        da = max(flops / (peak * eff(65536, 10 * 3)),
                 ((1216 * 65536 + 65536 * 768) * 2 + 1216 * 768 * 4) / (hbm * 3.35e12))
        assert got[scn] == pytest.approx([db, da], rel=1e-9), scn


def test_committed_matryoshka_model_has_one_loss_of_matmul_work():
    # --matryoshka: the torch backend's one-pass path does the GEMM work of one loss (3 units: the
    # segment GEMMs sum to one GEMM over D per side), the K-loss formula 3 units per level scaled by
    # d_k / D; the Matryoshka kernels with the suffix backward that "auto" takes for 16-bit inputs from
    # N x M = 2^20 (by hand: the forward walks D once, 1 unit; the suffix kernel walks D once per tile, 1 unit;
    # the 2 units of segment GEMMs run in cuBLAS, not on the Triton kernels' tensor cores): 2 units. Times are
    # a model (labelled), bracketed by their range; the triton backend's route is the Matryoshka kernels below
    # the panel path's threshold (N = 2048) and one plain call per level above it
    text = COMMITTED.read_text()
    assert "--- MODEL Matryoshka InfoNCE, dims 768/512/256/128/64" in text
    recs = _records(text, matryoshka=True)
    assert {(r["gpu"], r["n"]) for r in recs} == {(g, n) for g in ("A100", "H100", "H200")
                                                   for n in (2048, 16384, 65536)}
    for r in recs:
        unit = 2 * r["n"] ** 2 * r["d"]
        assert r["dims"] == [768, 512, 256, 128, 64] and r["model"].startswith("MODEL")
        assert r["plain_gemm_flops"] == 3 * unit
        assert r["one_pass_gemm_flops"] == 3 * unit
        assert r["formula_gemm_flops"] == 3 * unit * sum(r["dims"]) // r["d"]
        assert r["suffix_backward"] is True
        assert r["triton_tc_flops"] == pytest.approx(2 * unit, rel=1e-12)
        assert all(k["spills"] == 0 for k in r["triton_kernels"]), r
        assert {k["kernel"] for k in r["triton_kernels"]} == {"row_norm", "mat_fwd", "mat_epi"}
        assert r["triton_route"] == ("Matryoshka kernels, suffix backward" if r["n"] == 2048
                                     else "one plain call per level")
        # the suffix backward is taken where the model prices it below the kernels' own backward
        assert r["triton_ms"] < r["other_backward_ms"], r
        for key in ("one_pass", "triton", "k_calls_triton", "plain_triton", "other_backward"):
            lo, hi = r[f"{key}_range"]
            assert lo <= r[f"{key}_torch_ms" if key == "one_pass" else f"{key}_ms"] <= hi, key
        assert r["formula_fits"] == (r["formula_peak_bytes"] <= {"A100": 80e9, "H100": 80e9, "H200": 141e9}[r["gpu"]])
        # the K calls level by level: they add up to the route's time, and the top level (d = D) is the
        # plain loss (the same call)
        by_level = r["k_calls_by_level_ms"]
        assert len(by_level) == len(r["dims"]) and by_level[0] == pytest.approx(r["plain_triton_ms"], abs=1e-3)
        assert sum(by_level) == pytest.approx(r["k_calls_triton_ms"], abs=5e-3)
    # the same rows in the other losses' form ("matryoshka5": ms = the route taken, the floor of one plain
    # loss by hand, the formula's time where it fits)
    peaks = _peaks(text)
    five = {(r["gpu"], r["n"]): r for r in (json.loads(line) for line in text.splitlines() if line.startswith("{"))
            if r["loss"] == "matryoshka5"}
    assert set(five) == {(r["gpu"], r["n"]) for r in recs}
    for r in recs:
        f = five[(r["gpu"], r["n"])]
        assert f["ms"] == (r["k_calls_triton_ms"] if r["n"] > 2048 else r["triton_ms"])
        assert f["route"] == r["triton_route"]
        assert f["floor_ms"] == pytest.approx(3 * 2 * r["n"] ** 2 * r["d"] / (peaks[r["gpu"]] * 1e12) * 1e3, rel=1e-4,
                                              abs=5e-5)  # printed to 4 decimals
        assert f["floor_ms"] <= f["ms_range"][0] <= f["ms"] <= f["ms_range"][1]
        assert f["naive_ms"] == (r["formula_ms"] if r["formula_fits"] else None)


def test_committed_gist_model_counts_the_matmul_work_by_hand():
    # --gist, N = M for every block, guide dimension D / 2. Triton: per block the forward's logit and guide
    # tiles, each backward kernel recomputes both and adds one gradient product: model 1 + 2 + 2, guide
    # 1 + 1 + 1, in units of 2 N^2 D (2 N^2 Dg): 4 blocks x (5 x 2N^2 D + 3 x 2N^2 Dg). The torch sweep
    # forms the gradients in its one pass: 4 x (3 x 2N^2 D + 2N^2 Dg). The textbook: 4 logit and 4 guide
    # GEMMs forward, 8 gradient GEMMs backward, the same 4 x (3 x 2N^2 D + 2N^2 Dg).
    text = COMMITTED.read_text()
    assert "--gist" in text.splitlines()[0]
    recs = _records(text, gist=True)
    assert {(r["gpu"], r["n"]) for r in recs} == {(g, n) for g in ("A100", "H100", "H200") for n in (16384, 65536)}
    for r in recs:
        n, d, dg = r["n"], r["d"], r["guide_d"]
        assert dg == d // 2
        assert r["triton_tc_flops"] == 4 * (5 * 2 * n * n * d + 3 * 2 * n * n * dg), r
        assert r["torch_gemm_flops"] == 4 * (3 * 2 * n * n * d + 2 * n * n * dg), r
        assert r["textbook_gemm_flops"] == r["torch_gemm_flops"], r
        assert r["model"] == "MODEL, not a measurement"
        assert all(k["spills"] == 0 for k in r["kernels"]), r
        # the textbook's B x B matrices: 8 of them plus the B x 4B scores; it does not fit at N = 65536
        assert r["textbook_fits"] == (n == 16384), r


#: The per-block fused kernels of the guided losses (core/guided/triton_blocks.py), which the panel route replaces.
GUIDED_FUSED = {"guided_fwd", "guided_bwd_rows", "guided_bwd_cols"}


def _gist_panel_rows(n: int, d: int) -> int:
    """Rows per panel of GIST's guided panel route, by hand from the formula of
    core/guided/triton_panel.py panel_rows (bf16, default budget 0.70e9, a multiple of 128 rows: the 16-bit
    guides' blocks without the split target take 128 x 128 tiles, the split block 64 x 128): four
    N-column blocks, each ``2 M`` bytes of tile + 4 bytes x 5 partials per column tile (z, row maximum, the
    target's e and cosine; no temperature gradient), 8 D bytes per row group (anchors, positives), 32;
    fixed: 4 D bytes per row of the three tensors with a gradient (their fp32 accumulators); at least 1024
    rows (P_MIN) whatever the budget."""
    per_row = 4 * (2 * n + 4 * 5 * -(-n // 128)) + 8 * d * 2 + 32
    p = max(0, 700_000_000 - 4 * d * 3 * n) // per_row // 128 * 128  # 128-row tiles of the wide blocks
    return min(n, max(1024, p))


def test_committed_gist_model_runs_the_guided_panel_route_above_its_floor():
    """GIST (``--gist``): the record's route is what backend="triton" runs on CUDA for the summed bf16 loss,
    the guided panel route (core/guided/triton_panel.py: the epilogue GEMM guided_epi per panel and block,
    cuBLAS dR and dC), not the fused kernels; its time sits at or above the floor counted here by hand from
    the blocks (a-p, a-a, p-p, a-n, every one N x N, guide dimension D / 2): the logits 1 + 1/2 + 1/2 + 1 (the
    symmetric blocks as half a product), the guide cosines the same times Dg / D, the gradients 2 + 1 + 1 + 2
    (one GEMM per side; (G + G^T) X for a symmetric block): 10.5 units of 2 N^2 D, 4.4 ms on an H100 at
    N = 16384. The route's tensor-core work by hand: the epilogue GEMM 1 unit + a guide tile per block, the
    threshold kernel per tile shape one guide tile of 128 columns per row tile (targets on the diagonal),
    nothing in the redo (its programs return at once in the central figure); cuBLAS 2 units per block. The
    route is modelled faster than the fused kernels at both sizes."""
    text = COMMITTED.read_text()
    peaks = _peaks(text)
    recs = _records(text, gist=True)
    assert {(r["gpu"], r["n"]) for r in recs} == {(g, n) for g in peaks for n in (16384, 65536)}
    keys = {"loss", "gpu", "n", "path", "ms", "ms_range", "ms_worst_data", "pct_peak", "floor_ms", "floor_units",
            "naive_ms", "naive_ms_if_memory", "naive_peak_bytes", "fused_ms", "route_kernels", "route_tc_flops",
            "route_gemm_flops", "route_panel_rows", "triton_ms", "triton_range", "torch_ms", "textbook_ms",
            "textbook_fits", "kernels"}
    for r in recs:
        assert keys <= set(r), keys - set(r)
        n, d, dg = r["n"], r["d"], r["guide_d"]
        assert (d, dg) == (D, D // 2) and r["loss"] == "gist" and r["model"] == "MODEL, not a measurement"
        units = (1 + 0.5 + 0.5 + 1) * (1 + dg / d) + (2 + 1 + 1 + 2)
        assert units == 10.5 == r["floor_units"]
        floor = units * 2 * n * n * d / (peaks[r["gpu"]] * 1e12) * 1e3
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-4)
        if r["gpu"] == "H100" and n == 16384:
            assert round(floor, 1) == 4.4
        lo, hi = r["ms_range"]
        assert floor <= lo <= r["ms"] <= hi and r["ms"] <= r["ms_worst_data"], r
        assert r["pct_peak"] == pytest.approx(100 * floor / r["ms"], rel=1e-3, abs=0.006)  # printed to 0.01
        # the route: the guided panel route's launches, no fused guided kernel
        assert r["path"] == "panel"
        names = {k["kernel"] for k in r["route_kernels"]}
        assert "guided_epi" in names and "guided_epi_redo" in names and not names & GUIDED_FUSED, names
        assert r["route_panel_rows"] == _gist_panel_rows(n, d)
        panels = -(-n // r["route_panel_rows"])
        k = {x["kernel"]: x for x in r["route_kernels"]}
        assert k["guided_epi"]["launches"] == k["guided_epi_redo"]["launches"] == 4 * panels
        assert k["guided_epi"]["flops"] == 4 * 2 * n * n * (d + dg)
        assert k["guided_epi_redo"]["flops"] == 0
        # one threshold launch per tile shape (64 and 128 rows), each one guide tile of its rows against the
        # 128 columns that hold their targets (on the diagonal, the row tiles aligned)
        assert k["theta_guided"]["flops"] == 2 * (n // 64) * 2 * 64 * 128 * dg
        assert r["route_tc_flops"] == sum(x["flops"] for x in r["route_kernels"])
        assert r["route_gemm_flops"] == 4 * 2 * 2 * n * n * d
        assert all(x["spills"] == 0 for x in r["route_kernels"]), r["route_kernels"]
        for x in r["route_kernels"]:  # no kernel faster than its own FLOPs at peak
            assert x["ms"] * 1e-3 >= x["flops"] / (peaks[r["gpu"]] * 1e12), x
        # the fused kernels (triton_ms, the key gpu_validate reads) and the textbook beside it
        assert r["fused_ms"] == r["triton_ms"] >= floor
        assert r["naive_ms_if_memory"] == r["textbook_ms"]
        assert r["naive_peak_bytes"] == r["textbook_peak_bytes"]
        assert (r["naive_ms"] is None) == (not r["textbook_fits"]) == (n == 65536), r
        assert r["ms"] < r["fused_ms"], (r["gpu"], r["n"], r["ms"], r["fused_ms"])


def test_gist_panel_route_records_its_launches_by_hand():
    # the route as the model records it on the meta device (no compile): per panel and block one epilogue
    # GEMM and its redo (sm_80's redo tiles 32 rows, sm_90's 64), one threshold kernel, per panel and row
    # group (anchors, positives) the row norms, panel_rows and guided_acc (into its accumulator), per panel
    # the merge over the blocks before and after the redo (guided_rows), per column tensor its norms in
    # chunks of 2^22 elements and one panel_rows; cuBLAS: dR and dC of every block and panel (2 units per
    # block)
    code = r'''
import json, sys
from collections import Counter
sys.path.insert(0, "bench")
import gpu_model as G
out = {}
for g in ("A100", "H100"):
    launches, ops = G.run_gist_panel(16384, 768, G.GPUS[g])
    epi = [lz for lz in launches if lz.name == "guided_epi"]
    redo = [lz for lz in launches if lz.name == "guided_epi_redo"]
    out[g] = dict(names=Counter(lz.name for lz in launches), p=epi[0].args["P"], redo_grid=redo[0].grid[0],
                  gemm=sum(2 * m * n * k for _, _, gm, _ in ops if gm for m, n, k in [gm[:3]]),
                  gemm_dtypes=sorted({str(gm[3]) for _, _, gm, _ in ops if gm}))
print(json.dumps(out))
'''
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=False,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    n = 16384
    p = _gist_panel_rows(n, D)
    panels = -(-n // p)
    chunks = -(-n // ((1 << 22) // D))
    for g, redo_rows in (("A100", 32), ("H100", 64)):
        w = got[g]
        assert w["p"] == p
        assert w["names"] == {"guided_epi": 4 * panels, "guided_epi_redo": 4 * panels, "theta_guided": 2,
                              "row_norm": 2 * panels + 3 * chunks, "panel_rows": 2 * panels + 3,
                              "guided_rows": 2 * panels, "guided_acc": 2 * panels}, (g, w)
        assert w["redo_grid"] == -(-p // redo_rows)
        assert w["gemm"] == 4 * 2 * 2 * n * n * D and w["gemm_dtypes"] == ["torch.bfloat16"], (g, w)


def test_committed_siglip_model_runs_the_epilogue_route_above_its_floor():
    """SigLIP (``--siglip``): 3 matmul units of floor (logits, dX, dY) by hand; the route CUDA takes for the
    mean loss (the panel path's epilogue GEMM in one pass, MODE 5: 3 units) modelled at or above it, below
    the same path's two sweeps (per-row losses: 4 units; the model decides that the summed loss takes the
    one pass) and below its fused kernels (5 units, a streaming backward: measured 555 ms at N = 65536 on
    an H100, bench/results/h100-epilogue)."""
    recs = [json.loads(line) for line in COMMITTED.read_text().splitlines() if line.startswith("{")]
    sig = [r for r in recs if r["loss"] == "siglip"]
    peaks = _peaks(COMMITTED.read_text())
    assert {(r["gpu"], r["n"]) for r in sig} == {(g, n) for g in peaks for n in (16384, 65536)}
    for r in sig:
        floor = 3 * 2 * r["n"] ** 2 * D / (peaks[r["gpu"]] * 1e12) * 1e3
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-4)
        lo, hi = r["ms_range"]
        assert floor <= lo <= r["ms"] <= hi < r["fused_ms"], r
        assert r["ms"] < r["two_sweeps_ms"] < r["fused_ms"], r
        assert r["route_kernels"] == [["epi_gemm_siglip", 5]], r


def test_committed_maxsim_model_sits_above_its_floor_and_the_textbook_does_not_fit_at_4096():
    """Late interaction (``--maxsim``, Lq = 32, Ld = 180, D = 128): the floor is 2 units of the token matmul
    (2 N Lq N Ld D FLOPs each: the similarities and dd; dq is a gather) by hand; the Triton route is
    modelled at or above it; the textbook holds the [N, N, Lq, Ld] bf16 similarities (by hand: 2 bytes
    each), which fit an 80 GB part at N = 1024 and no part at N = 4096."""
    recs = [json.loads(line) for line in COMMITTED.read_text().splitlines() if line.startswith("{")]
    ms = [r for r in recs if r["loss"] == "maxsim"]
    peaks = _peaks(COMMITTED.read_text())
    assert {(r["gpu"], r["n"]) for r in ms} == {(g, n) for g in peaks for n in (1024, 4096)}
    for r in ms:
        n, lq, ld, d = r["n"], r["lq"], r["ld"], r["d"]
        assert (lq, ld, d) == (32, 180, 128)
        floor = 2 * 2 * n * lq * n * ld * d / (peaks[r["gpu"]] * 1e12) * 1e3
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-4)
        lo, hi = r["ms_range"]
        assert floor <= lo <= r["ms"] <= hi, r
        assert r["naive_peak_bytes"] >= n * n * lq * ld * 2, r
        assert (r["naive_ms"] is None) == (n == 4096), r
        assert r["model"] == "MODEL, not a measurement"


EPI_CONFIGS = ROOT / "bench" / "results" / "gpu_model" / "epi_configs.txt"
H100_MEASURED = ROOT / "bench" / "results" / "h100-epilogue" / "profile_configs.txt"


def test_epi_configs_sets_the_model_beside_every_measured_configuration():
    """``--epi-configs``: the one-pass epilogue GEMM modelled in every launch configuration the H100 timed
    (read here from its output independently of the script's parser), each above one matmul unit at the
    H100's bf16 peak (989.4 TFLOP/s, its datasheet), the untimed candidates labelled as such, and the
    committed output is this run's."""
    out = _run(["--losses", "", "--epi-configs"])
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    measured = re.findall(r"^config one_pass info_nce N=65536: (\S+) w(\d+) s(\d+): step .*? epi_gemm ([\d.]+) ms",
                          H100_MEASURED.read_text(), flags=re.M)
    assert len(measured) >= 5
    assert sorted((r["config"], r["measured_ms"]) for r in recs if r["measured_ms"] is not None) == sorted(
        (f"{c} w{w} s{s}", float(ms)) for c, w, s, ms in measured)
    floor = 2 * 65536 ** 2 * 768 / 989.4e12 * 1e3
    assert all(r["model_ms"] > floor for r in recs), recs
    assert [r["config"] for r in recs if r["measured_ms"] is None] == ["128x256x64 w16 s3"]
    assert all(r["model"].startswith("MODEL") for r in recs)
    committed = [json.loads(line) for line in EPI_CONFIGS.read_text().splitlines() if line.startswith("{")]
    assert [(r["config"], r["measured_ms"], r["ctas_sm"]) for r in committed] == [
        (r["config"], r["measured_ms"], r["ctas_sm"]) for r in recs]
    for a, b in zip(committed, recs, strict=True):
        assert a["model_ms"] == pytest.approx(b["model_ms"], rel=0.01), (a, b)
