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
  OVERLAP (a form of the flat loop; untimed, off by default): the flat loop's step serialises its matmul
  with the max / argmax epilogue (sm_90: the wgmma is issued and waited for at once, then the
  reductions run with the tensor cores idle). OVERLAP walks pairs of chunks (2 p, 2 p + 1) of a
  document (cdiv(Ld, BLOCK_T) rounded up to even: one more, empty, chunk when it is odd); iteration p
  issues chunk 2 p + 1's matmul (waited for at once; the wait also completes chunk 2 p's), merges the
  pair elementwise (per position the larger similarity and its token index, chunk 2 p on a tie), takes
  the pair's row maxima, issues chunk 2 p + 2's matmul (its zero accumulator depends on those maxima,
  so it is issued after chunk 2 p's registers have been read: sm_90 keeps it in flight across the
  loop's back edge, Triton's rule for an asynchronous wgmma whose result is read only after a later
  dot's wait), and then runs the argmax reduction and the document's end while that matmul computes.
  One max / argmax reduction per pair instead of per chunk; S, idx and the LSE are the flat loop's
  bit for bit (the same products, maxima and sums in the same order; a similarity of exactly -0 may
  come out +0, as the next chunk's matmul accumulates onto +0).
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
  P is built in registers in both forms, but in a blocked layout that Triton 3.9 converts into the
  matmul's operand layout through shared memory (sm_80: stored and read back with ldmatrix; sm_90: a
  layout conversion through shared memory before the register-operand wgmma). P_REGS (untimed, off
  by default): P is built in the accumulator's layout instead (its token index per row taken, once
  per program, as the row maximum of a tiny exact matmul [BLOCK_T, 16] @ [16, BLOCK_D] whose result has
  the accumulator's shape), from which the sm_90 wgmma reads its register operand with no shared-memory
  trip (sm_80 still converts through shared memory: its accumulator and operand layouts differ);
  bitwise the same dd.

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
def _fwd_sims(q, q_base, rmask, DOC, DV, j, t0, LD, D, stride_dm, stride_dt, dk, t_hi, sims,
              ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, RESIDENT: tl.constexpr,
              UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """``sims`` plus the similarities [ROWS, BLOCK_T] of the rows with tokens [t0, t0 + BLOCK_T) of document j
    (fp32, one ``tl.dot``; not yet masked) and the tokens' validity tv [BLOCK_T]. Only tokens below ``t_hi``
    (Ld, or 0: nothing is read, every token invalid, and j may be past the last document) are read."""
    d_base = DOC + tl.cast(j, tl.int64) * stride_dm
    t = t0 + tl.arange(0, BLOCK_T)
    tv = tl.load(DV + tl.cast(j, tl.int64) * LD + t, mask=t < t_hi, other=0) != 0
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
    return sims, tv


@triton.jit
def _fwd_fold(sims, tv, t0, best, arg, nvalid, BLOCK_T: tl.constexpr):
    """The max / argmax epilogue of one tile: invalid tokens -inf, then the running maximum and first argmax
    (the lowest index among the chunk's maxima; an earlier chunk keeps a tie: strictly greater replaces)."""
    t = t0 + tl.arange(0, BLOCK_T)
    nvalid += tv.to(tl.int32)
    sims = tl.where(tv[None, :], sims, NEG_INF)
    cmax = tl.max(sims, axis=1)
    carg = tl.min(tl.where(sims == cmax[:, None], t[None, :], BIG_INDEX), axis=1)
    upd = cmax > best
    return tl.where(upd, cmax, best), tl.where(upd, carg, arg), nvalid


@triton.jit
def _fwd_merge(sims_b, tv_b, sims_a, tv_a, t0, BLOCK_T: tl.constexpr):
    """Two consecutive chunks of one document, tokens [t0, t0 + BLOCK_T) (``b``) and the next BLOCK_T (``a``),
    merged elementwise: per position the larger similarity (invalid tokens -inf; ``b`` on a tie or where ``a``
    is NaN) and its token index; then :func:`_fwd_reduce` folds the pair as :func:`_fwd_fold` folds a chunk.
    Every maximum of ``b`` survives the merge, so the pair's first maximum is the chunk-by-chunk one."""
    t = t0 + tl.arange(0, BLOCK_T)
    xb = tl.where(tv_b[None, :], sims_b, NEG_INF)
    xa = tl.where(tv_a[None, :], sims_a, NEG_INF)
    take_b = (xb >= xa) | (xa != xa)
    return tl.where(take_b, xb, xa), tl.where(take_b, t[None, :], t[None, :] + BLOCK_T)


@triton.jit
def _fwd_reduce(x, ti, cmax, best, arg):
    """The running maximum / first argmax after a merged pair (x, ti) of :func:`_fwd_merge` whose row maxima
    are ``cmax``."""
    carg = tl.min(tl.where(x == cmax[:, None], ti, BIG_INDEX), axis=1)
    upd = cmax > best
    return tl.where(upd, cmax, best), tl.where(upd, carg, arg)


@triton.jit
def _fwd_chunk(q, q_base, rmask, DOC, DV, j, t0, LD, D, stride_dm, stride_dt, dk, best, arg, nvalid,
               ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, RESIDENT: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """The forward's step: the similarities of the rows with tokens [t0, t0 + BLOCK_T) of document j
    (fp32, one ``tl.dot``; invalid tokens -inf), folded into the running maximum / first argmax."""
    sims, tv = _fwd_sims(q, q_base, rmask, DOC, DV, j, t0, LD, D, stride_dm, stride_dt, dk, LD,
                         tl.zeros([ROWS, BLOCK_T], dtype=tl.float32), ROWS, BLOCK_T, BLOCK_D, RESIDENT, UPCAST,
                         DOT_PREC)
    return _fwd_fold(sims, tv, t0, best, arg, nvalid, BLOCK_T)


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
    DOT_PREC: tl.constexpr, OVERLAP: tl.constexpr = False,
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
        npairs = (j_hi - j_lo) * cpd
        if OVERLAP:
            # pairs of token chunks (2 p, 2 p + 1) of one document (cpd rounded up to even: one more empty
            # chunk when it is odd). Iteration p: chunk 2 p + 1's matmul (synchronous; its wait also completes
            # chunk 2 p's, issued by the previous iteration), the pair merged elementwise, chunk 2 p + 2's
            # matmul issued (its accumulator input is zeros that depend on the merge, so it is issued after
            # the merge has read chunk 2 p's registers), then the pair's max / argmax reductions and the
            # document's end while that matmul is in flight (sm_90: an asynchronous wgmma carried across
            # the loop's back edge, waited for by the next iteration's first dot)
            cpd2 = cpd + cpd % 2
            n_ch = (j_hi - j_lo) * cpd2
            sims_b, tv_b = _fwd_sims(q, q_base, rmask, DOC, DV, j_lo, 0, LD, D, stride_dm, stride_dt, dk,
                                     tl.where(n_ch > 0, LD, 0), tl.zeros([ROWS, BLOCK_T], dtype=tl.float32), ROWS,
                                     BLOCK_T, BLOCK_D, RESIDENT, UPCAST, DOT_PREC)
            for p in range(0, n_ch // 2):
                ca = 2 * p + 1
                jd = ca // cpd2
                ka = ca - jd * cpd2
                j = j_lo + jd
                sims_a, tv_a = _fwd_sims(q, q_base, rmask, DOC, DV, j, ka * BLOCK_T, LD, D, stride_dm, stride_dt,
                                         dk, LD, tl.zeros([ROWS, BLOCK_T], dtype=tl.float32), ROWS, BLOCK_T,
                                         BLOCK_D, RESIDENT, UPCAST, DOT_PREC)
                nvalid += tv_b.to(tl.int32) + tv_a.to(tl.int32)
                x, ti = _fwd_merge(sims_b, tv_b, sims_a, tv_a, (ka - 1) * BLOCK_T, BLOCK_T)
                cmax = tl.max(x, axis=1)
                jn = (ca + 1) // cpd2
                kn = ca + 1 - jn * cpd2
                # zeros (ka >= 0) that depend on the pair's maximum: the next matmul is issued after the merge
                # and the maximum have read chunk 2 p's registers (its accumulator reuses them)
                acc0 = tl.where(ka < 0, cmax[:, None], tl.zeros([ROWS, BLOCK_T], dtype=tl.float32))
                sims_b, tv_b = _fwd_sims(q, q_base, rmask, DOC, DV, j_lo + jn, kn * BLOCK_T, LD, D, stride_dm,
                                         stride_dt, dk, tl.where(ca + 1 < n_ch, LD, 0), acc0, ROWS, BLOCK_T,
                                         BLOCK_D, RESIDENT, UPCAST, DOT_PREC)
                best, arg = _fwd_reduce(x, ti, cmax, best, arg)
                if ka == cpd2 - 1:
                    m_l, z_l = _fwd_doc_end(S, idx_base, stride_ij, j, M, w, rmask, best, arg, nvalid, gi, gmask, s,
                                            empty_score, m_l, z_l, G, LQ_PAD)
                    best = tl.full([ROWS], NEG_INF, tl.float32)
                    arg = tl.zeros([ROWS], dtype=tl.int32)
                    nvalid = tl.zeros([BLOCK_T], dtype=tl.int32)
        else:
            for c in range(0, npairs):
                jd = c // cpd
                k = c - jd * cpd
                j = j_lo + jd
                best, arg, nvalid = _fwd_chunk(q, q_base, rmask, DOC, DV, j, k * BLOCK_T, LD, D, stride_dm,
                                               stride_dt, dk, best, arg, nvalid, ROWS, BLOCK_T, BLOCK_D, RESIDENT,
                                               UPCAST, DOT_PREC)
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
def _dd_step(acc, t, b, cb, x, DOT_PREC: tl.constexpr, REGS: tl.constexpr = False, t0=0):
    """acc [BLOCK_T, BLOCK_D] += P^T @ x with the weighted one-hot ``P^T_tr = [b_r = t] cb_r`` (cb already
    in the operand dtype: a select, no per-element cast)."""
    if REGS:  # t: the local token indices (0 .. BLOCK_T - 1) from a matmul result's layout; t0 the first token
        p = tl.where(t[:, None] == (b - t0)[None, :], cb[None, :], tl.zeros_like(cb)[None, :])
    else:
        p = tl.where(t[:, None] == b[None, :], cb[None, :], tl.zeros_like(cb)[None, :])
    return tl.dot(p, x, acc, input_precision=DOT_PREC)


@triton.jit
def maxsim_bwd_doc_kernel(
    Q, W, IDX, G, GSCALE, DD,
    N, M, LQ, LD, D, stride_qn, stride_qa,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NT: tl.constexpr, IDX_T: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr, P_REGS: tl.constexpr = False,
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
    t_first = pid_t * (NT * BLOCK_T)
    t = t_first + tl.arange(0, BLOCK_T)
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
    if P_REGS:
        # the local token index 0 .. BLOCK_T - 1 of each row of P^T as a row maximum of a tiny exact matmul
        # whose [BLOCK_T, BLOCK_D] result has the accumulator's shape (so its layout): tk [BLOCK_T, 16]
        # (column 0 the index) @ ones [16, BLOCK_D] (row 0); P^T is then built in that layout, from which
        # the matmul reads its register operand without a trip through shared memory
        kk = tl.arange(0, 16)
        tk = tl.where(kk[None, :] == 0, tl.arange(0, BLOCK_T)[:, None].to(tl.float32), 0.0)
        ones = tl.where(kk[:, None] == 0, 1.0, tl.zeros([16, BLOCK_D], dtype=tl.float32))
        if UPCAST:
            t_loc = tl.max(tl.dot(tk, ones), axis=1).to(tl.int32)
        else:
            t_loc = tl.max(tl.dot(tk.to(tl.float16), ones.to(tl.float16)), axis=1).to(tl.int32)
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
        if P_REGS:
            acc0 = _dd_step(acc0, t_loc, b, cb, x, DOT_PREC, True, t_first)
        else:
            acc0 = _dd_step(acc0, t, b, cb, x, DOT_PREC)
        if NT > 1:
            if P_REGS:
                acc1 = _dd_step(acc1, t_loc, b, cb, x, DOT_PREC, True, t_first + 1 * BLOCK_T)
            else:
                acc1 = _dd_step(acc1, t + BLOCK_T, b, cb, x, DOT_PREC)
        if NT > 2:
            if P_REGS:
                acc2 = _dd_step(acc2, t_loc, b, cb, x, DOT_PREC, True, t_first + 2 * BLOCK_T)
            else:
                acc2 = _dd_step(acc2, t + 2 * BLOCK_T, b, cb, x, DOT_PREC)
        if NT > 3:
            if P_REGS:
                acc3 = _dd_step(acc3, t_loc, b, cb, x, DOT_PREC, True, t_first + 3 * BLOCK_T)
            else:
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
