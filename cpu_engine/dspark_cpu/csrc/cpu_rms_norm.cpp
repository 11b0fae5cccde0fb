// transformers' RMSNorm in one call, with PyTorch's own roundings and summation order:
//   y = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps);  out = weight * y.to(x.dtype)
// PyTorch runs this as 7-9 ops, nearly all of the time dispatch, and one call here costs a fraction of
// them (benchmarks/op_costs.py; measured: docs/performance.md). The sum of squares is the only step whose
// result depends on an order: PyTorch's CPU sum of a contiguous row (aten/src/ATen/native/cpu/
// SumKernel.cpp, cascade_sum) adds vectors of `lanes` floats (its Vectorized<float> width: 8 under
// AVX2, 16 under AVX-512) in four interleaved accumulators with a cascade of partial sums every 16 or
// more vectors, then the four accumulators, then the leftover scalars and the lanes one by one. This
// file follows that order (the caller passes the lane width of the torch build's CPU capability), and
// cpu_engine/dspark_cpu/decoder.py checks the results against the model's own norms bit for bit before
// using it. Every other step is one correctly rounded IEEE operation (mean = sum / N, rsqrt = 1 / sqrt).

#include "cpu_kernels.h"
#include "cpu_vec_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace dspark_cpu {
namespace {

constexpr int kInterleave = 4;  // SumKernel.cpp's ilp_factor
constexpr int kLevels = 4;      // and its cascade's num_levels

int64_t ceil_log2(int64_t x) {  // c10's CeilLog2: 1 for x <= 2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v != 0; v >>= 1) ++bits;
  return bits;
}

// The sum of squares[0 .. n-1] in PyTorch's order for a contiguous row and vectors of Lanes floats
// (Lanes = 1 is its scalar path, taken when n is shorter than one vector).
template <int Lanes>
float cascade_sum(const float* squares, int64_t n) {
  float acc[kLevels][kInterleave][Lanes] = {};
  const int64_t vectors = n / Lanes, rows = vectors / kInterleave;
  auto add_vector = [&](float* into, int64_t index) {
    for (int l = 0; l < Lanes; ++l) into[l] += squares[index * Lanes + l];
  };
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kLevels), level_step = int64_t{1} << level_power;
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int k = 0; k < kInterleave; ++k) add_vector(acc[0][k], i * kInterleave + k);
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kInterleave; ++k) {
        for (int l = 0; l < Lanes; ++l) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.0f;
      }
      if ((i & ((level_step - 1) << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int k = 0; k < kInterleave; ++k) add_vector(acc[0][k], i * kInterleave + k);
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kInterleave; ++k) {
      for (int l = 0; l < Lanes; ++l) acc[0][k][l] += acc[j][k][l];
    }
  }
  for (int64_t v = rows * kInterleave; v < vectors; ++v) add_vector(acc[0][0], v);
  for (int k = 1; k < kInterleave; ++k) {
    for (int l = 0; l < Lanes; ++l) acc[0][0][l] += acc[0][k][l];
  }
  float total = 0.0f;
  for (int64_t e = vectors * Lanes; e < n; ++e) total += squares[e];
  for (int l = 0; l < Lanes; ++l) total += acc[0][0][l];
  return 0.0f + total;  // the sum is accumulated into a zero-filled output
}

float sum_of_squares(const float* squares, int64_t n, int lanes) {
  if (n < lanes) return cascade_sum<1>(squares, n);
  return lanes == 16 ? cascade_sum<16>(squares, n) : cascade_sum<8>(squares, n);
}

template <typename T>
DSPARK_AVX2 void norm_rows(const T* x, int64_t rows, int64_t n, const T* weight, float eps, int lanes, T* out) {
  std::vector<float> squares(n);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * n;
    T* out_row = out + r * n;
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
      const __m256 v = vec::load8(row + e);
      _mm256_storeu_ps(squares.data() + e, _mm256_mul_ps(v, v));
    }
    for (; e < n; ++e) squares[e] = static_cast<float>(row[e]) * static_cast<float>(row[e]);
    const float mean = sum_of_squares(squares.data(), n, lanes) / static_cast<float>(n);
    const float scale = 1.0f / std::sqrt(mean + eps);
    // y = x * scale rounded to T (the .to(x.dtype)), then weight * y rounded to T
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (e = 0; e + 8 <= n; e += 8) {
      const __m256 normed = vec::round_to(_mm256_mul_ps(vec::load8(row + e), scale8), row);
      vec::store8(out_row + e, _mm256_mul_ps(vec::load8(weight + e), normed));
    }
    for (; e < n; ++e) {
      const T normed = static_cast<T>(static_cast<float>(row[e]) * scale);
      out_row[e] = static_cast<T>(static_cast<float>(weight[e]) * static_cast<float>(normed));
    }
  }
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t lanes) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [x.size(-1)]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  TORCH_CHECK(lanes == 8 || lanes == 16, "rms_norm: lanes must be 8 or 16");
  const torch::Tensor input = x.contiguous();
  const torch::Tensor w = weight.contiguous();
  torch::Tensor out = torch::empty(input.sizes(), input.options());
  const int64_t n = input.size(-1), rows = n == 0 ? 0 : input.numel() / n;
  const float epsilon = static_cast<float>(eps);
  switch (input.scalar_type()) {
    case torch::kFloat32:
      norm_rows<float>(input.data_ptr<float>(), rows, n, w.data_ptr<float>(), epsilon, lanes, out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      norm_rows<c10::BFloat16>(input.data_ptr<c10::BFloat16>(), rows, n, w.data_ptr<c10::BFloat16>(), epsilon,
                               lanes, out.data_ptr<c10::BFloat16>());
      break;
    case torch::kHalf:
      norm_rows<c10::Half>(input.data_ptr<c10::Half>(), rows, n, w.data_ptr<c10::Half>(), epsilon, lanes,
                           out.data_ptr<c10::Half>());
      break;
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16, got ", input.scalar_type());
  }
  return out;
}

}  // namespace dspark_cpu
