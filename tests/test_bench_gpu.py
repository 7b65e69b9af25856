"""bench-gpu on the CPU: its float64 definitions against the textbook formulas in float64, the harness with
stand-in contenders (agreement, out of memory, errors, the budget, the compiled pass, the forms' environment,
the JSON lines and the table), the peers' adapters (memeff and siglip-kernel themselves under the Triton
interpreter, values; the GPU-only ones through stand-ins of their documented calls) and the command line."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import types

import pytest
import torch

from fused_contrastive.bench import gpu as BG
from fused_contrastive.bench import gpu_losses as GL
from fused_contrastive.bench import gpu_peers as GP


def _f64(p: GL.Problem) -> GL.Problem:
    return GL.Problem(p.loss, p.n, p.d, torch.float64, p.device, {k: v.detach().double() for k, v in p.leaves.items()},
                      {k: (tuple(g.double() for g in v) if k == "guide" else v) for k, v in p.extra.items()})


@pytest.mark.parametrize("loss", GL.LOSSES)
def test_the_definitions_equal_the_textbook_in_float64(loss):
    n, d = (12, 16) if loss == "maxsim" else (40, 96)
    p = GL.build(loss, n, d, "cpu", torch.float32)
    want = float(GL.SPECS[loss].textbook(_f64(p)))
    assert GL.SPECS[loss].truth(p) == pytest.approx(want, rel=1e-6 if loss == "maxsim" else 1e-10, abs=1e-12)
    # several row chunks: the same value
    assert GL.SPECS[loss].truth(p, chunk=7) == pytest.approx(want, rel=1e-6 if loss == "maxsim" else 1e-10, abs=1e-12)


def test_a_wrong_definition_is_caught_by_the_textbook():
    p = GL.build("clip", 40, 96, "cpu", torch.float32)
    want = float(GL.SPECS["clip"].textbook(_f64(p)))
    rows_only = float(GL._row_ce(GL._unit(p.leaves["a"]), GL._unit(p.leaves["b"]), GL.CLIP_SCALE,
                                 torch.arange(40)).mean())
    # the column term matters: a definition without it is off by far more than the tolerance above
    assert abs(rows_only - want) > 1e4 * 1e-10 * abs(want)


# --- the harness, with stand-in contenders ---------------------------------------------------------------


def _con(name, fn, kind="peer", **kw):
    return BG.Contender(name, kind, lambda p: fn, **kw)


def _textbook_fn(p):
    return GL.SPECS[p.loss].textbook(p)


def _wrong(p):
    return GL.SPECS[p.loss].textbook(p) * 1.1


def _oom(p):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40 GiB")


def _broken(p):
    raise ValueError("a peer that rejects the inputs")


def _cfg(tmp_path, **kw):
    out = []
    return BG.Config(device="cpu", dtype=torch.float32, budget=kw.pop("budget", 60), reserve=kw.pop("reserve", 0.0),
                     repeats=2, out=str(tmp_path), print_fn=out.append, **kw), out


def test_every_kind_of_row(tmp_path):
    cons = [BG.Contender(BG.OURS, "ours", lambda p: GL.SPECS[p.loss].ours), _con("good", _textbook_fn),
            _con("wrong", _wrong), _con("oom", _oom), _con("broken", _broken),
            BG.Contender("absent", "peer", lambda p: _textbook_fn, missing="not installed (ModuleNotFoundError)"),
            BG.Contender(BG.TEXTBOOK, "textbook", lambda p: _textbook_fn, autocast=True)]
    cfg, printed = _cfg(tmp_path)
    rows = BG.run(cfg, [BG.Group("info_nce", 48, 32)], lambda g: cons)
    by = {r["contender"]: r for r in rows}
    assert by[BG.OURS]["status"] == "ok" and by[BG.OURS]["agrees"] and by[BG.OURS]["repeats"] == 2
    assert by["good"]["agrees"] and by["good"]["ms"] > 0
    assert by["wrong"]["status"] == "ok" and not by["wrong"]["agrees"]
    assert by["oom"]["status"] == "does not fit"
    assert by["broken"]["status"].startswith("error: ValueError: a peer that rejects")
    assert by["absent"]["status"].startswith("not installed")
    assert by[BG.TEXTBOOK]["agrees"]
    text = open(tmp_path / "bench_gpu.txt").read()
    assert "DISAGREES, not ranked" in text
    summary = BG.summary_rows(rows)[0]
    assert summary["peer"] == "good"  # the disagreeing peer is not ranked, whatever its time
    # the JSON lines: a meta line, then every row, as measured
    meta, back = BG.read_jsonl(str(tmp_path / "bench_gpu.jsonl"))
    assert meta["device"] == "cpu" and [r["contender"] for r in back] == [r["contender"] for r in rows]
    for key in ("loss", "n", "d", "dtype", "contender", "ms", "peak_mb", "gpu", "agrees"):
        assert key in back[0]
    assert BG.format_table(back, meta) == BG.format_table(rows, meta)
    assert any("agrees" in line for line in printed)


def test_the_budget_ends_with_the_table(tmp_path):
    def slow(p):
        time.sleep(0.6)
        return _textbook_fn(p)
    cons = [_con("slow", slow, kind="ours")]
    cfg, printed = _cfg(tmp_path, budget=6.0)  # a group starts with 5 s left: the first runs, the rest do not
    plan = [BG.Group("info_nce", 16, 8), BG.Group("clip", 16, 8), BG.Group("simcse", 16, 8)]
    rows = BG.run(cfg, plan, lambda g: cons)
    assert [r["status"] for r in rows][-1] == "not run (budget)"
    assert sum(r["status"] == "ok" for r in rows) >= 1
    assert printed[-1].startswith("# bench-gpu")  # the table comes last
    assert os.path.exists(tmp_path / "bench_gpu.png") or "matplotlib" in " ".join(printed)


def test_the_compiled_pass_runs_after_the_eager_rows_largest_n_first(tmp_path):
    cons = [_con("eager", _textbook_fn, kind="ours"), _con("compiled", _textbook_fn, kind="compiled")]
    cfg, _ = _cfg(tmp_path)
    rows = BG.run(cfg, [BG.Group("info_nce", 16, 8), BG.Group("info_nce", 32, 8)], lambda g: cons)
    assert [(r["contender"], r["n"]) for r in rows] == [("eager", 16), ("eager", 32), ("compiled", 32),
                                                        ("compiled", 16)]


def test_a_form_sets_its_environment_around_forward_and_backward(tmp_path):
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("fwd", os.environ.get("FUSED_CONTRASTIVE_EPI_FORM")))
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            seen.append(("bwd", os.environ.get("FUSED_CONTRASTIVE_EPI_FORM")))
            return g.expand(4, 3)

    p = GL.Problem("info_nce", 4, 3, torch.float32, torch.device("cpu"), {"x": torch.ones(4, 3, requires_grad=True)})
    form = BG.FORM_BY_NAME["epi=tma"]
    c = BG.Contender("f", "form", lambda p: None, form.context)
    BG.run_step(c, lambda p: Probe.apply(p.leaves["x"]), p)
    assert seen == [("fwd", "tma"), ("bwd", "tma")]
    assert os.environ.get("FUSED_CONTRASTIVE_EPI_FORM") is None


def test_the_default_plan_and_its_contenders():
    plan = BG.default_plan()
    assert plan[0] == BG.Group("info_nce", 16384, 768)
    assert {(g.loss, g.n) for g in plan} >= {("gist", 4096), ("gist", 16384), ("maxsim", 1024), ("maxsim", 4096),
                                            ("info_nce", 65536), ("clip", 4096)}
    assert ("gist", 65536) not in {(g.loss, g.n) for g in plan}
    assert {g.d for g in plan if g.loss == "info_nce"} == {768, 256}
    names = [c.name for c in BG.contenders("clip", 65536, 768)]
    assert names[0] == BG.OURS and names[-2:] == [BG.TEXTBOOK, BG.COMPILED]
    assert {"memeff", "inf-cl", f"{BG.OURS}[gemm=cublas]"} <= set(names)
    assert [c.name for c in BG.contenders("siglip", 4096, 768, forms=(), peers=False, compile=False)] == \
        [BG.OURS, BG.TEXTBOOK]


# --- the peers ------------------------------------------------------------------------------------------


@pytest.fixture
def cuda_capability(monkeypatch):
    """The peers ask for the GPU's compute capability (siglip-kernel at import): an sm_90 answer."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


@pytest.mark.parametrize("loss", ["info_nce", "clip", "matryoshka5", "matryoshka5_clip"])
def test_memeff_under_the_interpreter_computes_the_definition(loss, cuda_capability, monkeypatch):
    import importlib
    import pkgutil

    import memeff

    for m in pkgutil.iter_modules(memeff.__path__):  # its CUDA-only input checks (it runs under the interpreter)
        mod = importlib.import_module(f"memeff.{m.name}")
        if hasattr(mod, "_validate_features"):
            monkeypatch.setattr(mod, "_validate_features", lambda *a, **k: None)
    p = GL.build(loss, 24, 768 if loss.startswith("matryoshka") else 64, "cpu", torch.float32)
    got = GP.PEERS[0].losses[loss](p)(p)  # (values only: its backward's atomics are not the interpreter's)
    # fp32 logits of scale 20 (14 at the positive) round at ~1e-6 in every implementation, per level
    assert float(got) == pytest.approx(GL.SPECS[loss].truth(p), rel=2e-5, abs=1e-5 * len(p.extra.get(
        "matryoshka_dims", [0])))


def test_siglip_kernel_under_the_interpreter_computes_the_definition(cuda_capability):
    # bf16 inputs take its chunked-bf16 route (the one bench-gpu times): the logits by torch, its Triton pass
    # elementwise (no tl.dot, which the interpreter gets wrong in bf16); the loss comes back in bf16
    p = GL.build("siglip", 24, 64, "cpu", torch.bfloat16)
    (peer,) = GP.peers_of("siglip")
    got = peer.losses["siglip"](p)(p)
    got.backward()
    assert got.dtype == torch.bfloat16
    assert float(got) == pytest.approx(GL.truth_siglip(p), rel=2**-8)
    assert all(torch.isfinite(t.grad).all() for t in p.leaves.values())


def _stub(monkeypatch, name: str, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)


def test_the_gpu_only_peers_are_called_as_they_document(monkeypatch):
    """inf-cl, late-interaction-kernels and flash-maxsim run on CUDA only: stand-ins of their calls (as their
    code documents them: inf-cl's per-row loss of ``scale q . k`` without normalising and with D % head_dim == 0;
    the MaxSim scores with masks or prefix lengths, summed over query tokens) check the adapters' arguments."""
    def cal_flash_loss(q, k, labels=None, scale=None, head_dim=256):
        assert q.is_contiguous() and k.is_contiguous() and q.shape[1] % head_dim == 0 and head_dim >= 16
        logits = (scale * q) @ k.T
        return torch.logsumexp(logits, 1) - logits.diagonal()

    def maxsim(q, d, q_mask=None, d_mask=None, *, normalize=False, backward=None):
        assert not normalize
        s = torch.einsum("nad,mbd->nmab", q.float(), d.float()).masked_fill(~d_mask[None, :, None, :], -math.inf)
        return (s.amax(-1) * q_mask[:, None, :]).sum(-1)

    def flash_maxsim_batched_train(q, d, shared_docs=True, doc_lengths=None, query_lengths=None):
        qm = torch.arange(q.shape[1])[None] < query_lengths[:, None]
        dm = torch.arange(d.shape[1])[None] < doc_lengths[:, None]
        return maxsim(q, d, qm, dm)

    _stub(monkeypatch, "inf_cl", cal_flash_loss=cal_flash_loss)
    _stub(monkeypatch, "late_interaction_kernels", maxsim=maxsim)
    _stub(monkeypatch, "flash_maxsim", flash_maxsim_batched_train=flash_maxsim_batched_train)
    for loss, d in (("info_nce", 768), ("clip", 768), ("clip", 256)):
        p = GL.build(loss, 32, d, "cpu", torch.float32)
        (peer,) = [x for x in GP.peers_of(loss) if x.package == "inf-cl"]
        assert peer.missing() is None
        assert float(peer.losses[loss](p)(p)) == pytest.approx(GL.SPECS[loss].truth(p), rel=1e-5, abs=1e-6)
    p = GL.build("maxsim", 10, 16, "cpu", torch.float32)
    for peer in GP.peers_of("maxsim"):
        assert float(peer.losses["maxsim"](p)(p)) == pytest.approx(GL.truth_maxsim(p), rel=1e-5)


# --- the command line -----------------------------------------------------------------------------------


def test_the_command_needs_cuda_and_lists_its_plan(capsys):
    from fused_contrastive.__main__ import main

    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        pytest.skip("a CUDA device is present: the command would measure")
    assert main(["bench-gpu", "--budget", "5"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["bench-gpu", "--list", "--losses", "siglip", "--sizes", "4096", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("siglip N=4096 D=768: fused_contrastive,") and "siglip-kernel" in out
    with pytest.raises(SystemExit):
        main(["bench-gpu", "--losses", "nope"])
    assert "--losses: unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench-gpu", "--forms", "epi=fast"])
    assert "--forms: unknown ['epi=fast']" in capsys.readouterr().err


def test_a_saved_run_renders_again(tmp_path, capsys):
    from fused_contrastive.__main__ import main

    src = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "h200-bench-gpu-2", "bench_gpu.jsonl")
    assert main(["bench-gpu", "--from-jsonl", src]) == 0
    text = capsys.readouterr().out
    with open(os.path.join(os.path.dirname(src), "bench_gpu.txt")) as fh:
        committed = fh.read()
    # the committed table is this renderer's output of the same rows (its wall-time line aside)
    assert text.splitlines()[3:] == committed.rstrip("\n").splitlines()[3:]
    with open(src) as fh:
        # a row of this library at every (loss, N, D) of that run
        assert sum(1 for line in fh if json.loads(line).get("contender") == BG.OURS) == 29


def _block(text: str, begin: str, end: str) -> str:
    return text[text.index(begin):text.index(end)].split("\n", 1)[1].strip()


def test_the_readme_table_is_generated_from_the_committed_runs():
    root = os.path.join(os.path.dirname(__file__), "..")
    readme = open(os.path.join(root, "docs", "gpu-measurements.md")).read()  # the README links its table there
    assert _block(readme, "<!-- bench-gpu table:", "<!-- end of the bench-gpu table") == BG.readme_table(root)
    # this library's row at N = 4096 is the form its default takes now (a route changed after the run)
    rows = {(r["loss"], r["n"], r["d"]): r for r in BG.current_rows(root) if r["contender"] == BG.OURS}
    assert rows[("info_nce", 4096, 768)]["form"] == f"{BG.OURS}[tile=2^24]"
    assert rows[("clip", 4096, 768)].get("form") is None
