"""The Gluon form of the epilogue GEMM's statistics mode (``kernels/gluon_epi.py`` ``epi_stats_ws_kernel``: a
persistent, warp-specialised kernel for sm_90): when a launch may take it (:func:`fallback_reason`) and its launch
(:func:`stats_launch`), which takes exactly the arguments of the Triton launch it replaces (``epi_gemm_kernel``
in MODE 3, ``core/lse/triton_panel.py`` ``stats_forward``) and writes the same partials.

It is an option, never a default: env ``FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws`` (the switchboard's ``EPI_GEMM``;
default "triton") asks for it, and it runs only where every condition of :func:`fallback_reason` holds: a Triton
whose version is in :data:`TESTED_TRITON` (Gluon is experimental; its API moved between releases) with Gluon's
Hopper module, an sm_90 device (compute capability 9.0 exactly: wgmma is Hopper's; the meta device when the
recorder stands for sm_90), 16-bit operands whose rows TMA can copy, no bias column or margin, a host that is not
being traced. Elsewhere the Triton kernel runs and a ``RuntimeWarning`` (once per reason and process) says why.
No GPU has run the Gluon kernel: ``check --gpu-validate`` has a row that compares its statistics with float64
(``gpu_validate.check_gluon_stats``), and ``bench-gpu`` times it as the form ``epi=gluon-ws``."""

from __future__ import annotations

import warnings

import torch
import triton
from torch import Tensor

from ...kernels import gluon_epi as KG
from ...routes import setting
from . import launch as TL
from .launch import Launch

#: Triton versions the Gluon kernel was compiled with (sm_90, ``tests/test_gluon_epi.py``); any other takes the
#: Triton kernel. Add a version only after its compile test passes with it.
TESTED_TRITON = frozenset({"3.9.0"})

#: The switchboard's value that asks for the Gluon kernel (``EPI_GEMM``).
GLUON_WS = "gluon-ws"

#: Tile and ring of the Gluon kernel: [BLOCK_M, BLOCK_N] output tiles, BLOCK_K columns of D per ring slot, STAGES
#: slots (8 + 16 KiB each for bf16), CONSUMERS warpgroups (2: ping-pong). BLOCK_N is the Triton kernel's (the row
#: partials' layout); BLOCK_M is 64, not its 128: at 128 rows (a 128-register accumulator per thread) the column
#: statistics spilled 100-216 bytes on sm_90 at the most registers two consumers can have (240), flipping with
#: the flags; at 64 none spills (docs/panel-path.md, "Gluon"). The column partials are then per 64 rows.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS = 64, 128, 64, 4, 2

#: Launch name of the Gluon kernel (the recorder's and the validation's).
NAME = "epi_stats_gluon"

_WARNED: set[str] = set()

#: The reason of the latest refusal by :func:`use_gluon` (None: none yet, or the latest launch took the kernel);
#: ``check --gpu-validate`` reports it.
last_reason: str | None = None


def requested() -> bool:
    """Whether the switchboard asks for the Gluon kernel (``FUSED_CONTRASTIVE_EPI_GEMM=gluon-ws``)."""
    return setting("EPI_GEMM") == GLUON_WS


def fallback_reason(x: Tensor, y: Tensor, const: dict) -> str | None:
    """Why the MODE 3 launch of operands ``x`` [P, D], ``y`` [M, D] with constexprs ``const`` (those of
    ``epi_gemm_kernel``) cannot take the Gluon kernel; None when it can."""
    if not KG.AVAILABLE:
        return f"triton {triton.__version__} has no usable Gluon ({KG.IMPORT_ERROR})"
    if triton.__version__ not in TESTED_TRITON:
        return (f"triton {triton.__version__} is not a version the Gluon kernel was tested with "
                f"({', '.join(sorted(TESTED_TRITON))})")
    if TL.tensors_are_traced():
        return "a traced host (a tensor descriptor is not a tensor to torch.compile)"
    dev = x.device
    if dev.type == "meta":
        if TL._arch(dev) != "sm90":
            return f"the recorded arch is {TL._arch(dev)}, not sm_90"
    elif dev.type != "cuda":
        return f"{dev.type} tensors (Gluon has no interpreter; it needs an sm_90 CUDA device)"
    elif not torch.cuda.is_available():
        return "no CUDA device is available"
    else:
        cc = torch.cuda.get_device_capability(dev)
        if tuple(cc) != (9, 0):
            return f"compute capability {cc[0]}.{cc[1]}, not 9.0 (the kernel is Hopper's wgmma)"
    if x.dtype not in (torch.bfloat16, torch.float16) or y.dtype != x.dtype:
        return f"{x.dtype} / {y.dtype} operands (16-bit only)"
    if const.get("HAS_BIAS") or const.get("BIAS_COS") or const.get("POS_KIND", 0) != 0:
        return "a bias column, a margin or positives (not in the Gluon kernel)"
    if const.get("SPLIT_T"):
        return "the target split (SPLIT_T: the triangular sweep's saturated loss; not in the Gluon kernel)"
    for name, t in (("x", x), ("y", y)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or (dev.type != "meta" and t.data_ptr() % 16):
            return f"{name}'s rows are not 16-byte aligned (TMA)"
    return None


def use_gluon(x: Tensor, y: Tensor, const: dict) -> bool:
    """Whether this MODE 3 launch takes the Gluon kernel: :func:`requested` and no :func:`fallback_reason`;
    when requested but refused, a ``RuntimeWarning`` names the reason (once per reason and process)."""
    global last_reason
    if not requested():
        return False
    why = fallback_reason(x, y, const)
    last_reason = why
    if why is None:
        return True
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"fused_contrastive: FUSED_CONTRASTIVE_EPI_GEMM={GLUON_WS} is not used: {why}; the Triton "
                      "epilogue GEMM (kernels/panel.py) runs instead", RuntimeWarning, stacklevel=3)
    return False


def _descriptor(t: Tensor, block: list[int]):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))


def stats_launch(launch, name: str, args: dict, const: dict, n_tiles: int, programs: int) -> Launch:
    """Launch the Gluon kernel in place of ``epi_gemm_kernel``'s MODE 3 launch whose arguments are ``args`` /
    ``const`` (``stats_forward``'s: X and Y tensors, the partials MXP / ZP [P, n_pn] at row stride
    ``stride_zp``, n_pn at BLOCK_N columns, which must be the caller's, and with WANT_COL CM / CZ [cdiv(P, BLOCK_M),
    M] at this module's BLOCK_M, which the caller allocates so) on a persistent grid of ``min(n_tiles,
    programs)``; returns the :class:`Launch`. The caller has checked :func:`use_gluon`."""
    if const["BLOCK_N"] != BLOCK_N:
        raise ValueError(f"stats_launch: the caller's tiles are {const['BLOCK_N']} columns wide, the Gluon kernel's "
                         f"{BLOCK_N} (the row partials' layout depends on it)")
    if const["MODE"] != 3:
        raise ValueError(f"stats_launch: MODE {const['MODE']}, the Gluon kernel is MODE 3's")
    x, y = args["X"], args["Y"]
    want_col = bool(const["WANT_COL"])
    if want_col and tuple(args["CM"].shape) != (triton.cdiv(args["P"], BLOCK_M), args["M"]):
        raise ValueError(f"stats_launch: column partials {tuple(args['CM'].shape)}, the Gluon kernel writes "
                         f"[cdiv(P, {BLOCK_M}), M] = {(triton.cdiv(args['P'], BLOCK_M), args['M'])}")
    dm = args["DL"]  # (the caller's dummy)
    g = Launch(
        name, KG.epi_stats_ws_kernel, (max(1, min(n_tiles, programs)),),
        dict(x_desc=_descriptor(x, [BLOCK_M, BLOCK_K]), y_desc=_descriptor(y, [BLOCK_N, BLOCK_K]),
             MXP=args["MXP"], ZP=args["ZP"], CM=args["CM"] if want_col else dm, CZ=args["CZ"] if want_col else dm,
             RSP=args["RSP"], RB=args["RB"], SCALE=args["SCALE"], P=args["P"], M=args["M"], D=args["D"],
             r0=args["r0"], offset=args["offset"], stride_zp=args["stride_zp"]),
        dict(GROUP_M=const["GROUP_M"], STAGES=STAGES, CONSUMERS=CONSUMERS, NORMALIZE=bool(const["NORMALIZE"]),
             EXCLUDE_SELF=bool(const["EXCLUDE_SELF"]), WANT_COL=want_col, TRI=bool(const["TRI"]),
             CONSUMER_REGS=KG.CONSUMER_REGS, LOADER_REGS=KG.LOADER_REGS),
        4, 1, KG.MAXNREG if CONSUMERS == 2 else None)
    launch(g)
    return g
