"""Generator of the ahead-of-time kernel library (``CMakeLists.txt`` runs it; see the README section
"C++ / ahead-of-time kernels").

``python -m fused_contrastive.c_library --arch 80 --arch 90 --out DIR`` records the launches of one forward +
backward of the core op through the Triton launcher's own launch recorder
(``fused_contrastive.tools.compile_survey.record_core``: meta tensors, exactly the runtime argument lists) for every
covered feature set ("mode"), dtype and D class, compiles each distinct launch with
``triton.compile(..., target=GPUTarget("cuda", cc, 32))`` (no GPU needed) and writes

* ``DIR/cubin/<variant>.cubin``: the compiled kernels;
* ``DIR/fc_kernels_gen.h`` / ``fc_kernels_gen.c``: per variant its cubin bytes, symbol name, warps,
  shared memory and constexpr key; per kernel its argument layout (the non-constexpr parameters in
  order, their C types, and which ones were compiled as divisible by 16); the launch-config table
  (``triton_shared.configs.CONFIGS`` for the compiled dtypes) and the launcher's constants;
* ``DIR/manifest.json``: the same, for the tests.

``python -m fused_contrastive.c_library check --gen DIR --fc-run FC_RUN --mock LIBMOCK --work TMP`` (a ctest) runs the C
API on the mock driver for a grid of problems and compares each launch with the Python launcher's (variant,
cubin bytes, grid, block, shared memory, every argument), then byte-compares launched cubins with a fresh
``triton.compile``; with ``--torch-lib LIB`` it does the same through the torch operators.

The panel path (``core/lse/triton_panel.py``: cuBLAS GEMMs with the kernels of ``kernels/panel.py`` between
them) is recorded as well, once per grid of :data:`PANEL_PROGRAMS_REC` (every row-block size), and its
kernels are tabled by constexpr key (:func:`ckey`): ``fc_launch_kernel`` launches them for the torch
operators, whose host code (``csrc/fc_torch.cpp``) does the GEMMs with ``at::mm``. ``check --torch-lib``
compares those launches too (buffers by identity, see :func:`compare_calls`) and the GEMMs' order and
shapes (``torch.profiler`` sees the ATen calls made from C++).

Nothing in the C tables is typed by hand: a kernel change (a new parameter, a new constexpr, another
config) flows through the recorder into the tables, and ``check`` (the launch comparison the ctest
runs) fails if the hand-written C host logic no longer matches the Python launcher.

Covered feature set (the C API's "modes"; positives by labels or masks, bias and queues with their own
dense-mask kernels are not compiled): normalised rows, no bias, no positive term, with

* ``info_nce``: B given, row LSE (InfoNCE / MNRL with keys, SimCSE supervised);
* ``clip``: B given, row and column LSE (CLIP's two directions from one pass);
* ``self``: B is A with the self column excluded (SimCSE unsupervised in-batch, symmetric backward);
* ``info_nce_margin`` / ``clip_margin``: ``info_nce`` / ``clip`` with an additive margin in cosine units
  on each row's target logit, ``l_it = s (c_it - margin)`` (``CoreSpec.margin`` with
  ``CoreData.target``; AM-softmax / LaBSE): the kernels with ``HAS_BIAS`` and ``BIAS_COS`` (the margin
  rides on the bias column, ``bias = -margin`` at column ``target_i``). The C API selects them when
  ``fc_problem.margin != 0``; the margin and the targets are runtime arguments;
* ``info_nce_split`` / ``clip_split`` / ``self_split``: ``info_nce`` / ``clip`` / ``self`` with the target split
  (SPLIT_T: each row's target entry, and CLIP's ``(j, j)`` where ``target[j] == j``, kept out of the statistics
  and the 16-bit gradient tiles; ``triton_fused._lse_fwd`` with ``minus_target``, ``_lse_bwd`` with ``target``),
  recorded with an int64 target vector [n]. ``fc_forward_split`` / ``fc_backward_split`` select them (fused path
  only: no panel path);
* ``info_nce_margin_split`` / ``clip_margin_split``: the margin feature sets with the target split (the split's target
  vector is the margin's), selected by the split calls when ``fc_problem.margin != 0``.

The backward always computes dA and the scale gradient partials (NEED_DX, NEED_DS), dB when asked
(``info_nce``/``clip``). Triton must be imported with ``TRITON_INTERPRET=0`` (the ``main`` entry
point sets it when unset).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

#: mode -> (B given, column LSE, exclude_self, target margin, target split); see the module docstring.
MODES: dict[str, tuple[bool, bool, bool, bool, bool]] = {
    "info_nce": (True, False, False, False, False),
    "clip": (True, True, False, False, False),
    "self": (False, False, True, False, False),
    "info_nce_margin": (True, False, False, True, False),
    "clip_margin": (True, True, False, True, False),
    "info_nce_split": (True, False, False, False, True),
    "clip_split": (True, True, False, False, True),
    "self_split": (False, False, True, False, True),
    "info_nce_margin_split": (True, False, False, True, True),
    "clip_margin_split": (True, True, False, True, True),
}

#: The margin the margin modes are recorded with (a runtime argument: any value runs the same cubins;
#: exact in fp32, so the launch checks compare it bit for bit).
REC_MARGIN = 0.25


def base_mode(mode: str) -> str:
    """The C API's mode of a feature set: ``"info_nce_margin"`` -> ``"info_nce"`` (FC_MODE_INFO_NCE with
    ``fc_problem.margin != 0``), ``"clip_split"`` -> ``"clip"`` (FC_MODE_CLIP through ``fc_forward_split`` /
    ``fc_backward_split``)."""
    return mode.removesuffix("_split").removesuffix("_margin")

#: D classes: a padded D of a resident config ("16" .. "128": its own BLOCK_D) or "big" (D_PAD > 128,
#: streamed in fixed chunks). Recorded at these D (the largest of each class).
D_CLASSES = {"16": 16, "32": 32, "64": 64, "128": 128, "big": 768}

#: Integer parameters compiled as divisible by 16 (and so required to be by the C API): the row width
#: and every row stride (16-element rows give 16-byte aligned rows: vectorised loads).
#: The launch-config table's kernels the C launcher uses, by the kernel they configure ("fwd_wide": the
#: forward with row statistics only, the ``wide`` entries of the C table).
_CONFIG_KERNELS = {"fwd": "lse_fwd", "fwd_wide": "lse_fwd", "bwd_rows": "lse_bwd_rows", "bwd_cols": "lse_bwd_cols"}


#: Row strides of a panel (its width M, or N - r0 for a triangular panel): any value, never specialised.
_UNALIGNED = frozenset({"stride_l", "stride_dl"})


def _aligned_int(name: str) -> bool:
    return (name == "D" or name.startswith("stride_")) and name not in _UNALIGNED


#: The panel path's kernels (``kernels/panel.py``; ``core/lse/triton_panel.py`` launches them between cuBLAS
#: GEMMs). The C library has no GEMM: ``fc_launch_kernel`` launches them by constexpr key for
#: libfused_contrastive_torch, whose panel sweeps do the GEMMs with ``at::mm``.
PANEL_KERNELS = ("panel_dl", "panel_rows")

#: The panel path is recorded in its cuBLAS form (``panels.use_epilogue`` off: an fp32 panel of
#: products from a GEMM, then ``panel_dl``), the form ``csrc/fc_torch.cpp`` mirrors with ``at::mm``. The
#: Python launcher's default for 16-bit panels on CUDA (and on the meta device it is recorded on) is the
#: epilogue GEMM (``epi_gemm``), which the C++ host code does not drive.
PANEL_GEMM_ENV = "FUSED_CONTRASTIVE_PANEL_GEMM"

#: Grid sizes the panel kernels are recorded for (the switchboard's hook ``PANEL_PROGRAMS``): at REC_N rows one per
#: BLOCK_R of ``panels.panel_blocks`` (16, 8, 4, 2, 1), so every row-block variant is compiled.
PANEL_PROGRAMS_REC = (32, 64, 128, 256, 1024)


#: Problem size recorded (any N, M > block sizes: the launch lists do not depend on it otherwise).
REC_N, REC_M = 512, 384

_DTYPES = ("fp32", "fp16", "bf16")  # C enum order: FC_FLOAT32, FC_FLOAT16, FC_BFLOAT16
_ARCH_FAMILY = {80: "sm80", 90: "sm90"}


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def record(mode: str, dtype: str, n: int, m: int, d: int, arch: str, eps: float = 1e-12, offset: int = 0,
           need_b: bool = True, grad_cols: int | None = None, sms: int | None = None, path: str = "fused",
           programs: int | None = None, roots: dict | None = None):
    """The launches of one forward + backward of ``mode`` through the Python launcher (meta tensors).
    ``sms``: the device's SM count (the column-LSE forward uses 2 x SMs programs on a GPU). ``path``:
    "fused" (the fused kernels) or "panel" (:func:`record_panel`; ``programs``, ``roots`` are its).
    The margin modes are recorded with ``margin = REC_MARGIN`` and an int64 target vector [n]; the split modes
    with an int64 target vector [n] passed to the forward and the backward (``record_core``'s
    ``split_fwd``: the target split of ``triton_fused._lse_fwd`` / ``_lse_bwd``, SPLIT_T; the backward with the
    caller's exact target weights, EXACT_T, ``exact``), on the fused
    path only (the torch operators' panel path does not split: a split mode records its base mode's)."""
    import torch

    from . import routes
    from .core.spec import CoreData, CoreSpec
    from .tools.compile_survey import record_core

    has_b, want_col, excl, margin, split = MODES[mode]
    spec = CoreSpec(eps=eps, exclude_self=excl, offset=offset, grad_cols=grad_cols,
                    margin=REC_MARGIN if margin else 0.0)
    data = CoreData(target=torch.empty(n, dtype=torch.int64, device="meta") if margin else None)
    if path == "panel":
        return record_panel(mode, dtype, n, m, d, arch, spec, need_b, sms, programs, roots, data)
    if path != "fused":
        raise ValueError(f"path must be 'fused' or 'panel', got {path!r}")
    with routes.override(**({"COL_PARTIAL_PROGRAMS": 2 * sms} if sms else {})):
        return record_core(spec, data, has_b, want_col, False, _torch_dtype(dtype), n, m if has_b else n, d,
                           arch, need_a=True, need_b=need_b and has_b, need_s=True, split=split, split_fwd=split,
                           exact=split)


def record_panel(mode: str, dtype: str, n: int, m: int, d: int, arch: str, spec, need_b: bool, sms: int | None,
                 programs: int | None, roots: dict | None, data=None):
    """The panel path's launches for the statistics-level op (per-row LSEs, upstream gradients given):
    what ``triton_panel.forward`` / ``backward`` launch without a reduction. "info_nce" / "clip": the
    fused forward (``_lse_fwd``), then the recomputing panel sweep; "self" (B is A, no bias: symmetric
    logits): the triangular forward (``_lse_fwd`` with ``tri``) and sweep (``tri_backward``).
    ``programs``: the panel kernels' target grid (``PANEL_PROGRAMS``; 2 x SMs on a GPU). ``roots`` (a dict,
    filled): the tensors a caller owns (A, B, LSE, LSE_COL, G, G_COL, DA, DB), so a launch argument can be
    traced to one of them; TARGET too in the margin modes). ``data``: the CoreData (the margin modes'
    target), default empty."""
    import torch

    from . import routes
    from .core.lse import triton_fused, triton_panel
    from .core.spec import CoreData
    from .core.triton_shared import launch as TL
    from .tools.compile_survey import recording

    has_b, want_col = MODES[mode][:2]
    data = data if data is not None else CoreData()
    meta = torch.device("meta")
    dt = _torch_dtype(dtype)
    a = torch.empty((n, d), dtype=dt, device=meta)
    b = torch.empty((m, d), dtype=dt, device=meta) if has_b else None
    scale = torch.empty((), dtype=torch.float32, device=meta)
    g = torch.empty(n, device=meta)
    hooks = {"COL_PARTIAL_PROGRAMS": 2 * sms} if sms else {}
    if programs or sms:
        hooks["PANEL_PROGRAMS"] = programs if programs else 2 * sms
    # the cuBLAS form: what csrc/fc_torch.cpp mirrors (see PANEL_GEMM_ENV)
    with routes.override(PANEL_GEMM="cublas", **hooks):
        with recording(arch) as launches:
            p = TL._prepare_data(a, b, spec, data, False)
            scale_t = TL._scale32(scale, meta)
            lse_col = g_col = db = None
            # the backward is a second operator call in C++: its own dummy pointer (never dereferenced)
            pb = TL._prepare_data(a, b, spec, data, False)
            if triton_panel.use_tri(p, want_col, False):
                lse = triton_fused._lse_fwd(a, None, scale, spec, data, False, False, tri=True)[0]
                da, _, _ = triton_panel.tri_backward(TL._launch, pb, p.a, spec, scale_t, lse, g, True, True)
            else:
                lse, lse_col, _, _ = triton_fused._lse_fwd(a, b, scale, spec, data, want_col, False)
                g_col = torch.empty(m, device=meta) if want_col else None
                da, db, _, _, _, _ = triton_panel.sweep(TL._launch, pb, p.a, p.b, False, scale_t, spec, lse,
                                                        lse_col, None, g, g_col, None, True, need_b and has_b, True,
                                                        False)
    if roots is not None:
        roots.update(A=a, B=b, LSE=lse, LSE_COL=lse_col, G=g, G_COL=g_col, DA=da, DB=db, TARGET=data.target)
    return launches


def ckey(launch) -> str:
    """A launch's constexprs as the C side spells its lookup key: ``NAME=value`` sorted by name and joined
    by commas; bools 0/1, ints in decimal, floats with one decimal (refused unless that is exact)."""
    out = []
    for k, v in sorted(launch.constexprs.items()):
        if isinstance(v, bool):
            t = str(int(v))
        elif isinstance(v, int):
            t = str(v)
        elif isinstance(v, float):
            t = f"{v:.1f}"
            if float(t) != v:
                raise ValueError(f"{launch.name}: constexpr {k} = {v!r} is not exact with one decimal")
        else:
            t = str(v)
        out.append(f"{k}={t}")
    return ",".join(out)


def _sig_type(v) -> str:
    from .tools.compile_survey import _sig_type as sig

    return sig(v)


def aot_source(launch):
    """An ASTSource of ``launch`` for the C library: every pointer 16-byte aligned, D and the row strides
    divisible by 16 (when the recorded value is), no other integer specialised (N, M, offsets: any value)."""
    from torch import Tensor
    from triton.compiler import ASTSource

    fn = launch.fn
    sig = {k: (_sig_type(launch.args[k]) if k in launch.args else "constexpr") for k in fn.arg_names}
    attrs = {}
    for k, v in launch.args.items():
        if isinstance(v, Tensor) or (type(v) is int and _aligned_int(k) and v % 16 == 0):
            attrs[(fn.arg_names.index(k),)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)


def _path_free_compiles() -> None:
    """Compile without line info: a cubin then does not embed the absolute path of ``kernels/*.py``, so
    its bytes do not depend on where the checkout lies, and a cached compile from another checkout of
    the same source (Triton's cache key ignores the path) is byte-identical to a fresh one. Set for
    this process and the generator's workers (a build tool: the runtime never imports this module)."""
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"


def compile_launch(launch, cc: int):
    """``triton.compile`` of :func:`aot_source` for GPUTarget("cuda", cc, 32) (host ptxas, no driver),
    without line info (:func:`_path_free_compiles`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    _path_free_compiles()

    return triton.compile(aot_source(launch), target=GPUTarget("cuda", cc, 32),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))


def _layout(launch) -> list[dict]:
    """The kernel's runtime parameters in order (what cuLaunchKernel receives, before triton's two
    scratch pointers): name, signature type, compiled as divisible by 16."""
    from torch import Tensor

    out = []
    for k in launch.fn.arg_names:
        if k in launch.constexprs:
            continue
        v = launch.args[k]
        div = isinstance(v, Tensor) or (type(v) is int and _aligned_int(k) and v % 16 == 0)
        out.append(dict(name=k, type=_sig_type(v), div16=bool(div)))
    return out


def variant_key(launch) -> str:
    """A stable name of one compiled kernel: kernel name + hash of its constexprs, warps, stages, layout."""
    blob = json.dumps([launch.name, sorted((k, repr(v)) for k, v in launch.constexprs.items()), launch.num_warps,
                       launch.num_stages, _layout(launch)])
    return f"{launch.name}_{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def _flag_key(launch, mode: str, dclass: str) -> dict:
    has_b, want_col, excl, margin, split = MODES[mode]
    return dict(kernel=launch.name, dclass=dclass, sym=not has_b, want_col=want_col, exclude_self=excl,
                margin=margin, split=split)


def _recordings(mode: str, dt: str, dc: str, fam: str):
    """The recordings of one (mode, dtype, D class): the fused path, then the panel path once per
    :data:`PANEL_PROGRAMS_REC` grid; each as ``((path, programs), launches)``. A split mode has no panel
    path of its own (its base mode's is recorded under that mode)."""
    yield ("fused", None), record(mode, dt, REC_N, REC_M, D_CLASSES[dc], fam)
    if MODES[mode][4]:
        return
    for progs in PANEL_PROGRAMS_REC:
        yield ("panel", progs), record(mode, dt, REC_N, REC_M, D_CLASSES[dc], fam, path="panel", programs=progs)


def plan(archs: list[int], dtypes: list[str], dclasses: list[str], modes: list[str]) -> tuple[list, dict]:
    """(variant table, compile jobs by (cc, variant key)) of a build. Fused-path kernels are looked up by
    (D class, sym, want_col, exclude_self, margin) as the C launcher chooses them; the panel kernels by their
    constexpr key (:func:`ckey`, the same for every D class where it does not depend on D)."""
    table, todo = [], {}
    seen, by_ckey = set(), {}
    for cc in archs:
        fam = _ARCH_FAMILY[cc]
        for dt in dtypes:
            for dc in dclasses:
                for mode in modes:
                    for (path, progs), launches in _recordings(mode, dt, dc, fam):
                        for i, launch in enumerate(launches):
                            key, ck = variant_key(launch), ckey(launch)
                            if by_ckey.setdefault((cc, dt, launch.name, ck), key) != key:
                                raise RuntimeError(f"{launch.name}: two variants with constexprs {ck} (sm{cc}, {dt})")
                            # the panel kernels, and the triangular forward (lse_fwd with TRI, which the
                            # fused launcher must not pick): by constexpr key only
                            if launch.name in PANEL_KERNELS or launch.constexprs.get("TRI"):
                                fk = dict(cc=cc, dtype=dt, kernel=launch.name, dclass="-", sym=-1, want_col=-1,
                                          exclude_self=-1, margin=-1, split=-1)
                            else:
                                fk = dict(cc=cc, dtype=dt, **_flag_key(launch, mode, dc))
                                if launch.name == "row_norm":
                                    # flags do not apply
                                    fk.update(sym=False, want_col=False, exclude_self=False, margin=False,
                                              split=False)
                            ident = tuple(sorted(dict(fk, ckey=ck).items()))
                            if ident in seen:
                                continue
                            seen.add(ident)
                            table.append(dict(fk, ckey=ck, variant=key))
                            todo.setdefault((cc, key), (cc, key, mode, dt, dc, path, progs, i, fam))
    return table, todo


def _compile_job(job):
    cc, key, mode, dt, dc, path, progs, idx, fam = job
    t0 = time.perf_counter()
    launch = record(mode, dt, REC_N, REC_M, D_CLASSES[dc], fam, path=path, programs=progs)[idx]
    assert variant_key(launch) == key
    ck = compile_launch(launch, cc)
    md = ck.metadata
    if md.num_ctas != 1 or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        raise RuntimeError(f"{key}: clusters / cooperative / PDL launches are not supported by the C launcher")
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"{key}: kernels needing triton global/profile scratch are not supported")
    return dict(cc=cc, variant=key, symbol=md.name, num_warps=md.num_warps, shared=md.shared,
                cubin=ck.asm["cubin"], seconds=time.perf_counter() - t0, layout=_layout(launch))


def _c_ident(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s)


def generate(archs: list[int], dtypes: list[str], dclasses: list[str], modes: list[str], out: str,
             jobs: int = 1) -> dict:
    """Compile and write the tables (see the module docstring); returns the manifest."""
    from .core.triton_shared import configs as CFG
    from .core.triton_shared import panels

    t0 = time.perf_counter()
    table, todo = plan(archs, dtypes, dclasses, modes)
    job_list = list(todo.values())  # each worker records its launch again (launches do not pickle)
    _path_free_compiles()  # before the workers start: they inherit it
    t_plan = time.perf_counter() - t0
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            results = list(ex.map(_compile_job, job_list))
    else:
        results = [_compile_job(j) for j in job_list]
    os.makedirs(os.path.join(out, "cubin"), exist_ok=True)
    compiled = {}
    for r in results:
        name = f"sm{r['cc']}_{r['variant']}"
        with open(os.path.join(out, "cubin", name + ".cubin"), "wb") as f:
            f.write(r["cubin"])
        compiled[(r["cc"], r["variant"])] = dict(r, file=f"cubin/{name}.cubin",
                                                 sha256=hashlib.sha256(r["cubin"]).hexdigest(), cubin=None)
    layouts = {}
    for r in results:
        kname = r["variant"].rsplit("_", 1)[0]
        lay = [dict(p, type="ptr" if p["type"].startswith("*") else p["type"]) for p in r["layout"]]
        if layouts.setdefault(kname, lay) != lay:
            raise RuntimeError(f"{kname}: variants with different argument layouts")
    # the AOT modes have no softmax over positives: its forward config ("fwd_pos") is not launched here
    configs = {f"{k}/{a}/{dt}/{b}": c.__dict__ for (k, a, dt, b), c in CFG.CONFIGS.items()
               if dt in dtypes and k in _CONFIG_KERNELS}
    manifest = dict(
        archs=archs, dtypes=dtypes, dclasses=dclasses, modes=modes,
        consts=dict(RESIDENT_MAX_D=CFG.RESIDENT_MAX_D, ROW_NORM_BLOCK_R=CFG.ROW_NORM_BLOCK_R,
                    ROW_NORM_MAX_BLOCK_D=CFG.ROW_NORM_MAX_BLOCK_D, ROW_NORM_WARPS=CFG.ROW_NORM_WARPS,
                    # the panel path's host constants (triton_shared/configs.py, triton_shared/panels.py)
                    PANEL_CHUNK=CFG.PANEL_CHUNK, PANEL_ROWS_BLOCK_R=CFG.PANEL_ROWS_BLOCK_R,
                    PANEL_ROWS_MAX_BLOCK_D=CFG.PANEL_ROWS_MAX_BLOCK_D, PANEL_BUDGET_BYTES=panels.BUDGET_BYTES,
                    PANEL_P_MIN=panels.P_MIN, PANEL_MIN_ELEMENTS=panels.MIN_ELEMENTS,
                    PANEL_NORM_CHUNK_ELEMENTS=panels.NORM_CHUNK_ELEMENTS,
                    PANEL_FP16_PRESCALE=panels.FP16_PRESCALE),
        configs=configs, layouts=layouts,
        variants=[dict(e, **{k: compiled[(e["cc"], e["variant"])][k]
                             for k in ("symbol", "num_warps", "shared", "file", "sha256")},
                       arg_types=[q["type"] for q in compiled[(e["cc"], e["variant"])]["layout"]]) for e in table],
        compile_seconds={f"sm{r['cc']}_{r['variant']}": round(r["seconds"], 2) for r in results},
        plan_seconds=round(t_plan, 2), total_seconds=None)
    _write_c(manifest, compiled, out)
    manifest["total_seconds"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _write_c(man: dict, compiled: dict, out: str) -> None:
    names = sorted({p["name"] for lay in man["layouts"].values() for p in lay})
    kernels = sorted(man["layouts"])
    ctype = {"i32": "FC_T_I32", "i64": "FC_T_I64", "fp32": "FC_T_F32", "i1": "FC_T_I1"}
    h = ["/* generated by python -m fused_contrastive.c_library: do not edit */", "#pragma once", "#include <stddef.h>",
         "#include <stdint.h>", "",
         "typedef enum { FC_T_PTR, FC_T_I32, FC_T_I64, FC_T_F32, FC_T_I1 } fc_argtype;", "",
         "/* every runtime parameter name of the shipped kernels */", "typedef enum {"]
    h += [f"  FC_ARG_{n}," for n in names] + ["  FC_ARG_COUNT", "} fc_argname;", ""]
    h += ["typedef enum {"] + [f"  FC_K_{k}," for k in kernels] + ["  FC_K_COUNT", "} fc_kernel;", ""]
    h += ["typedef struct { fc_argname name; fc_argtype type; int div16; } fc_param;",
          "typedef struct { int n; const fc_param *params; } fc_layout;",
          "/* fused-path kernels are chosen by (dpad, sym, want_col, exclude_self, margin, split); the panel",
          "   kernels (-1 there) by ckey, their constexprs as NAME=value sorted by name (fc_launch_kernel) */",
          "typedef struct { int cc, dtype; fc_kernel kernel; int dpad; int sym, want_col, exclude_self, margin, split;",
          "  const char *ckey, *variant, *symbol; int num_warps, shared;",
          "  const unsigned char *cubin; size_t cubin_size;",
          "} fc_variant;",
          "/* wide: the forward with row statistics only (triton_configs \"fwd_wide\"); 0 for every other entry */",
          "typedef struct { fc_kernel kernel; int cc, dtype, bucket, wide;",
          "  int block_m, block_n, block_d, num_warps, num_stages; } fc_config;", "",
          "extern const fc_layout fc_layouts[FC_K_COUNT];", "extern const char *const fc_kernel_names[FC_K_COUNT];",
          "extern const char *const fc_arg_names[FC_ARG_COUNT];",
          f"#define FC_N_VARIANTS {len(man['variants'])}", "extern const fc_variant fc_variants[FC_N_VARIANTS];",
          f"#define FC_N_CONFIGS {len(man['configs'])}", "extern const fc_config fc_configs[FC_N_CONFIGS];"]
    h += [f"#define FC_{k} {v}" for k, v in man["consts"].items()]
    h += ["/* D buckets of triton_configs: 0 d64, 1 d128, 2 big */",
          f"#define FC_ARCHS_BUILT \"{';'.join(map(str, man['archs']))}\"",
          f"#define FC_DTYPES_BUILT \"{';'.join(man['dtypes'])}\"",
          f"#define FC_DCLASSES_BUILT \"{';'.join(man['dclasses'])}\"",
          f"#define FC_MODES_BUILT \"{';'.join(man['modes'])}\"", ""]
    c = ["/* generated by python -m fused_contrastive.c_library: do not edit */", '#include "fc_kernels_gen.h"', ""]
    c += ["const char *const fc_arg_names[FC_ARG_COUNT] = {" + ", ".join(f'"{n}"' for n in names) + "};",
          "const char *const fc_kernel_names[FC_K_COUNT] = {" + ", ".join(f'"{k}"' for k in kernels) + "};"]
    for k in kernels:
        ps = ", ".join(f"{{FC_ARG_{p['name']}, {'FC_T_PTR' if p['type'] == 'ptr' else ctype[p['type']]}, "
                       f"{int(p['div16'])}}}" for p in man["layouts"][k])
        c.append(f"static const fc_param params_{k}[] = {{{ps}}};")
    c.append("const fc_layout fc_layouts[FC_K_COUNT] = {"
             + ", ".join(f"{{{len(man['layouts'][k])}, params_{k}}}" for k in kernels) + "};")
    asm = ["/* generated by python -m fused_contrastive.c_library: the cubins, embedded */", ".section .rodata"]
    for (cc, key), r in sorted(compiled.items()):
        sym = f"fc_cubin_sm{cc}_{_c_ident(key)}"
        path = os.path.abspath(os.path.join(out, r["file"]))
        asm += [".balign 16", f".hidden {sym}", f".globl {sym}", f"{sym}:", f'.incbin "{path}"']
        c.append(f"extern const unsigned char {sym}[{os.path.getsize(path)}];")
    asm.append('.section .note.GNU-stack,"",@progbits')
    with open(os.path.join(out, "fc_cubins.S"), "w") as f:
        f.write("\n".join(asm) + "\n")
    dt_idx = {d: i for i, d in enumerate(_DTYPES)}
    rows = []
    for v in man["variants"]:
        dpad = -1 if v["dclass"] == "-" else 0 if v["dclass"] == "big" else int(v["dclass"])
        sym = f"fc_cubin_sm{v['cc']}_{_c_ident(v['variant'])}"
        rows.append(f"  {{{v['cc']}, {dt_idx[v['dtype']]}, FC_K_{v['kernel']}, {dpad}, {int(v['sym'])}, "
                    f"{int(v['want_col'])}, {int(v['exclude_self'])}, {int(v['margin'])}, {int(v['split'])}, "
                    f"\"{v['ckey']}\", "
                    f"\"{v['variant']}\", "
                    f"\"{v['symbol']}\", "
                    f"{v['num_warps']}, {v['shared']}, {sym}, sizeof({sym})}},")
    c += ["const fc_variant fc_variants[FC_N_VARIANTS] = {"] + rows + ["};"]
    kmap = _CONFIG_KERNELS
    buckets = {"d64": 0, "d128": 1, "big": 2}
    rows = []
    for key, cfg in man["configs"].items():
        k, arch, dt, b = key.split("/")
        rows.append(f"  {{FC_K_{kmap[k]}, {arch[2:]}, {dt_idx[dt]}, {buckets[b]}, {int(k == 'fwd_wide')}, "
                    f"{cfg['block_m']}, "
                    f"{cfg['block_n']}, {cfg['block_d']}, {cfg['num_warps']}, {cfg['num_stages']}}},")
    c += ["const fc_config fc_configs[FC_N_CONFIGS] = {"] + rows + ["};", ""]
    with open(os.path.join(out, "fc_kernels_gen.h"), "w") as f:
        f.write("\n".join(h) + "\n")
    with open(os.path.join(out, "fc_kernels_gen.c"), "w") as f:
        f.write("\n".join(c) + "\n")


#: D of the launch checks per D class (not powers of two where the class allows: ragged D chunks).
CHECK_D = {"16": 16, "32": 32, "64": 48, "128": 112, "big": 784}


def _scenarios(man: dict) -> list[dict]:
    out = []
    for cc in man["archs"]:
        for dt in man["dtypes"]:
            for dc in man["dclasses"]:
                for mode in man["modes"]:
                    # ragged N, M (not multiples of any block); CLIP on 3 SMs: 1000 rows = 8 row blocks of 128
                    # -> 6 programs cap -> 4 programs of 2 row blocks (the persistent loop)
                    n, m, sms = (1000, 200, 3) if base_mode(mode) == "clip" else (300, 200, 132)
                    out.append(dict(cc=cc, dtype=dt, mode=mode, n=n, m=m, d=CHECK_D[dc], grad_cols=-1,
                                    db=MODES[mode][0], sms=sms))
        if "info_nce" in man["modes"]:
            d = CHECK_D[man["dclasses"][-1]]
            dt = man["dtypes"][0]
            out.append(dict(cc=cc, dtype=dt, mode="info_nce", n=100, m=300, d=d, grad_cols=100, db=True, sms=132))
            out.append(dict(cc=cc, dtype=dt, mode="info_nce", n=100, m=300, d=d, grad_cols=-1, db=False, sms=132))
            out.append(dict(cc=cc, dtype=dt, mode="info_nce", n=100, m=300, d=d, grad_cols=0, db=True, sms=132))
    return out


_CU_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h)


def _decode(hexs: str, typ: str):
    import struct

    raw = bytes.fromhex(hexs)
    if typ == "ptr" or typ == "i64":
        return struct.unpack("<Q" if typ == "ptr" else "<q", raw)[0]
    if typ == "i32":
        return struct.unpack("<i", raw)[0]
    if typ == "fp32":
        return struct.unpack("<f", raw)[0]
    raise ValueError(typ)


def check_scenario(sc: dict, man: dict, gen: str, fc_run: str, mock: str, work: str) -> tuple[list[str], list]:
    """Run ``fc_run`` on the mock driver for one problem and compare every driver call with the Python
    launcher's launches for the same problem (:func:`compare_calls`)."""
    import subprocess

    os.makedirs(work, exist_ok=True)
    logf = os.path.join(work, "calls.jsonl")
    if os.path.exists(logf):
        os.remove(logf)
    env = dict(os.environ, FUSED_CONTRASTIVE_LIBCUDA=mock, FC_MOCK_CC=str(sc["cc"]), FC_MOCK_SMS=str(sc["sms"]),
               FC_MOCK_LOG=logf, FC_MOCK_DIR=work)
    cmd = [fc_run, sc["mode"], sc["dtype"], str(sc["n"]), str(sc["m"]), str(sc["d"]), str(sc["grad_cols"]),
           str(int(sc["db"]))]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode:
        return [f"{' '.join(cmd[1:])}: fc_run failed: {r.stderr.strip()}"], []
    with open(logf) as f:
        calls = [json.loads(x) for x in f]
    info = json.loads(r.stdout)
    # the split modes: the forward's LSEx and the backward's LSE are two caller buffers under one parameter name
    return compare_calls(sc, man, calls, 0, info, internal=tuple(info.get("internal", ())))


def compare_calls(sc: dict, man: dict, calls: list[dict], start: int, info: dict,
                  internal: tuple[str, ...] = ()) -> tuple[list[str], list]:
    """Compare the launches in ``calls[start:]`` (a mock-driver log; modules and functions may have been
    loaded earlier in it) with the Python launcher's for problem ``sc``: kernel variant and its cubin,
    grid, block, shared memory, the parameter count the cubin declares, every scalar argument, and the
    pointer arguments (the caller's pointers where the caller passed them, the same buffer wherever
    Python passes the same tensor, workspace buffers at least as large as Python's). ``info``: the
    caller's pointers (``ptrs``), the workspace (``workspace``, ``workspace_bytes``), optionally
    ``col_part``/``col_rows``/``ds_rows``; ``internal`` names pointer arguments the caller allocates
    itself (not in ``ptrs``). Returns (errors, [(launch, module image file), ...])."""
    import struct

    from torch import Tensor

    funcs = {c["func"]: c for c in calls if c["call"] == "cuModuleGetFunction"}
    mods = {c["module"]: c for c in calls if c["call"] == "cuModuleLoadData"}
    got = [c for c in calls[start:] if c["call"] == "cuLaunchKernel"]
    gc = None if sc["grad_cols"] < 0 else sc["grad_cols"]
    panel = sc.get("path", "fused") == "panel"
    roots: dict = {}
    exp = record(sc["mode"], sc["dtype"], sc["n"], sc["m"], sc["d"], _ARCH_FAMILY[sc["cc"]], eps=1e-12, offset=0,
                 need_b=sc["db"], grad_cols=gc, sms=sc["sms"], path=sc.get("path", "fused"), roots=roots)
    root_of = {r.untyped_storage()._cdata: k for k, r in roots.items() if r is not None}
    tag = (f"sm{sc['cc']} {sc['dtype']} {sc['mode']} N={sc['n']} M={sc['m']} D={sc['d']} grad_cols={sc['grad_cols']}"
           + (f" panel path (budget {sc['budget']})" if panel else ""))
    errs = []
    variants = {(v["cc"], v["variant"]): v for v in man["variants"]}
    want = [variants.get((sc["cc"], variant_key(ln)), {}).get("symbol", variant_key(ln) + " (not built)") for ln in exp]
    if [c["name"] for c in got] != want:
        return [f"{tag}: launched {[c['name'] for c in got]}, the Python launcher launches {want}"], []
    py_label, c_label = {}, {}
    ws0, ws1 = info["workspace"], info["workspace"] + info["workspace_bytes"]
    regions = {}  # workspace pointer -> bytes the Python launcher allocates for that buffer
    pairs = []
    base_c: dict = {}  # panel path: Python storage -> its C base address
    for i, (c, ln) in enumerate(zip(got, exp, strict=True)):
        v = variants[(sc["cc"], variant_key(ln))]
        in_launch: dict = {}
        where = f"{tag}: launch {i} ({ln.name})"
        if c["grid"] != [ln.grid[0], 1, 1] or len(ln.grid) != 1:
            errs.append(f"{where}: grid {c['grid']} != Python {list(ln.grid)}")
        if c["block"] != [32 * ln.num_warps, 1, 1]:
            errs.append(f"{where}: block {c['block']} != 32 x {ln.num_warps} warps")
        if c["shared"] != v["shared"]:
            errs.append(f"{where}: shared {c['shared']} != compiled {v['shared']}")
        if c["shared"] > 49152 and not any(
                x["call"] == "cuFuncSetAttribute" and x["func"] == c["func"] and x["attr"] == _CU_MAX_DYNAMIC_SHARED
                and x["value"] >= c["shared"] for x in calls):
            errs.append(f"{where}: {c['shared']} bytes of shared memory without cuFuncSetAttribute("
                        "MAX_DYNAMIC_SHARED_SIZE_BYTES) on the function")
        mfile = mods[c["module"]]["file"]
        with open(mfile, "rb") as f:
            image = f.read()
        if hashlib.sha256(image).hexdigest() != v["sha256"]:
            errs.append(f"{where}: the module image is not the generated cubin {v['file']}")
        lay = man["layouts"][ln.name]
        if funcs[c["func"]]["nparams"] != len(lay) + 2 or len(c["params"]) != len(lay) + 2 or c["extra_param"]:
            errs.append(f"{where}: {len(c['params'])} parameters (extra: {c['extra_param']}), the cubin declares "
                        f"{funcs[c['func']]['nparams']}, the layout has {len(lay)} + 2 scratch")
            continue
        if any(p is None for p in c["params"]):
            errs.append(f"{where}: missing parameters")
            continue
        for p, hx in zip(lay, c["params"][:len(lay)], strict=True):
            val, want = _decode(hx, p["type"]), ln.args[p["name"]]
            nm = p["name"]
            if p["type"] == "ptr" and panel:
                # the panel path allocates with torch's allocator, which reuses addresses from panel to
                # panel, so a C address may stand for several Python buffers over time, never the
                # reverse: each Python buffer (storage) must sit at one C base address wherever it is
                # passed (its views at the same offsets), two buffers of one launch at two addresses, a
                # caller's tensor (or a view of one) at the caller's pointer
                sid = want.untyped_storage()._cdata
                off = want.storage_offset() * want.element_size()
                base = base_c.setdefault(sid, val - off)
                if val - off != base:
                    errs.append(f"{where}: {nm} = {val:#x} is {val - off - base:+d} bytes off the buffer Python "
                                f"passes (+{off} into the buffer at {base:#x} in earlier launches)")
                if in_launch.setdefault(val - off, sid) != sid:
                    errs.append(f"{where}: {nm} is in the same buffer as another argument in C, not in Python")
                root = root_of.get(sid)
                if root is not None:
                    at = info["roots"].get(root, 0) + want.storage_offset() * want.element_size()
                    if not info["roots"].get(root) or val != at:
                        errs.append(f"{where}: {nm} = {val:#x}, Python passes {root} + "
                                    f"{want.storage_offset() * want.element_size()} bytes ({at:#x})")
                elif val in (info["roots"].get("A"), info["roots"].get("B")):  # alive during both calls
                    errs.append(f"{where}: {nm} is a caller's input in C, an internal buffer in Python")
            elif p["type"] == "ptr":
                if info["ptrs"].get(nm) and val != info["ptrs"][nm]:
                    errs.append(f"{where}: {nm} = {val:#x}, the caller passed {info['ptrs'][nm]:#x}")
                key_p = "SCALE" if nm == "SCALE" else py_label.setdefault(id(want), (i, nm))
                key_c = "SCALE" if nm == "SCALE" else c_label.setdefault(val, (i, nm))
                if key_p != key_c:
                    errs.append(f"{where}: {nm} is the buffer first passed as {key_c} in C, as {key_p} in Python")
                if ws0 <= val < ws1:
                    nbytes = want.numel() * want.element_size() if isinstance(want, Tensor) else 0
                    regions[val] = max(regions.get(val, 0), nbytes)
                elif not info["ptrs"].get(nm) and nm != "X" and nm not in internal:
                    errs.append(f"{where}: {nm} = {val:#x} is neither a caller's pointer nor in the workspace")
            elif p["type"] == "fp32":
                if struct.pack("<f", val) != struct.pack("<f", float(want)):
                    errs.append(f"{where}: {nm} = {val!r} != Python {want!r}")
            elif val != want:
                errs.append(f"{where}: {nm} = {val} != Python {want}")
        for hx in c["params"][len(lay):]:
            if _decode(hx, "ptr") != 0:
                errs.append(f"{where}: triton's scratch pointers must be NULL")
        pairs.append((ln, mfile))
    starts = sorted(regions) + [ws1]
    for a, b in itertools.pairwise(starts):
        if b - a < regions[a] or a % 256:
            errs.append(f"{tag}: workspace buffer at +{a - ws0} has {b - a} bytes, the Python launcher's has "
                        f"{regions[a]} (or misaligned)")
    fwd = [ln for ln in exp if ln.name == "lse_fwd"]
    if sc["mode"] == "clip" and "col_rows" in info:
        cp = fwd[0].args["COL_PART"]
        if info["col_rows"] != cp.shape[0] or info["col_part"] != _decode(got[exp.index(fwd[0])]["params"][
                [p["name"] for p in man["layouts"]["lse_fwd"]].index("COL_PART")], "ptr"):
            errs.append(f"{tag}: fc_col_partials gives {info['col_rows']} rows, Python {cp.shape[0]}")
    rows = [ln for ln in exp if ln.name == "lse_bwd_rows"]
    if rows and "ds_rows" in info and info["ds_rows"] != rows[0].args["DS_PART"].numel():
        errs.append(f"{tag}: fc_ds_rows {info['ds_rows']} != Python {rows[0].args['DS_PART'].numel()}")
    return errs, pairs


def check(gen: str, fc_run: str, mock: str, work: str, fresh: str = "per-kernel") -> list[str]:
    """Every scenario of the build (:func:`_scenarios`) through :func:`check_scenario`, then a fresh
    ``triton.compile`` (empty cache) of launched kernels, byte-compared with the module images the mock
    received: one per (arch, kernel) by default, every launched variant with ``fresh="all"``."""
    with open(os.path.join(gen, "manifest.json")) as f:
        man = json.load(f)
    errs, fresh_todo = [], {}
    for k, sc in enumerate(_scenarios(man)):
        e, pairs = check_scenario(sc, man, gen, fc_run, mock, os.path.join(work, f"s{k}"))
        errs += e
        for ln, mfile in pairs:
            key = (sc["cc"], ln.name) if fresh == "per-kernel" else (sc["cc"], variant_key(ln))
            fresh_todo.setdefault(key, (sc["cc"], ln, mfile))
    print(f"fused_contrastive.c_library check: {len(_scenarios(man))} problems compared with the Python launcher")
    errs += _fresh_compiles(fresh_todo.values())
    print(f"fused_contrastive.c_library check: {len(fresh_todo)} launched cubins recompiled from scratch")
    return errs


def _fresh_compiles(todo) -> list[str]:
    """``triton.compile`` each ``(cc, launch, module image file)`` with an empty Triton cache and compare
    the cubin with the image the mock driver received, byte for byte."""
    import tempfile

    errs = []
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            for cc, ln, mfile in todo:
                with open(mfile, "rb") as f:
                    if compile_launch(ln, cc).asm["cubin"] != f.read():
                        errs.append(f"sm{cc} {variant_key(ln)}: launched cubin differs from a fresh triton.compile")
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    return errs


_GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")


def _gemm_calls(prof) -> list[tuple[str, list]]:
    """The GEMMs a profiled region dispatched, outermost only, in order: (op without the in-place
    underscore, the shapes of its matrix operands). Sees ATen calls made from C++ (the torch operators'
    at::mm) as well as from Python."""
    out = []
    for e in prof.events():
        if e.name in _GEMMS and not (e.cpu_parent is not None and e.cpu_parent.name in _GEMMS):
            k = 3 if "addmm" in e.name else 2
            out.append((e.name.rstrip("_"), [list(x) for x in e.input_shapes[:k]]))
    return out


def _panel_scenarios(man: dict) -> list[dict]:
    """Problems of the torch operators' panel path: ragged N and M, a budget that gives 64-row panels (and
    a ragged last one), SM counts that select BLOCK_R 16 (2 SMs), 4 (8 SMs) and 1 (132 SMs), a single
    panel (the default budget), dB off and a queue (grad_cols)."""
    out = []
    for cc in man["archs"]:
        for dt in man["dtypes"]:
            dc = man["dclasses"][-1]
            for mode, sms in (("info_nce", 2), ("clip", 132), ("self", 8)):
                n, m = (300, 200)
                out.append(dict(cc=cc, dtype=dt, mode=mode, n=n, m=m, d=CHECK_D[dc], grad_cols=-1, db=mode != "self",
                                sms=sms, path="panel", budget="1"))
            out.append(dict(cc=cc, dtype=dt, mode="self", n=200, m=200, d=CHECK_D[man["dclasses"][0]], grad_cols=-1,
                            db=False, sms=132, path="panel", budget=str(700_000_000)))
            out.append(dict(cc=cc, dtype=dt, mode="info_nce", n=150, m=300, d=CHECK_D[dc], grad_cols=100, db=True,
                            sms=4, path="panel", budget="1"))
            out.append(dict(cc=cc, dtype=dt, mode="clip", n=150, m=300, d=CHECK_D[dc], grad_cols=-1, db=False,
                            sms=4, path="panel", budget="1"))
            # the margin modes: the bias-column variants of panel_dl (two row-block sizes, a queue)
            if "info_nce_margin" in man["modes"]:
                out.append(dict(cc=cc, dtype=dt, mode="info_nce_margin", n=300, m=200, d=CHECK_D[dc], grad_cols=150,
                                db=True, sms=2, path="panel", budget="1"))
            if "clip_margin" in man["modes"]:
                out.append(dict(cc=cc, dtype=dt, mode="clip_margin", n=150, m=300, d=CHECK_D[dc], grad_cols=-1,
                                db=True, sms=132, path="panel", budget="1"))
    return out


def check_torch(gen: str, lib: str, mock: str, work: str) -> list[str]:
    """The torch operators of ``lib`` (``fused_contrastive_aot::lse`` / ``lse_backward``) on CPU tensors
    whose data pointers stand in for device pointers (FUSED_CONTRASTIVE_AOT_FAKE_CPU=1), on the mock
    driver: every launch compared with the Python launcher's (:func:`compare_calls`), on the panel path
    also the GEMMs between the launches; then each panel kernel launched (they reach the library only
    through these operators) recompiled from an empty Triton cache and byte-compared with the image the
    driver received. Sets the process environment; run it in its own process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with open(os.path.join(gen, "manifest.json")) as f:
        man = json.load(f)
    os.makedirs(work, exist_ok=True)
    logf = os.path.join(work, "calls.jsonl")
    if os.path.exists(logf):
        os.remove(logf)
    os.environ.update(FUSED_CONTRASTIVE_LIBCUDA=mock, FUSED_CONTRASTIVE_AOT_FAKE_CPU="1", FC_MOCK_LOG=logf,
                      FC_MOCK_DIR=work)
    torch.ops.load_library(lib)
    op = torch.ops.fused_contrastive_aot
    errs = []
    # (the split modes run lse_split / lse_backward_split: the fused kernels only)
    fused = _scenarios(man)
    scen = fused + _panel_scenarios(man)
    fresh: dict = {}  # (cc, panel kernel) -> (cc, launch, module image file), one fresh compile each
    start = 0  # calls of the earlier problems in the log
    for sc in scen:
        os.environ.update(FC_MOCK_CC=str(sc["cc"]), FC_MOCK_SMS=str(sc["sms"]),
                          FUSED_CONTRASTIVE_TRITON_PATH=sc.get("path", "fused"),
                          FUSED_CONTRASTIVE_PANEL_BUDGET=sc.get("budget", str(700_000_000)))
        dt = _torch_dtype(sc["dtype"])
        has_b = MODES[sc["mode"]][0]
        n, m, d = sc["n"], (sc["m"] if has_b else sc["n"]), sc["d"]
        a = torch.empty(n, d, dtype=dt)
        b = torch.empty(m, d, dtype=dt) if has_b else None
        scale = torch.tensor(20.0)
        mode, margin = base_mode(sc["mode"]), (REC_MARGIN if MODES[sc["mode"]][3] else 0.0)
        split = MODES[sc["mode"]][4]
        target = torch.arange(n) % m if margin or split else None
        clip = mode == "clip"
        gcols = None if sc["grad_cols"] < 0 else sc["grad_cols"]
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof_c:
            g = torch.ones(n)
            g_col = torch.ones(m) if clip else None
            if split:  # the backward's LSE is the caller's merge of LSEx and LT (values do not matter here)
                lse_x, lse_col, lt, ws = op.lse_split(a, b, scale, mode, 1e-12, target, margin)
                lse = torch.empty(n)
                da, db, _, _ = op.lse_backward_split(a, b, scale, mode, 1e-12, ws, lse, lse_col if clip else None, g,
                                                     g_col, sc["db"], gcols, target, torch.zeros(n), margin)
            else:
                lse, lse_col, ws = op.lse(a, b, scale, mode, 1e-12, margin, target)
                da, db, _ = op.lse_backward(a, b, scale, mode, 1e-12, ws, lse, lse_col if clip else None, g,
                                            g_col, sc["db"], gcols, margin, target)
        if sc.get("path") == "panel":  # the GEMMs between the kernels: same order and shapes as Python's
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof_py:
                record(sc["mode"], sc["dtype"], n, m, d, _ARCH_FAMILY[sc["cc"]], need_b=sc["db"], grad_cols=gcols,
                       sms=sc["sms"], path="panel")
            got_g, want_g = _gemm_calls(prof_c), _gemm_calls(prof_py)
            if got_g != want_g or not want_g:
                errs.append(f"torch op: {sc['mode']} N={n} M={m} panel path: GEMMs {got_g} != Python {want_g}")
        with open(logf) as f:
            calls = [json.loads(x) for x in f]
        wsp = (ws.data_ptr() + 255) // 256 * 256
        # (split: LSE names the operator's LSEx and the caller's merged LSE, checked by identity; TV is the operator's)
        ptrs = dict(A=a.data_ptr(), B=b.data_ptr() if b is not None else 0, LSE=0 if split else lse.data_ptr(),
                    LSE_COL=lse_col.data_ptr() if clip else 0, G=g.data_ptr(),
                    G_COL=g_col.data_ptr() if clip else 0, DA=da.data_ptr(),
                    DB=db.data_ptr() if db.numel() else 0, TARGET=target.data_ptr() if margin else 0,
                    BIAS_COL=target.data_ptr() if margin else 0, TGT=target.data_ptr() if split else 0,
                    LT=lt.data_ptr() if split else 0)
        info = dict(ptrs=ptrs, workspace=wsp, workspace_bytes=max(0, ws.numel() - 256),
                    roots={k: v for k, v in ptrs.items() if v})
        e, pairs = compare_calls(sc, man, calls, start, info,
                                 internal=("GSCALE", "DS_PART", "SCALE") + (("LSE", "TV") if split else ()))
        errs += [f"torch op: {x}" for x in e]
        start = len(calls)
        for ln, mfile in pairs:  # the panel kernels only reach the library through these operators
            if ln.name in PANEL_KERNELS or ln.constexprs.get("TRI"):
                fresh.setdefault((sc["cc"], ln.name), (sc["cc"], ln, mfile))
    print(f"fused_contrastive.c_library check-torch: {len(scen)} problems compared with the Python launcher "
          f"({len(scen) - len(fused)} on the panel path)")
    errs += _fresh_compiles(fresh.values())
    print(f"fused_contrastive.c_library check-torch: {len(fresh)} launched panel-kernel cubins recompiled from scratch")
    return errs


def check_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m fused_contrastive.c_library check")
    ap.add_argument("--gen", required=True, help="the generator's output directory (manifest.json)")
    ap.add_argument("--fc-run")
    ap.add_argument("--mock", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--fresh", choices=("per-kernel", "all"), default="per-kernel")
    ap.add_argument("--torch-lib", help="check libfused_contrastive_torch's operators instead of fc_run")
    a = ap.parse_args(argv)
    errs = (check_torch(a.gen, a.torch_lib, a.mock, a.work) if a.torch_lib
            else check(a.gen, a.fc_run, a.mock, a.work, a.fresh))
    for e in errs:
        print("MISMATCH", e)
    print("OK" if not errs else f"{len(errs)} mismatches")
    return 1 if errs else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fused_contrastive.c_library", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", choices=sorted(_ARCH_FAMILY), help="compute capability")
    ap.add_argument("--dtype", action="append", choices=_DTYPES)
    ap.add_argument("--dclass", action="append", choices=list(D_CLASSES))
    ap.add_argument("--mode", action="append", choices=list(MODES))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    modes = args.mode or list(MODES)
    for mode in modes:  # fc_workspace_size, fc_col_partials, fc_ds_rows of a split mode check its unsplit mode
        if MODES[mode][4] and mode.removesuffix("_split") not in modes:
            ap.error(f"--mode {mode} needs its unsplit mode {mode.removesuffix('_split')} too")
    man = generate(args.arch or [80, 90], args.dtype or list(_DTYPES), args.dclass or list(D_CLASSES),
                   modes, args.out, args.jobs)
    n = len({(v["cc"], v["variant"]) for v in man["variants"]})
    print(f"fused_contrastive.c_library: {n} kernels compiled in {man['total_seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("fused_contrastive.c_library: needs TRITON_INTERPRET=0 (interpreted kernels cannot be compiled)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(check_main(sys.argv[2:]) if sys.argv[1:2] == ["check"] else main())
