"""Launch configurations of the Triton kernels: one fixed, documented table, no autotuning by default
(``@triton.autotune`` cannot run under the interpreter). Pure Python (no triton import), so the
tooling that reads the table (ahead-of-time compiles, the kernel report) and the launcher agree.

Why these numbers (fixed; tests/test_triton_compile.py checks 0 spill bytes for every entry on
sm_80 and sm_90 with every optional term switched on):

* forward, 16-bit: 128 x 64 tiles, 8 warps (two warpgroups on sm_90: wgmma M = 64 each); the
  fp32 logit tile and each of its exp temporaries is 32 registers per thread. D chunks of 64
  (128-byte rows); D <= 64 in one chunk of D_PAD. A 128-wide chunk spilled with every term on.
  For D > 128 the forward without a softmax over positives ("fwd") takes 128 x 128 tiles at 16 warps
  (four warpgroups, 2 x 2): every column tile re-reads the anchor block's D chunks, so a twice wider
  column tile halves that L2 -> SM traffic (bench/gpu_model.py: the L2-bound H100 forward at
  N = 65536 from 16.0 to about 12.5 ms, MODEL). Compiled with every other term on: 128 registers on
  sm_80, 119-128 on sm_90, 0 spills; at 8 warps 241-255 registers and spills. The positives' softmax
  (two more running statistics and the positive tile) spilled 32-164 bytes at 16 warps, so that
  forward ("fwd_pos") keeps 128 x 64 at 8 warps.
* forward with row statistics only ("fwd_wide": no column LSE, not the triangular forward, no bias
  column, no positives; InfoNCE's and SimCSE's fused forward, every forward-only call), sm_90,
  16-bit, D > 128: 128 x 256 tiles at 8 warps (two warpgroups, wgmma m64 n256 each): a 128 x 256
  tile reads (128 + 256) D operand elements for 2 x 128 x 256 D FLOPs, 85 FLOP/B of L2 -> SM traffic
  against 64 at 128 x 128 (bench/gpu_model.py, MODEL: the H100 forward at N = 65536 from 12.5 ms,
  53 % of peak, to 9.7 ms, 69 %). 209-229 registers on sm_90, 0 spills; the same tile with the column statistics
  spilled 56-300 bytes (255 registers), with the bias column 368 bytes, and on sm_80 (mma.sync)
  every variant spilled, so those keep "fwd".
* backward, 16-bit: 64 x 64 tiles at 8 warps. The backward holds more live tiles than the
  forward (l, the positive logits, dl and for A-is-B the transposed dl^T) plus the accumulator:
  4 warps spilled. D_PAD <= 128 keeps the [64, D_PAD] fp32 accumulator in registers (resident);
  larger D streams 64-wide chunks through the fp32 scratch.
* fp32 inputs use tf32x3 dots (each operand split in a high and a low tf32 part: 3 MMAs and about
  twice the operand registers): 16- or 32-wide D chunks, never resident, 8 warps, and every dot
  with M >= 64 (wgmma needs M = 64 per warpgroup on sm_90). 64-wide chunks or a resident
  [64, 128] accumulator spilled kilobytes; 64 x 64 x 32 forward tiles spilled 8 bytes on sm_80.

sm_90 uses the same numbers (the compiler picks wgmma for the same tiles) except where ``_ARCH_T16``
says otherwise ("fwd_wide"); a measured retune belongs here, per family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch options of one kernel. ``block_d`` 0 means D_PAD (resident)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


#: Largest padded D kept resident (whole rows in registers) by the backward kernels.
RESIDENT_MAX_D = 128

_T16 = {
    # (kernel, D bucket): config  (D buckets: "d64" D_PAD <= 64, "d128" <= 128, "big" > 128)
    ("fwd", "d64"): LaunchConfig(128, 64, 0, 8, 3),
    ("fwd", "d128"): LaunchConfig(128, 64, 64, 8, 3),
    ("fwd", "big"): LaunchConfig(128, 128, 64, 16, 3),
    ("fwd_pos", "d64"): LaunchConfig(128, 64, 0, 8, 3),
    ("fwd_pos", "d128"): LaunchConfig(128, 64, 64, 8, 3),
    ("fwd_pos", "big"): LaunchConfig(128, 64, 64, 8, 3),
    ("bwd_rows", "d64"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_rows", "d128"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_rows", "big"): LaunchConfig(64, 64, 64, 8, 2),
    ("bwd_cols", "d64"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_cols", "d128"): LaunchConfig(64, 64, 0, 8, 2),
    ("bwd_cols", "big"): LaunchConfig(64, 64, 64, 8, 2),
}
_T32 = {
    ("fwd", "d64"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd", "d128"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd", "big"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd_pos", "d64"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd_pos", "d128"): LaunchConfig(64, 64, 16, 8, 3),
    ("fwd_pos", "big"): LaunchConfig(64, 64, 16, 8, 3),
    ("bwd_rows", "d64"): LaunchConfig(64, 32, 32, 8, 2),
    ("bwd_rows", "d128"): LaunchConfig(64, 32, 32, 8, 2),
    ("bwd_rows", "big"): LaunchConfig(64, 32, 32, 8, 2),
    ("bwd_cols", "d64"): LaunchConfig(64, 64, 16, 8, 2),
    ("bwd_cols", "d128"): LaunchConfig(64, 64, 16, 8, 2),
    ("bwd_cols", "big"): LaunchConfig(64, 64, 16, 8, 2),
}

#: Input dtypes the kernels take, by their short name.
DTYPE_NAMES: dict[torch.dtype, str] = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
ARCH_FAMILIES = ("sm80", "sm90")
D_BUCKETS = ("d64", "d128", "big")
#: Per-arch entries that differ from the tables above: (kernel, arch family, D bucket) -> 16-bit config.
#: "fwd_wide" takes "fwd"'s config wherever this table has no entry of its own (:func:`_config`).
_ARCH_T16 = {
    ("fwd_wide", "sm90", "big"): LaunchConfig(128, 256, 64, 8, 3),
}

#: "fwd": the forward (column statistics, the triangular forward, a bias column; and SigLIP's);
#: "fwd_wide": the forward with row statistics only (see :func:`fwd_kernel`); "fwd_pos": the forward
#: with a softmax over positives (SupCon L_in).
KERNELS = ("fwd", "fwd_wide", "fwd_pos", "bwd_rows", "bwd_cols")


def _config(kernel: str, arch: str, dt: str, bucket: str) -> LaunchConfig:
    base = "fwd" if kernel == "fwd_wide" else kernel  # the wide forward differs only where _ARCH_T16 says
    if dt == "fp32":
        return _T32[(base, bucket)]
    return _ARCH_T16.get((kernel, arch, bucket), _T16[(base, bucket)])


#: The shipped table: (kernel, arch family, dtype name, D bucket) -> LaunchConfig.
CONFIGS: dict[tuple[str, str, str, str], LaunchConfig] = {
    (k, arch, dt, db): _config(k, arch, dt, db)
    for k in KERNELS for arch in ARCH_FAMILIES for dt in ("fp16", "bf16", "fp32") for db in D_BUCKETS
}


def fwd_kernel(pos: bool, want_col: bool, tri: bool, has_bias: bool) -> str:
    """The table key of a forward launch: "fwd_pos" with a softmax over positives, "fwd_wide" with row
    statistics only (no column LSE, not triangular, no bias column), "fwd" otherwise."""
    if pos:
        return "fwd_pos"
    return "fwd" if (want_col or tri or has_bias) else "fwd_wide"


#: The row-norm prologue (memory-bound): 32 rows x up to 128 columns of fp32 = 32 registers at 4 warps.
ROW_NORM_BLOCK_R = 32
ROW_NORM_MAX_BLOCK_D = 128
ROW_NORM_WARPS = 4
#: The target term's row kernel (kernels/target.py): rows per program, widest D chunk, warps (two
#: passes over the row and its target row, O(N*D); bandwidth-bound like the row-norm prologue).
TARGET_BLOCK_R = 16
TARGET_MAX_BLOCK_D = 128
TARGET_WARPS = 4
#: The one pass's in-place pass over cuBLAS's fp16 cosines (kernels/logit_pass.py, ``PANEL_GEMM=fp16pass``;
#: memory-bound: 2 bytes read and 2 written per logit): BLOCK_R rows x the one-pass epilogue GEMM's BLOCK_N
#: columns per program (the partials' width must be MODE 1's), 16 x 128 = 8 fp32 values per thread at 4 warps.
#: A first choice, untimed.
LOGIT_PASS_BLOCK_R = 16
LOGIT_PASS_WARPS = 4


def d_pad(d: int) -> int:
    """D rounded up to a power of two, at least 16 (``tl.dot`` needs K >= 16)."""
    return max(16, 1 << max(d - 1, 0).bit_length())


def d_bucket(d: int) -> str:
    p = d_pad(d)
    return "d64" if p <= 64 else ("d128" if p <= RESIDENT_MAX_D else "big")


def config_for(kernel: str, arch: str, dtype: torch.dtype, d: int) -> tuple[LaunchConfig, int, bool]:
    """(config, BLOCK_D, resident) of ``kernel`` for D-dimensional rows of ``dtype`` on ``arch``."""
    cfg = CONFIGS[(kernel, arch, DTYPE_NAMES[dtype], d_bucket(d))]
    resident = cfg.block_d == 0
    return cfg, (d_pad(d) if resident else cfg.block_d), resident


#: The panel kernel (kernels/panel.py, memory-bound elementwise work on a [P, M] panel): one program
#: per BLOCK_R rows walks the columns in chunks of PANEL_CHUNK elements (BLOCK_R x PANEL_CHUNK /
#: BLOCK_R), 8 fp32 registers per thread per live tile at 8 warps. BLOCK_R (16, 8, 4, 2 or 1) is chosen
#: per panel so that the grid has at least 2 programs per SM (``panels.panel_blocks``): a panel
#: of 1216 rows on 132 SMs takes 4 x 512, one of 320 rows 1 x 2048; the interpreter takes 16 x 128.
#: Compiled register counts are checked by tests/test_triton_panel.py (0 spills) and listed by
#: bench/gpu_model.py; at 4 warps the symmetric path took 188 registers (2 CTAs/SM: too few warps in
#: flight for a memory-bound kernel); 32 x 128 at 8 warps 203-211.
PANEL_CHUNK = 2048
PANEL_WARPS = 8
#: The panel's row epilogue (``panel_rows_kernel``: the normalisation backward and the dB operand):
#: 8 rows x up to 256 columns per step, two passes over D.
PANEL_ROWS_BLOCK_R = 8
PANEL_ROWS_MAX_BLOCK_D = 256
PANEL_ROWS_WARPS = 4


#: The guided kernels (``kernels/guided.py``: a second dot per tile for the guide, 16-wide chunks of
#: Dg) take the fused kernels' configs ("fwd_pos" for the forward, "bwd_rows" / "bwd_cols"), except on
#: sm_80 with fp32 guides (a tf32x3 dot: three MMAs and twice the operand registers), where the
#: backward kernels spilled at 64 x 64 tiles (16-bit: 16-140 bytes; fp32 "bwd_cols": 8 bytes): there
#: they take 64 x 32 tiles (214-254 registers, 0 spills; a resident [64, D_PAD] accumulator past
#: D_PAD = 128 spilled kilobytes, so "big" streams as before). With 16-bit guides the same 64 x 32
#: tile made ptxas stop at 128 registers and spill 16 bytes, while 64 x 64 compiles at 174-227
#: registers without spills, so 16-bit guides keep the fused table. tests/test_triton_guided.py
#: compiles the variants the losses launch.
_GUIDED_SM80_FP32_GUIDE = {
    ("bwd_rows", "16", "d64"): LaunchConfig(64, 32, 0, 8, 2),
    ("bwd_rows", "16", "d128"): LaunchConfig(64, 32, 0, 8, 2),
    ("bwd_rows", "16", "big"): LaunchConfig(64, 32, 64, 8, 2),
    ("bwd_rows", "32", "d64"): LaunchConfig(64, 32, 16, 8, 2),
    ("bwd_rows", "32", "d128"): LaunchConfig(64, 32, 16, 8, 2),
    ("bwd_rows", "32", "big"): LaunchConfig(64, 32, 16, 8, 2),
}
_GUIDED_SM80_FP32_GUIDE.update({("bwd_cols", w, b): c for (k, w, b), c in list(_GUIDED_SM80_FP32_GUIDE.items())
                                if k == "bwd_rows"})


def guided_config(kernel: str, arch: str, dtype: torch.dtype, d: int,
                  guide_dtype: torch.dtype = torch.float32) -> tuple[LaunchConfig, int, bool]:
    """(config, BLOCK_D, resident) of a guided kernel ("fwd", "bwd_rows", "bwd_cols") for D-dimensional
    rows of ``dtype`` and guides of ``guide_dtype`` on ``arch``."""
    key = "fwd_pos" if kernel == "fwd" else kernel
    cfg = CONFIGS[(key, arch, DTYPE_NAMES[dtype], d_bucket(d))]
    if arch == "sm80" and guide_dtype == torch.float32:
        cfg = _GUIDED_SM80_FP32_GUIDE.get((key, "32" if dtype == torch.float32 else "16", d_bucket(d)), cfg)
    resident = cfg.block_d == 0
    return cfg, (d_pad(d) if resident else cfg.block_d), resident


#: The Matryoshka kernels (``kernels/matryoshka.py``) loop over the levels (not unrolled) and keep their
#: running statistics in memory, so their registers do not grow with K. The forward takes the fused
#: "fwd_pos" entries (one logit tile, a positive tile). The backward holds more per tile than the fused
#: one (the level's logit tile, the suffix sum H and its 16-bit copy, two dots per D chunk with operands in
#: both orientations): 16-bit takes 32-wide D chunks, fp32 (tf32x3: twice the operand registers) 16-wide.
#: The dA kernel ("bwd_rows") takes 64 x 32 tiles; the dB kernel ("bwd_cols") 64 x 64, because its gradient
#: dot is H^T (BLOCK_N rows) times the rows' chunk and wgmma needs 64 rows (at 64 x 32 that dot fell back to
#: mma.sync on sm_90). Every launch sets ``maxnreg`` 255 (``matryoshka.triton_levels.MAXNREG``). Compiled for sm_80
#: and sm_90 at K = 1, 5 and 8 with every term (tests/test_triton_matryoshka.py): 0 spills.
_MATRYOSHKA_BWD = {
    ("bwd_rows", "16"): LaunchConfig(64, 32, 32, 8, 2), ("bwd_rows", "32"): LaunchConfig(64, 16, 16, 8, 2),
    ("bwd_cols", "16"): LaunchConfig(64, 64, 32, 8, 2), ("bwd_cols", "32"): LaunchConfig(64, 64, 16, 8, 2),
}


#: The suffix route's panel kernel (``mat_epi_kernel``: one walk along D per output tile, the levels' gradient
#: tiles parked in the operand dtype, 16-bit operands only), from the sm_80 / sm_90 compiles at 5 levels with
#: the target term, the positives' softmax and the column term (tests/test_matryoshka_suffix.py; not timed on
#: a GPU): 64 x 64 tiles over 64-wide D chunks at 8 warps, 3 stages, 0 spills (226-255 registers; wgmma on
#: sm_90). 64 x 128 (8 warps, 2-3 stages), 128 x 64 and 64 x 64 at 4 warps spilled 120-944 bytes: the parked
#: tiles, the top level's fp32 tile and the epilogue's temporaries are live together. At 8 levels 64 x 64 also
#: spilled (56-80 bytes): the route takes at most :data:`MATRYOSHKA_SUFFIX_LEVELS`.
MATRYOSHKA_SUFFIX = LaunchConfig(64, 64, 64, 8, 3)
MATRYOSHKA_SUFFIX_LEVELS = 5


def matryoshka_config(kernel: str, arch: str, dtype: torch.dtype, d: int) -> tuple[LaunchConfig, int]:
    """(config, BLOCK_D) of a Matryoshka kernel ("fwd", "bwd_rows" or "bwd_cols") for D-dimensional rows of
    ``dtype``."""
    if kernel == "fwd":
        cfg = CONFIGS[("fwd_pos", arch, DTYPE_NAMES[dtype], "big")]
    else:
        cfg = _MATRYOSHKA_BWD[(kernel, "32" if dtype == torch.float32 else "16")]
    return cfg, min(cfg.block_d, d_pad(d))

#: The epilogue GEMM of the panel path (kernels/panel.py ``epi_gemm_kernel``), 16-bit operands:
#: ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` per mode, measured on an H100 (bench/gpu_profile.py
#: ``--configs``, bench/results/h100-epilogue/profile.txt: the kernel's device time over a whole
#: N = 65536 step). One pass: 128 x 128 output tiles over 64-wide D chunks at 8 warps (two
#: warpgroups, wgmma m64 n128 on sm_90; mma.sync on sm_80), 4 stages of operands (128 KB of shared
#: memory): 19.9 ms against 21.9 at 3 stages, 20.0-21.2 for 64 x 128 / 128 x 64 tiles at 4 warps, 24.9 for
#: 64 x 256 and 64 x 64. Known statistics: 64 x 128 at 8 warps, 3 stages: 22.0 ms (128 x 64: 22.4,
#: 128 x 128: 22.5, 64 x 64: 26.0); the symmetric form with every term (two exp tiles, a positives'
#: mask) spills 4 bytes on sm_90 at 128 x 64 and none at 64 x 128. tests/test_triton_panel.py checks 0
#: spill bytes on sm_80 and sm_90 for every mode. Statistics (the forward of CLIP): 128 x 128 at 8 warps,
#: 3 stages: CLIP's two epilogue GEMMs took 42.8 ms against 45.8 at 4 stages, 46.3 at 64 x 128 and 46.1
#: at 128 x 64 with 4 warps.
#: SigLIP (MODE 4): the forward (losses only) as the one pass. The backward at 64 x 128 (its gradient
#: tile, sigmoid, the losses' softplus and four row sums spilled 36-672 bytes at 128 x 128) took 37 ms per
#: matmul unit on an H100 where the one pass takes 18.9 (bench/results/h100-epilogue/profile_siglip.txt,
#: both sweeps together). Its epilogue no longer computes the losses (the forward has them): 119-123
#: registers instead of 194-207 at 64 x 128 and 1254 PTX instructions instead of 2597 on sm_90, and the
#: one pass's 128 x 128 tiles at 8 warps and 4 stages now compile without spills (204-217 registers): taken
#: from the compile, not yet timed on a GPU. "siglip_eager" (MODE 5, the losses and the gradient tile of a
#: summed loss in one pass): both epilogues' tiles spilled 168-516 bytes at 128 x 128 (8 warps; 64-352 at
#: 16 warps), none at 64 x 128 or 128 x 64 (162-225 registers); 64 x 128 at 4 stages, from the compile and
#: the model (bench/gpu_model.py --siglip: 45.8 ms at N = 65536 on an H100 against 53.8 for the two
#: sweeps), not yet timed on a GPU.
EPI_GEMM = {
    "one_pass": LaunchConfig(128, 128, 64, 8, 4),
    "known": LaunchConfig(64, 128, 64, 8, 3),
    "stats": LaunchConfig(128, 128, 64, 8, 3),
    # the statistics forward with the target split out, without TRI (CLIP's and per-row InfoNCE's): the same tiles,
    # apart for its persistent forms (EPI_PERSIST_STAGES)
    "stats_split": LaunchConfig(128, 128, 64, 8, 3),
    "siglip_fwd": LaunchConfig(128, 128, 64, 8, 4),
    "siglip_bwd": LaunchConfig(128, 128, 64, 8, 4),
    "siglip_eager": LaunchConfig(64, 128, 64, 8, 4),
}
#: Pipeline depth (num_stages) of the epilogue GEMM's persistent forms (``panels.EPI_FORMS``) per
#: (EPI_GEMM config, arch, TMA operands), chosen from the sm_80 / sm_90 compiles of the launches
#: ``bench/gpu_model.py`` records at N = 65536 (bf16, D = 768; no GPU timing yet): the deepest pipeline up to
#: the tiles form's whose compile has no spills. The flattened tile loop keeps more registers live than one
#: tile (159-255 against 127-196), so some depths spill: TMA "one_pass" 28-44 bytes at 3-4 stages (0 at 2),
#: cp.async "one_pass" on sm_90 32 bytes at 2-3 (0 at 4), "siglip_eager" on sm_80 28 at 4. None: the
#: launch keeps the tiles form ("siglip_bwd", the gradient sweep of per-row SigLIP losses, spilled 16-200
#: bytes at every depth on both archs). Every persistent compile uses more than 128 registers at 8 warps,
#: so one CTA fits per SM: the persistent grid is the SM count.
EPI_PERSIST_STAGES: dict[tuple[str, str, bool], int | None] = {
    ("one_pass", "sm90", False): 4, ("one_pass", "sm80", False): 4, ("one_pass", "sm90", True): 2,
    ("known", "sm90", False): 3, ("known", "sm80", False): 3, ("known", "sm90", True): 3,
    ("stats", "sm90", False): 3, ("stats", "sm80", False): 3, ("stats", "sm90", True): 3,
    # (the split statistics forward of CLIP's column term: its TMA form spilled 32 + 56 bytes at 255 registers on
    # sm_90, 3 stages; it keeps the tiles form there)
    ("stats_split", "sm90", False): 3, ("stats_split", "sm80", False): 3, ("stats_split", "sm90", True): None,
    ("siglip_fwd", "sm90", False): 4, ("siglip_fwd", "sm80", False): 4, ("siglip_fwd", "sm90", True): 4,
    ("siglip_eager", "sm90", False): 4, ("siglip_eager", "sm80", False): 3, ("siglip_eager", "sm90", True): 4,
    ("siglip_bwd", "sm90", False): None, ("siglip_bwd", "sm80", False): None, ("siglip_bwd", "sm90", True): None,
}
#: The guided blocks' epilogue GEMM (kernels/guided.py ``guided_epi_kernel``, the GIST / guided InfoNCE
#: panel route), chosen from the sm_80 / sm_90 compiles (no GPU timing yet): the model tile and the guide tile
#: are both live in the epilogue (two fp32 accumulators), so 128 x 128 tiles spilled 4-1268 bytes on both
#: archs (fp32 guides the most) and 64 x 128 at 8 warps compiles without spills (wgmma m64 on sm_90). The
#: redo (MODE 2, a loop over the column tiles) spilled 16-560 bytes on sm_80 at 64 rows and none at 32
#: (mma.sync); sm_90 keeps 64 rows (wgmma); 4 warps spilled 300-1200 bytes on both. "one_pass_wide": the
#: blocks with 16-bit guides that do not split out the target column (GIST's a-a, p-p and a-n) compile
#: without spills at 128 x 128 with 32-wide guide k-steps (254 registers on sm_80 and sm_90; the split
#: block spilled 4-40 bytes there, fp32 guides 56-312): half the operand re-reads of the 64-row tiles.
GUIDED_EPI = {
    "one_pass": LaunchConfig(64, 128, 64, 8, 3),
    "one_pass_wide": LaunchConfig(128, 128, 64, 8, 3),
    "redo_sm80": LaunchConfig(32, 128, 64, 8, 3),
    "redo_sm90": LaunchConfig(64, 128, 64, 8, 3),
}
#: Pipeline depth of the guided epilogue GEMM's persistent form (``panels.EPI_FORMS``; "tma" runs it too,
#: the guide operands have no descriptors) per (GUIDED_EPI config, arch, 16-bit guides, split target block),
#: from the sm_80 / sm_90 compiles of GIST's and the ids-and-self blocks' launches at N = 4096 (bf16
#: embeddings, bf16 / fp32 guides; no GPU timing yet): the tiles form's 3 stages where they compile without
#: spills. On sm_90 every block does (221-254 registers); on sm_80 the 128-row blocks of 16-bit guides
#: (104-148 bytes at 2-3 stages) and the split blocks of fp32 guides (44-244) spill: None, those keep the tiles
#: form.
GUIDED_PERSIST_STAGES: dict[tuple[str, str, bool, bool], int | None] = {
    (name, arch, g16, split): 3
    for name in ("one_pass", "one_pass_wide") for arch in ("sm80", "sm90") for g16 in (False, True)
    for split in (False, True)}
GUIDED_PERSIST_STAGES.update({("one_pass_wide", "sm80", True, False): None, ("one_pass", "sm80", False, True): None})
#: The guided route's merge over the blocks (kernels/guided.py ``guided_rows_kernel``, 4 warps): rows per
#: program and column-tile partials per step.
GUIDED_ROWS_BLOCK_R = 16
GUIDED_ROWS_BLOCK_C = 128
#: Row tiles that sweep the column tiles together (L2 reuse of B's tiles across the group).
EPI_GROUP_M = 8
#: Rows per program of the one-pass redo launch (MODE 2, 8 warps, the one-pass BLOCK_N).
EPI_REDO_ROWS = 64
#: The one pass's per-row bookkeeping (kernels/panel.py ``epi_rows_kernel``, 4 warps): rows per program and
#: column-tile partials per step.
EPI_ROWS_BLOCK_R = 16
EPI_ROWS_BLOCK_C = 128
#: The merge of the statistics partials (kernels/panel.py ``stats_merge_kernel``, 4 warps): outputs per
#: program and partials per step.
STATS_MERGE_BLOCK_O = 32
STATS_MERGE_BLOCK_P = 64
