"""The Gluon statistics kernel (``kernels/gluon_epi.py``) and its host (``core/triton_shared/gluon_epi.py``), without a
GPU: Gluon has no interpreter, so its outputs cannot be computed here (``check --gpu-validate``'s gluon-ws rows do
that on an sm_90 GPU). What is checked:

* it compiles for sm_90 with the Triton installed here (a subprocess with ``TRITON_INTERPRET=0``), from the launches
  the library records for CLIP (row and column statistics), SimCSE (the triangular frame) and the rows alone: wgmma,
  TMA copies, ``setmaxnreg`` to the partitions' registers, 0 spill bytes, shared memory within sm_90's;
* the gate: the option is taken only on sm_90 (the recorder's arch on the meta device) with a tested Triton and
  16-bit, aligned, bias-free operands; elsewhere the Triton kernel runs, with a warning naming the reason, and the
  loss is the float64 definition's (the interpreter); an import without Gluon leaves ``AVAILABLE`` False;
* the launch's plumbing against the Triton MODE 3 launch it replaces, both recorded on the meta device: the same
  partial buffers (shapes, strides, dtypes), scalars and flags, descriptors of the same operands, a persistent grid;
* the validation row's machinery on the interpreter, with the Triton kernel standing in for the Gluon one: it
  passes against float64, a planted wrong statistic fails it, and where the gate refuses the kernel the row is
  "not run" with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from unittest import mock

import pytest
import torch
from fused_contrastive.kernels import gluon_epi as KG

from fused_contrastive import core, routes
from fused_contrastive import gpu_validate as GV
from fused_contrastive.core.triton_shared import gluon_epi as HG
from fused_contrastive.core.triton_shared import panels
from fused_contrastive.tools import compile_survey as CS
from tests._compiles import SMEM_LIMIT, run_compile_script

triton = pytest.importorskip("triton")


def record(loss: str, n: int, d: int, gemm: str, arch: str = "sm90", dtype=torch.bfloat16, split: bool = True):
    """The forward's launches of ``loss`` at N = ``n`` on the panel path's epilogue GEMM, recorded on the meta
    device for ``arch`` with ``EPI_GEMM=gemm``. ``split=False``: the triangular statistics forward without the
    target split (SimCSE's saturated loss, which the Gluon kernel does not have: with it the Triton kernel runs),
    the frame the Gluon kernel's triangular form computes."""
    from fused_contrastive.core.lse import triton_panel as TP

    a, b, scale, spec, data, coef, reduce = CS.core_call(loss, n, d, dtype)
    orig = TP.stats_forward

    def unsplit(*args, target=None, minus_target=None, **kw):
        return orig(*args, **kw)

    with routes.override(DENSE=False, TRITON_PATH="panel", PANEL_GEMM="epilogue", EPI_GEMM=gemm), \
            CS.recording(arch) as launches, warnings.catch_warnings(), \
            mock.patch.object(TP, "stats_forward", orig if split else unsplit):
        warnings.simplefilter("ignore", RuntimeWarning)
        core.run("triton", a, b, scale, spec, data, coef, reduce)
    return list(launches)


def _stats(launches, name):
    return [x for x in launches if x.name == name]


# --- compile (sm_90, no GPU) -------------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, os, re, subprocess, sys, tempfile
    sys.path.insert(0, ".")
    from tests.test_gluon_epi import record
    from fused_contrastive.tools import compile_survey as CS
    from triton.backends.nvidia.compiler import get_ptxas

    def sass(cubin):  # static SASS opcode counts (nvdisasm bundled with Triton)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            nvdisasm = os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")
            text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
        return dict(sass=len(ops), hgmma=sum(o.startswith("HGMMA") for o in ops),
                    usetmaxreg=sum(o.startswith("USETMAXREG") for o in ops),
                    utmaldg=sum(o.startswith("UTMALDG") for o in ops))

    out = []
    for label, loss in (("cols", "clip"), ("tri", "simcse")):
        (g,) = [x for x in record(loss, 4096, 768, "gluon-ws", split=False) if x.name == "epi_stats_gluon"]
        variants = [(label, g)]
        if label == "cols":  # the rows alone (a per-row output's forward), with two and with one consumer
            rows = g._replace(constexprs=dict(g.constexprs, WANT_COL=False))
            variants += [("rows", rows), ("rows 1 consumer", rows._replace(
                constexprs=dict(rows.constexprs, CONSUMERS=1), maxnreg=None))]
        for lab, lz in variants:
            keep = {}
            r = CS.compile_launch(lz, 90, keep)
            ptx = keep["kernel"].asm["ptx"]
            regs = re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)
            r.update(label=lab, setmaxnreg=sorted({int(v) for v in regs}),
                     ex2=ptx.count("ex2.approx"), consumers=lz.constexprs["CONSUMERS"],
                     **sass(keep["kernel"].asm["cubin"]),
                     constexprs={k: v for k, v in lz.constexprs.items() if isinstance(v, (bool, int))})
            out.append(r)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    if not KG.AVAILABLE or triton.__version__ not in HG.TESTED_TRITON:
        pytest.fail(f"the Gluon kernel must compile with the Triton installed here ({triton.__version__}, tested: "
                    f"{sorted(HG.TESTED_TRITON)}; {KG.IMPORT_ERROR})")
    return run_compile_script(_SCRIPT, 900)


def test_the_gluon_kernel_compiles_for_sm90(compiled):
    """Every variant compiles to wgmma (4 per 64-column step and consumer: one m64 instruction for the 64-row tile per
    k16 step), reads its operands by TMA only, spills nothing and fits sm_90's shared memory; the kernel's
    ``maxnreg`` is the 168 that three warpgroups share, and the partitions are given their registers by
    ``setmaxnreg`` (the consumers 240, the loader 24). Printed: the compile figures docs/panel-path.md quotes."""
    assert [r["label"] for r in compiled] == ["cols", "rows", "rows 1 consumer", "tri"]
    for r in compiled:
        print(json.dumps({k: r[k] for k in ("label", "consumers", "regs", "spill_stores", "spill_loads", "shared",
                                            "n_wgmma", "tma", "setmaxnreg", "ex2", "sass", "hgmma", "usetmaxreg",
                                            "utmaldg")}))
    for r in compiled:
        assert r["cc"] == 90 and r["tc"] == "wgmma" and r["n_mma"] == 0, r
        assert r["n_wgmma"] == 4 * r["consumers"], r
        assert r["tma"] > 0 and r["ld_v4"] == 0 and r["cp_async_16"] == 0 and r["ld_b16"] == 0, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared"] <= SMEM_LIMIT[90], r
        assert HG.STAGES * (HG.BLOCK_M + HG.BLOCK_N) * HG.BLOCK_K * 2 <= r["shared"], r  # the ring is in it
        assert KG.LOADER_REGS in r["setmaxnreg"], r
        assert r["hgmma"] >= r["n_wgmma"] and r["usetmaxreg"] >= 2 and r["utmaldg"] >= 2, r  # in the SASS too
        if r["consumers"] == 2:
            assert r["regs"] == KG.MAXNREG and KG.CONSUMER_REGS in r["setmaxnreg"], r
    by = {r["label"]: r for r in compiled}
    assert by["cols"]["constexprs"]["WANT_COL"] and not by["cols"]["constexprs"]["TRI"]
    assert by["tri"]["constexprs"]["TRI"] and by["tri"]["constexprs"]["EXCLUDE_SELF"]
    # one exp per logit for the rows, a second for the columns: per consumer, 64 x 128 / 128 threads = 64 each
    assert by["rows"]["ex2"] == 2 * 64 and by["cols"]["ex2"] == 2 * 128 and by["rows 1 consumer"]["ex2"] == 64


# --- the gate ----------------------------------------------------------------------------------------------------


def _meta(rows: int, d: int, dtype=torch.bfloat16):
    return torch.empty(rows, d, dtype=dtype, device="meta")


def test_the_gate_takes_sm90_with_a_tested_triton_only(monkeypatch):
    """On sm_90 (the recorder's arch) with a tested Triton the kernel may run; the sm_80 recording, CPU tensors, an
    untested Triton version, fp32 operands, a bias column or margin, rows TMA cannot copy and a traced host each give
    a reason."""
    x, y = _meta(256, 768), _meta(300, 768)
    ok = dict(HAS_BIAS=False, BIAS_COS=False, POS_KIND=0)
    with CS.recording("sm90"):
        assert HG.fallback_reason(x, y, ok) is None
        assert "16-bit" in HG.fallback_reason(_meta(256, 768, torch.float32), _meta(300, 768, torch.float32), ok)
        assert "bias" in HG.fallback_reason(x, y, dict(ok, HAS_BIAS=True))
        assert "margin" in HG.fallback_reason(x, y, dict(ok, BIAS_COS=True))
        assert "16-byte" in HG.fallback_reason(_meta(256, 100), _meta(300, 100), ok)  # 200-byte rows
        monkeypatch.setattr(HG.TL, "tensors_are_traced", lambda: True)
        assert "traced" in HG.fallback_reason(x, y, ok)
        monkeypatch.undo()
        monkeypatch.setattr(HG, "TESTED_TRITON", frozenset({"0.0.0"}))
        assert "not a version the Gluon kernel was tested with" in HG.fallback_reason(x, y, ok)
    monkeypatch.undo()
    with CS.recording("sm80"):
        assert "not sm_90" in HG.fallback_reason(x, y, ok)
    assert "cpu tensors" in HG.fallback_reason(torch.zeros(4, 8, dtype=torch.bfloat16),
                                              torch.zeros(4, 8, dtype=torch.bfloat16), ok)
    monkeypatch.setattr(KG, "AVAILABLE", False)
    monkeypatch.setattr(KG, "IMPORT_ERROR", "ImportError: no gluon")
    with CS.recording("sm90"):
        assert "no usable Gluon (ImportError: no gluon)" in HG.fallback_reason(x, y, ok)


def test_the_recorded_route_falls_back_elsewhere():
    """Recorded: with the option, sm_90 launches the Gluon kernel in place of MODE 3; sm_80 launches MODE 3 (and warns
    with the reason); without the option, MODE 3 on both."""
    assert _stats(record("clip", 1024, 768, "gluon-ws"), HG.NAME)
    assert not _stats(record("clip", 1024, 768, "gluon-ws"), "epi_gemm_stats")
    HG._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="EPI_GEMM=gluon-ws is not used: the recorded arch is sm80"):
        a, b, scale, spec, data, coef, reduce = CS.core_call("clip", 1024, 768, torch.bfloat16)
        with routes.override(DENSE=False, TRITON_PATH="panel", PANEL_GEMM="epilogue", EPI_GEMM="gluon-ws"), \
                CS.recording("sm80") as launches:
            core.run("triton", a, b, scale, spec, data, coef, reduce)
    assert _stats(launches, "epi_gemm_stats") and not _stats(launches, HG.NAME)
    for arch in ("sm90", "sm80"):
        ls = record("clip", 1024, 768, "triton", arch)
        assert _stats(ls, "epi_gemm_stats") and not _stats(ls, HG.NAME)


def test_on_the_interpreter_the_option_falls_back_with_the_float64_loss():
    """CPU tensors (no Gluon interpreter): CLIP's loss with the option asked for is computed by the Triton kernel,
    the warning names the reason once, and the loss is the float64 definition's."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    import fused_contrastive as fc

    want = fc.clip_loss(q.double(), k.double(), 10.0, backend="reference")
    HG._WARNED.clear()
    with routes.override(DENSE=False, TRITON_PATH="panel", PANEL_GEMM="epilogue", EPI_GEMM="gluon-ws"):
        with pytest.warns(RuntimeWarning, match="not used: cpu tensors"):
            got = fc.clip_loss(q.bfloat16(), k.bfloat16(), 10.0, backend="triton")
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            fc.clip_loss(q.bfloat16(), k.bfloat16(), 10.0, backend="triton")
    assert not [w for w in again if "EPI_GEMM" in str(w.message)]  # said once per reason
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    assert HG.last_reason is not None and "cpu tensors" in HG.last_reason


def test_import_without_gluon_does_not_fail():
    """With ``triton.experimental.gluon`` missing, the package imports, the kernel module says why, and the gate
    refuses the option with that reason."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton.experimental.gluon"] = None  # an import of it raises ImportError
        import torch
        import fused_contrastive
        from fused_contrastive.kernels import gluon_epi as KG
        from fused_contrastive.core.triton_shared import gluon_epi as HG
        assert not KG.AVAILABLE and KG.epi_stats_ws_kernel is None, KG.IMPORT_ERROR
        x = torch.zeros(8, 16, dtype=torch.bfloat16)
        print(HG.fallback_reason(x, x, {}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "has no usable Gluon (ModuleNotFoundError" in r.stdout, r.stdout
    # a Gluon whose frontend refuses the kernel's definitions (another version's): the same
    refused = code.replace('sys.modules["triton.experimental.gluon"] = None  # an import of it raises ImportError',
                           "from triton.experimental import gluon\n"
                           "def _no(*a, **k):\n    raise TypeError('this gluon refuses it')\n"
                           "gluon.jit = _no")
    r = subprocess.run([sys.executable, "-c", refused], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "has no usable Gluon (TypeError: this gluon refuses it)" in r.stdout, r.stdout


# --- the launch's plumbing against the Triton launch it replaces -------------------------------------------------


@pytest.mark.parametrize("loss,n", [("clip", 1000), ("clip", 4096), ("simcse", 4096)])
def test_the_launch_matches_the_triton_mode3_launch(loss, n):
    """Recorded side by side on sm_90's meta device: the same number of launches per panel; the Gluon launch writes
    the row partials' layout the Triton launch does (MXP / ZP [P, cdiv(M, 128)] at row stride ``stride_zp``; with
    the column term or the triangular frame CM / CZ [cdiv(P, 64), M], per 64 rows where the Triton kernel's are per
    128, and the columns' merge takes that many partials) and reads the same operands (as TMA
    descriptors of X and Y with the kernel's block shapes), scalars and flags, on a grid of at most one program per
    SM; the merge launches that read its partials are unchanged."""
    tri_ls = record(loss, n, 768, "triton", split=False)
    gl_ls = record(loss, n, 768, "gluon-ws", split=False)
    assert [x.name for x in tri_ls if x.name != "epi_gemm_stats"] == [x.name for x in gl_ls if x.name != HG.NAME]
    merges = [(x.args["n_out"], x.args["stride_o"]) for x in _stats(tri_ls, "stats_merge")]
    assert merges == [(x.args["n_out"], x.args["stride_o"]) for x in _stats(gl_ls, "stats_merge")]
    t3, gw = _stats(tri_ls, "epi_gemm_stats"), _stats(gl_ls, HG.NAME)
    assert len(t3) == len(gw) >= 1
    for t, g in zip(t3, gw, strict=True):
        ta, ga = t.args, g.args
        assert t.constexprs["MODE"] == 3 and t.constexprs["BLOCK_N"] == HG.BLOCK_N
        for k in ("P", "M", "D", "r0", "offset", "stride_zp"):
            assert ga[k] == ta[k], k
        want_col = t.constexprs["WANT_COL"]
        for k in ("MXP", "ZP", "RSP", "RB", "SCALE"):
            assert (ga[k].shape, ga[k].stride(), ga[k].dtype) == (ta[k].shape, ta[k].stride(), ta[k].dtype), k
        assert ga["MXP"].shape == (ta["P"], triton.cdiv(ta["M"], HG.BLOCK_N)) == (ta["P"], ta["stride_zp"])
        if want_col:
            for k in ("CM", "CZ"):
                assert (ga[k].shape, ga[k].stride()) == ((triton.cdiv(ta["P"], HG.BLOCK_M), ta["M"]), (ta["M"], 1)), k
                assert ta[k].shape == (triton.cdiv(ta["P"], t.constexprs["BLOCK_M"]), ta["M"]), k
        for k in ("NORMALIZE", "EXCLUDE_SELF", "WANT_COL", "TRI", "GROUP_M"):
            assert g.constexprs[k] == t.constexprs[k], k
        assert not t.constexprs["HAS_BIAS"] and not t.constexprs["BIAS_COS"] and t.constexprs["POS_KIND"] == 0
        xd, yd = ga["x_desc"], ga["y_desc"]
        assert (xd.base.shape, yd.base.shape) == (ta["X"].shape, ta["Y"].shape)
        assert (list(xd.block_shape), list(yd.block_shape)) == ([HG.BLOCK_M, HG.BLOCK_K], [HG.BLOCK_N, HG.BLOCK_K])
        n_tiles = triton.cdiv(ta["P"], HG.BLOCK_M) * ta["stride_zp"]
        assert g.grid == (min(n_tiles, panels.RECORD_SMS["sm90"]),)
        assert (g.num_warps, g.maxnreg) == (4, KG.MAXNREG)
        assert g.constexprs["CONSUMERS"] == 2 and g.constexprs["STAGES"] == HG.STAGES
    assert gw[0].constexprs["TRI"] == (loss == "simcse")


def test_simcse_with_the_target_split_keeps_the_triton_kernel():
    """SimCSE's triangular statistics forward splits its target out (its saturated loss), which the Gluon kernel does
    not: with ``EPI_GEMM=gluon-ws`` it runs the Triton kernel, with SPLIT_T, and the gate says why."""
    HG._WARNED.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a, b, scale, spec, data, coef, reduce = CS.core_call("simcse", 4096, 768, torch.bfloat16)
        with routes.override(DENSE=False, TRITON_PATH="panel", PANEL_GEMM="epilogue", EPI_GEMM="gluon-ws"), \
                CS.recording("sm90") as launches:
            core.run("triton", a, b, scale, spec, data, coef, reduce)
    stats = _stats(launches, "epi_gemm_stats")
    assert stats and all(x.constexprs["SPLIT_T"] and x.constexprs["TRI"] for x in stats), launches
    assert not _stats(launches, HG.NAME)
    assert any("target split" in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_stats_launch_refuses_another_layout_or_mode():
    (t,) = _stats(record("clip", 1000, 768, "triton"), "epi_gemm_stats")
    with pytest.raises(ValueError, match="tiles are 64 columns wide, the Gluon kernel's 128"):
        HG.stats_launch(lambda lz: None, HG.NAME, t.args, dict(t.constexprs, BLOCK_N=64), 8, 8)
    with pytest.raises(ValueError, match=r"column partials \(8, 1000\), the Gluon kernel writes \[cdiv\(P, 64\), M\]"):
        HG.stats_launch(lambda lz: None, HG.NAME, t.args, t.constexprs, 8, 8)  # the Triton kernel's [cdiv(P, 128), M]
    with pytest.raises(ValueError, match="MODE 0"):
        HG.stats_launch(lambda lz: None, HG.NAME, t.args, dict(t.constexprs, MODE=0), 8, 8)


# --- the validation row ------------------------------------------------------------------------------------------

_CASES = (("rows", 70, 90, 24, 20.0, False, 32), ("cols", 70, 90, 24, 100.0, True, None),
          ("tri", 70, None, 24, 20.0, False, 32))


def _stand_in(monkeypatch, scale_by: float = 1.0):
    """The Gluon kernel's place taken by the Triton MODE 3 launch (the interpreter can run it) at the Gluon kernel's
    tiles (so its partials have the Gluon layout), under the Gluon launch's name, its scale multiplied by
    ``scale_by`` (1: the true statistics)."""
    def launch_as_gluon(launch, name, args, const, n_tiles, programs):
        panels._epi_launch(launch, name, dict(args, SCALE=args["SCALE"] * scale_by), dict(const, BLOCK_M=HG.BLOCK_M),
                           "stats", n_tiles)

    monkeypatch.setattr(HG, "fallback_reason", lambda x, y, const: None)
    monkeypatch.setattr(HG, "stats_launch", launch_as_gluon)


def test_the_validation_row_passes_with_true_statistics(monkeypatch, capsys):
    _stand_in(monkeypatch)
    rep = GV.Report("cpu")
    GV.check_gluon_stats(rep, GV.Plan(gluon_cases=_CASES), "cpu")
    assert [r.ok for r in rep.results] == [True] * 3, rep.results
    assert all("epi_stats_gluon" in r.detail for r in rep.results)


def test_a_planted_wrong_statistic_fails_the_row(monkeypatch):
    """The scale off by 1e-3 (a logit off by 0.02 to 0.1): every row fails."""
    _stand_in(monkeypatch, 1.001)
    rep = GV.Report("cpu")
    GV.check_gluon_stats(rep, GV.Plan(gluon_cases=_CASES), "cpu")
    assert [r.ok for r in rep.results] == [False] * 3, rep.results


def test_where_the_gate_refuses_the_row_is_not_run(capsys):
    """On the CPU the gate refuses the kernel: the row runs nothing of it and says why (not run: proves nothing)."""
    rep = GV.Report("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        GV.check_gluon_stats(rep, GV.Plan(gluon_cases=_CASES[:1]), "cpu")
    assert rep.not_run == 1 and [r.ok for r in rep.results] == [None], rep.results
    assert "not run: the Gluon kernel did not launch (cpu tensors" in rep.results[0].detail


# --- the barrier protocol, modelled (no GPU runs the kernel) -------------------------------------------------------


class _Barrier:
    """An mbarrier of arrival count 1: ``k`` phases completed; a wait for parity ``p`` passes when the current
    (incomplete) phase's parity is not ``p`` (PTX ``mbarrier.try_wait.parity``: it names the phase by parity only)."""

    def __init__(self):
        self.k = 0

    def arrive(self):
        self.k += 1

    def passes(self, parity: int) -> bool:
        return (self.k & 1) != parity


def _run_protocol(n_tiles: int, n_k: int, stages: int, consumers: int, turn: bool, seed: int) -> str | None:
    """One program of ``epi_stats_ws_kernel`` as a model: its loader, its consumers and the TMA copies as agents with
    the kernel's index arithmetic and waits (``_loader``, ``_consumer``), interleaved at random (each copy lands at a
    random later time). Returns the first violation (a consumer reading a slot that holds another position, a copy
    overwriting a slot not yet released, a deadlock), or None."""
    import random

    rnd = random.Random(seed)
    ready = [_Barrier() for _ in range(stages)]
    empty = [_Barrier() for _ in range(stages)]
    trn = [_Barrier() for _ in range(2)]
    content = [None] * stages
    released = [-1] * stages  # the last position released per slot
    copies: list[tuple[int, int]] = []
    errors: list[str] = []

    def loader():
        c = 0
        for _t in range(n_tiles):
            for _k in range(n_k):
                s = c % stages
                yield lambda s=s, c=c: empty[s].passes(((c // stages) & 1) ^ 1)
                copies.append((s, c))
                c += 1

    def consumer(ci):
        for i, _t in enumerate(range(ci, n_tiles, consumers)):
            c = (i * consumers + ci) * n_k
            if turn and consumers == 2:
                yield lambda i=i: trn[ci].passes((i & 1) ^ (1 - ci))
            inflight = []
            for k in range(n_k):
                s = c % stages
                yield lambda s=s, c=c: ready[s].passes((c // stages) & 1)
                if content[s] != c:
                    errors.append(f"consumer {ci} read slot {s} for position {c}: it holds {content[s]}")
                inflight.append((s, c))
                while len(inflight) > 1:  # warpgroup_mma_wait(1): the previous group retires (reads its slot)
                    s0, c0 = inflight.pop(0)
                    if content[s0] != c0:
                        errors.append(f"consumer {ci}'s MMA of position {c0} saw slot {s0} overwritten")
                if k > 0:
                    prev = (c + stages - 1) % stages
                    released[prev] = c - 1
                    empty[prev].arrive()
                c += 1
            for s0, c0 in inflight:  # warpgroup_mma_wait(0)
                if content[s0] != c0:
                    errors.append(f"consumer {ci}'s MMA of position {c0} saw slot {s0} overwritten")
            prev = (c + stages - 1) % stages
            released[prev] = c - 1
            empty[prev].arrive()
            if turn and consumers == 2:
                trn[1 - ci].arrive()
            yield lambda: True  # (the epilogue)

    agents = {"loader": loader(), **{f"consumer {ci}": consumer(ci) for ci in range(consumers)}}
    waiting = {name: (lambda: True) for name in agents}
    while agents or copies:
        runnable = [n for n in agents if waiting[n]()]
        if copies and (not runnable or rnd.random() < 0.4):  # a copy lands (any pending one: TMA does not order them)
            s, c = copies.pop(rnd.randrange(len(copies)))
            if c >= stages and released[s] != c - stages:
                errors.append(f"the copy of position {c} overwrote slot {s} before position {c - stages} was released")
            content[s] = c
            ready[s].arrive()
        elif runnable:
            name = rnd.choice(runnable)
            try:
                waiting[name] = next(agents[name])
            except StopIteration:
                del agents[name], waiting[name]
        else:
            return f"deadlock: {sorted(agents)} wait"
        if errors:
            return errors[0]
    return None


@pytest.mark.parametrize("n_tiles,n_k,stages", [(5, 12, 4), (7, 3, 4), (4, 1, 2), (6, 5, 3), (9, 2, 4), (1, 12, 4)])
def test_the_ring_protocol_reads_each_slot_at_its_position(n_tiles, n_k, stages):
    """The kernel's barrier protocol (ring slots' ready / empty mbarriers, the consumers' turn), modelled with the
    kernel's index arithmetic under random interleavings and copy latencies: every consumer reads each slot when it
    holds the position it waited for, no copy overwrites an unreleased slot, and every agent finishes."""
    for consumers in (1, 2):
        for seed in range(150):
            assert _run_protocol(n_tiles, n_k, stages, consumers, True, seed) is None, (consumers, seed)


def test_without_the_turn_barriers_a_consumer_reads_another_tiles_operands():
    """The planted defect the turn barriers prevent: without them the second consumer waits on a ring slot's phase
    two or more ahead, passes on an old phase of the same parity and reads the first consumer's operands."""
    found = [_run_protocol(5, 12, 4, 2, False, seed) for seed in range(100)]
    assert any(f is not None and "read slot" in f for f in found), found[:3]


def test_on_cuda_a_row_runs_in_a_child_process_with_a_time_limit(monkeypatch):
    """The row's child process (what a CUDA run takes, so a kernel that hangs is a FAIL row, not the end of the run):
    run here on the CPU it reports the gate's refusal as the in-process row does; past its time limit it is killed
    and the row fails saying so."""
    case = _CASES[0]
    ok, detail = GV.gluon_row_child(case, "cpu")
    assert ok is None and detail.startswith("not run: the Gluon kernel did not launch (cpu tensors"), detail
    monkeypatch.setattr(GV, "GLUON_ROW_TIMEOUT_S", 0.01)
    ok, detail = GV.gluon_row_child(case, "cpu")
    assert ok is False and "no result within 0 s (child killed" in detail, detail
    calls = []
    monkeypatch.setattr(GV, "gluon_row_child", lambda c, d: calls.append(d) or (True, "stand-in"))
    rep = GV.Report("cuda")
    GV.check_gluon_stats(rep, GV.Plan(gluon_cases=_CASES[:2]), "cuda")
    assert calls == ["cuda", "cuda"] and [r.ok for r in rep.results] == [True, True]


def test_the_default_validation_rows_are_ones_the_gate_takes_on_sm90():
    """``check --gpu-validate`` runs :data:`GLUON_CASES` by default, and on sm_90 with this Triton the gate would
    take each of them (16-byte rows: D a multiple of 8), so a GPU run proves the kernel instead of skipping it."""
    assert GV.Plan().gluon_cases == GV.GLUON_CASES and len(GV.GLUON_CASES) >= 3
    assert {c[0] for c in GV.GLUON_CASES} == {"rows", "cols", "tri"}
    with CS.recording("sm90"):
        for _label, n, m, d, *_ in GV.GLUON_CASES:
            assert HG.fallback_reason(_meta(n, d), _meta(m or n, d), {}) is None, (n, m, d)
