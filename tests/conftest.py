"""Test-suite setup.

The Triton interpreter must be chosen before triton is first imported, so it is set here, before any
test module imports the package (CPU-only machines and CI have no GPU).

``path`` runs a test on both implementations of the torch backend: "dense" (the one-tile path every
test-sized problem takes by default) and "chunked" (``FUSED_CONTRASTIVE_DENSE=0`` with a small tile
budget, so the problem is split into many row chunks and symmetric blocks).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def set_path(monkeypatch, path: str, tile: int = 300) -> None:
    if path == "dense":
        monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "1")
        monkeypatch.delenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", raising=False)
    else:
        monkeypatch.setenv("FUSED_CONTRASTIVE_DENSE", "0")
        monkeypatch.setenv("FUSED_CONTRASTIVE_TILE_ELEMENTS", str(tile))


@pytest.fixture(params=["dense", "chunked"])
def path(request, monkeypatch):
    set_path(monkeypatch, request.param)
    return request.param


# The README's command deals the test files out to the workers one file at a time (--dist loadfile), by
# default largest test count first, so files with few but slow tests (the end-to-end benchmarks, the
# compile surveys, the C++ build) came last and one worker ran them while the other sat idle. The slowest
# files start first instead (longest first: seconds of test time in one 2-worker run of the whole suite,
# ``--durations=120``, summed per file and rounded), then the rest in xdist's own order.
SLOW_FILES = (
    ("test_triton_panel.py", 240), ("test_gpu_validate.py", 170), ("test_bench_cli.py", 150),
    ("test_epi_forms.py", 120), ("test_integration_sentence_transformers.py", 100), ("test_cmake_build.py", 100),
    ("test_compile.py", 90), ("test_gpu_model.py", 80), ("test_distributed.py", 70),
    ("test_triton_guided_panel.py", 70), ("test_packaging.py", 60), ("test_training_matrix.py", 50),
    ("test_triton_compile.py", 45), ("test_cli.py", 45), ("test_compile_guided.py", 40),
    ("test_epi_forms_compile.py", 40), ("test_gist.py", 35), ("test_matryoshka.py", 30),
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    files = [item.nodeid.split("::")[0] for item in items]
    count = {f: files.count(f) for f in set(files)}
    rank = {name: i for i, (name, _) in enumerate(SLOW_FILES)}

    def key(i: int) -> tuple:
        name = files[i].rsplit("/", 1)[-1]
        return (rank.get(name, len(rank)), -count[files[i]], files[i], i)

    items[:] = [items[i] for i in sorted(range(len(items)), key=key)]
