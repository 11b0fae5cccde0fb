// The target attributes of the CPU kernels' AVX2 code, and 8-element AVX2 loads and stores they share: float32, bfloat16 and float16 rows widened
// to float32, and float32 rounded back the way PyTorch rounds (to nearest, ties to even).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

namespace dspark_cpu {
namespace vec {

#define DSPARK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DSPARK_INLINE inline __attribute__((always_inline))

DSPARK_INLINE DSPARK_AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DSPARK_INLINE DSPARK_AVX2 __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
DSPARK_INLINE DSPARK_AVX2 __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// float32 lanes rounded to bfloat16's 16 bits (c10's rounding: to nearest even; NaN to 0x7FC0).
DSPARK_INLINE DSPARK_AVX2 __m256i bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

DSPARK_INLINE DSPARK_AVX2 void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
DSPARK_INLINE DSPARK_AVX2 void store8(c10::BFloat16* p, __m256 x) {
  // 8 x 32-bit -> 8 x 16-bit: pack within 128-bit lanes, then gather the two lanes' halves
  const __m256i bits = bf16_bits(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
DSPARK_INLINE DSPARK_AVX2 void store8(c10::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x rounded to T's precision and widened back: what a PyTorch op computing in float32 stores in a T tensor.
DSPARK_INLINE DSPARK_AVX2 __m256 round_to(__m256 x, const float*) { return x; }
DSPARK_INLINE DSPARK_AVX2 __m256 round_to(__m256 x, const c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16));
}
DSPARK_INLINE DSPARK_AVX2 __m256 round_to(__m256 x, const c10::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace vec
}  // namespace dspark_cpu
