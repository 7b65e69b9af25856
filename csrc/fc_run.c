/* fc_run.c - test driver of the C API (ctest; fused_contrastive.c_library check): one forward + backward on fake
 * device pointers, meant to run against the mock driver (FUSED_CONTRASTIVE_LIBCUDA=libfc_mock_cuda.so).
 *
 *   fc_run MODE DTYPE N M D GRAD_COLS WANT_DB [expect STATUS]
 *
 * MODE info_nce|clip|self, optionally suffixed _margin (the generator's margin feature sets: margin 0.25,
 * fused_contrastive.c_library.REC_MARGIN, with a target vector), _split (the target split: fc_forward_split /
 * fc_backward_split with a target vector, LT and TV buffers, and a backward LSE apart from the forward's LSEx) or
 * _margin_split (both, one target vector), DTYPE fp32|fp16|bf16, GRAD_COLS -1 for all
 * columns, WANT_DB 0|1. FC_RUN_TARGET=null|misaligned (error tests) passes a NULL / misaligned target
 * with the margin or the split. Prints one JSON object: the pointers it passed (so the checker can name every launch
 * argument) and the sizes the API reported. With `expect STATUS` the first failing call must fail with
 * that status (exit 0 if so).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fused_contrastive.h"

#define P(x) ((void *)(uintptr_t)(x))

int main(int argc, char **argv) {
  if (argc != 8 && argc != 10) {
    fprintf(stderr, "usage: fc_run MODE DTYPE N M D GRAD_COLS WANT_DB [expect STATUS]\n");
    return 2;
  }
  const char *modes[] = {"info_nce", "clip", "self"}, *dts[] = {"fp32", "fp16", "bf16"};
  int mode = -1, dt = -1, margin = 0, split = 0;
  for (int i = 0; i < 3; ++i) {
    size_t k = strlen(modes[i]);
    if (!strncmp(argv[1], modes[i], k) &&
        (!argv[1][k] || !strcmp(argv[1] + k, "_margin") || !strcmp(argv[1] + k, "_split") ||
         !strcmp(argv[1] + k, "_margin_split"))) {
      mode = i;
      margin = !strncmp(argv[1] + k, "_margin", 7);
      split = !strcmp(argv[1] + k, "_split") || !strcmp(argv[1] + k, "_margin_split");
    }
    if (!strcmp(argv[2], dts[i])) dt = i;
  }
  if (mode < 0 || dt < 0) {
    fprintf(stderr, "fc_run: bad mode or dtype\n");
    return 2;
  }
  const char *expect = argc == 10 ? argv[9] : NULL;
  fc_problem p;
  memset(&p, 0, sizeof p);
  p.mode = (fc_mode)mode;
  p.dtype = (fc_dtype)dt;
  p.n = atoll(argv[3]);
  p.m = atoll(argv[4]);
  p.d = atoll(argv[5]);
  p.a = P(0x10000000);
  p.stride_a = p.d;
  p.b = mode == FC_MODE_SELF ? NULL : P(0x20000000);
  p.stride_b = p.d;
  p.scale = P(0x30000000);
  p.eps = 1e-12f;
  p.offset = 0;
  const char *t = getenv("FC_RUN_TARGET");
  const int64_t *target = (t && !strcmp(t, "null")) ? NULL : P(0x37000000 + ((t && !strcmp(t, "misaligned")) ? 8 : 0));
  if (margin) {
    p.margin = 0.25f;
    p.target = target;
  }
  float *lse_x = P(0x31000000), *lt = split ? P(0x39000000) : NULL, *tv = split ? P(0x3a000000) : NULL;
  fc_backward_args g;
  memset(&g, 0, sizeof g);
  g.lse = split ? P(0x38000000) : P(0x31000000); /* the split: the backward's LSE is the caller's, from LSEx, LT */
  g.lse_col = mode == FC_MODE_CLIP ? P(0x32000000) : NULL;
  g.g = P(0x33000000);
  g.g_col = mode == FC_MODE_CLIP ? P(0x34000000) : NULL;
  g.gscale = P(0x35000000);
  g.da = P(0x40000000);
  g.stride_da = p.d;
  g.db = atoi(argv[7]) ? P(0x50000000) : NULL;
  g.stride_db = p.d;
  g.grad_cols = atoll(argv[6]);
  g.ds_part = P(0x36000000);
  void *ws = P(0x100000000ull);

  size_t bytes = 0;
  int64_t col_rows = 0, ds_rows = 0;
  float *part = NULL;
  fc_status st = fc_workspace_size(&p, &bytes);
  const char *where = "fc_workspace_size";
  if (st == FC_OK) {
    where = "fc_forward";
    st = split ? fc_forward_split(&p, target, ws, bytes, lse_x, lt, NULL) : fc_forward(&p, ws, bytes, lse_x, NULL);
  }
  if (st == FC_OK && mode == FC_MODE_CLIP) {
    where = "fc_col_partials";
    st = fc_col_partials(&p, ws, &part, &col_rows);
  }
  if (st == FC_OK) {
    where = "fc_ds_rows";
    st = fc_ds_rows(&p, &ds_rows);
  }
  if (st == FC_OK) {
    where = "fc_backward";
    st = split ? fc_backward_split(&p, &g, target, tv, ws, bytes, NULL) : fc_backward(&p, &g, ws, bytes, NULL);
  }
  if (expect) {
    if (st == FC_OK) {
      fprintf(stderr, "fc_run: expected %s, every call succeeded\n", expect);
      return 1;
    }
    if (strcmp(fc_status_name(st), expect)) {
      fprintf(stderr, "fc_run: expected %s, %s returned %s: %s\n", expect, where, fc_status_name(st), fc_last_error());
      return 1;
    }
    if (strncmp(fc_last_error(), expect, strlen(expect))) {
      fprintf(stderr, "fc_run: message does not start with the status: %s\n", fc_last_error());
      return 1;
    }
    printf("%s: %s\n", where, fc_last_error());
    return 0;
  }
  if (st != FC_OK) {
    fprintf(stderr, "fc_run: %s failed: %s\n", where, fc_last_error());
    return 1;
  }
  printf("{\"build\": \"%s\", \"workspace\": %llu, \"workspace_bytes\": %zu, \"col_part\": %llu, \"col_rows\": %lld, "
         "\"ds_rows\": %lld, \"ptrs\": {\"A\": %llu, \"B\": %llu, \"SCALE\": %llu, \"LSE\": %llu, \"LSE_COL\": %llu, "
         "\"G\": %llu, \"G_COL\": %llu, \"GSCALE\": %llu, \"DA\": %llu, \"DB\": %llu, \"DS_PART\": %llu, "
         "\"BIAS_COL\": %llu, \"TGT\": %llu, \"LT\": %llu, \"TV\": %llu}%s}\n",
         fc_build_info(), (unsigned long long)(uintptr_t)ws, bytes, (unsigned long long)(uintptr_t)part,
         (long long)col_rows, (long long)ds_rows, (unsigned long long)(uintptr_t)p.a,
         (unsigned long long)(uintptr_t)p.b, (unsigned long long)(uintptr_t)p.scale,
         /* the split: LSE names two caller buffers (LSEx, the backward's LSE), checked by identity */
         (unsigned long long)(split ? 0 : (uintptr_t)g.lse), (unsigned long long)(uintptr_t)g.lse_col,
         (unsigned long long)(uintptr_t)g.g, (unsigned long long)(uintptr_t)g.g_col,
         (unsigned long long)(uintptr_t)g.gscale, (unsigned long long)(uintptr_t)g.da,
         (unsigned long long)(uintptr_t)g.db, (unsigned long long)(uintptr_t)g.ds_part,
         (unsigned long long)(uintptr_t)p.target, (unsigned long long)(split ? (uintptr_t)target : 0),
         (unsigned long long)(uintptr_t)lt, (unsigned long long)(uintptr_t)tv, split ? ", \"internal\": [\"LSE\"]" : "");
  return 0;
}
