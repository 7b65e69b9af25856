"""The training-step matrix (tests/test_training_matrix.py) on the Triton routes a GPU takes, forced here: every cell's
one optimizer-free step of the tiny offline encoder with the triton backend (the CPU interpreter) on the fused kernels,
on the panel path in 4-row panels (cuBLAS tiles, and the epilogue GEMM's), and for the Matryoshka cells with the suffix
backward; fp32 and autocast bf16 in
one process, autocast bf16 under 2-rank gloo DDP. The matrix's default route on a CPU is the torch backend, so without
these the kernels' autograd plumbing (autocast's casts, the fp32 sums of their pieces, DDP's gathered batches, the
drop-ins' parameters) would only ever meet a real model on a GPU.

Truth and tolerance as in the matrix: the float64 textbook step on the global batch, THE accuracy rule against the
textbook's own error in the cell's precision. Each test also checks which kernels ran, so that a route that silently
fell back to another fails."""

from __future__ import annotations

import os
from unittest import mock

import pytest

pytest.importorskip("triton", reason="the test extra installs triton (pip install -e '.[test]')")

from _training_matrix import BY_NAME, CELLS, fresh, global_data, step, truth_and_same  # noqa: E402
from test_training_matrix import _assert_grads, ranks_agree, reported_cells  # noqa: E402

from fused_contrastive import routes  # noqa: E402

#: The switchboard of each forced route (FUSED_CONTRASTIVE_<name> in a child process).
ROUTES = {
    "fused": {"BACKEND": "triton", "DENSE": "0", "TRITON_PATH": "fused"},
    "panel": {"BACKEND": "triton", "DENSE": "0", "TRITON_PATH": "panel", "PANEL_ROWS": "4"},
    "epilogue": {"BACKEND": "triton", "DENSE": "0", "TRITON_PATH": "panel", "PANEL_ROWS": "4",
                 "PANEL_GEMM": "epilogue"},
    "suffix": {"BACKEND": "triton", "DENSE": "0", "TRITON_PATH": "fused", "MATRYOSHKA_ROUTE": "suffix"},
}
CELL_IDS = [c.name for c in CELLS]
MATRYOSHKA_CELLS = [c for c in CELL_IDS if "matryoshka" in c]
ONE_PROCESS = [(c, r) for r in ("fused", "panel", "epilogue") for c in CELL_IDS]
ONE_PROCESS += [(c, "suffix") for c in MATRYOSHKA_CELLS]


def _route_ran(route: str, names: set[str], cell: str, bf16: bool) -> None:
    """The kernels that ran are the forced route's: some Triton launch; none of the panel path's on the fused route;
    no fused log-sum-exp or Matryoshka backward on the panel path, and the epilogue GEMM on its route in 16 bits; the
    suffix kernel on the suffix route in 16 bits (fp32 takes the kernels' own backward there)."""
    assert names, f"{cell}/{route}: no Triton kernel ran"
    if route in ("fused", "suffix"):
        assert not {n for n in names if n.startswith(("panel_", "epi_"))}, (cell, route, names)
    if route in ("panel", "epilogue"):
        assert not {n for n in names if n.startswith(("lse_bwd", "mat_"))}, (cell, route, names)
    if route == "epilogue" and bf16 and "panel_rows" in names:
        # (the epilogue GEMM takes 16-bit operands, fp32 panels keep cuBLAS's tiles; SigLIP's and GIST's own forms)
        assert names & {"epi_gemm", "epi_gemm_siglip", "guided_epi"} and "panel_dl" not in names, (cell, route, names)
    if route == "suffix":
        assert ("mat_epi" if bf16 else "mat_bwd_rows") in names, (cell, route, names)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name,route", ONE_PROCESS, ids=[f"{c}-{r}" for c, r in ONE_PROCESS])
def test_one_process(name, route, precision, launches):
    cell, bf16 = BY_NAME[name], precision == "bf16"
    truth, same = truth_and_same(cell, bf16)
    model, mod = fresh(cell)
    launches.clear()
    with routes.override(**ROUTES[route]):
        got = step(cell, model, mod, global_data(cell), textbook=False, bf16=bf16)
    _route_ran(route, {x.name for x in launches}, name, bf16)
    _assert_grads(got, truth, same, bf16, f"{name}/{precision}/{route}")


def _spawn_route(route: str, store) -> dict[str, dict]:
    """{cell: {"grads": (rank 0's, rank 1's), "textbook": (...)} or {"error": text}}: every cell in one spawn of the
    matrix's DDP worker (bf16, plain encoding, ``test_training_matrix._spawn``), the route forced through the
    environment its ranks inherit."""
    from test_training_matrix import _spawn

    env = {f"FUSED_CONTRASTIVE_{k}": v for k, v in ROUTES[route].items()}
    with mock.patch.dict(os.environ, env):
        results = _spawn(CELL_IDS, "bf16", "plain", store)
    cells = reported_cells(results, CELL_IDS)
    # (the worker stops at the first failing cell: its traceback, for it and the cells not run after it)
    errs = "\n".join(f"rank {r['rank']} failed at {r['error'][0]}:\n{r['error'][1]}" for r in results if r["error"])
    return {name: cells.get(name, {"error": errs or "not reported"}) for name in CELL_IDS}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    cache: dict[str, dict] = {}

    def get(route: str) -> dict[str, dict]:
        if route not in cache:
            cache[route] = _spawn_route(route, tmp_path_factory.mktemp(f"ddp_{route}") / "store")
        return cache[route]
    return get


@pytest.mark.parametrize("route", ["fused", "panel"])
@pytest.mark.parametrize("name", CELL_IDS)
def test_ddp_two_ranks_bf16(name, route, ddp_runs):
    res = ddp_runs(route)[name]
    if "error" in res:
        pytest.fail(f"{name}/{route}/ddp: {res['error']}")
    truth, _ = truth_and_same(BY_NAME[name], True)
    g0 = ranks_agree(res, f"{name}/{route}")
    _assert_grads(g0, truth, res["textbook"][0], True, f"{name}/bf16/{route}/ddp")
