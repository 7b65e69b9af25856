/* mock_cuda.c - a stand-in for libcuda.so.1 in the tests (FUSED_CONTRASTIVE_LIBCUDA=<this library>).
 *
 * Exports the driver calls libfused_contrastive_kernels uses and records each one as a JSON line in
 * $FC_MOCK_LOG; the module images go to $FC_MOCK_DIR/module_<k>.cubin. Like the real driver, a launch
 * reads its parameters by the layout the cubin itself declares (the EIATTR_KPARAM_INFO entries of the
 * function's .nv.info section: ordinal, offset, size), so a wrong parameter count shows up as a NULL or
 * missing entry and a wrong order as wrong values in the log, which the tests decode and compare with the
 * Python launcher's launches.
 *
 * The device is described by FC_MOCK_CC (e.g. 90, 80, 86, 75; default 90), FC_MOCK_SMS (default 132),
 * FC_MOCK_SMEM_OPTIN (default 232448); FC_MOCK_NO_DEVICE=1 makes cuInit fail as without a GPU,
 * FC_MOCK_NO_CONTEXT=1 reports no current context. Nothing is ever executed or dereferenced on the
 * "device", unless a test installs a launch hook (fc_mock_set_exec): it receives every launch after it
 * is logged (the module image, the kernel's name, grid and the parameter bytes by the cubin's layout)
 * and may run it itself, e.g. the same kernel under the Triton interpreter on host memory that stands
 * in for device memory (tests/_aot_exec.py); a non-zero return fails the launch
 * (CUDA_ERROR_LAUNCH_FAILED).
 */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return (v && *v) ? atoi(v) : dflt;
}

static void log_line(const char *line) {
  const char *path = getenv("FC_MOCK_LOG");
  if (!path || !*path) return;
  FILE *f = fopen(path, "a");
  if (!f) return;
  fputs(line, f);
  fputc('\n', f);
  fclose(f);
}

#define MAX_MODULES 1024
#define MAX_FUNCS 1024
#define MAX_PARAMS 128

typedef struct {
  const unsigned char *image;
  size_t size;
} mock_module;

typedef struct {
  int module;
  char name[256];
  int nparams;
  int offset[MAX_PARAMS], size[MAX_PARAMS];
} mock_func;

static mock_module modules[MAX_MODULES];
static int n_modules;
static mock_func funcs[MAX_FUNCS];
static int n_funcs;

/* The launch hook (NULL: launches are only logged). */
typedef int (*fc_mock_exec_fn)(const void *image, size_t image_size, const char *name, unsigned grid_x, int nparams,
                               const int *sizes, void **params);
static fc_mock_exec_fn exec_hook;

__attribute__((visibility("default"))) void fc_mock_set_exec(fc_mock_exec_fn fn) { exec_hook = fn; }

static uint64_t rd(const unsigned char *p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/* Size of an ELF64 image: the end of its furthest section or header table. 0 if not ELF64. */
static size_t elf_size(const unsigned char *e) {
  if (memcmp(e, "\x7f" "ELF", 4) || e[4] != 2) return 0;
  uint64_t phoff = rd(e + 0x20, 8), shoff = rd(e + 0x28, 8);
  uint64_t phentsize = rd(e + 0x36, 2), phnum = rd(e + 0x38, 2), shentsize = rd(e + 0x3A, 2), shnum = rd(e + 0x3C, 2);
  uint64_t end = shoff + shentsize * shnum;
  if (phoff + phentsize * phnum > end) end = phoff + phentsize * phnum;
  for (uint64_t i = 0; i < shnum; ++i) {
    const unsigned char *sh = e + shoff + i * shentsize;
    if (rd(sh + 4, 4) == 8) continue; /* SHT_NOBITS */
    uint64_t o = rd(sh + 0x18, 8) + rd(sh + 0x20, 8);
    if (o > end) end = o;
  }
  return (size_t)end;
}

/* The .nv.info.<name> section's kernel parameters (EIATTR_KPARAM_INFO, 0x17): -1 if absent. */
static int param_layout(const unsigned char *e, const char *name, mock_func *f) {
  uint64_t shoff = rd(e + 0x28, 8), shentsize = rd(e + 0x3A, 2), shnum = rd(e + 0x3C, 2), shstrndx = rd(e + 0x3E, 2);
  const unsigned char *strsh = e + shoff + shstrndx * shentsize;
  const char *strtab = (const char *)e + rd(strsh + 0x18, 8);
  char want[300];
  snprintf(want, sizeof want, ".nv.info.%s", name);
  for (uint64_t i = 0; i < shnum; ++i) {
    const unsigned char *sh = e + shoff + i * shentsize;
    if (strcmp(strtab + rd(sh, 4), want)) continue;
    const unsigned char *p = e + rd(sh + 0x18, 8), *end = p + rd(sh + 0x20, 8);
    f->nparams = 0;
    while (p + 4 <= end) {
      int fmt = p[0], attr = p[1];
      if (fmt == 0x04) { /* EIFMT_SVAL: u16 size, payload */
        int sz = (int)rd(p + 2, 2);
        if (attr == 0x17 && sz >= 12) {
          int ordinal = (int)rd(p + 4 + 4, 2), offset = (int)rd(p + 4 + 6, 2);
          int size = (int)((rd(p + 4 + 8, 4) >> 18) & 0x3fff);
          if (ordinal < MAX_PARAMS) {
            f->offset[ordinal] = offset;
            f->size[ordinal] = size;
            if (ordinal + 1 > f->nparams) f->nparams = ordinal + 1;
          }
        }
        p += 4 + sz;
      } else {
        p += 4;
      }
    }
    return f->nparams;
  }
  return -1;
}

CUresult cuInit(unsigned int flags) {
  char b[128];
  snprintf(b, sizeof b, "{\"call\": \"cuInit\", \"flags\": %u}", flags);
  log_line(b);
  return env_int("FC_MOCK_NO_DEVICE", 0) ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
  *s = r == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : (r == CUDA_SUCCESS ? "CUDA_SUCCESS" : "CUDA_ERROR_MOCK");
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
  *ctx = env_int("FC_MOCK_NO_CONTEXT", 0) ? NULL : (CUcontext)(uintptr_t)0xC0C0;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *d) {
  *d = 0;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute attr, CUdevice d) {
  (void)d;
  int cc = env_int("FC_MOCK_CC", 90);
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = cc / 10; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = cc % 10; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = env_int("FC_MOCK_SMS", 132); break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = env_int("FC_MOCK_SMEM_OPTIN", 232448); break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
  size_t size = elf_size((const unsigned char *)image);
  if (!size) return CUDA_ERROR_INVALID_IMAGE;
  pthread_mutex_lock(&mu);
  int k = n_modules < MAX_MODULES ? n_modules++ : -1;
  pthread_mutex_unlock(&mu);
  if (k < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  modules[k].image = image;
  modules[k].size = size;
  const char *dir = getenv("FC_MOCK_DIR");
  char path[1024] = "";
  if (dir && *dir) {
    snprintf(path, sizeof path, "%s/module_%d.cubin", dir, k);
    FILE *f = fopen(path, "wb");
    if (f) {
      fwrite(image, 1, size, f);
      fclose(f);
    }
  }
  char b[1200];
  snprintf(b, sizeof b, "{\"call\": \"cuModuleLoadData\", \"module\": %d, \"size\": %zu, \"file\": \"%s\"}", k, size,
           path);
  log_line(b);
  *mod = (CUmodule)(uintptr_t)(k + 1);
  return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name) {
  int k = (int)(uintptr_t)mod - 1;
  if (k < 0 || k >= n_modules) return CUDA_ERROR_INVALID_HANDLE;
  mock_func f;
  memset(&f, 0, sizeof f);
  f.module = k;
  snprintf(f.name, sizeof f.name, "%s", name);
  if (param_layout(modules[k].image, name, &f) < 0) return CUDA_ERROR_NOT_FOUND;
  pthread_mutex_lock(&mu);
  int i = n_funcs < MAX_FUNCS ? n_funcs++ : -1;
  if (i >= 0) funcs[i] = f;
  pthread_mutex_unlock(&mu);
  if (i < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  char b[600];
  snprintf(b, sizeof b, "{\"call\": \"cuModuleGetFunction\", \"module\": %d, \"func\": %d, \"name\": \"%s\", "
           "\"nparams\": %d}", k, i, name, f.nparams);
  log_line(b);
  *fn = (CUfunction)(uintptr_t)(i + 1);
  return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction fn, CUfunction_attribute attr, int value) {
  char b[200];
  snprintf(b, sizeof b, "{\"call\": \"cuFuncSetAttribute\", \"func\": %d, \"attr\": %d, \"value\": %d}",
           (int)(uintptr_t)fn - 1, (int)attr, value);
  log_line(b);
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream stream, void **params, void **extra) {
  int i = (int)(uintptr_t)fn - 1;
  if (i < 0 || i >= n_funcs) return CUDA_ERROR_INVALID_HANDLE;
  if (!params || extra) return CUDA_ERROR_INVALID_VALUE;
  const mock_func *f = &funcs[i];
  static char b[65536];
  pthread_mutex_lock(&mu);
  int n = snprintf(b, sizeof b, "{\"call\": \"cuLaunchKernel\", \"func\": %d, \"module\": %d, \"name\": \"%s\", "
                   "\"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], \"shared\": %u, \"stream\": %llu, \"params\": [",
                   i, f->module, f->name, gx, gy, gz, bx, by, bz, shared, (unsigned long long)(uintptr_t)stream);
  CUresult r = CUDA_SUCCESS;
  for (int p = 0; p < f->nparams; ++p) {
    if (!params[p]) { /* fewer parameters passed than the kernel declares */
      n += snprintf(b + n, sizeof b - (size_t)n, "%snull", p ? ", " : "");
      r = CUDA_ERROR_INVALID_VALUE;
      continue;
    }
    n += snprintf(b + n, sizeof b - (size_t)n, "%s\"", p ? ", " : "");
    for (int j = 0; j < f->size[p]; ++j)
      n += snprintf(b + n, sizeof b - (size_t)n, "%02x", ((const unsigned char *)params[p])[j]);
    n += snprintf(b + n, sizeof b - (size_t)n, "\"");
  }
  /* one entry past the declared ones: a launcher passing more parameters than the kernel takes */
  n += snprintf(b + n, sizeof b - (size_t)n, "], \"extra_param\": %s}", params[f->nparams] ? "true" : "false");
  log_line(b);
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS && exec_hook &&
      exec_hook(modules[f->module].image, modules[f->module].size, f->name, gx, f->nparams, f->size, params))
    r = CUDA_ERROR_LAUNCH_FAILED;
  return r;
}
