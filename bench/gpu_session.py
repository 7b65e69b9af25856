"""One lent GPU session's measurements, in order of what they decide, within one wall-clock budget.

    python bench/gpu_session.py --out DIR                  # every step, --budget 540 s
    python bench/gpu_session.py --out DIR --steps configs,siglip   # what a first call left
    python bench/gpu_session.py --list                     # the steps and their commands

A developer session may be lent one GPU for a few minutes, a command at a time (600 s at most each). This
runs the commands the open GPU questions need (docs/gpu-measurements.md, "Running on a GPU") one after another, each
in its own process group with the time the budget has left, writing what each prints, as it prints it, to
``DIR/<step>.txt`` and a summary to ``DIR/session.json``. The device tool returns at most eight files, so
when the steps leave more than that, everything but the summary goes into one ``DIR/session.tar.gz`` (its
members the files as written, paths relative to DIR; ``tar xzf`` it into the results folder). A step
that would start with under ``--min-step`` seconds left is not run; a step that outlives the budget is
killed, its output so far kept and marked. The last line names the steps left for a second call. Commit the
files under ``bench/results/``.

Nothing here is a measurement of its own: the steps measure (``bench-gpu``, ``check --gpu-validate``,
``bench/gpu_profile.py``), this only sequences them and records each one's exit status and wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    why: str
    #: the step's own wall-clock budget flag (``check --gpu-validate --budget``): set to the smaller of
    #: ``budget_cap`` and the session's time left less ``budget_margin``, so the step ends by itself
    budget_flag: str | None = None
    budget_cap: float = 0.0
    budget_margin: float = 40.0

    def command(self, left: float, out: Path | str = "DIR") -> list[str]:
        argv = [a.replace("{out}", str(out)) for a in self.argv]
        if self.budget_flag is not None:
            argv += [self.budget_flag, f"{max(30.0, min(self.budget_cap, left - self.budget_margin)):.0f}"]
        return argv


_PROFILE = (sys.executable, "bench/gpu_profile.py")

#: In order of what each decides; the first three are the ones a first call must not miss. bench-gpu writes its
#: table, JSON lines and plot to ``DIR/levers/`` and ``DIR/bench_gpu/`` (three files each) beside its printed log;
#: with the other steps' logs and the summary that is more than the device tool returns, so :func:`pack` puts
#: them in one archive. The tile loops, the panel budget, the Matryoshka routes and the 128 x 256 one pass are
#: bench-gpu's forms (``bench/gpu.py`` FORMS), timed beside the defaults in its full run, so they are no steps of
#: their own; the levers get a short run of their own first, as nothing has timed them.
#: the levers built as options and never timed (bench/gpu.py FORMS): what the next GPU decides first
LEVERS = ("epi=hoist", "one_pass=128x256w16+hoist", "gemm=fp16pass", "siglip=lean", "siglip=lean128",
          "siglip=lean128+tiles", "siglip=fp16pass")

#: MaxSim's untimed forms: a step of their own, at MaxSim's sizes (the levers step's N would be 16384 and 65536)
MAXSIM_LEVERS = ("maxsim=overlap", "maxsim=dd-regs")

STEPS: tuple[Step, ...] = (
    Step("levers", (sys.executable, "-m", "fused_contrastive", "bench-gpu", "--losses",
                    "info_nce,simcse,clip,siglip,matryoshka5", "--sizes", "16384,65536", "--dims", "768", "--forms",
                    ",".join(LEVERS), "--no-peers", "--no-compile", "--out", "{out}/levers"),
         "the untimed levers beside the defaults (hoisted epilogue loads, the fp16 pass, SigLIP's lean epilogue): "
         "each becomes a default only where it wins here",
         budget_flag="--budget", budget_cap=180.0),
    Step("bench_gpu", (sys.executable, "-m", "fused_contrastive", "bench-gpu", "--out", "{out}/bench_gpu"),
         "every loss's default route beside the textbook, its compiled form, the route options and the peers",
         budget_flag="--budget", budget_cap=330.0),
    Step("validate", (sys.executable, "-m", "fused_contrastive", "check", "--gpu-validate", "--jobs", "8"),
         "the verdict: parity of every kernel family against float64, reruns, fp16, timings beside the model",
         budget_flag="--budget", budget_cap=240.0),
    Step("maxsim_levers", (sys.executable, "-m", "fused_contrastive", "bench-gpu", "--losses", "maxsim", "--forms",
                           ",".join(MAXSIM_LEVERS), "--no-peers", "--no-compile", "--out", "{out}/maxsim_levers"),
         "MaxSim's untimed forms (the overlapped forward, dd's one-hot in registers) beside its default at its own "
         "sizes (N = M = 1024 and 4096)",
         budget_flag="--budget", budget_cap=90.0),
    Step("configs", (*_PROFILE, "--n", "65536", "--losses", "", "--no-profile", "--configs", "one_pass,stats"),
         "the one pass's and the statistics forward's launch configurations"),
    Step("siglip", (*_PROFILE, "--n", "65536", "--losses", "siglip", "--siglip-forms", "--configs", "siglip_eager"),
         "SigLIP's one pass against its two sweeps, and the one pass's configurations"),
)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_step(step: Step, out: Path, left: float) -> dict:
    """Run ``step`` with ``left`` seconds at most, its output streamed to ``out / f"{step.name}.txt"``."""
    cmd = step.command(left, out)
    path = out / f"{step.name}.txt"
    t0 = time.monotonic()
    with path.open("w") as f:
        f.write("$ " + " ".join(repr(a) if not a or " " in a else a for a in cmd) + "\n")
        f.flush()
        # the checkout's package first (bench/ scripts import fused_contrastive; no install needed there)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=left)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, timed_out = None, True
        wall = time.monotonic() - t0
        f.write(f"\n# TIMED OUT after {wall:.0f} s: killed, the output above is what it printed\n" if timed_out
                else f"\n# exit {rc}, wall {wall:.0f} s\n")
    status = "timed out" if timed_out else ("ok" if rc == 0 else f"exit {rc}")
    return dict(step=step.name, status=status, rc=rc, wall_s=round(wall, 1), file=path.name, command=cmd)


def run_session(steps: tuple[Step, ...] | list[Step], out: Path, budget: float, min_step: float) -> dict:
    """Every step in order while at least ``min_step`` seconds of ``budget`` are left; the summary is
    also written to ``out / "session.json"``."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows, not_run = [], []
    for step in steps:
        left = budget - (time.monotonic() - t0)
        if left < min_step:
            not_run.append(step.name)
            continue
        print(f"[{time.monotonic() - t0:5.0f} s] {step.name}: {step.why}", flush=True)
        rows.append(run_step(step, out, left))
        print(f"[{time.monotonic() - t0:5.0f} s] {step.name}: {rows[-1]['status']}, {rows[-1]['wall_s']:.0f} s",
              flush=True)
    summary = dict(budget_s=budget, wall_s=round(time.monotonic() - t0, 1), steps=rows, not_run=not_run,
                   device=_device())
    (out / "session.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


#: files the device tool brings back from its output folder
MAX_FILES = 8
PACK = "session.tar.gz"


def pack(out: Path, max_files: int = MAX_FILES) -> list[str]:
    """When ``out`` holds more than ``max_files`` files (any depth), move every file but ``session.json`` into
    ``out / PACK`` (paths relative to ``out``, contents as written) and return their relative paths; else
    leave ``out`` as it is and return []."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    if len(files) <= max_files:
        return []
    members = [p for p in files if p.name != "session.json" or p.parent != out]
    names = [str(p.relative_to(out)) for p in members]
    with tarfile.open(out / PACK, "w:gz") as tar:
        for p, name in zip(members, names, strict=True):
            tar.add(p, arcname=name)
    for p in members:
        p.unlink()
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return names


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # noqa: BLE001 - the summary says what it could not read
        return f"unknown ({type(e).__name__})"


def select(names: str) -> list[Step]:
    by_name = {s.name: s for s in STEPS}
    wanted = [x for x in names.split(",") if x]
    bad = [x for x in wanted if x not in by_name]
    if bad:
        raise SystemExit(f"bench/gpu_session.py: --steps: unknown step(s) {', '.join(bad)}; "
                         f"the steps are {', '.join(by_name)}")
    return [by_name[x] for x in wanted]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for <step>.txt and session.json")
    ap.add_argument("--budget", type=float, default=540.0, metavar="SECONDS",
                    help="wall clock for all the steps (default 540: a 600 s device call with room to copy back)")
    ap.add_argument("--min-step", type=float, default=45.0, metavar="SECONDS",
                    help="a step starts only with this much of the budget left (default 45)")
    ap.add_argument("--steps", default=",".join(s.name for s in STEPS),
                    help="comma-separated steps, in the order to run them (default: all, in the order listed)")
    ap.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    ap.add_argument("--no-pack", action="store_true",
                    help=f"leave the files as written even when there are more than {MAX_FILES}")
    args = ap.parse_args(argv)
    steps = select(args.steps)
    if args.list:
        for s in steps:
            print(f"{s.name:<11} {' '.join(s.command(args.budget))}\n            {s.why}")
        return 0
    if args.out is None:
        ap.error("--out is required (unless --list)")
    summary = run_session(steps, args.out, args.budget, args.min_step)
    for r in summary["steps"]:
        print(f"  {r['step']:<11} {r['status']:<10} {r['wall_s']:6.0f} s  {r['file']}")
    packed = [] if args.no_pack else pack(args.out)
    if packed:
        print(f"{len(packed)} files (more than the device tool's {MAX_FILES}) packed into {args.out / PACK}: "
              f"tar xzf it into the results folder")
    if summary["not_run"]:
        print(f"not run (budget): python bench/gpu_session.py --out DIR --steps {','.join(summary['not_run'])}")
    return 0 if all(r["status"] == "ok" for r in summary["steps"]) and not summary["not_run"] else 1


if __name__ == "__main__":
    sys.exit(main())
