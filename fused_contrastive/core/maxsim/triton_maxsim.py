"""Triton path of late interaction (ColBERT's MaxSim): the launchers of ``fused_contrastive.kernels.maxsim``
(whose docstring has the math, the tie rule and the numerics). Plain functions, no autograd:

* :func:`maxsim_forward` ``(q, d, w, dvalid, scale, empty_score) -> (S, idx, lse)``;
* :func:`maxsim_backward` ``(q, d, w, idx, G) -> (dq, dd)``.

Shapes and dtypes: ``q`` [N, Lq, D], ``d`` [M, Ld, D] (fp32 / fp16 / bf16; both cast to their promoted
dtype; the inner dimension is made contiguous, other strides are passed to the kernels), ``w`` [N, Lq]
(read as fp32), ``dvalid`` [M, Ld] bool (False = padding token). Outputs: ``S`` [N, M] fp32
(``S_ij = sum_a w_ia max_{b valid} <q_ia, d_jb>``, ``empty_score`` for a document without a valid
token), ``idx`` [N, Lq, M] (the lowest maximising token index; 0 for an empty document; int16 for
Ld < 2^15, else int32; under :data:`IDX_T` the view ``permute(1, 2, 0)`` of an [M, N, Lq] tensor, which
the backward reads in place; any other layout it reads as [N, Lq, M] contiguous, copying if needed),
``lse`` [N] fp32 (``logsumexp_j scale * S_ij``, online in the forward kernel;
``scale`` a float or a 0-dim / 1-element tensor read by the kernel from its pointer: no host sync);
``dq`` [N, Lq, D] and ``dd`` [M, Ld, D] fp32.

Memory: nothing of size N*Lq*M*Ld; the forward allocates S, idx and an fp32 [splits, N] buffer of
per-split LSEs (merged by ``torch.logsumexp`` over the splits: fixed order, deterministic); the
backward allocates dq and dd only. Every output is allocated with ``triton_shared.launch._alloc`` (NaN-filled
under ``POISON_OUTPUTS``; the argmax with its dtype's minimum), and every launch goes through
``triton_shared/launch.py`` ``_launch`` (so ``tools.compile_survey.recording`` sees exactly these argument lists, and
``wrap_triton`` under tracing).

Work, in units of one N*Lq x M*Ld x D matmul (2 N Lq M Ld D FLOPs): forward 1 (tensor cores); backward
dd 1 (tensor cores, the weighted one-hot matmul); dq 1/Ld of a unit as fp32 FMAs on gathered rows
(``DQ_GATHER``, the default) or 1 unit as the one-hot matmul on tensor cores.

Launch configs (constants below, one per kernel and dtype class; the same on sm_80 and sm_90): the best
combination :func:`sweep_settings` timed (``routes.ROUTES``' MaxSim row; the runs: docs/gpu-measurements.md).
tests/test_triton_maxsim.py compiles them ahead of time for sm_80 / sm_90 (0 spills, shared
memory within the part's limit, mma.sync / wgmma) at the ColBERT shape D = 128, Lq = 32, Ld = 180 in
bf16 / fp16 / fp32, the forward's other regimes, and every sweep setting in bf16 at the ColBERT shape.
Registers below: bf16, D = 128, triton 3.9's ptxas (sm_80 / sm_90):

* forward, 16-bit (default 256 query-token rows x 32-token chunks, flat loop: 166 / 117 registers, 80 /
  88 KiB shared; described here at the former 128 x 64): 128 query-token rows (G = 128 / LQ_PAD queries;
  for 128 < Lq <= 256 one query of LQ_PAD rows and 32-token chunks) x 64-token chunks, 8 warps (two
  warpgroups: wgmma M = 64 each), the
  query rows resident for D_PAD <= 256 (one K chunk), 3 stages (2 above D_PAD 128: the resident rows and
  three staged document chunks would pass the A100's shared memory); larger D streams 64-wide chunks.
  The flat (document, chunk) loop (:data:`FWD_FLAT`): 161 / 123 registers, 65 / 80 KiB shared (the
  nested loops: 196 / 124). 256 rows x 32 tokens: 166 / 117; 256 x 64: 255 / 175; the rows as the
  register operand (:data:`FWD_Q_REGS`): 161 / 166, with 256 x 32: 166 / 174 (256 x 64 at 16 warps
  spilled 24 bytes on sm_80). fp32: 64 rows x 64 tokens x 16-wide D chunks, 8
  warps (tf32x3 splits each operand in two; 32-wide chunks spilled on sm_80).
* dq (gather): 64 rows x up to 128 columns (D chunks on a second grid axis), 8 warps, 64 / 76 registers
  with :data:`IDX_T` (80 / 80 without; 4 warps spilled 4 bytes on sm_90 at D = 64). The one-hot form:
  64 rows x 64 tokens x 128 columns, 8 warps (fp32: 64 x 32 x 32 at 4 warps; wider tiles spilled).
* dd: 64 tokens x 64 query rows per matmul step x up to 128 columns, one token chunk per program at 4
  warps (the default, measured fastest: 168 / 160 registers); the form with up to 4 token chunks of one
  document per program (3 at Ld = 180), 8 warps: 233 / 222 registers, 25 / 41 KiB shared, measured
  slower (143 ms against 110; 128 rows per step:
  255 / 249). fp32: 64 x 64 x 32-wide D chunks, one chunk per program, 4 warps (several chunks
  spilled 120 to 3600 bytes).
* untimed options (:data:`FWD_OVERLAP`, :data:`DD_P_REGS`; ``FUSED_CONTRASTIVE_MAXSIM_FWD`` /
  ``FUSED_CONTRASTIVE_MAXSIM_DD``): the forward's overlap form at the default tile, 210 / 223 registers (sm_90 /
  sm_80); dd's one-hot in the accumulator's layout, 128 / 168 (docs/maxsim.md, ``bench/maxsim_forms_compile.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ... import routes
from ...kernels import maxsim as KMS
from ..triton_shared import launch as TL
from ..triton_shared.configs import DTYPE_NAMES, d_pad

__all__ = ["DD_P_REGS", "DQ_GATHER", "FWD_FLAT", "FWD_OVERLAP", "FWD_Q_REGS", "FWD_SPLITS", "IDX_T", "dd_p_regs",
           "fwd_overlap", "maxsim_backward", "maxsim_forward", "settings", "sweep_settings"]


class MaxSimConfig(NamedTuple):
    """Tiles and launch options of one kernel: ``rows`` query-token rows per tile (the forward's
    target G * LQ_PAD), ``block_t`` document tokens, ``block_d`` the D chunk (0: D_PAD, resident);
    ``chunks`` (dd only) the most token chunks of one document per program (1 to 4)."""

    rows: int
    block_t: int
    block_d: int
    num_warps: int
    num_stages: int
    chunks: int = 1


#: 16-bit forward and dd configurations from two H100 sweeps (bench/results/h100-maxsim/sweep*.txt, N = M =
#: 4096, Lq = 32, Ld = 180, D = 128): 256 query rows x 32-token chunks (forward 111 ms against 122 at 128 x 64),
#: dd one 64-token chunk per program at 4 warps (110 ms; 3 chunks at 8 warps: 143)
FWD_16 = MaxSimConfig(256, 32, 0, 8, 3)
FWD_32 = MaxSimConfig(64, 64, 16, 8, 3)
#: The forward keeps the query rows resident up to this D_PAD (16-bit); above it, D chunks of 64.
FWD_RESIDENT_MAX_D = 256
BWD_Q = MaxSimConfig(64, 64, 128, 8, 2)
BWD_Q_DOT = MaxSimConfig(64, 64, 128, 8, 3)
BWD_Q_DOT_32 = MaxSimConfig(64, 32, 32, 4, 3)
BWD_D = MaxSimConfig(64, 64, 128, 4, 3, 1)
BWD_D_32 = MaxSimConfig(64, 64, 32, 4, 3)
#: Largest Lq (LQ_PAD rows of one query must fit one forward tile).
MAX_LQ = 256

#: dq by gathering each row's argmax token (fp32 FMAs, exact) instead of the one-hot matmul.
DQ_GATHER = True
#: Document splits of the forward (each program walks M / splits documents; the launcher merges the
#: splits' LSEs). None: enough programs for 2 per SM on a GPU (at most M), 2 under the interpreter (so
#: small tests merge splits).
FWD_SPLITS: int | None = None
#: The forward walks its split's (document, token chunk) pairs in one loop (the next document's loads
#: pipelined behind this one's last chunk and epilogue) instead of a loop over documents around a loop
#: over their chunks.
FWD_FLAT = True
#: The forward's resident query rows as the similarity matmul's register operand (wgmma reads only the
#: document tile from shared memory; more registers) instead of a shared-memory operand.
FWD_Q_REGS = False
#: The forward's overlap form (``FUSED_CONTRASTIVE_MAXSIM_FWD=overlap`` also selects it; untimed on a GPU, so off):
#: the flat loop over pairs of token chunks, the next chunk's matmul issued before this pair's max / argmax
#: reductions and document end (sm_90: an asynchronous wgmma in flight across them), the pair merged
#: elementwise before one reduction (the kernel docstring).
FWD_OVERLAP = False
#: dd's overlap of nothing but its operand: the weighted one-hot P built in the matmul accumulator's layout
#: (``FUSED_CONTRASTIVE_MAXSIM_DD=regs`` also selects it; untimed, so off), which the sm_90 wgmma reads as
#: its register operand with no trip through shared memory (the default form stores P to shared memory
#: and reads it back in the operand layout).
DD_P_REGS = False
#: The argmax stored document-major, ``[M, N * Lq]`` (returned as the ``[N, Lq, M]`` view
#: ``permute(1, 2, 0)``), and dd reads ``G^T``: the forward's stores of a program's rows and the
#: backward's loads of a block of rows for one document are contiguous (False: ``[N, Lq, M]``
#: contiguous, one 32-byte sector per element). The backward reads either layout (told apart by the
#: strides of the idx it is given), whatever this flag says then.
IDX_T = True

#: The configuration of commit 24a4e55 (the H100 run), for comparisons in one run. The kernels' code is
#: not quite that commit's: dd casts each row's coefficient once (a select per element, the same
#: rounding) and loads the argmax block one step ahead.
_BASELINE = dict(FWD_FLAT=False, IDX_T=False, FWD_Q_REGS=False, FWD_16=MaxSimConfig(128, 64, 0, 8, 3),
                 BWD_D=MaxSimConfig(64, 64, 128, 4, 3, 1), FWD_OVERLAP=False, DD_P_REGS=False)

_SMS = {"sm80": 108, "sm90": 132}  # recorded launches (meta tensors): A100, H100


def fwd_overlap() -> bool:
    """Whether the forward runs its overlap form: :data:`FWD_OVERLAP` or ``FUSED_CONTRASTIVE_MAXSIM_FWD=overlap``
    (read per call)."""
    return FWD_OVERLAP or routes.setting("MAXSIM_FWD") == "overlap"


def dd_p_regs() -> bool:
    """Whether dd builds its one-hot operand in the accumulator's layout: :data:`DD_P_REGS` or
    ``FUSED_CONTRASTIVE_MAXSIM_DD=regs`` (read per call)."""
    return DD_P_REGS or routes.setting("MAXSIM_DD") == "regs"


def _kernel_dtype(q: Tensor, d: Tensor) -> torch.dtype:
    for x in (q, d):
        if x.dtype not in DTYPE_NAMES:
            raise TypeError(f"the MaxSim kernels take float32, float16 or bfloat16 tokens, got {x.dtype}")
    return torch.promote_types(q.dtype, d.dtype)


def _tokens_ok(x: Tensor, dt: torch.dtype) -> Tensor:
    x = x.to(dt)
    return x if x.stride(2) == 1 or x.shape[2] <= 1 else x.contiguous()


def _check(q: Tensor, d: Tensor, w: Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or d.dim() != 3 or q.shape[2] != d.shape[2]:
        raise ValueError(f"q [N, Lq, D] and d [M, Ld, D] with one D, got {tuple(q.shape)} and {tuple(d.shape)}")
    n, lq, dim = q.shape
    m, ld, _ = d.shape
    if tuple(w.shape) != (n, lq):
        raise ValueError(f"w must be [N, Lq] = {[n, lq]}, got {tuple(w.shape)}")
    if lq > MAX_LQ:
        raise NotImplementedError(f"the MaxSim kernels take Lq <= {MAX_LQ} query tokens, got {lq}")
    return n, lq, m, ld, dim


def _alloc_index(shape, dtype: torch.dtype, device) -> Tensor:
    """``triton_shared.launch._alloc`` for the integer argmax: filled with the dtype's minimum (never a token
    index) under ``POISON_OUTPUTS``."""
    if TL.POISON_OUTPUTS:
        return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _is_idx_t(idx: Tensor) -> bool:
    """Whether ``idx`` [N, Lq, M] is the document-major layout of :data:`IDX_T` (``[M, N, Lq]`` contiguous,
    permuted); otherwise the backward reads it as ``[N, Lq, M]`` contiguous (copying it if it is not)."""
    return idx.permute(2, 0, 1).is_contiguous() and (IDX_T or not idx.is_contiguous())


def _splits(n_groups: int, m: int, dev: torch.device) -> int:
    if FWD_SPLITS is not None:
        want = FWD_SPLITS
    elif TL._RECORDER is not None or dev.type == "cuda":
        sms = _SMS[TL._RECORDER.arch] if TL._RECORDER is not None else TL._cuda_props(TL._index(dev))[1]
        want = triton.cdiv(2 * sms, n_groups)
    else:
        want = 2
    return max(1, min(m, want))


def _fwd_config(dt: torch.dtype, lq_pad: int, dim: int) -> tuple[MaxSimConfig, int, int, bool]:
    """(config, G, BLOCK_D, RESIDENT) of the forward."""
    dp = d_pad(dim)
    if dt == torch.float32:
        cfg = FWD_32
        block_d, resident = min(cfg.block_d, dp), cfg.block_d >= dp
    else:
        cfg = FWD_16
        resident = dp <= FWD_RESIDENT_MAX_D
        block_d = dp if resident else 64
        if dp > 128:
            cfg = cfg._replace(num_stages=2)
    if lq_pad > cfg.rows:  # one query per program: fewer tokens per chunk keep the tile's registers
        cfg = cfg._replace(block_t=max(16, cfg.block_t * cfg.rows // lq_pad))
    return cfg, max(1, cfg.rows // lq_pad), block_d, resident


def maxsim_forward(q: Tensor, d: Tensor, w: Tensor, dvalid: Tensor, scale, empty_score: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``(S [N, M] fp32, idx [N, Lq, M] int16 / int32, lse [N] fp32)``; see the module docstring."""
    n, lq, m, ld, dim = _check(q, d, w)
    if tuple(dvalid.shape) != (m, ld):
        raise ValueError(f"dvalid must be [M, Ld] = {[m, ld]}, got {tuple(dvalid.shape)}")
    dev = q.device
    dt = _kernel_dtype(q, d)
    q, d = _tokens_ok(q, dt), _tokens_ok(d, dt)
    w = w.to(device=dev, dtype=torch.float32).contiguous()
    dv = (dvalid if dvalid.dtype == torch.bool else dvalid != 0).contiguous().view(torch.uint8)
    idt = torch.int16 if ld < (1 << 15) else torch.int32
    s = TL._alloc((n, m), torch.float32, dev)
    if IDX_T:
        idx = _alloc_index((m, n, lq), idt, dev).permute(1, 2, 0)
    else:
        idx = _alloc_index((n, lq, m), idt, dev)
    if n == 0 or m == 0:
        return s, idx, torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    lq_pad = max(1, 1 << max(lq - 1, 0).bit_length())
    cfg, g, block_d, resident = _fwd_config(dt, lq_pad, dim)
    overlap = fwd_overlap()
    n_groups = triton.cdiv(n, g)
    splits = _splits(n_groups, m, dev)
    per = triton.cdiv(m, splits)
    splits = triton.cdiv(m, per)
    part = TL._alloc((splits, n), torch.float32, dev)
    TL._launch(TL.Launch(
        "maxsim_fwd", KMS.maxsim_fwd_kernel, (n_groups, splits),
        dict(Q=q, DOC=d, W=w, DV=dv, SCALE=TL._scale32(scale, dev), S=s, IDX=idx, LSE_PART=part,
             N=n, M=m, LQ=lq, LD=ld, D=dim, docs_per_split=per, stride_qn=q.stride(0), stride_qa=q.stride(1),
             stride_dm=d.stride(0), stride_dt=d.stride(1), empty_score=float(empty_score)),
        dict(G=g, LQ_PAD=lq_pad, BLOCK_T=cfg.block_t, BLOCK_D=block_d, RESIDENT=resident,
             FLAT=FWD_FLAT or overlap, IDX_T=IDX_T, Q_REGS=FWD_Q_REGS, UPCAST=TL._upcast(dt),
             DOT_PREC=TL._dot_prec(dt), OVERLAP=overlap),
        cfg.num_warps, cfg.num_stages))
    lse = part[0] if splits == 1 else torch.logsumexp(part, dim=0)
    return s, idx, lse


def maxsim_backward(q: Tensor, d: Tensor, w: Tensor, idx: Tensor, G: Tensor, dvalid: Tensor | None = None,
                    gather: bool | None = None) -> tuple[Tensor, Tensor]:
    """``(dq [N, Lq, D], dd [M, Ld, D])`` fp32 for the upstream gradient ``G`` [N, M] of S (0 at empty
    documents: the caller guarantees it) and the forward's ``idx``.

    ``gather`` (default :data:`DQ_GATHER`) picks dq's form (see the kernel docstring). ``dvalid`` is
    read only by the one-hot form of dq (``gather=False``), to keep padding tokens out of its loads;
    without it their values must be finite."""
    n, lq, m, ld, dim = _check(q, d, w)
    if tuple(idx.shape) != (n, lq, m) or tuple(G.shape) != (n, m):
        raise ValueError(f"idx must be [N, Lq, M] = {[n, lq, m]} and G [N, M], got {tuple(idx.shape)}, "
                         f"{tuple(G.shape)}")
    gather = DQ_GATHER if gather is None else bool(gather)
    dev = q.device
    dt = _kernel_dtype(q, d)
    q, d = _tokens_ok(q, dt), _tokens_ok(d, dt)
    w = w.to(device=dev, dtype=torch.float32).contiguous()
    g = G.to(device=dev, dtype=torch.float32).contiguous()
    idx_t = _is_idx_t(idx)
    if not idx_t:
        idx = idx.contiguous()
    dq = TL._alloc((n, lq, dim), torch.float32, dev)
    dd = TL._alloc((m, ld, dim), torch.float32, dev)
    rows = n * lq
    if rows == 0 or m == 0 or ld == 0 or dim == 0:
        return dq.zero_(), dd.zero_()
    dp = d_pad(dim)
    upcast, prec = TL._upcast(dt), TL._dot_prec(dt)
    has_dv = dvalid is not None and not gather
    dv = (dvalid != 0).contiguous().view(torch.uint8) if has_dv else w  # w: a stand-in, never read
    cfg = BWD_Q if gather else (BWD_Q_DOT_32 if dt == torch.float32 else BWD_Q_DOT)
    block_d = min(cfg.block_d, dp)
    TL._launch(TL.Launch(
        "maxsim_bwd_query", KMS.maxsim_bwd_query_kernel, (triton.cdiv(rows, cfg.rows), triton.cdiv(dim, block_d)),
        dict(DOC=d, W=w, IDX=idx, G=g, DV=dv, DQ=dq, N=n, M=m, LQ=lq, LD=ld, D=dim, stride_dm=d.stride(0),
             stride_dt=d.stride(1)),
        dict(ROWS=cfg.rows, BLOCK_T=cfg.block_t, BLOCK_D=block_d, GATHER=gather, IDX_T=idx_t, HAS_DV=has_dv,
             UPCAST=upcast, DOT_PREC=prec),
        cfg.num_warps, cfg.num_stages))
    # one global scale of the coefficients G_ij w_ia (device tensors, no sync): |P| <= PRESCALE
    gs = g.abs().amax() * w.abs().amax()
    gs = torch.where(gs > 0, gs, torch.ones_like(gs)).reshape(1)
    cfg = BWD_D_32 if dt == torch.float32 else BWD_D
    block_d = min(cfg.block_d, dp)
    chunks = triton.cdiv(ld, cfg.block_t)
    t_progs = triton.cdiv(chunks, max(1, min(4, cfg.chunks)))
    nt = triton.cdiv(chunks, t_progs)  # the fewest chunks per program for that many programs
    gt = g.t().contiguous() if idx_t else g  # [M, N]: a block of rows' coefficients for one j adjacent
    TL._launch(TL.Launch(
        "maxsim_bwd_doc", KMS.maxsim_bwd_doc_kernel,
        (m, t_progs, triton.cdiv(dim, block_d)),
        dict(Q=q, W=w, IDX=idx, G=gt, GSCALE=gs, DD=dd, N=n, M=m, LQ=lq, LD=ld, D=dim, stride_qn=q.stride(0),
             stride_qa=q.stride(1)),
        dict(ROWS=cfg.rows, BLOCK_T=cfg.block_t, BLOCK_D=block_d, NT=nt, IDX_T=idx_t, UPCAST=upcast, DOT_PREC=prec,
             PRESCALE=TL.prescale(dt), P_REGS=dd_p_regs()),
        cfg.num_warps, cfg.num_stages))
    return dq, dd


# --- settings for a device sweep ------------------------------------------------------------------------

def sweep_settings() -> list[tuple[str, dict[str, object]]]:
    """``(name, {module attribute: value})`` settings of the 16-bit kernels a GPU sweep should time
    (apply one with :func:`settings`; each names all the attributes it sets, so nothing is left over
    from another). The forward and dd kernels are timed separately, so one run of each setting answers
    for both; dq changes only with the layout (``idx-nlm``).

    * ``baseline``: the configuration of the first H100 run (commit 24a4e55: nested forward loops at
      128 x 64, idx [N, Lq, M], dd one 64-token chunk per program at 4 warps);
    * ``default``: the module's defaults, the best of two H100 sweeps (flat forward loop at 256 query
      rows x 32 tokens, idx [M, N*Lq], dd as the baseline): 247 ms against the baseline's 267 in one run;
    * ``fwd-nested``, ``idx-nlm``: ``default`` with the nested forward loops / the old idx layout;
    * ``fwd-r128t64``: 128 rows x 64 tokens (the flat loop measured 178 ms there, the nested 117-122);
    * ``dd-chunks3``: dd's programs take 3 token chunks of a document at 8 warps (143 ms; 110 with one);
    * ``fwd-overlap``, ``dd-regs``: ``default`` with the forward's overlap form / dd's one-hot operand in the
      accumulator's layout (:data:`FWD_OVERLAP`, :data:`DD_P_REGS`; untimed, compile figures in docs/maxsim.md).
    """
    best = dict(FWD_FLAT=True, IDX_T=True, FWD_Q_REGS=False, FWD_16=MaxSimConfig(256, 32, 0, 8, 3),
                BWD_D=MaxSimConfig(64, 64, 128, 4, 3, 1), FWD_OVERLAP=False, DD_P_REGS=False)
    return [
        ("baseline", dict(_BASELINE)),
        ("default", dict(best)),
        ("fwd-nested", dict(best, FWD_FLAT=False)),
        ("idx-nlm", dict(best, IDX_T=False)),
        ("fwd-r128t64", dict(best, FWD_16=MaxSimConfig(128, 64, 0, 8, 3))),
        ("dd-chunks3", dict(best, BWD_D=MaxSimConfig(64, 64, 128, 8, 3, 4))),
        ("fwd-overlap", dict(best, FWD_OVERLAP=True)),
        ("dd-regs", dict(best, DD_P_REGS=True)),
    ]


@contextlib.contextmanager
def settings(setting: str | dict[str, object]) -> Iterator[dict[str, object]]:
    """Within the block, this module's attributes as in ``setting`` (a name of :func:`sweep_settings` or
    a dict of attribute -> value); restored after."""
    if isinstance(setting, str):
        named = dict(sweep_settings())
        if setting not in named:
            raise ValueError(f"unknown MaxSim setting {setting!r}; valid: {sorted(named)}")
        setting = named[setting]
    g = globals()
    unknown = [k for k in setting if k not in g or k.startswith("__")]
    if unknown:
        raise ValueError(f"not attributes of the MaxSim launcher: {unknown}")
    old = {k: g[k] for k in setting}
    g.update(setting)
    try:
        yield dict(setting)
    finally:
        g.update(old)
