"""The panel path of the Triton backend: matmuls in cuBLAS GEMMs, the per-logit work in one Triton kernel.

Why: the fused backward kernels (``kernels/lse.py``) recompute tiles and accumulate ``dl @ B`` through
a per-64-column read-modify-write of an fp32 scratch when D > 128 (~18 FLOP/B of L2 traffic, modelled
at 12-20% of bf16 peak on an H100; ``/work/shared/GPU_REVIEW.md``). Here every matmul is a
``torch.mm`` / ``addmm`` (cuBLAS on a GPU, fixed call order: deterministic for a fixed shape and
device), and ``kernels/panel.py`` does the softmax work of a panel in one pass.

Sweep over row panels of P rows (whole rows, all M columns), panel ``P_k = [r0, r0 + P)``:

1. ``Lraw = (A_P diag(pw)) @ B^T``, fp32 output (``out_dtype`` GEMM for 16-bit operands) [P, M];
   ``pw`` per row a power of two (exact) that bounds the products; the inverse norms are folded in
   by the kernel (raw operands: no normalised copy of A or B);
2. ``DL = panel_dl_kernel(Lraw, statistics)`` [P, M] in the operand dtype (fp16: times 2^13);
3. ``dA_P = s gs / PRESCALE * DL @ B_op`` (fp32 out) then the normalisation backward, written to dA;
4. ``acc[:gcols] += DL[:, :gcols]^T @ A_hat_P`` (fp32 accumulator of dB, ``addmm`` with
   ``out=acc``: one fixed order over the panels); after the sweep, dB from ``acc`` (times the norm
   of each row when the kernel folded its inverse norm), then its normalisation backward.

Units (one unit = one N x M x D matmul = 2 N M D FLOPs), by case:

* summed loss, A != B (or A is B with a bias), no column term (InfoNCE, SimCSE two-view / supervised,
  SupCon with a queue, DSCL, ...): **3 units, all cuBLAS**. The panel spans whole rows, so the kernel
  forms each row's LSE / LSEpos in the same sweep (``EAGER``) and the gradient is formed in the
  forward (scaled by the scalar upstream gradient in backward), as the torch backend does on CPU.
* per-row output or a column term (CLIP), A != B: the statistics first, from the fused forward kernel
  (1 unit, ``lse_fwd_kernel``: row, positive and column LSEs from the same tiles), then the panel
  backward (3 units, cuBLAS): **4 units**. (A panel sweep for the column LSE would also cost 1 unit.)
* A is B without a bias (symmetric SimCSE, SupCon without a queue, CLIP of A against itself): fused
  forward (1) + panel backward with ``H = dl + dl^T`` from the same tile (logits 1 + ``H @ A`` 1):
  **3 units**, no dB accumulator.
* ``need_b`` False (a frozen tower): the ``dl^T @ A`` GEMM is skipped (2 units).
* a second backward through a retained graph after an EAGER forward: the recomputing panel backward
  from the statistics the eager sweep saved (3 more units).

No case falls back to the fused kernels on this path: every term of the core op (LSE, LSEcol, LSEpos
with label or dense-mask positives, exclude_self with an offset, the bias column, grad_cols, the
temperature gradient) is covered; TGT and SET are O(N*D) and come from ``positives.py`` on every path.

Memory (bytes; e = operand element size; "extra" = allocated by the loss beyond its inputs and the
gradients it returns; the fused forward's scaled copies ``sa, sb`` (``e (N + M) D``) and column
partials (``4 x 2 SMs x M``) of the non-EAGER cases exist only during the forward and are not kept)::

    fixed  = 4 M D  [dB accumulator, A != B and dB needed]  +  e M D  [fp16 only: normalised B]
    per panel row  = (4 + e) M  [Lraw fp32, DL]  +  (12 + e) D  [A_P temporaries: fp32 scaled / normalised
                     rows, dA_P fp32, the operand copy]
    P = min(N, max(P_MIN, round_down_64((BUDGET - fixed) / per_row)))
    extra = fixed + P * per_row + O(N + M)

With the default ``BUDGET = 0.70e9`` at N = M = 131072, D = 768, bf16: fixed = 402.7 MB, per_row =
797 184 B, P = 320, extra = 657.8 MB + ~5 MB of vectors < 0.72 GB. At N = M = 65536: P = 1216.

GEMM FLOPs and bytes per panel (the model helper's inputs; P rows, M columns, D, e):

* logits: ``2 P M D`` FLOPs; reads ``e (P + M) D``, writes ``4 P M``;
* ``DL @ B``: ``2 P M D``; reads ``e (P M + M D)``, writes ``4 P D``;
* ``DL^T @ A_hat_P``: ``2 P M D``; reads ``e (P M + P D)``, read-modify-writes the fp32 accumulator
  ``8 M D`` (arithmetic intensity ~P/4 FLOP per accumulator byte: P >= ~1200 keeps it compute-bound
  on an H100's HBM, so small budgets at very large M make this GEMM bandwidth-bound);
* the Triton kernel: reads ``4 P M`` (EAGER ``8 P M``) + masks, writes ``e P M`` (``kernels/panel.py``).
Workspace: ``Lraw`` 4 P M, ``DL`` e P M, A_P temporaries ~(12 + e) P D, the accumulator 4 M D.

Limits: products ``|pw_i A_i| |B_j|`` must stay in the fp32 range (raw B: rows of norm above ~1e37);
cuBLAS GEMMs are deterministic for a fixed shape, device and library version (set
``CUBLAS_WORKSPACE_CONFIG`` as PyTorch's determinism notes say when several streams are used); fp32
operands run the GEMMs in fp32 (or TF32 where the user allowed it), unlike the fused kernels' tf32x3.
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from ..kernels import panel as KP
from .norms import clamped_norms, normalize_backward_
from .spec import Coeffs, combine
from .triton_configs import PANEL_BLOCK_C, PANEL_BLOCK_R, PANEL_WARPS

__all__ = ["BUDGET_BYTES", "MIN_ELEMENTS", "PANEL_ROWS", "P_MIN", "panel_rows", "use_panel"]

#: Byte budget of the panel path's extra memory (env ``FUSED_CONTRASTIVE_PANEL_BUDGET`` overrides).
BUDGET_BYTES = 700_000_000
#: Fewest rows of a panel, whatever the budget says (below it the GEMMs lose their shape).
P_MIN = 64
#: Test hook: a fixed panel height (None: from the budget).
PANEL_ROWS: int | None = None
#: ``auto`` takes the panel path for CUDA tensors with N * M at least this (smaller problems are
#: launch-bound: the fused kernels do them in 3 launches).
MIN_ELEMENTS = 1 << 24
#: fp16 pre-scale of the gradient tile (see kernels/panel.py): |h| <= 6, 6 * 2^13 < 65504.
FP16_PRESCALE = 8192.0


def use_panel(a: Tensor, n: int, m: int) -> bool:
    """Which Triton path runs: env ``FUSED_CONTRASTIVE_TRITON_PATH`` = "panel", "fused" or "auto"
    (default). "auto": the panel path for CUDA tensors with N * M >= :data:`MIN_ELEMENTS`, the fused
    kernels otherwise (and always on the CPU interpreter, where the tests force either path)."""
    mode = os.environ.get("FUSED_CONTRASTIVE_TRITON_PATH", "auto")
    if mode not in ("auto", "panel", "fused"):
        raise ValueError(f"FUSED_CONTRASTIVE_TRITON_PATH must be 'auto', 'panel' or 'fused', got {mode!r}")
    if mode != "auto":
        return mode == "panel"
    return a.device.type == "cuda" and n * m >= MIN_ELEMENTS


def panel_rows(n: int, m: int, d: int, dtype: torch.dtype, need_db: bool) -> int:
    """P of the module docstring's formula (or :data:`PANEL_ROWS`)."""
    if PANEL_ROWS is not None:
        return max(1, min(n, PANEL_ROWS))
    budget = int(os.environ.get("FUSED_CONTRASTIVE_PANEL_BUDGET", BUDGET_BYTES))
    e = torch.empty((), dtype=dtype).element_size()
    fixed = (4 * m * d if need_db else 0) + (e * m * d if dtype == torch.float16 else 0)
    per_row = (4 + e) * m + (12 + e) * d
    p = (budget - fixed) // per_row
    p = p - p % 64 if p >= 64 else p
    return max(1, min(n, max(P_MIN, p)))


def _mm32(x: Tensor, y: Tensor) -> Tensor:
    """x @ y with an fp32 result (fp32 accumulation; 16-bit operands through cuBLAS's out_dtype)."""
    if x.dtype == torch.float32:
        return torch.mm(x, y)
    if x.device.type == "cpu":  # the CPU has no out_dtype GEMM: the interpreter tests' route
        return torch.mm(x.float(), y.float())
    return torch.mm(x, y, out_dtype=torch.float32)


def _addmm32_(acc: Tensor, x: Tensor, y: Tensor) -> None:
    """acc += x @ y in place, acc fp32."""
    if x.dtype == torch.float32:
        acc.addmm_(x, y)
    elif x.device.type == "cpu":
        acc.addmm_(x.float(), y.float())
    else:
        torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)


def _pow2(x: Tensor) -> Tensor:
    """Per row the power of two that puts the row's largest magnitude in [1, 2) (1 for fp16: its
    products cannot overflow fp32, and scaling could push elements into fp16 subnormals)."""
    if x.dtype == torch.float16:
        return torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    big = x.abs().amax(dim=1).float()
    _, e = torch.frexp(big)
    return torch.ldexp(torch.ones_like(big), (1 - e).clamp(-126, 126))


class _Problem:
    """Norms and operands of one sweep (O(N + M) plus, for fp16, the normalised copy of B)."""

    def __init__(self, a: Tensor, b: Tensor, same: bool, spec, chunk: int):
        self.a, self.b, self.spec = a, b, spec
        self.normalize = spec.normalize
        self.dt = a.dtype
        if spec.normalize:
            self.na = clamped_norms(a, spec.eps, torch.float32)
            self.nb = self.na if same else clamped_norms(b, spec.eps, torch.float32)
            self.ra, self.rb = 1.0 / self.na, 1.0 / self.nb
        else:
            self.na = self.nb = self.ra = self.rb = None
        self.fold = spec.normalize and self.dt != torch.float16
        self.prescale = FP16_PRESCALE if self.dt == torch.float16 else 1.0
        self.b_op = b
        if spec.normalize and not self.fold:
            # fp16: the normalised B in fp16 (rounded once from fp32, as the fused kernels' operand)
            self.b_op = torch.empty_like(b)
            for c0 in range(0, b.shape[0], chunk):
                self.b_op[c0:c0 + chunk] = self.hat(b, self.rb, c0, c0 + chunk).to(self.dt)

    def hat(self, x: Tensor, r: Tensor | None, r0: int, r1: int) -> Tensor:
        """Rows [r0, r1) of x normalised, fp32."""
        xf = x[r0:r1].float()
        return xf * r[r0:r1, None] if r is not None else xf


def _gscale(vecs) -> Tensor:
    present = [v for v in vecs if v is not None]
    gs = torch.stack([x.abs().amax() for x in present]).amax()
    return torch.where(gs > 0, gs, torch.ones_like(gs)).reshape(1)


def sweep(launch, prep, a: Tensor, b: Tensor, same_storage: bool, sym: bool, scale_t: Tensor, spec,
          lse: Tensor | None, lse_col: Tensor | None, lse_pos: Tensor | None,
          g: Tensor | None, g_col: Tensor | None, g_pos: Tensor | None,
          need_a: bool, need_b: bool, need_s: bool, eager: bool):
    """One panel sweep: ``(dA, dB, ds, LSE, LSEpos)`` (dA / dB in the operand dtype, ds 0-dim fp32;
    LSE / LSEpos only with ``eager``, else None; None where not asked).

    ``prep`` is the fused path's ``_Prepared`` (labels, mask, bias columns, dummy); ``launch`` is
    ``triton_backend._launch`` (so the AOT recorder sees these launches). With ``eager``, ``g`` /
    ``g_pos`` are the coefficients as [N] fp32 and ``lse`` / ``lse_pos`` are produced here. ``sym``:
    B is A without a bias, dA holds both roles and dB is None.
    """
    from .triton_backend import Launch, _alloc, _mask_args, _problem_args

    n, d = a.shape
    m = b.shape[0]
    dev, dt = a.device, a.dtype
    need_b = need_b and not sym
    gcols = m if spec.grad_cols is None else min(m, int(spec.grad_cols))
    p_rows = panel_rows(n, m, d, dt, need_b)
    pr = _Problem(a, b, sym or same_storage, spec, p_rows)
    gs = _gscale((g, g_col, g_pos))
    dm = prep.dummy
    lse_out = torch.empty(n, dtype=torch.float32, device=dev) if eager else None
    lsep_out = torch.empty(n, dtype=torch.float32, device=dev) if eager and g_pos is not None else None
    da = _alloc((n, d), dt, dev) if need_a else None
    acc = torch.zeros((gcols, d), dtype=torch.float32, device=dev) if need_b and gcols > 0 else None
    ds_parts = []
    rb = pr.rb if pr.rb is not None else dm
    common = dict(RB=rb, SCALE=scale_t, GSCALE=gs, **_problem_args(prep),
                  LSE=lse if lse is not None else dm, G=g if g is not None else dm,
                  LSE_COL=lse_col if lse_col is not None else dm, G_COL=g_col if g_col is not None else dm,
                  LSE_POS=lse_pos if lse_pos is not None else dm, G_POS=g_pos if g_pos is not None else dm,
                  LSE_OUT=lse_out if lse_out is not None else dm,
                  LSE_POS_OUT=lsep_out if lsep_out is not None else dm)
    flags = dict(NORMALIZE=bool(spec.normalize), EXCLUDE_SELF=bool(spec.exclude_self),
                 HAS_BIAS=prep.bias_col is not None, POS_KIND=prep.pos_kind, HAS_G=g is not None,
                 HAS_GCOL=g_col is not None, HAS_GPOS=g_pos is not None, SYM=bool(sym), EAGER=bool(eager),
                 NEED_DS=bool(need_s), FOLD_RB=bool(pr.fold), PRESCALE=pr.prescale)
    post = scale_t.reshape(()) * gs.reshape(()) / pr.prescale  # s gs / PRESCALE, a device scalar
    bt = b.T
    for r0 in range(0, n, p_rows):
        r1 = min(n, r0 + p_rows)
        pp = r1 - r0
        a_p = a[r0:r1]
        pw = _pow2(a_p)
        a_s = a_p if dt == torch.float16 else (a_p.float() * pw[:, None]).to(dt)
        rsp = (pr.ra[r0:r1] / pw) if pr.normalize else 1.0 / pw
        lraw = _mm32(a_s, bt)
        del a_s
        dl = _alloc((pp, m), dt, dev)
        n_prog = triton.cdiv(pp, PANEL_BLOCK_R)
        ds_part = _alloc((n_prog,), torch.float32, dev) if need_s else dm
        launch(Launch(
            "panel_dl", KP.panel_dl_kernel, (n_prog,),
            dict(L=lraw, DL=dl, RSP=rsp.contiguous(), **common, DS_PART=ds_part, M=m, r0=r0, P=pp,
                 stride_l=lraw.stride(0), stride_dl=dl.stride(0), **_mask_args(prep, spec)),
            dict(BLOCK_R=PANEL_BLOCK_R, BLOCK_C=PANEL_BLOCK_C, **flags), PANEL_WARPS, 1))
        del lraw
        if need_s:
            ds_parts.append(ds_part)
        if need_a:
            da_p = _mm32(dl, pr.b_op).mul_(post)
            if pr.normalize:
                da_p = normalize_backward_(da_p, pr.hat(a, pr.ra, r0, r1), pr.na[r0:r1], spec.eps)
            da[r0:r1] = da_p.to(dt)
            del da_p
        if acc is not None:
            a_hat = pr.hat(a, pr.ra, r0, r1).to(dt) if pr.normalize else a_p
            _addmm32_(acc, dl[:, :gcols].T, a_hat)
        del dl
    db = None
    if need_b:
        db = _alloc((m, d), dt, dev)
        if gcols < m:
            db[gcols:].zero_()  # queue columns get no gradient
        for c0 in range(0, gcols, p_rows):
            c1 = min(gcols, c0 + p_rows)
            g_hat = acc[c0:c1].mul_(post)
            if pr.normalize:
                if pr.fold:
                    g_hat.mul_(pr.nb[c0:c1, None])  # undo the inverse norm folded into DL
                g_hat = normalize_backward_(g_hat, pr.hat(b, pr.rb, c0, c1), pr.nb[c0:c1], spec.eps)
            db[c0:c1] = g_hat.to(dt)
        del acc
    ds = None
    if need_s:
        ds = (torch.cat(ds_parts).sum() * gs.reshape(())) if ds_parts else torch.zeros((), device=dev)
    return da, db, ds, lse_out, lsep_out


def _vec(c, n: int, dev) -> Tensor:
    if isinstance(c, Tensor):
        return c.to(device=dev, dtype=torch.float32).contiguous()
    return torch.full((n,), float(c), dtype=torch.float32, device=dev)


def forward(ctx, a: Tensor, b: Tensor | None, orig_dtypes, scale, spec, data, coef: Coeffs, reduce: bool):
    """TritonCoreFn.forward on the panel path (``a``, ``b`` already in the kernel dtype)."""
    from . import triton_backend as TB

    same = b is None
    want_col, want_pos = coef.col is not None, coef.pos is not None
    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    need_s = need_s and isinstance(scale, Tensor)
    n = a.shape[0]
    dev = a.device
    p = TB._prepare_data(a, b, spec, data, want_pos)
    bb = p.b
    sym = p.sym
    ctx.path = "panel"
    ctx.spec, ctx.coef, ctx.reduce = spec, coef, reduce
    ctx.scale = None if isinstance(scale, Tensor) else scale
    ctx.dtypes = orig_dtypes
    ctx.prep = p._replace(a=None, b=None, sa=None, sb=None)
    scale_t = TB._scale32(scale, dev)
    eager = reduce and not sym and not want_col and (need_a or need_b or need_s)
    if eager:
        g = _vec(coef.lse, n, dev)
        g_pos = _vec(coef.pos, n, dev) if want_pos else None
        da, db, ds, lse, lse_pos = sweep(TB._launch, p, p.a, bb, same, False, scale_t, spec, None, None, None,
                                         g, None, g_pos, need_a, need_b or (same and need_a), need_s, True)
        if same and da is not None:
            da = da + db  # B is A with a bias: both roles of A
            db = None
        ctx.eager = (da, db, ds)
        lse_col = None
    else:
        ctx.eager = None
        lse, lse_col, lse_pos, _ = TB._lse_fwd(a, b, scale, spec, data, want_col, want_pos)
    ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos, p.a,
                          None if same else p.b)
    return combine(coef.to(torch.float32), reduce, lse, lse_col, lse_pos)


def backward(ctx, go: Tensor):
    """TritonCoreFn.backward on the panel path."""
    from . import triton_backend as TB

    need_a, need_b, need_s = ctx.needs_input_grad[:3]
    adt, bdt, sdt, sshape = ctx.dtypes
    same = bdt is None
    go = go.to(torch.float32)

    def out(da, db, ds):
        return (da.to(adt) if need_a and da is not None else None,
                db.to(bdt) if need_b and not same and db is not None else None,
                ds.to(sdt).reshape(sshape) if need_s and ds is not None else None,
                None, None, None, None)

    if ctx.eager is not None:
        da, db, ds = ctx.eager
        ctx.eager = None  # a second backward (retain_graph) recomputes from the saved statistics
        return out(da.mul_(go.to(da.dtype)) if da is not None else None,
                   db.mul_(go.to(db.dtype)) if db is not None else None,
                   ds * go if ds is not None else None)
    scale, lse, lse_col, lse_pos, a, b = ctx.saved_tensors
    if scale is None:
        scale = ctx.scale
    spec, coef = ctx.spec, ctx.coef
    p = ctx.prep
    n = lse.shape[0]
    g = TB._coef_grad(coef.lse, go, n, lse)
    g_col = TB._coef_grad(coef.col, go, lse_col.shape[0], lse_col) if lse_col is not None else None
    g_pos = TB._coef_grad(coef.pos, go, n, lse_pos)
    bb = a if same else b
    sym = p.sym
    need_s = need_s and isinstance(scale, Tensor)
    da, db, ds, _, _ = sweep(TB._launch, p, a, bb, same, sym, TB._scale32(scale, a.device), spec, lse, lse_col,
                             lse_pos, g, g_col, g_pos, need_a, (need_b and not same) or (same and not sym and need_a),
                             need_s, False)
    if same and not sym and da is not None:
        da = da + db
        db = None
    return out(da, db, ds)
