"""Every benchmark case of ``python -m fused_contrastive bench`` under pytest-benchmark.

Parameters come from ``fused_contrastive.bench.contenders.plan`` (see ``conftest.py`` for the options);
each benchmark times one mode of one (loss, contender, N) case bound by ``contenders.bind``, the same
code the CLI measures.
"""

from __future__ import annotations

import torch

from fused_contrastive.bench import contenders as C


def test_case(benchmark, planned: C.Planned, mode: str, bench_options: dict) -> None:
    p, o = planned, bench_options
    bound = C.bind(p.case, p.contender, p.n, o["dim"], o["dtype"], o["device"])
    benchmark.group = f"{p.case} N={p.n} D={o['dim']} {mode}"
    benchmark.extra_info.update(loss=p.case, contender=p.contender, n=p.n, dim=o["dim"], dtype=str(o["dtype"]),
                                mode=mode, inputs=bound.case.inputs, flops=bound.case.flops(p.n, o["dim"], mode),
                                device=str(o["device"]))

    def sync() -> None:
        if o["device"].type == "cuda":
            torch.cuda.synchronize(o["device"])

    def forward() -> None:
        bound.forward()
        sync()

    def step() -> None:
        bound.step()
        sync()

    def backward(loss) -> None:
        loss.backward()
        sync()

    def clear() -> None:
        bound.zero_grad()

    def fresh_forward():
        bound.zero_grad()
        return (bound.forward(),), {}

    target, setup = {"forward": (forward, clear), "backward": (backward, fresh_forward),
                     "forward+backward": (step, clear)}[mode]
    benchmark.pedantic(target, setup=setup, rounds=o["rounds"], warmup_rounds=1)
    if mode != "forward":
        assert all(g is not None for g in bound.inputs.grads()), "backward left an input without a gradient"
