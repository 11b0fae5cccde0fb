// A small-batch linear kernel for x86 CPUs with AVX2 + FMA (+ F16C), built by dspark_hf/kernels/cpu_row_block.py.
//
// Decoding runs 1 to ~16 input rows through every weight matrix once per step, so the step streams
// the weights from memory and should cost about the same for 1 row as for 8. The weight is stored in
// column blocks of 16 outputs, [N/16][K][16], in its own dtype (float32, bfloat16 or float16, widened
// to float32 in registers). bfloat16 blocks hold each k's 16 columns interleaved (0, 8, 1, 9, ... 7, 15),
// so one 32-byte load widens with a shift (columns 0-7) and a mask (columns 8-15): 3 instructions
// for 16 weights instead of 6. A group of up to 6 rows keeps 2 x 6 accumulators in registers; more rows
// take turns on each short k-span of the block while it sits in L1, so every weight is read from
// memory once per call at an even pace. Threads split the column blocks.
//
// With several rows the FMAs take long enough that the hardware prefetcher alone leaves the memory
// idle part of the time (8 rows of SmolLM2's fp32 linears: 24.8 ms against 17.0 ms for one row on a
// Zen 3 EPYC; benchmarks/row_block_rows.py); an explicit prefetch kPrefetchBytes ahead keeps it
// streaming (20.1 ms). One row of float32 weights runs without it (it made that case slower).
//
// Every output is one float32 fused multiply-add chain over k = 0 .. K-1 in order, whatever the
// number of rows, so a row's result does not depend on the other rows of the batch: a verify
// forward of several tokens gives each token the same linear outputs as a forward of that token alone.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kSpan = 32;
constexpr int64_t kPrefetchBytes = 2048;
// The fewest rows that prefetch, per weight size: float32 from 2 rows; 16-bit weights from 1 (one row of
// bfloat16 ran about 9% faster with it, float32 about 6% slower).
template <typename W> constexpr int64_t kPrefetchFromRows = sizeof(W) == 4 ? 2 : 1;

#define DSPARK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DSPARK_INLINE inline __attribute__((always_inline))

// One k's 16 weights from p, widened to float32: columns 0-7 in low, 8-15 in high.
template <typename W> DSPARK_INLINE DSPARK_AVX2 void load16(const W* p, __m256& low, __m256& high);
template <> DSPARK_INLINE DSPARK_AVX2 void load16<float>(const float* p, __m256& low, __m256& high) {
  low = _mm256_loadu_ps(p);
  high = _mm256_loadu_ps(p + 8);
}
// bfloat16, interleaved: 32-bit word j holds column j in its low half and column 8 + j in its high half, and a
// bfloat16 is the high half of a float32.
template <> DSPARK_INLINE DSPARK_AVX2 void load16<uint16_t>(const uint16_t* p, __m256& low, __m256& high) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  low = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  high = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
struct Half { uint16_t bits; };
template <> DSPARK_INLINE DSPARK_AVX2 void load16<Half>(const Half* p, __m256& low, __m256& high) {
  low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// R <= 6 rows x one 16-column block over k in [k_begin, k_end): the 2 x R accumulators start from and
// return to acc[R][16], so a block can be walked in k-spans without changing any output's FMA chain.
// Prefetch: fetch the weights kPrefetchBytes ahead, once per 64-byte line.
template <typename W, int R, bool Prefetch>
DSPARK_AVX2 void block_span(const float* x, int64_t K, const W* block, int64_t k_begin, int64_t k_end, float* acc) {
  __m256 a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5;
#define DSPARK_IN(i) if constexpr (R > i) { a##i = _mm256_loadu_ps(acc + i * kBlock); b##i = _mm256_loadu_ps(acc + i * kBlock + 8); }
  DSPARK_IN(0) DSPARK_IN(1) DSPARK_IN(2) DSPARK_IN(3) DSPARK_IN(4) DSPARK_IN(5)
#undef DSPARK_IN
  for (int64_t k = k_begin; k < k_end; ++k) {
    if constexpr (Prefetch) {
      if (sizeof(W) == 4 || (k & 1) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(block + k * kBlock) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m256 w_low, w_high, xk;
    load16<W>(block + k * kBlock, w_low, w_high);
#define DSPARK_ROW(i) if constexpr (R > i) { xk = _mm256_broadcast_ss(x + i * K + k); \
    a##i = _mm256_fmadd_ps(xk, w_low, a##i); b##i = _mm256_fmadd_ps(xk, w_high, b##i); }
    DSPARK_ROW(0) DSPARK_ROW(1) DSPARK_ROW(2) DSPARK_ROW(3) DSPARK_ROW(4) DSPARK_ROW(5)
#undef DSPARK_ROW
  }
#define DSPARK_OUT(i) if constexpr (R > i) { _mm256_storeu_ps(acc + i * kBlock, a##i); _mm256_storeu_ps(acc + i * kBlock + 8, b##i); }
  DSPARK_OUT(0) DSPARK_OUT(1) DSPARK_OUT(2) DSPARK_OUT(3) DSPARK_OUT(4) DSPARK_OUT(5)
#undef DSPARK_OUT
}

// All rows x one block. Rows go in groups of at most 6, of balanced size (8 rows: 4 + 4). With more
// than one group the block is walked in spans of kSpan k-steps and every group takes its turn on a span
// while it is in L1, so the weights stream from memory at an even pace as the rows are computed.
template <typename W>
void rows_of_block(const float* x, int64_t rows, int64_t K, const W* block, float* y, int64_t N, int64_t columns,
                   float* acc) {
  using Kernel = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*);
  static constexpr Kernel streaming[7] = {nullptr, block_span<W, 1, false>, block_span<W, 2, false>,
                                          block_span<W, 3, false>, block_span<W, 4, false>, block_span<W, 5, false>,
                                          block_span<W, 6, false>};
  static constexpr Kernel prefetching[7] = {nullptr, block_span<W, 1, true>, block_span<W, 2, true>,
                                            block_span<W, 3, true>, block_span<W, 4, true>, block_span<W, 5, true>,
                                            block_span<W, 6, true>};
  const Kernel* kernels = rows >= kPrefetchFromRows<W> ? prefetching : streaming;
  std::fill(acc, acc + rows * kBlock, 0.0f);
  const int64_t groups = (rows + 5) / 6;
  const int64_t span = groups == 1 ? K : kSpan;
  for (int64_t k = 0; k < K; k += span) {
    const int64_t k_end = std::min<int64_t>(K, k + span);
    for (int64_t group = 0, first = 0; group < groups; ++group) {
      const int64_t count = (rows - first) / (groups - group);
      kernels[count](x + first * K, K, block, k, k_end, acc + first * kBlock);
      first += count;
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::copy(acc + r * kBlock, acc + r * kBlock + columns, y + r * N);
}

template <typename W>
void run(const float* x, int64_t rows, int64_t K, const W* packed, int64_t N, float* y) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(rows * kBlock);
    for (int64_t b = begin; b < end; ++b) {
      rows_of_block<W>(x, rows, K, packed + b * K * kBlock, y + b * kBlock, N, std::min<int64_t>(kBlock, N - b * kBlock),
                       acc.data());
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
