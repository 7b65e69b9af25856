// fc_torch.cpp - libfused_contrastive_torch: the C API as PyTorch operators (namespace fused_contrastive_aot).
//
// The Python package already defines TORCH_LIBRARY(fused_contrastive, ...) (a namespace can be defined
// once), so these live in fused_contrastive_aot. They are the core op's kernel statistics (the level of
// the Python launcher's _lse_fwd / _lse_bwd), not the whole fused_contrastive::triton_core schema: the
// loss coefficients, targets and positive terms stay in the Python package.
//
//   lse(Tensor a, Tensor? b, Tensor scale, str mode, float eps) -> (Tensor lse, Tensor lse_col, Tensor ws)
//   lse_backward(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor ws, Tensor lse,
//                Tensor? lse_col, Tensor g, Tensor? g_col, bool need_b, SymInt? grad_cols)
//       -> (Tensor da, Tensor db, Tensor ds)
//
// mode: "info_nce" | "clip" | "self" (b None). lse_col is empty outside "clip"; ws is the workspace the
// backward needs (pass it back unmodified); db is empty when not asked for (and in "self": da then holds
// both roles of A); ds is dL/dscale (0-dim fp32). Registered for CUDA. For the tests only, the same
// implementation is registered for CPU and runs when FUSED_CONTRASTIVE_AOT_FAKE_CPU is set: CPU data
// pointers then stand in for device pointers, which only a mock driver (FUSED_CONTRASTIVE_LIBCUDA) accepts.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "fused_contrastive.h"

#ifdef FC_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using at::Tensor;

void check(fc_status s, const char *call) {
  TORCH_CHECK(s == FC_OK, "fused_contrastive_aot: ", call, " failed: ", fc_last_error());
}

fc_dtype dtype_of(const Tensor &t, const char *name) {
  switch (t.scalar_type()) {
    case at::kFloat: return FC_FLOAT32;
    case at::kHalf: return FC_FLOAT16;
    case at::kBFloat16: return FC_BFLOAT16;
    default: TORCH_CHECK_TYPE(false, "fused_contrastive_aot: ", name, " must be float32, float16 or bfloat16, got ",
                              t.scalar_type());
  }
}

fc_mode mode_of(const std::string &m) {
  if (m == "info_nce") return FC_MODE_INFO_NCE;
  if (m == "clip") return FC_MODE_CLIP;
  if (m == "self") return FC_MODE_SELF;
  TORCH_CHECK_VALUE(false, "fused_contrastive_aot: mode must be \"info_nce\", \"clip\" or \"self\", got \"", m, "\"");
}

void *stream_of(const Tensor &a) {
#ifdef FC_TORCH_CUDA
  if (a.is_cuda()) return c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
#endif
  (void)a;
  return nullptr;
}

Tensor rows_ok(const Tensor &x, const char *name) {
  TORCH_CHECK_VALUE(x.dim() == 2, "fused_contrastive_aot: ", name, " must be 2-D [rows, D], got ", x.dim(), "-D");
  return x.stride(1) == 1 || x.size(1) <= 1 ? x : x.contiguous();
}

struct Problem {
  fc_problem p{};
  Tensor a, b, scale;
};

Problem make_problem(const Tensor &a_, const std::optional<Tensor> &b_, const Tensor &scale, const std::string &mode,
                     double eps) {
  Problem P;
  P.p.mode = mode_of(mode);
  P.a = rows_ok(a_, "a");
  TORCH_CHECK_VALUE((P.p.mode == FC_MODE_SELF) != b_.has_value(), "fused_contrastive_aot: b must be None exactly in "
                    "mode \"self\"");
  P.p.dtype = dtype_of(P.a, "a");
  if (b_) {
    P.b = rows_ok(*b_, "b");
    TORCH_CHECK_TYPE(P.b.scalar_type() == P.a.scalar_type(), "fused_contrastive_aot: a and b must have one dtype");
    TORCH_CHECK_VALUE(P.b.size(1) == P.a.size(1), "fused_contrastive_aot: a and b must have the same D");
    TORCH_CHECK_VALUE(P.b.device() == P.a.device(), "fused_contrastive_aot: a and b must be on one device");
  }
  P.scale = scale.detach().to(P.a.device(), at::kFloat).reshape({1}).contiguous();
  P.p.n = P.a.size(0);
  P.p.d = P.a.size(1);
  P.p.a = P.a.data_ptr();
  P.p.stride_a = P.a.stride(0);
  P.p.m = b_ ? P.b.size(0) : P.p.n;
  P.p.b = b_ ? P.b.data_ptr() : nullptr;
  P.p.stride_b = b_ ? P.b.stride(0) : 0;
  P.p.scale = P.scale.data_ptr<float>();
  P.p.eps = static_cast<float>(eps);
  P.p.offset = 0;
  return P;
}

// the workspace as a byte tensor; its first 256-byte aligned address is the workspace
void *ws_ptr(const Tensor &ws) {
  auto p = reinterpret_cast<uintptr_t>(ws.data_ptr());
  return reinterpret_cast<void *>((p + 255) & ~uintptr_t(255));
}

std::tuple<Tensor, Tensor, Tensor> lse(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                       std::string mode, double eps) {
#ifdef FC_TORCH_CUDA
  c10::cuda::OptionalCUDAGuard guard;
  if (a.is_cuda()) guard.set_device(a.device());
#endif
  Problem P = make_problem(a, b, scale, mode, eps);
  size_t bytes = 0;
  check(fc_workspace_size(&P.p, &bytes), "fc_workspace_size");
  Tensor ws = at::empty({static_cast<int64_t>(bytes) + 256}, P.a.options().dtype(at::kByte));
  Tensor out = at::empty({P.p.n}, P.a.options().dtype(at::kFloat));
  check(fc_forward(&P.p, ws_ptr(ws), bytes, out.data_ptr<float>(), stream_of(P.a)), "fc_forward");
  Tensor col = at::empty({0}, out.options());
  if (P.p.mode == FC_MODE_CLIP) {
    float *part = nullptr;
    int64_t rows = 0;
    check(fc_col_partials(&P.p, ws_ptr(ws), &part, &rows), "fc_col_partials");
    // the deterministic merge of the per-program partials (the Python launcher's logsumexp(dim=0))
    auto off = reinterpret_cast<char *>(part) - reinterpret_cast<char *>(ws.data_ptr());
    col = at::logsumexp(ws.narrow(0, off, rows * P.p.m * 4).view(at::kFloat).view({rows, P.p.m}), {0});
  }
  return {out, col, ws};
}

std::tuple<Tensor, Tensor, Tensor> lse_backward(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                                std::string mode, double eps, const Tensor &ws, const Tensor &lse_,
                                                const std::optional<Tensor> &lse_col, const Tensor &g,
                                                const std::optional<Tensor> &g_col, bool need_b,
                                                std::optional<c10::SymInt> grad_cols) {
#ifdef FC_TORCH_CUDA
  c10::cuda::OptionalCUDAGuard guard;
  if (a.is_cuda()) guard.set_device(a.device());
#endif
  Problem P = make_problem(a, b, scale, mode, eps);
  size_t bytes = 0;
  check(fc_workspace_size(&P.p, &bytes), "fc_workspace_size");
  TORCH_CHECK_VALUE(ws.scalar_type() == at::kByte && static_cast<size_t>(ws.numel()) >= bytes + 256,
                    "fused_contrastive_aot: ws is not the workspace lse() returned for this problem");
  auto f32 = [&](const Tensor &t) { return t.to(P.a.device(), at::kFloat).contiguous(); };
  const bool clip = P.p.mode == FC_MODE_CLIP;
  TORCH_CHECK_VALUE(clip == (lse_col.has_value() && g_col.has_value()),
                    "fused_contrastive_aot: lse_col and g_col are given exactly in mode \"clip\"");
  Tensor l = f32(lse_), gg = f32(g), lc, gc;
  // one global scale of the upstream gradients (the Python launcher's gscale): the 16-bit gradient tile
  // cannot underflow; 1 where every gradient is 0
  Tensor gs = gg.abs().amax();
  if (clip) {
    lc = f32(*lse_col);
    gc = f32(*g_col);
    gs = at::maximum(gs, gc.abs().amax());
  }
  gs = at::where(gs > 0, gs, at::ones_like(gs)).reshape({1}).contiguous();
  fc_backward_args args{};
  args.lse = l.data_ptr<float>();
  args.g = gg.data_ptr<float>();
  args.lse_col = clip ? lc.data_ptr<float>() : nullptr;
  args.g_col = clip ? gc.data_ptr<float>() : nullptr;
  args.gscale = gs.data_ptr<float>();
  Tensor da = at::empty(P.a.sizes(), P.a.options());
  args.da = da.data_ptr();
  args.stride_da = da.stride(0);
  Tensor db = at::empty({0}, P.a.options());
  int64_t m = P.p.m;
  if (need_b && P.p.mode != FC_MODE_SELF) {
    db = at::empty({m, P.p.d}, P.a.options());
    int64_t gcols = grad_cols ? std::min<int64_t>(m, grad_cols->guard_int(__FILE__, __LINE__)) : m;
    if (gcols < m) db.narrow(0, gcols, m - gcols).zero_();  // queue columns get no gradient
    args.db = db.data_ptr();
    args.stride_db = db.stride(0);
    args.grad_cols = gcols;
  }
  int64_t rows = 0;
  check(fc_ds_rows(&P.p, &rows), "fc_ds_rows");
  Tensor ds_part = at::empty({rows}, l.options());
  args.ds_part = ds_part.data_ptr<float>();
  check(fc_backward(&P.p, &args, ws_ptr(ws), bytes, stream_of(P.a)), "fc_backward");
  return {da, db, ds_part.sum() * gs.reshape({})};
}

}  // namespace

TORCH_LIBRARY(fused_contrastive_aot, m) {
  m.def("lse(Tensor a, Tensor? b, Tensor scale, str mode, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("lse_backward(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor ws, Tensor lse, "
        "Tensor? lse_col, Tensor g, Tensor? g_col, bool need_b, SymInt? grad_cols) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fused_contrastive_aot, CUDA, m) {
  m.impl("lse", &lse);
  m.impl("lse_backward", &lse_backward);
}

namespace {
std::tuple<Tensor, Tensor, Tensor> lse_cpu(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                           std::string mode, double eps) {
  const bool fake = std::getenv("FUSED_CONTRASTIVE_AOT_FAKE_CPU") != nullptr;
  TORCH_CHECK(fake, "fused_contrastive_aot::lse runs on CUDA tensors (the kernels are GPU code)");
  return lse(a, b, scale, std::move(mode), eps);
}
std::tuple<Tensor, Tensor, Tensor> lse_backward_cpu(const Tensor &a, const std::optional<Tensor> &b,
                                                    const Tensor &scale, std::string mode, double eps, const Tensor &ws,
                                                    const Tensor &l, const std::optional<Tensor> &lc, const Tensor &g,
                                                    const std::optional<Tensor> &gc, bool need_b,
                                                    std::optional<c10::SymInt> grad_cols) {
  const bool fake = std::getenv("FUSED_CONTRASTIVE_AOT_FAKE_CPU") != nullptr;
  TORCH_CHECK(fake, "fused_contrastive_aot::lse_backward runs on CUDA tensors (the kernels are GPU code)");
  return lse_backward(a, b, scale, std::move(mode), eps, ws, l, lc, g, gc, need_b, std::move(grad_cols));
}
}  // namespace

TORCH_LIBRARY_IMPL(fused_contrastive_aot, CPU, m) {
  m.impl("lse", &lse_cpu);
  m.impl("lse_backward", &lse_backward_cpu);
}
