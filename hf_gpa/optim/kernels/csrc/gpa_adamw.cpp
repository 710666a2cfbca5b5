// One GPA-AdamW step over a list of tensors in a single pass over memory (CPU).
//
// Per element, reading y, g, z, m, v once and writing y, z, m, v once (9 passes; AdamW itself needs 7):
//   m <- lerp(m, g, 1 - beta1)               v <- beta2 v + (1 - beta2) g^2
//   d = z' - z = -lr wd z - step_size m / (sqrt(v) / sqrt(bc2) + eps)        (step_size = lr / bc1, in double)
//   y <- y + (1 - mu_x) (z - y) + (1 - mu_x mu_y) d     (= mu_x mu_y x + (1 - mu_x mu_y) z', as small corrections:
//                                                          x = z and lr = 0 leave y bitwise unchanged)
//   z <- z + d
// y and g have the parameter's dtype; z, m, v the state dtype (float32 for bf16/fp16 parameters). For bf16/fp16
// parameters an optional float32 copy of y (y32) carries y's exact value; the parameter receives it rounded. It is
// used only while the parameter still equals it rounded (something else may have written the parameter).
// Tensors may have any dense layout (channels_last, ...) as long as all of one parameter's tensors share it.
// m's update is torch's lerp, with its two formulas: w = 1 - beta1 < 0.5 gives m + w (g - m), else
// g - (1 - w) (g - m), which is exact where w = 1 (beta1 = 0, as Schedule-Free uses) whatever |g| / |m|.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Conversions between the parameter's dtype and the state's. For bf16 the rounding is c10's round-to-nearest-even
// written without a branch (NaN as a select), bitwise the same values: c10's conversion branches on NaN, which stops
// the compiler from vectorizing the loops below (a bf16 step ran at 5.7x torch's fused AdamW).
template <typename param_t, typename state_t>
inline param_t to_param(state_t v) {
  return static_cast<param_t>(v);
}

template <>
inline c10::BFloat16 to_param<c10::BFloat16, float>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + UINT32_C(0x7FFF) + ((bits >> 16) & 1)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? UINT32_C(0x7FC0) : rounded), c10::BFloat16::from_bits());
}

template <typename param_t, typename state_t>
inline state_t to_state(param_t v) {
  return static_cast<state_t>(v);
}

template <>
inline float to_state<c10::BFloat16, float>(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay, mu_x, mu_y;
  bool maximize;
};

template <typename param_t, typename state_t, bool has_y32, bool lerp_small>
void update_tensor(at::Tensor& y_t, const at::Tensor& g_t, at::Tensor& z_t, at::Tensor& m_t, at::Tensor& v_t,
                   at::Tensor* y32_t, const Hyper& h, double step_size, double bc2_sqrt) {
  param_t* __restrict__ y = y_t.data_ptr<param_t>();
  const param_t* __restrict__ g = g_t.data_ptr<param_t>();
  state_t* __restrict__ z = z_t.data_ptr<state_t>();
  state_t* __restrict__ m = m_t.data_ptr<state_t>();
  state_t* __restrict__ v = v_t.data_ptr<state_t>();
  state_t* __restrict__ y32 = has_y32 ? y32_t->data_ptr<state_t>() : nullptr;
  // torch's lerp(m, g, w) as one multiply-add, base + coeff (g - m): (m, w) if |w| < 0.5, else (g, w - 1). The
  // branch is a template argument: a select inside the loop would stop the compiler from vectorizing it.
  const state_t w = static_cast<state_t>(1.0 - h.beta1);
  const state_t lerp_coeff = lerp_small ? w : w - state_t(1);
  const state_t beta2 = static_cast<state_t>(h.beta2);
  const state_t one_minus_beta2 = static_cast<state_t>(1.0 - h.beta2);
  const state_t inv_bc2_sqrt = static_cast<state_t>(1.0 / bc2_sqrt);
  const state_t eps = static_cast<state_t>(h.eps);
  const state_t neg_decay = static_cast<state_t>(-h.lr * h.weight_decay);
  const state_t neg_step_size = static_cast<state_t>(-step_size);
  const state_t one_minus_mu_x = static_cast<state_t>(1.0 - h.mu_x);
  const state_t c = static_cast<state_t>(1.0 - h.mu_x * h.mu_y);
  const state_t sign = h.maximize ? state_t(-1) : state_t(1);
  at::parallel_for(0, y_t.numel(), 16384, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const state_t gi = sign * to_state<param_t, state_t>(g[i]);
      const state_t mi = (lerp_small ? m[i] : gi) + lerp_coeff * (gi - m[i]);
      const state_t vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
      const state_t zi = z[i];
      const state_t d = neg_decay * zi + neg_step_size * (mi / (std::sqrt(vi) * inv_bc2_sqrt + eps));
      state_t yi = to_state<param_t, state_t>(y[i]);
      if constexpr (has_y32) {
        // y's float32 copy, unless something else wrote the parameter since the last step.
        const state_t y32i = y32[i];
        yi = to_state<param_t, state_t>(to_param<param_t, state_t>(y32i)) == yi ? y32i : yi;
      }
      const state_t yn = yi + one_minus_mu_x * (zi - yi) + c * d;
      y[i] = to_param<param_t, state_t>(yn);
      if constexpr (has_y32) {
        y32[i] = yn;
      }
      z[i] = zi + d;
      m[i] = mi;
      v[i] = vi;
    }
  });
}

template <typename param_t, typename state_t>
void update(at::Tensor& y, const at::Tensor& g, at::Tensor& z, at::Tensor& m, at::Tensor& v, at::Tensor* y32,
            const Hyper& h, double step_size, double bc2_sqrt) {
  const bool lerp_small = std::abs(static_cast<state_t>(1.0 - h.beta1)) < state_t(0.5);  // torch's lerp's branch
  if (y32 != nullptr && lerp_small) {
    update_tensor<param_t, state_t, true, true>(y, g, z, m, v, y32, h, step_size, bc2_sqrt);
  } else if (y32 != nullptr) {
    update_tensor<param_t, state_t, true, false>(y, g, z, m, v, y32, h, step_size, bc2_sqrt);
  } else if (lerp_small) {
    update_tensor<param_t, state_t, false, true>(y, g, z, m, v, y32, h, step_size, bc2_sqrt);
  } else {
    update_tensor<param_t, state_t, false, false>(y, g, z, m, v, y32, h, step_size, bc2_sqrt);
  }
}

// Same dense layout: the elementwise update may then run over the storage in memory order.
bool same_dense_layout(const at::Tensor& ref, const at::Tensor& t) {
  return t.sizes() == ref.sizes() && t.strides() == ref.strides() && ref.is_non_overlapping_and_dense();
}

void gpa_adamw_step(std::vector<at::Tensor> ys, std::vector<at::Tensor> gs, std::vector<at::Tensor> zs,
                    std::vector<at::Tensor> ms, std::vector<at::Tensor> vs, std::vector<at::Tensor> y32s,
                    std::vector<double> bc1s, std::vector<double> bc2_sqrts, double lr, double beta1, double beta2,
                    double eps, double weight_decay, double mu_x, double mu_y, bool maximize) {
  const Hyper h{lr, beta1, beta2, eps, weight_decay, mu_x, mu_y, maximize};
  const size_t n = ys.size();
  TORCH_CHECK(gs.size() == n && zs.size() == n && ms.size() == n && vs.size() == n && bc1s.size() == n &&
                  bc2_sqrts.size() == n && (y32s.empty() || y32s.size() == n),
              "gpa_adamw_step: all lists must have the same length");
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& y = ys[i];
    TORCH_CHECK(y.device().is_cpu(), "gpa_adamw_step: CPU tensors only");
    at::Tensor* y32 = y32s.empty() ? nullptr : &y32s[i];
    TORCH_CHECK(same_dense_layout(y, gs[i]) && same_dense_layout(y, zs[i]) && same_dense_layout(y, ms[i]) &&
                    same_dense_layout(y, vs[i]) && (y32 == nullptr || same_dense_layout(y, *y32)),
                "gpa_adamw_step: the tensors of one parameter must share one dense layout");
    TORCH_CHECK(gs[i].scalar_type() == y.scalar_type(), "gpa_adamw_step: grad dtype must match the parameter");
    const auto p = y.scalar_type();
    const auto s = zs[i].scalar_type();
    const double step_size = lr / bc1s[i];  // as Python computes it: the for-loop's value bitwise
    TORCH_CHECK(ms[i].scalar_type() == s && vs[i].scalar_type() == s && (y32 == nullptr || y32->scalar_type() == s),
                "gpa_adamw_step: state dtypes differ");
    if (p == at::kFloat && s == at::kFloat) {
      update<float, float>(y, gs[i], zs[i], ms[i], vs[i], y32, h, step_size, bc2_sqrts[i]);
    } else if (p == at::kDouble && s == at::kDouble) {
      update<double, double>(y, gs[i], zs[i], ms[i], vs[i], y32, h, step_size, bc2_sqrts[i]);
    } else if (p == at::kBFloat16 && s == at::kFloat) {
      update<c10::BFloat16, float>(y, gs[i], zs[i], ms[i], vs[i], y32, h, step_size, bc2_sqrts[i]);
    } else if (p == at::kHalf && s == at::kFloat) {
      update<c10::Half, float>(y, gs[i], zs[i], ms[i], vs[i], y32, h, step_size, bc2_sqrts[i]);
    } else {
      TORCH_CHECK(false, "gpa_adamw_step: unsupported dtypes ", p, " / ", s);
    }
  }
}

// state_dtype="compact" (bf16 parameters): y and z are 24-bit values, a bf16 high word (y's: the parameter) and an
// int8 low word each (hf_gpa/optim/_state_layout.py defines them), m and v are bf16. Computed in float32 as above,
// then u is rounded once to 24 bits (round to nearest even on the bit pattern), hi = the bf16 nearest to it (ties
// away), lo = its bits 15..8 read as a signed byte, so that u24 = (hi << 16) + (lo << 8): integer ops only,
// vectorizable. A high word written from outside meets a stale low word; the two pairs that would leave the finite
// numbers (hi = +-0 with lo < 0: a NaN; hi = +-inf) join to hi alone, and split writes a NaN as (0x7FC0, 0).
inline float join24(uint16_t hi, int8_t lo) {
  // The select at 16 bits, hi's width, with lo as the high byte of an int16 (its sign and lo * 256): a select on lo's
  // own 8-bit lanes, or on a product, made GCC 12 convert masks between lane widths and multiply (a compact step
  // went from 1.31x to 1.92x fused AdamW bf16).
  const int16_t low = static_cast<int16_t>(static_cast<uint16_t>(static_cast<uint8_t>(lo)) << 8);
  const uint16_t magnitude = hi & UINT16_C(0x7FFF);
  const bool ignored = ((magnitude == 0) & (low < 0)) | (magnitude == UINT16_C(0x7F80));
  const int16_t kept = ignored ? int16_t(0) : low;
  const uint32_t bits = (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(kept));
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// bf16 as its bits: the loop below vectorizes on uint16_t arrays, not on c10::BFloat16 ones (GCC 12).
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline uint16_t float_to_bf16(float v) {  // round to nearest even, as to_param<c10::BFloat16, float>
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + UINT32_C(0x7FFF) + ((bits >> 16) & 1)) >> 16;
  return static_cast<uint16_t>(v != v ? UINT32_C(0x7FC0) : rounded);
}

inline void split24(float u, uint16_t& hi, int8_t& lo) {
  uint32_t bits;
  std::memcpy(&bits, &u, sizeof(bits));
  // A NaN becomes the 24-bit value 0x7FC000 (hi = 0x7FC0, lo = 0): one select at 32 bits, u's width, before the
  // words are taken apart (selects on the 16- and 8-bit words cost mask conversions, as in join24).
  const uint32_t b24 =
      u != u ? UINT32_C(0x7FC00000) : (bits + UINT32_C(0x7F) + ((bits >> 8) & 1)) & UINT32_C(0xFFFFFF00);
  hi = static_cast<uint16_t>((b24 + UINT32_C(0x8000)) >> 16);
  lo = static_cast<int8_t>(static_cast<uint8_t>(b24 >> 8));
}

struct CompactConsts {
  float sign, lerp_coeff, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_decay, neg_step_size, one_minus_mu_x, c;
};

// One range of one tensor. A function of its own, with restrict pointers as arguments: inside parallel_for's lambda
// (pointers captured by reference) GCC 12 does not vectorize this loop.
template <bool lerp_small>
void compact_range(int64_t begin, int64_t end, uint16_t* __restrict__ y, const uint16_t* __restrict__ g,
                   uint16_t* __restrict__ z, uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                   int8_t* __restrict__ y_lo, int8_t* __restrict__ z_lo, const CompactConsts k) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gi = k.sign * bf16_to_float(g[i]);
    const float m_old = bf16_to_float(m[i]);
    const float mi = (lerp_small ? m_old : gi) + k.lerp_coeff * (gi - m_old);
    const float vi = k.beta2 * bf16_to_float(v[i]) + k.one_minus_beta2 * gi * gi;
    const float zi = join24(z[i], z_lo[i]);
    const float d = k.neg_decay * zi + k.neg_step_size * (mi / (std::sqrt(vi) * k.inv_bc2_sqrt + k.eps));
    const float yi = join24(y[i], y_lo[i]);
    split24(yi + k.one_minus_mu_x * (zi - yi) + k.c * d, y[i], y_lo[i]);
    split24(zi + d, z[i], z_lo[i]);
    m[i] = float_to_bf16(mi);
    v[i] = float_to_bf16(vi);
  }
}

template <bool lerp_small>
void update_compact_tensor(at::Tensor& y_t, const at::Tensor& g_t, at::Tensor& z_t, at::Tensor& m_t, at::Tensor& v_t,
                           at::Tensor& y_lo_t, at::Tensor& z_lo_t, const Hyper& h, double step_size,
                           double bc2_sqrt) {
  uint16_t* y = reinterpret_cast<uint16_t*>(y_t.data_ptr<c10::BFloat16>());
  const uint16_t* g = reinterpret_cast<const uint16_t*>(g_t.data_ptr<c10::BFloat16>());
  uint16_t* z = reinterpret_cast<uint16_t*>(z_t.data_ptr<c10::BFloat16>());
  uint16_t* m = reinterpret_cast<uint16_t*>(m_t.data_ptr<c10::BFloat16>());
  uint16_t* v = reinterpret_cast<uint16_t*>(v_t.data_ptr<c10::BFloat16>());
  int8_t* y_lo = y_lo_t.data_ptr<int8_t>();
  int8_t* z_lo = z_lo_t.data_ptr<int8_t>();
  const float w = static_cast<float>(1.0 - h.beta1);
  const CompactConsts k{h.maximize ? -1.0f : 1.0f,
                        lerp_small ? w : w - 1.0f,
                        static_cast<float>(h.beta2),
                        static_cast<float>(1.0 - h.beta2),
                        static_cast<float>(1.0 / bc2_sqrt),
                        static_cast<float>(h.eps),
                        static_cast<float>(-h.lr * h.weight_decay),
                        static_cast<float>(-step_size),
                        static_cast<float>(1.0 - h.mu_x),
                        static_cast<float>(1.0 - h.mu_x * h.mu_y)};
  at::parallel_for(0, y_t.numel(), 16384, [&](int64_t begin, int64_t end) {
    compact_range<lerp_small>(begin, end, y, g, z, m, v, y_lo, z_lo, k);
  });
}

void gpa_adamw_step_compact(std::vector<at::Tensor> ys, std::vector<at::Tensor> gs, std::vector<at::Tensor> zs,
                            std::vector<at::Tensor> ms, std::vector<at::Tensor> vs, std::vector<at::Tensor> y_los,
                            std::vector<at::Tensor> z_los, std::vector<double> bc1s, std::vector<double> bc2_sqrts,
                            double lr, double beta1, double beta2, double eps, double weight_decay, double mu_x,
                            double mu_y, bool maximize) {
  const Hyper h{lr, beta1, beta2, eps, weight_decay, mu_x, mu_y, maximize};
  const size_t n = ys.size();
  TORCH_CHECK(gs.size() == n && zs.size() == n && ms.size() == n && vs.size() == n && y_los.size() == n &&
                  z_los.size() == n && bc1s.size() == n && bc2_sqrts.size() == n,
              "gpa_adamw_step_compact: all lists must have the same length");
  const bool lerp_small = std::abs(static_cast<float>(1.0 - beta1)) < 0.5f;  // torch's lerp's branch
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& y = ys[i];
    TORCH_CHECK(y.device().is_cpu(), "gpa_adamw_step_compact: CPU tensors only");
    TORCH_CHECK(same_dense_layout(y, gs[i]) && same_dense_layout(y, zs[i]) && same_dense_layout(y, ms[i]) &&
                    same_dense_layout(y, vs[i]) && same_dense_layout(y, y_los[i]) && same_dense_layout(y, z_los[i]),
                "gpa_adamw_step_compact: the tensors of one parameter must share one dense layout");
    for (const at::Tensor* t : {&y, &gs[i], &zs[i], &ms[i], &vs[i]}) {
      TORCH_CHECK(t->scalar_type() == at::kBFloat16, "gpa_adamw_step_compact: y, g, z, m, v must be bf16");
    }
    TORCH_CHECK(y_los[i].scalar_type() == at::kChar && z_los[i].scalar_type() == at::kChar,
                "gpa_adamw_step_compact: the low words must be int8");
    const double step_size = lr / bc1s[i];  // as Python computes it
    if (lerp_small) {
      update_compact_tensor<true>(y, gs[i], zs[i], ms[i], vs[i], y_los[i], z_los[i], h, step_size, bc2_sqrts[i]);
    } else {
      update_compact_tensor<false>(y, gs[i], zs[i], ms[i], vs[i], y_los[i], z_los[i], h, step_size, bc2_sqrts[i]);
    }
  }
}

// The two passes the generic GPA wrapper adds around its base optimizer's step, each one read-modify-write of y
// with one read of z:  before: y <- scale (y - alpha z);  after: y <- y + alpha z. With a float32 copy y32 (bf16/fp16
// parameters) y32 carries y: before the base step only y32 moves; after it the parameter receives y32 rounded.
template <typename param_t, typename state_t>
void axpby_tensor(at::Tensor& y_t, const at::Tensor& z_t, at::Tensor* y32_t, double alpha_d, double scale_d,
                  bool before) {
  param_t* __restrict__ y = y_t.data_ptr<param_t>();
  const state_t* __restrict__ z = z_t.data_ptr<state_t>();
  state_t* __restrict__ y32 = y32_t != nullptr ? y32_t->data_ptr<state_t>() : nullptr;
  const state_t alpha = static_cast<state_t>(alpha_d);
  const state_t scale = static_cast<state_t>(scale_d);
  at::parallel_for(0, y_t.numel(), 16384, [&](int64_t begin, int64_t end) {
    if (y32 == nullptr && before) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        y[i] = to_param<param_t, state_t>(scale * (to_state<param_t, state_t>(y[i]) - alpha * z[i]));
      }
    } else if (y32 == nullptr) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        y[i] = to_param<param_t, state_t>(to_state<param_t, state_t>(y[i]) + alpha * z[i]);
      }
    } else if (before) {
      for (int64_t i = begin; i < end; ++i) {
        const state_t yi = to_state<param_t, state_t>(y[i]);
        const state_t y_exact = to_state<param_t, state_t>(to_param<param_t, state_t>(y32[i])) == yi ? y32[i] : yi;
        y32[i] = scale * (y_exact - alpha * z[i]);
      }
    } else {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        const state_t yn = y32[i] + alpha * z[i];
        y32[i] = yn;
        y[i] = to_param<param_t, state_t>(yn);
      }
    }
  });
}

void gpa_wrapper_pass(std::vector<at::Tensor> ys, std::vector<at::Tensor> zs, std::vector<at::Tensor> y32s,
                      double alpha, double scale, bool before) {
  TORCH_CHECK(ys.size() == zs.size() && (y32s.empty() || y32s.size() == ys.size()),
              "gpa_wrapper_pass: lists differ in length");
  for (size_t i = 0; i < ys.size(); ++i) {
    at::Tensor& y = ys[i];
    at::Tensor* y32 = y32s.empty() ? nullptr : &y32s[i];
    TORCH_CHECK(y.device().is_cpu() && same_dense_layout(y, zs[i]) && (y32 == nullptr || same_dense_layout(y, *y32)),
                "gpa_wrapper_pass: CPU tensors of one dense layout only");
    const auto p = y.scalar_type();
    const auto s = zs[i].scalar_type();
    TORCH_CHECK(y32 == nullptr || y32->scalar_type() == s, "gpa_wrapper_pass: y32 must have z's dtype");
    if (p == at::kFloat && s == at::kFloat) {
      axpby_tensor<float, float>(y, zs[i], y32, alpha, scale, before);
    } else if (p == at::kDouble && s == at::kDouble) {
      axpby_tensor<double, double>(y, zs[i], y32, alpha, scale, before);
    } else if (p == at::kBFloat16 && s == at::kFloat) {
      axpby_tensor<c10::BFloat16, float>(y, zs[i], y32, alpha, scale, before);
    } else if (p == at::kHalf && s == at::kFloat) {
      axpby_tensor<c10::Half, float>(y, zs[i], y32, alpha, scale, before);
    } else {
      TORCH_CHECK(false, "gpa_wrapper_pass: unsupported dtypes ", p, " / ", s);
    }
  }
}

}  // namespace

// train() of an fp32/fp64 parameter in one pass (see hf_gpa/optim/_gpa_switch.py, which holds it to its torch ops):
// y = bits(approx) + residual, approx = lerp(z, x, mu_y) computed by torch beforehand (torch's lerp has its own
// rounding), except at the listed elements (index, difference): bits(approx) + difference. Where x is bitwise the
// x eval() wrote, recomputed from y as z + (y - z) / mu_y (each operation rounded once, as torch's), x becomes y;
// elsewhere x was written in eval mode and wins: x becomes approx.
namespace {

template <typename scalar_t, typename int_t>
inline scalar_t from_bits(int_t bits) {
  scalar_t value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename scalar_t, typename int_t>
inline int_t to_bits(scalar_t value) {
  int_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// y from its bits, or approx where x was written since eval().
template <typename scalar_t, typename int_t>
inline scalar_t restored_y(scalar_t xi, scalar_t zi, scalar_t approx_i, int_t y_bits, scalar_t mu_y) {
  // Unsigned addition: wraps in two's complement like torch's integer add (signed overflow would be undefined).
  using uint_t = typename std::make_unsigned<int_t>::type;
  const scalar_t y = from_bits<scalar_t, int_t>(static_cast<int_t>(static_cast<uint_t>(y_bits)));
  const scalar_t x_again = (y - zi) / mu_y + zi;
  return to_bits<scalar_t, int_t>(x_again) == to_bits<scalar_t, int_t>(xi) ? y : approx_i;
}

template <typename scalar_t, typename int_t, typename residual_t>
void train_residual_tensor(at::Tensor& x_t, const at::Tensor& z_t, const at::Tensor& approx_t,
                           const at::Tensor& residual_t_, const at::Tensor& listed_t, double mu_y_d) {
  using uint_t = typename std::make_unsigned<int_t>::type;
  scalar_t* __restrict__ x = x_t.data_ptr<scalar_t>();
  const scalar_t* __restrict__ z = z_t.data_ptr<scalar_t>();
  const scalar_t* __restrict__ approx = approx_t.data_ptr<scalar_t>();
  const residual_t* __restrict__ residual = residual_t_.data_ptr<residual_t>();
  const scalar_t mu_y = static_cast<scalar_t>(mu_y_d);
  // The listed elements first, from the x they still hold; written back after the pass over all elements.
  const int64_t k = listed_t.size(0);
  const int64_t* listed = listed_t.data_ptr<int64_t>();
  std::vector<scalar_t> listed_values(k);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = listed[2 * j];
    const uint_t bits =
        static_cast<uint_t>(to_bits<scalar_t, int_t>(approx[i])) + static_cast<uint_t>(listed[2 * j + 1]);
    listed_values[j] = restored_y<scalar_t, int_t>(x[i], z[i], approx[i], static_cast<int_t>(bits), mu_y);
  }
  at::parallel_for(0, x_t.numel(), 16384, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const uint_t bits = static_cast<uint_t>(to_bits<scalar_t, int_t>(approx[i])) +
                          static_cast<uint_t>(static_cast<int_t>(residual[i]));
      x[i] = restored_y<scalar_t, int_t>(x[i], z[i], approx[i], static_cast<int_t>(bits), mu_y);
    }
  });
  for (int64_t j = 0; j < k; ++j) {
    x[listed[2 * j]] = listed_values[j];
  }
}

void gpa_train_residual(at::Tensor x, at::Tensor z, at::Tensor approx, at::Tensor residual, at::Tensor listed,
                        double mu_y) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && same_dense_layout(x, z) && same_dense_layout(x, approx) &&
                  same_dense_layout(x, residual),
              "gpa_train_residual: contiguous CPU tensors only (the list's indices are into the logical order)");
  TORCH_CHECK(z.scalar_type() == x.scalar_type() && approx.scalar_type() == x.scalar_type(),
              "gpa_train_residual: x, z and approx must share one dtype");
  TORCH_CHECK(listed.scalar_type() == at::kLong && listed.dim() == 2 && listed.size(1) == 2 && listed.is_contiguous(),
              "gpa_train_residual: the overflow list must be a contiguous (k, 2) int64 tensor");
  const auto p = x.scalar_type();
  const auto r = residual.scalar_type();
  if (p == at::kFloat && r == at::kChar) {
    train_residual_tensor<float, int32_t, int8_t>(x, z, approx, residual, listed, mu_y);
  } else if (p == at::kFloat && r == at::kInt) {
    train_residual_tensor<float, int32_t, int32_t>(x, z, approx, residual, listed, mu_y);
  } else if (p == at::kDouble && r == at::kChar) {
    train_residual_tensor<double, int64_t, int8_t>(x, z, approx, residual, listed, mu_y);
  } else if (p == at::kDouble && r == at::kLong) {
    train_residual_tensor<double, int64_t, int64_t>(x, z, approx, residual, listed, mu_y);
  } else {
    TORCH_CHECK(false, "gpa_train_residual: unsupported dtypes ", p, " / ", r);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("gpa_adamw_step", &gpa_adamw_step, "One fused GPA-AdamW step over lists of CPU tensors");
  module.def("gpa_adamw_step_compact", &gpa_adamw_step_compact,
             "One fused GPA-AdamW step over bf16 CPU tensors with 24-bit y and z (state_dtype='compact')");
  module.def("gpa_wrapper_pass", &gpa_wrapper_pass,
             "y <- scale (y - alpha z) (before) or y <- y + alpha z (after), through float32 copies of y if given");
  module.def("gpa_train_residual", &gpa_train_residual,
             "train() of an fp32/fp64 parameter: y from lerp(z, x, mu_y) and the residual, where x was not written");
}
