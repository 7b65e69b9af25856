"""MaxSim's untimed kernel forms beside the defaults, compiled ahead of time for sm_80 / sm_90 with the Triton
installed here: COMPILED, NOT TIMED.

    python bench/maxsim_forms_compile.py            # bf16, N = M = 1024, Lq = 32, Ld = 180, D = 128

The forms (``core/maxsim/triton_maxsim.py``'s sweep settings): ``default``; ``fwd-overlap`` (the forward over
pairs of token chunks, the next chunk's matmul issued before the pair's max / argmax reductions:
``FUSED_CONTRASTIVE_MAXSIM_FWD=overlap``); ``dd-regs`` (dd's one-hot operand built in the accumulator's layout:
``FUSED_CONTRASTIVE_MAXSIM_DD=regs``). For the forward (default, fwd-overlap) and dd (default, dd-regs): registers,
spill bytes, shared memory, whether ptxas serialised the wgmma (its C7514 / C7515 warnings), and static SASS counts
(``cuobjdump -sass`` of the cubin) of the whole kernel and of its main loop's body (the longest backward branch), per
token chunk (the overlap form's body holds two): every instruction, tensor-core instructions (HGMMA / HMMA),
wgmma waits (``WARPGROUP.DEPBAR``), shared-memory stores / loads (STS, LDS, LDSM), and the reductions' FMNMX,
IMNMX / VIMNMX and SHFL. ``in flight``: per wgmma commit group of the loop, the SASS instructions between its last
HGMMA and the next wait (in program order, around the back edge): the work that may run while the tensor cores
do (few when a wait follows the issue). ``ttgir``: the loop's ``warp_group_dot`` ops and their waits in
program order (``dot`` / ``dot*`` an asynchronous one left in flight / ``wait N`` / ``reduce``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

from fused_contrastive.core.maxsim import triton_maxsim as TMS  # noqa: E402
from fused_contrastive.tools import compile_survey  # noqa: E402

CASES = (("maxsim_fwd", "default"), ("maxsim_fwd", "fwd-overlap"), ("maxsim_bwd_doc", "default"),
         ("maxsim_bwd_doc", "dd-regs"))


def record(setting: str, arch: str, n: int, lq: int, ld: int, d: int):
    meta, dt = torch.device("meta"), torch.bfloat16
    q = torch.empty(n, lq, d, dtype=dt, device=meta)
    doc = torch.empty(n, ld, d, dtype=dt, device=meta)
    w = torch.empty(n, lq, device=meta)
    dv = torch.empty(n, ld, dtype=torch.bool, device=meta)
    with TMS.settings(setting), compile_survey.recording(arch) as launches:
        s, idx, lse = TMS.maxsim_forward(q, doc, w, dv, torch.empty((), device=meta), -1e9)
        TMS.maxsim_backward(q, doc, w, idx, torch.empty(n, n, device=meta), dv)
    return {x.name: x for x in launches}


def _tool(name: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin (``cuobjdump -sass`` bundled with Triton: branch targets as addresses)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m[1], 16), m[2]))
    return out


def serialized(ptx: str, cc: int) -> bool:
    """Whether ptxas reports the wgmma serialised (C7514 / C7515 'Potential Performance Loss')."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={sm_arch_from_capability(cc)}", src, "-o",
                              os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True).stderr
    return "Potential Performance Loss: wgmma" in log


def op(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def loop_body(lines):
    """The main loop: the instructions of the longest backward branch's range."""
    loops = []
    for addr, ins in lines:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", ins)
        if m and int(m[1], 16) < addr:
            loops.append((int(m[1], 16), addr))
    if not loops:
        raise ValueError("no loop in the SASS")
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return [(a, i) for a, i in lines if lo <= a <= hi]


def in_flight(body) -> list[int]:
    """Per wgmma commit group of the loop (its last HGMMA carries ``gsb0``): the instructions between it and the next
    WARPGROUP.DEPBAR in program order, around the loop's back edge (the work that may run while it computes)."""
    out = []
    for k, (_, ins) in enumerate(body):
        if op(ins).startswith("HGMMA") and "gsb0" in ins:
            n = 0
            for m in range(1, len(body)):
                o = op(body[(k + m) % len(body)][1])
                if o.startswith("WARPGROUP.DEPBAR"):
                    break
                n += not o.startswith("HGMMA")
            out.append(n)
    return out


def ttgir_order(ttgir: str) -> str:
    """The loop's dots, their waits and the reductions, in program order (the outermost scf.for's body)."""
    start = ttgir.find("scf.for")
    seq = []
    for line in ttgir[start:].splitlines():
        if "ttng.warp_group_dot_wait" in line:
            seq.append("wait " + re.search(r"pendings = (\d+)", line)[1])
        elif "ttng.warp_group_dot " in line or "tt.dot " in line:
            seq.append("dot")
        elif '"tt.reduce"' in line:
            seq.append("reduce")
        elif line.strip().startswith("scf.yield") and line.startswith("      scf.yield"):
            break
    out = []
    for s in seq:  # collapse repeats
        if out and out[-1][0] == s:
            out[-1][1] += 1
        else:
            out.append([s, 1])
    return ", ".join(s if k == 1 else f"{s} x{k}" for s, k in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--ld", type=int, default=180)
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    print(f"COMPILED, NOT TIMED: bf16, N = M = {a.n}, Lq = {a.lq}, Ld = {a.ld}, D = {a.d}; triton "
          f"{__import__('triton').__version__}\n")
    keys = ("sass", "loop/chunk", "hgmma|hmma", "depbar", "sts", "lds", "ldsm", "fmnmx", "imnmx", "shfl")
    print("| kernel | form | cc | regs | spill | shared | wgmma serialised | in flight | " + " | ".join(keys)
          + " | ttgir loop |")
    print("|" + "---|" * (9 + len(keys)))
    for cc, arch in compile_survey.TARGETS:
        for kernel, setting in CASES:
            launch = record(setting, arch, a.n, a.lq, a.ld, a.d)[kernel]
            keep: dict[str, object] = {}
            r = compile_survey.compile_launch(launch, cc, keep)
            ck = keep["kernel"]
            lines = sass_lines(ck.asm["cubin"])
            body = loop_body(lines)
            chunks = 2 if setting == "fwd-overlap" else 1
            ops = [op(i) for _, i in body]

            def n(prefix, ops=ops):
                return sum(o.startswith(prefix) for o in ops)
            vals = dict(sass=len(lines), **{"loop/chunk": round(len(body) / chunks)},
                        **{"hgmma|hmma": n("HGMMA") + n("HMMA")}, depbar=n("WARPGROUP.DEPBAR"),
                        sts=n("STS"), lds=n("LDS.") + sum(o == "LDS" for o in ops), ldsm=n("LDSM"),
                        fmnmx=n("FMNMX"), imnmx=n("IMNMX") + n("VIMNMX"), shfl=n("SHFL"))
            ser = serialized(ck.asm["ptx"], cc) if cc == 90 else "-"
            fl = "/".join(map(str, in_flight(body))) if cc == 90 else "-"
            print(f"| {kernel} | {setting} | {cc} | {r['regs']} | {r['spill_stores'] + r['spill_loads']} | "
                  f"{r['shared']} | {ser} | {fl} | " + " | ".join(str(vals[k]) for k in keys)
                  + f" | {ttgir_order(ck.asm['ttgir'])} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
