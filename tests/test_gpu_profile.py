"""``bench/gpu_profile.py`` (a CUDA-only measurement script) wired as its labels say, checked on the CPU
under the Triton interpreter: the two SigLIP forms it times side by side run the one pass (MODE 5) and
the two sweeps (MODE 4, then MODE 4 with the upstream gradients), with the same loss value; each mode's
list of configurations starts with the shipped one and names the loss that runs that mode; the Matryoshka
timing runs its kernels with the 16-byte loads and with the scalar ones, to the same gradients."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fused_contrastive.core.triton_shared import configs as CFG
from fused_contrastive.core.triton_shared import launch as TL

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "bench" / "gpu_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def profile_mod():
    return _load()


def test_config_lists_start_with_the_shipped_configuration(profile_mod):
    assert set(profile_mod.CONFIGS) == set(profile_mod.MODE_LOSS)
    for mode, cfgs in profile_mod.CONFIGS.items():
        assert cfgs[0] == CFG.EPI_GEMM[mode], mode
        assert len(set(cfgs)) == len(cfgs), mode  # each timed once


def test_siglip_forms_run_the_one_pass_and_the_two_sweeps(profile_mod, monkeypatch, route):
    route(DENSE="0")  # small N: not the one-tile path
    seen = []
    orig = TL._launch
    monkeypatch.setattr(TL, "_launch", lambda x: (seen.append(x), orig(x))[1])
    losses = {}
    for per_row, want in ((False, [(5, True)]), (True, [(4, False), (4, True)])):
        seen.clear()
        step = profile_mod._setup("siglip", 48, 16, torch.bfloat16, device="cpu", per_row=per_row)
        with profile_mod.triton_path("panel"):
            step()
        assert [(x.constexprs["MODE"], x.constexprs["HAS_G"]) for x in seen if x.name == "epi_gemm_siglip"] == want
        losses[per_row] = torch.cat([x.args["ZP"].sum(1) for x in seen if x.name == "epi_gemm_siglip"
                                     and (x.constexprs["MODE"] == 5 or not x.constexprs["HAS_G"])])
    # the same per-image losses (the forms' products and softplus are the same code)
    torch.testing.assert_close(losses[False], losses[True], rtol=0, atol=0)


def test_matryoshka_loads_time_the_aligned_and_the_scalar_form(profile_mod, monkeypatch):
    # --matryoshka-loads: the same Matryoshka kernels with ALIGNED on (the code's choice for boundaries that
    # are multiples of 16) and forced off, the same loss and gradients (the hint changes no arithmetic)
    seen = []
    orig = TL._launch
    monkeypatch.setattr(TL, "_launch", lambda x: (seen.append(x), orig(x))[1])
    got = {}
    assert [(r, on) for _, r, on in profile_mod.MATRYOSHKA_FORMS] == [("kernels", True), ("kernels", False),
                                                                      ("suffix", True)]
    for label, route, on in profile_mod.MATRYOSHKA_FORMS:
        seen.clear()
        step = profile_mod._matryoshka_setup(40, 192, device="cpu")  # levels 192/128/64/32/16
        with profile_mod.matryoshka_route(route), profile_mod.matryoshka_aligned(on):
            step()
        mats = [x for x in seen if x.name.startswith("mat_")]
        bwd = {"mat_bwd_rows", "mat_bwd_cols"} if route == "kernels" else {"mat_epi"}
        assert {x.name for x in mats} == {"mat_fwd"} | bwd, label
        assert {x.constexprs["ALIGNED"] for x in mats} == {on}
        got[label] = torch.cat([t.grad.float().flatten() for t in step.leaves])
    torch.testing.assert_close(got["16-byte loads"], got["scalar loads"], rtol=0, atol=0)
    # the suffix backward: the same gradients up to its bf16 roundings (not the same arithmetic)
    ref = got["16-byte loads"]
    assert 0 < float((got["suffix backward"] - ref).abs().max() / ref.abs().max()) < 2e-2


def test_epi_forms_time_the_three_tile_loops(profile_mod, monkeypatch, capsys, route):
    # --epi-forms: each form of the epilogue GEMM's tile loop runs (the launches say which), and the printed
    # verdict compares its gradients with the tiles form's (the kernels are the same code: bitwise equal)

    route(DENSE="0")
    route(PANEL_ROWS=40)
    # (no timing on the CPU: each form's one compiling step is what the verdict compares)
    monkeypatch.setattr(profile_mod, "_timer", lambda dev: lambda step: 1.0)
    monkeypatch.setattr(profile_mod, "_kernel_ms", lambda step: {"epi_gemm_kernel": 0.5})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seen = []
    orig = TL._launch
    monkeypatch.setattr(TL, "_launch", lambda x: (seen.append(x), orig(x))[1])
    profile_mod.time_epi_forms("info_nce", 97, 32, 1, device="cpu")
    forms = {(x.constexprs["PERSIST"], x.constexprs["TMA"]) for x in seen if x.name == "epi_gemm"}
    assert forms == {(False, False), (True, False), (True, True)}
    out = capsys.readouterr().out
    assert out.count("bitwise equal") == 3, out
