/* fc_api.c - host side of libfused_contrastive_kernels: the Python launcher's host logic for the
 * covered modes (fused_contrastive/core/triton_shared/launch.py: _prepare, _row_norms, _lse_fwd, _lse_bwd)
 * on the generated tables (fc_kernels_gen.h: variants, argument layouts, launch configs), and the
 * CUDA driver reached only through dlopen.
 *
 * Arguments are set by parameter name (as the Python launcher passes keyword arguments); the generated
 * layout of each kernel orders and types them, so a kernel's parameter list is never re-typed here.
 * Triton 3.x kernels take two extra trailing pointers (global scratch, profile scratch): the generator
 * refuses kernels that need either, and NULL is passed for both (as triton's launcher does then).
 */
#define _GNU_SOURCE
#include "fused_contrastive.h"

#include <cuda.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fc_kernels_gen.h"

/* ------------------------------------------------------------------------------------------------ */
/* errors                                                                                           */
/* ------------------------------------------------------------------------------------------------ */

static __thread char g_err[512];

static fc_status fail(fc_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = snprintf(g_err, sizeof g_err, "%s: ", fc_status_name(s));
  vsnprintf(g_err + k, sizeof g_err - (size_t)k, fmt, ap);
  va_end(ap);
  return s;
}

const char *fc_status_name(fc_status s) {
  static const char *names[] = {"FC_OK", "FC_ERR_INVALID_ARGUMENT", "FC_ERR_NO_DRIVER", "FC_ERR_NO_DEVICE",
                                "FC_ERR_NO_CONTEXT", "FC_ERR_UNSUPPORTED_ARCH", "FC_ERR_UNSUPPORTED_DTYPE",
                                "FC_ERR_UNSUPPORTED_SHAPE", "FC_ERR_UNSUPPORTED_MODE", "FC_ERR_MISALIGNED",
                                "FC_ERR_WORKSPACE", "FC_ERR_DRIVER"};
  return ((unsigned)s < sizeof names / sizeof *names) ? names[s] : "FC_ERR_UNKNOWN";
}

const char *fc_last_error(void) { return g_err; }

const char *fc_build_info(void) {
  return "archs=" FC_ARCHS_BUILT " dtypes=" FC_DTYPES_BUILT " dclasses=" FC_DCLASSES_BUILT " modes=" FC_MODES_BUILT;
}

/* ------------------------------------------------------------------------------------------------ */
/* the driver, through dlopen                                                                       */
/* ------------------------------------------------------------------------------------------------ */

static struct {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuCtxGetCurrent)(CUcontext *);
  CUresult (*cuCtxGetDevice)(CUdevice *);
  CUresult (*cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
  CUresult (*cuModuleLoadData)(CUmodule *, const void *);
  CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
  CUresult (*cuGetErrorName)(CUresult, const char **); /* optional */
  fc_status status;
  char msg[400];
} drv;

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void drv_load(void) {
  const char *path = getenv("FUSED_CONTRASTIVE_LIBCUDA");
  if (!path || !*path) path = "libcuda.so.1";
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    drv.status = FC_ERR_NO_DRIVER;
    snprintf(drv.msg, sizeof drv.msg, "cannot load the CUDA driver %s (%s); a GPU and its driver are needed", path,
             dlerror());
    return;
  }
#define SYM(name)                                                                                           \
  do {                                                                                                      \
    *(void **)&drv.name = dlsym(h, #name);                                                                  \
    if (!drv.name) {                                                                                        \
      drv.status = FC_ERR_NO_DRIVER;                                                                        \
      snprintf(drv.msg, sizeof drv.msg, "%s has no symbol %s", path, #name);                                \
      return;                                                                                               \
    }                                                                                                       \
  } while (0)
  SYM(cuInit);
  SYM(cuCtxGetCurrent);
  SYM(cuCtxGetDevice);
  SYM(cuDeviceGetAttribute);
  SYM(cuModuleLoadData);
  SYM(cuModuleGetFunction);
  SYM(cuFuncSetAttribute);
  SYM(cuLaunchKernel);
#undef SYM
  *(void **)&drv.cuGetErrorName = dlsym(h, "cuGetErrorName");
  CUresult r = drv.cuInit(0);
  if (r != CUDA_SUCCESS) {
    drv.status = FC_ERR_NO_DEVICE;
    snprintf(drv.msg, sizeof drv.msg, "cuInit failed with CUresult %d (no usable GPU)", (int)r);
    return;
  }
  drv.status = FC_OK;
}

static fc_status drv_fail(const char *call, CUresult r) {
  const char *name = NULL;
  if (drv.cuGetErrorName) drv.cuGetErrorName(r, &name);
  return fail(FC_ERR_DRIVER, "%s failed: %s (%d)", call, name ? name : "?", (int)r);
}

typedef struct {
  CUcontext ctx;
  int cc, sms, smem_optin;
} fc_device;

/* The current context's device: compute capability and SM count (the Python launcher's _cuda_props). */
static fc_status current_device(fc_device *dev) {
  pthread_once(&drv_once, drv_load);
  if (drv.status != FC_OK) return fail(drv.status, "%s", drv.msg);
  CUcontext ctx = NULL;
  CUresult r = drv.cuCtxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS) return drv_fail("cuCtxGetCurrent", r);
  if (!ctx) return fail(FC_ERR_NO_CONTEXT, "no current CUDA context on this thread (make one current first)");
  CUdevice d;
  if ((r = drv.cuCtxGetDevice(&d)) != CUDA_SUCCESS) return drv_fail("cuCtxGetDevice", r);
  int major = 0, minor = 0;
  if ((r = drv.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d)) != CUDA_SUCCESS ||
      (r = drv.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d)) != CUDA_SUCCESS ||
      (r = drv.cuDeviceGetAttribute(&dev->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d)) != CUDA_SUCCESS ||
      (r = drv.cuDeviceGetAttribute(&dev->smem_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, d)) !=
          CUDA_SUCCESS)
    return drv_fail("cuDeviceGetAttribute", r);
  dev->ctx = ctx;
  /* cubins run on their own major version only: sm_80 code on 8.x, sm_90(a) code on 9.0 */
  if (major == 8)
    dev->cc = 80;
  else if (major == 9 && minor == 0)
    dev->cc = 90;
  else
    return fail(FC_ERR_UNSUPPORTED_ARCH, "compute capability %d.%d: kernels exist for 8.x (sm_80) and 9.0 (sm_90)",
                major, minor);
  const char *built = FC_ARCHS_BUILT;
  char want[8];
  snprintf(want, sizeof want, "%d", dev->cc);
  if (!strstr(built, want))
    return fail(FC_ERR_UNSUPPORTED_ARCH, "compute capability %d.%d needs sm_%d kernels; this library has archs %s",
                major, minor, dev->cc, built);
  return FC_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* modules: one per (context, cubin), loaded on first use                                           */
/* ------------------------------------------------------------------------------------------------ */

#define FC_MAX_LOADED 4096
static struct {
  CUcontext ctx;
  const unsigned char *cubin;
  CUfunction fn;
} loaded[FC_MAX_LOADED];
static int n_loaded;
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;

static fc_status get_function(const fc_device *dev, const fc_variant *v, CUfunction *out) {
  fc_status st = FC_OK;
  pthread_mutex_lock(&load_mu);
  for (int i = 0; i < n_loaded; ++i)
    if (loaded[i].ctx == dev->ctx && loaded[i].cubin == v->cubin) {
      *out = loaded[i].fn;
      goto done;
    }
  if (v->shared > dev->smem_optin) {
    st = fail(FC_ERR_UNSUPPORTED_ARCH, "%s needs %d bytes of shared memory; the device allows %d", v->variant,
              v->shared, dev->smem_optin);
    goto done;
  }
  if (n_loaded == FC_MAX_LOADED) {
    st = fail(FC_ERR_DRIVER, "more than %d loaded modules", FC_MAX_LOADED);
    goto done;
  }
  CUmodule mod;
  CUfunction fn;
  CUresult r = drv.cuModuleLoadData(&mod, v->cubin);
  if (r != CUDA_SUCCESS) {
    st = drv_fail("cuModuleLoadData", r);
    goto done;
  }
  if ((r = drv.cuModuleGetFunction(&fn, mod, v->symbol)) != CUDA_SUCCESS) {
    st = drv_fail("cuModuleGetFunction", r);
    goto done;
  }
  if (v->shared > 49152 &&
      (r = drv.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, v->shared)) != CUDA_SUCCESS) {
    st = drv_fail("cuFuncSetAttribute", r);
    goto done;
  }
  loaded[n_loaded].ctx = dev->ctx;
  loaded[n_loaded].cubin = v->cubin;
  loaded[n_loaded].fn = fn;
  ++n_loaded;
  *out = fn;
done:
  pthread_mutex_unlock(&load_mu);
  return st;
}

/* ------------------------------------------------------------------------------------------------ */
/* argument values by name, packed by the generated layouts                                         */
/* ------------------------------------------------------------------------------------------------ */

typedef struct {
  int set;
  int is_ptr;
  uint64_t p;
  int64_t i;
  double f;
} fc_val;

typedef struct {
  fc_val v[FC_ARG_COUNT];
} fc_args;

static void set_p(fc_args *a, fc_argname n, const void *p) {
  a->v[n] = (fc_val){1, 1, (uint64_t)(uintptr_t)p, 0, 0.0};
}
static void set_i(fc_args *a, fc_argname n, int64_t i) { a->v[n] = (fc_val){1, 0, 0, i, 0.0}; }
static void set_f(fc_args *a, fc_argname n, double f) { a->v[n] = (fc_val){1, 0, 0, 0, f}; }

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t d_pad(int64_t d) { /* triton_shared.configs.d_pad: next power of two, at least 16 */
  int64_t p = 16;
  while (p < d) p <<= 1;
  return p;
}

static int d_bucket(int64_t d) { /* triton_shared.configs.d_bucket: 0 d64, 1 d128, 2 big */
  int64_t p = d_pad(d);
  return p <= 64 ? 0 : (p <= FC_RESIDENT_MAX_D ? 1 : 2);
}

typedef struct {
  const fc_config *cfg;
  int block_d, resident;
} fc_choice;

/* triton_shared.configs.config_for; `wide`: the forward's "fwd_wide" entry (row statistics only) */
static fc_status config_for(fc_kernel k, int cc, fc_dtype dt, int64_t d, int wide, fc_choice *out) {
  for (int i = 0; i < FC_N_CONFIGS; ++i) {
    const fc_config *c = &fc_configs[i];
    if (c->kernel == k && c->cc == cc && c->dtype == (int)dt && c->bucket == d_bucket(d) && c->wide == wide) {
      out->cfg = c;
      out->resident = c->block_d == 0;
      out->block_d = out->resident ? (int)d_pad(d) : c->block_d;
      return FC_OK;
    }
  }
  return fail(FC_ERR_UNSUPPORTED_DTYPE, "no launch config for %s, dtype %d on sm_%d (dtypes built: %s)",
              fc_kernel_names[k], (int)dt, cc, FC_DTYPES_BUILT);
}

static const fc_variant *find_variant(fc_kernel k, int cc, fc_dtype dt, int64_t d, int sym, int want_col,
                                      int exclude_self, int margin, int split) {
  int dpad = d_pad(d) > FC_RESIDENT_MAX_D ? 0 : (int)d_pad(d);
  for (int i = 0; i < FC_N_VARIANTS; ++i) {
    const fc_variant *v = &fc_variants[i];
    if (v->kernel == k && v->cc == cc && v->dtype == (int)dt && v->dpad == dpad && v->sym == sym &&
        v->want_col == want_col && v->exclude_self == exclude_self && v->margin == margin &&
        v->split == split)
      return v;
  }
  return NULL;
}

/* `name` is one of the ';'-separated entries of `list` (not a substring of one: "info_nce" is not in
   "info_nce_margin") */
static int in_list(const char *list, const char *name) {
  size_t k = strlen(name);
  for (const char *s = list; *s;) {
    const char *e = strchr(s, ';');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    if (len == k && !strncmp(s, name, k)) return 1;
    if (!e) break;
    s = e + 1;
  }
  return 0;
}

typedef struct {
  fc_kernel kernel;
  int sym, want_col, exclude_self, margin; /* margin: the HAS_BIAS + BIAS_COS variants (fc_problem.margin) */
  int split;                               /* the SPLIT_T variants (fc_forward_split / fc_backward_split) */
  int64_t grid;
  fc_args args;
} fc_launch;

static fc_status launch_variant(const fc_device *dev, const fc_variant *v, const fc_launch *L, CUstream stream,
                                int check_only);

/* Check every parameter (set, in range, aligned as compiled) and launch; `check_only` validates only. */
static fc_status launch(const fc_device *dev, const fc_problem *p, const fc_launch *L, CUstream stream,
                        int check_only) {
  const fc_variant *v =
      find_variant(L->kernel, dev->cc, p->dtype, p->d, L->sym, L->want_col, L->exclude_self, L->margin, L->split);
  if (!v)
    return fail(FC_ERR_UNSUPPORTED_SHAPE,
                "no %s kernel built for sm_%d, dtype %d, D = %lld (D_PAD %lld) with sym=%d want_col=%d "
                "exclude_self=%d margin=%d split=%d (built: %s)",
                fc_kernel_names[L->kernel], dev->cc, (int)p->dtype, (long long)p->d, (long long)d_pad(p->d), L->sym,
                L->want_col, L->exclude_self, L->margin, L->split, fc_build_info());
  return launch_variant(dev, v, L, stream, check_only);
}

static fc_status launch_variant(const fc_device *dev, const fc_variant *v, const fc_launch *L, CUstream stream,
                                int check_only) {
  const fc_layout *lay = &fc_layouts[L->kernel];
  /* storage for every parameter (8 bytes each) + the two scratch pointers */
  uint64_t store[64 + 3];
  void *params[64 + 3];
  memset(params, 0, sizeof params); /* NULL after the last parameter (a driver reading more sees it) */
  if (lay->n > 64) return fail(FC_ERR_INVALID_ARGUMENT, "kernel %s has too many parameters", fc_kernel_names[L->kernel]);
  for (int i = 0; i < lay->n; ++i) {
    const fc_param *q = &lay->params[i];
    const fc_val *x = &L->args.v[q->name];
    const char *nm = fc_arg_names[q->name];
    if (!x->set)
      return fail(FC_ERR_INVALID_ARGUMENT, "parameter %s of %s not set", nm, fc_kernel_names[L->kernel]);
    store[i] = 0;
    switch (q->type) {
      case FC_T_PTR:
        if (!x->is_ptr || !x->p) return fail(FC_ERR_INVALID_ARGUMENT, "%s: NULL pointer for %s", fc_kernel_names[L->kernel], nm);
        if (q->div16 && (x->p % 16)) return fail(FC_ERR_MISALIGNED, "pointer %s is not 16-byte aligned", nm);
        memcpy(&store[i], &x->p, 8);
        break;
      case FC_T_I32: {
        if (x->i < INT32_MIN || x->i > INT32_MAX)
          return fail(FC_ERR_UNSUPPORTED_SHAPE, "%s = %lld does not fit the kernels' int32 parameter", nm,
                      (long long)x->i);
        if (q->div16 && (x->i % 16))
          return fail(FC_ERR_UNSUPPORTED_SHAPE, "%s = %lld: the kernels are compiled for a multiple of 16", nm,
                      (long long)x->i);
        int32_t t = (int32_t)x->i;
        memcpy(&store[i], &t, 4);
        break;
      }
      case FC_T_I64:
        if (q->div16 && (x->i % 16))
          return fail(FC_ERR_UNSUPPORTED_SHAPE, "%s = %lld: the kernels are compiled for a multiple of 16", nm,
                      (long long)x->i);
        memcpy(&store[i], &x->i, 8);
        break;
      case FC_T_F32: {
        float t = (float)x->f;
        memcpy(&store[i], &t, 4);
        break;
      }
      default:
        return fail(FC_ERR_INVALID_ARGUMENT, "parameter %s has an unsupported type", nm);
    }
    params[i] = &store[i];
  }
  store[lay->n] = store[lay->n + 1] = 0; /* triton's global and profile scratch: not used (checked at build) */
  params[lay->n] = &store[lay->n];
  params[lay->n + 1] = &store[lay->n + 1];
  if (L->grid > 0x7fffffff) return fail(FC_ERR_UNSUPPORTED_SHAPE, "grid of %lld programs", (long long)L->grid);
  if (check_only || L->grid == 0) return FC_OK;
  CUfunction fn;
  fc_status st = get_function(dev, v, &fn);
  if (st != FC_OK) return st;
  CUresult r = drv.cuLaunchKernel(fn, (unsigned)L->grid, 1, 1, 32u * (unsigned)v->num_warps, 1, 1,
                                  (unsigned)v->shared, stream, params, NULL);
  if (r != CUDA_SUCCESS) return drv_fail("cuLaunchKernel", r);
  return FC_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* problem, workspace                                                                               */
/* ------------------------------------------------------------------------------------------------ */

typedef struct {
  int64_t n, m, d, elsize;
  int same, want_col, excl, margin, split;
  int64_t col_progs, fwd_rb;
  fc_choice fwd, rows, cols;
  /* workspace offsets (bytes) */
  size_t o_dummy, o_sa, o_na, o_ra, o_rsa, o_sb, o_nb, o_rb, o_rsb, o_col, o_acc_rows, o_acc_cols, total;
} fc_plan;

static size_t take(size_t *cur, size_t bytes) {
  size_t at = *cur;
  *cur += (bytes + 255) & ~(size_t)255;
  return at;
}

static fc_status make_plan(const fc_problem *p, const fc_device *dev, fc_plan *P, int split) {
  if (!p) return fail(FC_ERR_INVALID_ARGUMENT, "problem is NULL");
  memset(P, 0, sizeof *P);
  if ((unsigned)p->mode > FC_MODE_SELF) return fail(FC_ERR_UNSUPPORTED_MODE, "mode %d is not a fc_mode", (int)p->mode);
  if ((unsigned)p->dtype > FC_BFLOAT16) return fail(FC_ERR_UNSUPPORTED_DTYPE, "dtype %d is not a fc_dtype", (int)p->dtype);
  static const char *mode_names[] = {"info_nce", "clip", "self"};
  if (split) { /* the target split: its own kernel variants (SPLIT_T), feature set "<mode>_split" (with a target
                 margin "<mode>_margin_split": HAS_BIAS, BIAS_COS and SPLIT_T; the margin's target is the split's) */
    if (!isfinite(p->margin))
      return fail(FC_ERR_INVALID_ARGUMENT, "margin = %g: must be finite", (double)p->margin);
    if (p->margin != 0.0f && p->mode == FC_MODE_SELF)
      return fail(FC_ERR_UNSUPPORTED_MODE, "margin: not supported in FC_MODE_SELF (FC_MODE_INFO_NCE and "
                  "FC_MODE_CLIP take a target margin)");
    char want[40];
    snprintf(want, sizeof want, "%s%s_split", mode_names[p->mode], p->margin != 0.0f ? "_margin" : "");
    if (!in_list(FC_MODES_BUILT, want))
      return fail(FC_ERR_UNSUPPORTED_MODE, "the target split: mode %s not built (modes: %s)", want, FC_MODES_BUILT);
    if (p->margin != 0.0f && !p->target)
      return fail(FC_ERR_INVALID_ARGUMENT, "target is NULL (required when margin != 0: the margin's columns)");
    if (p->margin != 0.0f && (uintptr_t)p->target % 16) return fail(FC_ERR_MISALIGNED, "target is not 16-byte aligned");
  } else if (p->margin == 0.0f) {
    if (!in_list(FC_MODES_BUILT, mode_names[p->mode]))
      return fail(FC_ERR_UNSUPPORTED_MODE, "mode %s not built (modes: %s)", mode_names[p->mode], FC_MODES_BUILT);
  } else { /* the target margin: its own kernel variants (HAS_BIAS, BIAS_COS), feature set "<mode>_margin" */
    if (!isfinite(p->margin))
      return fail(FC_ERR_INVALID_ARGUMENT, "margin = %g: must be finite", (double)p->margin);
    if (p->mode == FC_MODE_SELF)
      return fail(FC_ERR_UNSUPPORTED_MODE, "margin: not supported in FC_MODE_SELF (FC_MODE_INFO_NCE and "
                  "FC_MODE_CLIP take a target margin)");
    char want[32];
    snprintf(want, sizeof want, "%s_margin", mode_names[p->mode]);
    if (!in_list(FC_MODES_BUILT, want))
      return fail(FC_ERR_UNSUPPORTED_MODE, "margin: mode %s not built (modes: %s)", want, FC_MODES_BUILT);
    if (!p->target) return fail(FC_ERR_INVALID_ARGUMENT, "target is NULL (required when margin != 0)");
    if ((uintptr_t)p->target % 16) return fail(FC_ERR_MISALIGNED, "target is not 16-byte aligned");
  }
  static const char *dt_names[] = {"fp32", "fp16", "bf16"};
  if (!strstr(FC_DTYPES_BUILT, dt_names[p->dtype]))
    return fail(FC_ERR_UNSUPPORTED_DTYPE, "dtype %s not built (dtypes: %s)", dt_names[p->dtype], FC_DTYPES_BUILT);
  P->same = p->mode == FC_MODE_SELF;
  P->want_col = p->mode == FC_MODE_CLIP;
  P->excl = p->mode == FC_MODE_SELF;
  P->margin = p->margin != 0.0f;
  P->split = split;
  P->n = p->n;
  P->m = P->same ? p->n : p->m;
  P->d = p->d;
  P->elsize = p->dtype == FC_FLOAT32 ? 4 : 2;
  if (p->n < 1 || P->m < 1 || p->d < 1)
    return fail(FC_ERR_INVALID_ARGUMENT, "n, m, d must be >= 1 (got %lld, %lld, %lld)", (long long)p->n,
                (long long)P->m, (long long)p->d);
  if (P->same && p->b) return fail(FC_ERR_INVALID_ARGUMENT, "b must be NULL in FC_MODE_SELF (B is A)");
  if (!P->same && !p->b) return fail(FC_ERR_INVALID_ARGUMENT, "b is NULL (FC_MODE_SELF is B is A)");
  if (!p->a || !p->scale) return fail(FC_ERR_INVALID_ARGUMENT, "a and scale are required");
  if (p->stride_a < p->d || (!P->same && p->stride_b < p->d))
    return fail(FC_ERR_INVALID_ARGUMENT, "row strides must be >= d");
  if (P->same && p->offset != 0) return fail(FC_ERR_INVALID_ARGUMENT, "offset must be 0 when B is A");
  fc_status st;
  /* triton_shared.configs.fwd_kernel: no mode has positives, so row statistics alone ("fwd_wide") unless CLIP's
     column LSE is wanted or the margin's bias column is there */
  if ((st = config_for(FC_K_lse_fwd, dev->cc, p->dtype, p->d, !P->want_col && !P->margin, &P->fwd)) != FC_OK)
    return st;
  if ((st = config_for(FC_K_lse_bwd_rows, dev->cc, p->dtype, p->d, 0, &P->rows)) != FC_OK) return st;
  if ((st = config_for(FC_K_lse_bwd_cols, dev->cc, p->dtype, p->d, 0, &P->cols)) != FC_OK) return st;
  /* _lse_fwd / _col_programs: with a column LSE at most 2 x SMs programs, balanced */
  P->fwd_rb = cdiv(P->n, P->fwd.cfg->block_m);
  P->col_progs = P->fwd_rb;
  if (P->want_col) {
    int64_t cap = 2 * (int64_t)dev->sms;
    int64_t per = cdiv(P->fwd_rb, cap > 1 ? cap : 1);
    P->col_progs = cdiv(P->fwd_rb, per);
  }
  size_t cur = 0, n = (size_t)P->n, m = (size_t)P->m, d = (size_t)P->d, el = (size_t)P->elsize;
  P->o_dummy = take(&cur, 4);
  P->o_sa = take(&cur, n * d * el);
  P->o_na = take(&cur, 4 * n);
  P->o_ra = take(&cur, 4 * n);
  P->o_rsa = take(&cur, 4 * n);
  if (!P->same) {
    P->o_sb = take(&cur, m * d * el);
    P->o_nb = take(&cur, 4 * m);
    P->o_rb = take(&cur, 4 * m);
    P->o_rsb = take(&cur, 4 * m);
  }
  if (P->want_col) P->o_col = take(&cur, 4 * (size_t)P->col_progs * m);
  if (!P->rows.resident) P->o_acc_rows = take(&cur, 4 * n * d);
  if (!P->same && !P->cols.resident) P->o_acc_cols = take(&cur, 4 * m * d);
  P->total = cur;
  return FC_OK;
}

static fc_status begin_as(const fc_problem *p, fc_device *dev, fc_plan *P, int split) {
  fc_status st = current_device(dev);
  if (st != FC_OK) return st;
  return make_plan(p, dev, P, split);
}

static fc_status begin(const fc_problem *p, fc_device *dev, fc_plan *P) { return begin_as(p, dev, P, 0); }

static void *at(void *ws, size_t off) { return (char *)ws + off; }

fc_status fc_workspace_size(const fc_problem *p, size_t *bytes) {
  fc_device dev;
  fc_plan P;
  fc_status st = begin(p, &dev, &P);
  if (st != FC_OK) return st;
  if (!bytes) return fail(FC_ERR_INVALID_ARGUMENT, "bytes is NULL");
  *bytes = P.total;
  g_err[0] = 0;
  return FC_OK;
}

static fc_status check_ws(const fc_plan *P, void *ws, size_t bytes) {
  if (!ws) return fail(FC_ERR_WORKSPACE, "workspace is NULL");
  if (bytes < P->total) return fail(FC_ERR_WORKSPACE, "workspace of %zu bytes < the %zu needed", bytes, P->total);
  if ((uintptr_t)ws % 256) return fail(FC_ERR_MISALIGNED, "workspace is not 256-byte aligned");
  return FC_OK;
}

/* _row_norms: the scaled copy, norms, inverse norms and inverse norms of the copy */
static void row_norm_launch(const fc_plan *P, const fc_problem *p, fc_launch *L, const void *x, int64_t stride,
                            int64_t rows, void *xs, void *nrm, void *rn, void *rs) {
  memset(L, 0, sizeof *L);
  L->kernel = FC_K_row_norm;
  L->grid = cdiv(rows, FC_ROW_NORM_BLOCK_R);
  set_p(&L->args, FC_ARG_X, x);
  set_p(&L->args, FC_ARG_XS, xs);
  set_p(&L->args, FC_ARG_NORM, nrm);
  set_p(&L->args, FC_ARG_RNORM, rn);
  set_p(&L->args, FC_ARG_RS, rs);
  set_i(&L->args, FC_ARG_N, rows);
  set_i(&L->args, FC_ARG_D, P->d);
  set_i(&L->args, FC_ARG_stride_x, stride);
  set_i(&L->args, FC_ARG_stride_xs, P->d);
  set_f(&L->args, FC_ARG_eps, p->eps);
}

/* Arguments common to the three main kernels (_problem_args, _sizes, _mask_args of the launcher). */
static void common_args(const fc_plan *P, const fc_problem *p, void *ws, fc_args *a) {
  void *dummy = at(ws, P->o_dummy);
  set_p(a, FC_ARG_SA, at(ws, P->o_sa));
  set_p(a, FC_ARG_SB, at(ws, P->same ? P->o_sa : P->o_sb));
  set_p(a, FC_ARG_RSA, at(ws, P->o_rsa));
  set_p(a, FC_ARG_RSB, at(ws, P->same ? P->o_rsa : P->o_rsb));
  set_p(a, FC_ARG_SCALE, p->scale);
  set_p(a, FC_ARG_BIAS_COL, P->margin ? (const void *)p->target : dummy); /* the margin's column: target_i */
  set_p(a, FC_ARG_ROW_LAB, dummy);
  set_p(a, FC_ARG_COL_LAB, dummy);
  set_p(a, FC_ARG_POS_MASK, dummy);
  set_i(a, FC_ARG_N, P->n);
  set_i(a, FC_ARG_M, P->m);
  set_i(a, FC_ARG_D, P->d);
  set_i(a, FC_ARG_stride_sa, P->d);
  set_i(a, FC_ARG_stride_sb, P->d);
  set_i(a, FC_ARG_offset, p->offset);
  set_f(a, FC_ARG_bias, P->margin ? -(double)p->margin : 0.0); /* in cosine units (BIAS_COS): -margin */
  set_i(a, FC_ARG_n0, 1);
  set_i(a, FC_ARG_m0, 1);
  set_i(a, FC_ARG_stride_pm, 1);
}

static fc_status run_all(const fc_device *dev, const fc_problem *p, fc_launch *Ls, int n, void *stream) {
  /* validate every launch before the first one runs: an error launches nothing */
  for (int i = 0; i < n; ++i) {
    fc_status st = launch(dev, p, &Ls[i], (CUstream)stream, 1);
    if (st != FC_OK) return st;
  }
  for (int i = 0; i < n; ++i) {
    fc_status st = launch(dev, p, &Ls[i], (CUstream)stream, 0);
    if (st != FC_OK) return st;
  }
  g_err[0] = 0;
  return FC_OK;
}

/* fc_forward, and with `split` fc_forward_split (_lse_fwd with target and minus_target: SPLIT_T, TGT, LT) */
static fc_status forward_impl(const fc_problem *p, const int64_t *target, void *ws, size_t ws_bytes, float *lse,
                              float *lt, void *stream, int split) {
  fc_device dev;
  fc_plan P;
  fc_status st = begin_as(p, &dev, &P, split);
  if (st != FC_OK) return st;
  if ((st = check_ws(&P, ws, ws_bytes)) != FC_OK) return st;
  if (!lse) return fail(FC_ERR_INVALID_ARGUMENT, split ? "lse_x is NULL" : "lse is NULL");
  if (split && !target) return fail(FC_ERR_INVALID_ARGUMENT, "target is NULL (the split needs each row's target)");
  if (split && (uintptr_t)target % 16) return fail(FC_ERR_MISALIGNED, "target is not 16-byte aligned");
  if (split && !lt) return fail(FC_ERR_INVALID_ARGUMENT, "lt is NULL (the split writes [2n] floats there)");
  fc_launch L[3];
  int k = 0;
  row_norm_launch(&P, p, &L[k++], p->a, p->stride_a, P.n, at(ws, P.o_sa), at(ws, P.o_na), at(ws, P.o_ra),
                  at(ws, P.o_rsa));
  if (!P.same)
    row_norm_launch(&P, p, &L[k++], p->b, p->stride_b, P.m, at(ws, P.o_sb), at(ws, P.o_nb), at(ws, P.o_rb),
                    at(ws, P.o_rsb));
  fc_launch *F = &L[k++];
  memset(F, 0, sizeof *F);
  F->kernel = FC_K_lse_fwd;
  F->sym = P.same;
  F->want_col = P.want_col;
  F->exclude_self = P.excl;
  F->margin = P.margin;
  F->split = split;
  F->grid = P.col_progs;
  common_args(&P, p, ws, &F->args);
  set_p(&F->args, FC_ARG_LSE, lse);
  set_p(&F->args, FC_ARG_LSE_POS, at(ws, P.o_dummy));
  set_p(&F->args, FC_ARG_COL_PART, at(ws, P.want_col ? P.o_col : P.o_dummy));
  set_i(&F->args, FC_ARG_n_row_blocks, P.fwd_rb);
  set_p(&F->args, FC_ARG_TGT, split ? (const void *)target : at(ws, P.o_dummy));
  set_p(&F->args, FC_ARG_LT, split ? (void *)lt : at(ws, P.o_dummy));
  return run_all(&dev, p, L, k, stream);
}

fc_status fc_forward(const fc_problem *p, void *ws, size_t ws_bytes, float *lse, void *stream) {
  return forward_impl(p, NULL, ws, ws_bytes, lse, NULL, stream, 0);
}

fc_status fc_forward_split(const fc_problem *p, const int64_t *target, void *ws, size_t ws_bytes, float *lse_x,
                           float *lt, void *stream) {
  return forward_impl(p, target, ws, ws_bytes, lse_x, lt, stream, 1);
}

fc_status fc_col_partials(const fc_problem *p, void *ws, float **part, int64_t *rows) {
  fc_device dev;
  fc_plan P;
  fc_status st = begin(p, &dev, &P);
  if (st != FC_OK) return st;
  if (!P.want_col) return fail(FC_ERR_UNSUPPORTED_MODE, "column partials exist in FC_MODE_CLIP only");
  if (!ws || !part || !rows) return fail(FC_ERR_INVALID_ARGUMENT, "workspace, part and rows are required");
  *part = (float *)at(ws, P.o_col);
  *rows = P.col_progs;
  g_err[0] = 0;
  return FC_OK;
}

fc_status fc_ds_rows(const fc_problem *p, int64_t *rows) {
  fc_device dev;
  fc_plan P;
  fc_status st = begin(p, &dev, &P);
  if (st != FC_OK) return st;
  if (!rows) return fail(FC_ERR_INVALID_ARGUMENT, "rows is NULL");
  *rows = cdiv(P.n, P.rows.cfg->block_m);
  g_err[0] = 0;
  return FC_OK;
}

/* The flags of the backward kernels (_flags + HAS_G / HAS_GCOL / HAS_GPOS of _lse_bwd) select the variant;
   every compiled backward has HAS_G, NEED_DX and NEED_DS on, HAS_GCOL exactly in FC_MODE_CLIP. */
static void bwd_common(const fc_plan *P, const fc_problem *p, const fc_backward_args *g, void *ws, fc_args *a) {
  void *dummy = at(ws, P->o_dummy);
  common_args(P, p, ws, a);
  set_p(a, FC_ARG_GSCALE, g->gscale);
  set_p(a, FC_ARG_LSE, g->lse);
  set_p(a, FC_ARG_G, g->g);
  set_p(a, FC_ARG_LSE_COL, P->want_col ? (const void *)g->lse_col : dummy);
  set_p(a, FC_ARG_G_COL, P->want_col ? (const void *)g->g_col : dummy);
  set_p(a, FC_ARG_LSE_POS, dummy);
  set_p(a, FC_ARG_G_POS, dummy);
  set_f(a, FC_ARG_eps, p->eps);
}

/* fc_backward, and with `split` fc_backward_split (_lse_bwd with target: SPLIT_T, TGT, TV) */
static fc_status backward_impl(const fc_problem *p, const fc_backward_args *g, const int64_t *target, float *tv,
                               void *ws, size_t ws_bytes, void *stream, int split) {
  fc_device dev;
  fc_plan P;
  fc_status st = begin_as(p, &dev, &P, split);
  if (st != FC_OK) return st;
  if ((st = check_ws(&P, ws, ws_bytes)) != FC_OK) return st;
  if (!g) return fail(FC_ERR_INVALID_ARGUMENT, "args is NULL");
  if (split && !target) return fail(FC_ERR_INVALID_ARGUMENT, "target is NULL (the split needs each row's target)");
  if (split && (uintptr_t)target % 16) return fail(FC_ERR_MISALIGNED, "target is not 16-byte aligned");
  if (split && !tv) return fail(FC_ERR_INVALID_ARGUMENT, "tv is NULL (the split writes [n] floats there)");
  if (!g->lse || !g->g || !g->gscale || !g->da || !g->ds_part)
    return fail(FC_ERR_INVALID_ARGUMENT, "args: lse, g, gscale, da and ds_part are required");
  if (P.want_col && (!g->lse_col || !g->g_col))
    return fail(FC_ERR_INVALID_ARGUMENT, "args: lse_col and g_col are required in FC_MODE_CLIP");
  if (!P.want_col && (g->lse_col || g->g_col))
    return fail(FC_ERR_UNSUPPORTED_MODE, "args: lse_col / g_col given outside FC_MODE_CLIP");
  if (P.same && g->db) return fail(FC_ERR_UNSUPPORTED_MODE, "args: db must be NULL in FC_MODE_SELF (dA has both roles)");
  if (g->stride_da < P.d || (g->db && g->stride_db < P.d)) return fail(FC_ERR_INVALID_ARGUMENT, "args: row strides must be >= d");
  fc_launch L[2];
  int k = 0;
  fc_launch *R = &L[k++];
  memset(R, 0, sizeof *R);
  R->kernel = FC_K_lse_bwd_rows;
  R->sym = P.same;
  R->want_col = P.want_col;
  R->exclude_self = P.excl;
  R->margin = P.margin;
  R->split = split;
  R->grid = cdiv(P.n, P.rows.cfg->block_m);
  bwd_common(&P, p, g, ws, &R->args);
  set_p(&R->args, FC_ARG_A, p->a);
  set_p(&R->args, FC_ARG_RA, at(ws, P.o_ra));
  set_p(&R->args, FC_ARG_NA, at(ws, P.o_na));
  set_p(&R->args, FC_ARG_DA, g->da);
  set_p(&R->args, FC_ARG_ACC, at(ws, P.rows.resident ? P.o_dummy : P.o_acc_rows));
  set_p(&R->args, FC_ARG_DS_PART, g->ds_part);
  set_p(&R->args, FC_ARG_TGT, split ? (const void *)target : at(ws, P.o_dummy));
  set_p(&R->args, FC_ARG_TV, split ? (void *)tv : at(ws, P.o_dummy));
  set_i(&R->args, FC_ARG_stride_a, p->stride_a);
  set_i(&R->args, FC_ARG_stride_da, g->stride_da);
  if (g->db) {
    int64_t gcols = g->grad_cols < 0 || g->grad_cols > P.m ? P.m : g->grad_cols;
    fc_launch *C = &L[k++];
    memset(C, 0, sizeof *C);
    C->kernel = FC_K_lse_bwd_cols;
    C->sym = 0;
    C->want_col = P.want_col;
    C->exclude_self = P.excl;
    C->margin = P.margin;
    C->split = split;
    C->grid = cdiv(gcols, P.cols.cfg->block_n);
    bwd_common(&P, p, g, ws, &C->args);
    set_p(&C->args, FC_ARG_B, p->b);
    set_p(&C->args, FC_ARG_RB, at(ws, P.o_rb));
    set_p(&C->args, FC_ARG_NB, at(ws, P.o_nb));
    set_p(&C->args, FC_ARG_DB, g->db);
    set_p(&C->args, FC_ARG_ACC, at(ws, P.cols.resident ? P.o_dummy : P.o_acc_cols));
    set_p(&C->args, FC_ARG_TGT, split ? (const void *)target : at(ws, P.o_dummy));
    set_i(&C->args, FC_ARG_stride_b, p->stride_b);
    set_i(&C->args, FC_ARG_stride_db, g->stride_db);
    set_i(&C->args, FC_ARG_grad_cols, gcols);
  }
  return run_all(&dev, p, L, k, stream);
}

fc_status fc_backward(const fc_problem *p, const fc_backward_args *g, void *ws, size_t ws_bytes, void *stream) {
  return backward_impl(p, g, NULL, NULL, ws, ws_bytes, stream, 0);
}

fc_status fc_backward_split(const fc_problem *p, const fc_backward_args *args, const int64_t *target, float *tv,
                            void *ws, size_t ws_bytes, void *stream) {
  return backward_impl(p, args, target, tv, ws, ws_bytes, stream, 1);
}

/* ------------------------------------------------------------------------------------------------ */
/* kernel-level entry points (the panel path of libfused_contrastive_torch)                          */
/* ------------------------------------------------------------------------------------------------ */

fc_status fc_device_props(int *cc, int *sms) {
  fc_device dev;
  fc_status st = current_device(&dev);
  if (st != FC_OK) return st;
  if (!cc || !sms) return fail(FC_ERR_INVALID_ARGUMENT, "cc and sms are required");
  *cc = dev.cc;
  *sms = dev.sms;
  g_err[0] = 0;
  return FC_OK;
}

fc_status fc_kernel_config(const char *kernel, fc_dtype dtype, int64_t d, int *block_m, int *block_n, int *block_d) {
  fc_device dev;
  fc_status st = current_device(&dev);
  if (st != FC_OK) return st;
  if (!kernel || !block_m || !block_n || !block_d)
    return fail(FC_ERR_INVALID_ARGUMENT, "kernel, block_m, block_n and block_d are required");
  if ((unsigned)dtype > FC_BFLOAT16) return fail(FC_ERR_UNSUPPORTED_DTYPE, "dtype %d is not a fc_dtype", (int)dtype);
  if (d < 1) return fail(FC_ERR_INVALID_ARGUMENT, "d must be >= 1 (got %lld)", (long long)d);
  int k = -1;
  for (int i = 0; i < FC_K_COUNT; ++i)
    if (!strcmp(fc_kernel_names[i], kernel)) k = i;
  if (k < 0) return fail(FC_ERR_INVALID_ARGUMENT, "no kernel named %s in this library", kernel);
  fc_choice c;
  if ((st = config_for((fc_kernel)k, dev.cc, dtype, d, 0, &c)) != FC_OK) return st;  /* not "fwd_wide" */
  *block_m = c.cfg->block_m;
  *block_n = c.cfg->block_n;
  *block_d = c.block_d;
  g_err[0] = 0;
  return FC_OK;
}

fc_status fc_launch_kernel(const char *kernel, fc_dtype dtype, const char *constexprs, int64_t grid,
                           const fc_karg *args, int nargs, void *stream) {
  fc_device dev;
  fc_status st = current_device(&dev);
  if (st != FC_OK) return st;
  if (!kernel || !constexprs || nargs < 0 || (nargs > 0 && !args))
    return fail(FC_ERR_INVALID_ARGUMENT, "kernel, constexprs and args are required");
  if ((unsigned)dtype > FC_BFLOAT16) return fail(FC_ERR_UNSUPPORTED_DTYPE, "dtype %d is not a fc_dtype", (int)dtype);
  int k = -1;
  for (int i = 0; i < FC_K_COUNT; ++i)
    if (!strcmp(fc_kernel_names[i], kernel)) k = i;
  if (k < 0) return fail(FC_ERR_INVALID_ARGUMENT, "no kernel named %s in this library", kernel);
  const fc_variant *v = NULL;
  for (int i = 0; i < FC_N_VARIANTS && !v; ++i)
    if (fc_variants[i].kernel == (fc_kernel)k && fc_variants[i].cc == dev.cc && fc_variants[i].dtype == (int)dtype &&
        !strcmp(fc_variants[i].ckey, constexprs))
      v = &fc_variants[i];
  if (!v)
    return fail(FC_ERR_UNSUPPORTED_SHAPE, "no %s kernel built for sm_%d, dtype %d with constexprs %s (built: %s)",
                kernel, dev.cc, (int)dtype, constexprs, fc_build_info());
  fc_launch L;
  memset(&L, 0, sizeof L);
  L.kernel = (fc_kernel)k;
  L.grid = grid;
  const fc_layout *lay = &fc_layouts[k];
  for (int j = 0; j < nargs; ++j) {
    const fc_karg *x = &args[j];
    const fc_param *q = NULL;
    for (int i = 0; i < lay->n && x->name; ++i)
      if (!strcmp(fc_arg_names[lay->params[i].name], x->name)) q = &lay->params[i];
    if (!q) return fail(FC_ERR_INVALID_ARGUMENT, "%s has no parameter %s", kernel, x->name ? x->name : "(NULL)");
    if (L.args.v[q->name].set) return fail(FC_ERR_INVALID_ARGUMENT, "%s: parameter %s given twice", kernel, x->name);
    int want = q->type == FC_T_PTR ? FC_KARG_PTR : q->type == FC_T_F32 ? FC_KARG_FLOAT : FC_KARG_INT;
    if ((int)x->kind != want)
      return fail(FC_ERR_INVALID_ARGUMENT, "%s: parameter %s given as kind %d, the kernel takes kind %d", kernel,
                  x->name, (int)x->kind, want);
    if (want == FC_KARG_PTR)
      set_p(&L.args, q->name, x->ptr);
    else if (want == FC_KARG_INT)
      set_i(&L.args, q->name, x->i);
    else
      set_f(&L.args, q->name, x->f);
  }
  if (grid < 0) return fail(FC_ERR_INVALID_ARGUMENT, "grid %lld < 0", (long long)grid);
  if ((st = launch_variant(&dev, v, &L, (CUstream)stream, 1)) != FC_OK) return st;
  if ((st = launch_variant(&dev, v, &L, (CUstream)stream, 0)) != FC_OK) return st;
  g_err[0] = 0;
  return FC_OK;
}
