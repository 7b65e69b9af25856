"""The benchmark suite (``python -m fused_contrastive bench``), one module per job:

* ``contenders.py``: cases and contenders (this library's backends and ``testing.baselines``), their
  inputs, availability and static skip rules;
* ``harness.py``: the memory and timing passes, fresh processes, the cost model behind the ETA, the
  suite loop;
* ``memory.py``: peak memory meters (CPU peak RSS in a fresh process, CUDA allocator);
* ``report.py``: rows, ratios, the largest-batch fit, the tables, JSON and plots;
* ``cli.py``: the command line.

The same cases run under pytest-benchmark with ``pytest bench/ --benchmark-only``.
"""

from .cli import main

__all__ = ["main"]
