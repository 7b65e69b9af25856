"""What ``python -m fused_contrastive check``, the test-suite and the benchmark share, so they cannot
drift apart: THE case registry (``cases``), THE accuracy rule (``accuracy``) and THE seed / textbook /
peer formulas (``baselines``). Importing it imports nothing beyond torch and this package."""

from .accuracy import SLACK, Comparison, assert_close, compare, loss_and_grads, run
from .baselines import BASELINES, Baseline
from .cases import BENCH_CASES, CASE_BY_NAME, CASES, SHAPES, Case, get, make_inputs, shapes_for

__all__ = [
           "BASELINES",
           "BENCH_CASES",
           "CASES",
           "CASE_BY_NAME",
           "SHAPES",
           "SLACK",
           "Baseline",
           "Case",
           "Comparison",
           "assert_close",
           "compare",
           "get",
           "loss_and_grads",
           "make_inputs",
           "run",
           "shapes_for",
]
