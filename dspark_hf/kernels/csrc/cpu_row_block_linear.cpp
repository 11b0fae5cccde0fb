// A small-batch linear kernel for x86 CPUs with AVX2 + FMA (+ F16C), built by dspark_hf/kernels/cpu_gemm.py.
//
// Decoding runs 1 to ~16 input rows through every weight matrix once per step, so the step streams
// the weights from memory and should cost about the same for 1 row as for 8. The weight is stored in
// column blocks of 16 outputs, [N/16][K][16], in its own dtype (float32, bfloat16 or float16, widened
// to float32 in registers), and every block is read once for up to 12 input rows: up to 6 rows keep
// 2 x 6 accumulators for the whole block, 7 to 12 rows go over the block's two 8-column halves (the
// second half comes from cache). Threads split the column blocks.
//
// Every output is one float32 fused multiply-add chain over k = 0 .. K-1 in order, whatever the
// number of rows, so a row's result does not depend on the other rows of the batch: a verify
// forward of several tokens gives each token the same linear outputs as a forward of that token alone.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 16;

#define DSPARK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DSPARK_INLINE inline __attribute__((always_inline))

// Eight weights from p, widened to float32.
template <typename W> DSPARK_INLINE DSPARK_AVX2 __m256 load8(const W* p);
template <> DSPARK_INLINE DSPARK_AVX2 __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> DSPARK_INLINE DSPARK_AVX2 __m256 load8<uint16_t>(const uint16_t* p) {  // bfloat16: the high half of a float32
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
struct Half { uint16_t bits; };
template <> DSPARK_INLINE DSPARK_AVX2 __m256 load8<Half>(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DSPARK_INLINE DSPARK_AVX2 void store8(float* y, __m256 value, int64_t columns) {
  if (columns >= 8) {
    _mm256_storeu_ps(y, value);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, value);
  for (int64_t c = 0; c < columns; ++c) y[c] = lanes[c];
}

// R <= 6 rows x one whole 16-column block.
template <typename W, int R>
DSPARK_AVX2 void whole_block(const float* x, int64_t K, const W* block, float* y, int64_t ldy, int64_t columns) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0,
         a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w_low = load8<W>(block + k * kBlock);
    const __m256 w_high = load8<W>(block + k * kBlock + 8);
    __m256 xk;
#define DSPARK_ROW(i) if constexpr (R > i) { xk = _mm256_broadcast_ss(x + i * K + k); \
    a##i = _mm256_fmadd_ps(xk, w_low, a##i); b##i = _mm256_fmadd_ps(xk, w_high, b##i); }
    DSPARK_ROW(0) DSPARK_ROW(1) DSPARK_ROW(2) DSPARK_ROW(3) DSPARK_ROW(4) DSPARK_ROW(5)
#undef DSPARK_ROW
  }
#define DSPARK_OUT(i) if constexpr (R > i) { store8(y + i * ldy, a##i, columns); \
    if (columns > 8) store8(y + i * ldy + 8, b##i, columns - 8); }
  DSPARK_OUT(0) DSPARK_OUT(1) DSPARK_OUT(2) DSPARK_OUT(3) DSPARK_OUT(4) DSPARK_OUT(5)
#undef DSPARK_OUT
}

// 7 <= R <= 12 rows x one 16-column block, one 8-column half at a time (12 accumulators fit the 16 registers).
template <typename W, int R>
DSPARK_AVX2 void half_blocks(const float* x, int64_t K, const W* block, float* y, int64_t ldy, int64_t columns) {
  for (int64_t half = 0; half < 2 && half * 8 < columns; ++half) {
    const W* weights = block + half * 8;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0,
           c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    for (int64_t k = 0; k < K; ++k) {
      const __m256 w = load8<W>(weights + k * kBlock);
#define DSPARK_ROW(i) if constexpr (R > i) { c##i = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * K + k), w, c##i); }
      DSPARK_ROW(0) DSPARK_ROW(1) DSPARK_ROW(2) DSPARK_ROW(3) DSPARK_ROW(4) DSPARK_ROW(5)
      DSPARK_ROW(6) DSPARK_ROW(7) DSPARK_ROW(8) DSPARK_ROW(9) DSPARK_ROW(10) DSPARK_ROW(11)
#undef DSPARK_ROW
    }
    const int64_t half_columns = std::min<int64_t>(8, columns - half * 8);
#define DSPARK_OUT(i) if constexpr (R > i) { store8(y + i * ldy + half * 8, c##i, half_columns); }
    DSPARK_OUT(0) DSPARK_OUT(1) DSPARK_OUT(2) DSPARK_OUT(3) DSPARK_OUT(4) DSPARK_OUT(5)
    DSPARK_OUT(6) DSPARK_OUT(7) DSPARK_OUT(8) DSPARK_OUT(9) DSPARK_OUT(10) DSPARK_OUT(11)
#undef DSPARK_OUT
  }
}

template <typename W>
void rows_of_block(const float* x, int64_t rows, int64_t K, const W* block, float* y, int64_t N, int64_t columns) {
  using Kernel = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t);
  static constexpr Kernel kernels[13] = {
      nullptr, whole_block<W, 1>, whole_block<W, 2>, whole_block<W, 3>, whole_block<W, 4>, whole_block<W, 5>,
      whole_block<W, 6>, half_blocks<W, 7>, half_blocks<W, 8>, half_blocks<W, 9>, half_blocks<W, 10>,
      half_blocks<W, 11>, half_blocks<W, 12>};
  for (int64_t first = 0; first < rows; first += 12) {
    const int64_t count = std::min<int64_t>(12, rows - first);
    kernels[count](x + first * K, K, block, y + first * N, N, columns);
  }
}

template <typename W>
void run(const float* x, int64_t rows, int64_t K, const W* packed, int64_t N, float* y) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      rows_of_block<W>(x, rows, K, packed + b * K * kBlock, y + b * kBlock, N, std::min<int64_t>(kBlock, N - b * kBlock));
    }
  });
}

// input [..., K] of any float dtype; packed [N/16 (rounded up), K, 16]; returns [..., N] in input's dtype.
torch::Tensor row_block_linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && packed.device().is_cpu(), "row_block_linear runs on CPU tensors");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous(), "packed weight must be [blocks, K, 16]");
  const int64_t K = packed.size(1);
  TORCH_CHECK(input.size(-1) == K, "input has ", input.size(-1), " features, the weight ", K);
  TORCH_CHECK(packed.size(0) * kBlock >= out_features, "packed weight has fewer than out_features columns");
  const torch::Tensor x = input.reshape({-1, K}).to(torch::kFloat32).contiguous();
  const int64_t rows = x.size(0);
  torch::Tensor y = torch::empty({rows, out_features}, x.options());
  if (rows > 0) {
    switch (packed.scalar_type()) {
      case torch::kFloat32:
        run<float>(x.data_ptr<float>(), rows, K, packed.data_ptr<float>(), out_features, y.data_ptr<float>());
        break;
      case torch::kBFloat16:
        run<uint16_t>(x.data_ptr<float>(), rows, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                      out_features, y.data_ptr<float>());
        break;
      case torch::kHalf:
        run<Half>(x.data_ptr<float>(), rows, K, reinterpret_cast<const Half*>(packed.data_ptr()), out_features,
                  y.data_ptr<float>());
        break;
      default:
        TORCH_CHECK(false, "row_block_linear: packed weights must be float32, bfloat16 or float16, got ",
                    packed.scalar_type());
    }
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out_features;
  return y.view(sizes).to(input.scalar_type());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_block_linear", &row_block_linear, "x @ W.T + b with W packed in 16-column blocks (AVX2 + FMA)");
}
