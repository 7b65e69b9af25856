"""Device code several families' kernels share (Triton ``@triton.jit`` helpers and the row-norm prologue kernel):
the operand loads, norms and cosine tiles, the logits and their masks, the online and merged log-sum-exp, the
saved statistics, the logit gradients, the normalisation backward epilogues, the streaming accumulator (their math
in ``kernels/lse.py``'s docstring), and SigLIP's flipped logits, softplus and logit gradient (their math in
``kernels/siglip.py``'s docstring; the epilogue GEMM of ``kernels/panel.py`` forms SigLIP from them too), with
the lean forms of the last two (one exp, a polynomial log1p and one approximate reciprocal per logit:
``_softplus_lean``, ``_dz_lean``; the epilogue GEMM's LEAN option). A family's kernel file imports this module
and ``panel.py`` / ``target.py``, never another family's file."""

import inspect

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))

@triton.jit
def row_norm_kernel(X, XS, NORM, RNORM, RS, N, D, stride_x, stride_xs, eps,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """NORM_i = max(||X_i||, eps), RNORM_i = 1 / NORM_i, the scaled copy XS_i = X_i p_i and RS_i, the
    inverse clamped norm of XS_i (fp32 statistics; XS in X's dtype).

    The norm is a one-pass scaled sum of squares (as BLAS nrm2): with the running row maximum ``big``
    of |x|, ``ssq = sum (x / big)^2`` is rescaled by ``(big_old / big_new)^2`` when a chunk raises the
    maximum, and ``||x|| = big sqrt(ssq)``; a plain ``sum x^2`` in fp32 overflows for rows of norm above
    ~1.8e19. ``p_i`` is the power of two with ``p big`` in [1, 2): multiplying by it is exact (no
    rounding), so the tiles read the same values as the raw rows, with every product bounded (no
    overflow in the dot). NaN or inf in a row gives NaN statistics.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    base = X + rows.to(tl.int64)[:, None] * stride_x
    big = tl.zeros([BLOCK_R], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(base + dd[None, :], mask=rmask[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
        new = tl.maximum(big, tl.max(tl.abs(x), axis=1))
        safe = tl.where(new > 0, new, 1.0)
        ratio = big / safe
        xs = x / safe[:, None]
        ssq = ssq * ratio * ratio + tl.sum(xs * xs, axis=1)
        big = new
    # p = 2^-e with big = 1.f 2^e: built from big's exponent bits (exact), kept a normal float
    e_bits = (big.to(tl.int32, bitcast=True) >> 23) & 0xFF
    p = (tl.minimum(tl.maximum(254 - e_bits, 1), 253) << 23).to(tl.float32, bitcast=True)
    p = tl.where(big > 0, p, 1.0)
    root = tl.sqrt(ssq)
    norm = big * root
    # clamps written as "norm < eps ? eps : norm" so that a NaN norm stays NaN
    norm = tl.where(norm < eps, eps, norm)
    snorm = (p * big) * root  # the norm of the scaled row: p big is in [1, 2), no overflow
    snorm = tl.where(snorm < p * eps, p * eps, snorm)
    tl.store(NORM + rows, norm, mask=rmask)
    tl.store(RNORM + rows, 1.0 / norm, mask=rmask)
    tl.store(RS + rows, 1.0 / snorm, mask=rmask)
    out = XS + rows.to(tl.int64)[:, None] * stride_xs
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        x = tl.load(base + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(out + dd[None, :], (x * p[:, None]).to(XS.dtype.element_ty), mask=m2)

@triton.jit
def _inv_norms(RN, idx, mask, NORMALIZE: tl.constexpr):
    """Per-row inverse norms r (1 without normalisation; 0 on padding)."""
    if NORMALIZE:
        r = tl.load(RN + idx, mask=mask, other=0.0)
    else:
        r = tl.where(mask, 1.0, 0.0)
    return r

@triton.jit
def _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """cos_ij = <SA_i, SB_j> rsa_i rsb_j on a BLOCK_M x BLOCK_N tile, fp32, 0 outside [0, N) x [0, M).

    SA and SB are the prologue's power-of-two scaled copies (the raw rows when NORMALIZE is off):
    the dot runs on the raw values (fp16/bf16 products are exact in the fp32 accumulator) without
    overflow, and the two inverse norms of the scaled rows are applied once to the finished tile.
    """
    a_base = SA + rows.to(tl.int64)[:, None] * stride_sa  # int64: N * stride may exceed 2^31
    b_base = SB + cols.to(tl.int64)[:, None] * stride_sb
    rmask = rows < N
    cmask = cols < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dmask = (dd < D)[None, :]
        a = tl.load(a_base + dd[None, :], mask=rmask[:, None] & dmask, other=0.0)
        b = tl.load(b_base + dd[None, :], mask=cmask[:, None] & dmask, other=0.0)
        if UPCAST:  # interpreter only: its bf16 tl.dot is wrong (the values are bf16 either way)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    return acc * rsa[:, None] * rsb[None, :]

@triton.jit
def _logits(cos, s, rows, cols, N, M, offset, bias_c, bias,
            EXCLUDE_SELF: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_COS: tl.constexpr):
    """l = s cos (+ bias at column bias_c[i]; with BIAS_COS the bias is in cosine units, s (cos + bias):
    the core op's target margin, bias = -margin at the target); -inf at the self column offset + i and
    on padding."""
    l = cos * s
    if HAS_BIAS:
        if BIAS_COS:
            l = tl.where(cols[None, :] == bias_c[:, None], l + bias * s, l)
        else:
            l = tl.where(cols[None, :] == bias_c[:, None], l + bias, l)
    if EXCLUDE_SELF:
        l = tl.where(cols[None, :] == rows[:, None] + offset, NEG_INF, l)
    valid = (rows < N)[:, None] & (cols < M)[None, :]
    return tl.where(valid, l, NEG_INF)

@triton.jit
def _pos_logits(l, rows, cols, N, M, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
                POS_KIND: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Logits restricted to positives: l + log w_ij (w = [lab_i == lab_j] or pos_mask[i % n0, j % m0]).

    TRANSPOSE reads w_ji instead (the symmetric backward's transposed term; labels are symmetric).
    """
    if POS_KIND == 1:
        lp = tl.where(lab_r[:, None] == lab_c[None, :], l, NEG_INF)
    else:
        valid = (rows < N)[:, None] & (cols < M)[None, :]
        if TRANSPOSE:
            off = (cols % n0).to(tl.int64)[None, :] * stride_pm + (rows % m0)[:, None]
        else:
            off = (rows % n0).to(tl.int64)[:, None] * stride_pm + (cols % m0)[None, :]
        w = tl.load(POS_MASK + off, mask=valid, other=0.0).to(tl.float32)
        # log 0 = -inf removes non-positives (padding is -inf already). Plain tl.log, not _log0: its two
        # extra selects on the tile made the sm_90 symmetric backward spill (tests/test_triton_compile.py);
        # under the interpreter this may warn "divide by zero encountered in log" for a dense 0/1 mask
        lp = l + tl.log(w)
    return lp

@triton.jit
def _log0(x):
    """log x for the sums of exponentials the kernels take logs of (x >= 0 or NaN): log 0 = -inf exactly as
    tl.log gives, but without evaluating log(0), which under the Triton interpreter (numpy) warns
    'divide by zero encountered in log' for every masked lane or fully excluded row."""
    zero = x == 0.0
    return tl.where(zero, NEG_INF, tl.log(tl.where(zero, 1.0, x)))

@triton.jit
def _online_rows(m_i, z_i, l):
    """One online LSE step over the columns of a tile: running max m, running sum z (per row)."""
    m_new = tl.maximum(m_i, tl.max(l, axis=1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # guard exp(-inf - -inf)
    z_i = z_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(l - m_safe[:, None]), axis=1)
    return m_new, z_i

@triton.jit
def _online_rows_split(m_i, z_i, l, hit):
    """:func:`_online_rows` with the entries ``hit`` left out of the sum (a row's target, split out: the running max
    may be theirs, a shift only)."""
    m_new = tl.maximum(m_i, tl.max(l, axis=1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # guard exp(-inf - -inf)
    z_i = z_i * tl.exp(m_i - m_safe) + tl.sum(tl.where(hit, 0.0, tl.exp(l - m_safe[:, None])), axis=1)
    return m_new, z_i

@triton.jit
def _lse_add(x, y):
    """log(exp x + exp y) elementwise, -inf safe, NaN propagating."""
    mx = tl.maximum(x, y)
    ms = tl.where(mx == NEG_INF, 0.0, mx)
    return ms + _log0(tl.exp(x - ms) + tl.exp(y - ms))

@triton.jit
def _stat(PTR, idx, mask):
    """A saved LSE with -inf replaced by 0 (then exp(l - LSE) = exp(-inf) = 0 on such a row)."""
    x = tl.load(PTR + idx, mask=mask, other=0.0)
    return tl.where(x == NEG_INF, 0.0, x)

@triton.jit
def _grad_vec(G, LSE_PTR, idx, mask, inv_gs, ZERO_ON_NEG_INF: tl.constexpr):
    """Upstream gradient / gscale; 0 where the LSE is -inf when asked (zero-positive rows)."""
    g = tl.load(G + idx, mask=mask, other=0.0) * inv_gs
    if ZERO_ON_NEG_INF:
        g = tl.where(tl.load(LSE_PTR + idx, mask=mask, other=0.0) == NEG_INF, 0.0, g)
    return g

@triton.jit
def _row_stats(LSE, G, LSE_POS, G_POS, LSE_COL, G_COL, rows, mask, inv_gs, HAS_G: tl.constexpr,
               HAS_GPOS: tl.constexpr, COL_ROLE: tl.constexpr):
    """The rows' statistics and upstream coefficients for a gradient tile: ``(lse, g, lse_pos, g_pos,
    lse_col, g_col)`` (``g`` 0 without HAS_G; the positives' pair and, with COL_ROLE (the symmetric
    case's column term), the column-role pair of the same rows, else copies of the row pair)."""
    lse_r = _stat(LSE, rows, mask)
    g_r = tl.zeros_like(lse_r)
    if HAS_G:
        g_r = _grad_vec(G, LSE, rows, mask, inv_gs, False)
    lsep_r = lse_r
    gp_r = g_r
    if HAS_GPOS:
        lsep_r = _stat(LSE_POS, rows, mask)
        gp_r = _grad_vec(G_POS, LSE_POS, rows, mask, inv_gs, True)
    lsec_r = lse_r
    gc_r = g_r
    if COL_ROLE:
        lsec_r = _stat(LSE_COL, rows, mask)
        gc_r = _grad_vec(G_COL, LSE_COL, rows, mask, inv_gs, False)
    return lse_r, g_r, lsep_r, gp_r, lsec_r, gc_r

@triton.jit
def _dlogits(l, lp, lse_r, g_r, lsec_c, gc_c, lsep_r, gp_r,
             HAS_G: tl.constexpr, HAS_GCOL: tl.constexpr, HAS_GPOS: tl.constexpr):
    """dl_ij = g_i p_ij + gc_j pc_ij + gp_i q_ij (all /gscale) on a tile."""
    dl = tl.zeros_like(l)
    if HAS_G:
        dl += g_r[:, None] * tl.exp(l - lse_r[:, None])
    if HAS_GCOL:
        dl += gc_c[None, :] * tl.exp(l - lsec_c[None, :])
    if HAS_GPOS:
        dl += gp_r[:, None] * tl.exp(lp - lsep_r[:, None])
    return dl

@triton.jit
def _norm_bwd_epilogue(X, OUT, ACC, NORM, RN, rows, N, D, stride_x, stride_o, acc, mult, eps,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       NORMALIZE: tl.constexpr, RESIDENT: tl.constexpr):
    """OUT_i = (g_i - x_i <g_i, x_i>) r_i (or g_i r_i when ||X_i|| <= eps), g = mult * (dl @ other).

    ``acc`` holds the [BLOCK_R, BLOCK_D] accumulator when RESIDENT; otherwise it is in ACC (fp32,
    row stride D). ``x`` = X r is the normalised row; without NORMALIZE OUT = g.
    """
    rmask = rows < N
    x_base = X + rows.to(tl.int64)[:, None] * stride_x
    o_base = OUT + rows.to(tl.int64)[:, None] * stride_o
    if NORMALIZE:
        r = tl.load(RN + rows, mask=rmask, other=0.0)
        nrm = tl.load(NORM + rows, mask=rmask, other=1.0)
        keep = nrm > eps  # clamped rows: x / eps is linear, no projection
    if RESIDENT:
        dd = tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        g = acc * mult
        if NORMALIZE:
            xh = tl.load(x_base + dd[None, :], mask=m2, other=0.0).to(tl.float32) * r[:, None]
            proj = tl.where(keep, tl.sum(g * xh, axis=1), 0.0)
            g = (g - xh * proj[:, None]) * r[:, None]
        tl.store(o_base + dd[None, :], g.to(OUT.dtype.element_ty), mask=m2)
    else:
        if not NORMALIZE:  # (unused without the projection)
            r = tl.zeros([BLOCK_R], dtype=tl.float32)
            keep = rmask
        _norm_bwd_rows(ACC, D, X, stride_x, OUT, stride_o, rows, rmask, tl.zeros([BLOCK_R], dtype=tl.float32) + mult,
                       r, r, keep, D, BLOCK_D, NORMALIZE)

@triton.jit
def _norm_bwd_rows(G, stride_g, X, stride_x, OUT, stride_o, rows, rmask, gmul, xmul, omul, keep, D,
                   BLOCK_D: tl.constexpr, NORMALIZE: tl.constexpr):
    """The normalisation backward of rows held in memory, shared by the fused backward (rows of its
    fp32 accumulator) and the panel path's row epilogue (rows of a GEMM output): with ``g_i = G_i
    gmul_i`` and ``x_hat_i = X_i xmul_i`` (the normalised row), ``OUT_i = (g_i - x_hat_i <g_i, x_hat_i>)
    omul_i`` (``omul`` = 1 / the clamped norm; no projection where ``keep`` is False, a clamped row),
    cast to OUT's dtype; without NORMALIZE ``OUT_i = g_i``. Two passes over D (the projection, then the
    output), every element written once; ``rows`` / ``rmask`` are the [BLOCK_R] rows and their bound."""
    r64 = rows.to(tl.int64)[:, None]
    proj = tl.zeros(gmul.shape, dtype=tl.float32)
    if NORMALIZE:
        for d0 in range(0, D, BLOCK_D):  # pass 1: <g, x_hat> over all of D
            dd = d0 + tl.arange(0, BLOCK_D)
            m2 = rmask[:, None] & (dd < D)[None, :]
            g = tl.load(G + r64 * stride_g + dd[None, :], mask=m2, other=0.0) * gmul[:, None]
            xh = tl.load(X + r64 * stride_x + dd[None, :], mask=m2, other=0.0).to(tl.float32) * xmul[:, None]
            proj += tl.sum(g * xh, axis=1)
        proj = tl.where(keep, proj, 0.0)
    for d0 in range(0, D, BLOCK_D):  # pass 2: the input gradient in the output's dtype
        dd = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (dd < D)[None, :]
        g = tl.load(G + r64 * stride_g + dd[None, :], mask=m2, other=0.0) * gmul[:, None]
        if NORMALIZE:
            xh = tl.load(X + r64 * stride_x + dd[None, :], mask=m2, other=0.0).to(tl.float32) * xmul[:, None]
            g = (g - xh * proj[:, None]) * omul[:, None]
        tl.store(OUT + r64 * stride_o + dd[None, :], g.to(OUT.dtype.element_ty), mask=m2)

@triton.jit
def _accumulate(acc, ACC, dl, SY, stride_sy, rows_o, rsy, idx_y, n_out, n_y, D, first,
                BLOCK_D: tl.constexpr, RESIDENT: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr):
    """acc (or ACC[rows_o]) += PRESCALE dl @ Y_hat[idx_y], Y_hat = SY rsy (the scaled copy times its
    inverse norm); dl is [len(rows_o), len(idx_y)].

    dl and Y_hat are cast to SY's dtype first (fp16/bf16 tensor-core operands, fp32 accumulation);
    dl is multiplied by the power of two PRESCALE before its cast (fp16: 2^13, so that softmax weights
    ~1/M stay normal numbers; the epilogue divides it out in fp32).
    """
    dlo = (dl * PRESCALE).to(SY.dtype.element_ty)  # rounded to the operand dtype, as on the GPU
    if UPCAST:
        dlo = dlo.to(tl.float32)
    y_base = SY + idx_y.to(tl.int64)[:, None] * stride_sy
    ymask = idx_y < n_y
    if RESIDENT:
        dd = tl.arange(0, BLOCK_D)
        y = tl.load(y_base + dd[None, :], mask=ymask[:, None] & (dd < D)[None, :], other=0.0)
        yh = (y.to(tl.float32) * rsy[:, None]).to(SY.dtype.element_ty)
        if UPCAST:
            yh = yh.to(tl.float32)
        acc = tl.dot(dlo, yh, acc, input_precision=DOT_PREC)
    else:
        a_base = ACC + rows_o.to(tl.int64)[:, None] * D
        omask = rows_o < n_out
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dmask = (dd < D)[None, :]
            y = tl.load(y_base + dd[None, :], mask=ymask[:, None] & dmask, other=0.0)
            yh = (y.to(tl.float32) * rsy[:, None]).to(SY.dtype.element_ty)
            if UPCAST:
                yh = yh.to(tl.float32)
            # the scratch rows are this program's own; the first tile starts from 0 (no memset)
            prev = tl.load(a_base + dd[None, :], mask=omask[:, None] & dmask & (first > 0), other=0.0)
            part = tl.dot(dlo, yh, prev, input_precision=DOT_PREC)
            tl.store(a_base + dd[None, :], part, mask=omask[:, None] & dmask)
        tl.debug_barrier()  # order these stores before other threads' loads of the same rows
    return acc


@triton.jit
def _flipped(cos, s, b, rows, cols, N, M, offset):
    """(w = -label * z on the tile, the valid mask (inside [0, N) x [0, M)), the positive mask)."""
    z = cos * s + b
    pos = cols[None, :] == rows[:, None] + offset
    w = tl.where(pos, -z, z)
    valid = (rows < N)[:, None] & (cols < M)[None, :]
    return w, valid, pos


@triton.jit
def _softplus(w):
    """log(1 + exp(w)) for any finite w, without overflow and without losing tiny values."""
    e = tl.exp(-tl.abs(w))  # in (0, 1]
    u = 1.0 + e
    d = u - 1.0
    lp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.maximum(w, 0.0) + lp


@triton.jit
def _dz(cos, s, b, g_r, rows, cols, N, M, offset):
    """dz_ij = g_i sign_ij sigmoid(w_ij) on the tile, 0 on padding."""
    w, valid, pos = _flipped(cos, s, b, rows, cols, N, M, offset)
    e = tl.exp(-tl.abs(w))  # in (0, 1]: no overflow for any w
    r = 1.0 / (1.0 + e)
    p = tl.where(w >= 0, r, e * r)  # sigmoid(w): one division
    p = tl.where(pos, -p, p) * g_r[:, None]
    return tl.where(valid, p, 0.0)


@triton.jit
def _sub_set(dl, gset, rows, cols, N, M, offset, lab_r, lab_c, POS_MASK, n0, m0, stride_pm,
             POS_KIND: tl.constexpr, EXCLUDE_SELF: tl.constexpr, TRANSPOSE: tl.constexpr, pm_shift=0):
    """``dl_ij - gset_i w_ij`` on a tile (the SET term's gradient, ``-c.set_i w_ij`` over gscale, formed in
    fp32 inside the tile before it is rounded to a 16-bit operand: for a softmax concentrated on the
    positives ``p_ij`` and ``w_ij c.set_i`` nearly cancel). ``w_ij = [lab_r_i == lab_c_j]`` (POS_KIND 1) or
    ``POS_MASK[i % n0, j % m0]`` (2), 0 on padding (``rows >= N``, ``cols >= M``) and at the excluded own
    column ``offset + i`` (EXCLUDE_SELF). TRANSPOSE (the symmetric backward's transposed term, B is A,
    ``offset`` 0): ``dl_ij - gset_j w_ji`` with ``gset`` the columns' [C] (labels are symmetric; the mask
    is read transposed, as :func:`_pos_logits` does). ``pm_shift``: the mask is indexed at ``rows + pm_shift``
    and ``cols + pm_shift`` (the triangular sweep's frame, whose row 0 is the panel's first row; 0 elsewhere)."""
    valid = (rows < N)[:, None] & (cols < M)[None, :]
    if EXCLUDE_SELF:
        if TRANSPOSE:
            valid = valid & (rows[:, None] != cols[None, :] + offset)
        else:
            valid = valid & (cols[None, :] != rows[:, None] + offset)
    if POS_KIND == 1:
        w = tl.where(valid & (lab_r[:, None] == lab_c[None, :]), 1.0, 0.0)
    else:
        if TRANSPOSE:
            base = POS_MASK + ((cols + pm_shift) % n0).to(tl.int64) * stride_pm
            w = tl.load(base[None, :] + ((rows + pm_shift) % m0)[:, None], mask=valid, other=0.0).to(tl.float32)
        else:
            base = POS_MASK + ((rows + pm_shift) % n0).to(tl.int64) * stride_pm
            w = tl.load(base[:, None] + ((cols + pm_shift) % m0)[None, :], mask=valid, other=0.0).to(tl.float32)
    if TRANSPOSE:
        out = dl - gset[None, :] * w
    else:
        out = dl - gset[:, None] * w
    return out
#: log(1 + e) = e * p(e) on [0, 1]: p the degree-7 minimax fit of log1p(e) / e in relative error (Remez, float64;
#: coefficients rounded to fp32, constant term first). Max relative error over (0, 1]: 2.22e-7 evaluated in
#: float64, 3.6e-7 (3 units of 2^-23) in fp32 Horner steps (tests/test_siglip_lean.py measures both).
LOG1P_COEFFS = (0.9999998211860657, -0.4999740421772003, 0.33275479078292847, -0.24495463073253632,
                0.17745241522789001, -0.10768171399831772, 0.04408963397145271, -0.008539209142327309)
_L1P0 = tl.constexpr(LOG1P_COEFFS[0])
_L1P1 = tl.constexpr(LOG1P_COEFFS[1])
_L1P2 = tl.constexpr(LOG1P_COEFFS[2])
_L1P3 = tl.constexpr(LOG1P_COEFFS[3])
_L1P4 = tl.constexpr(LOG1P_COEFFS[4])
_L1P5 = tl.constexpr(LOG1P_COEFFS[5])
_L1P6 = tl.constexpr(LOG1P_COEFFS[6])
_L1P7 = tl.constexpr(LOG1P_COEFFS[7])
_NEG_LOG2E = tl.constexpr(-1.4426950408889634)


@triton.jit
def _log1p_unit(e):
    """log(1 + e) for e in [0, 1] (fp32): ``e * p(e)``, :data:`LOG1P_COEFFS` in 7 FMA Horner steps and one
    multiply; relative error at most 3.6e-7 (exact 0 at e = 0, no loss of tiny e)."""
    p = _L1P7 * e + _L1P6
    p = p * e + _L1P5
    p = p * e + _L1P4
    p = p * e + _L1P3
    p = p * e + _L1P2
    p = p * e + _L1P1
    p = p * e + _L1P0
    return e * p


@triton.jit
def _softplus_lean(w):
    """:func:`_softplus` with one exp and no log: ``max(w, 0) + log1p(e)``, ``e = exp(-|w|)`` in (0, 1],
    log1p by :func:`_log1p_unit` (relative error <= 3.6e-7 on the log1p term; finite for every finite w).
    The exp is ``exp2(-|w| log2(e))``, which compiles to one multiply and ``ex2.approx.ftz.f32`` (``tl.exp``
    adds a denormal range fix-up, three more instructions): e flushes to 0 below 2^-126 (|w| > 87.3), where
    the term is below 1.2e-38. The fp32 product ``|w| log2(e)`` is off by up to 2^-24 |w| relative in e (as
    ``tl.exp``'s on a GPU)."""
    e = tl.exp2(tl.abs(w) * _NEG_LOG2E)
    return tl.maximum(w, 0.0) + _log1p_unit(e)


#: ``tl.fdiv(..., approx=True)`` (``div.approx.f32``) exists from Triton 3.7 on; Triton 3.6 (the one PyTorch 2.11's
#: CUDA wheels bring, which the lent GPUs ran) has no such argument, and :func:`_dz_lean` then takes its plain
#: ``tl.fdiv``. Chosen once, at import, by the installed Triton's signature.
FDIV_APPROX = tl.constexpr("approx" in inspect.signature(tl.fdiv).parameters)


@triton.jit
def _dz_lean(w, valid, pos, g_r):
    """:func:`_dz` of the flipped logits ``w`` (with :func:`_flipped`'s masks): ``g_i sign_ij sigmoid(w_ij)``,
    0 on padding, sigmoid from the same ``e = exp(-|w|)`` as :func:`_softplus_lean` (the compiler keeps one exp
    per logit for both) and one approximate reciprocal ``r = 1 / (1 + e)`` (``div.approx.f32`` on NVIDIA, at
    most 2 ulp; the interpreter divides exactly): ``r`` for w >= 0, ``e r`` below."""
    e = tl.exp2(tl.abs(w) * _NEG_LOG2E)
    if FDIV_APPROX:
        r = tl.fdiv(1.0, 1.0 + e, approx=True)
    else:  # a Triton without approx (3.6, which PyTorch's CUDA wheels bring): its plain fast division
        r = tl.fdiv(1.0, 1.0 + e)
    p = tl.where(w >= 0, r, e * r)
    p = tl.where(pos, -p, p) * g_r[:, None]
    return tl.where(valid, p, 0.0)
