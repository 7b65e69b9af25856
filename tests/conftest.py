"""Test-suite setup. The Triton interpreter must be chosen before triton is first imported, so it is
set here, before any test module imports the package (CPU-only machines and CI have no GPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
