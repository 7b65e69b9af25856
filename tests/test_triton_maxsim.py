"""The MaxSim (late interaction) kernels (``kernels/maxsim.py``, launchers ``core/maxsim/triton_maxsim.py``), run by
the interpreter (conftest.py sets TRITON_INTERPRET=1), against a float64 oracle written here from the
definition: the [N, M, Lq, Ld] similarities materialised in float64 from the same (16-bit rounded) inputs,
the first maximising token taken explicitly (the lowest index among equal maxima).

Every kernel output is pre-filled with NaN (``POISON_OUTPUTS``: an element a kernel forgets to write shows
up), the token inputs are views into NaN-padded buffers (an out-of-bounds read shows up; the views also
have non-contiguous batch / token strides), and in some cases the padding document tokens themselves are
NaN (the kernels must never read them). Tolerances are bounds on fp32 accumulation: each compared value
against ``rel * (the same sum of absolute values)``, with ``rel`` 1e-5 (the fp32 sums) except dd from
16-bit inputs, whose weighted one-hot operand is rounded to the input dtype once per term (2^-8 bf16,
2^-11 fp16). The argmax is compared with the oracle's wherever the best and second-best similarity differ
by more than the sims' error bound, and everywhere it must be a valid token within that bound of the
maximum; exact ties (dyadic inputs: every dot product is exact) must pick the lowest index.

The ahead-of-time test compiles the forward and both backward kernels for sm_80 / sm_90 at the ColBERT
shape (D = 128, Lq = 32, Ld = 180) in a fresh process (``tests/_compiles.py``).
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from fused_contrastive.core.maxsim import triton_maxsim as TMS
from fused_contrastive.core.triton_shared import launch as TL
from tests._compiles import assert_no_spills_within_smem, assert_tensor_cores, run_compile_script

EMPTY = -1e9


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(TL, "POISON_OUTPUTS", True)


# --- inputs -------------------------------------------------------------------------------------------

def _nan_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, L, D] as a view into a NaN buffer with one more token and three more columns per row."""
    b, l, d = x.shape
    buf = torch.full((b, l + 1, d + 3), float("nan"), dtype=x.dtype)
    buf[:, :l, :d] = x
    return buf[:, :l, :d]


def _problem(n, m, lq, ld, dim, dtype, seed, *, p_valid=0.7, empty=(), pad_q=1, float_w=True, nan_pad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, lq, dim, generator=g).to(dtype)
    d = torch.randn(m, ld, dim, generator=g).to(dtype)
    dv = torch.rand(m, ld, generator=g) < p_valid
    dv[:, 0] |= ~dv.any(1)  # non-empty unless listed
    for j in empty:
        dv[j] = False
    w = (torch.rand(n, lq, generator=g) * 2 - 0.5) if float_w else torch.ones(n, lq)
    if pad_q:
        w[:, lq - pad_q:] = 0.0  # padded query tokens
    if nan_pad:
        d = d.masked_fill(~dv[..., None], float("nan"))
    return q, d, w, dv


# --- the oracle ---------------------------------------------------------------------------------------

def _sims(q, d, dv):
    """float64 sims [N, M, Lq, Ld] (-inf at invalid tokens) and their absolute-value sums (error scale)."""
    q64, d64 = q.double().nan_to_num(), d.double().nan_to_num()
    sims = torch.einsum("nad,mbd->nmab", q64, d64).masked_fill(~dv[None, :, None, :], -math.inf)
    abs_ = torch.einsum("nad,mbd->nmab", q64.abs(), d64.abs())
    return sims, abs_


def _oracle(q, d, w, dv, scale):
    sims, abs_ = _sims(q, d, dv)
    top = sims.amax(-1)
    ld = d.shape[1]
    first = torch.where(sims == top[..., None], torch.arange(ld), ld).amin(-1)  # the lowest maximising index
    second = sims.scatter(-1, first.clamp(max=ld - 1)[..., None], -math.inf).amax(-1)
    empty = ~dv.any(1)
    first = first.masked_fill(empty[None, :, None], 0)
    best = top.masked_fill(empty[None, :, None], 0.0)
    w64 = w.double()
    s = torch.einsum("nma,na->nm", best, w64).masked_fill(empty[None, :], EMPTY)
    best_abs = abs_.gather(-1, first[..., None]).squeeze(-1)
    s_abs = torch.einsum("nma,na->nm", best_abs, w64.abs())
    return dict(sims=sims, abs=abs_, S=s, S_abs=s_abs, idx=first.permute(0, 2, 1), gap=(top - second).permute(0, 2, 1),
                lse=torch.logsumexp(float(scale) * s, dim=1), empty=empty)


def _grad_oracle(q, d, w, idx, G):
    """dq, dd in float64 from the definition for argmax indices ``idx`` [N, Lq, M], and their absolute sums."""
    oh = torch.nn.functional.one_hot(idx.long(), d.shape[1]).double()  # [N, Lq, M, Ld]
    q64, d64, w64, g64 = q.double().nan_to_num(), d.double().nan_to_num(), w.double(), G.double()
    dq = torch.einsum("namb,nm,na,mbd->nad", oh, g64, w64, d64)
    dq_abs = torch.einsum("namb,nm,na,mbd->nad", oh, g64.abs(), w64.abs(), d64.abs())
    dd = torch.einsum("namb,nm,na,nad->mbd", oh, g64, w64, q64)
    dd_abs = torch.einsum("namb,nm,na,nad->mbd", oh, g64.abs(), w64.abs(), q64.abs())
    return dq, dq_abs, dd, dd_abs


def _within(got, want, bound, what):
    err = (got.double() - want).abs()
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outside the bound; worst error "
                           f"{float(err[bad].max())} at bound {float(bound[bad].min()) if bound.dim() else bound}")


DD_REL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _run_and_check(q, d, w, dv, scale=1.5, *, G_mag=1.0, exact_idx=False, gather=None, seed=0):
    """Forward and backward on the kernels, every output against the oracle; returns (oracle, idx)."""
    scale_t = torch.tensor(scale) if not isinstance(scale, torch.Tensor) else scale
    S, idx, lse = TMS.maxsim_forward(_nan_view(q), _nan_view(d), w, dv, scale_t, EMPTY)
    o = _oracle(q, d, w, dv, float(scale_t))
    n, lq, _ = q.shape
    m, ld, _ = d.shape
    assert S.shape == (n, m) and S.dtype == torch.float32 and lse.shape == (n,) and lse.dtype == torch.float32
    assert idx.shape == (n, lq, m) and idx.dtype == (torch.int16 if ld < 2**15 else torch.int32)
    # scores: fp32 accumulation of exact products (16-bit inputs) or tf32x3 (fp32), empty documents exact
    _within(S, o["S"], 1e-5 * o["S_abs"] + 1e-30, "S")
    assert (S[:, o["empty"]] == torch.tensor(EMPTY, dtype=torch.float32)).all()
    # argmax: a valid token within the sims' error bound of the maximum everywhere; the oracle's first
    # maximum wherever the top two differ by more than twice that bound (exact ties: everywhere)
    i = idx.long()
    assert ((i >= 0) & (i < max(ld, 1))).all()
    ne = ~o["empty"]
    if ne.any():
        sims = o["sims"].permute(0, 2, 1, 3)[:, :, ne]  # [N, Lq, M', Ld]
        tol = 1e-5 * o["abs"].permute(0, 2, 1, 3)[:, :, ne].amax(-1)
        picked = sims.gather(-1, i[:, :, ne, None]).squeeze(-1)
        assert (picked >= sims.amax(-1) - tol).all(), "an argmax is not a (valid) maximum"
        sure = torch.ones_like(tol, dtype=torch.bool) if exact_idx else o["gap"][:, :, ne] > 2 * tol
        assert sure.float().mean() > 0.5, "the case compares too few indices"
        assert (i[:, :, ne][sure] == o["idx"][:, :, ne][sure]).all(), "not the first maximising token"
    assert (i[:, :, o["empty"]] == 0).all()
    # lse: the logsumexp of scale * S (the scores checked above), in float64
    want_lse = torch.logsumexp(float(scale_t) * S.double(), dim=1)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    # backward, upstream gradients 0 at empty documents; the oracle at the kernel's (checked) indices
    g = torch.Generator().manual_seed(seed + 100)
    G = torch.randn(n, m, generator=g) * G_mag
    G[:, o["empty"]] = 0.0
    dq, dd = TMS.maxsim_backward(_nan_view(q), _nan_view(d), w, idx, G, dv, gather=gather)
    assert dq.shape == (n, lq, q.shape[2]) and dd.shape == (m, ld, d.shape[2])
    assert dq.dtype == dd.dtype == torch.float32
    dq0, dq_abs, dd0, dd_abs = _grad_oracle(q, d, w, idx, G)
    _within(dq, dq0, 1e-5 * dq_abs + 1e-30, "dq")
    gs = float(G.abs().max() * w.abs().max())
    atol = gs * 2.0**-37 * n * lq if q.dtype == torch.float16 else 0.0  # fp16 subnormal terms (x PRESCALE)
    _within(dd, dd0, DD_REL[q.dtype] * dd_abs + atol + 1e-30, "dd")
    assert (dd[~dv] == 0).all(), "gradient on a padding token"
    return o, idx


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "onehot"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_random_masks_weights_and_an_empty_document(dtype, gather):
    # random doc masks, two padded query tokens, float weights (some negative), document 3 empty
    q, d, w, dv = _problem(7, 9, 6, 13, 24, dtype, 1, empty=(3,), pad_q=2)
    _run_and_check(q, d, w, dv, 2.5, gather=gather)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_d128(dtype):
    q, d, w, dv = _problem(4, 5, 5, 11, 128, dtype, 2, empty=(1,))
    _run_and_check(q, d, w, dv, 1.0)


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "onehot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_documents_longer_than_a_chunk(dtype, gather):
    # Ld = 150: three chunks of 64 tokens (the last partial); the padding tokens are NaN
    q, d, w, dv = _problem(4, 5, 8, 150, 16, dtype, 3, p_valid=0.5, empty=(4,), nan_pad=True)
    _run_and_check(q, d, w, dv, 0.7, gather=gather)


def test_several_query_groups_and_document_splits(monkeypatch):
    # Lq = 40 (LQ_PAD 64, two queries per program): three query groups, the last one partial; the
    # documents in three splits (LSEs merged by the launcher) and in one
    q, d, w, dv = _problem(5, 7, 40, 10, 16, torch.float32, 4, empty=(6,), pad_q=5)
    for splits in (3, 1):
        monkeypatch.setattr(TMS, "FWD_SPLITS", splits)
        _run_and_check(q, d, w, dv, 3.0)


def test_long_queries_one_per_program():
    # Lq = 130: LQ_PAD 256 > 128 rows, one query per program, 32-token chunks
    q, d, w, dv = _problem(2, 3, 130, 40, 16, torch.bfloat16, 5, pad_q=3)
    _run_and_check(q, d, w, dv, 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_small_upstream_gradients(dtype):
    # G ~ 1e-7 (a mean over many rows times softmax weights): fp16's operand needs gscale and PRESCALE
    q, d, w, dv = _problem(5, 6, 4, 9, 32, dtype, 6, empty=(0,))
    _run_and_check(q, d, w, dv, 1.0, G_mag=1e-7)


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "onehot"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_exact_ties_take_the_lowest_index(dtype, gather):
    """Duplicate document tokens (dyadic values: every similarity is exact in every dtype): the argmax is
    the lowest valid duplicate, within a chunk and across chunks (tokens 5, 9 and 70, 130), an invalid
    lower duplicate (token 2) is skipped, and the gradient goes to the chosen token only."""
    _check_exact_ties(dtype, gather)


def _check_exact_ties(dtype, gather):
    g = torch.Generator().manual_seed(7)
    n, m, lq, ld, dim = 3, 4, 6, 140, 16
    d = (torch.randint(-4, 5, (m, ld, dim), generator=g) / 4).to(dtype)
    dv = torch.rand(m, ld, generator=g) < 0.8
    for j in range(m):
        for b in (9, 70, 130):
            d[j, b] = d[j, 5]
        d[j, 2] = d[j, 5]
        dv[j, [5, 9, 70, 130]] = True
        dv[j, 2] = False
    q = torch.zeros(n, lq, dim, dtype=dtype)
    for i in range(n):
        for a in range(lq):
            # each query token aligned with some document's duplicated token (ties), or random
            q[i, a] = d[(i + a) % m, 5] * 2 if a % 2 == 0 else (torch.randint(-4, 5, (dim,), generator=g) / 4)
    w = torch.randint(0, 5, (n, lq), generator=g) / 4
    o, idx = _run_and_check(q, d, w, dv, 1.0, exact_idx=True, gather=gather)
    # not vacuous: many (query token, document) pairs tie at the duplicates, and index 5 wins them
    sims = o["sims"].permute(0, 2, 1, 3)
    tie = (sims[..., 5] == sims.amax(-1)) & (sims[..., 9] == sims[..., 5])
    assert tie.sum() >= n * lq // 2 and (idx.long()[tie] == 5).all()


def test_tiny_and_degenerate_shapes():
    # N = M = Lq = Ld = 1, D = 3 (padded to 16); then every document empty
    q, d, w, dv = _problem(1, 1, 1, 1, 3, torch.float32, 8, pad_q=0)
    _run_and_check(q, d, w, dv, 1.0)
    q, d, w, dv = _problem(2, 3, 2, 4, 8, torch.bfloat16, 9, pad_q=0)
    dv[:] = False
    S, idx, lse = TMS.maxsim_forward(q, d, w, dv, torch.tensor([2.0]), EMPTY)
    assert (S == torch.tensor(EMPTY, dtype=torch.float32)).all() and (idx == 0).all()
    torch.testing.assert_close(lse, torch.full((2,), 2.0 * EMPTY + math.log(3)), rtol=1e-6, atol=0)
    dq, dd = TMS.maxsim_backward(q, d, w, idx, torch.zeros(2, 3))
    assert (dq == 0).all() and (dd == 0).all()


@pytest.mark.parametrize("ld", [100, 250, 300])
def test_dd_chunks_per_program(ld):
    # dd's programs take up to BWD_D.chunks token chunks of 64: Ld = 100 (2 chunks, one program), 250 (4,
    # one), 300 (5: two programs of 3, the last chunk of the second beyond Ld)
    q, d, w, dv = _problem(2, 2, 5, ld, 16, torch.bfloat16, 30 + ld, p_valid=0.6)
    _run_and_check(q, d, w, dv, 1.0)


def test_int32_indices_past_32767_tokens(monkeypatch):
    # Ld = 2^15 + 256: int32 indices; the maximum of document 0 at token 33000 > 32767. Chunks of 1024
    # tokens (the interpreter's time goes per chunk and per program; the kernels take any power of two)
    monkeypatch.setattr(TMS, "FWD_32", TMS.FWD_32._replace(block_t=1024))
    monkeypatch.setattr(TMS, "BWD_D_32", TMS.BWD_D_32._replace(block_t=1024))
    n, m, lq, ld, dim = 1, 2, 2, (1 << 15) + 256, 16
    g = torch.Generator().manual_seed(10)
    q = torch.randn(n, lq, dim, generator=g)
    d = torch.randn(m, ld, dim, generator=g) * 0.01
    dv = torch.zeros(m, ld, dtype=torch.bool)
    dv[:, ::997] = True
    dv[0, 33000] = True
    d[0, 33000] = q[0, 0] * 3
    w = torch.ones(n, lq)
    S, idx, lse = TMS.maxsim_forward(q, d, w, dv, 1.0, EMPTY)
    o = _oracle(q, d, w, dv, 1.0)
    assert idx.dtype == torch.int32 and int(idx[0, 0, 0]) == 33000
    assert (idx.long() == o["idx"]).all()
    _within(S, o["S"], 1e-5 * o["S_abs"], "S")
    G = torch.tensor([[0.5, -2.0]])
    dq, dd = TMS.maxsim_backward(q, d, w, idx, G)
    dq0, _, dd0, _ = _grad_oracle(q, d, w, idx, G)
    torch.testing.assert_close(dq.double(), dq0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dd.double(), dd0, rtol=1e-5, atol=1e-6)


def test_scale_as_float_0dim_and_1element_tensor():
    q, d, w, dv = _problem(3, 4, 3, 7, 16, torch.float32, 11)
    outs = [TMS.maxsim_forward(q, d, w, dv, s, EMPTY)[2] for s in (-0.5, torch.tensor(-0.5), torch.tensor([-0.5]))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].double(), _oracle(q, d, w, dv, -0.5)["lse"], rtol=1e-5, atol=1e-5)


# --- the launch settings of a device sweep -------------------------------------------------------------

SETTINGS = [name for name, _ in TMS.sweep_settings()]


def test_sweep_settings_are_distinct_and_restored():
    named = TMS.sweep_settings()
    assert len(named) == len({n for n, _ in named}) <= 9 and {"baseline", "default"} <= {n for n, _ in named}
    # "default" is the module's defaults; every setting restores the attributes after its block
    before = {k: getattr(TMS, k) for _, st in named for k in st}
    assert all(getattr(TMS, k) == v for k, v in dict(named)["default"].items())
    for name, st in named:
        with TMS.settings(name) as got:
            assert got == st and all(getattr(TMS, k) == v for k, v in st.items())
        assert {k: getattr(TMS, k) for k in before} == before
    with pytest.raises(ValueError, match="unknown MaxSim setting"):
        with TMS.settings("nope"):
            pass
    with pytest.raises(ValueError, match="not attributes"):
        with TMS.settings({"NOPE": 1}):
            pass


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_sweep_setting_is_exact(setting):
    """Each setting of :func:`TMS.sweep_settings` on the cases that reach its differences: 16-bit inputs (its
    configs), random masks with an empty document and several query groups / document splits, documents of
    three chunks with NaN padding, exact ties within and across chunks (bf16, fp16: both dq forms), fp32
    (the layouts and the flat loop), and Ld = 0."""
    with TMS.settings(setting):
        q, d, w, dv = _problem(11, 9, 6, 13, 24, torch.bfloat16, 21, empty=(3,), pad_q=2)
        _run_and_check(q, d, w, dv, 2.5)
        q, d, w, dv = _problem(3, 4, 8, 150, 16, torch.bfloat16, 22, p_valid=0.5, empty=(2,), nan_pad=True)
        _run_and_check(q, d, w, dv, 0.7)
        _check_exact_ties(torch.float16, False)
        _check_exact_ties(torch.bfloat16, True)
        q, d, w, dv = _problem(3, 5, 3, 70, 16, torch.float32, 23, empty=(4,))
        _run_and_check(q, d, w, dv, 1.0)
        q, d, w = torch.randn(2, 4, 16).bfloat16(), torch.zeros(3, 0, 16).bfloat16(), torch.ones(2, 4)
        S, idx, lse = TMS.maxsim_forward(q, d, w, torch.zeros(3, 0, dtype=torch.bool), 1.0, EMPTY)
        assert (S == torch.tensor(EMPTY, dtype=torch.float32)).all() and idx.shape == (2, 4, 3) and (idx == 0).all()
        torch.testing.assert_close(lse, torch.full((2,), EMPTY + math.log(3)), rtol=1e-6, atol=0)


# --- ahead-of-time compiles ---------------------------------------------------------------------------

_COMPILE = textwrap.dedent(
    """
    import json
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from fused_contrastive.core.maxsim import triton_maxsim as TMS
    from fused_contrastive.tools import compile_survey

    DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def record(fam, dname, d, lq, gather, setting="default"):
        with TMS.settings(setting):
            return _record(fam, dname, d, lq, gather)

    def _record(fam, dname, d, lq, gather):
        meta, dt, n, ld = torch.device("meta"), DT[dname], 1024, 180
        q = torch.empty(n, lq, d, dtype=dt, device=meta)
        doc = torch.empty(n, ld, d, dtype=dt, device=meta)
        w = torch.empty(n, lq, device=meta)
        dv = torch.empty(n, ld, dtype=torch.bool, device=meta)
        with compile_survey.recording(fam) as launches:
            s, idx, lse = TMS.maxsim_forward(q, doc, w, dv, torch.empty((), device=meta), -1e9)
            TMS.maxsim_backward(q, doc, w, idx, torch.empty(n, n, device=meta), dv, gather=gather)
        return [x for x in launches if gather or x.name == "maxsim_bwd_query"]

    def key(launch):  # what the compiled code depends on: launches with one key compile to the same code
        return launch.name, compile_survey.source(launch).hash(), launch.num_warps, launch.num_stages

    def job(args):
        cc, fam, dname, d, lq, gather, i, setting = args
        out = compile_survey.compile_launch(record(fam, dname, d, lq, gather, setting)[i], cc)
        out.update(dtype=dname, d=d, lq=lq, gather=gather, setting=setting)
        return out

    if __name__ == "__main__":
        # the ColBERT shape (D = 128, Lq = 32, Ld = 180) in bf16 and fp32, every kernel and both forms of
        # dq; fp16; the forward's other regimes: D_PAD 256 resident (2 stages), D = 768 streamed in
        # chunks, Lq = 256 (one query per program, 32-token chunks)
        shapes = [("bf16", 128, 32), ("fp32", 128, 32), ("fp16", 128, 32), ("bf16", 256, 32), ("bf16", 768, 32),
                  ("fp32", 768, 32), ("bf16", 128, 256)]
        jobs = [(cc, fam, dn, d, lq, True, i, "default") for cc, fam in compile_survey.TARGETS for dn, d, lq in shapes
                for i in range(3) if i == 0 or (dn, d, lq) in shapes[:3]]
        jobs += [(cc, fam, dn, 128, 32, False, 0, "default") for cc, fam in compile_survey.TARGETS
                 for dn in ("bf16", "fp32")]
        # every other sweep setting at the ColBERT shape in bf16: the forward and dd (dq: the layouts)
        jobs += [(cc, fam, "bf16", 128, 32, True, i, name) for cc, fam in compile_survey.TARGETS
                 for name, _ in TMS.sweep_settings() if name != "default" for i in (0, 1, 2)
                 if i != 1 or name in ("baseline", "idx-nlm")]
        # a launch whose code is one already in the list is compiled once (its record copied)
        keys = [(j[0], key(record(*j[1:6], j[7])[j[6]])) for j in jobs]
        first = {}
        for n, k in enumerate(keys):
            first.setdefault(k, n)
        with ProcessPoolExecutor(max_workers=2) as ex:
            done = dict(zip(sorted(set(first.values())), ex.map(job, [jobs[n] for n in sorted(set(first.values()))])))
        out = []
        for n, (j, k) in enumerate(zip(jobs, keys)):
            r = dict(done[first[k]])
            r.update(dtype=j[2], d=j[3], lq=j[4], gather=j[5], setting=j[7])
            out.append(r)
        print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    return run_compile_script(_COMPILE, 600)


def test_maxsim_kernels_compile_for_sm80_and_sm90(compiled):
    have = {(r["kernel"], r["cc"], r["dtype"], r["d"], r["lq"], r["gather"]) for r in compiled
            if r["setting"] == "default"}
    colbert = {(k, cc, dn, 128, 32, True) for k in ("maxsim_fwd", "maxsim_bwd_query", "maxsim_bwd_doc")
               for cc in (80, 90) for dn in ("bf16", "fp32", "fp16")}
    onehot = {("maxsim_bwd_query", cc, dn, 128, 32, False) for cc in (80, 90) for dn in ("bf16", "fp32")}
    fwd = {("maxsim_fwd", cc, dn, d, lq, True) for cc in (80, 90)
           for dn, d, lq in (("bf16", 256, 32), ("bf16", 768, 32), ("fp32", 768, 32), ("bf16", 128, 256))}
    assert have == colbert | onehot | fwd, sorted(have ^ (colbert | onehot | fwd))
    swept = {(r["setting"], r["kernel"], r["cc"]) for r in compiled if r["setting"] != "default"}
    assert swept == {(name, k, cc) for name, _ in TMS.sweep_settings() if name != "default" for cc in (80, 90)
                     for k in ("maxsim_fwd", "maxsim_bwd_doc", "maxsim_bwd_query")
                     if k != "maxsim_bwd_query" or name in ("baseline", "idx-nlm")}
    assert_no_spills_within_smem(compiled)
    # the similarity matmul, the dd one-hot matmul and the one-hot form of dq on tensor cores; dq's
    # default gathers the argmax rows (fp32 FMAs, no matmul to put on tensor cores)
    gathers = [r for r in compiled if r["kernel"] == "maxsim_bwd_query" and r["gather"]]
    assert_tensor_cores([r for r in compiled if r not in gathers])
    assert all(r["tc"] == "none" for r in gathers)


# --- the untimed forms (FUSED_CONTRASTIVE_MAXSIM_FWD=overlap, FUSED_CONTRASTIVE_MAXSIM_DD=regs) -----------------

FORMS = {"fwd-overlap": dict(MAXSIM_FWD="overlap"), "dd-regs": dict(MAXSIM_DD="regs")}


def _both(q, d, w, dv, G):
    S, idx, lse = TMS.maxsim_forward(_nan_view(q), _nan_view(d), w, dv, 1.3, EMPTY)
    dq, dd = TMS.maxsim_backward(_nan_view(q), _nan_view(d), w, idx, G, dv)
    return S, idx, lse, dq, dd


@pytest.mark.parametrize("ld", [24, 70, 150])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_untimed_forms_against_the_oracle_and_bitwise_the_default(form, dtype, ld):
    """Each form through the switchboard: every output against the float64 oracle (``_run_and_check``), and
    bitwise the default form's (the same products, maxima and sums in the same order). Ld = 24: one chunk per
    document (the overlap form pads it to a pair with an empty chunk); 70: an odd number of chunks (bf16: 3 of 32;
    fp32: 2 of 64); 150: NaN padding tokens over several pairs. Ragged masks, an empty document, padded query
    tokens, several query groups and document splits."""
    from fused_contrastive import routes

    q, d, w, dv = _problem(12, 11, 8, ld, 32, dtype, 40 + ld, p_valid=0.6, empty=(4,), pad_q=2, nan_pad=ld == 150)
    G = torch.randn(12, 11, generator=torch.Generator().manual_seed(41))
    G[:, 4] = 0.0
    want = _both(q, d, w, dv, G)
    with routes.override(**FORMS[form]):
        assert TMS.fwd_overlap() == (form == "fwd-overlap") and TMS.dd_p_regs() == (form == "dd-regs")
        _run_and_check(q, d, w, dv, 1.3, seed=42)
        got = _both(q, d, w, dv, G)
    for name, a, b in zip(("S", "idx", "lse", "dq", "dd"), got, want, strict=True):
        assert torch.equal(a, b), f"{form}: {name} differs from the default form"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_overlap_form_ties_within_a_pair_of_chunks(dtype):
    """Exact ties between the two chunks of one merged pair (token 5 and the same position of the next chunk,
    5 + BLOCK_T), across pairs (tokens 5 and 5 + 2 BLOCK_T) and with an invalid lower duplicate: the lowest valid
    index wins, as in the default form."""
    from fused_contrastive import routes

    bt = TMS.FWD_32.block_t if dtype == torch.float32 else TMS.FWD_16.block_t
    g = torch.Generator().manual_seed(43)
    n, m, lq, ld, dim = 3, 4, 6, 5 + 2 * bt + 3, 16
    d = (torch.randint(-4, 5, (m, ld, dim), generator=g) / 4).to(dtype)
    dv = torch.rand(m, ld, generator=g) < 0.8
    for j in range(m):  # token 1: an invalid duplicate; 5 the first valid one
        for b in (5 + bt, 5 + 2 * bt, 1):
            d[j, b] = d[j, 5]
        dv[j, [5, 5 + bt, 5 + 2 * bt]] = True
        dv[j, 1] = False
    q = torch.stack([torch.stack([d[(i + a) % m, 5] * 2 for a in range(lq)]) for i in range(n)])
    w = torch.ones(n, lq)
    with routes.override(MAXSIM_FWD="overlap"):
        o, idx = _run_and_check(q, d, w, dv, 1.0, exact_idx=True)
    sims = o["sims"].permute(0, 2, 1, 3)
    tie = (sims[..., 5] == sims.amax(-1)) & (sims[..., 5 + bt] == sims[..., 5])
    assert tie.sum() >= n * lq // 2 and (idx.long()[tie] == 5).all()


def test_the_switchboard_selects_the_forms_per_call(monkeypatch):
    """FUSED_CONTRASTIVE_MAXSIM_FWD / _DD reach the launches (recorded on the meta device), read per call; unset,
    the defaults; an invalid value is an error naming the variable."""
    from fused_contrastive.tools import compile_survey

    def launched():
        meta = torch.device("meta")
        q, d = torch.empty(8, 4, 32, device=meta), torch.empty(8, 24, 32, device=meta)
        w, dv = torch.empty(8, 4, device=meta), torch.empty(8, 24, dtype=torch.bool, device=meta)
        with compile_survey.recording("sm90") as launches:
            s, idx, lse = TMS.maxsim_forward(q, d, w, dv, 1.0, EMPTY)
            TMS.maxsim_backward(q, d, w, idx, torch.empty(8, 8, device=meta), dv)
        c = {x.name: x.constexprs for x in launches}
        return c["maxsim_fwd"]["OVERLAP"], c["maxsim_fwd"]["FLAT"], c["maxsim_bwd_doc"]["P_REGS"]

    monkeypatch.delenv("FUSED_CONTRASTIVE_MAXSIM_FWD", raising=False)
    monkeypatch.delenv("FUSED_CONTRASTIVE_MAXSIM_DD", raising=False)
    assert launched() == (False, True, False)
    monkeypatch.setenv("FUSED_CONTRASTIVE_MAXSIM_FWD", "overlap")
    assert launched() == (True, True, False)
    monkeypatch.setenv("FUSED_CONTRASTIVE_MAXSIM_DD", "regs")
    monkeypatch.setattr(TMS, "FWD_FLAT", False)  # the overlap form is a flat loop whatever FWD_FLAT says
    assert launched() == (True, True, True)
    monkeypatch.setenv("FUSED_CONTRASTIVE_MAXSIM_FWD", "pairs")
    with pytest.raises(ValueError, match="FUSED_CONTRASTIVE_MAXSIM_FWD must be one of 'flat', 'overlap'"):
        launched()
