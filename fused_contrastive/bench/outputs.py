"""What the single-loss benchmarks (``bench-gist``, ``bench-matryoshka``, ``bench-maxsim``) share around
their measurement: the ``--sizes`` argument and the report they print and write."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def sizes_arg(parser: argparse.ArgumentParser, text: str, low: int = 2) -> list[int]:
    """``--sizes`` as comma-separated integers, each at least ``low`` (``parser.error`` otherwise)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error("--sizes must be comma-separated integers")
    if not sizes or min(sizes) < low:
        parser.error(f"--sizes must hold integers >= {low}")
    return sizes


def publish(text: str, res: dict[str, Any], out: str | None, stem: str) -> None:
    """Print the report; with ``out``, also write it to ``out/stem.txt`` and the measurements to
    ``out/stem.json`` (the directory is created)."""
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{stem}.txt"), "w") as fh:
            fh.write(text + "\n")
        with open(os.path.join(out, f"{stem}.json"), "w") as fh:
            json.dump(res, fh, indent=1)
