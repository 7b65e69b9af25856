"""fused_contrastive.integrations.open_clip against open_clip's own ClipLoss / SigLipLoss in float64:
value and every gradient (features, logit_scale, logit_bias), one process and 2 ranks on gloo.

``import open_clip`` imports torchvision (whose only build for this torch cannot load here), so open_clip's
``loss.py``, which imports only torch, is loaded by file path from the installed package."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fused_contrastive.integrations import open_clip as fo
from tests._peers import open_clip_loss
from tests._ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]


OC = open_clip_loss()
needs_peer = pytest.mark.skipif(OC is None, reason="open-clip-torch is not installed "
                                "(pip install --no-deps open-clip-torch)")


def _inputs(n, d=12, seed=0, unit=True):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=g, dtype=torch.float64)
    txt = img + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)
    if unit:
        img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    scale = torch.tensor(10.0, dtype=torch.float64)
    bias = torch.tensor(-3.0, dtype=torch.float64)
    return img, txt, scale, bias


def _value_and_grads(loss_fn, leaves, *, output_dict=False):
    xs = [x.clone().requires_grad_(True) for x in leaves]
    out = loss_fn(*xs)
    loss = out["contrastive_loss"] if output_dict else out
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return loss.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@needs_peer
@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("output_dict", [False, True])
@pytest.mark.parametrize("unit", [True, False])
def test_clip_loss_matches_open_clip(n, with_bias, output_dict, unit):
    img, txt, s, b = _inputs(n, seed=n, unit=unit)
    ours, theirs = fo.ClipLoss(cache_labels=True), OC.ClipLoss(cache_labels=True)
    for _ in range(2):  # a second call goes through open_clip's label cache
        if with_bias:
            got = _value_and_grads(lambda *a: ours(*a, output_dict=output_dict), [img, txt, s, b],
                                   output_dict=output_dict)
            want = _value_and_grads(lambda *a: theirs(*a, output_dict=output_dict), [img, txt, s, b],
                                    output_dict=output_dict)
        else:
            got = _value_and_grads(lambda *a: ours(*a, output_dict=output_dict), [img, txt, s], output_dict=output_dict)
            want = _value_and_grads(lambda *a: theirs(*a, output_dict=output_dict), [img, txt, s],
                                    output_dict=output_dict)
        _close(got[0], want[0])
        for g, w in zip(got[1], want[1], strict=True):
            _close(g, w)
    if with_bias:  # a bias on every logit cancels in the softmax: exactly 0 here
        assert got[1][3].item() == 0.0


@needs_peer
@pytest.mark.parametrize("n", [1, 3, 17, 40])
@pytest.mark.parametrize("bias", ["tensor", "float", "none"])
@pytest.mark.parametrize("unit", [True, False])
def test_siglip_loss_matches_open_clip(n, bias, unit):
    img, txt, s, b = _inputs(n, seed=100 + n, unit=unit)
    ours, theirs = fo.SigLipLoss(), OC.SigLipLoss()
    if bias == "tensor":
        got = _value_and_grads(ours, [img, txt, s, b])
        want = _value_and_grads(theirs, [img, txt, s, b])
    else:
        bv = -2.5 if bias == "float" else None
        got = _value_and_grads(lambda i, t, sc: ours(i, t, sc, bv), [img, txt, s])
        want = _value_and_grads(lambda i, t, sc: theirs(i, t, sc, bv), [img, txt, s])
    _close(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        _close(g, w)
    out = ours(img, txt, s, b, output_dict=True)
    assert set(out) == {"contrastive_loss"}
    _close(out["contrastive_loss"], want[0] if bias == "tensor" else theirs(img, txt, s, b))


def _dist_worker(rank: int, world: int, init: str, n: int, out) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        oc = open_clip_loss()
        img, txt, s, b = _inputs(n * world, seed=7)
        sl = slice(rank * n, (rank + 1) * n)
        local = [img[sl], txt[sl], s, b]
        res = {"rank": rank, "cases": {}}
        cases = [(f"clip local={ll} grad={gg}",
                  fo.ClipLoss(local_loss=ll, gather_with_grad=gg, rank=rank, world_size=world),
                  oc.ClipLoss(local_loss=ll, gather_with_grad=gg, rank=rank, world_size=world))
                 for ll in (False, True) for gg in (False, True)]
        cases += [(f"siglip {impl}", fo.SigLipLoss(rank=rank, world_size=world, dist_impl=impl),
                   oc.SigLipLoss(rank=rank, world_size=world, dist_impl=impl))
                  for impl in (None, "bidir", "shift", "reduce", "gather")]
        # a non-positive logit_scale (open_clip takes any): open_clip's formula, gathered the same way
        for sv, tag in ((s, ""), (torch.tensor(-1.5, dtype=torch.float64), " scale<0")):
            for name, ours, theirs in cases:
                args = [local[0], local[1], sv, local[3]]
                got = _value_and_grads(ours, args)
                want = _value_and_grads(theirs, args)
                errs = [float((got[0] - want[0]).abs())] + [float((g - w).abs().max())
                                                            for g, w in zip(got[1], want[1], strict=True)]
                scale = [float(want[0].abs())] + [float(w.abs().max()) for w in want[1]]
                res["cases"][name + tag] = (errs, scale)
        out.put(res)
    except Exception:  # noqa: BLE001 - reported: the parent fails at once instead of waiting for a hang
        import traceback

        out.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        dist.destroy_process_group()


@needs_peer
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_options_match_open_clip(world, tmp_path):
    results = run_ranks(_dist_worker, world, tmp_path, 4, timeout=150)
    for r in results:
        assert len(r["cases"]) == 18
        for name, (errs, scale) in r["cases"].items():
            for e, m in zip(errs, scale, strict=True):
                assert e <= 1e-10 * max(m, 1.0), (r["rank"], name, errs)


@needs_peer
@pytest.mark.parametrize("scale", [0.0, "neg_tensor"])
@pytest.mark.parametrize("cls", ["ClipLoss", "SigLipLoss"])
def test_non_positive_logit_scale_runs_open_clips_formula(cls, scale):
    """open_clip takes any logit_scale; the fused losses need > 0, so the drop-in computes open_clip's
    formula there (same value and gradients, the scale's included) and warns once."""
    import warnings

    img, txt, _, b = _inputs(6, seed=3)
    sv = torch.tensor(-2.0, dtype=torch.float64) if scale == "neg_tensor" else torch.tensor(scale, dtype=torch.float64)
    ours, theirs = getattr(fo, cls)(), getattr(OC, cls)()
    fo._WARNED.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _value_and_grads(ours, [img, txt, sv, b])
        _value_and_grads(ours, [img, txt, sv, b])
    want = _value_and_grads(theirs, [img, txt, sv, b])
    _close(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        _close(g, w)
    msgs = [str(w.message) for w in seen if "logit_scale" in str(w.message)]
    assert len(msgs) == 1 and cls in msgs[0], msgs


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="use_horovod"):
        fo.ClipLoss(use_horovod=True)
    with pytest.raises(ValueError, match="dist_impl"):
        fo.SigLipLoss(dist_impl="ring")
    with pytest.raises(ValueError, match="rank"):
        fo.ClipLoss(rank=2, world_size=2)
    with pytest.raises(TypeError, match="world_size"):
        fo.SigLipLoss(world_size=2.0)
    img, txt, s, _ = _inputs(4)
    with pytest.raises(ValueError, match="torch.distributed"):  # world_size 2 without a process group
        fo.ClipLoss(rank=0, world_size=2)(img, txt, s)
    with pytest.raises(ValueError, match="logit_bias"):  # a per-column bias does not cancel
        fo.ClipLoss()(img, txt, s, torch.zeros(4, dtype=torch.float64))


def test_importing_the_integration_does_not_import_open_clip():
    code = ("import sys, fused_contrastive, fused_contrastive.integrations.open_clip; "
            "assert 'open_clip' not in sys.modules and 'torchvision' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_example_trains(loss):
    spec = importlib.util.spec_from_file_location("clip_siglip_step", ROOT / "examples" / "clip_siglip_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.main(["--loss", loss, "--steps", "25", "--batch", "64"])
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
