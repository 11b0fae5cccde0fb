// Attention for a few query tokens over a KV cache (decode steps and verify forwards) on x86 CPUs with
// AVX2 + FMA, built with the row-block kernel by dspark_hf/kernels/cpu_extension.py.
//
// PyTorch's CPU SDPA kernel is built for long sequences: for one query token over 256 cached tokens it
// spent 25-50 us per layer of SmolLM2 on an AMD EPYC (bf16: 140 us with grouped heads broadcast), most
// of it fixed cost, for about 0.3 M multiply-adds. Here each (batch, query head, query token) is one
// work item that scores the query against the keys it may see, takes a float32 softmax and sums the
// values; threads split the items.
//
// Each query token is computed alone, over keys 0 .. the last its mask allows, in the same order
// whatever else is in the call: a verify forward of several tokens gives each token the attention
// output of a one-token step on the same cache, bit for bit. Against SDPA the sums run in another
// order and exp is a polynomial (within 2 ulp), so results agree within rounding.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace dspark_cpu {
namespace {

#define DSPARK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DSPARK_INLINE inline __attribute__((always_inline))

// 8 elements widened to float32.
DSPARK_INLINE DSPARK_AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DSPARK_INLINE DSPARK_AVX2 __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
DSPARK_INLINE DSPARK_AVX2 __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DSPARK_INLINE DSPARK_AVX2 float sum8(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 twos = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(twos, _mm_movehdup_ps(twos)));
}

// exp(x) for x <= 0 (softmax after subtracting the maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 polynomial (relative error under 2 ulp); exp(-inf) and anything below -87.3 give 0.
DSPARK_INLINE DSPARK_AVX2 __m256 exp8(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.3f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

// q . k for one key: a multiply-add chain over the head dim in order, 8 features per step.
template <typename T>
DSPARK_INLINE DSPARK_AVX2 __m256 dot_lanes(const T* q, const T* k, int64_t D) {
  __m256 acc = _mm256_mul_ps(load8(q), load8(k));
  for (int64_t d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(load8(q + d), load8(k + d), acc);
  return acc;
}

// One work item: one query head of one token against keys 0 .. keys-1 of its key/value head; out gets
// [D] in float32. Four keys are scored at once (independent chains: one would wait on the FMA's latency),
// each key's score the same chain as when scored alone, so the result does not depend on `keys` beyond
// the keys themselves.
template <typename T>
DSPARK_AVX2 void attend(const T* q, const T* k, int64_t k_stride, const T* v, int64_t v_stride, const bool* allowed,
                        int64_t keys, int64_t D, float scale, float* scores, float* out) {
  constexpr float kMinus = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  for (; t + 4 <= keys; t += 4) {
    __m256 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_mul_ps(load8(q), load8(k + (t + j) * k_stride));
    for (int64_t d = 8; d < D; d += 8) {
      const __m256 qd = load8(q + d);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qd, load8(k + (t + j) * k_stride + d), acc[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) scores[t + j] = sum8(acc[j]) * scale;
  }
  for (; t < keys; ++t) scores[t] = sum8(dot_lanes(q, k + t * k_stride, D)) * scale;
  float top = kMinus;
  for (t = 0; t < keys; ++t) {
    if (allowed != nullptr && !allowed[t]) scores[t] = kMinus;
    top = std::max(top, scores[t]);
  }
  // Subtract, exponentiate and sum in 8-wide lanes fixed by t (the tail padded with exp(-inf) = 0).
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (t = 0; t + 8 <= keys; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), top8));
    _mm256_storeu_ps(scores + t, p);
    total = _mm256_add_ps(total, p);
  }
  if (t < keys) {
    alignas(32) float tail[8];
    for (int64_t i = 0; i < 8; ++i) tail[i] = t + i < keys ? scores[t + i] : kMinus;
    const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(tail), top8));
    _mm256_store_ps(tail, p);
    for (int64_t i = 0; t + i < keys; ++i) scores[t + i] = tail[i];
    total = _mm256_add_ps(total, p);
  }
  const float inverse = 1.0f / sum8(total);
  // out = sum_t p[t] v[t] * inverse: up to 64 features (8 independent chains) per pass over the keys.
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t chunks = std::min<int64_t>(8, (D - d0) / 8);
    __m256 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    if (chunks == 8) {
      for (t = 0; t < keys; ++t) {
        const __m256 p = _mm256_set1_ps(scores[t]);
        const T* vt = v + t * v_stride + d0;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vt + 8 * c), acc[c]);
      }
    } else {
      for (t = 0; t < keys; ++t) {
        const __m256 p = _mm256_set1_ps(scores[t]);
        const T* vt = v + t * v_stride + d0;
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vt + 8 * c), acc[c]);
      }
    }
    const __m256 inverse8 = _mm256_set1_ps(inverse);
    for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(acc[c], inverse8));
  }
}

template <typename T>
void run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
         const c10::optional<torch::Tensor>& mask, double scale, torch::Tensor& output) {
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t T_keys = key.size(2), group = H / key.size(1);
  const T* q = static_cast<const T*>(query.data_ptr());
  const T* k = static_cast<const T*>(key.data_ptr());
  const T* v = static_cast<const T*>(value.data_ptr());
  const bool* allowed = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mask_batch = mask.has_value() && mask->size(0) > 1 ? mask->stride(0) : 0;
  const int64_t mask_row = mask.has_value() ? mask->stride(2) : 0;
  T* out = static_cast<T*>(output.data_ptr());  // [B, L, H, D]
  // Work items: (batch, query head, token); the query heads of one key/value head are adjacent.
  at::parallel_for(0, B * H * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(T_keys + 8), sums(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * L), h = item / L % H, l = item % L;
      const bool* row_mask = allowed == nullptr ? nullptr : allowed + b * mask_batch + l * mask_row;
      int64_t keys = T_keys;  // up to the last key the token may see: the same range as its one-token step
      if (row_mask != nullptr) {
        while (keys > 0 && !row_mask[keys - 1]) --keys;
      }
      T* out_row = out + ((b * L + l) * H + h) * D;
      if (keys == 0) {  // a fully masked token (padding): zeros, as PyTorch's CPU flash kernel gives
        std::fill(out_row, out_row + D, static_cast<T>(0.0f));
        continue;
      }
      const int64_t kv = h / group;
      attend<T>(q + b * query.stride(0) + h * query.stride(1) + l * query.stride(2),
                k + b * key.stride(0) + kv * key.stride(1), key.stride(2),
                v + b * value.stride(0) + kv * value.stride(1), value.stride(2), row_mask, keys, D,
                static_cast<float>(scale), scores.data(), sums.data());
      for (int64_t i = 0; i < D; ++i) out_row[i] = static_cast<T>(sums[i]);
    }
  });
}

}  // namespace

// query [B, H, L, D], key/value [B, Hkv, T, D] (last dim contiguous, H a multiple of Hkv, D a multiple of
// 8), mask: None or bool [B or 1, 1, L, T] (True: may attend); returns [B, L, H, D] in query's dtype.
torch::Tensor few_query_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "few_query_attention: 4-d query, key, value");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == query.size(3),
              "key and value must be [B, Hkv, T, D] for a query [B, H, L, D]");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(query.size(3) % 8 == 0, "head dim must be a multiple of 8");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "head dim must be contiguous");
  TORCH_CHECK(query.size(2) <= key.size(2), "more query tokens than keys");
  TORCH_CHECK(mask.has_value() || query.size(2) == 1, "several query tokens need a mask (which keys each may see)");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 4 && mask->size(1) == 1 &&
                    (mask->size(0) == 1 || mask->size(0) == query.size(0)) && mask->size(2) == query.size(2) &&
                    mask->size(3) == key.size(2) && mask->stride(3) == 1,
                "mask must be bool [B or 1, 1, L, T] with contiguous keys");
  }
  torch::Tensor output = torch::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  switch (query.scalar_type()) {
    case torch::kFloat32: run<float>(query, key, value, mask, scale, output); break;
    case torch::kBFloat16: run<c10::BFloat16>(query, key, value, mask, scale, output); break;
    case torch::kHalf: run<c10::Half>(query, key, value, mask, scale, output); break;
    default: TORCH_CHECK(false, "few_query_attention: float32, bfloat16 or float16, got ", query.scalar_type());
  }
  return output;
}

}  // namespace dspark_cpu
