"""The README's "When to use it" table quotes committed results only: every time, peak and ratio in it is read
back here from the result file the row cites (``bench/results/``, the commands' unedited output), by a parser
of that file's own format written here, not by the code that wrote it.

Rules the README states and this file checks: a cell ``[form] T ms, P MiB|MB`` is the named contender's
forward+backward median time and peak (CPU peaks MiB = bytes / 2^20; bench-gpu's MB as recorded), rounded as
:func:`fmt_ms` / :func:`fmt_peak` do; a ratio cell ``Rx time, Sx peak`` is this library's value over the other's,
from the unrounded values; a row citing two files takes each contender from the first file that measured it. A
row that cites no file says "not measured yet" in every value cell. ``test_a_planted_edit_fails`` edits numbers
of a copy of the README and requires the checker to fail on each edit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- when-to-use table", "<!-- end of the when-to-use table"
MIB = 1 << 20
#: per result file kind: the contender names of this library and of the textbook column
OURS = {"bench.json": ("torch", "formula"), "bench_gist.json": ("fused", "textbook"),
        "bench_matryoshka.json": ("one-pass", "formula"), "bench_maxsim.json": ("ours", "materialised"),
        "bench_encode.txt": ("cached", "plain"), "bench_gpu.jsonl": ("fused_contrastive", "textbook"),
        "bench_st_step.txt": ("ours", None)}  # a sentence-transformers step: their class is the peer, no textbook
PENDING = "not measured yet"


def fmt_ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_peak(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.3f}x"


def measured(path: Path, loss: str, n: int, d: int | None, contender: str) -> tuple[float, float, str] | None:
    """(time ms, peak, unit) of ``contender`` at ``n`` (and ``d``) in the committed file, or None."""
    kind = path.name
    if kind == "bench.json":  # bench: rows per (loss, contender, N, mode); peaks in bytes
        for r in json.loads(path.read_text())["rows"]:
            if (r["loss"], r["n"], r["contender"], r["mode"], r["status"]) == (loss, n, contender,
                                                                                 "forward+backward", "ok"):
                return r["time_ms"], r["peak_bytes"] / MIB, "MiB"
    elif kind == "bench_gpu.jsonl":  # bench-gpu: a meta line, then a row per measurement; ms and MB
        for line in path.read_text().splitlines()[1:]:
            r = json.loads(line)
            if (r.get("loss"), r.get("n"), r.get("d"), r.get("contender"), r.get("status")) == (loss, n, d, contender,
                                                                                                 "ok"):
                return r["ms"], r["peak_mb"], "MB"
    elif kind in ("bench_gist.json", "bench_matryoshka.json", "bench_maxsim.json"):  # rows per N: seconds, bytes
        for r in json.loads(path.read_text())["rows"]:
            if r["n"] == n and r["median_s"].get(contender) is not None:
                return r["median_s"][contender] * 1e3, r["peak_bytes"][contender] / MIB, "MiB"
    elif kind == "bench_encode.txt":  # bench-encode's table: "step  time ms  peak MiB"; one batch per run
        batch = re.search(r"batch (\d+)", path.read_text())
        for line in path.read_text().splitlines():
            f = line.split()
            if batch and int(batch.group(1)) == n and len(f) == 3 and f[0] == contender:
                return float(f[1]), float(f[2]), "MiB"
    elif kind == "bench_st_step.txt":  # bench-st-step's table: loss, batch, st ms, ours ms, time x, st live MiB,
        # ours live MiB, ...; "peak" here is the step's live tensor bytes (3 significant digits as printed)
        for line in path.read_text().splitlines():
            f = line.split()
            if len(f) == 11 and f[0] == loss and f[1] == str(n) and contender in ("ours", "sentence-transformers"):
                ms, live = (f[3], f[6]) if contender == "ours" else (f[2], f[5])
                return float(ms), float(live), "MiB"
    else:
        raise AssertionError(f"no parser for {path.name}")
    return None


def table_rows(readme: str) -> list[list[str]]:
    block = readme[readme.index(BEGIN):readme.index(END)].splitlines()[1:]
    assert block[0].startswith("| loss, setting | N | this library | textbook formula | this library / textbook |")
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block[2:] if line.startswith("|")]


CELL = re.compile(r"^(?:(?P<peer>[\w+.\-]+): )?(?:\[(?P<form>[^\]]+)\] )?(?P<ms>[\d.]+) ms, (?P<peak>[\d.]+) "
                  r"(?P<unit>MiB|MB)$")
RATIO = re.compile(r"^(?P<t>[\d.]+x) time, (?P<p>[\d.]+x) peak$")


def check(readme: str) -> list[str]:
    """Every disagreement between the README's table and the files it cites (empty: all agree)."""
    bad: list[str] = []
    rows = table_rows(readme)
    if len(rows) < 15:
        bad.append(f"only {len(rows)} rows")
    for row in rows:
        bad += _check_row(row)
    return bad


def _check_row(row: list[str]) -> list[str]:
    bad: list[str] = []
    where = " | ".join(row[:2])
    if len(row) != 8:
        return [f"{where}: {len(row)} cells"]
    setting, n, ours, text, r_text, peer, r_peer, source = row
    files = re.findall(r"\]\((bench/results/[^)]+)\)", source)
    if not files:  # a row waiting for a run: no number in its value cells
        if any(c != PENDING for c in (ours, text, r_text, peer, r_peer)):
            bad.append(f"{where}: cites no committed file, so its cells must say {PENDING!r}")
        return bad
    paths = [ROOT / f for f in files]
    loss = re.match(r"`([\w-]+)`", setting)
    d = re.search(r"\bD = (\d+)", setting)
    kind = paths[0].name
    if not loss or not n.isdigit() or kind not in OURS or any(p.name != kind for p in paths):
        return [f"{where}: no loss key, no N or sources of another kind ({files})"]
    n_, d_ = int(n), (int(d.group(1)) if d else None)

    def value(cell: str, default: str, role: str):
        m = CELL.match(cell)
        if not m:
            bad.append(f"{where}: {role} cell {cell!r} is not 'T ms, P unit'")
            return None
        name = f"{default}[{m['form']}]" if m["form"] else (m["peer"] or default)
        got = next((v for p in paths if (v := measured(p, loss.group(1), n_, d_, name))), None)
        if got is None:
            bad.append(f"{where}: {name} has no measurement at N = {n_} in {files}")
            return None
        want = f"{fmt_ms(got[0])} ms, {fmt_peak(got[1])} {got[2]}"
        if f"{m['ms']} ms, {m['peak']} {m['unit']}" != want:
            bad.append(f"{where}: {role} says {cell!r}, {files} has {want}")
        return got

    def ratio(cell: str, a, b, role: str) -> None:
        m = RATIO.match(cell)
        if not m:
            bad.append(f"{where}: {role} ratio {cell!r}")
        elif a and b and (m["t"], m["p"]) != (fmt_ratio(a[0] / b[0]), fmt_ratio(a[1] / b[1])):
            bad.append(f"{where}: {role} ratio {cell!r}, the file gives {fmt_ratio(a[0] / b[0])} time, "
                       f"{fmt_ratio(a[1] / b[1])} peak")

    ours_name, text_name = OURS[kind]
    a = value(ours, ours_name, "this library")
    if text_name is None:  # no textbook in this kind of run: both cells say so
        if (text, r_text) != ("-", "-"):
            bad.append(f"{where}: {files} has no textbook, so its cells must be '-'")
    else:
        ratio(r_text, a, value(text, text_name, "textbook"), "textbook")
    if (peer == "-") != (r_peer == "-"):
        bad.append(f"{where}: a peer without its ratio or the reverse")
    elif peer != "-":
        if not CELL.match(peer) or not CELL.match(peer)["peer"]:
            bad.append(f"{where}: the peer cell {peer!r} does not name the peer")
        else:
            ratio(r_peer, a, value(peer, "", "peer"), "peer")
    return bad


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_table_is_the_committed_results():
    assert check(_readme()) == []


def test_the_table_covers_cpu_gpu_peers_and_where_it_does_not_help():
    rows = table_rows(_readme())
    cited = {f for r in rows for f in re.findall(r"\]\((bench/results/[^)]+)\)", r[-1])}
    assert {"bench/results/cpu-2core-default/bench.json", "bench/results/h200-bench-gpu-2/bench_gpu.jsonl"} <= cited
    assert all((ROOT / f).is_file() for f in cited)
    slower = [r for r in rows if RATIO.match(r[4]) and float(RATIO.match(r[4])["t"][:-1]) > 1]
    assert any("H200" in r[0] for r in slower) and any("CPU" in r[0] for r in slower)  # where it does not help
    assert any("siglip-kernel" in r[5] and float(RATIO.match(r[6])["t"][:-1]) > 1 for r in rows)


def largest_batch_problems(readme: str) -> list[str]:
    """The README's extrapolated largest InfoNCE batch against the committed run's ``largest_batch`` entries."""
    m = re.search(r"The largest InfoNCE batch within (\d+) GiB .*?\s+peaks at N = ([\d, and]+): (\d+) for this\s+"
                  r"library against (\d+) for the textbook formula", readme, re.DOTALL)
    if not m:
        return ["no largest-batch sentence"]
    run = json.loads((ROOT / "bench/results/cpu-2core-default/bench.json").read_text())
    by = {e["contender"]: e for e in run["largest_batch"] if e["loss"] == "info_nce"}
    fit = [int(x) for x in re.findall(r"\d+", m[2])]
    want = (run["meta"]["mem_budget_bytes"] / 2**30, by["torch"]["fit_n"], by["torch"]["n_max"], by["formula"]["n_max"])
    got = (int(m[1]), fit, int(m[3]), int(m[4]))
    return [] if got == want and by["formula"]["fit_n"] == fit else [f"README {got}, the run {want}"]


def test_the_largest_batch_is_the_committed_runs():
    assert largest_batch_problems(_readme()) == []
    planted = _readme().replace("614077 for this library", "614078 for this library")
    assert largest_batch_problems(planted)


@pytest.mark.parametrize("edit", [
    ("| 2666 ms, 189 MiB |", "| 2666 ms, 188 MiB |"),  # a peak
    ("| 2666 ms, 189 MiB |", "| 2667 ms, 189 MiB |"),  # a time
    ("| 0.91x time, 0.23x peak |", "| 0.91x time, 0.22x peak |"),  # a ratio
    ("| 1.51x time, 0.44x peak |", "| 0.66x time, 2.26x peak |"),  # a ratio the other way round (peer / ours)
    ("memeff: 2.02 ms, 50 MB", "memeff: 2.03 ms, 50 MB"),  # a peer's time
    ("| [tile=2^24] 2.77 ms, 252 MB |", "| 3.39 ms, 71 MB |"),  # the default before the route changed
    ("| 65536 | 44.3 ms, 660 MB | 75.2 ms, 42951 MB |", "| 16384 | 44.3 ms, 660 MB | 75.2 ms, 42951 MB |"),  # N
    ("| 4096 | 14117 ms, 18 MiB |", "| 4096 | 14117 ms, 17 MiB |"),  # a cached drop-in's live bytes
    ("sentence-transformers: 8508 ms, 29 MiB | 0.86x time, 0.41x peak", "sentence-transformers: 8508 ms, 29 MiB | "
     "0.86x time, 0.40x peak"),  # its ratio to theirs
])
def test_a_planted_edit_fails(edit):
    old, new = edit
    text = _readme()
    assert old in text, old
    planted = text.replace(old, new, 1)
    assert check(planted), f"the checker passed the edit {old!r} -> {new!r}"


def test_a_pending_row_with_a_number_fails():
    # a row waiting for a run (it cites no file) passes with every value cell pending, and fails with a number
    row = f"| `gist` CPU | 2048 | {' | '.join([PENDING] * 5)} | `bench-gist` (no run yet) |\n"
    text = _readme().replace(END, row + END, 1)
    assert check(text) == []
    planted = text.replace(row, row.replace(PENDING, "52.9 MiB", 1), 1)
    assert any("must say" in b for b in check(planted))
