"""Triton device code of SigLIP's sigmoid loss (host side: ``fused_contrastive/core/siglip/triton_siglip.py``;
the PyTorch path and the derivation: ``fused_contrastive/core/siglip/torch_siglip.py``).

With the cosine tile of the core kernels (``lse._cos_tile``: the prologue's power-of-two scaled rows
``SA``, ``SB`` and their inverse norms ``rsa``, ``rsb`` folded into the finished tile; raw rows and
``r = 1`` without NORMALIZE), the runtime scale ``s`` and bias ``b`` (pointers, never constexprs), and
the positive of row i at column ``offset + i``::

    z_ij    = s cos_ij + b
    w_ij    = -z_ij at the positive (label +1), z_ij elsewhere (label -1)
    loss_i  = sum_j softplus(w_ij)
    dz_ij   = g_i sign_ij sigmoid(w_ij)        (sign -1 at the positive, +1 elsewhere)
    dx_i    = s sum_j dz_ij y_j     dy_j = s sum_i dz_ij x_i     ds = sum dz_ij cos_ij     db = sum dz_ij

followed by the normalisation backward (``lse._norm_bwd_epilogue``). The same tiles as the core op with a
softplus in place of the online log-sum-exp: no running statistic, so the forward is one streaming sum
per row and the backward needs only the upstream gradients (nothing saved but the O(N*D) inputs).

Kernels:

* ``siglip_fwd_kernel``        one program per row block, streams all column blocks: loss_i.
* ``siglip_bwd_rows_kernel``   one program per row block: dX (and the row block's partial sums of
                               ds and db, summed by the launcher in a fixed order).
* ``siglip_bwd_cols_kernel``   one program per column block (the transposed walk): dY.

Deterministic: no atomics; every output row has one owning program and a fixed summation order. The
backward recomputes the tiles in both kernels (4 units of an N x M x D matmul, like the core op's
A != B backward; forward 1).

Numerics: ``softplus(w) = max(w, 0) + log1p(exp(-|w|))``, with ``log1p(e) = log(u) * e / (u - 1)``,
``u = 1 + e`` (exact to a few ulps for tiny ``e``, where ``log(1 + e)`` would round to 0), and
``sigmoid(w)`` as ``1 / (1 + e)`` or ``e / (1 + e)`` with ``e = exp(-|w|)`` (no exp overflows):
finite for every finite ``w`` (scales of 1e4 included). The upstream gradients are divided by
``gscale = max |g|`` before the fp16/bf16 cast of the gradient matmul's operand, so ``|dz| <= 1``, and,
as in the core kernels, ``dz`` is multiplied by the power of two ``PRESCALE`` (2^13 for fp16, else 1;
``triton_shared.launch.prescale``) before that cast and divided out in the fp32 epilogue: a negative pair's
``sigmoid(z)`` (~4.5e-5 at SigLIP's initial bias -10) is below fp16's smallest normal number.
Padding rows / columns are masked out of every sum. The epilogue GEMM's LEAN option (the switchboard's
``SIGLIP_EPILOGUE``: ``kernels/common.py`` ``_softplus_lean``, ``_dz_lean``) forms the same terms from one
``exp2`` per logit, ``log1p(e)`` as a degree-7 polynomial in e (relative error <= 3.6e-7) and one approximate
reciprocal; these kernels keep the exact form.

Supported: any N, M, D, fp32 / fp16 / bf16 (fp32 accumulation, tf32x3 dots for fp32), row strides,
int64 offsets. Launch configs: the core kernels' table (``core/triton_shared/configs.py``: "fwd", "bwd_rows",
"bwd_cols"); these kernels hold fewer live tiles than the core kernels with every term on, and
tests/test_triton_compile.py compiles each for sm_80 / sm_90 (0 spills, mma / wgmma). An H100 measured them
far slower than the textbook formula at N = 65536, bf16 (docs/gpu-measurements.md), so 16-bit problems where the
core op takes the panel path run on the panel path's epilogue GEMM instead (``kernels/panel.py`` MODE 4, which
uses ``_flipped``, ``_softplus`` and ``_dz`` of ``kernels/common.py``, as these kernels do;
``core/siglip/triton_siglip.use_panel_route``).
"""

import triton
import triton.language as tl

from .common import _accumulate, _cos_tile, _dz, _flipped, _inv_norms, _norm_bwd_epilogue, _softplus


@triton.jit
def siglip_fwd_kernel(
    SA, SB, RSA, RSB, SCALE, BIAS, LOSS,
    N, M, D, stride_sa, stride_sb, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """LOSS_i = sum_j softplus(w_ij) for one block of rows (grid: cdiv(N, BLOCK_M))."""
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    b = tl.load(BIAS).to(tl.float32)
    # 1. this program's rows and their inverse norms
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range(0, M, BLOCK_N):
        # 2. the cosine tile of column block J (D streamed in chunks, fp32 accumulation)
        cols = j0 + tl.arange(0, BLOCK_N)
        rsb = _inv_norms(RSB, cols, cols < M, NORMALIZE)
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        # 3. logits with the label sign, softplus, padding masked out of the row sums
        w, valid, _ = _flipped(cos, s, b, rows, cols, N, M, offset)
        acc += tl.sum(tl.where(valid, _softplus(w), 0.0), axis=1)
    tl.store(LOSS + rows, acc, mask=rmask)


@triton.jit
def siglip_bwd_rows_kernel(
    A, SA, SB, RA, NA, RSA, RSB, SCALE, BIAS, GSCALE, G,
    DA, ACC, DS_PART, DB_PART,
    N, M, D, stride_a, stride_sa, stride_sb, stride_da, offset, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, NEED_DX: tl.constexpr, NEED_DS: tl.constexpr, NEED_DB: tl.constexpr,
    RESIDENT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PRESCALE: tl.constexpr,
):
    """dX for one block of rows (grid: cdiv(N, BLOCK_M)), and this block's shares of ds and db.

    For each column block J: 1. recompute the cosine tile; 2. dz (upstream gradients / gscale);
    3. ds, db partial sums per row; 4. dX_I += dz @ Y_hat_J (registers, or this program's fp32 scratch
    rows when D is large). Epilogue: times s gscale, normalisation backward, stored in X's dtype.
    """
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    b = tl.load(BIAS).to(tl.float32)
    gs = tl.load(GSCALE)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
    g_r = tl.load(G + rows, mask=rmask, other=0.0) / gs
    if RESIDENT:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)  # unused: the accumulator is the ACC scratch
    ds_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range(0, M, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        rsb = _inv_norms(RSB, cols, cols < M, NORMALIZE)
        # 1. recompute the tile (the forward's code)
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        # 2. dz of this tile
        dz = _dz(cos, s, b, g_r, rows, cols, N, M, offset)
        # 3. scale and bias gradients
        if NEED_DS:
            ds_acc += tl.sum(dz * cos, axis=1)
        if NEED_DB:
            db_acc += tl.sum(dz, axis=1)
        # 4. dX_I += dz @ Y_hat_J
        if NEED_DX:
            acc = _accumulate(acc, ACC, dz, SB, stride_sb, rows, rsb, cols, N, M, D, j0,
                              BLOCK_D, RESIDENT, UPCAST, DOT_PREC, PRESCALE)
    if NEED_DS:
        tl.store(DS_PART + pid, tl.sum(ds_acc, axis=0))
    if NEED_DB:
        tl.store(DB_PART + pid, tl.sum(db_acc, axis=0))
    if NEED_DX:
        _norm_bwd_epilogue(A, DA, ACC, NA, RA, rows, N, D, stride_a, stride_da, acc, s * gs / PRESCALE, eps,
                           BLOCK_M, BLOCK_D, NORMALIZE, RESIDENT)


@triton.jit
def siglip_bwd_cols_kernel(
    B, SA, SB, RB, NB, RSA, RSB, SCALE, BIAS, GSCALE, G,
    DB, ACC,
    N, M, D, stride_b, stride_sa, stride_sb, stride_db, offset, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, RESIDENT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    PRESCALE: tl.constexpr,
):
    """dY for one block of columns (grid: cdiv(M, BLOCK_N)): for each row block I, recompute the tile
    and dz (same code as the row kernel), dY_J += dz^T @ X_hat_I. Epilogue as the row kernel's."""
    pid = tl.program_id(0)
    s = tl.load(SCALE).to(tl.float32)
    b = tl.load(BIAS).to(tl.float32)
    gs = tl.load(GSCALE)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rsb = _inv_norms(RSB, cols, cols < M, NORMALIZE)
    if RESIDENT:
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)  # unused: the accumulator is the ACC scratch
    for i0 in range(0, N, BLOCK_M):
        rows = i0 + tl.arange(0, BLOCK_M)
        rmask = rows < N
        rsa = _inv_norms(RSA, rows, rmask, NORMALIZE)
        g_r = tl.load(G + rows, mask=rmask, other=0.0) / gs
        cos = _cos_tile(SA, SB, stride_sa, stride_sb, rows, cols, N, M, D, rsa, rsb,
                        BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PREC)
        dz = _dz(cos, s, b, g_r, rows, cols, N, M, offset)
        acc = _accumulate(acc, ACC, tl.trans(dz), SA, stride_sa, cols, rsa, rows, M, N, D, i0,
                          BLOCK_D, RESIDENT, UPCAST, DOT_PREC, PRESCALE)
    _norm_bwd_epilogue(B, DB, ACC, NB, RB, cols, M, D, stride_b, stride_db, acc, s * gs / PRESCALE, eps,
                       BLOCK_N, BLOCK_D, NORMALIZE, RESIDENT)
