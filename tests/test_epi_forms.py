"""The epilogue GEMM's tile-loop forms (``panels.EPI_FORMS``, env ``FUSED_CONTRASTIVE_EPI_FORM``;
``kernels/panel.py`` ``epi_gemm_kernel`` PERSIST / TMA): one program per tile (the default), a persistent
grid walking the tiles in one flattened loop, and the persistent grid with TMA operand tiles.

Under the CPU interpreter (conftest.py) with small tiles (16 x 32, 32-wide D steps; D = 72 is not a multiple
of them) and 3 programs, so every program walks several tiles of a ragged grid: every mode the persistent
forms take (the one pass and its split target column, the statistics forward, known statistics, the
triangular sweep, SigLIP's one pass and its losses sweep) gives outputs bitwise equal to the tiles form's
(the same products in the same order, the same epilogue), and the loss and gradients against float64
(THE accuracy rule). tests/test_epi_forms_compile.py lowers every persistent launch for sm_80 / sm_90."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs triton
    pytest.skip("triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

from triton.tools.tensor_descriptor import TensorDescriptor

import fused_contrastive as fc
from fused_contrastive.core.lse import triton_panel
from fused_contrastive.core.triton_shared import launch as TL
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.core.triton_shared.configs import LaunchConfig
from fused_contrastive.testing import CASE_BY_NAME, compare

SMALL = LaunchConfig(16, 32, 32, 4, 2)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch, route):
    """The panel path's epilogue GEMM in 40-row panels of 16 x 32 tiles, outputs poisoned with NaN."""
    route(DENSE="0")
    route(TRITON_PATH="panel")
    route(PANEL_GEMM="epilogue")
    route(PANEL_ROWS=40)
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)
    for name in list(triton_panel.EPI_GEMM):
        monkeypatch.setitem(triton_panel.EPI_GEMM, name, SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@contextlib.contextmanager
def _launches():
    """Every Triton launch made inside, recorded while it still runs."""
    seen = []
    orig = TL._launch

    def launch(x):
        seen.append(x)
        orig(x)

    TL._launch = launch
    try:
        yield seen
    finally:
        TL._launch = orig


def _run(loss: str, dtype=torch.bfloat16, n: int = 97, d: int = 72):
    """Loss and gradients of one fwd + bwd, and the epilogue GEMM launches it made."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    with _launches() as seen:
        if loss == "info_nce":
            out = fc.info_nce(q, k, torch.arange(n), backend="triton")
        elif loss == "clip":
            out = fc.clip_loss(q, k, 10.0, backend="triton")
        elif loss == "simcse":  # interleaved pairs, B is A: the triangular sweep (statistics, known statistics)
            out = fc.simcse_loss(q[: n - n % 2], backend="triton")
        elif loss == "siglip":
            out = fc.siglip_loss(q, k, torch.tensor(5.0), torch.tensor(-2.0), backend="triton")
        else:  # per-row SigLIP losses: the losses sweep (MODE 4), then the gradient sweep (tiles form)
            out = fc.siglip_loss(q, k, torch.tensor(5.0), torch.tensor(-2.0), reduction="none",
                                 backend="triton").sum()
        out.backward()
    outs = [t for t in (out.detach(), q.grad, k.grad) if t is not None]
    return outs, [x for x in seen if x.name.startswith("epi_gemm")]


LOSSES = {"info_nce": {1}, "clip": {0, 3}, "simcse": {0, 3}, "siglip": {5}, "siglip_rows": {4}}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_forms_equal_the_tiles_form_bitwise(loss, monkeypatch):
    monkeypatch.setenv(panels.EPI_FORM_ENV, "tiles")
    want, tiles = _run(loss)
    assert max(x.grid[0] for x in tiles) > 3  # programs that walk several tiles below
    for form in ("persistent", "tma"):
        monkeypatch.setenv(panels.EPI_FORM_ENV, form)
        got, launches = _run(loss)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (loss, form, float((a.float() - b.float()).abs().max()))
        persistent = [x for x in launches if x.constexprs["PERSIST"]]
        # (CLIP's split statistics forward keeps the tiles form where TMA is asked: its TMA compile spilled on sm_90,
        # configs.EPI_PERSIST_STAGES["stats_split"])
        kept = {("epi_gemm_stats", 3, False)} if (loss, form) == ("clip", "tma") else set()
        assert {x.constexprs["MODE"] for x in persistent} == LOSSES[loss] - {m for _, m, _ in kept}, [
            x.name for x in launches]
        assert all(x.grid[0] <= 3 and x.constexprs["TMA"] == (form == "tma") for x in persistent)
        assert max(x.grid[0] for x in persistent) == 3  # EPI_PROGRAMS on the interpreter (a panel may have fewer)
        assert all(isinstance(x.args["X"], TensorDescriptor) == (form == "tma") for x in persistent)
        # the tiles form stays where the persistent compile spilled (SigLIP's gradient sweep for per-row
        # losses) and for the one pass's redo (MODE 2)
        rest = {(x.name, x.constexprs["MODE"], x.constexprs["HAS_G"]) for x in launches
                if not x.constexprs["PERSIST"]}
        tiles_kept = {("epi_gemm_redo", 2, False), ("epi_gemm_redo", 2, True), ("epi_gemm_siglip", 4, True)}
        assert rest <= tiles_kept | kept, rest
        assert all(x.constexprs["TMA"] is False for x in launches if not x.constexprs["PERSIST"])


def _gist(gdt):
    """GISTEmbed's loss and gradients on the guided blocks' epilogue GEMM (40-row panels of 16 x 32 tiles),
    and its guided_epi launches."""
    from fused_contrastive import routes
    from fused_contrastive.losses.guided import gist_loss

    g = torch.Generator().manual_seed(1)
    a, p, n = (torch.randn(r, 72, generator=g).bfloat16().requires_grad_() for r in (97, 97, 83))
    guides = tuple(torch.randn(r, 21, generator=g).to(gdt) for r in (97, 97, 83))
    with routes.override(GUIDED_PANEL_ROWS=40), _launches() as seen:
        loss = gist_loss(a, p, n, guide=guides, temperature=0.05, backend="triton")
        loss.backward()
    return [loss.detach(), a.grad, p.grad, n.grad], [x for x in seen if x.name.startswith("guided_epi")]


@pytest.mark.parametrize("gdt, form", [(torch.bfloat16, "persistent"), (torch.float32, "tma")],
                         ids=["bf16-guides-persistent", "fp32-guides-tma"])
def test_guided_persistent_form_equals_the_tiles_form_bitwise(gdt, form, monkeypatch):
    # the guided blocks' epilogue GEMM (GIST's four blocks, its split target block): "persistent" and "tma"
    # both run its persistent form (no descriptors for the guides), bitwise the tiles form's results
    from fused_contrastive.core.guided import triton_panel as TGP

    for name in list(TGP.GUIDED_EPI):
        monkeypatch.setitem(TGP.GUIDED_EPI, name, SMALL)
    # every block persistent here (the interpreter runs sm_80's table, where some keep the tiles form: the
    # compile test below checks that table)
    for key in list(TGP.GUIDED_PERSIST_STAGES):
        monkeypatch.setitem(TGP.GUIDED_PERSIST_STAGES, key, 2)
    monkeypatch.setenv(panels.EPI_FORM_ENV, "tiles")
    want, tiles = _gist(gdt)
    assert max(x.grid[0] for x in tiles if x.name == "guided_epi") > 3
    monkeypatch.setenv(panels.EPI_FORM_ENV, form)
    got, launches = _gist(gdt)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (form, float((a.float() - b.float()).abs().max()))
    epi = [x for x in launches if x.name == "guided_epi"]
    assert epi and all(x.constexprs["PERSIST"] and x.grid[0] <= 3 for x in epi), [x.grid for x in epi]
    assert not any(x.constexprs["PERSIST"] for x in launches if x.name == "guided_epi_redo")


@pytest.mark.parametrize("name, form", [("info_nce", "persistent"), ("clip_scale", "tma")])
def test_forms_against_float64(name, form, monkeypatch):
    monkeypatch.setenv(panels.EPI_FORM_ENV, form)
    c = compare(CASE_BY_NAME[name], 97, 72, torch.bfloat16, "triton", canary=True)
    assert c.ok, c


def test_tma_needs_aligned_rows_and_the_env_is_checked(monkeypatch):
    # D = 13 in bf16: 26-byte rows, which TMA cannot copy: the persistent form with cp.async copies instead
    monkeypatch.setenv(panels.EPI_FORM_ENV, "tma")
    got, launches = _run("info_nce", d=13)
    assert {(x.constexprs["PERSIST"], x.constexprs["TMA"]) for x in launches if x.name == "epi_gemm"} == {
        (True, False)}
    monkeypatch.setenv(panels.EPI_FORM_ENV, "tiles")
    want, _ = _run("info_nce", d=13)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.setenv(panels.EPI_FORM_ENV, "warp")
    with pytest.raises(ValueError, match=panels.EPI_FORM_ENV):
        _run("info_nce")


def _redo_run():
    """InfoNCE in bf16 at |s| = 100 with rows 32-63 pointing away from every key: the one pass (MODE 1) and its redo
    (MODE 2) of those rows (tests/test_triton_panel.py's test_epilogue_gemm_one_pass_redo), a learned temperature."""
    g = torch.Generator().manual_seed(0)
    n, m, d = 64, 80, 72
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    k = (u + 0.2 * torch.randn(m, d, generator=g) / d ** 0.5).bfloat16().requires_grad_()
    q = torch.cat([k[:32].detach().float() + 0.05 * torch.randn(32, d, generator=g) / d ** 0.5,
                   -u + 0.2 * torch.randn(32, d, generator=g) / d ** 0.5]).bfloat16().requires_grad_()
    t = torch.tensor(0.01, requires_grad=True)
    with _launches() as seen:
        out = fc.info_nce(q, k, torch.arange(n), temperature=t, backend="triton")
        out.backward()
    return [out.detach(), q.grad, k.grad, t.grad], [x for x in seen if x.name.startswith("epi_gemm")]


HOIST_LOSSES = {"info_nce": {1, 2}, "clip": {0}, "simcse": {0}, "redo": {1, 2}}  # (the redo launch returns at once
# without a row to redo)


@pytest.mark.parametrize("form", ["tiles", "persistent"])
@pytest.mark.parametrize("loss", list(HOIST_LOSSES))
def test_hoisted_loads_equal_the_current_kernel_bitwise(loss, form, monkeypatch, route):
    # EPI_HOIST (epi_gemm_kernel's HOIST): the per-row loads before the products' loop, issued once; the same
    # values through the same operations, so every output is bitwise the current kernel's (MODE 0 with the
    # target split out and the triangular sweep's SYM / TRI, MODE 1 with it, MODE 2's redo)
    monkeypatch.setenv(panels.EPI_FORM_ENV, form)
    runs = []
    for hoist in ("0", "1"):
        route(EPI_HOIST=hoist)
        runs.append(_redo_run() if loss == "redo" else _run(loss))
    (want, off), (got, on) = runs
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (loss, form, float((a.float() - b.float()).abs().max()))
    modes = {x.constexprs["MODE"] for x in on if x.constexprs["HOIST"]}
    assert modes == HOIST_LOSSES[loss], [(x.name, x.constexprs["MODE"], x.constexprs["HOIST"]) for x in on]
    assert not any(x.constexprs["HOIST"] for x in off)
    assert not any(x.constexprs["HOIST"] for x in on if x.constexprs["MODE"] > 2)  # (the statistics forward)
    if loss == "redo":
        assert sum(int(x.args["BAD"].sum()) for x in on if x.constexprs["MODE"] == 2) == 32
