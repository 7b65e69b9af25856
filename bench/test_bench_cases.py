"""Every benchmark case of ``python -m fused_contrastive bench`` under pytest-benchmark.

Parameters come from :func:`fused_contrastive.bench.plan_params` (see ``conftest.py`` for the options);
each benchmark times one mode of one (loss, contender, N) case built by
:func:`fused_contrastive.bench.build_case`, the same code the CLI measures.
"""

from __future__ import annotations

from fused_contrastive import bench as B


def test_case(benchmark, bench_param: B.BenchParam, mode: str, bench_options: dict) -> None:
    p, o = bench_param, bench_options
    case = B.build_case(p.loss, p.contender, p.n, o["dim"], o["dtype"], o["device"])
    spec = B.LOSSES[p.loss]
    benchmark.group = f"{p.loss} N={p.n} D={o['dim']} {mode}"
    benchmark.extra_info.update(
        loss=p.loss, contender=p.contender, n=p.n, dim=o["dim"], dtype=str(o["dtype"]), mode=mode,
        inputs=spec.inputs, flops=spec.flops(p.n, o["dim"], mode), device=str(o["device"]),
    )
    target, setup = B.benchmark_call(case, mode)
    benchmark.pedantic(target, setup=setup, rounds=o["rounds"], warmup_rounds=1)
    if mode != "forward":
        assert all(g is not None for g in case.inputs.grads()), "backward left an input without a gradient"
