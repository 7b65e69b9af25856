"""Triton device code of late interaction (ColBERT's MaxSim) scores, forward and backward (host side:
``fused_contrastive/core/maxsim/triton_maxsim.py``; launch configs there).

Inputs: query tokens ``q`` [N, Lq, D] and document tokens ``d`` [M, Ld, D] (fp32 / fp16 / bf16, one
dtype; the inner dimension contiguous, any token / batch strides), query-token weights ``w`` [N, Lq]
fp32 (0 on padding; any float), document-token validity ``dvalid`` [M, Ld] (bool read as uint8; False
= padding, excluded from the maximum)::

    sim_iajb = <q_ia, d_jb>                                  (fp32 accumulation; never stored)
    idx_iaj  = min { b : dvalid_jb, sim_iajb = max_{b' : dvalid_jb'} sim_iajb' }   (0 for an empty j)
    S_ij     = sum_a w_ia sim_{ia j idx_iaj}                 (empty_score for an empty document j)
    LSE_i    = log sum_j exp(s S_ij)                         (s: the runtime scale, a pointer)

Tie rule: among equal maxima the lowest token index b wins (within a chunk of BLOCK_T tokens the
smallest index equal to the chunk maximum; across chunks only a strictly larger maximum replaces the
running one, so an earlier chunk keeps a tie). The backward routes each term's gradient to that one
token. Empty document (no valid token): ``S_ij = empty_score``, ``idx = 0``, gradient 0 (the host
passes ``G_ij = 0``; the kernels also skip every term whose coefficient is 0).

Backward, for the upstream gradient ``G_ij = dL/dS_ij`` [N, M] fp32::

    dq_ia = w_ia sum_j G_ij d_{j, idx_iaj}                    [N, Lq, D] fp32
    dd_jb = sum_{(i, a) : idx_iaj = b} G_ij w_ia q_ia         [M, Ld, D] fp32   (0 on invalid tokens)

Kernels:

* ``maxsim_fwd_kernel``  one program per (group of G queries, split of the documents): its G * LQ_PAD
  query-token rows (LQ_PAD = next power of two >= Lq; rows a >= Lq are padding) stay resident (or are
  re-read per D chunk) while it walks its documents; per document, per chunk of BLOCK_T tokens, the
  [rows, BLOCK_T] similarity tile is one ``tl.dot`` (tensor cores), invalid tokens are set to -inf,
  and the running maximum / first argmax per row are updated (a max, then the min of the indices
  equal to it, per chunk). At the end of a document the rows' ``w * max`` are summed per query (a
  reshape to [G, LQ_PAD]) and S, idx are stored, and the online LSE of ``s S_ij`` (running max and
  sum per query) is updated; the split's LSE is stored in ``LSE_PART[split, i]`` and the launcher
  merges the splits with ``logsumexp`` (fixed order). FLAT: one loop over the split's (document,
  chunk) pairs, cdiv(Ld, BLOCK_T) chunks per document (at least 1), the end-of-document step under a
  branch on the last chunk, so the software pipeline (num_stages) runs across documents; otherwise a
  loop over documents around a loop over their chunks (the pipeline refills per document). Q_REGS
  (resident rows only): the rows are the matmul's register operand (sm_90 wgmma then reads only the
  document tile from shared memory; more registers) instead of a shared-memory operand.
  Work: one N*Lq x M*Ld x D matmul (2 N Lq M Ld D FLOPs, Ld rounded up to BLOCK_T, Lq to LQ_PAD).
  Traffic: every program reads every document of its split, cdiv(N, G) M Ld D elements in all (e.g.
  N/4 of them at Lq = 32 and 128 rows); each query row once per split.
* ``maxsim_bwd_query_kernel``  one program per (block of ROWS query-token rows, D chunk), over all
  documents. GATHER (the default): per document the row's argmax token ``d_{j, idx}`` is loaded
  directly (a gather of ROWS rows of BLOCK_D elements) and ``acc += G_ij d_{j, idx}`` in fp32 FMAs:
  exact to fp32 rounding, N Lq M D FMAs and no matmul (1/Ld of the forward's work). Without GATHER,
  the tensor-core form: per chunk of BLOCK_T tokens ``tmp += onehot(idx) @ d_chunk`` (the one-hot in
  the operand dtype is exact, so tmp is d_{j, idx} exactly), then ``acc += G_ij tmp`` per document:
  one unit of the forward's matmul. Traffic (gather): N Lq M argmax rows of D elements, and the
  argmax itself (contiguous per document with IDX_T, else one 32-byte sector per element).
* ``maxsim_bwd_doc_kernel``  one program per (document j, NT chunks of BLOCK_T tokens, D chunk), over
  all N*Lq query-token rows in blocks of ROWS: ``acc_k [BLOCK_T, BLOCK_D] += P_k^T @ q_rows`` for its
  NT (1 to 4) chunks with the weighted one-hot ``P^T_tr = [idx_rj = t] G_ij w_r`` built in registers
  (one tensor-core matmul, the same work as the forward, Ld rounded up to NT BLOCK_T per program).
  ``P`` is the matmul operand, so it is in the input dtype: the coefficients are divided by one
  global ``gscale = max|G| max|w|`` and multiplied by the power of two PRESCALE (2^13 for fp16, else 1)
  and cast once per row, and the fp32 epilogue multiplies by ``gscale / PRESCALE``: each term is
  rounded once to the operand dtype (relative 2^-9 for bf16, 2^-12 for fp16; fp32 uses tf32x3,
  ~fp32), like the gradient tiles of the core kernels (``lse._accumulate``). Traffic: every program
  reads all N Lq query rows (its D chunk), so the rows are read M cdiv(cdiv(Ld, BLOCK_T), NT) times
  in all (NT = 3 at Ld = 180, BLOCK_T = 64: M times, a third of NT = 1), and the argmax column of its
  document (contiguous with IDX_T; else one 32-byte sector per element), loaded one block ahead.

Deterministic: no atomics; every output element has one owning program and a fixed summation order.
Memory: nothing of size N*Lq*M*Ld exists; the forward writes S [N, M] fp32, idx (int16 for Ld < 2^15,
else int32) and LSE_PART [splits, N]; the backward reads them back (no recompute). IDX_T (a constexpr
of every kernel): idx is stored document-major, [M, N*Lq] (element (r = i Lq + a, j) at j N Lq + r),
and dd reads G^T [M, N]; otherwise idx is [N*Lq, M] and G [N, M]. Offsets of N*Lq*M and N*Lq*D are
int64.

Numerics: fp32 accumulation; 16-bit products are exact in fp32, fp32 inputs use ``tf32x3`` dots
(~fp32). NaN similarities: ``tl.max`` ignores NaN (GPU maxnum, interpreter nanmax), so a NaN token
is skipped by the maximum where the document has a finite one (NaN inputs are otherwise unspecified,
unlike the reference, which propagates them). Invalid document tokens and the tile's rows a >= Lq
are loaded as 0 (masked loads: their memory is never read), so NaN / garbage document padding is
harmless. Query tokens with w = 0 are read in the forward (their idx is the definition's, and
``0 * max`` is NaN for a NaN token, as in the definition); in the backward, terms with a zero
coefficient (w = 0 or G = 0) load nothing.

Tested under the CPU interpreter (tests/test_triton_maxsim.py, float64 oracle; every setting of
``triton_maxsim.sweep_settings()``) and by ahead-of-time compilation for sm_80 / sm_90; every setting ran on an H100 too
(bench/gpu_maxsim.py --sweep: bf16 parity against the float64 oracle and the timings in
bench/results/h100-maxsim/).

Interpreter: its bf16 ``tl.dot`` is wrong, so UPCAST (bf16 under ``TRITON_INTERPRET=1`` only) casts
the bf16 tiles to fp32 before each dot (the values are bf16 either way); its fp32 -> bf16 cast does not
round to nearest either, so the one rounded operand (dd's P) is rounded by ``_rne_bf16`` there.
"""

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
BIG_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _rne_bf16(x):
    """fp32 x rounded to bf16 (nearest, ties to even), kept in fp32: the interpreter's own bf16 cast does
    not round to nearest (errors up to ~2^-7), so UPCAST rounds the bf16 operand with this instead."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _doc_tile(d_base, stride_dt, t, tv, dk, D, UPCAST: tl.constexpr):
    """Document tokens t [BLOCK_T] x columns dk [BLOCK_D]; invalid tokens and columns >= D read as 0."""
    x = tl.load(d_base + t.to(tl.int64)[:, None] * stride_dt + dk[None, :], mask=tv[:, None] & (dk < D)[None, :],
                other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_chunk(q, q_base, rmask, DOC, DV, j, t0, LD, D, stride_dm, stride_dt, dk, best, arg, nvalid,
               ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, RESIDENT: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """The forward's step: the similarities of the rows with tokens [t0, t0 + BLOCK_T) of document j
    (fp32, one ``tl.dot``; invalid tokens -inf), folded into the running maximum / first argmax."""
    d_base = DOC + tl.cast(j, tl.int64) * stride_dm
    t = t0 + tl.arange(0, BLOCK_T)
    tv = tl.load(DV + tl.cast(j, tl.int64) * LD + t, mask=t < LD, other=0) != 0
    nvalid += tv.to(tl.int32)
    sims = tl.zeros([ROWS, BLOCK_T], dtype=tl.float32)
    if RESIDENT:
        sims = tl.dot(q, tl.trans(_doc_tile(d_base, stride_dt, t, tv, dk, D, UPCAST)), sims,
                      input_precision=DOT_PREC)
    else:
        for d0 in range(0, D, BLOCK_D):
            dc = d0 + dk
            qc = tl.load(q_base[:, None] + dc[None, :], mask=rmask[:, None] & (dc < D)[None, :], other=0.0)
            if UPCAST:
                qc = qc.to(tl.float32)
            sims = tl.dot(qc, tl.trans(_doc_tile(d_base, stride_dt, t, tv, dc, D, UPCAST)), sims,
                          input_precision=DOT_PREC)
    # running maximum and first argmax: the lowest index among the chunk's maxima, and an earlier
    # chunk keeps a tie (strictly greater replaces)
    sims = tl.where(tv[None, :], sims, NEG_INF)
    cmax = tl.max(sims, axis=1)
    carg = tl.min(tl.where(sims == cmax[:, None], t[None, :], BIG_INDEX), axis=1)
    upd = cmax > best
    return tl.where(upd, cmax, best), tl.where(upd, carg, arg), nvalid


@triton.jit
def _fwd_doc_end(S, idx_base, stride_ij, j, M, w, rmask, best, arg, nvalid, gi, gmask, s, empty_score, m_l, z_l,
                 G: tl.constexpr, LQ_PAD: tl.constexpr):
    """The end of document j: S_ij = sum_a w_ia max_b sim (empty document: empty_score, idx 0) stored
    with idx, and the online LSE of s S_ij updated (running max m, sum z; exp(-inf - -inf) guarded)."""
    nonempty = tl.max(nvalid, axis=0) > 0
    contrib = w * tl.where(rmask & nonempty, best, 0.0)
    sc = tl.sum(tl.reshape(contrib, [G, LQ_PAD]), axis=1)
    sc = tl.where(nonempty, sc, empty_score)
    tl.store(S + gi.to(tl.int64) * M + j, sc, mask=gmask)
    tl.store(idx_base + tl.cast(j, tl.int64) * stride_ij, arg.to(idx_base.dtype.element_ty), mask=rmask)
    x = sc * s
    m_new = tl.maximum(m_l, x)
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    z_l = z_l * tl.exp(m_l - m_safe) + tl.exp(x - m_safe)
    return m_new, z_l



@triton.jit
def maxsim_fwd_kernel(
    Q, DOC, W, DV, SCALE, S, IDX, LSE_PART,
    N, M, LQ, LD, D, docs_per_split,
    stride_qn, stride_qa, stride_dm, stride_dt, empty_score,
    G: tl.constexpr, LQ_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    RESIDENT: tl.constexpr, FLAT: tl.constexpr, IDX_T: tl.constexpr, Q_REGS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """S [N, M], IDX ([M, N * Lq] with IDX_T, else [N * Lq, M]) for documents [split * docs_per_split, ...)
    of queries [pid G, pid G + G), and LSE_PART[split, i] (grid: (cdiv(N, G), splits)). W [N, Lq] fp32,
    DV [M, Ld] uint8 contiguous.

    RESIDENT: BLOCK_D >= D, the [G * LQ_PAD, BLOCK_D] query rows are loaded once (Q_REGS: kept as the
    dot's register operand); otherwise every similarity tile streams D in BLOCK_D chunks (both operands
    re-read; fp32 inputs). FLAT: one loop over (document, chunk) pairs (see the module docstring).
    """
    ROWS: tl.constexpr = G * LQ_PAD
    pid = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.load(SCALE).to(tl.float32)
    # 1. this program's query-token rows: row r is token r % LQ_PAD of query pid * G + r // LQ_PAD
    r = tl.arange(0, ROWS)
    qi = pid * G + r // LQ_PAD
    qa = r % LQ_PAD
    rmask = (qi < N) & (qa < LQ)
    flat = qi.to(tl.int64) * LQ + qa  # the row of [N * Lq]: W, IDX
    q_base = Q + qi.to(tl.int64) * stride_qn + qa.to(tl.int64) * stride_qa
    w = tl.load(W + flat, mask=rmask, other=0.0)
    if IDX_T:  # IDX [M, N * Lq]: the element (r, j) at j * N * Lq + r
        idx_base = IDX + flat
        stride_ij = N * LQ
    else:  # IDX [N * Lq, M]
        idx_base = IDX + flat * M
        stride_ij = 1
    dk = tl.arange(0, BLOCK_D)
    if RESIDENT:
        q = tl.load(q_base[:, None] + dk[None, :], mask=rmask[:, None] & (dk < D)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if Q_REGS:  # not a load's result: the compiler keeps the dot's A operand in registers (wgmma)
            q = tl.where(rmask[:, None], q, tl.zeros_like(q))
    else:
        q = 0.0  # unused: the chunks re-read the rows
    gi = pid * G + tl.arange(0, G)
    gmask = gi < N
    m_l = tl.full([G], NEG_INF, tl.float32)  # online LSE of s S_ij over this split's documents
    z_l = tl.zeros([G], dtype=tl.float32)
    j_lo = split * docs_per_split
    j_hi = tl.minimum(j_lo + docs_per_split, M)
    if FLAT:
        # one loop over the split's (document, token chunk) pairs: the loads of the next document's
        # first chunk are software-pipelined behind the current document's last chunk and epilogue
        cpd = tl.maximum(tl.cdiv(LD, BLOCK_T), 1)  # chunks per document (one masked chunk for Ld = 0)
        best = tl.full([ROWS], NEG_INF, tl.float32)
        arg = tl.zeros([ROWS], dtype=tl.int32)
        nvalid = tl.zeros([BLOCK_T], dtype=tl.int32)
        for c in range(0, (j_hi - j_lo) * cpd):
            jd = c // cpd
            k = c - jd * cpd
            j = j_lo + jd
            best, arg, nvalid = _fwd_chunk(q, q_base, rmask, DOC, DV, j, k * BLOCK_T, LD, D, stride_dm, stride_dt,
                                           dk, best, arg, nvalid, ROWS, BLOCK_T, BLOCK_D, RESIDENT, UPCAST, DOT_PREC)
            if k == cpd - 1:
                m_l, z_l = _fwd_doc_end(S, idx_base, stride_ij, j, M, w, rmask, best, arg, nvalid, gi, gmask, s,
                                        empty_score, m_l, z_l, G, LQ_PAD)
                best = tl.full([ROWS], NEG_INF, tl.float32)
                arg = tl.zeros([ROWS], dtype=tl.int32)
                nvalid = tl.zeros([BLOCK_T], dtype=tl.int32)
    else:
        for j in range(j_lo, j_hi):
            best = tl.full([ROWS], NEG_INF, tl.float32)
            arg = tl.zeros([ROWS], dtype=tl.int32)
            nvalid = tl.zeros([BLOCK_T], dtype=tl.int32)
            for t0 in range(0, LD, BLOCK_T):
                best, arg, nvalid = _fwd_chunk(q, q_base, rmask, DOC, DV, j, t0, LD, D, stride_dm, stride_dt, dk,
                                               best, arg, nvalid, ROWS, BLOCK_T, BLOCK_D, RESIDENT, UPCAST, DOT_PREC)
            m_l, z_l = _fwd_doc_end(S, idx_base, stride_ij, j, M, w, rmask, best, arg, nvalid, gi, gmask, s,
                                    empty_score, m_l, z_l, G, LQ_PAD)
    zero = z_l == 0.0  # no document in this split (or every s S_ij = -inf): LSE = -inf, without log(0)
    lse = tl.where(zero, NEG_INF, m_l + tl.log(tl.where(zero, 1.0, z_l)))
    tl.store(LSE_PART + tl.cast(split, tl.int64) * N + gi, lse, mask=gmask)


@triton.jit
def maxsim_bwd_query_kernel(
    DOC, W, IDX, G, DV, DQ,
    N, M, LQ, LD, D, stride_dm, stride_dt,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr, IDX_T: tl.constexpr,
    HAS_DV: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dq_ia = w_ia sum_j G_ij d_{j, idx_iaj} for ROWS flat query-token rows r = i * Lq + a and columns
    [pid_d BLOCK_D, ...) (grid: (cdiv(N * Lq, ROWS), cdiv(D, BLOCK_D))); DQ [N * Lq, D] fp32; IDX
    [M, N * Lq] (IDX_T: a block of rows contiguous per document) or [N * Lq, M]; G [N, M].

    GATHER: the argmax rows are loaded directly (fp32 FMAs, no matmul). Otherwise the one-hot matmul
    over every token chunk (tensor cores); HAS_DV then masks invalid tokens out of the loaded chunks
    (their memory is never read), without it every token of the chunk is read (finite padding needed).
    """
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    nr = N * LQ
    r = pid * ROWS + tl.arange(0, ROWS)
    rmask = r < nr
    r64 = r.to(tl.int64)
    qi = r // LQ
    dk = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dk < D
    w = tl.load(W + r64, mask=rmask, other=0.0)
    live_r = rmask & (w != 0.0)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    idx_t = IDX + r  # IDX_T: the rows' indices of document j at idx_t + j * N * Lq
    for j in range(0, M):
        d_base = DOC + tl.cast(j, tl.int64) * stride_dm
        if IDX_T:
            b = tl.load(idx_t, mask=rmask, other=0).to(tl.int32)
            idx_t += nr
        else:
            b = tl.load(IDX + r64 * M + j, mask=rmask, other=0).to(tl.int32)
        g = tl.load(G + qi.to(tl.int64) * M + j, mask=rmask, other=0.0)
        live = live_r & (g != 0.0)  # G_ij = 0 (an empty document): nothing loaded, no term
        if GATHER:
            x = tl.load(d_base + b.to(tl.int64)[:, None] * stride_dt + dk[None, :],
                        mask=live[:, None] & dmask[None, :], other=0.0)
            acc += g[:, None] * x.to(tl.float32)
        else:
            tmp = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for t0 in range(0, LD, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tv = t < LD
                if HAS_DV:
                    tv = tv & (tl.load(DV + tl.cast(j, tl.int64) * LD + t, mask=tv, other=0) != 0)
                hot = (b[:, None] == t[None, :]) & live[:, None]
                oh = tl.where(hot, 1.0, 0.0).to(DOC.dtype.element_ty)  # exact in every operand dtype
                if UPCAST:
                    oh = oh.to(tl.float32)
                tmp = tl.dot(oh, _doc_tile(d_base, stride_dt, t, tv, dk, D, UPCAST), tmp, input_precision=DOT_PREC)
            acc += g[:, None] * tmp
    tl.store(DQ + r64[:, None] * D + dk[None, :], acc * w[:, None], mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _dd_step(acc, t, b, cb, x, DOT_PREC: tl.constexpr):
    """acc [BLOCK_T, BLOCK_D] += P^T @ x with the weighted one-hot ``P^T_tr = [b_r = t] cb_r`` (cb already
    in the operand dtype: a select, no per-element cast)."""
    p = tl.where(t[:, None] == b[None, :], cb[None, :], tl.zeros_like(cb)[None, :])
    return tl.dot(p, x, acc, input_precision=DOT_PREC)


@triton.jit
def maxsim_bwd_doc_kernel(
    Q, W, IDX, G, GSCALE, DD,
    N, M, LQ, LD, D, stride_qn, stride_qa,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NT: tl.constexpr, IDX_T: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr,
):
    """dd_jb = sum_{(i, a): idx_iaj = b} G_ij w_ia q_ia for the NT chunks of BLOCK_T tokens from
    pid_t NT BLOCK_T of document j and columns [pid_d BLOCK_D, ...) (grid: (M, cdiv(cdiv(Ld, BLOCK_T), NT),
    cdiv(D, BLOCK_D))); DD [M, Ld, D] fp32. NT in 1..4: each loaded block of query rows (and its argmax
    indices / coefficients) serves NT accumulators, so the rows are re-read cdiv(Ld, NT BLOCK_T) times
    per document instead of cdiv(Ld, BLOCK_T).

    Over all N * Lq query-token rows in blocks of ROWS: ``acc_k += P_k^T @ q_rows``, ``P^T_tr = [idx_rj = t]
    c_r``, ``c_r = G_ij w_r PRESCALE / gscale`` rounded once to the operand dtype; the epilogue multiplies
    by gscale / PRESCALE.
    """
    tl.static_assert(NT >= 1 and NT <= 4)
    j = tl.program_id(0)  # neighbouring programs read the same lines of IDX
    pid_t = tl.program_id(1)
    pid_d = tl.program_id(2)
    t = pid_t * (NT * BLOCK_T) + tl.arange(0, BLOCK_T)
    dk = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dk < D
    gs = tl.load(GSCALE)
    mult = PRESCALE / gs
    nr = N * LQ
    acc0 = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if NT > 1:
        acc1 = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if NT > 2:
        acc2 = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if NT > 3:
        acc3 = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    b_next = _dd_index(IDX, j, tl.arange(0, ROWS), nr, M, IDX_T)
    for r0 in range(0, nr, ROWS):
        r = r0 + tl.arange(0, ROWS)
        rmask = r < nr
        r64 = r.to(tl.int64)
        qi = r // LQ
        qa = r - qi * LQ
        # the argmax of this block, loaded one step ahead (a plain load: the pipeliner leaves it
        # synchronous in the loop), and the next block's
        b = b_next
        b_next = _dd_index(IDX, j, r + ROWS, nr, M, IDX_T)
        if IDX_T:  # G^T [M, N]: contiguous in r
            g = tl.load(G + (tl.cast(j, tl.int64) * N + qi), mask=rmask, other=0.0)
        else:  # G [N, M]
            g = tl.load(G + qi.to(tl.int64) * M + j, mask=rmask, other=0.0)
        w = tl.load(W + r64, mask=rmask, other=0.0)
        c = g * w * mult
        live = rmask & (c != 0.0)  # rows without a term load nothing (and their c is 0)
        x = tl.load(Q + qi.to(tl.int64)[:, None] * stride_qn + qa.to(tl.int64)[:, None] * stride_qa + dk[None, :],
                    mask=live[:, None] & dmask[None, :], other=0.0)
        if UPCAST:  # interpreter, bf16: the operand rounded as the GPU's cast rounds it
            cb = _rne_bf16(c)
            x = x.to(tl.float32)
        else:
            cb = c.to(Q.dtype.element_ty)
        acc0 = _dd_step(acc0, t, b, cb, x, DOT_PREC)
        if NT > 1:
            acc1 = _dd_step(acc1, t + BLOCK_T, b, cb, x, DOT_PREC)
        if NT > 2:
            acc2 = _dd_step(acc2, t + 2 * BLOCK_T, b, cb, x, DOT_PREC)
        if NT > 3:
            acc3 = _dd_step(acc3, t + 3 * BLOCK_T, b, cb, x, DOT_PREC)
    _dd_store(DD, acc0 * (gs / PRESCALE), j, t, dk, dmask, LD, D)
    if NT > 1:
        _dd_store(DD, acc1 * (gs / PRESCALE), j, t + BLOCK_T, dk, dmask, LD, D)
    if NT > 2:
        _dd_store(DD, acc2 * (gs / PRESCALE), j, t + 2 * BLOCK_T, dk, dmask, LD, D)
    if NT > 3:
        _dd_store(DD, acc3 * (gs / PRESCALE), j, t + 3 * BLOCK_T, dk, dmask, LD, D)


@triton.jit
def _dd_index(IDX, j, r, nr, M, IDX_T: tl.constexpr):
    """idx of rows r (< N * Lq; -1 beyond) for document j: IDX [M, N * Lq] (IDX_T) or [N * Lq, M]."""
    if IDX_T:
        b = tl.load(IDX + (tl.cast(j, tl.int64) * nr + r), mask=r < nr, other=-1)
    else:
        b = tl.load(IDX + r.to(tl.int64) * M + j, mask=r < nr, other=-1)
    return b.to(tl.int32)


@triton.jit
def _dd_store(DD, out, j, t, dk, dmask, LD, D):
    tl.store(DD + (tl.cast(j, tl.int64) * LD + t.to(tl.int64))[:, None] * D + dk[None, :], out,
             mask=(t < LD)[:, None] & dmask[None, :])
