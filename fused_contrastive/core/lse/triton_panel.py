"""The panel path of the Triton backend: matmuls in cuBLAS GEMMs, the per-logit work in one Triton kernel.

Why: the fused backward kernels (``kernels/lse.py``) recompute tiles and accumulate ``dl @ B`` through
a per-64-column read-modify-write of an fp32 scratch when D > 128 (~18 FLOP/B of L2 traffic, modelled
at 12-20% of bf16 peak on an H100; ``docs/panel-path.md``). Here every matmul is a
``torch.mm`` / ``addmm`` (cuBLAS on a GPU, fixed call order: deterministic for a fixed shape and
device), and ``kernels/panel.py`` does the softmax work of a panel in one pass.

Sweep over row panels of P rows (whole rows, all M columns), panel ``P_k = [r0, r0 + P)``:

1. ``X_P`` = A's rows scaled by a power of two each (exact; the products cannot overflow) with their
   clamped norms, by the row-norm prologue kernel (one launch per panel; B's norms once, in chunks);
2. ``Lraw = X_P @ B^T``, fp32 output (``out_dtype`` GEMM for 16-bit operands) [P, M]; the inverse
   norms are folded in by the kernel (raw operands: no normalised copy of A or B);
3. ``DL, W = panel_dl_kernel(Lraw, statistics)``: DL [P, M] in the operand dtype (fp16: times 2^13),
   W [P] row weights, the gradient tile being ``diag(W) DL`` (see "one pass" below);
4. ``dA_P`` = the normalisation backward of ``s gs / PRESCALE * diag(W) (DL @ B_op)`` (GEMM fp32 out,
   then ``panel_rows_kernel``, which also writes ``XW = diag(W) A_hat_P`` in the operand dtype);
5. ``acc[:gcols] += DL[:, :gcols]^T @ XW`` (fp32 accumulator of dB, ``addmm`` with ``out=acc``: one
   fixed order over the panels); after the sweep, dB from ``acc`` by the same row epilogue (times
   the norm of each row when the kernel folded its inverse norm).

Six launches per panel (row norms, 2 GEMMs + addmm, 2 Triton kernels), a handful per call.

**The epilogue GEMM** (16-bit operands, :func:`use_epilogue`): steps 2 and 3 become one Triton GEMM,
``kernels/panel.py`` ``epi_gemm_kernel``, whose epilogue forms DL (and W) from the products in registers
(:func:`_epi_panel`); the fp32 ``Lraw`` is never allocated (``panel_rows(..., epilogue=True)``: about 2.7x
taller panels for the same budget). Its statistics mode (:func:`stats_forward`) replaces the fused
forward kernel where the statistics come first (a column term, per-row output, the triangular sweep).

**One pass** (``ONE_PASS``: a summed loss without a column term and without a softmax over positives,
unit rows, bf16 / fp32 operands: InfoNCE, SimCSE, DSCL, ...): every logit is at most
``c = |s| (+ bias)``, so the kernel writes ``e_ij = exp(l_ij - m)``, ``m = c - 56`` (``e_ij <= e^56``:
no overflow of fp32 sums over M < 2^31 columns, derived in kernels/panel.py) in the same read that sums
``z_i = sum_j e_ij``; ``LSE_i = m + log z_i`` and ``W_i = g_i / (gscale z_i)`` follow, and the
gradient tile ``g_i p_ij = W_i e_ij`` needs no second read of the fp32 panel. A row block with a row of
``z_i < 2^-64`` (all its logits below ``c - 104.4``: possible only for ``|s| + bias > 52``; at
``|s| = 100`` a row whose every cosine is below -0.004; its small ``e_ij`` would lose precision) is
redone exactly in two passes (``W = 1`` there). Otherwise
(positives' softmax, fp16, raw dot products) the eager sweep reads the panel twice.

Units (one unit = one N x M x D matmul = 2 N M D FLOPs), by case:

* B is A without a bias, no column term, no softmax over positives (symmetric SimCSE,
  InfoNCE of a batch against itself; summed or per row): the **triangular sweep**, **2 units** plus
  the diagonal blocks (``P / N`` of a unit). Forward: the fused forward kernel over the tiles on and
  above the diagonal only (``lse_fwd_kernel`` with TRI, half a unit, no logits in memory: each tile's
  row statistics for its rows, its column statistics for the rows of its columns, merged per row by
  the host). Backward (:func:`tri_backward`): panel ``[r0, r1)`` holds its rows against columns
  ``[r0, N)`` only (the logits are symmetric), the logits GEMM (half a unit over the sweep),
  ``H = G + G^T`` from the same tile (``panel_dl_kernel`` with SYM and TRI), then
  ``acc[r0:r1] += H @ A[r0:]`` and ``acc[r1:] += H[:, P:]^T @ A_P`` (one unit), one fp32 accumulator
  of dA.
* other summed losses without a column term (InfoNCE, two-view / supervised SimCSE, SupCon, DSCL, ...;
  B is A with a bias or positives included, its two roles summed): **3 units, all cuBLAS**. The panel
  spans whole rows, so the kernel forms each row's LSE / LSEpos in the same sweep (``EAGER``) and the
  gradient is formed in the forward (scaled by the scalar upstream gradient in backward), as the
  torch backend does on CPU.
* per-row output or a column term (CLIP), A != B: the statistics first, from the fused forward kernel
  (1 unit, ``lse_fwd_kernel``: row, positive and column LSEs from the same tiles), then the panel
  backward (3 units, cuBLAS): **4 units**. (A panel sweep for the column LSE would also cost 1 unit.)
* the same with A is B without a bias (CLIP of A against itself, positives' softmax): fused forward (1) +
  panel backward with ``H = dl + dl^T`` from the same tile (logits 1 + ``H @ A`` 1): **3 units**, no
  dB accumulator.
* ``need_b`` False (a frozen tower): the ``dl^T @ A`` GEMM is skipped (2 units).
* a second backward through a retained graph after an EAGER forward: the recomputing panel backward
  from the statistics the eager sweep saved (3 more units).

No case falls back to the fused kernels on this path: every term of the core op (LSE, LSEcol, LSEpos
with label or dense-mask positives, exclude_self with an offset, the bias column, grad_cols, the
temperature gradient) is covered; TGT and SET are O(N*D) and come from ``positives.py`` on every path.

Memory (bytes; e = operand element size; "extra" = allocated by the loss beyond its inputs and the
gradients it returns; the fused forward's scaled copies ``sa, sb`` (``e (N + M) D``) and column
partials (``4 x 2 SMs x M``) of the non-EAGER cases exist only during the forward and are not kept;
B's row-norm chunks, ``e 2^22`` bytes, only before the sweep)::

    fixed  = 4 M D  [dB accumulator, dB needed]  +  e M D  [fp16 only: normalised B]
    per panel row  = (4 + e) M  [Lraw fp32, DL]  +  (4 + 2 e) D  [X_P, the dA GEMM's fp32 output, XW]
                     + 16  [norms, W]
    P = min(N, max(P_MIN, round_down_64((BUDGET - fixed) / per_row)))
    extra = fixed + P * per_row + O(N + M)

With the default ``BUDGET = 0.70e9`` at N = M = 131072, D = 768, bf16: fixed = 402.7 MB, per_row =
792 592 B, P = 320, extra = 656.3 MB + ~5 MB of vectors < 0.72 GB. At N = M = 65536: P = 1216.

GEMM FLOPs and bytes per panel (the model helper's inputs; P rows, M columns, D, e):

* logits: ``2 P M D`` FLOPs; reads ``e (P + M) D``, writes ``4 P M``;
* ``DL @ B``: ``2 P M D``; reads ``e (P M + M D)``, writes ``4 P D``;
* ``DL^T @ XW``: ``2 P M D``; reads ``e (P M + P D)``, read-modify-writes the fp32 accumulator
  ``8 M D`` (arithmetic intensity ~P/4 FLOP per accumulator byte: P >= ~1200 keeps it compute-bound
  on an H100's HBM, so small budgets at very large M make this GEMM bandwidth-bound);
* the Triton kernel: reads ``4 P M`` (two-pass EAGER ``8 P M``) + masks, writes ``e P M``
  (``kernels/panel.py``); the row epilogue O(P D).

Limits: products ``|pw_i A_i| |B_j|`` must stay in the fp32 range (raw B: rows of norm above ~1e37);
cuBLAS GEMMs are deterministic for a fixed shape, device and library version (set
``CUBLAS_WORKSPACE_CONFIG`` as PyTorch's determinism notes say when several streams are used); fp32
operands run the GEMMs in fp32 (or TF32 where the user allowed it), unlike the fused kernels' tf32x3.
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from ...kernels import panel as KP
from ..spec import Coeffs, combine
from ..triton_shared import launch as TL
from ..triton_shared.configs import (
    EPI_GEMM,
    EPI_GROUP_M,
    EPI_PERSIST_STAGES,
    EPI_REDO_ROWS,
    EPI_ROWS_BLOCK_C,
    EPI_ROWS_BLOCK_R,
    PANEL_CHUNK,
    PANEL_ROWS_BLOCK_R,
    PANEL_ROWS_MAX_BLOCK_D,
    PANEL_ROWS_WARPS,
    PANEL_WARPS,
    STATS_MERGE_BLOCK_O,
    STATS_MERGE_BLOCK_P,
    d_pad,
)
from ..triton_shared.launch import (
    Launch,
    _alloc,
    _cuda_props,
    _gscale,
    _index,
    _mask_args,
    _problem_args,
    _row_norms,
    _upcast,
)

__all__ = ["BUDGET_BYTES", "EPILOGUE_DEVICES", "EPILOGUE_MIN_ELEMENTS", "GEMM_PROBE_DEVICES", "MIN_ELEMENTS",
           "NATIVE_GEMMS", "PANEL_ROWS", "P_MIN", "gemm_routes", "panel_rows", "use_epilogue", "use_panel"]

#: Byte budget of the panel path's extra memory (env ``FUSED_CONTRASTIVE_PANEL_BUDGET`` overrides).
BUDGET_BYTES = 700_000_000
#: Fewest rows of a panel, whatever the budget says (below it the GEMMs lose their shape).
P_MIN = 64
#: Test hook: a fixed panel height (None: from the budget).
PANEL_ROWS: int | None = None
#: ``auto`` takes the panel path for CUDA tensors with N * M at least this (smaller problems are
#: launch-bound: the fused kernels do them in 3 launches).
MIN_ELEMENTS = 1 << 24
#: Programs of the panel kernel (None: 2 per SM on CUDA, 1 on the interpreter; the GPU model sets it).
PANEL_PROGRAMS: int | None = None
#: Elements of one chunk of B's row-norm prologue (its scaled copy is a temporary of this size).
NORM_CHUNK_ELEMENTS = 1 << 22
#: fp16 pre-scale of the gradient tile (see kernels/panel.py): |h| <= 6, 6 * 2^13 < 65504.
FP16_PRESCALE = 8192.0


def use_panel(a: Tensor, n: int, m: int) -> bool:
    """Which Triton path runs: env ``FUSED_CONTRASTIVE_TRITON_PATH`` = "panel", "fused" or "auto"
    (default). "auto": the panel path for CUDA tensors with N * M >= :data:`MIN_ELEMENTS`, the fused
    kernels otherwise (and always on the CPU interpreter, where the tests force either path)."""
    mode = os.environ.get("FUSED_CONTRASTIVE_TRITON_PATH", "auto")
    if mode not in ("auto", "panel", "fused"):
        raise ValueError(f"FUSED_CONTRASTIVE_TRITON_PATH must be 'auto', 'panel' or 'fused', got {mode!r}")
    if mode != "auto":
        return mode == "panel"
    return a.device.type == "cuda" and n * m >= MIN_ELEMENTS


def use_epilogue(dev: torch.device, dt: torch.dtype, form: str = "one_pass", elements: int = 0) -> bool:
    """Which GEMM forms a panel's gradient tile (or the statistics forward's tiles): the epilogue GEMM
    (``kernels/panel.py`` ``epi_gemm_kernel``: products in registers, the per-logit work as its epilogue,
    only the 16-bit tile written) or the cuBLAS form (an fp32 panel of products, then ``panel_dl_kernel``;
    the fused forward kernel for the statistics). Env ``FUSED_CONTRASTIVE_PANEL_GEMM`` = "epilogue",
    "cublas" or "auto" (default). "auto" on :data:`EPILOGUE_DEVICES`: the epilogue GEMM when the problem's
    ``elements`` (N x M) reach :data:`EPILOGUE_MIN_ELEMENTS` of its ``form`` ("one_pass": the eager sweep;
    "known": the statistics forward and the backward from known statistics, A != B; "tri": the
    triangular sweep) and the arch, else the cuBLAS form. fp32 operands always take cuBLAS (fp32 GEMMs, or
    TF32 where the user allowed it; a Triton fp32 dot would round to TF32 or take three passes)."""
    mode = os.environ.get("FUSED_CONTRASTIVE_PANEL_GEMM", "auto")
    if mode not in ("auto", "epilogue", "cublas"):
        raise ValueError(f"FUSED_CONTRASTIVE_PANEL_GEMM must be 'auto', 'epilogue' or 'cublas', got {mode!r}")
    if dt == torch.float32:
        return False
    if mode != "auto":
        return mode == "epilogue"
    if dev.type not in EPILOGUE_DEVICES:
        return False
    cc = 90 if TL._arch(dev) == "sm90" else 80
    return elements >= EPILOGUE_MIN_ELEMENTS[(form, cc)]


#: Device types whose 16-bit panels "auto" may give the epilogue GEMM (meta: the GPU model records what
#: CUDA runs). The CPU interpreter runs it when the tests ask for it.
EPILOGUE_DEVICES: tuple[str, ...] = ("cuda", "meta")
#: Smallest N x M at which "auto" takes the epilogue GEMM, per (form, compute capability): where
#: ``bench/gpu_model.py`` prefers it (its records' ``panel_form_should_prefer``; tests/test_gpu_model.py
#: fails when a route and the model disagree by more than the model's 5 % band) and, on sm_90, where an
#: H100 measured it faster (bench/results/h100-epilogue/gpu_validate.txt, bf16, D = 768, fwd + bwd:
#: InfoNCE 5.18 / 5.37 ms epilogue / cuBLAS at N = 16384 and 49.9 / 60.0 at 65536; CLIP 7.23 / 6.96 and
#: 77.1 / 92.7; SimCSE 6.83 / 5.99 and 43.0 / 50.4).
EPILOGUE_MIN_ELEMENTS: dict[tuple[str, int], int] = {
    ("one_pass", 80): 0, ("one_pass", 90): 0,
    ("known", 80): 0, ("known", 90): 1 << 30,
    ("tri", 80): 1 << 30, ("tri", 90): 1 << 32,
    ("guided", 80): 0, ("guided", 90): 0,
}


#: Forms of the epilogue GEMM's tile loop (env ``FUSED_CONTRASTIVE_EPI_FORM``; ``kernels/panel.py``
#: ``epi_gemm_kernel``'s PERSIST and TMA): "tiles" (the default: one program per output tile, operands by
#: 16-byte ``cp.async`` copies), "persistent" (one program per resident CTA walking the tiles in one
#: flattened loop, so the next tile's operand copies overlap this tile's epilogue) and "tma" (persistent,
#: operand tiles by TMA where the device has it: sm_90 and later, and the operands' rows are 16-byte
#: aligned; "persistent" elsewhere). The forms compute the same tiles. The default stays "tiles" until a
#: GPU has timed the others side by side (``bench/gpu_profile.py --epi-forms``): what they change is
#: pipeline latency, which ``bench/gpu_model.py`` does not model, so the model prices them alike.
EPI_FORMS = ("tiles", "persistent", "tma")
EPI_FORM_ENV = "FUSED_CONTRASTIVE_EPI_FORM"
#: Test hook: the persistent forms' grid (None: :func:`persistent_programs`, one program per SM on CUDA, the
#: model's GPU when recording, 3 programs on the interpreter, so that each walks several tiles).
EPI_PROGRAMS: int | None = None
#: SMs of the GPU a recording (the meta device) stands for, per arch: an H100 SXM, an A100.
RECORD_SMS = {"sm90": 132, "sm80": 108}


#: The tile-loop form a launch configuration of the epilogue GEMM takes on an arch when env :data:`EPI_FORM_ENV`
#: is unset ("tiles" where not listed), each from a measurement: SigLIP's one pass (MODE 5) on sm_90 with TMA
#: operand tiles, 58.4 against 63.9 ms for the tiles form (fwd + bwd at N = 65536, D = 768, bf16, one H200,
#: ``bench/results/h200-bench-gpu-1/bench_gpu.txt``, siglip ``fused_contrastive[epi=tma]``); the same run timed
#: the persistent forms slower than the tiles form for CLIP (0.83-0.86x), SimCSE (0.98-0.99x) and Matryoshka
#: CLIP (0.86-0.90x).
EPI_FORM_DEFAULT: dict[tuple[str, str], str] = {("siglip_eager", "sm90"): "tma"}


def epi_form(config: str | None = None, arch: str | None = None) -> str:
    """The epilogue GEMM's tile-loop form: env :data:`EPI_FORM_ENV` when set, else :data:`EPI_FORM_DEFAULT`'s for
    the launch configuration ``config`` on ``arch`` ("tiles" where it lists none)."""
    form = os.environ.get(EPI_FORM_ENV) or EPI_FORM_DEFAULT.get((config, arch), "tiles")
    if form not in EPI_FORMS:
        raise ValueError(f"{EPI_FORM_ENV} must be one of {', '.join(map(repr, EPI_FORMS))}, got {form!r}")
    return form


def _tma_ok(x: Tensor, y: Tensor) -> bool:
    """Whether TMA can copy ``x``'s and ``y``'s rows: sm_90 or later (the recorder's arch on the meta
    device; the interpreter emulates it), unit inner stride, 16-byte aligned rows and bases, and a host
    that is not being traced (a descriptor is not a tensor to ``torch.compile``)."""
    dev = x.device
    if TL.tensors_are_traced() or (dev.type != "cpu" and TL._arch(dev) != "sm90"):
        return False
    for t in (x, y):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16:
            return False
        if dev.type != "meta" and t.data_ptr() % 16:
            return False
    return True


def persistent_programs(dev: torch.device) -> int:
    """Programs of a persistent epilogue GEMM (this module's and the guided blocks'): :data:`EPI_PROGRAMS`
    when set, else one CTA per SM (every persistent compile uses more than 128 registers at 8 warps: see
    ``triton_configs.EPI_PERSIST_STAGES``), the model's GPU on the meta device, 3 on the interpreter."""
    if EPI_PROGRAMS is not None:
        return EPI_PROGRAMS
    if dev.type == "cpu":
        return 3
    return _cuda_props(_index(dev))[1] if dev.type == "cuda" else RECORD_SMS[TL._arch(dev)]


def _epi_launch(launch, name: str, args: dict, const: dict, config: str, n_tiles: int) -> None:
    """Launch the epilogue GEMM (MODE 0 / 1 / 3 / 4 / 5) over ``n_tiles`` tiles in the form of
    :func:`epi_form`, with the launch configuration ``EPI_GEMM[config]`` (its pipeline depth from
    ``EPI_PERSIST_STAGES`` in the persistent forms; a config without one keeps the tiles form): ``args`` /
    ``const`` those of the one-tile-per-program form (X and Y tensors)."""
    cfg = EPI_GEMM[config]
    dev = args["X"].device
    arch = TL._arch(dev)
    form = epi_form(config, arch)
    tma = form == "tma" and _tma_ok(args["X"], args["Y"])
    # (TMA implies sm_90; the interpreter, which runs the sm_80 table, emulates it)
    stages = EPI_PERSIST_STAGES[(config, "sm90" if tma else arch, tma)] if form != "tiles" else None
    if stages is None:  # the tiles form: one program per tile
        launch(Launch(name, KP.epi_gemm_kernel, (n_tiles,), args, dict(const, PERSIST=False, TMA=False),
                      cfg.num_warps, cfg.num_stages))
        return
    programs = persistent_programs(dev)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        bm, bn, bk = const["BLOCK_M"], const["BLOCK_N"], const["BLOCK_K"]
        x, y = args["X"], args["Y"]
        args = dict(args, X=TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk]),
                    Y=TensorDescriptor(y, list(y.shape), list(y.stride()), [bn, bk]))
    launch(Launch(name, KP.epi_gemm_kernel, (max(1, min(n_tiles, programs)),), args,
                  dict(const, PERSIST=True, TMA=tma), cfg.num_warps, stages))


def panel_rows(n: int, m: int, d: int, dtype: torch.dtype, need_db: bool, epilogue: bool = False) -> int:
    """P of the module docstring's formula (or :data:`PANEL_ROWS`); ``epilogue``: the epilogue GEMM's
    panel, which holds no fp32 products (``e M`` bytes per row for the tile plus three fp32 partials
    per 64 columns, instead of ``(4 + e) M``)."""
    if PANEL_ROWS is not None:
        return max(1, min(n, PANEL_ROWS))
    budget = int(os.environ.get("FUSED_CONTRASTIVE_PANEL_BUDGET", BUDGET_BYTES))
    e = torch.empty((), dtype=dtype).element_size()
    fixed = (4 * m * d if need_db else 0) + (e * m * d if dtype == torch.float16 else 0)
    per_col = e * m + 12 * triton.cdiv(m, 64) if epilogue else (4 + e) * m
    per_row = per_col + (4 + 2 * e) * d + 16
    p = (budget - fixed) // per_row
    p = p - p % 64 if p >= 64 else p
    return max(1, min(n, max(P_MIN, p)))


# The fp32-output GEMM of 16-bit operands. ``torch.mm(x, y, out_dtype=torch.float32)`` and
# ``torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)`` (fp32 ``acc``, bf16 / fp16 ``x``, ``y``)
# are the cheap route on CUDA (cuBLAS accumulates in fp32 and writes fp32), but whether a torch build
# has them, and accepts an fp32 ``self`` beside 16-bit operands, depends on its version (the overload
# is new; some CUDA builds reject the mixed-dtype addmm). So neither runs unproven: the first CUDA call
# per (device, dtype) runs both on tiny tensors of the real call's layout (transposed views, ``out=``
# the accumulator) against a float64 product (:func:`_probe`) and caches the verdict; on an exception
# or a mismatch it warns once and takes the fallback, which is correct everywhere:
#   mm    "native" | "upcast": torch.mm(x.float(), y.float()) (an fp32 copy of both operands)
#   addmm "native" | "mm_add": acc.add_(_mm32(x, y)) (one fp32 [rows, cols] temporary)
#         | "upcast": acc.addmm_(x.float(), y.float())
# The CPU has neither op (torch 2.13: "Could not run 'aten::mm.dtype' ... CPU"): it takes "upcast"
# unprobed; the meta device (the GPU model) records the native calls. Tests force the probe on the CPU
# with stand-ins for the native calls (:data:`GEMM_PROBE_DEVICES`, :data:`NATIVE_GEMMS`).

#: Device types whose 16-bit GEMMs are probed (test hook: the CPU with stand-in native calls).
GEMM_PROBE_DEVICES: tuple[str, ...] = ("cuda",)


def _native_mm(x: Tensor, y: Tensor) -> Tensor:
    return torch.mm(x, y, out_dtype=torch.float32)


def _native_addmm_(acc: Tensor, x: Tensor, y: Tensor) -> None:
    torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)


#: The native calls the probe and the "native" routes run (test hook).
NATIVE_GEMMS = {"mm": _native_mm, "addmm": _native_addmm_}
#: (device type, index, dtype) -> (mm route, addmm route): the probes' cached verdicts.
_GEMM_ROUTES: dict[tuple, tuple[str, str]] = {}


def _probe_one(op: str, dev: torch.device, dt: torch.dtype) -> str | None:
    """Run the native ``op`` once on tiny tensors of the real call's layout; None if its fp32 result
    matches the float64 product to fp32 accuracy, else what went wrong. The operands are 16-bit
    values whose products need more than 16 bits (a 16-bit output would be off by ~2^-9 relative; the
    bound is 2^-16 of sum |x||y|)."""
    g = torch.Generator().manual_seed(1234)
    k = 72
    x = (torch.randn(k, 24, generator=g) * 3).to(dt)  # used transposed: [24, 72], as dl[:, :g].T
    y = (torch.randn(40, k, generator=g) * 3).to(dt)  # used transposed: [72, 40], as b.T
    xd, yd = x.T.double(), y.T.double()
    want = xd @ yd
    bound = (xd.abs() @ yd.abs()) * 2.0 ** -16
    try:
        xt, yt = x.to(dev).T, y.to(dev).T
        if op == "mm":
            got = NATIVE_GEMMS["mm"](xt, yt)
        else:
            acc0 = torch.randn(24, 40, generator=g)
            acc = acc0.to(dev, copy=True)
            ptr = acc.data_ptr()
            NATIVE_GEMMS["addmm"](acc, xt, yt)
            if acc.data_ptr() != ptr:
                return "the result did not land in the accumulator"
            got, want = acc, want + acc0.double()
            bound = bound + acc0.double().abs() * 2.0 ** -22
        if got.dtype != torch.float32 or tuple(got.shape) != (24, 40):
            return f"result {got.dtype} {tuple(got.shape)}, expected torch.float32 (24, 40)"
        err = (got.detach().cpu().double() - want).abs()
        if not bool((err <= bound).all()):
            return (f"result differs from the float64 product by up to {float(err.max()):.3g} "
                    f"(bound {float(bound.max()):.3g})")
    except Exception as e:  # noqa: BLE001 - any failure of the native call means: do not use it
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def gemm_routes(dev: torch.device, dt: torch.dtype) -> tuple[str, str]:
    """``(mm route, addmm route)`` of the fp32-output GEMMs of ``dt`` operands on ``dev`` (see the
    comment above): probed once per (device, dtype) on :data:`GEMM_PROBE_DEVICES`, a warning on a
    fallback; "upcast" on other devices, "native" on meta; fp32 operands never come here. Before the
    first eager call on a device, a traced (torch.compile / export) or CUDA-graph-captured call takes
    "upcast" without probing."""
    if dev.type == "meta":
        return "native", "native"
    if dev.type not in GEMM_PROBE_DEVICES:
        return "upcast", "upcast"
    key = (dev.type, dev.index, dt)
    routes = _GEMM_ROUTES.get(key)
    if routes is None and (torch.compiler.is_compiling()
                           or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        # no probe while tracing (fake tensors have no values) or capturing a CUDA graph (no host
        # copies): the fallback for this call, nothing cached (an eager call probes later), said once
        if key not in _UNPROBED_WARNED:
            import warnings

            _UNPROBED_WARNED.add(key)
            warnings.warn(f"fused_contrastive: the first panel-path call with {dt} operands on {dev} is traced or "
                          "captured, where the fp32-output GEMMs cannot be probed: it takes the 'upcast' route "
                          "(fp32 GEMMs on TF32 over an fp32 copy of the operands: slower than the native route). "
                          "Run one eager call first to probe, and trace or capture after it", RuntimeWarning,
                          stacklevel=3)
        return "upcast", "upcast"
    if routes is None:
        why_mm = _probe_one("mm", dev, dt)
        why_addmm = _probe_one("addmm", dev, dt)
        routes = ("upcast" if why_mm else "native",
                  "native" if why_addmm is None else ("upcast" if why_mm else "mm_add"))
        for op, why, route in (("mm", why_mm, routes[0]), ("addmm", why_addmm, routes[1])):
            if why:
                import warnings

                warnings.warn(f"fused_contrastive: torch {torch.__version__} on {dev} has no working fp32-output "
                              f"{op} of {dt} operands ({why}); the panel path takes the {route!r} fallback "
                              f"(correct, more memory traffic)", RuntimeWarning, stacklevel=3)
        _GEMM_ROUTES[key] = routes
    return routes


#: (device type, index, dtype) whose unprobed (traced / captured) first call was announced
_UNPROBED_WARNED: set = set()


class _tf32_for:
    """Within the block, fp32 CUDA GEMMs may use TF32 when the operands were 16-bit: bf16 (8 significant
    bits) and fp16 (11, normal or subnormal: both inside fp32's exponent range) values are exact in TF32
    (11 significant bits, fp32's exponent), and their products (at most 22 bits) exact in fp32, so an
    upcast 16-bit GEMM on TF32 tensor cores with fp32 accumulation computes what the native fp32-output
    GEMM does, ~8x faster than full fp32. The global flag is put back afterwards."""

    def __init__(self, dtype: torch.dtype):
        self.on = dtype in (torch.bfloat16, torch.float16)

    def __enter__(self):
        if self.on:
            self.old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.backends.cuda.matmul.allow_tf32 = self.old


def _mm32(x: Tensor, y: Tensor) -> Tensor:
    """x @ y with an fp32 result (fp32 accumulation; 16-bit operands by :func:`gemm_routes`' route; the
    upcast route on TF32, :class:`_tf32_for`)."""
    if x.dtype == torch.float32:
        return torch.mm(x, y)
    if gemm_routes(x.device, x.dtype)[0] == "native":
        return NATIVE_GEMMS["mm"](x, y)
    with _tf32_for(x.dtype):
        return torch.mm(x.float(), y.float())


def _addmm32_(acc: Tensor, x: Tensor, y: Tensor) -> None:
    """acc += x @ y in place, acc fp32."""
    if x.dtype == torch.float32:
        acc.addmm_(x, y)
        return
    route = gemm_routes(x.device, x.dtype)[1]
    if route == "native":
        NATIVE_GEMMS["addmm"](acc, x, y)
    elif route == "mm_add":
        acc.add_(_mm32(x, y))
    else:
        with _tf32_for(x.dtype):
            acc.addmm_(x.float(), y.float())


def _pow2(x: Tensor) -> Tensor:
    """Per row the power of two that puts the row's largest magnitude in [1, 2), fp32 (1 for fp16: its
    products cannot overflow fp32, and scaling could push elements into fp16 subnormals). One
    reduction over x (no |x| temporary) and O(N) vector ops."""
    if x.dtype == torch.float16:
        return torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    big = torch.linalg.vector_norm(x, ord=float("inf"), dim=1).float()
    _, e = torch.frexp(big)
    return torch.ldexp(torch.ones_like(big), (1 - e).clamp(-126, 126))


def panel_blocks(p: int, programs: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the panel kernel for a panel of ``p`` rows: the most rows per program
    (of 16, 8, 4, 2, 1) that still gives at least ``programs`` programs, 2048 elements per chunk."""
    for r in (16, 8, 4, 2):
        if triton.cdiv(p, r) >= programs:
            return r, PANEL_CHUNK // r
    return 1, PANEL_CHUNK


def _programs(dev: torch.device) -> int:
    """Programs the panel kernel should have to fill the GPU (:data:`PANEL_PROGRAMS`, else 2 per SM on
    CUDA, else 1: the interpreter runs the fewest programs)."""
    if PANEL_PROGRAMS is not None:
        return PANEL_PROGRAMS
    if dev.type == "cuda":
        return 2 * _cuda_props(_index(dev))[1]
    return 1


class _Problem:
    """Statistics and operands of one sweep: O(N + M) vectors plus, for fp16, the normalised copy of B.

    With normalisation, B's norms come from the row-norm prologue kernel in chunks of at most
    :data:`NORM_CHUNK_ELEMENTS` elements (its scaled copy of the chunk is a temporary), and each panel
    of A gets its own launch (:meth:`rows`), whose scaled copy is the logits GEMM's operand. Without
    normalisation, one power of two per row of A (one reduction)."""

    def __init__(self, a: Tensor, b: Tensor, spec, need_op: bool = True):
        self.a, self.spec = a, spec
        self.normalize = spec.normalize
        self.dt = a.dtype
        self.fold = spec.normalize and self.dt != torch.float16
        self.prescale = FP16_PRESCALE if self.dt == torch.float16 else 1.0
        self.b_op = b
        self.nb = self.rb = self.pw = None
        m, d = b.shape
        if spec.normalize:
            self.nb = _alloc((m,), torch.float32, b.device)  # written by the chunks' launches
            self.rb = _alloc((m,), torch.float32, b.device)
            step = max(1, NORM_CHUNK_ELEMENTS // max(d, 1))
            fp16_copy = not self.fold and need_op
            if fp16_copy:  # fp16: the normalised B in fp16 (rounded once from fp32, as the fused kernels')
                self.b_op = torch.empty_like(b)
            for c0 in range(0, m, step):
                xs, _, _, rs = _row_norms(b[c0:c0 + step], spec.eps, self.nb[c0:c0 + step], self.rb[c0:c0 + step])
                if fp16_copy:
                    self.b_op[c0:c0 + step] = (xs.float() * rs[:, None]).to(self.dt)
                del xs
        else:
            self.pw = _pow2(a)
            self.pw_dt = self.pw.to(self.dt)
            self.rpw = 1.0 / self.pw

    def rows(self, r0: int, r1: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(x, rs, norm)`` of A's rows [r0, r1): the GEMM operand (the rows scaled by a power of two,
        exactly), the factor that turns it into the normalised (or raw) rows, the clamped norms."""
        if self.normalize:
            xs, nrm, _, rs = _row_norms(self.a[r0:r1], self.spec.eps)
            return xs, rs, nrm
        x = self.a[r0:r1] if self.dt == torch.float16 else self.a[r0:r1] * self.pw_dt[r0:r1, None]
        return x, self.rpw[r0:r1], None


def _rows_launch(launch, g, x, rs, nrm, w, scale_t, gs, out, xw, eps: float, normalize: bool, prescale: float, dm):
    """One launch of ``panel_rows_kernel`` (see kernels/panel.py) over the rows of ``x``."""
    r, d = x.shape
    launch(Launch(
        "panel_rows", KP.panel_rows_kernel, (triton.cdiv(r, PANEL_ROWS_BLOCK_R),),
        dict(G=g if g is not None else dm, X=x, RS=rs if rs is not None else dm, NRM=nrm if nrm is not None else dm,
             W=w, SCALE=scale_t, GSCALE=gs, OUT=out if out is not None else dm, XW=xw if xw is not None else dm,
             R=r, D=d, stride_g=g.stride(0) if g is not None else 0, stride_x=x.stride(0),
             stride_o=out.stride(0) if out is not None else 0, stride_xw=xw.stride(0) if xw is not None else 0,
             eps=float(eps)),
        dict(BLOCK_R=PANEL_ROWS_BLOCK_R, BLOCK_D=min(d_pad(d), PANEL_ROWS_MAX_BLOCK_D), NORMALIZE=bool(normalize),
             NEED_OUT=out is not None, NEED_XW=xw is not None, PRESCALE=prescale),
        PANEL_ROWS_WARPS, 1))


#: Keyword arguments of ``panel_dl_kernel``'s flags that the epilogue GEMM does not take.
_PANEL_ONLY_FLAGS = ("EAGER", "ONE_PASS")
#: The statistics' and problem's pointer arguments the epilogue GEMM shares with ``panel_dl_kernel``.
_EPI_POINTERS = ("RB", "SCALE", "GSCALE", "BIAS_COL", "ROW_LAB", "COL_LAB", "POS_MASK", "LSE", "G", "LSE_COL", "G_COL",
                 "LSE_POS", "G_POS", "TGT", "TV")


def _epi_panel(launch, x: Tensor, y: Tensor, dl: Tensor, rs: Tensor, common: dict, flags: dict, margs: dict, r0: int,
               one_pass: bool, g: Tensor | None, gs: Tensor, shift: Tensor | None, lse_out: Tensor | None, dm: Tensor,
               tw: Tensor | None = None):
    """One panel's gradient tile by the epilogue GEMM (``kernels/panel.py`` ``epi_gemm_kernel``):
    ``(W, ds)`` with ``W`` [P] the row weights (the tile is ``diag(W) DL``) and ``ds`` the panel's
    temperature-gradient parts (a 1-d fp32 tensor, None without NEED_DS).

    ``x`` [P, D] the panel's operand rows, ``y`` [M, D] the raw B, ``dl`` [P, M] the output tile.
    Known statistics (``one_pass`` False): one launch (MODE 0), W = 1. One pass: the MODE 1 launch
    writes ``e_ij`` and the partials; ``epi_rows_kernel`` sums them per row in a fixed order
    (O(P M / BLOCK_N)) and flags the rows with ``z_i < 2^-64``, a MODE 2 launch redoes those exactly (its
    row tiles without such a row return at once: no host synchronisation), then ``epi_rows_kernel`` again
    writes ``LSE_i = shift_i + log z_i`` to ``lse_out``, ``W_i = g_i / (gscale z_i)`` (0 where ``z_i = 0``:
    a row without any column) and, with SPLIT_T, the target weights to ``tw`` [P] (the panel's slice) and
    zeroes the target entries of ``dl``; ``shift`` is the fixed shift ``m`` as a 0-dim tensor."""
    pp, d = x.shape
    m = y.shape[0]
    dev = x.device
    cfg = EPI_GEMM["one_pass" if one_pass else "known"]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_d
    n_pm, n_pn = triton.cdiv(pp, bm), triton.cdiv(m, bn)
    need_s = bool(flags["NEED_DS"])
    args = dict(X=x, Y=y, DL=dl, RSP=rs.contiguous(), **{k: common[k] for k in _EPI_POINTERS}, P=pp, M=m, D=d, r0=r0,
                stride_x=x.stride(0), stride_y=y.stride(0), stride_dl=dl.stride(0), **margs)
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0, UPCAST=_upcast(x.dtype),
                 **{k: v for k, v in flags.items() if k not in _PANEL_ONLY_FLAGS}, WANT_COL=False)
    args.update(CZ=dm, CM=dm, LBIAS=dm)
    if not one_pass:
        ds_part = _alloc((n_pm * n_pn,), torch.float32, dev) if need_s else dm
        _epi_launch(launch, "epi_gemm",
                    dict(args, ZP=dm, TP=dm, MXP=dm, DS_PART=ds_part, BAD=dm, SHIFT=dm, stride_zp=0),
                    dict(const, MODE=0), "known", n_pm * n_pn)
        return torch.ones(pp, dtype=torch.float32, device=dev), (ds_part if need_s else None)
    zp = _alloc((pp, n_pn), torch.float32, dev)
    tp = _alloc((pp, n_pn), torch.float32, dev) if need_s else dm
    mxp = _alloc((pp, n_pn), torch.float32, dev)
    part = dict(args, ZP=zp, TP=tp, MXP=mxp, DS_PART=dm, stride_zp=n_pn)
    _epi_launch(launch, "epi_gemm", dict(part, BAD=dm, SHIFT=dm), dict(const, MODE=1), "one_pass", n_pm * n_pn)
    bad = torch.empty((pp,), dtype=torch.int8, device=dev)  # (the poisoned outputs of _alloc are NaN: float only)
    sh = _alloc((pp,), torch.float32, dev)
    w = _alloc((pp,), torch.float32, dev)
    dsw = _alloc((pp,), torch.float32, dev) if need_s else dm
    split = bool(flags["SPLIT_T"])  # MODE 1 / 2 reported e at each row's target column but left it in the tile
    rows_args = dict(ZP=zp, MXP=mxp, TP=tp, SHIFT0=shift, BAD=bad, SH=sh, LSE_OUT=lse_out, G=g, GSCALE=gs, W_OUT=w,
                     DSW=dsw, TV=common["TV"], TW=tw if split else dm, DL=dl, TGT=common["TGT"], P=pp, n_pn=n_pn, r0=r0,
                     stride_zp=n_pn, stride_dl=dl.stride(0))
    rows_const = dict(BLOCK_R=EPI_ROWS_BLOCK_R, BLOCK_C=EPI_ROWS_BLOCK_C, NEED_DS=need_s, SPLIT_T=split)
    rows_grid = (triton.cdiv(pp, EPI_ROWS_BLOCK_R),)
    launch(Launch("epi_rows", KP.epi_rows_kernel, rows_grid, rows_args, dict(rows_const, FINISH=False), 4, 1))
    # the redo's row tiles: EPI_REDO_ROWS rows at 8 warps (the partials' column tiles stay BLOCK_N wide);
    # a 128-row tile with the redo's column loop spilled on sm_90
    launch(Launch("epi_gemm_redo", KP.epi_gemm_kernel, (triton.cdiv(pp, EPI_REDO_ROWS),),
                  dict(part, BAD=bad, SHIFT=sh), dict(const, MODE=2, BLOCK_M=EPI_REDO_ROWS, PERSIST=False, TMA=False),
                  8, cfg.num_stages))
    launch(Launch("epi_rows", KP.epi_rows_kernel, rows_grid, rows_args, dict(rows_const, FINISH=True), 4, 1))
    return w, (dsw if need_s else None)


def stats_forward(launch, prep, a: Tensor, b: Tensor, scale_t: Tensor, spec, want_col: bool, tri: bool = False
                  ) -> tuple[Tensor, Tensor | None]:
    """``(LSE [N], LSEcol [M] or None)`` by the epilogue GEMM's statistics mode (MODE 3, one matmul unit,
    two exps per logit, nothing of size P x M written): per panel of rows the tiles' row maxima and
    sums, and with ``want_col`` their column maxima and sums, merged in a fixed order (``logsumexp`` over
    the tiles; the columns' over the panels by ``logaddexp``): deterministic and exact for any logits.
    Replaces the fused forward kernel (``lse_fwd``) for 16-bit panels without a softmax over positives.
    ``b`` is A itself when B is A. ``tri`` (the triangular sweep: B is A, symmetric logits, row LSE
    only): panel ``[r0, r1)`` against rows ``[r0, N)`` only (half a unit over the sweep), its row
    statistics for its rows and its column statistics for the rows past it, merged per row."""
    n, d = a.shape
    m = b.shape[0]
    dev, dt = a.device, a.dtype
    cfg = EPI_GEMM["stats"]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_d
    pr = _Problem(a, b, spec, need_op=False)
    p_rows = panel_rows(n, m, d, dt, False, True)
    dm = prep.dummy
    lse = _alloc((n,), torch.float32, dev)
    lse_col = torch.full((m,), float("-inf"), dtype=torch.float32, device=dev) if want_col or tri else None
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0, UPCAST=_upcast(dt),
                 MODE=3, NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                 HAS_BIAS=prep.bias_col is not None, BIAS_COS=spec.margin != 0.0, POS_KIND=0, HAS_G=False,
                 HAS_GCOL=False, HAS_GPOS=False, SYM=False, NEED_DS=False, FOLD_RB=False, PRESCALE=1.0, TRI=bool(tri),
                 WANT_COL=bool(want_col or tri), SPLIT_T=False)
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        x, rs, _ = pr.rows(r0, r1)
        c0 = r0 if tri else 0  # the triangular frame: columns [r0, N) of B = A, indices from 0
        y, mc = b[c0:], m - c0
        n_pm, n_pn = triton.cdiv(pp, bm), triton.cdiv(mc, bn)
        rm = _alloc((pp, n_pn), torch.float32, dev)
        rz = _alloc((pp, n_pn), torch.float32, dev)
        cm = _alloc((n_pm, mc), torch.float32, dev) if want_col or tri else dm
        cz = _alloc((n_pm, mc), torch.float32, dev) if want_col or tri else dm
        _epi_launch(launch, "epi_gemm_stats",
                    dict(X=x, Y=y, DL=dm, ZP=rz, TP=dm, MXP=rm, CZ=cz, CM=cm, DS_PART=dm, BAD=dm, SHIFT=dm, LBIAS=dm,
                         RSP=rs.contiguous(), RB=pr.rb[c0:] if pr.rb is not None else dm, SCALE=scale_t,
                         GSCALE=dm, **_problem_args(prep), LSE=dm, G=dm, LSE_COL=dm, G_COL=dm, LSE_POS=dm, G_POS=dm,
                         TGT=dm, TV=dm, P=pp, M=mc, D=d, r0=0 if tri else r0, stride_x=x.stride(0),
                         stride_y=y.stride(0), stride_dl=0, stride_zp=n_pn, **_mask_args(prep, spec)),
                    const, "stats", n_pm * n_pn)
        del x
        # the partials merged by stats_merge_kernel: the rows' over their column tiles, the columns' over the
        # panel's row tiles and into their statistics so far
        bo, bp = STATS_MERGE_BLOCK_O, STATS_MERGE_BLOCK_P
        launch(Launch("stats_merge", KP.stats_merge_kernel, (triton.cdiv(pp, bo),),
                      dict(MX=rm, Z=rz, OUT=lse[r0:r1], n_out=pp, n_part=n_pn, stride_o=n_pn, stride_p=1),
                      dict(BLOCK_O=bo, BLOCK_P=bp, ACC=False), 4, 1))
        if want_col or tri:
            launch(Launch("stats_merge", KP.stats_merge_kernel, (triton.cdiv(mc, bo),),
                          dict(MX=cm, Z=cz, OUT=lse_col[c0:], n_out=mc, n_part=n_pm, stride_o=1, stride_p=mc),
                          dict(BLOCK_O=bo, BLOCK_P=bp, ACC=True), 4, 1))
    if tri:  # every row: its panel's row statistics and the column statistics of the panels above it
        return torch.logaddexp(lse, lse_col), None
    return lse, lse_col


def siglip_sweep(launch, x: Tensor, y: Tensor, scale_t: Tensor, bias_t: Tensor, normalize: bool, eps: float,
                 offset: int, g: Tensor | None, need_x: bool, need_y: bool, need_s: bool, with_loss: bool = False):
    """SigLIP on row panels (``kernels/panel.py`` ``epi_gemm_kernel`` MODE 4; the math in
    ``kernels/siglip.py``): ``(loss [N], dX, dY, ds, db)`` for images ``x`` [N, D] and texts ``y`` [M, D]
    in one 16-bit dtype, ``scale_t`` / ``bias_t`` [1] fp32. Without ``g`` (the forward): the per-image
    losses only, one matmul unit. With ``g`` [N] fp32 (the upstream gradient of each image's loss; the
    loss is then None unless ``with_loss``): per panel the epilogue GEMM writes the gradient tile ``dz``
    (16-bit, pre-scaled and ``rb_j`` folded as the core op's ``DL``), then the core sweep's cuBLAS GEMMs
    and row epilogue give dX and the dY accumulator: 3 units. ``with_loss`` (MODE 5, the eager forward of
    a summed loss: ``g`` is its weight per row) forms the losses in the same epilogue: 3 units for the step
    where a forward and a backward sweep take 4 (the fused kernels take 5, their backward streaming through
    an fp32 scratch). ds / db are 0-dim fp32 tensors (no host sync), None unless ``need_s``; dX / dY None
    unless asked."""
    from ..spec import CoreSpec

    n, d = x.shape
    m = y.shape[0]
    dev, dt = x.device, x.dtype
    spec = CoreSpec(normalize=normalize, eps=eps)
    need = g is not None
    pr = _Problem(x, y, spec, need_op=need and need_x)
    p_rows = panel_rows(n, m, d, dt, need and need_y, True)
    one_pass = need and with_loss  # MODE 5
    with_loss = with_loss or not need
    config = "siglip_eager" if one_pass else "siglip_bwd" if need else "siglip_fwd"
    cfg = EPI_GEMM[config]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_d
    dm = torch.empty(1, dtype=torch.float32, device=dev)
    gs = _gscale(g) if need else None
    loss = _alloc((n,), torch.float32, dev) if with_loss else None
    dx = _alloc((n, d), dt, dev) if need and need_x else None
    acc = torch.zeros((m, d), dtype=torch.float32, device=dev) if need and need_y else None
    n_pn = triton.cdiv(m, bn)
    ds_parts, db_parts = [], []
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0, UPCAST=_upcast(dt),
                 MODE=5 if one_pass else 4, NORMALIZE=bool(normalize), EXCLUDE_SELF=False, HAS_BIAS=False,
                 BIAS_COS=False, POS_KIND=0,
                 HAS_G=need, HAS_GCOL=False, HAS_GPOS=False, SYM=False, NEED_DS=bool(need and need_s),
                 FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale, TRI=False, WANT_COL=False, SPLIT_T=False)
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        xp, rs, nrm = pr.rows(r0, r1)
        n_pm = triton.cdiv(pp, bm)
        zp = _alloc((pp, n_pn), torch.float32, dev) if with_loss else dm
        tp = _alloc((pp, n_pn), torch.float32, dev) if need and need_s else dm
        bp = _alloc((pp, n_pn), torch.float32, dev) if need and need_s else dm
        dl = _alloc((pp, m), dt, dev) if need else dm
        _epi_launch(launch, "epi_gemm_siglip",
                    dict(X=xp, Y=y, DL=dl, ZP=zp, TP=tp, MXP=bp, CZ=dm, CM=dm, DS_PART=dm, BAD=dm, SHIFT=dm,
                         LBIAS=bias_t, RSP=rs.contiguous(), RB=pr.rb if pr.rb is not None else dm, SCALE=scale_t,
                         GSCALE=gs if need else dm, BIAS_COL=dm, ROW_LAB=dm, COL_LAB=dm, POS_MASK=dm, LSE=dm,
                         G=g if need else dm, LSE_COL=dm, G_COL=dm, LSE_POS=dm, G_POS=dm, TGT=dm, TV=dm, P=pp, M=m,
                         D=d, r0=r0,
                         stride_x=xp.stride(0), stride_y=y.stride(0), stride_dl=dl.stride(0) if need else 0,
                         stride_zp=n_pn, offset=int(offset), bias=0.0, n0=1, m0=1, stride_pm=1),
                    const, config, n_pm * n_pn)
        if with_loss:
            loss[r0:r1] = zp.sum(1)
        if need and need_s:
            ds_parts.append(tp.sum().reshape(1))
            db_parts.append(bp.sum().reshape(1))
        if need:
            _panel_gemms(launch, pr, dl, torch.ones(pp, dtype=torch.float32, device=dev), xp, rs, nrm, scale_t, gs,
                         dx[r0:r1] if need_x else None, acc, m, dm)
        del xp, dl
    dy = None
    if acc is not None:
        dy = _db_from_acc(launch, pr, acc, y, m, scale_t, gs, dm)
        del acc
    ds = db = None
    if need and need_s:
        ds = torch.cat(ds_parts).sum() * gs.reshape(())
        db = torch.cat(db_parts).sum() * gs.reshape(())
    return loss, dx, dy, ds, db


def _one_pass_shift(scale_t: Tensor, spec, has_bias: bool, bias: float) -> Tensor:
    """The fixed shift ``m = c - 56`` of the one-pass sweep as a 0-dim fp32 tensor (the kernels'
    ``_one_pass_shift``: ``c = |s|``, plus the kernels' ``bias`` argument (``_mask_args``) when positive,
    in cosine units for a margin)."""
    s = scale_t.reshape(()).abs()
    c = s
    if has_bias:
        c = s + s * max(bias, 0.0) if spec.margin != 0.0 else s + max(bias, 0.0)
    return c - KP.ONE_PASS_SHIFT.value


def _panel_gemms(launch, pr: "_Problem", dl: Tensor, w: Tensor, x: Tensor, rs: Tensor, nrm, scale_t: Tensor,
                 gs: Tensor, da_rows: Tensor | None, acc: Tensor | None, gcols: int, dm: Tensor) -> None:
    """The cuBLAS half of one panel, after its gradient tile ``diag(w) dl`` [P, M] is formed: dA of the
    panel rows into ``da_rows`` (the normalisation backward of ``(w dl @ B) s gs / PRESCALE``, by
    ``panel_rows_kernel``, which also writes ``XW = diag(w) A_hat_P``) and ``acc[:gcols] += dl[:, :gcols]^T
    @ XW`` (the fp32 dB accumulator; None: no dB)."""
    p, d = x.shape
    da_raw = _mm32(dl, pr.b_op) if da_rows is not None else None
    xw = _alloc((p, d), x.dtype, x.device) if acc is not None else None
    if da_raw is not None or xw is not None:
        _rows_launch(launch, da_raw, x, rs, nrm, w, scale_t, gs, da_rows, xw, pr.spec.eps, pr.normalize,
                     pr.prescale, dm)
    del da_raw
    if acc is not None:
        _addmm32_(acc, dl[:, :gcols].T, xw)


def _db_from_acc(launch, pr: "_Problem", acc: Tensor, b: Tensor, gcols: int, scale_t: Tensor, gs: Tensor,
                 dm: Tensor, wide: bool = False) -> Tensor:
    """dB [M, D] in B's dtype (fp32 with ``wide``) from the sweep's fp32 accumulator of its first ``gcols`` rows: the
    normalisation backward of ``acc s gs / PRESCALE``, times the norm of each row where the tile folded its
    inverse norm; rows past ``gcols`` (queue columns) get no gradient."""
    m, d = b.shape
    db = _alloc((m, d), torch.float32 if wide else b.dtype, b.device)
    if gcols < m:
        db[gcols:].zero_()
    if gcols > 0:
        wcol = pr.nb[:gcols] if pr.fold else torch.ones(gcols, dtype=torch.float32, device=b.device)
        _rows_launch(launch, acc, b[:gcols], pr.rb[:gcols] if pr.rb is not None else None,
                     pr.nb[:gcols] if pr.nb is not None else None, wcol, scale_t, gs, db[:gcols], None, pr.spec.eps,
                     pr.normalize, pr.prescale, dm)
    return db


def sweep(launch, prep, a: Tensor, b: Tensor, sym: bool, scale_t: Tensor, spec,
          lse: Tensor | None, lse_col: Tensor | None, lse_pos: Tensor | None,
          g: Tensor | None, g_col: Tensor | None, g_pos: Tensor | None,
          need_a: bool, need_b: bool, need_s: bool, eager: bool, wide: bool = False,
          target: Tensor | None = None):
    """One panel sweep: ``(dA, dB, ds, LSE, LSEpos, tw)`` (dA / dB in the operand dtype, fp32 with ``wide``;
    ds 0-dim fp32; LSE / LSEpos only with ``eager``, else None; None where not asked).

    ``target`` [N] (int64): each row's target column is left out of the gradient
    tiles, and ``tw`` [N] fp32 is the gradient with respect to the target logit ``l[i, target[i]]``
    (for the coefficients ``g``; what the caller applies with the target term, ``core.PiecesFn``);
    else ``tw`` is None.

    ``prep`` is the fused path's ``_Prepared`` (labels, mask, bias columns, dummy); ``launch`` is
    ``triton_backend._launch`` (so the AOT recorder sees these launches). With ``eager``, ``g`` /
    ``g_pos`` are the coefficients as [N] fp32 and ``lse`` / ``lse_pos`` are produced here. ``sym``:
    B is A without a bias, dA holds both roles and dB is None.
    """
    n, d = a.shape
    m = b.shape[0]
    dev, dt = a.device, a.dtype
    need_b = need_b and not sym
    gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
    one_pass = bool(eager and g_pos is None and spec.normalize and dt != torch.float16)
    # the epilogue GEMM needs the statistics first: known ones (the recomputing backward) or one pass
    epi = use_epilogue(dev, dt, "one_pass" if one_pass else "known", n * m) and (one_pass or not eager)
    p_rows = panel_rows(n, m, d, dt, need_b, epi)
    block_r, block_c = panel_blocks(min(n, p_rows), _programs(dev))
    pr = _Problem(a, b, spec)
    gs = _gscale(g, g_col, g_pos)
    dm = prep.dummy
    lse_out = torch.empty(n, dtype=torch.float32, device=dev) if eager else None
    lsep_out = torch.empty(n, dtype=torch.float32, device=dev) if eager and g_pos is not None else None
    split = target is not None
    tw = torch.empty(n, dtype=torch.float32, device=dev) if split else None
    da = _alloc((n, d), torch.float32 if wide else dt, dev) if need_a else None
    acc = torch.zeros((gcols, d), dtype=torch.float32, device=dev) if need_b and gcols > 0 else None
    ds_parts = []
    common = dict(RB=pr.rb if pr.rb is not None else dm, SCALE=scale_t, GSCALE=gs, **_problem_args(prep),
                  LSE=lse if lse is not None else dm, G=g if g is not None else dm,
                  LSE_COL=lse_col if lse_col is not None else dm, G_COL=g_col if g_col is not None else dm,
                  LSE_POS=lse_pos if lse_pos is not None else dm, G_POS=g_pos if g_pos is not None else dm,
                  LSE_OUT=lse_out if lse_out is not None else dm,
                  LSE_POS_OUT=lsep_out if lsep_out is not None else dm, TGT=target.contiguous() if split else dm)
    # one read of each panel (the fixed-bound exponentials, see kernels/panel.py) where the bound is
    # known (unit rows) and a single softmax forms the gradient (no positives' softmax); fp16 keeps the
    # two passes (its range cannot hold exp(l - |s|))
    one_pass = bool(eager and g_pos is None and spec.normalize and dt != torch.float16)
    flags = dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                 HAS_BIAS=prep.bias_col is not None, BIAS_COS=spec.margin != 0.0, POS_KIND=prep.pos_kind,
                 HAS_G=g is not None,
                 HAS_GCOL=g_col is not None, HAS_GPOS=g_pos is not None, SYM=bool(sym), EAGER=bool(eager),
                 ONE_PASS=one_pass, NEED_DS=bool(need_s), FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale,
                 TRI=False, SPLIT_T=split)
    bt = b.T
    margs = _mask_args(prep, spec)
    shift = _one_pass_shift(scale_t, spec, prep.bias_col is not None, margs["bias"]) if epi and one_pass else None
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        x, rs, nrm = pr.rows(r0, r1)
        dl = _alloc((pp, m), dt, dev)
        tv = _alloc((pp,), torch.float32, dev) if split else dm
        if epi:
            w, ds_part = _epi_panel(launch, x, b, dl, rs, dict(common, TV=tv), flags, margs, r0, one_pass, g, gs,
                                    shift, lse_out, dm, tw[r0:r1] if split else None)
        else:
            lraw = _mm32(x, bt)
            w = _alloc((pp,), torch.float32, dev)
            n_prog = triton.cdiv(pp, block_r)
            ds_part = _alloc((n_prog,), torch.float32, dev) if need_s else dm
            launch(Launch(
                "panel_dl", KP.panel_dl_kernel, (n_prog,),
                dict(L=lraw, DL=dl, W_OUT=w, RSP=rs.contiguous(), **common, TV=tv, DS_PART=ds_part, M=m, r0=r0, P=pp,
                     stride_l=lraw.stride(0), stride_dl=dl.stride(0), **margs),
                dict(BLOCK_R=block_r, BLOCK_C=block_c, **flags), PANEL_WARPS, 1))
            del lraw
        if need_s:
            ds_parts.append(ds_part)
        if split and not (epi and one_pass):  # the target columns' true weights W_i gscale tv_i (tv is in the
            tw[r0:r1] = tv * w * gs.reshape(())  # tile's units; the one-pass epilogue GEMM writes them itself)
        _panel_gemms(launch, pr, dl, w, x, rs, nrm, scale_t, gs, da[r0:r1] if need_a else None, acc, gcols, dm)
        del dl, x
    db = None
    if need_b:
        db = _db_from_acc(launch, pr, acc, b, gcols, scale_t, gs, dm, wide)
        del acc
    ds = None
    if need_s:
        ds = (torch.cat(ds_parts).sum() * gs.reshape(())) if ds_parts else torch.zeros((), device=dev)
    return da, db, ds, lse_out, lsep_out, tw


def use_tri(p, want_col: bool, want_pos: bool) -> bool:
    """The triangular sweep: B is A without a bias (symmetric logits), no column term, no softmax over
    positives (symmetric SimCSE, InfoNCE of a batch against itself)."""
    return bool(p.sym and not want_col and not want_pos)


def _tri_panels(pr: _Problem, a: Tensor, p_rows: int, epilogue: bool):
    """The triangular sweep's panels: ``(r0, P, C, Lraw, rs, x)`` for rows [r0, r0 + P) against rows
    [r0, N) (C = N - r0): ``x`` the rows' operand and ``rs`` its factors; with the cuBLAS form ``Lraw``
    [P, C] their raw products (fp32, one GEMM) and ``x`` None, with the epilogue GEMM ``Lraw`` None."""
    n = a.shape[0]
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        x, rs, _ = pr.rows(r0, r1)
        if epilogue:
            yield r0, r1 - r0, n - r0, None, rs, x
        else:
            lraw = _mm32(x, a[r0:].T)
            del x
            yield r0, r1 - r0, n - r0, lraw, rs, None
            del lraw


def tri_backward(launch, prep, a: Tensor, spec, scale_t: Tensor, lse: Tensor, g: Tensor, need_a: bool,
                 need_s: bool, wide: bool = False, target: Tensor | None = None
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward of the triangular sweep: ``(dA, ds)`` of B-is-A logits from the upper triangle only.

    The gradient of symmetric logits is ``dA_hat = s (G + G^T) A_hat`` with ``G_ij = g_i p_ij``. Per panel
    (rows [r0, r1), columns [r0, N)) ``panel_dl_kernel`` (SYM, TRI) writes ``H_ij = G_ij + G_ji`` from
    the one logit (the rows' and the columns' LSE), then ``acc[r0:r1] += H @ A[r0:]`` and
    ``acc[r1:] += H[:, P:]^T @ A_P``: pairs inside the diagonal block once, every other pair from the
    panel of its smaller row. Logits half a unit + the two GEMMs one unit: with the forward's half
    unit, 2 matmul units (the eager sweep takes 3). bf16 / fp32 fold both inverse norms into H, so
    both GEMMs read the raw A and the accumulator holds ``dA_hat_i rb_i`` (undone by the epilogue);
    fp16 reads a normalised fp16 copy of A. dL/ds counts the diagonal block's ``G_ji`` once.

    Returns ``(dA, ds, tw)``. With ``target`` [N] (int64) every row's own target weight ``G_{i, t_i}`` is
    left out of H (at ``(i, t_i)``, and transposed at ``(t_i, i)``) and comes back in ``tw`` [N] fp32
    (as :func:`sweep`'s): from the row's panel when ``t_i`` is in its frame, else from the panel of
    ``t_i`` (the pair's transposed term there); else ``tw`` is None."""
    n, d = a.shape
    dev, dt = a.device, a.dtype
    epi = use_epilogue(dev, dt, "tri", n * n)
    p_rows = panel_rows(n, n, d, dt, True, epi)
    block_r, block_c = panel_blocks(min(n, p_rows), _programs(dev))
    pr = _Problem(a, a, spec, need_op=need_a)
    gs = _gscale(g)
    dm = prep.dummy
    acc = torch.zeros((n, d), dtype=torch.float32, device=dev) if need_a else None
    ds_parts = []
    split = target is not None
    tv = torch.zeros(n, dtype=torch.float32, device=dev) if split else None
    flags = dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self), HAS_BIAS=False, BIAS_COS=False,
                 POS_KIND=0,
                 HAS_G=True, HAS_GCOL=False, HAS_GPOS=False, SYM=True, EAGER=False, ONE_PASS=False,
                 NEED_DS=bool(need_s), FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale, TRI=True, SPLIT_T=split)
    a_op = pr.b_op  # raw A (folded norms, or no normalisation) or the normalised fp16 copy
    for r0, pp, c, lraw, rs, x in _tri_panels(pr, a, p_rows, epi):
        r1 = r0 + pp
        h = _alloc((pp, c), dt, dev)
        common = dict(RB=pr.rb[r0:] if pr.rb is not None else dm, SCALE=scale_t, GSCALE=gs, **_problem_args(prep),
                      LSE=lse[r0:], G=g[r0:], LSE_COL=dm, G_COL=dm, LSE_POS=dm, G_POS=dm,
                      TGT=(target[r0:] - r0).contiguous() if split else dm, TV=tv[r0:] if split else dm)
        if epi:
            _, ds_part = _epi_panel(launch, x, a[r0:], h, rs, common, flags, _mask_args(prep, spec), 0, False, None,
                                    gs, None, None, dm)
        else:
            n_prog = triton.cdiv(pp, block_r)
            ds_part = _alloc((n_prog,), torch.float32, dev) if need_s else dm
            launch(Launch(
                "panel_dl", KP.panel_dl_kernel, (n_prog,),
                dict(L=lraw, DL=h, W_OUT=_alloc((pp,), torch.float32, dev), RSP=rs.contiguous(), **common,
                     LSE_OUT=dm, LSE_POS_OUT=dm, DS_PART=ds_part, M=c, r0=0, P=pp, stride_l=lraw.stride(0),
                     stride_dl=h.stride(0), **_mask_args(prep, spec)),
                dict(BLOCK_R=block_r, BLOCK_C=block_c, **flags), PANEL_WARPS, 1))
        del lraw, x
        if need_s:
            ds_parts.append(ds_part)
        if acc is not None:
            _addmm32_(acc[r0:r1], h, a_op[r0:])
            if c > pp:
                _addmm32_(acc[r1:], h[:, pp:].T, a_op[r0:r1])
        del h
    da = None
    if acc is not None:
        da = _alloc((n, d), torch.float32 if wide else dt, dev)
        wrow = pr.nb if pr.fold else torch.ones(n, dtype=torch.float32, device=dev)
        _rows_launch(launch, acc, a, pr.rb, pr.nb, wrow, scale_t, gs, da, None, spec.eps, spec.normalize,
                     pr.prescale, dm)
        del acc
    ds = None
    if need_s:
        ds = torch.cat(ds_parts).sum() * gs.reshape(()) if ds_parts else torch.zeros((), device=dev)
    return da, ds, (tv * gs.reshape(()) if split else None)


def _vec(c, n: int, dev) -> Tensor:
    if isinstance(c, Tensor):
        return c.to(device=dev, dtype=torch.float32).contiguous()
    return torch.full((n,), float(c), dtype=torch.float32, device=dev)


def forward(ctx, a: Tensor, b: Tensor | None, orig_dtypes, scale, spec, data, coef: Coeffs, reduce: bool):
    """TritonCoreFn.forward on the panel path (``a``, ``b`` already in the kernel dtype)."""
    same = b is None
    want_col, want_pos = coef.col is not None, coef.pos is not None
    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    need_s = need_s and isinstance(scale, Tensor)
    n = a.shape[0]
    dev = a.device
    p = TL._prepare_data(a, b, spec, data, want_pos)
    bb = p.b
    ctx.path = "panel"
    ctx.spec, ctx.coef, ctx.reduce = spec, coef, reduce
    ctx.scale = None if isinstance(scale, Tensor) else scale
    ctx.dtypes = orig_dtypes
    ctx.prep = p._replace(a=None, b=None, sa=None, sb=None)
    scale_t = TL._scale32(scale, dev)
    ctx.tri = use_tri(p, want_col, want_pos)
    # the target column left out of the 16-bit tiles (core.PiecesFn asks, with a target term)
    ctx.split = data.target if getattr(ctx, "split_target", False) and coef.pos is None else None
    eager = reduce and not want_col and not ctx.tri and (need_a or need_b or need_s)
    if eager:
        g = _vec(coef.lse, n, dev)
        g_pos = _vec(coef.pos, n, dev) if want_pos else None
        da, db, ds, lse, lse_pos, tw = sweep(TL._launch, p, p.a, bb, False, scale_t, spec, None, None, None,
                                             g, None, g_pos, need_a, need_b or (same and need_a), need_s, True,
                                             getattr(ctx, "wide", False), ctx.split)
        if same and da is not None:
            da = da + db  # B is A with a bias: both roles of A
            db = None
        ctx.eager = (da, db, ds, tw)
        lse_col = None
    elif ctx.tri:
        ctx.eager = None
        lse_col, lse_pos = None, None
        if use_epilogue(dev, a.dtype, "tri", n * n):
            lse = stats_forward(TL._launch, p, p.a, p.a, scale_t, spec, False, tri=True)[0]
        else:
            lse = TL._lse_fwd(a, None, scale, spec, data, False, False, tri=True)[0]
    elif use_epilogue(dev, a.dtype, "known", n * bb.shape[0]) and not want_pos:
        ctx.eager = None
        lse, lse_col = stats_forward(TL._launch, p, p.a, bb, scale_t, spec, want_col)
        lse_pos = None
    else:
        ctx.eager = None
        lse, lse_col, lse_pos, _ = TL._lse_fwd(a, b, scale, spec, data, want_col, want_pos)
    ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos, p.a,
                          None if same else p.b)
    return combine(coef.to(torch.float32), reduce, lse, lse_col, lse_pos)


def backward(ctx, go: Tensor):
    """TritonCoreFn.backward on the panel path."""
    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    adt, bdt, sdt, sshape = ctx.dtypes
    same = bdt is None
    go = go.to(torch.float32)

    def out(da, db, ds):
        return (da.to(adt) if need_a and da is not None else None,
                db.to(bdt) if need_b and not same and db is not None else None,
                ds.to(sdt).reshape(sshape) if need_s and ds is not None else None,
                None, None, None, None)

    if ctx.eager is not None:
        da, db, ds, tw = ctx.eager
        ctx.eager = None  # a second backward (retain_graph) recomputes from the saved statistics
        if tw is not None:
            ctx.moved_target = tw * go  # what core.PiecesFn applies with the target term
        return out(da.mul_(go.to(da.dtype)) if da is not None else None,
                   db.mul_(go.to(db.dtype)) if db is not None else None,
                   ds * go if ds is not None else None)
    scale, lse, lse_col, lse_pos, a, b = ctx.saved_tensors
    if scale is None:
        scale = ctx.scale
    spec, coef = ctx.spec, ctx.coef
    p = ctx.prep
    n = lse.shape[0]
    g = TL._coef_grad(coef.lse, go, n, lse)
    if ctx.tri:
        need_s = need_s and isinstance(scale, Tensor)
        if g is None:
            g = torch.zeros(n, dtype=torch.float32, device=a.device)
        da, ds, tw = tri_backward(TL._launch, p, a, spec, TL._scale32(scale, a.device), lse, g, need_a, need_s,
                                  getattr(ctx, "wide", False), ctx.split)
        if tw is not None:
            ctx.moved_target = tw  # what core.PiecesFn applies with the target term
        return out(da, None, ds)
    g_col = TL._coef_grad(coef.col, go, lse_col.shape[0], lse_col) if lse_col is not None else None
    g_pos = TL._coef_grad(coef.pos, go, n, lse_pos)
    bb = a if same else b
    sym = p.sym
    need_s = need_s and isinstance(scale, Tensor)
    da, db, ds, _, _, tw = sweep(TL._launch, p, a, bb, sym, TL._scale32(scale, a.device), spec, lse, lse_col,
                                 lse_pos, g, g_col, g_pos, need_a,
                                 (need_b and not same) or (same and not sym and need_a), need_s, False,
                                 getattr(ctx, "wide", False), ctx.split)
    if tw is not None:
        ctx.moved_target = tw  # what core.PiecesFn applies with the target term
    if same and not sym and da is not None:
        da = da + db
        db = None
    return out(da, db, ds)
