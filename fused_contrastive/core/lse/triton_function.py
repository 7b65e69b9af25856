"""The autograd Function of the core op on Triton: it picks the path (the ahead-of-time library, the
panel path of ``triton_panel.py`` or the fused kernels of ``triton_shared/launch.py``) and applies the
coefficients of ``spec.py`` (``LSE``, ``LSEcol``, ``LSEpos`` vectors) in PyTorch; the linear positive
terms come from ``linear_terms.py``, called by ``core.run``. It is the top of the Triton modules: it
imports them, none of them imports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._amp import autocast_off
from ..._first_order import first_order
from ..spec import Coeffs, CoreData, CoreSpec, combine, set_grad
from ..target_split import minus_coefficients
from ..triton_shared import launch as TL
from ..triton_shared import panels
from . import library_route, triton_fused, triton_panel

__all__ = ["TritonCoreFn", "core"]


class TritonCoreFn(torch.autograd.Function):
    """``c.lse LSE + c.col LSEcol + c.pos LSEpos`` per row ([N]) or summed (0-dim), float32, on the
    Triton kernels.

    Saved for backward: the inputs (alive anyway), the scaled copies and norms (O(N*D)) and the LSEs;
    backward recomputes the tiles. Gradients come back in each input's dtype (the scale's in the
    scale's dtype), None for inputs that do not require grad.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    @autocast_off
    def forward(ctx, a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
                reduce: bool):
        dt = TL.kernel_dtype(a, b)
        ak = a.to(dt)
        bk = None if b is None else b.to(dt)
        n, m = a.shape[0], (a.shape[0] if b is None else b.shape[0])
        dtypes = (a.dtype, None if b is None else b.dtype, scale.dtype if isinstance(scale, Tensor) else None,
                  scale.shape if isinstance(scale, Tensor) else None)
        aot_mode = library_route.route(ak, bk, spec, data, coef)
        if aot_mode is not None:  # the ahead-of-time library (FUSED_CONTRASTIVE_AOT_LIB): no JIT
            return library_route.forward(ctx, ak, bk, dtypes, scale, spec, data, coef, reduce, aot_mode)
        if panels.use_panel(ak, n, m):
            return triton_panel.forward(ctx, ak, bk, dtypes, scale, spec, data, coef, reduce)
        ctx.path = "fused"
        # the target column left out of the 16-bit tiles (core.PiecesFn asks, with a target term; no loss
        # combines one with a softmax over positives, whose symmetric kernel would then spill)
        ctx.split = data.target if getattr(ctx, "split_target", False) and coef.pos is None else None
        # and each row's loss less its target logit formed without the cancellation (triton_fused._lse_fwd's
        # target split; with a column term, CLIP, the column's too; core.forward_parts takes c_i l_it out of the
        # target term's value)
        minus: dict = {}
        split16 = triton_fused.splits_forward(ctx, coef, dt)
        lse, lse_col, lse_pos, p = triton_fused._lse_fwd(ak, bk, scale, spec, data, coef.col is not None,
                                                         coef.pos is not None, target=ctx.split if split16 else None,
                                                         minus_target=minus)
        # the SET term's gradient formed inside the 16-bit tiles (core.PiecesFn hands over its coefficients)
        ctx.set_c = triton_fused.set_split(ctx, dt, spec, data, coef)
        if ctx.set_c is not None:
            p = TL.with_positives(p, ak, bk, spec, data)
        ctx.spec, ctx.coef = spec, coef
        # the tensors go through save_for_backward (in-place edits of the inputs are caught); the rest
        # of the prepared inputs (labels, masks, norms: O(N + M)) rides on ctx
        ctx.prep = p._replace(a=None, b=None, sa=None, sb=None)
        ctx.scale = None if isinstance(scale, Tensor) else scale
        ctx.dtypes = dtypes
        same = b is None
        ctx.save_for_backward(scale if isinstance(scale, Tensor) else None, lse, lse_col, lse_pos, p.a,
                              None if same else p.b, p.sa, None if same else p.sb)
        if minus:
            ctx.minus_target = minus_coefficients(coef, minus, n)
            # the split's statistics for the backward's exact target weights (O(N + M))
            triton_fused.keep_exact(ctx, minus, ctx.minus_target, p.sym, coef.col is not None)
            return combine(coef.to(torch.float32), reduce, minus["loss"], minus.get("col_loss", lse_col), lse_pos)
        return combine(coef.to(torch.float32), reduce, lse, lse_col, lse_pos)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @autocast_off
    @first_order("TritonCoreFn")
    def backward(ctx, go: Tensor):
        if ctx.path == "panel":
            return triton_panel.backward(ctx, go)
        if ctx.path == "aot":
            return library_route.backward(ctx, go)
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        scale, lse, lse_col, lse_pos, a, b, sa, sb = ctx.saved_tensors
        if scale is None:
            scale = ctx.scale
        spec, coef = ctx.spec, ctx.coef
        same = ctx.dtypes[1] is None
        p = ctx.prep._replace(a=a, b=a if same else b, sa=sa, sb=sa if same else sb)
        go = go.to(torch.float32)
        n = lse.shape[0]
        g = TL._coef_grad(coef.lse, go, n, lse)
        g_col = TL._coef_grad(coef.col, go, lse_col.shape[0], lse_col) if lse_col is not None else None
        g_pos = TL._coef_grad(coef.pos, go, n, lse_pos)
        g_set = None if ctx.set_c is None else set_grad(ctx.set_c, go, n)
        wide, split = getattr(ctx, "wide", False), ctx.split
        # each row's weight at its target combined with the target term's, without the cancellation of p_t - 1 (with
        # them a frozen A runs no row kernel: the target columns' weights are these)
        exact = triton_fused.backward_exact(ctx, split, g, g_col, lse_col)
        if split is not None and exact is None and not need_a and not need_s and a.dtype == torch.float32:
            # a frozen A (LiT's locked image tower) without the split statistics: the row kernel would run only to
            # report the target column's fp32 weight, so the column kernel takes the target column as it is, and
            # nothing recomputes the tiles for A
            split = None
        if same and not p.sym:
            # B is A but with a bias (never used by the losses): dA + dB of the plain kernels
            out = triton_fused._lse_bwd(p, scale, spec, lse, lse_col, lse_pos, g, g_col, g_pos, need_a, need_a, need_s,
                                        wide, split, g_set, exact)
        else:
            out = triton_fused._lse_bwd(p, scale, spec, lse, lse_col, lse_pos, g, g_col, g_pos,
                              need_a, need_b and not same, need_s, wide, split, g_set, exact)
        da, db, ds = out[:3]
        if split is not None:
            ctx.moved_target = out[3]  # what core.PiecesFn applies with the target term
            # (the target term's coefficients already in it: core.backward_parts has the target term leave them out)
            ctx.moved_less = ctx.exact_less if exact is not None else None
        ctx.took_set = g_set is not None  # the SET term's gradient is in these (core.PiecesFn drops its own)
        if same and not p.sym:
            da = None if da is None else da + db
        adt, bdt, sdt, sshape = ctx.dtypes
        ga = da.to(adt) if need_a and da is not None else None
        gb = db.to(bdt) if need_b and not same and db is not None else None
        gs = ds.to(sdt).reshape(sshape) if need_s and ds is not None else None
        return ga, gb, gs, None, None, None, None


def core(a: Tensor, b: Tensor | None, scale, spec: CoreSpec, data: CoreData, coef: Coeffs,
         reduce: bool) -> Tensor:
    """``c.lse LSE + c.col LSEcol + c.pos LSEpos`` per row (or summed) on the Triton kernels (float32)."""
    return TritonCoreFn.apply(a, b, scale, spec, data, coef, reduce)
