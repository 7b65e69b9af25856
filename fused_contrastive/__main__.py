"""Command line of fused-contrastive: ``fused-contrastive`` or ``python -m fused_contrastive``.

Sub-commands: ``check`` (the default) verifies every loss on every backend available here against
the float64 ground truth; ``bench`` runs the benchmark suite; ``bench-encode`` times
``encode_in_chunks`` against a plain step; ``bench-gather`` computes what ``gather=`` sends per rank;
``bench-matryoshka`` times the one-pass Matryoshka loss against one plain loss and the K-loss computations;
``bench-gist`` times the fused GISTEmbed loss against the textbook computation with B x B matrices;
``bench-st-step`` times a sentence-transformers training step with their loss and the fused one;
``bench-maxsim`` times the fused MaxSim (late-interaction) loss against the materialised token
similarities and sentence-transformers' loss; ``bench-gpu`` (CUDA) times every loss's default route
beside the textbook formula, its compiled form, the route options and the GPU-only peer libraries.
``--help`` on either lists its options.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from . import routes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
#: "dense": the one-tile path of problems that fit the tile budget; "tiled": the O(N*D) path (chunked
#: PyTorch or the Triton kernels), forced with FUSED_CONTRASTIVE_DENSE=0.
PATHS = ("dense", "tiled")
#: How long ``check`` takes with its default options, as measured (printed by ``check`` and its help): 948 rows
#: in 29.7 s on an idle 2-core CPU (torch 2.13, triton's interpreter installed), 2 m 36 s for 708 rows on a
#: 2-core host at load 4-7
DEFAULT_CHECK_TIME = "about 30 seconds on an idle 2-core CPU, a few minutes on a busy one"
COMMANDS = ("check", "bench", "bench-encode", "bench-gather", "bench-matryoshka", "bench-gist",
            "bench-st-step", "bench-maxsim", "bench-gpu")
#: What each sub-command imports beyond torch, by the extra that installs it (``pyproject.toml``). A
#: sub-command whose extra is missing says so in one line and exits 2; ``check`` needs none.
EXTRAS = {"bench": ("numpy", "tqdm", "tabulate")}
NEEDS = {"bench": ("bench",), "bench-encode": ("bench",), "bench-gather": ("bench",), "bench-matryoshka": ("bench",),
         "bench-gist": ("bench",), "bench-st-step": ("bench", "sentence-transformers"), "bench-maxsim": ("bench",)}
EXTRA_MODULES = {**EXTRAS, "sentence-transformers": ("sentence_transformers", "transformers")}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _shape(text: str) -> tuple[int, int]:
    try:
        n, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not NxD (e.g. 97x64)") from None
    if n < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: N and D must be >= 1")
    return n, d


def _choices(kind: str, valid: Sequence[str]):
    def parse(text: str) -> list[str]:
        items = _csv(text)
        bad = [x for x in items if x not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad or [text]}; valid: {', '.join(valid)}")
        return items
    return parse


def available_backends(device: str) -> list[str]:
    """Our backends that can run on ``device`` here (the reference is the oracle, not checked)."""
    from ._backend import triton_usable_on

    out = ["torch"]
    if triton_usable_on(torch.device(device)):
        out.append("triton")
    return out


@contextlib.contextmanager
def _path(path: str) -> Iterator[None]:
    with routes.override(DENSE=path == "dense"):
        yield


def _device(text: str) -> str:
    """``--device``: a torch device string of a device this machine has (checked up front, so that a
    missing GPU is one error, not a FAIL row per case)."""
    try:
        dev = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({str(e).splitlines()[0]})") from None
    if dev.type == "cpu":
        return text
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here (torch {torch.__version__}, "
                                         f"built {'with' if torch.version.cuda else 'without'} CUDA)")
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: no such device here ({str(e).splitlines()[0]})") from None
    return text


def _check_parser(sub) -> argparse.ArgumentParser:
    from .testing import CASES

    names = [c.name for c in CASES]
    p = sub.add_parser(
        "check", help="every loss on every available backend against the float64 ground truth (default)",
        description="Run every case of the registry on every backend available on the device, on random "
                    "data, against the float64 ground truth (the reference backend in float64). A row "
                    "passes when each output's error is within twice PyTorch's own error in that dtype plus "
                    "a small slack (fused_contrastive.testing.accuracy). Exit status 1 if any row fails. "
                    f"With the default options it takes {DEFAULT_CHECK_TIME} (fewer --shapes / --dtypes / --losses: "
                    "less); it prints its row count first and the time taken last.")
    p.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="a torch device this machine has (default: cuda if available, else cpu)")
    p.add_argument("--shapes", type=lambda t: [_shape(s) for s in _csv(t)], default=[(1, 3), (97, 64), (256, 768)],
                   metavar="NxD,...", help="N anchors x D dims (default 1x3,97x64,256x768)")
    p.add_argument("--dtypes", type=_choices("dtype", list(DTYPES)), default=["float32", "bfloat16", "float16"],
                   metavar="DTYPE,...", help=f"among {', '.join(DTYPES)} (default float32,bfloat16,float16)")
    p.add_argument("--backends", type=_choices("backend", ["torch", "triton"]), default=None, metavar="BACKEND,...",
                   help="torch and/or triton (default: those available on the device)")
    p.add_argument("--paths", type=_choices("path", PATHS), default=list(PATHS), metavar="PATH,...",
                   help="dense (one tile) and/or tiled (chunked / kernels) (default both)")
    p.add_argument("--losses", type=_choices("case", names), default=names, metavar="CASE,...",
                   help="registry case names (default all; --list shows them)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--gpu-validate", action="store_true",
                   help="first run on a GPU instead (needs CUDA; exit 2 without): every Triton kernel family (the "
                        "core op's fused kernels and panel path, SupCon, CoSENT, SigLIP, GIST, the Matryoshka kernels "
                        "and their per-level route) and the options only the CPU interpreter has run against the "
                        "float64 oracle under THE accuracy rule, at N = 4099, D = 768 (bf16/fp16/fp32; flat, sharp "
                        "and saturated inputs) and D = 100 (flat bf16), with NaN-filled outputs and scratch; then "
                        "bitwise-identical reruns and fp16 at M = 65536 against fp32; the timings against the "
                        "textbook formula (with the GPU model's prediction) last. Prints its plan and an ESTIMATE of "
                        "its time first; ends with the verdict table, naming every row not run (exit 1 on a failure; "
                        "fused_contrastive/gpu_validate.py)")
    p.add_argument("--budget", type=float, default=420.0, metavar="SECONDS",
                   help="with --gpu-validate: wall-clock budget; rows that would start later are listed as not run "
                        "and the verdict table follows (default 420)")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), metavar="J",
                   help="with --gpu-validate: processes for the correctness checks, which compile every kernel "
                        "variant on a first run (the timings run alone, after them; default min(8, CPUs))")
    p.add_argument("--aot-lib", default=None, metavar="PATH",
                   help="with --gpu-validate: also check this built libfused_contrastive_torch.so (default: "
                        "$FUSED_CONTRASTIVE_AOT_LIB)")
    return p


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .testing import CASE_BY_NAME, compare

    if args.gpu_validate:
        from . import gpu_validate

        return gpu_validate.main(args.device, args.aot_lib, args.budget, max(1, args.jobs))
    if args.list:
        for c in CASE_BY_NAME.values():
            print(f"{c.name:22s} {c.fn.__name__:24s} {c.covers}")
        return 0
    here = available_backends(args.device)
    backends = args.backends or here
    missing = [b for b in backends if b not in here]
    if missing:
        parser.error(f"--backends {','.join(missing)}: not available on {args.device} here "
                     f"(available: {', '.join(here)})")
    dtypes = [DTYPES[d] for d in args.dtypes]
    if "triton" in backends and torch.float64 in dtypes:
        print("note: triton takes no float64; those rows are skipped")
    print(f"fused-contrastive check on {args.device} (torch {torch.__version__}); backends: {', '.join(backends)}; "
          "errors against the float64 ground truth, tolerance 2 x PyTorch's same-dtype error + slack")
    plan = []  # (case, backend, path, label, N, D, dtype), or a note (str) where a case does not run at a shape
    for name in args.losses:
        case = CASE_BY_NAME[name]
        for be in backends:
            for path in args.paths:
                if be == "triton" and (not case.has_triton or (case.op != "core" and path == "dense")):
                    continue  # no kernel (alignment); CoSENT's and SigLIP's kernels have no one-tile variant
                label = f"{be}/{path if path == 'dense' else ('kernels' if be == 'triton' else 'chunked')}"
                for n, d in args.shapes:
                    if n < case.min_n:  # e.g. uniformity (pairs i != j): not built at a different N silently
                        plan.append(f"{name:22s} {label:15s} {f'{n}x{d}':>9s} {'-':9s} {'':38s}  n/a (the case "
                                    f"needs N >= {case.min_n})")
                        continue
                    plan += [(case, be, path, label, n, d, dt) for dt in dtypes
                             if not (be == "triton" and dt == torch.float64)]
    rows = sum(1 for p in plan if not isinstance(p, str))
    if rows == 0:
        print("nothing to check: no case runs on the selected backends")
        return 1
    print(f"{rows} rows to check (with the default options: {DEFAULT_CHECK_TIME}; the last line gives the time)")
    head = (f"{'case':22s} {'backend':15s} {'N x D':>9s} {'dtype':9s} {'loss err':>9s} {'tol':>8s} "
            f"{'grad err':>9s} {'tol':>8s}  result")
    print(head)
    print("-" * len(head))
    failures = 0
    t0 = time.perf_counter()
    for p in plan:
        if isinstance(p, str):
            print(p, flush=True)
            continue
        case, be, path, label, n, d, dt = p
        try:
            with _path(path):
                c = compare(case, n, d, dt, be, device=args.device)
            ok = c.ok
            cols = f"{c.loss_err:9.2e} {c.loss_tol:8.1e} {c.grad_err:9.2e} {c.grad_tol:8.1e}"
            detail = "" if ok else f"  {c}"
        except Exception as exc:  # noqa: BLE001 - a crash is a failure row, not fatal
            ok, cols, detail = False, "error".ljust(38), f"  {type(exc).__name__}: {exc}"[:200]
        failures += not ok
        dname = str(dt).replace("torch.", "")
        print(f"{case.name:22s} {label:15s} {f'{n}x{d}':>9s} {dname:9s} {cols}  "
              f"{'PASS' if ok else 'FAIL'}{detail}", flush=True)
    print(f"{rows} rows, {'all passed' if not failures else f'{failures} FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


def missing_extra(command: str | None) -> str | None:
    """The one-line message for ``command`` when a module of an extra it needs is not importable here,
    else None (``importlib.util.find_spec``: nothing is imported)."""
    import importlib.util

    for extra in NEEDS.get(command or "", ()):
        for mod in EXTRA_MODULES[extra]:
            if importlib.util.find_spec(mod) is None:
                return (f"fused-contrastive {command}: needs the [{extra}] extra ({mod} is not installed): "
                        f'pip install "/path/to/fused-contrastive[{extra}]" (a checkout of this project)')
    return None


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and the parser of each sub-command by name."""
    from . import __version__
    from .bench import cli as bench_cli
    from .bench import encode as bench_encode
    from .bench import gather as bench_gather
    from .bench import gist as bench_gist
    from .bench import gpu as bench_gpu
    from .bench import matryoshka as bench_matryoshka
    from .bench import maxsim_late as bench_maxsim
    from .bench import st_step as bench_st_step

    parser = argparse.ArgumentParser(
        prog="fused-contrastive",
        description="Fused, O(N*D)-memory contrastive losses for PyTorch. With no sub-command: check.")
    parser.add_argument("--version", action="version", version=f"fused-contrastive {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    subs = {"check": _check_parser(sub), "bench": bench_cli.add_parser(sub),
            "bench-encode": bench_encode.add_parser(sub), "bench-gather": bench_gather.add_parser(sub),
            "bench-matryoshka": bench_matryoshka.add_parser(sub), "bench-gist": bench_gist.add_parser(sub),
            "bench-st-step": bench_st_step.add_parser(sub), "bench-maxsim": bench_maxsim.add_parser(sub),
            "bench-gpu": bench_gpu.add_parser(sub)}
    return parser, subs


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser()
    if not argv:
        argv = ["check"]
    args, extra = parser.parse_known_args(argv)
    if extra:  # answered by the sub-command's parser (its usage and options), not the top level's
        (subs.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    need = missing_extra(args.command)
    if need:
        print(need, file=sys.stderr)
        return 2
    if args.command == "bench":
        from .bench import cli as bench_cli

        return bench_cli.run(args, subs["bench"])
    if args.command == "bench-encode":
        from .bench import encode as bench_encode

        return bench_encode.run(args, subs["bench-encode"])
    if args.command == "bench-gather":
        from .bench import gather as bench_gather

        return bench_gather.run(args, subs["bench-gather"])
    if args.command == "bench-matryoshka":
        from .bench import matryoshka as bench_matryoshka

        return bench_matryoshka.run(args, subs["bench-matryoshka"])
    if args.command == "bench-gist":
        from .bench import gist as bench_gist

        return bench_gist.run(args, subs["bench-gist"])
    if args.command == "bench-st-step":
        from .bench import st_step as bench_st_step

        return bench_st_step.run(args, subs["bench-st-step"])
    if args.command == "bench-maxsim":
        from .bench import maxsim_late as bench_maxsim

        return bench_maxsim.run(args, subs["bench-maxsim"])
    if args.command == "bench-gpu":
        from .bench import gpu as bench_gpu

        return bench_gpu.run_cli(args, subs["bench-gpu"])
    if args.command is None:
        parser.error(f"choose a sub-command: {', '.join(COMMANDS)}")
    return check(args, subs["check"])


if __name__ == "__main__":
    sys.exit(main())
