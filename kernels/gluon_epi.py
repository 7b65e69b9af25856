"""Gluon device code (sm_90 only): a persistent, warp-specialised form of the epilogue GEMM's statistics mode.

``epi_stats_ws_kernel`` computes what ``kernels/panel.py`` ``epi_gemm_kernel`` writes in MODE 3 (the statistics
forward, ``core/lse/triton_panel.py`` ``stats_forward``; no bias column, margin or positives): for every [BLOCK_M,
BLOCK_N] tile of the panel's products ``X @ Y^T`` (X the panel's rows [P, D] scaled by powers of two, Y the raw B
[M, D], 16-bit, fp32 accumulation) and every row i and column j of the tile,

    l_ij  = s * (raw_ij * RSP[i] * rb_j)          rb_j = RB[j] with NORMALIZE, else 1
            (-inf at the own column ``offset + r0 + i`` with EXCLUDE_SELF; -inf past the panel or past M)
    MXP[i, pid_n] = max_j l_ij,    ZP[i, pid_n] = sum_j exp(l_ij - MXP[i, pid_n])
    (WANT_COL) CM[pid_m, j] = max_i l_ij,    CZ[pid_m, j] = sum_i exp(l_ij - CM[pid_m, j])
    (the shift 0 where the maximum is -inf: the sum is 0; with TRI, the triangular frame, a column j < r0 + P, inside
    the panel, gets (-inf, 0): only the columns past the panel are the rows of later panels)

at ``i * stride_zp + pid_n`` and ``pid_m * M + j`` (the layouts ``stats_merge_kernel`` merges; the row partials'
as the Triton kernel's, the column partials per BLOCK_M = 64 rows where its are per 128). The same fp32 operations
in the same order as ``_logits_rb`` / ``_logits`` of ``kernels/panel.py`` on the products; the products' summation
order over D is the tensor cores' (as the Triton kernel's), so the partials agree to fp32 rounding, not bitwise.

Structure (Hopper warp specialisation, ``gl.warp_specialize``): one CTA per SM walks the tiles ``pid, pid + grid,
...`` in the grouped order of ``_grouped_tile`` (GROUP_M row tiles sweep the column tiles together).

* the loader partition (1 warp, ``LOADER_REGS`` registers by ``setmaxnreg``) issues the TMA copies of the
  operand tiles, BLOCK_K columns of D at a time, into a ring of ``STAGES`` shared-memory slots, each with a
  "ready" mbarrier (the copies' transaction bytes) and an "empty" mbarrier (the consumer's release);
* ``CONSUMERS`` consumer warpgroups (4 warps each; 2: ping-pong) take the program's tiles in turn (consumer c the
  program's tiles c, c + CONSUMERS, ...): wgmma over the ring's slots (asynchronous, one group in flight, the slot
  released when the next group has been issued and the previous one retired), then the per-row epilogue on the
  accumulator in registers. A pair of "turn" mbarriers makes the consumers take the MMA loop in turn (each hands
  it over when its tile's MMAs are done): one consumer's MMAs run while the other's epilogue runs, so the
  epilogue is overlapped with the tensor cores instead of following them. The first consumer is
  the default partition (``num_warps`` = 4: its registers are what ``maxnreg`` leaves), the second a worker with
  ``CONSUMER_REGS``.

Not done here (the issue's full form): the 2 x 1 cluster multicast of the Y tiles, the one pass's gradient tile
(MODE 1) and the known-statistics backward (MODE 0). Compiled for sm_90 only (``tests/test_gluon_epi.py``); no GPU
has run it (``docs/panel-path.md``, "Gluon"). Importing this module never fails: without a Triton that has
``triton.experimental.gluon`` (and its Hopper module), :data:`AVAILABLE` is False, :data:`IMPORT_ERROR` says why,
and the kernel is None. Which Tritons may launch it is the host's decision (``core/triton_shared/gluon_epi.py``).
"""

from __future__ import annotations

try:  # Gluon is experimental: absent from older Tritons, its API moving between versions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
except Exception as _e:  # noqa: BLE001 - any failure means: no Gluon kernel here
    AVAILABLE = False
    IMPORT_ERROR: str | None = f"{type(_e).__name__}: {_e}"
else:
    AVAILABLE = True
    IMPORT_ERROR = None

#: Registers per thread of the loader partition (one warp issuing TMA copies; 24 is the fewest ``setmaxnreg`` takes).
LOADER_REGS = 24
#: Registers per thread of the worker consumer warpgroup (the 64 x 128 fp32 accumulator takes 64 of them; the column
#: statistics most of the rest): the triangular frame's compile (SimCSE's flags) spilled 32 bytes on sm_90 at 200 and
#: 48 at 168, none at 240, the most two consumers can have beside a 24-register loader.
CONSUMER_REGS = 240
#: ``maxnreg`` of the whole kernel: 3 warpgroups (2 consumers, the loader's warp rounded up to a warpgroup) share the
#: SM's 65536 registers, 65536 / 384 = 170.7, rounded down to a multiple of 8; the default partition (the first
#: consumer) gets what the workers leave: 3 x 168 - 240 - 24 = 240.
MAXNREG = 168

if AVAILABLE:
    try:  # (the decorators run Gluon's frontend: another version's may refuse what this one takes)

        @gluon.jit
        def _tile_of(t, n_pm, n_pn, GROUP_M: gl.constexpr):
            """Tile ``t`` as (row tile, column tile) in ``_grouped_tile``'s order (kernels/panel.py)."""
            group = GROUP_M * n_pn
            first_m = (t // group) * GROUP_M
            size_m = gl.minimum(n_pm - first_m, GROUP_M)
            return first_m + (t % group) % size_m, (t % group) // size_m

        @gluon.jit
        def _loader(x_desc, y_desc, xs, ys, ready, empty, P, M, D, GROUP_M: gl.constexpr):
            """The loader partition: every tile's operand tiles, BLOCK_K columns of D at a time, into the ring."""
            BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
            BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
            BLOCK_N: gl.constexpr = y_desc.block_type.shape[0]
            STAGES: gl.constexpr = xs.type.shape[0]
            n_pm = gl.cdiv(P, BLOCK_M)
            n_pn = gl.cdiv(M, BLOCK_N)
            n_k = gl.cdiv(D, BLOCK_K)
            c = 0
            for t in range(gl.program_id(0), n_pm * n_pn, gl.num_programs(0)):
                pid_m, pid_n = _tile_of(t, n_pm, n_pn, GROUP_M)
                for k in range(n_k):
                    s = c % STAGES
                    # a slot is free once its consumer released it (mbarriers start in phase 1 complete: the first
                    # STAGES waits pass)
                    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + y_desc.block_type.nbytes)
                    tma.async_load(x_desc, [pid_m * BLOCK_M, k * BLOCK_K], ready.index(s), xs.index(s))
                    tma.async_load(y_desc, [pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), ys.index(s))
                    c += 1

        @gluon.jit
        def _consumer(xs, ys, ready, empty, turn, MXP, ZP, CM, CZ, RSP, RB, SCALE, P, M, D, r0, offset, stride_zp,
                      CI: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                      NORMALIZE: gl.constexpr, EXCLUDE_SELF: gl.constexpr, WANT_COL: gl.constexpr, TRI: gl.constexpr):
            """Consumer warpgroup ``CI``: the products of its tiles by wgmma from the ring, then the statistics. With
            two consumers, ``turn`` orders their MMA loops: consumer CI starts its i-th tile's after the other consumer
            has finished the MMAs of the tile before it in the program's order (then every wait on a ring slot's
            "ready" barrier is for the phase after the last one waited: an mbarrier wait names its phase by parity
            only, so a consumer that waited two phases ahead would pass on an old phase and read another tile's
            operands)."""
            BLOCK_M: gl.constexpr = xs.type.shape[1]
            BLOCK_K: gl.constexpr = xs.type.shape[2]
            STAGES: gl.constexpr = xs.type.shape[0]
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, BLOCK_N, 16])
            row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
            col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
            n_pm = gl.cdiv(P, BLOCK_M)
            n_pn = gl.cdiv(M, BLOCK_N)
            n_k = gl.cdiv(D, BLOCK_K)
            s = gl.load(SCALE).to(gl.float32)
            i = 0  # this consumer's tiles so far
            for t in range(gl.program_id(0) + CI * gl.num_programs(0), n_pm * n_pn, CONSUMERS * gl.num_programs(0)):
                pid_m, pid_n = _tile_of(t, n_pm, n_pn, GROUP_M)
                c = (i * CONSUMERS + CI) * n_k  # the ring position of the tile's first slot (the loader's count)
                acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
                if CONSUMERS == 2:  # the first consumer's first wait passes (an mbarrier starts with phase -1 complete)
                    mbarrier.wait(turn.index(CI), (i & 1) ^ (1 - CI))
                for k in range(n_k):
                    st = c % STAGES
                    mbarrier.wait(ready.index(st), (c // STAGES) & 1)
                    acc = warpgroup_mma(xs.index(st), ys.index(st).permute((1, 0)), acc, is_async=True)
                    # one group in flight: the previous group has retired, its slot goes back to the loader
                    acc, _, _ = warpgroup_mma_wait(1, deps=(acc, xs.index(st), ys.index(st)))
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=k > 0)
                    c += 1
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
                if CONSUMERS == 2:  # the other consumer's MMAs may start: they run during this epilogue
                    mbarrier.arrive(turn.index(1 - CI))

                # the epilogue: kernels/panel.py _logits_rb / _logits, then MODE 3's row statistics
                loc = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
                lmask = loc < P
                cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                cmask = cols < M
                rsp = gl.load(RSP + loc, mask=lmask, other=0.0)
                if NORMALIZE:
                    rb = gl.load(RB + cols, mask=cmask, other=0.0)
                else:
                    rb = gl.where(cmask, 1.0, 0.0)
                cos = acc * gl.expand_dims(rsp, 1) * gl.expand_dims(rb, 0)
                lg = cos * s
                if EXCLUDE_SELF:
                    lg = gl.where(gl.expand_dims(cols, 0) == gl.expand_dims(r0 + loc + offset, 1), float("-inf"), lg)
                lg = gl.where(gl.expand_dims(lmask, 1) & gl.expand_dims(cmask, 0), lg, float("-inf"))
                rm = gl.max(lg, axis=1)
                rz = gl.sum(gl.exp(lg - gl.expand_dims(gl.where(rm == float("-inf"), 0.0, rm), 1)), axis=1)
                part = loc.to(gl.int64) * stride_zp + pid_n
                gl.store(MXP + part, rm, mask=lmask)
                gl.store(ZP + part, rz, mask=lmask)
                if WANT_COL:
                    cm = gl.max(lg, axis=0)
                    cz = gl.sum(gl.exp(lg - gl.expand_dims(gl.where(cm == float("-inf"), 0.0, cm), 0)), axis=0)
                    if TRI:
                        # the triangular frame: only the columns past the panel (rows of later panels). A whole column
                        # is in or out, so its statistics are masked instead of its logits (a second tile of selects
                        # spilled 164 bytes): a column out is (-inf, 0), what the Triton kernel's masked logits give
                        past = cols >= r0 + P
                        cm = gl.where(past, cm, float("-inf"))
                        cz = gl.where(past, cz, 0.0)
                    cpart = pid_m.to(gl.int64) * M + cols
                    gl.store(CM + cpart, cm, mask=cmask)
                    gl.store(CZ + cpart, cz, mask=cmask)
                i += 1

        @gluon.jit
        def epi_stats_ws_kernel(x_desc, y_desc, MXP, ZP, CM, CZ, RSP, RB, SCALE, P, M, D, r0, offset, stride_zp,
                                GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                                NORMALIZE: gl.constexpr, EXCLUDE_SELF: gl.constexpr, WANT_COL: gl.constexpr,
                                TRI: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                LOADER_REGS: gl.constexpr):
            """The row statistics of a panel (the module docstring): ``x_desc`` / ``y_desc`` TMA descriptors of X [P, D]
            and Y [M, D] (16-bit, block shapes [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K], NVMMA-swizzled), MXP / ZP
            [P, cdiv(M, BLOCK_N)] fp32 (row stride ``stride_zp``), RSP [P] and RB [M] fp32, SCALE a 1-element tensor;
            ``r0`` the panel's first row (the own column is ``r0 + i + offset``). Grid: at most one program per SM (a
            persistent grid; any grid size gives the same outputs); ``num_warps`` 4 (the first consumer), the kernel's
            ``maxnreg`` :data:`MAXNREG`; ``CONSUMERS`` 1 or 2; ``CONSUMER_REGS`` / ``LOADER_REGS`` the worker
            partitions' ``setmaxnreg`` (:data:`CONSUMER_REGS`, :data:`LOADER_REGS`)."""
            BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
            BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
            BLOCK_N: gl.constexpr = y_desc.block_type.shape[0]
            dtype: gl.constexpr = x_desc.dtype
            xs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
            ys = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], y_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=1)
                mbarrier.init(empty.index(st), count=1)
            for ci in gl.static_range(2):
                mbarrier.init(turn.index(ci), count=1)
            FIRST: gl.constexpr = 0
            SECOND: gl.constexpr = 1
            load_args = (x_desc, y_desc, xs, ys, ready, empty, P, M, D, GROUP_M)
            if CONSUMERS == 2:
                gl.warp_specialize([
                    (_consumer, (xs, ys, ready, empty, turn, MXP, ZP, CM, CZ, RSP, RB, SCALE, P, M, D, r0,
                                 offset, stride_zp, FIRST, CONSUMERS, BLOCK_N, GROUP_M, NORMALIZE, EXCLUDE_SELF,
                                 WANT_COL, TRI)),
                    (_consumer, (xs, ys, ready, empty, turn, MXP, ZP, CM, CZ, RSP, RB, SCALE, P, M, D, r0,
                                 offset, stride_zp, SECOND, CONSUMERS, BLOCK_N, GROUP_M, NORMALIZE, EXCLUDE_SELF,
                                 WANT_COL, TRI)),
                    (_loader, load_args),
                ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
            else:
                gl.warp_specialize([
                    (_consumer, (xs, ys, ready, empty, turn, MXP, ZP, CM, CZ, RSP, RB, SCALE, P, M, D, r0,
                                 offset, stride_zp, FIRST, CONSUMERS, BLOCK_N, GROUP_M, NORMALIZE, EXCLUDE_SELF,
                                 WANT_COL, TRI)),
                    (_loader, load_args),
                ], [1], [LOADER_REGS])
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(st))
                mbarrier.invalidate(empty.index(st))
            for ci in gl.static_range(2):
                mbarrier.invalidate(turn.index(ci))
    except Exception as _e:  # noqa: BLE001 - any failure means: no Gluon kernel here
        AVAILABLE = False
        IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

if not AVAILABLE:
    epi_stats_ws_kernel = None
