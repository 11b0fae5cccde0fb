// Rotary position embedding of a step's queries and keys in one call, with the lean decoder's arithmetic
// (cpu_engine/dspark_cpu/decoder.py): x * cos + roll(x, D/2) * signed_sin, where signed_sin is sin with
// its first half negated (rotate_half(x) * sin, bit for bit). Each product and the sum are rounded to
// x's dtype as PyTorch's separate ops round them (the extension is built with -ffp-contract=off, so no
// product is fused into the add), so the results equal the PyTorch expression bit for bit, in one call
// that costs a fraction of those ops' dispatch (benchmarks/op_costs.py; measured: docs/performance.md).

#include "cpu_kernels.h"
#include "cpu_vec_avx2.h"

#include <ATen/Parallel.h>

#include <cstdint>

namespace dspark_cpu {
namespace {

using vec::load8;
using vec::round_to;
using vec::store8;

// One row of D features: out[d] = r(r(x[d] c[d]) + r(x[d +- D/2] s[d])), r rounding to T.
template <typename T>
DSPARK_AVX2 void rotate_row(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 8) {
    const __m256 low = load8(x + d), high = load8(x + half + d);
    const __m256 low_cos = round_to(_mm256_mul_ps(low, load8(cos + d)), x);
    const __m256 high_sin = round_to(_mm256_mul_ps(high, load8(sin + d)), x);
    store8(out + d, _mm256_add_ps(low_cos, high_sin));
    const __m256 high_cos = round_to(_mm256_mul_ps(high, load8(cos + half + d)), x);
    const __m256 low_sin = round_to(_mm256_mul_ps(low, load8(sin + half + d)), x);
    store8(out + half + d, _mm256_add_ps(high_cos, low_sin));
  }
}

// x [B, H, L, D] (any strides, D contiguous) -> a new contiguous [B, H, L, D]; cos/sin [B or 1, L, D].
template <typename T>
void rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  const int64_t cos_batch = cos.size(0) > 1 ? cos.stride(0) : 0, sin_batch = sin.size(0) > 1 ? sin.stride(0) : 0;
  const T* xs = static_cast<const T*>(x.data_ptr());
  const T* cs = static_cast<const T*>(cos.data_ptr());
  const T* ss = static_cast<const T*>(sin.data_ptr());
  T* os = static_cast<T*>(out.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t l = 0; l < L; ++l) {
        rotate_row<T>(xs + b * x.stride(0) + h * x.stride(1) + l * x.stride(2),
                      cs + b * cos_batch + l * cos.stride(1), ss + b * sin_batch + l * sin.stride(1), D,
                      os + ((b * H + h) * L + l) * D);
      }
    }
  }
}

void check(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu(), "rotary_embedding: a 4-d CPU tensor [B, H, L, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos and sin must have the dtype of the query and key");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && (cos.size(0) == 1 || cos.size(0) == x.size(0)) &&
                  cos.size(1) == x.size(2) && cos.size(2) == x.size(3),
              "rotary_embedding: cos and sin must be [B or 1, L, D]");
  TORCH_CHECK(x.size(3) % 16 == 0, "rotary_embedding: the head dim must be a multiple of 16");
  TORCH_CHECK(x.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1, "rotary_embedding: D must be contiguous");
}

torch::Tensor rotate_any(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check(x, cos, sin);
  torch::Tensor out = torch::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case torch::kFloat32: rotate<float>(x, cos, sin, out); break;
    case torch::kBFloat16: rotate<c10::BFloat16>(x, cos, sin, out); break;
    case torch::kHalf: rotate<c10::Half>(x, cos, sin, out); break;
    default: TORCH_CHECK(false, "rotary_embedding: float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rotary_embedding(const torch::Tensor& query, const torch::Tensor& key,
                                                          const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  return {rotate_any(query, cos, signed_sin), rotate_any(key, cos, signed_sin)};
}

}  // namespace dspark_cpu
