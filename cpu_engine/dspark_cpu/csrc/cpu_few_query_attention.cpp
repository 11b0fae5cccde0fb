// Attention for a few query tokens over a KV cache (decode steps and verify forwards) on x86 CPUs with
// AVX2 + FMA, built with the row-block kernel by cpu_engine/dspark_cpu/extension.py.
//
// PyTorch's CPU SDPA kernel is built for long sequences: for one query token over 256 cached tokens
// most of its time per layer of SmolLM2 is fixed cost, for about 0.3 M multiply-adds. Here the queries
// that share a key/value head (its query heads times the tokens) are taken in blocks of up to three:
// each key and value row is loaded once per block and feeds all its queries, the softmax is float32,
// and threads split the blocks, which made verify forwards cheaper than one query at a time
// (measured: docs/performance.md).
//
// Each query token is computed alone, over keys 0 .. the last its mask allows, in the same order
// whatever else is in the call or its block: a verify forward of several tokens gives each token the
// attention output of a one-token step on the same cache, bit for bit, whatever the thread count. Against
// SDPA the sums run in another order and exp is a polynomial (within 2 ulp), so results agree within
// rounding.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_vec_avx2.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace dspark_cpu {
namespace {

using vec::load8;

DSPARK_INLINE DSPARK_AVX2 float sum8(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 twos = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(twos, _mm_movehdup_ps(twos)));
}

// exp(x) for x <= 0 (softmax after subtracting the maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 polynomial (relative error under 2 ulp); exp(-inf) and anything below -87.3 give 0, NaN NaN.
DSPARK_INLINE DSPARK_AVX2 __m256 exp8(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.3f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  x = _mm256_max_ps(floor_x, x);  // (the second operand when either is NaN: NaN stays NaN)
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

// Four dot products' lanes added up: lane j of acc[i] holds the sum of features j, j + 8, ... of key i;
// each key's score is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whatever the other three hold.
DSPARK_INLINE DSPARK_AVX2 __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// scores[i][t] = scale * (q_i . k_t) for NQ queries (float32 rows of q_row_stride) and keys 0 .. keys-1.
// Each key is loaded once for all NQ queries; every dot product is the same chain (8 lanes over the head
// dim, features in order, then reduce4's tree) whichever queries and keys share its tile, so a query's
// scores do not depend on its block.
template <int NQ, typename T>
DSPARK_AVX2 void score_block(const float* q, int64_t D, const T* k, int64_t k_stride, int64_t keys, float scale,
                             float* const* scores) {
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t t = 0; t < keys; t += 4) {
    const int live = static_cast<int>(std::min<int64_t>(4, keys - t));  // 1-3 at the end: the rest stay zero
    const T* kt = k + t * k_stride;
    __m256 acc[NQ][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
#pragma GCC unroll 3
      for (int i = 0; i < NQ; ++i) acc[i][j] = _mm256_setzero_ps();
    }
    if (live == 4) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 kd = load8(kt + j * k_stride);
#pragma GCC unroll 3
        for (int i = 0; i < NQ; ++i) acc[i][j] = _mm256_mul_ps(_mm256_loadu_ps(q + i * D), kd);
      }
      for (int64_t d = 8; d < D; d += 8) {
        __m256 qd[NQ];
#pragma GCC unroll 3
        for (int i = 0; i < NQ; ++i) qd[i] = _mm256_loadu_ps(q + i * D + d);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256 kd = load8(kt + j * k_stride + d);
#pragma GCC unroll 3
          for (int i = 0; i < NQ; ++i) acc[i][j] = _mm256_fmadd_ps(qd[i], kd, acc[i][j]);
        }
      }
    } else {
      for (int j = 0; j < live; ++j) {
        for (int i = 0; i < NQ; ++i) acc[i][j] = _mm256_mul_ps(_mm256_loadu_ps(q + i * D), load8(kt + j * k_stride));
        for (int64_t d = 8; d < D; d += 8) {
          const __m256 kd = load8(kt + j * k_stride + d);
          for (int i = 0; i < NQ; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), kd, acc[i][j]);
        }
      }
    }
#pragma GCC unroll 3
    for (int i = 0; i < NQ; ++i) {
      const __m128 four = _mm_mul_ps(reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), scale4);
      if (live == 4) {
        _mm_storeu_ps(scores[i] + t, four);
      } else {
        alignas(16) float tail[4];
        _mm_store_ps(tail, four);
        for (int j = 0; j < live; ++j) scores[i][t + j] = tail[j];
      }
    }
  }
}

// Masks keys the row may not see, exponentiates scores[0 .. keys-1] in place (after subtracting their
// maximum) and returns 1 / their sum; lanes are fixed by t (the tail padded with exp(-inf) = 0). A NaN
// score makes the sum NaN, so the row comes out NaN, as SDPA's does.
DSPARK_AVX2 float softmax_in_place(float* scores, const bool* allowed, int64_t keys) {
  constexpr float kMinus = -std::numeric_limits<float>::infinity();
  const __m256 minus8 = _mm256_set1_ps(kMinus);
  __m256 tops = minus8;
  int64_t t = 0;
  for (; t + 8 <= keys; t += 8) {
    __m256 s = _mm256_loadu_ps(scores + t);
    if (allowed != nullptr) {
      const __m256i flags = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(allowed + t)));
      s = _mm256_blendv_ps(s, minus8, _mm256_castsi256_ps(_mm256_cmpeq_epi32(flags, _mm256_setzero_si256())));
      _mm256_storeu_ps(scores + t, s);
    }
    tops = _mm256_max_ps(tops, s);
  }
  alignas(32) float lane_tops[8];
  _mm256_store_ps(lane_tops, tops);
  float top = kMinus;
  for (int i = 0; i < 8; ++i) top = std::max(top, lane_tops[i]);
  for (; t < keys; ++t) {
    if (allowed != nullptr && !allowed[t]) scores[t] = kMinus;
    top = std::max(top, scores[t]);
  }
  t = 0;
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (; t + 8 <= keys; t += 8) {
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
  return 1.0f / sum8(total);
}

// out[i] = inverse[i] * sum_t probs[i][t] v[t] over t < keys[i], in float32. Each value row is loaded
// once for all queries still summing; each output feature is one chain over t in order from zero,
// whatever the block, so the result is the query's own.
template <int NQ, typename T>
DSPARK_AVX2 void sum_values(const T* v, int64_t v_stride, int64_t D, const float* const* probs, const int64_t* keys,
                            const float* inverse, float* const* out) {
  int64_t shared = keys[0];
  for (int i = 1; i < NQ; ++i) shared = std::min(shared, keys[i]);
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int64_t chunks = std::min<int64_t>(4, (D - d0) / 8);
    __m256 acc[NQ][4];
#pragma GCC unroll 3
    for (int i = 0; i < NQ; ++i) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm256_setzero_ps();
    }
    if (chunks == 4) {
      for (int64_t t = 0; t < shared; ++t) {
        const T* vt = v + t * v_stride + d0;
        __m256 p[NQ];
#pragma GCC unroll 3
        for (int i = 0; i < NQ; ++i) p[i] = _mm256_set1_ps(probs[i][t]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256 vc = load8(vt + 8 * c);
#pragma GCC unroll 3
          for (int i = 0; i < NQ; ++i) acc[i][c] = _mm256_fmadd_ps(p[i], vc, acc[i][c]);
        }
      }
    } else {
      for (int64_t t = 0; t < shared; ++t) {
        const T* vt = v + t * v_stride + d0;
        for (int64_t c = 0; c < chunks; ++c) {
          const __m256 vc = load8(vt + 8 * c);
          for (int i = 0; i < NQ; ++i) acc[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(probs[i][t]), vc, acc[i][c]);
        }
      }
    }
    for (int i = 0; i < NQ; ++i) {  // the keys only some queries see (the last tokens of a verify)
      for (int64_t t = shared; t < keys[i]; ++t) {
        const __m256 p = _mm256_set1_ps(probs[i][t]);
        const T* vt = v + t * v_stride + d0;
        for (int64_t c = 0; c < chunks; ++c) acc[i][c] = _mm256_fmadd_ps(p, load8(vt + 8 * c), acc[i][c]);
      }
      const __m256 inverse8 = _mm256_set1_ps(inverse[i]);
      for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out[i] + d0 + 8 * c, _mm256_mul_ps(acc[i][c], inverse8));
    }
  }
}

constexpr int kMaxBlock = 3;  // queries per block: 3 x 4 accumulators fill the 16 AVX2 registers

// Queries per block: the largest of 1 .. kMaxBlock whose busiest thread gets no more queries than with
// smaller blocks (blocks of one key/value head are split among threads in contiguous runs, as
// at::parallel_for does). The result never depends on it.
int64_t block_size(int64_t heads, int64_t per_head, int64_t threads) {
  int64_t best = 1, best_load = std::numeric_limits<int64_t>::max();
  for (int64_t size = 1; size <= kMaxBlock; ++size) {
    const int64_t blocks = (per_head + size - 1) / size, units = heads * blocks;
    const int64_t parts = std::max<int64_t>(1, std::min(threads, units));
    const int64_t run = (units + parts - 1) / parts;
    int64_t load = 0;
    for (int64_t first = 0; first < units; first += run) {
      int64_t queries = 0;
      for (int64_t unit = first; unit < std::min(units, first + run); ++unit)
        queries += std::min(size, per_head - unit % blocks * size);
      load = std::max(load, queries);
    }
    if (load <= best_load) best = size, best_load = load;
  }
  return best;
}

template <int NQ, typename T>
DSPARK_AVX2 void attend_block(const float* q, int64_t D, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                              const bool* const* masks, const int64_t* keys, float scale, float* const* scores,
                              float* const* sums) {
  int64_t most = keys[0];
  for (int i = 1; i < NQ; ++i) most = std::max(most, keys[i]);
  score_block<NQ, T>(q, D, k, k_stride, most, scale, scores);
  float inverse[NQ];
  for (int i = 0; i < NQ; ++i) inverse[i] = softmax_in_place(scores[i], masks[i], keys[i]);
  sum_values<NQ, T>(v, v_stride, D, scores, keys, inverse, sums);
}

// out[0 .. D-1] = row rounded to T (c10's rounding: to nearest even).
template <typename T>
DSPARK_AVX2 void store_row(const float* row, int64_t D, T* out) {
  for (int64_t d = 0; d < D; d += 8) vec::store8(out + d, _mm256_loadu_ps(row + d));
}

// rows [T, D] (row stride `stride`) widened to float32 into out [T, D].
template <typename T>
DSPARK_AVX2 void widen_rows(const T* rows, int64_t stride, int64_t T_rows, int64_t D, float* out) {
  for (int64_t t = 0; t < T_rows; ++t) {
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + t * D + d, load8(rows + t * stride + d));
  }
}

template <typename T>
void attend_live(int live, const float* q, int64_t D, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                 const bool* const* masks, const int64_t* keys, float scale, float* const* scores, float* const* sums) {
  switch (live) {
    case 0: break;
    case 1: attend_block<1, T>(q, D, k, k_stride, v, v_stride, masks, keys, scale, scores, sums); break;
    case 2: attend_block<2, T>(q, D, k, k_stride, v, v_stride, masks, keys, scale, scores, sums); break;
    default: attend_block<3, T>(q, D, k, k_stride, v, v_stride, masks, keys, scale, scores, sums); break;
  }
}

template <typename T>
void run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
         const c10::optional<torch::Tensor>& mask, double scale, torch::Tensor& output) {
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t T_keys = key.size(2), kv_heads = key.size(1), group = H / kv_heads;
  const T* q = static_cast<const T*>(query.data_ptr());
  const T* k = static_cast<const T*>(key.data_ptr());
  const T* v = static_cast<const T*>(value.data_ptr());
  const bool* allowed = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mask_batch = mask.has_value() && mask->size(0) > 1 ? mask->stride(0) : 0;
  const int64_t mask_row = mask.has_value() ? mask->stride(2) : 0;
  T* out = static_cast<T*>(output.data_ptr());  // [B, L, H, D]
  // A key/value head serves group * L queries (its query heads times the tokens), taken in blocks.
  const int64_t per_head = group * L;
  const int64_t block = block_size(B * kv_heads, per_head, at::get_num_threads());
  const int64_t blocks = (per_head + block - 1) / block;
  at::parallel_for(0, B * kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_rows(kMaxBlock * D), score_rows(kMaxBlock * (T_keys + 8)), sum_rows(kMaxBlock * D);
    // bfloat16 / float16 keys and values widened once per head for the thread's blocks of it (exact, so the
    // numbers are those of widening them on the fly, as a head with few queries here does); the buffers
    // live on with the thread because fresh 100 KB allocations every call cost page faults.
    thread_local std::vector<float> wide_keys, wide_values;
    int64_t widened = -1;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (kv_heads * blocks), kv = unit / blocks % kv_heads;
      const int64_t first = unit % blocks * block, count = std::min(block, per_head - first);
      T* out_rows[kMaxBlock];
      const bool* masks[kMaxBlock];
      int64_t keys[kMaxBlock];
      float* scores[kMaxBlock];
      float* sums[kMaxBlock];
      int live = 0;  // the block's queries that see at least one key, packed to the front
      for (int64_t n = 0; n < count; ++n) {
        const int64_t h = kv * group + (first + n) / L, l = (first + n) % L;
        const bool* row_mask = allowed == nullptr ? nullptr : allowed + b * mask_batch + l * mask_row;
        int64_t seen = T_keys;  // up to the last key the token may see: the same range as its one-token step
        if (row_mask != nullptr) {
          while (seen > 0 && !row_mask[seen - 1]) --seen;
        }
        T* out_row = out + ((b * L + l) * H + h) * D;
        if (seen == 0) {  // a fully masked token (padding): zeros, as PyTorch's CPU flash kernel gives
          std::fill(out_row, out_row + D, static_cast<T>(0.0f));
          continue;
        }
        const T* q_row = q + b * query.stride(0) + h * query.stride(1) + l * query.stride(2);
        for (int64_t d = 0; d < D; ++d) q_rows[live * D + d] = static_cast<float>(q_row[d]);
        out_rows[live] = out_row, masks[live] = row_mask, keys[live] = seen;
        scores[live] = score_rows.data() + live * (T_keys + 8), sums[live] = sum_rows.data() + live * D;
        ++live;
      }
      const T* k_head = k + b * key.stride(0) + kv * key.stride(1);
      const T* v_head = v + b * value.stride(0) + kv * value.stride(1);
      const float s = static_cast<float>(scale);
      const int64_t head = unit / blocks;
      // Widening a head pays from about four queries on (measured: three one-token queries ran slower so).
      const int64_t head_end = std::min(end, (head + 1) * blocks);  // this thread's last block of the head, + 1
      const int64_t queries_left = std::min(per_head, (head_end - head * blocks) * block) - first;
      if (!std::is_same<T, float>::value && (widened == head || queries_left >= 4)) {
        if (widened != head) {
          if (wide_keys.size() < static_cast<size_t>(T_keys * D)) {
            wide_keys.resize(T_keys * D), wide_values.resize(T_keys * D);
          }
          widen_rows<T>(k_head, key.stride(2), T_keys, D, wide_keys.data());
          widen_rows<T>(v_head, value.stride(2), T_keys, D, wide_values.data());
          widened = head;
        }
        attend_live<float>(live, q_rows.data(), D, wide_keys.data(), D, wide_values.data(), D, masks, keys, s, scores, sums);
      } else {
        attend_live<T>(live, q_rows.data(), D, k_head, key.stride(2), v_head, value.stride(2), masks, keys, s, scores, sums);
      }
      for (int n = 0; n < live; ++n) store_row(sums[n], D, out_rows[n]);
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
