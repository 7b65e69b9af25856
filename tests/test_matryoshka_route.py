"""The Matryoshka route the code takes on the panel path (``core._leveled``: one plain core-op call per
level on the truncated rows, the caller's ``normalize`` kept, so the one-pass panel kernel normalises
them in fp32) is what ``bench/gpu_model.py`` costs (``run_triton`` of the plain loss at each level's
D): the same kernels with the same compile-time flags, level by level. Recorded on the meta device for
the H100's arch, nothing runs. Until 0.2 the route passed ``normalize=False`` on rows normalised in the
input dtype, which switched the one-pass kernel off while the model costed it."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from fused_contrastive import core, routes  # noqa: E402
from fused_contrastive.core.triton_shared import launch as TL  # noqa: E402
from fused_contrastive.tools import compile_survey  # noqa: E402

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def _gpu_model(monkeypatch):
    """``bench/gpu_model.py``, imported here, not at collection: it sets TRITON_INTERPRET=0 at import
    (the script compiles), which nothing else may see: a kernel module first imported meanwhile (the
    Matryoshka kernels, by the leveled call below) would be compiled, not interpreted, for the rest of the
    session. The session's value is put back at once (the recording below compiles nothing)."""
    prev = os.environ.get("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRITON_INTERPRET", prev)
    monkeypatch.syspath_prepend(BENCH)
    import gpu_model

    os.environ["TRITON_INTERPRET"] = prev
    return gpu_model


def _key(launch: TL.Launch) -> tuple:
    return launch.name, tuple(sorted((k, v) for k, v in launch.constexprs.items()))


def test_the_per_level_route_is_what_the_model_costs(monkeypatch, route):
    GM = _gpu_model(monkeypatch)
    n, d = 8192, 768
    gpu = GM.GPUS["H100"]
    dims = tuple(sorted(GM.matryoshka_dims(d)))
    model = [[_key(lz) for lz in GM.run_triton("info_nce", n, dk, gpu, "panel")[0]] for dk in dims]

    a, b, scale, spec, data, coef, reduce = compile_survey.core_call("info_nce", n, d, torch.bfloat16)
    route(TRITON_PATH="panel")
    route(COL_PARTIAL_PROGRAMS=2 * gpu.sms)
    route(PANEL_PROGRAMS=2 * gpu.sms)
    with compile_survey.recording(gpu.arch) as launches:
        out = core.run("triton", a, b, scale, spec, data, coef, reduce, levels=(dims, tuple(1.0 for _ in dims)))
        torch.autograd.grad(out.sum(), [a, b])
    code = [_key(lz) for lz in launches]
    want = [k for level in model for k in level]
    # the same launches (the order differs: autograd runs the levels' target-term backwards after every
    # level's forward, where the model records each level whole)
    assert Counter(code) == Counter(want), "the Matryoshka route and the model's per-level calls diverge"
    assert sum(name == "target_rows" for name, _ in code) == 2 * len(dims)
    # and the route is the one-pass tile on normalised rows at every level: the epilogue GEMM's one pass
    # (MODE 1) where CUDA takes it, the panel kernel's ONE_PASS on the cuBLAS form
    tiles = [dict(c) for name, c in code if name in ("panel_dl", "epi_gemm")]
    assert len(tiles) == len(dims), tiles
    assert all(c.get("NORMALIZE") and (c.get("ONE_PASS") or c.get("MODE") == 1) for c in tiles), tiles
    assert routes.setting("TRITON_PATH") == "panel"
