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
