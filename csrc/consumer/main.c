/* Consumer of the installed fused_contrastive package: links, reports the build, and without a driver
 * (FUSED_CONTRASTIVE_LIBCUDA pointing nowhere) gets FC_ERR_NO_DRIVER with a message, no crash. */
#include <fused_contrastive.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  const char *info = fc_build_info();
  printf("%s\n", info);
  if (argc > 1 && !strstr(info, argv[1])) {
    fprintf(stderr, "build info does not list archs %s\n", argv[1]);
    return 1;
  }
  fc_problem p;
  memset(&p, 0, sizeof p);
  p.mode = FC_MODE_INFO_NCE;
  p.dtype = FC_BFLOAT16;
  p.n = p.m = 64;
  p.d = 768;
  size_t bytes = 0;
  fc_status st = fc_workspace_size(&p, &bytes);
  printf("%s: %s\n", fc_status_name(st), fc_last_error());
  return st == FC_ERR_NO_DRIVER && strstr(fc_last_error(), "cannot load the CUDA driver") ? 0 : 1;
}
