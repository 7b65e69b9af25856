"""SigLIP's epilogue GEMM (``kernels/panel.py`` ``epi_gemm_kernel`` MODE 4 / 5) in its per-logit forms, compiled
ahead of time for sm_90 (or sm_80) with the Triton installed here: COMPILED, NOT TIMED.

    python bench/siglip_epilogue_compile.py                 # N = 65536, D = 768, sm_90
    python bench/siglip_epilogue_compile.py --cc 80 --n 16384

For each ``FUSED_CONTRASTIVE_SIGLIP_EPILOGUE`` form (exact, lean, lean128) and epilogue-GEMM tile loop (tiles,
and tma on sm_90: SigLIP's one pass's default there), the launches of ``siglip_loss``'s Triton Function
(``bench/gpu_model.py`` ``run_siglip_triton``: the mean loss, whose one pass is MODE 5, and the per-row losses,
MODE 4's forward and gradient sweeps) are recorded on the meta device and compiled
(``tools.compile_survey.compile_launch``). Per distinct launch: registers, spill bytes, shared memory, and
the SASS instruction counts per thread (``nvdisasm`` of the cubin, the static count of the whole kernel: the
tiles loop holds the straight-line epilogue once, beside the D loop's body; the persistent loops' flattened tile
loop holds three copies of it): every instruction, FFMA,
the MUFU.EX2 / RCP / LG2 special-function instructions, and the PTX's ``ex2`` / ``rcp`` / ``lg2`` / ``fma``
lines. A tile holds BLOCK_M x BLOCK_N logits over num_warps x 32 threads.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_model as GM  # noqa: E402

from fused_contrastive import routes  # noqa: E402
from fused_contrastive.tools import compile_survey  # noqa: E402

FORMS = ("exact", "lean", "lean128")
GPU_OF_CC = {90: "H100", 80: "A100"}


def sass_counts(cubin: bytes) -> dict[str, int]:
    """Static SASS instruction counts of a cubin (``nvdisasm`` bundled with Triton)."""
    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    return dict(sass=len(ops), ffma=sum(o.startswith("FFMA") for o in ops),
                ex2=sum(o.startswith("MUFU.EX2") for o in ops), rcp=sum(o.startswith("MUFU.RCP") for o in ops),
                lg2=sum(o.startswith("MUFU.LG2") for o in ops), hgmma=sum(o.startswith("HGMMA") for o in ops))


def ptx_counts(ptx: str) -> dict[str, int]:
    lines = [x.strip() for x in ptx.splitlines()]
    return dict(ptx_ex2=sum(x.startswith("ex2.") for x in lines), ptx_rcp=sum(x.startswith("rcp.") for x in lines),
                ptx_div=sum(x.startswith("div.") for x in lines), ptx_lg2=sum(x.startswith("lg2.") for x in lines),
                ptx_fma=sum(x.startswith("fma.") for x in lines))


def launches(n: int, d: int, cc: int, form: str, loop: str, path: str):
    """The epilogue GEMM's launches of ``run_siglip_triton`` with ``SIGLIP_EPILOGUE=form`` and the tile loop
    ``EPI_FORM=loop`` (switchboard overrides: they win over the environment the recorder sets)."""
    gpu = GM.GPUS[GPU_OF_CC[cc]]
    with routes.override(SIGLIP_EPILOGUE=form, EPI_FORM=loop):
        return [x for x in GM.run_siglip_triton(n, d, gpu, path)[0] if x.name == "epi_gemm_siglip"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--loops", default=None, help="tile loops (default: tiles,tma on sm_90, tiles on sm_80)")
    ap.add_argument("--paths", default="panel,panel_rows", help="panel (MODE 5), panel_rows (MODE 4 sweeps)")
    args = ap.parse_args(argv)
    import triton

    loops = (args.loops or ("tiles,tma" if args.cc == 90 else "tiles")).split(",")
    print(f"triton {triton.__version__}, sm_{args.cc}, N = {args.n}, D = {args.d}, bf16: COMPILED, NOT TIMED")
    print("| form | loop | mode | HAS_G | tile | warps | stages | regs | spill B | smem B | SASS | FFMA | MUFU.EX2 "
          "| MUFU.RCP | MUFU.LG2 | PTX ex2 / rcp / div / lg2 / fma |")
    print("|" + "---|" * 16)
    seen = set()
    for form in args.forms.split(","):
        for loop in loops:
            for path in args.paths.split(","):
                for lz in launches(args.n, args.d, args.cc, form, loop, path):
                    c = lz.constexprs
                    key = (form, c["MODE"], c["HAS_G"], c["BLOCK_M"], c["BLOCK_N"], lz.num_warps, lz.num_stages,
                           c["PERSIST"], c["TMA"])  # (a config without a persistent depth keeps the tiles loop)
                    if key in seen:
                        continue
                    seen.add(key)
                    keep: dict = {}
                    r = compile_survey.compile_launch(lz, args.cc, keep)
                    ck = keep["kernel"]
                    s = sass_counts(ck.asm["cubin"])
                    p = ptx_counts(ck.asm["ptx"])
                    lp = ("tma" if c["TMA"] else "persistent") if c["PERSIST"] else "tiles"
                    print(f"| {form} | {lp} | {c['MODE']} | {c['HAS_G']} | {c['BLOCK_M']}x{c['BLOCK_N']} | "
                          f"{lz.num_warps} | {lz.num_stages} | {r['regs']} | {r['spill_stores']}/{r['spill_loads']} | "
                          f"{r['shared']} | {s['sass']} | {s['ffma']} | {s['ex2']} | {s['rcp']} | {s['lg2']} | "
                          f"{p['ptx_ex2']} / {p['ptx_rcp']} / {p['ptx_div']} / {p['ptx_lg2']} / {p['ptx_fma']} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
