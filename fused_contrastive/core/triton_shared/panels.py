"""The panel routes' shared host machinery (the core op's panel path, SigLIP's sweep, the guided and Matryoshka
panel routes): the panel height from the byte budget (:func:`panel_rows`), whether a problem takes the panel path
and the epilogue GEMM (:func:`use_panel`, :func:`use_epilogue`, :func:`epi_form`), the epilogue GEMM's launch in
its tiles / persistent / TMA forms, the fp32-output GEMMs and their probes (:func:`gemm_routes`, ``_mm32``,
``_addmm32_``), a sweep's operands and statistics (``_Problem``), the row epilogue (``_rows_launch``) and the
cuBLAS half of one panel (``_panel_gemms``, ``_db_from_acc``). Device code: ``kernels/panel.py``."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...kernels import panel as KP
from ...routes import setting
from . import launch as TL
from .configs import (
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
    d_pad,
)
from .launch import (
    Launch,
    _alloc,
    _cuda_props,
    _index,
    _row_norms,
    _upcast,
)

__all__ = ["BUDGET_BYTES", "EPILOGUE_DEVICES", "EPILOGUE_MIN_ELEMENTS", "GEMM_PROBE_DEVICES", "MIN_ELEMENTS",
           "NATIVE_GEMMS", "P_MIN", "gemm_routes", "panel_rows", "use_epilogue", "use_panel"]

#: Byte budget of the panel path's extra memory (env ``FUSED_CONTRASTIVE_PANEL_BUDGET`` overrides).
BUDGET_BYTES = 700_000_000


#: Fewest rows of a panel, whatever the budget says (below it the GEMMs lose their shape).
P_MIN = 64


#: ``auto`` takes the panel path for CUDA tensors with N * M at least this (smaller problems are
#: launch-bound: the fused kernels do them in 3 launches).
MIN_ELEMENTS = 1 << 24


#: Elements of one chunk of B's row-norm prologue (its scaled copy is a temporary of this size).
NORM_CHUNK_ELEMENTS = 1 << 22


#: fp16 pre-scale of the gradient tile (see kernels/panel.py): |h| <= 6, 6 * 2^13 < 65504.
FP16_PRESCALE = 8192.0


def use_panel(a: Tensor, n: int, m: int) -> bool:
    """Which Triton path runs: env ``FUSED_CONTRASTIVE_TRITON_PATH`` = "panel", "fused" or "auto"
    (default). "auto": the panel path for CUDA tensors with N * M >= :data:`MIN_ELEMENTS`, the fused
    kernels otherwise (and always on the CPU interpreter, where the tests force either path)."""
    mode = setting("TRITON_PATH")
    if mode != "auto":
        return mode == "panel"
    return a.device.type == "cuda" and n * m >= MIN_ELEMENTS


def use_epilogue(dev: torch.device, dt: torch.dtype, form: str = "one_pass", elements: int = 0) -> bool:
    """Which GEMM forms a panel's gradient tile (or the statistics forward's tiles): the epilogue GEMM
    (``kernels/panel.py`` ``epi_gemm_kernel``: products in registers, the per-logit work as its epilogue,
    only the 16-bit tile written) or the cuBLAS form (an fp32 panel of products, then ``panel_dl_kernel``;
    the fused forward kernel for the statistics). Env ``FUSED_CONTRASTIVE_PANEL_GEMM`` = "epilogue",
    "cublas", "fp16pass" or "auto" (default; "fp16pass" is "auto" here: it changes only the one pass's tiles of
    bf16 operands, which ``core/triton_shared/logit_pass.py`` produces, ``use_fp16_pass``). "auto" on
    :data:`EPILOGUE_DEVICES`: the epilogue GEMM when the problem's
    ``elements`` (N x M) reach :data:`EPILOGUE_MIN_ELEMENTS` of its ``form`` ("one_pass": the eager sweep;
    "known": the statistics forward and the backward from known statistics, A != B; "tri": the
    triangular sweep) and the arch, else the cuBLAS form. fp32 operands always take cuBLAS (fp32 GEMMs, or
    TF32 where the user allowed it; a Triton fp32 dot would round to TF32 or take three passes)."""
    mode = setting("PANEL_GEMM")
    if dt == torch.float32:
        return False
    if mode == "fp16pass":  # the one pass's own form (core/triton_shared/logit_pass.py); the default elsewhere
        mode = "auto"
    if mode != "auto":
        return mode == "epilogue"
    if dev.type not in EPILOGUE_DEVICES:
        return False
    cc = 90 if TL._arch(dev) == "sm90" else 80
    return elements >= EPILOGUE_MIN_ELEMENTS[(form, cc)]


#: Device types whose 16-bit panels "auto" may give the epilogue GEMM (meta: the GPU model records what
#: CUDA runs). The CPU interpreter runs it when the tests ask for it.
EPILOGUE_DEVICES: tuple[str, ...] = ("cuda", "meta")


#: Smallest N x M at which "auto" takes the epilogue GEMM, per (form, compute capability). Evidence:
#: ``routes.ROUTES`` (the epilogue GEMM rows); the measurements: docs/gpu-measurements.md.
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


#: SMs of the GPU a recording (the meta device) stands for, per arch: an H100 SXM, an A100.
RECORD_SMS = {"sm90": 132, "sm80": 108}


#: The tile-loop form a launch configuration of the epilogue GEMM takes on an arch when env :data:`EPI_FORM_ENV`
#: is unset ("tiles" where not listed). Evidence: ``routes.ROUTES``; the measurements: docs/gpu-measurements.md.
EPI_FORM_DEFAULT: dict[tuple[str, str], str] = {("siglip_eager", "sm90"): "tma"}


def epi_form(config: str | None = None, arch: str | None = None) -> str:
    """The epilogue GEMM's tile-loop form: env :data:`EPI_FORM_ENV` when set, else :data:`EPI_FORM_DEFAULT`'s for
    the launch configuration ``config`` on ``arch`` ("tiles" where it lists none)."""
    return setting("EPI_FORM") or EPI_FORM_DEFAULT.get((config, arch), "tiles")


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
    """Programs of a persistent epilogue GEMM (this module's and the guided blocks'): the switchboard's hook
    ``EPI_PROGRAMS`` when set, else one CTA per SM (every persistent compile uses more than 128 registers at 8
    warps: see ``triton_shared.configs.EPI_PERSIST_STAGES``), the model's GPU on the meta device, 3 on the
    interpreter."""
    if setting("EPI_PROGRAMS") is not None:
        return setting("EPI_PROGRAMS")
    if dev.type == "cpu":
        return 3
    return _cuda_props(_index(dev))[1] if dev.type == "cuda" else RECORD_SMS[TL._arch(dev)]


def _epi_launch(launch, name: str, args: dict, const: dict, config: str, n_tiles: int) -> None:
    """Launch the epilogue GEMM (MODE 0 / 1 / 3 / 4 / 5) over ``n_tiles`` tiles in the form of
    :func:`epi_form`, with the launch configuration ``EPI_GEMM[config]`` (its pipeline depth from
    ``EPI_PERSIST_STAGES`` in the persistent forms; a config without one keeps the tiles form): ``args`` /
    ``const`` those of the one-tile-per-program form (X and Y tensors)."""
    cfg = EPI_GEMM[config]
    # (the SET term's split and the exact target weights: MODE 0's, whose callers name them; pm_shift the mask's
    # index shift; WX never read without EXACT_T)
    const, args = {"SPLIT_SET": False, "EXACT_T": False, **const}, {"pm_shift": 0, "WX": args["TV"], "CT": args["TV"],
                                                                     **args}
    const = dict(const, HOIST=bool(const.get("HOIST", False)))  # (set by _epi_panel for MODE 0 / 1 / 2)
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


def panel_rows(n: int, m: int, d: int, dtype: torch.dtype, need_db: bool, epilogue: bool = False,
               extra: tuple[int, int] = (0, 0)) -> int:
    """P of the module docstring's formula (or the switchboard's hook ``PANEL_ROWS``); ``epilogue``: the epilogue GEMM's
    panel, which holds no fp32 products (``e M`` bytes per row for the tile plus three fp32 partials
    per 64 columns, instead of ``(4 + e) M``); ``extra``: (fixed, per row) bytes a tile producer adds (the
    fp16 pass's unit rows, ``logit_pass.panel_bytes``)."""
    if setting("PANEL_ROWS") is not None:
        return max(1, min(n, setting("PANEL_ROWS")))
    budget = setting("PANEL_BUDGET") or BUDGET_BYTES
    e = torch.empty((), dtype=dtype).element_size()
    fixed = (4 * m * d if need_db else 0) + (e * m * d if dtype == torch.float16 else 0) + extra[0]
    per_col = e * m + 12 * triton.cdiv(m, 64) if epilogue else (4 + e) * m
    per_row = per_col + (4 + 2 * e) * d + 16 + extra[1]
    p = (budget - fixed) // per_row
    p = p - p % 64 if p >= 64 else p
    return max(1, min(n, max(P_MIN, p)))


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
    """Programs the panel kernel should have to fill the GPU (the switchboard's hook ``PANEL_PROGRAMS``, else 2 per
    SM on CUDA, else 1: the interpreter runs the fewest programs)."""
    if setting("PANEL_PROGRAMS") is not None:
        return setting("PANEL_PROGRAMS")
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
                 "LSE_POS", "G_POS", "TGT", "TV", "WX")


def _epi_panel(launch, x: Tensor, y: Tensor, dl: Tensor, rs: Tensor, common: dict, flags: dict, margs: dict, r0: int,
               one_pass: bool, g: Tensor | None, gs: Tensor, shift: Tensor | None, lse_out: Tensor | None, dm: Tensor,
               tw: Tensor | None = None, loss_out: Tensor | None = None, fold_out: Tensor | None = None,
               producer=None):
    """One panel's gradient tile by the epilogue GEMM (``kernels/panel.py`` ``epi_gemm_kernel``):
    ``(W, ds)`` with ``W`` [P] the row weights (the tile is ``diag(W) DL``) and ``ds`` the panel's
    temperature-gradient parts (a 1-d fp32 tensor, None without NEED_DS).

    ``x`` [P, D] the panel's operand rows, ``y`` [M, D] the raw B, ``dl`` [P, M] the output tile.
    Known statistics (``one_pass`` False): one launch (MODE 0), W = 1. One pass: the MODE 1 launch
    writes ``e_ij`` and the partials; ``epi_rows_kernel`` sums them per row in a fixed order
    (O(P M / BLOCK_N)) and flags the rows with ``z_i < 2^-64``, a MODE 2 launch redoes those exactly (its
    row tiles without such a row return at once: no host synchronisation), then ``epi_rows_kernel`` again
    writes ``LSE_i = shift_i + log z_i`` to ``lse_out``, ``W_i = g_i / (gscale z_i)`` (0 where ``z_i = 0``:
    a row without any column) and, with SPLIT_T (the target column left out of ``dl``, whose entries there are 0),
    the target weights to ``tw`` [P] (the panel's slice), each row's loss less its target logit (``log1p(zx_i /
    e_it)``, or ``LSE_i`` where not formed that way) to ``loss_out`` [P] and 1 (or 0) to ``fold_out`` [P]
    (``kernels/panel.py`` ``epi_rows_kernel``); ``shift`` is the fixed shift ``m`` as a 0-dim tensor. The
    switchboard's ``EPI_HOIST`` sets the epilogue GEMM's HOIST (its per-row loads before the products' loop;
    the same results). ``producer`` (one pass only): what writes the tile and its partials in place of the
    MODE 1 launch (``logit_pass.Fp16Pass``: cuBLAS fp16 cosines and one pass over them), called as
    ``producer(launch, x, rs, dl, ZP, TP, MXP, common, flags, margs, r0, BLOCK_N)``; it writes what MODE 1
    writes."""
    pp, d = x.shape
    m = y.shape[0]
    dev = x.device
    cfg = EPI_GEMM["one_pass" if one_pass else "known"]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_d
    n_pm, n_pn = triton.cdiv(pp, bm), triton.cdiv(m, bn)
    need_s = bool(flags["NEED_DS"])
    args = dict(X=x, Y=y, DL=dl, RSP=rs.contiguous(), **{k: common[k] for k in _EPI_POINTERS},
                pm_shift=common.get("pm_shift", 0), P=pp, M=m, D=d, r0=r0,
                stride_x=x.stride(0), stride_y=y.stride(0), stride_dl=dl.stride(0), **margs)
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=EPI_GROUP_M, EVEN_K=d % bk == 0, UPCAST=_upcast(x.dtype),
                 **{k: v for k, v in flags.items() if k not in _PANEL_ONLY_FLAGS}, WANT_COL=False, LEAN=False,
                 HOIST=bool(setting("EPI_HOIST")))
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
    split = bool(flags["SPLIT_T"])  # MODE 1 / 2 left each row's target column out of the tile and ZP, e_t in TV
    # (split, NEED_DS) each row's target cosine, from the tile that holds it (0 for a target no tile holds)
    ct = torch.zeros((pp,), dtype=torch.float32, device=dev) if split and need_s else dm
    part = dict(args, ZP=zp, TP=tp, MXP=mxp, DS_PART=dm, stride_zp=n_pn, CT=ct)
    if producer is None:
        _epi_launch(launch, "epi_gemm", dict(part, BAD=dm, SHIFT=dm), dict(const, MODE=1), "one_pass", n_pm * n_pn)
    else:
        producer(launch, x, rs, dl, zp, tp, mxp, dict(common, CT=ct), flags, margs, r0, bn)
    bad = torch.empty((pp,), dtype=torch.int8, device=dev)  # (the poisoned outputs of _alloc are NaN: float only)
    sh = _alloc((pp,), torch.float32, dev)
    w = _alloc((pp,), torch.float32, dev)
    dsw = _alloc((pp,), torch.float32, dev) if need_s else dm
    if split and (loss_out is None or fold_out is None or tw is None):
        raise ValueError("_epi_panel: a one pass with SPLIT_T needs tw, loss_out and fold_out")
    rows_args = dict(ZP=zp, MXP=mxp, TP=tp, SHIFT0=shift, BAD=bad, SH=sh, LSE_OUT=lse_out, G=g, GSCALE=gs, W_OUT=w,
                     DSW=dsw, TV=common["TV"], TW=tw if split else dm, LOSS=loss_out if split else dm,
                     FOLD=fold_out if split else dm, CT=ct, P=pp, n_pn=n_pn, r0=r0, stride_zp=n_pn)
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
