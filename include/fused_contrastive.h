/* fused_contrastive.h - C API of the ahead-of-time compiled core-op kernels (libfused_contrastive_kernels).
 *
 * The Triton kernels of fused_contrastive (kernels/lse.py), compiled at build time for sm_80 / sm_90 and
 * launched through the CUDA driver API (libcuda.so.1 is dlopen'ed on first use: no link-time CUDA
 * dependency; FUSED_CONTRASTIVE_LIBCUDA overrides the library path). The host logic mirrors the Python
 * launcher (fused_contrastive/core/triton_shared/launch.py: _lse_fwd, _lse_bwd): same configs, grids,
 * scratch buffers and argument lists; a ctest compares both launch by launch.
 *
 * Math (normalised rows a_i = A_i / max(||A_i||, eps), b_j likewise, runtime scale s):
 *   l_ij = s <a_i, b_j>        (-inf at j == offset + i in FC_MODE_SELF)
 *   l_ij = s (<a_i, b_j> - margin)  at j == target[i] when margin != 0 (additive margin, cosine units)
 *   LSE_i = log sum_j exp(l_ij),   LSEcol_j = log sum_i exp(l_ij)  (FC_MODE_CLIP)
 * A loss adds its linear positive term (e.g. -l_ii, with the margin: -s (<a_i, b_i> - margin)) itself;
 * it is O(N*D). With a margin, dL/ds takes <a_i, b_t> - margin at the target (fc_backward's ds_part does).
 *
 * Modes (the compiled feature set; positives by labels / masks, bias and queue masks are not shipped):
 *   FC_MODE_INFO_NCE  B given, row LSE                      (InfoNCE / MNRL with keys)
 *   FC_MODE_CLIP      B given, row LSE and column LSE       (CLIP: both directions from one pass)
 *   FC_MODE_SELF      B is A, the self column excluded     (SimCSE-style in-batch, symmetric backward)
 * FC_MODE_INFO_NCE and FC_MODE_CLIP also take a target margin (fc_problem.margin, .target): AM-softmax /
 * LaBSE, its row form (FC_MODE_INFO_NCE, target[i] = i) and its symmetric form (FC_MODE_CLIP, the margin
 * on the diagonal: target[i] = i with n == m). Those are their own kernels, built as the feature sets
 * "info_nce_margin" / "clip_margin" of FC_MODES; margin == 0 runs the plain kernels (target ignored).
 *
 * Conventions: every pointer is a CUDA device pointer (CUdeviceptr cast to void*), 16-byte aligned;
 * rows have a contiguous inner dimension; D and every row stride must be multiples of 16 elements; N, M,
 * D, strides < 2^31. The calls are asynchronous on `stream` (a CUstream, NULL = the legacy default
 * stream) and use the calling thread's current CUDA context. All entry points are thread-safe. On error
 * nothing is launched and fc_last_error() (thread-local) holds a message naming the argument.
 */
#ifndef FUSED_CONTRASTIVE_H
#define FUSED_CONTRASTIVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FC_API
#else
#define FC_API __attribute__((visibility("default")))
#endif

typedef enum fc_status {
  FC_OK = 0,
  FC_ERR_INVALID_ARGUMENT = 1,   /* NULL where a pointer is required, negative size, ... */
  FC_ERR_NO_DRIVER = 2,          /* libcuda.so.1 (or FUSED_CONTRASTIVE_LIBCUDA) cannot be loaded */
  FC_ERR_NO_DEVICE = 3,          /* cuInit failed: no GPU / no usable device */
  FC_ERR_NO_CONTEXT = 4,         /* no current CUDA context on this thread */
  FC_ERR_UNSUPPORTED_ARCH = 5,   /* no kernels built for this device's compute capability */
  FC_ERR_UNSUPPORTED_DTYPE = 6,  /* dtype not built (CMake option FC_DTYPES) */
  FC_ERR_UNSUPPORTED_SHAPE = 7,  /* D class not built (FC_DCLASSES), D or a stride not a multiple of 16, >= 2^31 */
  FC_ERR_UNSUPPORTED_MODE = 8,   /* mode not built (FC_MODES) or not valid for this call */
  FC_ERR_MISALIGNED = 9,         /* a pointer is not 16-byte aligned */
  FC_ERR_WORKSPACE = 10,         /* workspace NULL or smaller than fc_workspace_size() */
  FC_ERR_DRIVER = 11             /* a CUDA driver call failed (message has the call and its error) */
} fc_status;

typedef enum fc_dtype { FC_FLOAT32 = 0, FC_FLOAT16 = 1, FC_BFLOAT16 = 2 } fc_dtype;

typedef enum fc_mode { FC_MODE_INFO_NCE = 0, FC_MODE_CLIP = 1, FC_MODE_SELF = 2 } fc_mode;

/* One problem: the inputs shared by forward and backward. */
typedef struct fc_problem {
  fc_mode mode;
  fc_dtype dtype;        /* of A, B, dA, dB */
  int64_t n, m, d;       /* A [n, d], B [m, d]; m is ignored (= n) in FC_MODE_SELF */
  const void *a;         /* [n, d], row stride stride_a (elements) */
  int64_t stride_a;
  const void *b;         /* [m, d] (NULL in FC_MODE_SELF) */
  int64_t stride_b;
  const float *scale;    /* 1 float on the device: s (1 / temperature); a runtime value, never recompiles */
  float eps;             /* norm clamp, e.g. 1e-12 */
  int64_t offset;        /* FC_MODE_SELF: row i's excluded column is offset + i (0 when B is A) */
  /* Additive target margin (cosine units, finite; 0 = none, the default of a zeroed struct): row i's logit
     at column target[i] is s (<a_i, b_target[i]> - margin), in the row LSE, the column LSE (FC_MODE_CLIP)
     and the gradients (dL/ds takes <a_i, b_t> - margin there). FC_MODE_INFO_NCE and FC_MODE_CLIP only:
     FC_ERR_UNSUPPORTED_MODE in FC_MODE_SELF or when the "<mode>_margin" kernels were not built. */
  float margin;
  /* [n] int64 on the device, 16-byte aligned: row i's target column, in [0, m). Required when margin != 0
     (FC_ERR_INVALID_ARGUMENT if NULL, FC_ERR_MISALIGNED), ignored otherwise. The values are device memory
     and are not checked: a value outside [0, m) matches no column, so that row gets no margin. */
  const int64_t *target;
} fc_problem;

typedef struct fc_backward_args {
  const float *lse;      /* [n] from fc_forward */
  const float *lse_col;  /* [m] merged column LSE (FC_MODE_CLIP; see fc_col_partials), else NULL */
  const float *g;        /* [n] dL/dLSE (0 where LSE is -inf) */
  const float *g_col;    /* [m] dL/dLSEcol (FC_MODE_CLIP), else NULL */
  const float *gscale;   /* 1 float > 0 on the device: g, g_col are divided by it before the 16-bit cast of the
                            gradient tile and multiplied back after (use max |g|, |g_col|; 1 is valid) */
  void *da;              /* [n, d] in dtype (required): dL/dA (both roles of A in FC_MODE_SELF) */
  int64_t stride_da;
  void *db;              /* [m, d] in dtype, or NULL: no dB (must be NULL in FC_MODE_SELF) */
  int64_t stride_db;
  int64_t grad_cols;     /* only rows [0, grad_cols) of dB are written (a queue after them); -1: all m */
  float *ds_part;        /* [fc_ds_rows()] partial sums: dL/ds = gscale * sum(ds_part) */
} fc_backward_args;

/* Name of a status ("FC_ERR_UNSUPPORTED_ARCH", ...). */
FC_API const char *fc_status_name(fc_status s);
/* Message of the last error on this thread ("" after success). */
FC_API const char *fc_last_error(void);
/* What this library was built with: "archs=80;90 dtypes=bf16 dclasses=128;big modes=info_nce;clip;self". */
FC_API const char *fc_build_info(void);

/* Bytes of device workspace one problem needs (the scaled row copies and norms the backward reuses, the
   column-LSE partials, the streaming backward's fp32 scratch). The same workspace must be passed to
   fc_forward and then fc_backward of that problem, unmodified in between. Queries the current device. */
FC_API fc_status fc_workspace_size(const fc_problem *p, size_t *bytes);

/* Forward: lse [n] fp32; in FC_MODE_CLIP also the column-LSE partials in the workspace. */
FC_API fc_status fc_forward(const fc_problem *p, void *workspace, size_t workspace_bytes, float *lse, void *stream);

/* FC_MODE_CLIP after fc_forward: where the [*rows, m] fp32 partial column LSEs are (inside the workspace):
   LSEcol_j = logsumexp over r of part[r * m + j] (deterministic merge, left to the caller). */
FC_API fc_status fc_col_partials(const fc_problem *p, void *workspace, float **part, int64_t *rows);

/* Rows of fc_backward_args.ds_part for this problem on the current device. */
FC_API fc_status fc_ds_rows(const fc_problem *p, int64_t *rows);

/* Backward: dA, dB (optional) and the scale-gradient partials. */
FC_API fc_status fc_backward(const fc_problem *p, const fc_backward_args *args, void *workspace,
                             size_t workspace_bytes, void *stream);

/* ---- the target split: the loss of a saturated softmax --------------------------------------------------
 * In fp16 / bf16 with a peaked softmax (p_t ~ 0.9999) the loss LSE_i - l_it cancels in fp32 (a row loss of ~1e-4
 * against logits of ~|s|), and the backward rounds the target's weight p_it g_i into the 16-bit gradient tile,
 * where it meets the target term's -g_i. The split calls keep each row's target entry apart (the SPLIT_T kernels
 * of the feature sets "info_nce_split" / "clip_split" / "self_split", and with a target margin (fc_problem.margin
 * != 0, its target the same vector as the split's) "info_nce_margin_split" / "clip_margin_split"; the logits l_it
 * below then carry the margin, s (cos - margin); FC_ERR_UNSUPPORTED_MODE when the feature set was not built).
 * In FC_MODE_SELF (B is A) t_i is row i's partner
 * (never i itself, which is excluded: that row then gets lt[i] = -inf), and row t_i of dA takes the B role below. `target`: [n] int64 on the device, 16-byte aligned, row i's target column
 * t_i (not range-checked). They use the workspace, fc_col_partials and fc_ds_rows of the plain calls.
 *
 * fc_forward_split writes
 *   lse_x [n]   LSEx_i = log sum_{j != t_i} exp(l_ij)          (the row LSE without its target entry)
 *   lt   [2n]   lt[i] = l_it, from the row's fp32 dot with its target row; lt[n + i] = the row's largest tile logit.
 *               The caller fills lt with -inf first (a row whose target matches no column keeps lt[i] = -inf).
 * and in FC_MODE_CLIP column j's partials keep the entry (j, j) apart where target[j] == j (LSEcolx_j; the other
 * columns keep every entry). The caller forms, in fp32 (as fused_contrastive/core/lse/triton_fused.py _lse_fwd):
 *   row loss   LSE_i - l_it = softplus(LSEx_i - lt[i])          where lt[i] > -inf, else LSEx_i
 *   column     LSEcol_j - l_jj = softplus(LSEcolx_j - lt[j])    where target[j] == j (j < n), else LSEcolx_j
 *   the backward's LSE   lse_i = logaddexp(LSEx_i, tt_i),  tt_i = lt[n + i] if lt[i] >= lt[n + i] - 2^-14 max(1,
 *              |lt[n + i]|) else lt[i] (the target logit as the tiles round it); lse_col_j likewise with tt_j
 *              where target[j] == j.
 * fc_backward_split takes that lse (and lse_col) in args and leaves each row's target entry (i, t_i) out of dA and
 * dB. tv [n] is read and written: on entry it holds, divided by args->gscale, each row's weight at l_it of the LSE
 * terms combined with the target term's share that the loss above took out (formed without the cancellation of
 * p_t - 1, which in fp32 keeps nothing where 1 - p_t is below an ulp of |s|; python: core/lse/triton_fused.py
 * exact_weights), with g_i = dL/dLSE_i, gc_j = dL/dLSEcol_j:
 *   W_i = -g_i exp(LSEx_i - lse_i)                               where lt[i] > -inf (else 0)
 *       + FC_MODE_CLIP: -gc_i exp(LSEcolx_i - lse_col_i)         where target[i] == i and lt[i] > -inf
 *                       gc_t exp(tt_i - lse_col_t), t = target[i]  elsewhere
 * The kernel takes W_i at the target entry (ds_part counts it) and writes it back. The caller applies w_i = gscale
 * tv_i together with what is left of its target term's coefficient c_i (0 for the loss LSE_i - l_it on a row with
 * lt[i] > -inf: W_i holds its -g_i) in fp32: dA_i += (w_i + c_i) dl_it/dA_i, dB_t += (w_i + c_i) dl_it/dB_t, and
 * dL/ds += c_i <a_i, b_t> (W_i's part is in ds_part), where l_it = s <a_i, b_t>, a_i = A_i / max(||A_i||, eps)
 * (python: fused_contrastive/core/linear_terms.py). */
FC_API fc_status fc_forward_split(const fc_problem *p, const int64_t *target, void *workspace, size_t workspace_bytes,
                                  float *lse_x, float *lt, void *stream);
FC_API fc_status fc_backward_split(const fc_problem *p, const fc_backward_args *args, const int64_t *target, float *tv,
                                   void *workspace, size_t workspace_bytes, void *stream);

/* ---- kernel level: the panel path's kernels --------------------------------------------------------
 * For large problems the Python package's Triton backend takes a "panel path" (core/lse/triton_panel.py):
 * cuBLAS GEMMs over row panels with small Triton kernels between them. This library has no GEMM, so it
 * does not run that path itself; libfused_contrastive_torch drives it (at::mm for the GEMMs) and
 * launches the kernels through the two calls below. They are usable from C, but the argument lists
 * are the kernels' own (kernels/panel.py): callers are expected to mirror triton_panel.py. */

/* Compute capability (80 or 90, as the kernels were built for) and SM count of the current device. */
FC_API fc_status fc_device_props(int *cc, int *sms);

/* The launch configuration the Python launcher uses for `kernel` ("lse_fwd", "lse_bwd_rows", "lse_bwd_cols")
   at D on the current device's arch: block sizes (block_d: the padded D of a resident config, else the
   streamed chunk). "lse_fwd" is the forward with column statistics (CLIP, the triangular forward); the
   forward with row statistics only (fc_forward in the modes without a column LSE) takes its own entry,
   128 x 256 tiles on sm_90 for D > 128. */
FC_API fc_status fc_kernel_config(const char *kernel, fc_dtype dtype, int64_t d, int *block_m, int *block_n,
                                  int *block_d);

typedef enum fc_karg_kind { FC_KARG_PTR = 0, FC_KARG_INT = 1, FC_KARG_FLOAT = 2 } fc_karg_kind;

/* One runtime argument by parameter name: ptr (a device pointer), i (integer types) or f (fp32). */
typedef struct fc_karg {
  const char *name;
  fc_karg_kind kind;
  const void *ptr;
  int64_t i;
  double f;
} fc_karg;

/* Launch the generated kernel `kernel` (e.g. "panel_dl") for the current device's arch and `dtype`, the
   variant compiled with `constexprs` ("NAME=value,..." sorted by name; bools 0/1, floats with one
   decimal, as the generator's manifest lists them), on `grid` x 1 x 1 programs. Every runtime parameter
   must be given exactly once, pointers 16-byte aligned where compiled so. FC_ERR_UNSUPPORTED_SHAPE when
   no such variant was built. */
FC_API fc_status fc_launch_kernel(const char *kernel, fc_dtype dtype, const char *constexprs, int64_t grid,
                                  const fc_karg *args, int nargs, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FUSED_CONTRASTIVE_H */
