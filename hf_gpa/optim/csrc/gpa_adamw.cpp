// One GPA-AdamW step over a list of tensors in a single pass over memory (CPU).
//
// Per element, reading y, g, z, m, v once and writing y, z, m, v once (9 passes; AdamW itself needs 7):
//   m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2
//   z' <- (1 - lr wd) z - step_size m / (sqrt(v) / sqrt(bc2) + eps)        (step_size = lr / bc1)
//   y <- mu_x (y - (1 - mu_y) z) + (1 - mu_x mu_y) z'                     (= mu_x mu_y x + (1 - mu_x mu_y) z')
//   z <- z'
// y and g have the parameter's dtype; z, m, v the state dtype (float32 for bf16/fp16 parameters).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <vector>

namespace {

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay, mu_x, mu_y;
  bool maximize;
};

template <typename param_t, typename state_t>
void update_tensor(at::Tensor& y_t, const at::Tensor& g_t, at::Tensor& z_t, at::Tensor& m_t, at::Tensor& v_t,
                   const Hyper& h, double step_size, double bc2_sqrt) {
  param_t* __restrict__ y = y_t.data_ptr<param_t>();
  const param_t* __restrict__ g = g_t.data_ptr<param_t>();
  state_t* __restrict__ z = z_t.data_ptr<state_t>();
  state_t* __restrict__ m = m_t.data_ptr<state_t>();
  state_t* __restrict__ v = v_t.data_ptr<state_t>();
  const state_t one_minus_beta1 = static_cast<state_t>(1.0 - h.beta1);
  const state_t beta2 = static_cast<state_t>(h.beta2);
  const state_t one_minus_beta2 = static_cast<state_t>(1.0 - h.beta2);
  const state_t inv_bc2_sqrt = static_cast<state_t>(1.0 / bc2_sqrt);
  const state_t eps = static_cast<state_t>(h.eps);
  const state_t decay = static_cast<state_t>(1.0 - h.lr * h.weight_decay);
  const state_t neg_step_size = static_cast<state_t>(-step_size);
  const state_t mu_x = static_cast<state_t>(h.mu_x);
  const state_t one_minus_mu_y = static_cast<state_t>(1.0 - h.mu_y);
  const state_t c = static_cast<state_t>(1.0 - h.mu_x * h.mu_y);
  const state_t sign = h.maximize ? state_t(-1) : state_t(1);
  at::parallel_for(0, y_t.numel(), 16384, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const state_t gi = sign * static_cast<state_t>(g[i]);
      const state_t mi = m[i] + one_minus_beta1 * (gi - m[i]);
      const state_t vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
      const state_t zi = z[i];
      const state_t zn = decay * zi + neg_step_size * mi / (std::sqrt(vi) * inv_bc2_sqrt + eps);
      const state_t yi = static_cast<state_t>(y[i]);
      y[i] = static_cast<param_t>(mu_x * (yi - one_minus_mu_y * zi) + c * zn);
      z[i] = zn;
      m[i] = mi;
      v[i] = vi;
    }
  });
}

void gpa_adamw_step(std::vector<at::Tensor> ys, std::vector<at::Tensor> gs, std::vector<at::Tensor> zs,
                    std::vector<at::Tensor> ms, std::vector<at::Tensor> vs, std::vector<double> step_sizes,
                    std::vector<double> bc2_sqrts, double lr, double beta1, double beta2, double eps,
                    double weight_decay, double mu_x, double mu_y, bool maximize) {
  const Hyper h{lr, beta1, beta2, eps, weight_decay, mu_x, mu_y, maximize};
  const size_t n = ys.size();
  TORCH_CHECK(gs.size() == n && zs.size() == n && ms.size() == n && vs.size() == n && step_sizes.size() == n &&
                  bc2_sqrts.size() == n,
              "gpa_adamw_step: all lists must have the same length");
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& y = ys[i];
    TORCH_CHECK(y.device().is_cpu(), "gpa_adamw_step: CPU tensors only");
    TORCH_CHECK(y.is_contiguous() && gs[i].is_contiguous() && zs[i].is_contiguous() && ms[i].is_contiguous() &&
                    vs[i].is_contiguous(),
                "gpa_adamw_step: contiguous tensors only");
    TORCH_CHECK(gs[i].scalar_type() == y.scalar_type(), "gpa_adamw_step: grad dtype must match the parameter");
    TORCH_CHECK(zs[i].numel() == y.numel() && gs[i].numel() == y.numel() && ms[i].numel() == y.numel() &&
                    vs[i].numel() == y.numel(),
                "gpa_adamw_step: sizes differ");
    const auto p = y.scalar_type();
    const auto s = zs[i].scalar_type();
    TORCH_CHECK(ms[i].scalar_type() == s && vs[i].scalar_type() == s, "gpa_adamw_step: state dtypes differ");
    if (p == at::kFloat && s == at::kFloat) {
      update_tensor<float, float>(y, gs[i], zs[i], ms[i], vs[i], h, step_sizes[i], bc2_sqrts[i]);
    } else if (p == at::kDouble && s == at::kDouble) {
      update_tensor<double, double>(y, gs[i], zs[i], ms[i], vs[i], h, step_sizes[i], bc2_sqrts[i]);
    } else if (p == at::kBFloat16 && s == at::kFloat) {
      update_tensor<c10::BFloat16, float>(y, gs[i], zs[i], ms[i], vs[i], h, step_sizes[i], bc2_sqrts[i]);
    } else if (p == at::kHalf && s == at::kFloat) {
      update_tensor<c10::Half, float>(y, gs[i], zs[i], ms[i], vs[i], h, step_sizes[i], bc2_sqrts[i]);
    } else {
      TORCH_CHECK(false, "gpa_adamw_step: unsupported dtypes ", p, " / ", s);
    }
  }
}

// The two passes the generic GPA wrapper adds around its base optimizer's step, each one read-modify-write of y
// with one read of z:  before: y <- scale (y - alpha z);  after: y <- y + c z.
template <typename param_t, typename state_t>
void axpby_tensor(at::Tensor& y_t, const at::Tensor& z_t, double alpha_d, double scale_d, bool before) {
  param_t* __restrict__ y = y_t.data_ptr<param_t>();
  const state_t* __restrict__ z = z_t.data_ptr<state_t>();
  const state_t alpha = static_cast<state_t>(alpha_d);
  const state_t scale = static_cast<state_t>(scale_d);
  at::parallel_for(0, y_t.numel(), 16384, [&](int64_t begin, int64_t end) {
    if (before) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        y[i] = static_cast<param_t>(scale * (static_cast<state_t>(y[i]) - alpha * z[i]));
      }
    } else {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        y[i] = static_cast<param_t>(static_cast<state_t>(y[i]) + alpha * z[i]);
      }
    }
  });
}

void gpa_wrapper_pass(std::vector<at::Tensor> ys, std::vector<at::Tensor> zs, double alpha, double scale,
                      bool before) {
  TORCH_CHECK(ys.size() == zs.size(), "gpa_wrapper_pass: lists differ in length");
  for (size_t i = 0; i < ys.size(); ++i) {
    at::Tensor& y = ys[i];
    TORCH_CHECK(y.device().is_cpu() && y.is_contiguous() && zs[i].is_contiguous() && zs[i].numel() == y.numel(),
                "gpa_wrapper_pass: contiguous CPU tensors of equal size only");
    const auto p = y.scalar_type();
    const auto s = zs[i].scalar_type();
    if (p == at::kFloat && s == at::kFloat) {
      axpby_tensor<float, float>(y, zs[i], alpha, scale, before);
    } else if (p == at::kDouble && s == at::kDouble) {
      axpby_tensor<double, double>(y, zs[i], alpha, scale, before);
    } else if (p == at::kBFloat16 && s == at::kFloat) {
      axpby_tensor<c10::BFloat16, float>(y, zs[i], alpha, scale, before);
    } else if (p == at::kHalf && s == at::kFloat) {
      axpby_tensor<c10::Half, float>(y, zs[i], alpha, scale, before);
    } else {
      TORCH_CHECK(false, "gpa_wrapper_pass: unsupported dtypes ", p, " / ", s);
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("gpa_adamw_step", &gpa_adamw_step, "One fused GPA-AdamW step over lists of CPU tensors");
  module.def("gpa_wrapper_pass", &gpa_wrapper_pass, "y <- scale (y - alpha z) (before) or y <- y + alpha z (after)");
}
