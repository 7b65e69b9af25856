"""pytest-benchmark front end of the benchmark suite: ``pytest bench/ --benchmark-only``.

The cases (losses, contenders, inputs, skip rules) come from ``fused_contrastive.bench.contenders``,
the module behind ``python -m fused_contrastive bench``; this file only turns them into parameters.
pytest-benchmark measures time only (compare runs with ``--benchmark-save`` / ``--benchmark-compare``);
peak memory, differences and ratios are the CLI's job.

Options (all optional):
  --bench-losses info_nce,clip     losses (default all benchmark losses)
  --bench-sizes 128,1024           N, the number of anchors (default 128,1024; contenders whose memory
                                   estimate exceeds --bench-mem-gb are skipped)
  --bench-dim 768  --bench-dtype float32  --bench-device auto
  --bench-contenders torch,formula contenders (default all)
  --bench-modes forward,backward,forward+backward
  --bench-rounds 5                 timed rounds per benchmark (after 1 warm-up round)
  --bench-mem-gb 16 --bench-max-iter-seconds 10   the CLI's estimate-based skips (memory, time)
"""

from __future__ import annotations

import pytest
import torch

from fused_contrastive.bench import contenders as C


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("fused_contrastive bench")
    g.addoption("--bench-losses", default=",".join(C.BENCH_NAMES), help="comma-separated losses")
    g.addoption("--bench-sizes", default="128,1024", help="comma-separated N (anchors), default 128,1024")
    g.addoption("--bench-dim", type=int, default=768, help="embedding dimension D (default 768)")
    g.addoption("--bench-dtype", default="float32", choices=list(C.DTYPES))
    g.addoption("--bench-device", default="auto", help="auto (cuda if available), cpu or cuda[:i]")
    g.addoption("--bench-contenders", default="", help="comma-separated contender names (default all)")
    g.addoption("--bench-modes", default=",".join(C.MODES), help="comma-separated modes")
    g.addoption("--bench-rounds", type=int, default=5, help="timed rounds per benchmark (default 5)")
    g.addoption("--bench-mem-gb", type=float, default=16.0, help="memory cap for the estimate-based skips")
    g.addoption("--bench-max-iter-seconds", type=float, default=10.0,
                help="skip memory-bound seeds/peers whose step is predicted to take longer (default 10)")


def _csv(config: pytest.Config, name: str) -> list[str]:
    return [x for x in str(config.getoption(name)).split(",") if x]


def bench_device(config: pytest.Config) -> torch.device:
    dev = config.getoption("--bench-device")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if dev == "auto" else dev)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "planned" not in metafunc.fixturenames:
        return
    cfg = metafunc.config
    losses = _csv(cfg, "--bench-losses")
    unknown = [x for x in losses if x not in C.BENCH_NAMES]
    if unknown:
        raise pytest.UsageError(f"--bench-losses: unknown {unknown}; choose from {C.BENCH_NAMES}")
    modes = _csv(cfg, "--bench-modes")
    if any(m not in C.MODES for m in modes):
        raise pytest.UsageError(f"--bench-modes must be among {C.MODES}, got {modes}")
    wanted = set(_csv(cfg, "--bench-contenders"))
    params = C.plan(losses, [int(n) for n in _csv(cfg, "--bench-sizes")], cfg.getoption("--bench-dim"),
                    C.DTYPES[cfg.getoption("--bench-dtype")], bench_device(cfg),
                    mem_cap=cfg.getoption("--bench-mem-gb") * C.GiB,
                    max_iter_seconds=cfg.getoption("--bench-max-iter-seconds"))
    metafunc.parametrize(
        "planned",
        [pytest.param(p, id=p.id, marks=[pytest.mark.skip(reason=p.skip)] if p.skip else [])
         for p in params if not wanted or p.contender in wanted],
    )
    metafunc.parametrize("mode", modes)


@pytest.fixture(scope="session")
def bench_options(request: pytest.FixtureRequest) -> dict:
    cfg = request.config
    return {"dim": cfg.getoption("--bench-dim"), "dtype": C.DTYPES[cfg.getoption("--bench-dtype")],
            "device": bench_device(cfg), "rounds": cfg.getoption("--bench-rounds")}
