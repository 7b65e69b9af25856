"""Every Triton launch of the GPU routes, compiled ahead of time for sm_90 and sm_80 with the Triton installed
here: a kernel that a GPU's Triton cannot compile fails on the CPU, before a GPU is lent.

    python bench/gpu_compiles.py                      # every route at N = 4096, 16384, 65536; sm_90 and sm_80
    python bench/gpu_compiles.py --cc 90 --n 16384 --jobs 2

Why: the first lent H200 (torch 2.11, Triton 3.6, ``bench/results/h200-bench-gpu/``) could not compile the
one pass's row kernel (``epi_rows_kernel``: Triton 3.6's thread-locality pass asserts on a loop's reduction
whose result has two uses), so InfoNCE's, Matryoshka's and GIST's default routes raised there, while every
compile on this machine's newer Triton passed. Run this with the Triton that PyTorch's CUDA wheels ship (a
second environment: ``pip install triton==3.6.0``) as well as with the newest.

The launches are recorded on the meta device (``tools.compile_survey.recording``, nothing runs) by
``bench/gpu_model.py``'s recorders, for the core op on each path and panel-GEMM form (InfoNCE, SimCSE, CLIP,
SupCon L_in; the one pass's fp16 pass, ``logit_pass``, where it applies), the epilogue
GEMM's tile loops, the Matryoshka kernels (both backwards), GIST's guided route and its fused kernels, SigLIP's
routes (with its lean epilogue and fp16 pass options, ``FUSED_CONTRASTIVE_SIGLIP_EPILOGUE``) and MaxSim's
kernels; identical launches (kernel, constexprs, warps, stages, argument dtypes) compile once. Prints one line per
distinct launch and exits 1 if any failed to compile.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_model as GM  # noqa: E402

from fused_contrastive import routes  # noqa: E402
from fused_contrastive.core.triton_shared import launch as TL  # noqa: E402
from fused_contrastive.tools import compile_survey  # noqa: E402

CORE_LOSSES = ("info_nce", "simcse", "clip", "supcon_in")
PATHS = ("fused", "panel", "panel-epilogue", "panel-cublas", "panel-fp16pass")
EPI_FORMS = ("tiles", "persistent", "tma")
#: the core losses whose epilogue GEMM launches (MODE 0 / 1 / 2) are compiled once more with EPI_HOIST on
HOIST_LOSSES = ("info_nce", "simcse", "clip")
GPU_OF_CC = {90: "H100", 80: "A100"}


@contextmanager
def _env(**kv: str) -> Iterator[None]:
    with mock.patch.dict(os.environ, {f"FUSED_CONTRASTIVE_{k}": v for k, v in kv.items()}):
        yield


def recordings(sizes: list[int], d: int = 768) -> list[tuple[str, Callable[[GM.GPU], list[TL.Launch]]]]:
    """(label, record(gpu) -> launches) of every route this survey compiles."""
    out: list[tuple[str, Callable]] = []
    for n in sizes:
        for loss in CORE_LOSSES:
            for path in PATHS:
                if path == "fused" and n > 16384:
                    continue
                out.append((f"{loss} N={n} {path}", lambda g, loss=loss, n=n, path=path:
                            GM.run_triton(loss, n, d, g, path)[0]))
            for form in EPI_FORMS[1:]:
                out.append((f"{loss} N={n} panel-epilogue {form}", lambda g, loss=loss, n=n, form=form:
                            _with(lambda: GM.run_triton(loss, n, d, g, "panel-epilogue")[0], EPI_FORM=form)))
            if loss in HOIST_LOSSES:  # the epilogue GEMM's per-row loads before its D loop (EPI_HOIST)
                out.append((f"{loss} N={n} panel-epilogue hoist", lambda g, loss=loss, n=n:
                            _with(lambda: GM.run_triton(loss, n, d, g, "panel-epilogue")[0], EPI_HOIST="1")))
        for route in ("suffix", "kernels"):
            out.append((f"matryoshka5 N={n} {route}", lambda g, n=n, route=route:
                        _with(lambda: GM.run_matryoshka_triton(n, d, g)[0], MATRYOSHKA_ROUTE=route)))
        for form in EPI_FORMS:
            out.append((f"gist N={n} panel {form}", lambda g, n=n, form=form:
                        _with(lambda: GM.run_gist_panel(n, d, g)[0], EPI_FORM=form)))
        if n <= 16384:
            out.append((f"gist N={n} fused", lambda g, n=n: GM.run_gist_triton(n, d, g)[0]))
        for path in ("fused", "panel", "panel_rows"):
            for form in (EPI_FORMS if path != "fused" else EPI_FORMS[:1]):
                out.append((f"siglip N={n} {path} {form}", lambda g, n=n, path=path, form=form:
                            _with(lambda: GM.run_siglip_triton(n, d, g, path)[0], EPI_FORM=form)))
        for lean in ("lean", "lean128"):  # SigLIP's lean epilogue (an option, SIGLIP_EPILOGUE) on the panel route
            for path in ("panel", "panel_rows"):
                for form in EPI_FORMS:
                    out.append((f"siglip N={n} {path} {form} {lean}", lambda g, n=n, path=path, form=form, lean=lean:
                                _overriding(lambda: GM.run_siglip_triton(n, d, g, path)[0], EPI_FORM=form,
                                            SIGLIP_EPILOGUE=lean)))
        for path in ("panel", "panel_rows"):  # SigLIP's fp16 pass (an option, SIGLIP_EPILOGUE=fp16pass)
            out.append((f"siglip N={n} {path} fp16pass", lambda g, n=n, path=path:
                        _overriding(lambda: GM.run_siglip_triton(n, d, g, path)[0], SIGLIP_EPILOGUE="fp16pass")))
    out.append(("maxsim N=1024", lambda g: GM.run_maxsim_triton(1024, 32, 180, 128, g)[0]))
    return out


_all_recordings = recordings  # (tests narrow ``recordings`` and reach the full list here)


def _with(fn, **env: str):
    with _env(**env):
        return fn()


def _overriding(fn, **values: str):
    """``fn()`` with the switchboard's overrides ``values``, which win over the environment a recorder sets
    itself (``gpu_model.run_siglip_triton`` sets ``EPI_FORM=tiles`` in the environment)."""
    with routes.override(**values):
        return fn()


def key(launch: TL.Launch) -> tuple:
    return (launch.name, tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages,
            launch.options().get("maxnreg"),
            tuple(sorted((k, str(v.dtype)) for k, v in launch.args.items() if isinstance(v, torch.Tensor))),
            tuple(sorted(k for k, v in launch.args.items() if isinstance(v, int) and not isinstance(v, bool)
                         and v % 16 == 0 and v != 0)))


def collect(sizes: list[int], ccs: list[int], d: int = 768) -> tuple[dict[tuple, tuple[TL.Launch, int, str]], list]:
    """{(cc, key): (launch, cc, first route label)} and the routes that could not even be recorded."""
    found: dict[tuple, tuple[TL.Launch, int, str]] = {}
    broken = []
    for cc in ccs:
        gpu = GM.GPUS[GPU_OF_CC[cc]]
        for label, rec in recordings(sizes, d):
            try:
                launches = rec(gpu)
            except Exception as exc:  # noqa: BLE001 - a route that cannot be recorded is reported, not fatal
                broken.append((cc, label, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
                continue
            for lz in launches:
                found.setdefault((cc, key(lz)), (lz, cc, label))
    return found, broken


#: the launches to compile, set before the worker processes fork (a launch holds kernels and meta tensors,
#: which do not pickle: the workers take an index)
_ITEMS: list[tuple[TL.Launch, int, str]] = []


def _compile(i: int) -> tuple[str, int, str, str]:
    lz, cc, label = _ITEMS[i]
    try:
        r = compile_survey.compile_launch(lz, cc)
        spill = r.get("spill_stores", 0) + r.get("spill_loads", 0)  # (compile_launch's ptxas figures)
        return lz.name, cc, label, f"ok: {r.get('regs')} regs, {spill} B spilled (stores + loads), {r.get('tc')}"
    except Exception as exc:  # noqa: BLE001
        return lz.name, cc, label, f"FAIL {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="4096,16384,65536", help="comma-separated N (default 4096,16384,65536)")
    ap.add_argument("--cc", default="90,80", help="comma-separated compute capabilities (default 90,80)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: cores)")
    args = ap.parse_args(argv)
    import triton

    t0 = time.time()
    sizes = [int(x) for x in args.n.split(",") if x]
    ccs = [int(x) for x in args.cc.split(",") if x]
    found, broken = collect(sizes, ccs)
    print(f"triton {triton.__version__}: {len(found)} distinct launches from {len(recordings(sizes))} routes x "
          f"{len(ccs)} archs", flush=True)
    _ITEMS[:] = sorted(found.values(), key=lambda t: (t[1], t[0].name))
    if args.jobs <= 1:
        results = [_compile(i) for i in range(len(_ITEMS))]
    else:
        with cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as ex:
            results = list(ex.map(_compile, range(len(_ITEMS))))
    fails = [r for r in results if r[3].startswith("FAIL")]
    for name, cc, label, res in results:
        print(f"sm_{cc} {name:<22} ({label}): {res}")
    for cc, label, err in broken:
        print(f"sm_{cc} route not recorded ({label}): {err}")
    print(f"{len(results) - len(fails)} compiled, {len(fails)} failed, {len(broken)} routes not recorded; "
          f"{time.time() - t0:.0f} s")
    return 1 if fails or broken else 0


if __name__ == "__main__":
    sys.exit(main())
