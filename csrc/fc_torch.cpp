// fc_torch.cpp - libfused_contrastive_torch: the C API as PyTorch operators (namespace fused_contrastive_aot).
//
// The Python package already defines TORCH_LIBRARY(fused_contrastive, ...) (a namespace can be defined
// once), so these live in fused_contrastive_aot. They are the core op's kernel statistics (the level of
// the Python launcher's _lse_fwd / _lse_bwd), not the whole fused_contrastive::triton_core schema: the
// loss coefficients, targets and positive terms stay in the Python package.
//
//   lse(Tensor a, Tensor? b, Tensor scale, str mode, float eps, float margin=0., Tensor? target=None)
//       -> (Tensor lse, Tensor lse_col, Tensor ws)
//   lse_backward(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor ws, Tensor lse,
//                Tensor? lse_col, Tensor g, Tensor? g_col, bool need_b, SymInt? grad_cols, float margin=0.,
//                Tensor? target=None)
//       -> (Tensor da, Tensor db, Tensor ds)
//   lse_split(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor target, float margin=0.)
//       -> (Tensor lse_x, Tensor lse_col_x, Tensor lt, Tensor ws)
//   lse_backward_split(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor ws, Tensor lse, Tensor? lse_col,
//                      Tensor g, Tensor? g_col, bool need_b, SymInt? grad_cols, Tensor target, Tensor w,
//                      float margin=0.) -> (Tensor da, Tensor db, Tensor ds, Tensor tw)
//   build_info() -> str    (fc_build_info(): the archs, dtypes, D classes and modes built)
//
// The split ops are fc_forward_split / fc_backward_split ("info_nce" / "clip" / "self"; a margin, whose target is the
// split's, in "info_nce" / "clip" where the "_margin_split" feature sets are built; the fused kernels at every
// size, never the panel path): lse_x, lse_col_x (the merged column partials) and lt [2n] as the header says; lse /
// lse_col of the backward are the caller's merged ones (core/lse/triton_fused.py merge_split); w [n] the combined weights
// at each row's target logit (the header's W_i: target_split.exact_weights), passed as tv = w / gscale; tw [n] =
// gscale * tv (triton_fused._lse_bwd's fourth result).
//
// Large problems take the panel path, as the Python backend does (core/lse/triton_panel.py): on CUDA tensors
// with N * M >= 2^24, or where FUSED_CONTRASTIVE_TRITON_PATH says "panel" ("fused": never). Its GEMMs
// run in at::mm / addmm (cuBLAS, fixed order), the per-logit and per-row work in the panel kernels of
// the C library (fc_launch_kernel); nothing N x M is allocated (panels of P rows from the byte budget
// FUSED_CONTRASTIVE_PANEL_BUDGET, default 0.70 GB). "info_nce" / "clip": the fused forward, then the
// recomputing panel backward (ws unused there); "self": the triangular forward (the fused forward kernel
// over the upper triangle's tiles) and the triangular backward sweep (ws
// empty).
//
// mode: "info_nce" | "clip" | "self" (b None). margin (cosine units) with target ([n] integer, row i's
// target column in [0, m), on a's device; not range-checked: no host synchronisation): the additive
// target margin of fc_problem, in "info_nce" and "clip" (the fused kernels and the panel path alike);
// lse_backward takes the margin and target lse was given. lse_col is empty outside "clip"; ws is the workspace the
// backward needs (pass it back unmodified); db is empty when not asked for (and in "self": da then holds
// both roles of A); ds is dL/dscale (0-dim fp32). Registered for CUDA. For the tests only, the same
// implementation is registered for CPU and runs when FUSED_CONTRASTIVE_AOT_FAKE_CPU is set: CPU data
// pointers then stand in for device pointers, which only a mock driver (FUSED_CONTRASTIVE_LIBCUDA) accepts.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fc_kernels_gen.h"  // the launcher's constants: FC_PANEL_*, FC_TRI_*, FC_ROW_NORM_* (generated)
#include "fused_contrastive.h"

#include <ATen/CPUGeneratorImpl.h>

#ifdef FC_TORCH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
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
  Tensor a, b, scale, target;  // target: [n] int64, 16-byte aligned (the margin's columns), or undefined
};

Problem make_problem(const Tensor &a_, const std::optional<Tensor> &b_, const Tensor &scale, const std::string &mode,
                     double eps, double margin, const std::optional<Tensor> &target) {
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
  TORCH_CHECK_VALUE(std::isfinite(margin), "fused_contrastive_aot: margin must be finite, got ", margin);
  P.p.margin = static_cast<float>(margin);
  if (margin != 0.0) {
    TORCH_CHECK_VALUE(P.p.mode != FC_MODE_SELF, "fused_contrastive_aot: margin is supported in modes \"info_nce\" "
                      "and \"clip\", not \"self\"");
    TORCH_CHECK_VALUE(target.has_value(), "fused_contrastive_aot: margin != 0 needs target ([n] target columns)");
    const Tensor &t = *target;
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == P.p.n, "fused_contrastive_aot: target must have shape [n] = [",
                      P.p.n, "], got ", t.sizes());
    TORCH_CHECK_TYPE(!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type()) &&
                         t.scalar_type() != at::kBool,
                     "fused_contrastive_aot: target must be an integer tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == P.a.device(), "fused_contrastive_aot: target must be on a's device");
    P.target = t.to(at::kLong).contiguous();
    if (reinterpret_cast<uintptr_t>(P.target.data_ptr()) % 16) P.target = P.target.clone();  // a fresh allocation
    P.p.target = P.target.data_ptr<int64_t>();
  }
  return P;
}


// ------------------------------------------------------------------------------------------------
// the panel path (fused_contrastive/core/lse/triton_panel.py, statement by statement; a ctest compares
// every launch with the Python launcher's)
// ------------------------------------------------------------------------------------------------

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t d_pad(int64_t d) {  // triton_shared.configs.d_pad
  int64_t p = 16;
  while (p < d) p <<= 1;
  return p;
}

// panels.use_panel
bool use_panel(const Tensor &a, int64_t n, int64_t m) {
  const char *e = std::getenv("FUSED_CONTRASTIVE_TRITON_PATH");
  const std::string mode = e ? e : "auto";
  TORCH_CHECK_VALUE(mode == "auto" || mode == "panel" || mode == "fused",
                    "FUSED_CONTRASTIVE_TRITON_PATH must be 'auto', 'panel' or 'fused', got '", mode, "'");
  if (mode != "auto") return mode == "panel";
  return a.is_cuda() && n * m >= static_cast<int64_t>(FC_PANEL_MIN_ELEMENTS);
}

// one launch of a generated kernel, its variant named by the constexprs (fc_launch_kernel)
struct Kernel {
  const char *name;
  fc_dtype dt;
  int64_t grid;
  std::map<std::string, std::string> cx;
  std::vector<fc_karg> args;
  Kernel(const char *n, fc_dtype d, int64_t g) : name(n), dt(d), grid(g) {}
  Kernel &p(const char *k, const Tensor &t) {
    args.push_back({k, FC_KARG_PTR, t.data_ptr(), 0, 0.0});
    return *this;
  }
  Kernel &i(const char *k, int64_t v) {
    args.push_back({k, FC_KARG_INT, nullptr, v, 0.0});
    return *this;
  }
  Kernel &f(const char *k, double v) {
    args.push_back({k, FC_KARG_FLOAT, nullptr, 0, v});
    return *this;
  }
  Kernel &c(const char *k, int64_t v) {
    cx[k] = std::to_string(v);
    return *this;
  }
  Kernel &s(const char *k, const char *v) {  // a string constexpr, as is
    cx[k] = v;
    return *this;
  }
  Kernel &cf(const char *k, double v) {  // floats with one decimal, as the generator's key spells them
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f", v);
    cx[k] = buf;
    return *this;
  }
  void run(void *stream) {
    std::string key;
    for (const auto &kv : cx) key += (key.empty() ? "" : ",") + kv.first + "=" + kv.second;
    check(fc_launch_kernel(name, dt, key.c_str(), grid, args.data(), static_cast<int>(args.size()), stream), name);
  }
};

struct Panel {
  Tensor a, b;  // b is a in mode "self"
  fc_dtype dt;
  int64_t n, m, d, el;
  double eps, prescale;
  bool fold;     // the kernels fold B's inverse norms into the gradient tile (bf16 / fp32)
  Tensor scale;  // [1] fp32
  Tensor dummy;  // stands in for every absent pointer (never dereferenced)
  double margin;  // the target margin (cosine units; 0: none) at columns target ([n] int64)
  Tensor target;
  void *stream;
  int programs;  // 2 per SM (panels._programs)
};

Panel make_panel(const Problem &P) {
  Panel C;
  C.a = P.a;
  C.b = P.p.mode == FC_MODE_SELF ? P.a : P.b;
  C.dt = P.p.dtype;
  C.n = P.p.n;
  C.m = C.b.size(0);
  C.d = P.p.d;
  C.el = P.a.element_size();
  C.eps = P.p.eps;
  C.fold = C.dt != FC_FLOAT16;
  C.prescale = C.dt == FC_FLOAT16 ? FC_PANEL_FP16_PRESCALE : 1.0;
  C.scale = P.scale;
  C.dummy = at::empty({1}, P.a.options().dtype(at::kFloat));
  C.margin = P.p.margin;
  C.target = P.target;
  C.stream = stream_of(P.a);
  int cc = 0, sms = 0;
  check(fc_device_props(&cc, &sms), "fc_device_props");
  C.programs = 2 * sms;
  return C;
}

// panels.panel_rows (without the test hook PANEL_ROWS)
int64_t panel_rows(const Panel &C, int64_t m, bool need_db) {
  const char *env = std::getenv("FUSED_CONTRASTIVE_PANEL_BUDGET");
  const int64_t budget = env && *env ? std::stoll(env) : static_cast<int64_t>(FC_PANEL_BUDGET_BYTES);
  const int64_t e = C.el, d = C.d;
  const int64_t fixed = (need_db ? 4 * m * d : 0) + (C.dt == FC_FLOAT16 ? e * m * d : 0);
  const int64_t per_row = (4 + e) * m + (4 + 2 * e) * d + 16;
  const int64_t num = budget - fixed;
  int64_t p = num >= 0 ? num / per_row : -((-num + per_row - 1) / per_row);  // Python's floor division
  p = p >= 64 ? p - p % 64 : p;
  return std::max<int64_t>(1, std::min<int64_t>(C.n, std::max<int64_t>(FC_PANEL_P_MIN, p)));
}

// panels.panel_blocks: (BLOCK_R, BLOCK_C)
std::pair<int64_t, int64_t> panel_blocks(int64_t p, int64_t programs) {
  for (int64_t r : {16, 8, 4, 2})
    if (cdiv(p, r) >= programs) return {r, FC_PANEL_CHUNK / r};
  return {1, FC_PANEL_CHUNK};
}

// triton_shared.launch._row_norms: (scaled copy, norms, inverse norms, inverse norms of the copy)
std::array<Tensor, 4> row_norms(const Panel &C, const Tensor &x, Tensor norm = {}, Tensor rnorm = {}) {
  const int64_t r = x.size(0), d = x.size(1);
  auto f32 = x.options().dtype(at::kFloat);
  Tensor xs = at::empty({r, d}, x.options());
  if (!norm.defined()) norm = at::empty({r}, f32);
  if (!rnorm.defined()) rnorm = at::empty({r}, f32);
  Tensor rs = at::empty({r}, f32);
  Kernel("row_norm", C.dt, cdiv(r, FC_ROW_NORM_BLOCK_R))
      .p("X", x).p("XS", xs).p("NORM", norm).p("RNORM", rnorm).p("RS", rs)
      .i("N", r).i("D", d).i("stride_x", x.stride(0)).i("stride_xs", xs.stride(0)).f("eps", C.eps)
      .c("BLOCK_R", FC_ROW_NORM_BLOCK_R).c("BLOCK_D", std::min<int64_t>(d_pad(d), FC_ROW_NORM_MAX_BLOCK_D))
      .run(C.stream);
  return {xs, norm, rnorm, rs};
}

// panels._Problem with normalisation: B's norms in chunks; for fp16 (need_op) the normalised B
struct Norms {
  Tensor nb, rb, b_op;
};

Norms column_norms(const Panel &C, bool need_op) {
  Norms N;
  auto f32 = C.b.options().dtype(at::kFloat);
  N.nb = at::empty({C.m}, f32);
  N.rb = at::empty({C.m}, f32);
  const int64_t step = std::max<int64_t>(1, FC_PANEL_NORM_CHUNK_ELEMENTS / std::max<int64_t>(C.d, 1));
  const bool fp16_copy = !C.fold && need_op;
  N.b_op = fp16_copy ? at::empty_like(C.b) : C.b;
  for (int64_t c0 = 0; c0 < C.m; c0 += step) {
    const int64_t len = std::min(step, C.m - c0);
    auto r = row_norms(C, C.b.narrow(0, c0, len), N.nb.narrow(0, c0, len), N.rb.narrow(0, c0, len));
    if (fp16_copy) N.b_op.narrow(0, c0, len).copy_((r[0].to(at::kFloat) * r[3].unsqueeze(1)).to(C.b.scalar_type()));
  }
  return N;
}

// triton_panel._gscale
Tensor gscale(std::initializer_list<const Tensor *> vs) {
  std::vector<Tensor> m;
  for (const Tensor *v : vs)
    if (v && v->defined()) m.push_back(v->abs().amax());
  Tensor gs = at::stack(m).amax();
  return at::where(gs > 0, gs, at::ones_like(gs)).reshape({1});
}

// panels.gemm_routes: the fp32-output GEMMs of 16-bit operands (at::mm / at::addmm_out with
// out_dtype: cuBLAS accumulates in fp32 and writes fp32) run unproven nowhere. The first call per
// (device, dtype) runs both on tiny tensors of the real call's layout (transposed operands, out= the
// accumulator) against a float64 product and caches the verdict; on an exception or a mismatch it warns
// once and takes the upcast fallback (fp32 copies of the operands: correct everywhere). The CPU has no
// such GEMMs: it takes the fallback unprobed, unless FUSED_CONTRASTIVE_AOT_PROBE_CPU is set (the tests:
// the probe then runs there, fails, and the fallback is what runs). While a CUDA graph is being captured
// no probe can run (host copies): the fallback, said once, nothing cached.
struct GemmRoutes {
  bool mm = false, addmm = false;  // true: the native out_dtype call
};
std::mutex g_routes_mu;
std::map<std::pair<int, int>, GemmRoutes> g_routes;

std::string probe_gemm(bool add, const Tensor &like) {
  try {
    auto gen = at::detail::createCPUGenerator(1234);
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    const int64_t k = 72;
    Tensor x = (at::randn({k, 24}, gen, f32) * 3).to(like.scalar_type());  // used transposed: [24, 72]
    Tensor y = (at::randn({40, k}, gen, f32) * 3).to(like.scalar_type());  // used transposed: [72, 40]
    Tensor xd = x.t().to(at::kDouble), yd = y.t().to(at::kDouble);
    Tensor want = at::mm(xd, yd);
    // products of 16-bit values need more than 16 bits: a 16-bit output would be off by ~2^-9 relative
    Tensor bound = at::mm(xd.abs(), yd.abs()) * std::ldexp(1.0, -16);
    Tensor xt = x.to(like.device()).t(), yt = y.to(like.device()).t();
    Tensor got;
    if (!add) {
      got = at::mm(xt, yt, at::kFloat);
    } else {
      Tensor acc0 = at::randn({24, 40}, gen, f32);
      Tensor acc = acc0.to(like.device(), /*non_blocking=*/false, /*copy=*/true);
      void *ptr = acc.data_ptr();
      at::addmm_out(acc, acc, xt, yt, at::kFloat);
      if (acc.data_ptr() != ptr) return "the result did not land in the accumulator";
      got = acc;
      want = want + acc0.to(at::kDouble);
      bound = bound + acc0.to(at::kDouble).abs() * std::ldexp(1.0, -22);
    }
    if (got.scalar_type() != at::kFloat || got.size(0) != 24 || got.size(1) != 40)
      return "the result is not fp32 [24, 40]";
    Tensor err = (got.cpu().to(at::kDouble) - want).abs();
    if (!(err <= bound).all().item<bool>())
      return "the result differs from the float64 product by up to " + std::to_string(err.max().item<double>());
  } catch (const c10::Error &e) {
    std::string w = e.what_without_backtrace();
    return w.substr(0, w.find('\n'));
  } catch (const std::exception &e) {
    return e.what();
  }
  return "";
}

GemmRoutes gemm_routes(const Tensor &x) {
  const bool probe_cpu = std::getenv("FUSED_CONTRASTIVE_AOT_PROBE_CPU") != nullptr;
  if (!x.is_cuda() && !probe_cpu) return {};
  const std::pair<int, int> key{x.is_cuda() ? x.get_device() : -1, static_cast<int>(x.scalar_type())};
  std::lock_guard<std::mutex> lock(g_routes_mu);
  auto it = g_routes.find(key);
  if (it != g_routes.end()) return it->second;
#ifdef FC_TORCH_CUDA
  if (x.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    TORCH_WARN_ONCE("fused_contrastive_aot: the first panel-path call with ", x.scalar_type(), " operands on ",
                    x.device(), " is being captured in a CUDA graph, where the fp32-output GEMMs cannot be probed: "
                    "it takes the upcast route (fp32 copies of the operands, slower). Run one call before capturing.");
    return {};
  }
#endif
  GemmRoutes r;
  const std::string why_mm = probe_gemm(false, x), why_addmm = probe_gemm(true, x);
  r.mm = why_mm.empty();
  r.addmm = why_addmm.empty();
  if (!r.mm)
    TORCH_WARN("fused_contrastive_aot: no working fp32-output mm of ", x.scalar_type(), " operands on ", x.device(),
               " (", why_mm, "); the panel path takes the upcast route (correct, more memory traffic)");
  if (!r.addmm)
    TORCH_WARN("fused_contrastive_aot: no working fp32-output addmm of ", x.scalar_type(), " operands on ",
               x.device(), " (", why_addmm, "); the panel path takes the upcast route (correct, more memory traffic)");
  g_routes[key] = r;
  return r;
}

// panels._mm32 / _addmm32_: fp32 results (16-bit operands: the native route where its probe passed)
Tensor mm32(const Tensor &x, const Tensor &y) {
  if (x.scalar_type() == at::kFloat) return at::mm(x, y);
  if (!gemm_routes(x).mm) return at::mm(x.to(at::kFloat), y.to(at::kFloat));
  return at::mm(x, y, at::kFloat);
}

void addmm32_(Tensor acc, const Tensor &x, const Tensor &y) {
  if (x.scalar_type() == at::kFloat)
    acc.addmm_(x, y);
  else if (!gemm_routes(x).addmm)
    acc.addmm_(x.to(at::kFloat), y.to(at::kFloat));
  else
    at::addmm_out(acc, acc, x, y, at::kFloat);
}

// panels._rows_launch (normalised rows)
void rows_launch(const Panel &C, const Tensor &g, const Tensor &x, const Tensor &rs, const Tensor &nrm, const Tensor &w,
                 const Tensor &gs, const Tensor &out, const Tensor *xw) {
  const int64_t r = x.size(0), d = x.size(1);
  Kernel("panel_rows", C.dt, cdiv(r, FC_PANEL_ROWS_BLOCK_R))
      .p("G", g).p("X", x).p("RS", rs).p("NRM", nrm).p("W", w).p("SCALE", C.scale).p("GSCALE", gs).p("OUT", out)
      .p("XW", xw ? *xw : C.dummy)
      .i("R", r).i("D", d).i("stride_g", g.stride(0)).i("stride_x", x.stride(0)).i("stride_o", out.stride(0))
      .i("stride_xw", xw ? xw->stride(0) : 0).f("eps", C.eps)
      .c("BLOCK_R", FC_PANEL_ROWS_BLOCK_R).c("BLOCK_D", std::min<int64_t>(d_pad(d), FC_PANEL_ROWS_MAX_BLOCK_D))
      .c("NORMALIZE", 1).c("NEED_OUT", 1).c("NEED_XW", xw != nullptr).cf("PRESCALE", C.prescale)
      .run(C.stream);
}

// panel_dl_kernel's launch without positives or masks; `tri`: a triangular panel (SYM, TRI). The bias
// column is the target margin's (HAS_BIAS and BIAS_COS: bias = -margin at column target_i), if any
Kernel dl_kernel(const Panel &C, int64_t grid, int64_t block_r, int64_t block_c, bool excl, bool has_gcol, bool tri) {
  const bool margin = C.margin != 0.0;
  Kernel k("panel_dl", C.dt, grid);
  k.c("BLOCK_R", block_r).c("BLOCK_C", block_c).c("NORMALIZE", 1).c("EXCLUDE_SELF", excl).c("HAS_BIAS", margin)
      .c("BIAS_COS", margin).c("POS_KIND", 0).c("HAS_G", 1).c("HAS_GCOL", has_gcol).c("HAS_GPOS", 0).c("SYM", tri)
      .c("EAGER", 0).c("ONE_PASS", 0).c("NEED_DS", 1).c("FOLD_RB", C.fold).cf("PRESCALE", C.prescale).c("TRI", tri)
      .c("SPLIT_T", 0).c("SPLIT_SET", 0).c("EXACT_T", 0);
  k.p("TGT", C.dummy).p("TV", C.dummy).p("WX", C.dummy).p("BIAS_COL", margin ? C.target : C.dummy).p("ROW_LAB", C.dummy).p("COL_LAB", C.dummy).p("POS_MASK", C.dummy)
      .p("LSE_POS", C.dummy).p("G_POS", C.dummy).p("LSE_OUT", C.dummy).p("LSE_POS_OUT", C.dummy)
      .p("LOSS", C.dummy).p("FOLD", C.dummy)  /* the one pass's loss outputs: ONE_PASS is off here */
      .i("offset", 0).f("bias", margin ? -C.margin : 0.0).i("n0", 1).i("m0", 1).i("stride_pm", 1).i("pm_shift", 0);
  return k;
}

// triton_panel.sweep without EAGER, B given (modes info_nce / clip): (dA, dB or empty, ds)
std::tuple<Tensor, Tensor, Tensor> panel_backward(const Panel &C, const Tensor &lse, const Tensor *lse_col,
                                                  const Tensor &g, const Tensor *g_col, bool need_b, int64_t gcols) {
  const int64_t n = C.n, m = C.m, d = C.d;
  auto f32 = C.a.options().dtype(at::kFloat);
  const int64_t p_rows = panel_rows(C, m, need_b);
  const auto [block_r, block_c] = panel_blocks(std::min(n, p_rows), C.programs);
  Norms N = column_norms(C, true);
  Tensor gs = gscale({&g, g_col});
  Tensor da = at::empty({n, d}, C.a.options());
  Tensor acc = need_b && gcols > 0 ? at::zeros({gcols, d}, f32) : Tensor();
  std::vector<Tensor> ds_parts;
  const Tensor bt = C.b.t();
  for (int64_t r0 = 0; r0 < n; r0 += p_rows) {
    const int64_t pp = std::min(n, r0 + p_rows) - r0;
    auto rr = row_norms(C, C.a.narrow(0, r0, pp));
    const Tensor &x = rr[0], &nrm = rr[1], &rs = rr[3];
    Tensor lraw = mm32(x, bt);
    Tensor dl = at::empty({pp, m}, C.a.options());
    Tensor w = at::empty({pp}, f32);
    const int64_t n_prog = cdiv(pp, block_r);
    Tensor ds_part = at::empty({n_prog}, f32);
    dl_kernel(C, n_prog, block_r, block_c, false, lse_col != nullptr, false)
        .p("L", lraw).p("DL", dl).p("W_OUT", w).p("RSP", rs).p("RB", N.rb).p("SCALE", C.scale).p("GSCALE", gs)
        .p("LSE", lse).p("G", g).p("LSE_COL", lse_col ? *lse_col : C.dummy).p("G_COL", g_col ? *g_col : C.dummy)
        .p("DS_PART", ds_part).i("M", m).i("r0", r0).i("P", pp).i("stride_l", lraw.stride(0))
        .i("stride_dl", dl.stride(0))
        .run(C.stream);
    lraw.reset();
    ds_parts.push_back(ds_part);
    // dA_P = normalisation backward of (W DL @ B) s gs / PRESCALE; XW = W A_hat_P for the dB GEMM
    Tensor da_raw = mm32(dl, N.b_op);
    Tensor xw = acc.defined() ? at::empty({pp, d}, C.a.options()) : Tensor();
    rows_launch(C, da_raw, x, rs, nrm, w, gs, da.narrow(0, r0, pp), acc.defined() ? &xw : nullptr);
    if (acc.defined()) addmm32_(acc, dl.narrow(1, 0, gcols).t(), xw);
  }
  Tensor db = at::empty({0}, C.a.options());
  if (need_b) {
    db = at::empty({m, d}, C.a.options());
    if (gcols < m) db.narrow(0, gcols, m - gcols).zero_();  // queue columns get no gradient
    if (gcols > 0) {
      // times the norm of each row where the kernel folded its inverse norm into DL
      Tensor wcol = C.fold ? N.nb.narrow(0, 0, gcols) : at::ones({gcols}, f32);
      rows_launch(C, acc, C.b.narrow(0, 0, gcols), N.rb.narrow(0, 0, gcols), N.nb.narrow(0, 0, gcols), wcol, gs,
                  db.narrow(0, 0, gcols), nullptr);
    }
  }
  return {da, db, at::cat(ds_parts).sum() * gs.reshape({})};
}

// lse.triton_fused._lse_fwd with tri (mode "self" on the panel path): the fused forward kernel over the
// tiles on and above the diagonal, its per-program column partials merged into the row LSEs
Tensor tri_lse(const Panel &C) {
  const int64_t n = C.n, d = C.d;
  auto f32 = C.a.options().dtype(at::kFloat);
  auto rr = row_norms(C, C.a);  // _prepare: the scaled copy, norms, inverse norms, inverse norms of the copy
  int bm = 0, bn = 0, bd = 0;
  check(fc_kernel_config("lse_fwd", C.dt, d, &bm, &bn, &bd), "fc_kernel_config");
  const int64_t n_rb = cdiv(n, bm);
  const int64_t per = cdiv(n_rb, std::max<int64_t>(1, C.programs));  // _col_programs: 2 x SMs, balanced
  const int64_t progs = cdiv(n_rb, per);
  Tensor lse = at::empty({n}, f32);
  Tensor col_part = at::full({progs, n}, -std::numeric_limits<float>::infinity(), f32);
  Kernel("lse_fwd", C.dt, progs)
      .p("SA", rr[0]).p("SB", rr[0]).p("RSA", rr[3]).p("RSB", rr[3]).p("SCALE", C.scale).p("BIAS_COL", C.dummy)
      .p("ROW_LAB", C.dummy).p("COL_LAB", C.dummy).p("POS_MASK", C.dummy).p("LSE", lse).p("LSE_POS", C.dummy)
      .p("COL_PART", col_part).i("N", n).i("M", n).i("D", d).i("stride_sa", rr[0].stride(0))
      .i("stride_sb", rr[0].stride(0)).i("offset", 0).f("bias", 0.0).i("n0", 1).i("m0", 1).i("stride_pm", 1)
      .i("n_row_blocks", cdiv(n_rb, progs) * progs)
      .c("BLOCK_M", bm).c("BLOCK_N", bn).c("BLOCK_D", bd).c("NORMALIZE", 1).c("EXCLUDE_SELF", 1).c("HAS_BIAS", 0).c("BIAS_COS", 0)
      .c("POS_KIND", 0).s("UPCAST", "0").s("DOT_PREC", C.dt == FC_FLOAT32 ? "tf32x3" : "tf32").c("WANT_COL", 0)
      .c("TRI", 1).p("TGT", C.dummy).p("LT", C.dummy).c("SPLIT_T", 0)
      .run(C.stream);
  return at::logaddexp(lse, at::logsumexp(col_part, {0}));
}

// triton_panel.tri_backward: (dA with both roles, ds) of B-is-A logits (mode "self")
std::tuple<Tensor, Tensor> tri_backward(const Panel &C, const Tensor &lse, const Tensor &g) {
  const int64_t n = C.n, d = C.d;
  auto f32 = C.a.options().dtype(at::kFloat);
  const int64_t p_rows = panel_rows(C, n, true);
  const auto [block_r, block_c] = panel_blocks(std::min(n, p_rows), C.programs);
  Norms N = column_norms(C, true);
  Tensor gs = gscale({&g});
  Tensor acc = at::zeros({n, d}, f32);
  std::vector<Tensor> ds_parts;
  const Tensor &a_op = N.b_op;  // raw A (folded norms) or the normalised fp16 copy
  for (int64_t r0 = 0; r0 < n; r0 += p_rows) {
    const int64_t r1 = std::min(n, r0 + p_rows), pp = r1 - r0, c = n - r0;
    auto rr = row_norms(C, C.a.narrow(0, r0, pp));
    Tensor lraw = mm32(rr[0], C.a.narrow(0, r0, c).t());
    Tensor h = at::empty({pp, c}, C.a.options());
    const int64_t n_prog = cdiv(pp, block_r);
    Tensor ds_part = at::empty({n_prog}, f32);
    dl_kernel(C, n_prog, block_r, block_c, true, false, true)
        .p("L", lraw).p("DL", h).p("W_OUT", at::empty({pp}, f32)).p("RSP", rr[3]).p("RB", N.rb.narrow(0, r0, c))
        .p("SCALE", C.scale).p("GSCALE", gs).p("LSE", lse.narrow(0, r0, c)).p("G", g.narrow(0, r0, c))
        .p("LSE_COL", C.dummy).p("G_COL", C.dummy).p("DS_PART", ds_part).i("M", c).i("r0", 0).i("P", pp)
        .i("stride_l", lraw.stride(0)).i("stride_dl", h.stride(0))
        .run(C.stream);
    lraw.reset();
    ds_parts.push_back(ds_part);
    addmm32_(acc.narrow(0, r0, pp), h, a_op.narrow(0, r0, c));
    if (c > pp) addmm32_(acc.narrow(0, r1, n - r1), h.narrow(1, pp, c - pp).t(), a_op.narrow(0, r0, pp));
  }
  Tensor da = at::empty({n, d}, C.a.options());
  Tensor wrow = C.fold ? N.nb : at::ones({n}, f32);
  rows_launch(C, acc, C.a, N.rb, N.nb, wrow, gs, da, nullptr);
  return {da, at::cat(ds_parts).sum() * gs.reshape({})};
}

// the workspace as a byte tensor; its first 256-byte aligned address is the workspace
void *ws_ptr(const Tensor &ws) {
  auto p = reinterpret_cast<uintptr_t>(ws.data_ptr());
  return reinterpret_cast<void *>((p + 255) & ~uintptr_t(255));
}

// The fused kernels' forward (fc_forward, or with the split's targets `t` fc_forward_split): (LSE or LSEx [n], the merged
// column LSE [m] in FC_MODE_CLIP (else empty), LT [2n] with the split (else empty), the workspace)
std::tuple<Tensor, Tensor, Tensor, Tensor> fused_forward(const Problem &P, const Tensor *t) {
  size_t bytes = 0;
  check(fc_workspace_size(&P.p, &bytes), "fc_workspace_size");
  Tensor ws = at::empty({static_cast<int64_t>(bytes) + 256}, P.a.options().dtype(at::kByte));
  Tensor out = at::empty({P.p.n}, P.a.options().dtype(at::kFloat));
  Tensor lt = at::empty({0}, out.options());
  if (t) {
    lt = at::full({2 * P.p.n}, -std::numeric_limits<float>::infinity(), out.options());
    check(fc_forward_split(&P.p, t->data_ptr<int64_t>(), ws_ptr(ws), bytes, out.data_ptr<float>(),
                           lt.data_ptr<float>(), stream_of(P.a)),
          "fc_forward_split");
  } else {
    check(fc_forward(&P.p, ws_ptr(ws), bytes, out.data_ptr<float>(), stream_of(P.a)), "fc_forward");
  }
  Tensor col = at::empty({0}, out.options());
  if (P.p.mode == FC_MODE_CLIP) {
    float *part = nullptr;
    int64_t rows = 0;
    check(fc_col_partials(&P.p, ws_ptr(ws), &part, &rows), "fc_col_partials");
    // the deterministic merge of the per-program partials (the Python launcher's logsumexp(dim=0))
    auto off = reinterpret_cast<char *>(part) - reinterpret_cast<char *>(ws.data_ptr());
    col = at::logsumexp(ws.narrow(0, off, rows * P.p.m * 4).view(at::kFloat).view({rows, P.p.m}), {0});
  }
  return {out, col, lt, ws};
}

// The fused kernels' backward (fc_backward, or with the split's targets `t` and combined target weights `w`
// fc_backward_split): (dA, dB or empty, dL/dscale, with the split tw = gscale * tv, else empty). The shapes of lse,
// g (and lse_col, g_col in FC_MODE_CLIP) are the caller's checks; `fwd` names the forward operator that made `ws`.
std::tuple<Tensor, Tensor, Tensor, Tensor> fused_backward(const Problem &P, const Tensor &ws, const Tensor &lse_,
                                                          const std::optional<Tensor> &lse_col, const Tensor &g,
                                                          const std::optional<Tensor> &g_col, bool need_b,
                                                          const std::optional<c10::SymInt> &grad_cols,
                                                          const Tensor *t, const Tensor *w, const char *fwd) {
  auto f32 = [&](const Tensor &x) { return x.to(P.a.device(), at::kFloat).contiguous(); };
  const bool clip = P.p.mode == FC_MODE_CLIP;
  size_t bytes = 0;
  check(fc_workspace_size(&P.p, &bytes), "fc_workspace_size");
  TORCH_CHECK_VALUE(ws.scalar_type() == at::kByte && static_cast<size_t>(ws.numel()) >= bytes + 256,
                    "fused_contrastive_aot: ws is not the workspace ", fwd, "() returned for this problem");
  Tensor l = f32(lse_), gg = f32(g), lc, gc;
  if (clip) {
    lc = f32(*lse_col);
    gc = f32(*g_col);
  }
  // one global scale of the upstream gradients (the Python launcher's gscale): the 16-bit gradient tile
  // cannot underflow; 1 where every gradient is 0
  Tensor gs = gscale({&gg, clip ? &gc : nullptr}).contiguous();
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
  if (!t) {
    check(fc_backward(&P.p, &args, ws_ptr(ws), bytes, stream_of(P.a)), "fc_backward");
    return {da, db, ds_part.sum() * gs.reshape({}), at::empty({0}, l.options())};
  }
  Tensor tv = (f32(*w) / gs).contiguous();  // read, then written, by the row kernel
  check(fc_backward_split(&P.p, &args, t->data_ptr<int64_t>(), tv.data_ptr<float>(), ws_ptr(ws), bytes,
                          stream_of(P.a)),
        "fc_backward_split");
  return {da, db, ds_part.sum() * gs.reshape({}), tv * gs.reshape({})};
}

std::tuple<Tensor, Tensor, Tensor> lse(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                       std::string mode, double eps, double margin,
                                       const std::optional<Tensor> &target) {
#ifdef FC_TORCH_CUDA
  c10::cuda::OptionalCUDAGuard guard;
  if (a.is_cuda()) guard.set_device(a.device());
#endif
  Problem P = make_problem(a, b, scale, mode, eps, margin, target);
  if (P.p.mode == FC_MODE_SELF && use_panel(P.a, P.p.n, P.p.n)) {  // the triangular forward: no workspace
    Tensor l = tri_lse(make_panel(P));
    return {l, at::empty({0}, l.options()), at::empty({0}, P.a.options().dtype(at::kByte))};
  }
  auto [out, col, lt, ws] = fused_forward(P, nullptr);
  return {out, col, ws};
}

std::tuple<Tensor, Tensor, Tensor> lse_backward(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                                std::string mode, double eps, const Tensor &ws, const Tensor &lse_,
                                                const std::optional<Tensor> &lse_col, const Tensor &g,
                                                const std::optional<Tensor> &g_col, bool need_b,
                                                std::optional<c10::SymInt> grad_cols, double margin,
                                                const std::optional<Tensor> &target) {
#ifdef FC_TORCH_CUDA
  c10::cuda::OptionalCUDAGuard guard;
  if (a.is_cuda()) guard.set_device(a.device());
#endif
  Problem P = make_problem(a, b, scale, mode, eps, margin, target);
  auto f32 = [&](const Tensor &t) { return t.to(P.a.device(), at::kFloat).contiguous(); };
  const bool clip = P.p.mode == FC_MODE_CLIP;
  TORCH_CHECK_VALUE(clip == (lse_col.has_value() && g_col.has_value()),
                    "fused_contrastive_aot: lse_col and g_col are given exactly in mode \"clip\"");
  TORCH_CHECK_VALUE(lse_.dim() == 1 && lse_.size(0) == P.p.n && g.dim() == 1 && g.size(0) == P.p.n,
                    "fused_contrastive_aot: lse and g must have shape [n] = [", P.p.n, "]");
  if (use_panel(P.a, P.p.n, P.p.m)) {
    Panel C = make_panel(P);
    Tensor l = f32(lse_), gg = f32(g);
    if (P.p.mode == FC_MODE_SELF) {
      auto [da, ds] = tri_backward(C, l, gg);
      return {da, at::empty({0}, P.a.options()), ds};
    }
    Tensor lc, gc;
    if (clip) {
      lc = f32(*lse_col);
      gc = f32(*g_col);
      TORCH_CHECK_VALUE(lc.dim() == 1 && lc.size(0) == P.p.m && gc.dim() == 1 && gc.size(0) == P.p.m,
                        "fused_contrastive_aot: lse_col and g_col must have shape [m] = [", P.p.m, "]");
    }
    const int64_t m = P.p.m;
    const int64_t gcols = grad_cols ? std::max<int64_t>(0, std::min<int64_t>(m, grad_cols->guard_int(__FILE__, __LINE__))) : m;
    return panel_backward(C, l, clip ? &lc : nullptr, gg, clip ? &gc : nullptr, need_b, gcols);
  }
  auto [da, db, ds, tw] = fused_backward(P, ws, lse_, lse_col, g, g_col, need_b, grad_cols, nullptr, nullptr, "lse");
  return {da, db, ds};
}

Tensor split_target(const Problem &P, const Tensor &target) {
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == P.p.n, "fused_contrastive_aot: target must have shape [n] = [",
                    P.p.n, "], got ", target.sizes());
  TORCH_CHECK_TYPE(!at::isFloatingType(target.scalar_type()) && !at::isComplexType(target.scalar_type()) &&
                       target.scalar_type() != at::kBool,
                   "fused_contrastive_aot: target must be an integer tensor, got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.device() == P.a.device(), "fused_contrastive_aot: target must be on a's device");
  Tensor t = target.to(at::kLong).contiguous();
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) t = t.clone();  // a fresh allocation
  return t;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lse_split(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                                     std::string mode, double eps, const Tensor &target, double margin) {
#ifdef FC_TORCH_CUDA
  c10::cuda::OptionalCUDAGuard guard;
  if (a.is_cuda()) guard.set_device(a.device());
#endif
  Problem P = make_problem(a, b, scale, mode, eps, margin, margin != 0.0 ? std::optional<Tensor>(target) : std::nullopt);
  Tensor t = split_target(P, target);
  return fused_forward(P, &t);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lse_backward_split(
    const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale, std::string mode, double eps, const Tensor &ws,
    const Tensor &lse_, const std::optional<Tensor> &lse_col, const Tensor &g, const std::optional<Tensor> &g_col,
    bool need_b, std::optional<c10::SymInt> grad_cols, const Tensor &target, const Tensor &w, double margin) {
#ifdef FC_TORCH_CUDA
  c10::cuda::OptionalCUDAGuard guard;
  if (a.is_cuda()) guard.set_device(a.device());
#endif
  Problem P = make_problem(a, b, scale, mode, eps, margin, margin != 0.0 ? std::optional<Tensor>(target) : std::nullopt);
  Tensor t = split_target(P, target);
  const bool clip = P.p.mode == FC_MODE_CLIP;
  TORCH_CHECK_VALUE(clip == (lse_col.has_value() && g_col.has_value()),
                    "fused_contrastive_aot: lse_col and g_col are given exactly in mode \"clip\"");
  TORCH_CHECK_VALUE(lse_.dim() == 1 && lse_.size(0) == P.p.n && g.dim() == 1 && g.size(0) == P.p.n,
                    "fused_contrastive_aot: lse and g must have shape [n] = [", P.p.n, "]");
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == P.p.n, "fused_contrastive_aot: w must have shape [n] = [", P.p.n,
                    "]");
  return fused_backward(P, ws, lse_, lse_col, g, g_col, need_b, grad_cols, &t, &w, "lse_split");
}

}  // namespace

static std::string build_info() { return fc_build_info(); }  // "archs=80;90 dtypes=... dclasses=... modes=..."

TORCH_LIBRARY(fused_contrastive_aot, m) {
  m.def("build_info() -> str", &build_info);
  m.def("lse(Tensor a, Tensor? b, Tensor scale, str mode, float eps, float margin=0., Tensor? target=None) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("lse_backward(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor ws, Tensor lse, "
        "Tensor? lse_col, Tensor g, Tensor? g_col, bool need_b, SymInt? grad_cols, float margin=0., "
        "Tensor? target=None) -> (Tensor, Tensor, Tensor)");
  m.def("lse_split(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor target, float margin=0.) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("lse_backward_split(Tensor a, Tensor? b, Tensor scale, str mode, float eps, Tensor ws, Tensor lse, "
        "Tensor? lse_col, Tensor g, Tensor? g_col, bool need_b, SymInt? grad_cols, Tensor target, Tensor w, "
        "float margin=0.) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fused_contrastive_aot, CUDA, m) {
  m.impl("lse", &lse);
  m.impl("lse_backward", &lse_backward);
  m.impl("lse_split", &lse_split);
  m.impl("lse_backward_split", &lse_backward_split);
}

namespace {
std::tuple<Tensor, Tensor, Tensor> lse_cpu(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                           std::string mode, double eps, double margin,
                                           const std::optional<Tensor> &target) {
  const bool fake = std::getenv("FUSED_CONTRASTIVE_AOT_FAKE_CPU") != nullptr;
  TORCH_CHECK(fake, "fused_contrastive_aot::lse runs on CUDA tensors (the kernels are GPU code)");
  return lse(a, b, scale, std::move(mode), eps, margin, target);
}
std::tuple<Tensor, Tensor, Tensor> lse_backward_cpu(const Tensor &a, const std::optional<Tensor> &b,
                                                    const Tensor &scale, std::string mode, double eps, const Tensor &ws,
                                                    const Tensor &l, const std::optional<Tensor> &lc, const Tensor &g,
                                                    const std::optional<Tensor> &gc, bool need_b,
                                                    std::optional<c10::SymInt> grad_cols, double margin,
                                                    const std::optional<Tensor> &target) {
  const bool fake = std::getenv("FUSED_CONTRASTIVE_AOT_FAKE_CPU") != nullptr;
  TORCH_CHECK(fake, "fused_contrastive_aot::lse_backward runs on CUDA tensors (the kernels are GPU code)");
  return lse_backward(a, b, scale, std::move(mode), eps, ws, l, lc, g, gc, need_b, std::move(grad_cols), margin,
                      target);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> lse_split_cpu(const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale,
                                                         std::string mode, double eps, const Tensor &target,
                                                         double margin) {
  const bool fake = std::getenv("FUSED_CONTRASTIVE_AOT_FAKE_CPU") != nullptr;
  TORCH_CHECK(fake, "fused_contrastive_aot::lse_split runs on CUDA tensors (the kernels are GPU code)");
  return lse_split(a, b, scale, std::move(mode), eps, target, margin);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> lse_backward_split_cpu(
    const Tensor &a, const std::optional<Tensor> &b, const Tensor &scale, std::string mode, double eps, const Tensor &ws,
    const Tensor &l, const std::optional<Tensor> &lc, const Tensor &g, const std::optional<Tensor> &gc, bool need_b,
    std::optional<c10::SymInt> grad_cols, const Tensor &target, const Tensor &w, double margin) {
  const bool fake = std::getenv("FUSED_CONTRASTIVE_AOT_FAKE_CPU") != nullptr;
  TORCH_CHECK(fake, "fused_contrastive_aot::lse_backward_split runs on CUDA tensors (the kernels are GPU code)");
  return lse_backward_split(a, b, scale, std::move(mode), eps, ws, l, lc, g, gc, need_b, std::move(grad_cols),
                            target, w, margin);
}
}  // namespace

TORCH_LIBRARY_IMPL(fused_contrastive_aot, CPU, m) {
  m.impl("lse", &lse_cpu);
  m.impl("lse_backward", &lse_backward_cpu);
  m.impl("lse_split", &lse_split_cpu);
  m.impl("lse_backward_split", &lse_backward_split_cpu);
}
