// A small-batch linear kernel for x86 CPUs with AVX2 + FMA (+ F16C), and AVX-512 where the CPU has it,
// built into the CPU extension by cpu_engine/dspark_cpu/extension.py (used by row_block.py).
//
// Decoding runs 1 to ~16 input rows through every weight matrix once per step, so the step streams
// the weights from memory and should cost about the same for 1 row as for 8. The weight is stored in
// column blocks of 16 outputs in its own dtype (float32, bfloat16 or float16, widened to float32 in
// registers). Two layouts:
//
// * per k, [N/16][K][16]: float32 and float16 everywhere; bfloat16 under AVX2, with each k's 16 columns
//   interleaved (0, 8, 1, 9, ... 7, 15) so one 32-byte load widens with a shift (columns 0-7) and a mask
//   (columns 8-15): 3 instructions for 16 weights instead of 6.
// * per pair of k, [N/16][K/2][16 x 2]: bfloat16 under AVX-512. One 64-byte line holds the 16 columns'
//   weights for k and k + 1; a shift gives k's and a mask k + 1's (float32 inputs), or, on CPUs with
//   avx512_bf16 and bfloat16 inputs, VDPBF16PS multiplies the pair and adds it in one instruction.
//
// A group of rows keeps its accumulators in registers (AVX2: up to 6 rows x 2 registers; AVX-512: up
// to 8 rows, 12 for bfloat16 pairs, x 1, and groups of 3-8 rows of float32/float16 weights on two blocks at once,
// each broadcast input feeding two multiply-adds); more rows take turns on each short k-span of the block(s) while
// they sit in L1, so every weight is read from memory once per call at an even pace. Threads split the column blocks.
//
// With several rows the FMAs take long enough that the hardware prefetcher alone leaves the memory
// idle part of the time (8 rows of SmolLM2's fp32 linears took far longer than one row, where reading
// the weights is the whole cost); an explicit prefetch kPrefetchBytes ahead keeps it streaming
// (measured: docs/performance.md). One row of float32 weights runs without it (it made that case slower).
//
// Every output is one float32 multiply-add chain over k = 0 .. K-1 in order, whatever the number of
// rows, so a row's result does not depend on the other rows of the batch: a verify forward of several
// tokens gives each token the same linear outputs as a forward of that token alone. The FMA paths (AVX2
// and AVX-512) give the same bits; VDPBF16PS adds each pair's products one after the other with
// round-to-nearest like an FMA but flushes subnormal inputs and results to zero (and the CPU may order
// the pair differently), so its outputs can differ from the FMA paths' in the last bit, never between
// batch sizes.

#include "cpu_kernels.h"
#include "cpu_vec_avx2.h"  // DSPARK_AVX2, DSPARK_INLINE

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dspark_cpu {
namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kSpanK = 32;  // k-steps per span when several row groups share a block
constexpr int64_t kPrefetchBytes = 2048;

#define DSPARK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define DSPARK_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

enum Isa : int { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2 };
const char* const kIsaNames[] = {"avx2", "avx512", "avx512_bf16"};

Isa detect_isa() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")))
    return kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512;
}
const Isa kCpuIsa = detect_isa();
std::atomic<int> g_isa{kCpuIsa};

struct Half { uint16_t bits; };

// ---- AVX2: per-k layout, up to 6 rows x 2 registers --------------------------------------------------

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
template <> DSPARK_INLINE DSPARK_AVX2 void load16<Half>(const Half* p, __m256& low, __m256& high) {
  low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// Prefetch the weights kPrefetchBytes ahead, once per 64-byte line (a step holds StepBytes of them), into L1
// (T0) or, for the AVX-512 per-k path, into L2 (T1; see span_avx512).
template <int64_t StepBytes, int Hint = _MM_HINT_T0> DSPARK_INLINE void prefetch_ahead(const void* step_start, int64_t step) {
  if (StepBytes >= 64 || (step & (64 / StepBytes - 1)) == 0)
    _mm_prefetch(static_cast<const char*>(step_start) + kPrefetchBytes, static_cast<_mm_hint>(Hint));
}

// The span kernels: R rows x B column blocks over steps [s_begin, s_end) (a step is one k, or one pair of
// k in the pair layout). Block b starts at block + b * stride; the accumulators start from and return to
// acc[R][B][16], so a block can be walked in spans without changing any output's chain. One or two rows
// take several blocks at once (B > 1): with one block, one row is one or two chains of K dependent
// multiply-adds, each waiting on the last one's latency, which a layer held in cache cannot hide.

template <typename W, int R, int B, bool Prefetch>
DSPARK_AVX2 void span_avx2(const float* x, int64_t ldx, const W* block, int64_t stride, int64_t k_begin, int64_t k_end,
                           float* acc) {
  __m256 low_acc[R][B], high_acc[R][B];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      low_acc[r][b] = _mm256_loadu_ps(acc + (r * B + b) * kBlock);
      high_acc[r][b] = _mm256_loadu_ps(acc + (r * B + b) * kBlock + 8);
    }
  for (int64_t k = k_begin; k < k_end; ++k) {
    __m256 w_low[B], w_high[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      if constexpr (Prefetch) prefetch_ahead<kBlock * sizeof(W)>(block + b * stride + k * kBlock, k);
      load16<W>(block + b * stride + k * kBlock, w_low[b], w_high[b]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        low_acc[r][b] = _mm256_fmadd_ps(xk, w_low[b], low_acc[r][b]);
        high_acc[r][b] = _mm256_fmadd_ps(xk, w_high[b], high_acc[r][b]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      _mm256_storeu_ps(acc + (r * B + b) * kBlock, low_acc[r][b]);
      _mm256_storeu_ps(acc + (r * B + b) * kBlock + 8, high_acc[r][b]);
    }
}

template <typename W> DSPARK_INLINE DSPARK_AVX512 __m512 load16_512(const W* p);
template <> DSPARK_INLINE DSPARK_AVX512 __m512 load16_512<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> DSPARK_INLINE DSPARK_AVX512 __m512 load16_512<Half>(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The R x B accumulators of a span kernel from and back to acc[R][B][16].
template <int R, int B>
DSPARK_INLINE DSPARK_AVX512 void read_acc512(const float* acc, __m512 (&sums)[R][B]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) sums[r][b] = _mm512_loadu_ps(acc + (r * B + b) * kBlock);
}
template <int R, int B>
DSPARK_INLINE DSPARK_AVX512 void write_acc512(const __m512 (&sums)[R][B], float* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(acc + (r * B + b) * kBlock, sums[r][b]);
}

// AVX-512, per-k layout (float32, float16). Its prefetches go to L2: whole SmolLM2 fp32 forwards of 8 and 16 tokens
// were faster than with L1 prefetches, or level, in interleaved runs of both orders; one row, which does not
// prefetch, the same (float16 weights, which share this path, were not measured). The bfloat16 pair paths keep L1
// prefetches: there L2 ones helped one row and cost more at eight. The AVX2 paths were not measured with L2 ones
// (measured: docs/performance.md).
template <typename W, int R, int B, bool Prefetch>
DSPARK_AVX512 void span_avx512(const float* x, int64_t ldx, const W* block, int64_t stride, int64_t k_begin,
                               int64_t k_end, float* acc) {
  __m512 sums[R][B];
  read_acc512<R, B>(acc, sums);
  for (int64_t k = k_begin; k < k_end; ++k) {
    __m512 w[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      if constexpr (Prefetch) prefetch_ahead<kBlock * sizeof(W), _MM_HINT_T1>(block + b * stride + k * kBlock, k);
      w[b] = load16_512<W>(block + b * stride + k * kBlock);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) sums[r][b] = _mm512_fmadd_ps(xk, w[b], sums[r][b]);
    }
  }
  write_acc512<R, B>(sums, acc);
}

// AVX-512, bfloat16 pairs with float32 inputs: k = 2p then k = 2p + 1, as an FMA chain.
template <int R, int B, bool Prefetch>
DSPARK_AVX512 void span_pairs_fma(const float* x, int64_t ldx, const uint32_t* block, int64_t stride, int64_t p_begin,
                                  int64_t p_end, float* acc) {
  __m512 sums[R][B];
  read_acc512<R, B>(acc, sums);
  for (int64_t p = p_begin; p < p_end; ++p) {
    __m512 even[B], odd[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      if constexpr (Prefetch) prefetch_ahead<64>(block + b * stride + p * kBlock, p);
      const __m512i words = _mm512_loadu_si512(block + b * stride + p * kBlock);
      even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      odd[b] = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 x_even = _mm512_set1_ps(x[r * ldx + 2 * p]), x_odd = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) sums[r][b] = _mm512_fmadd_ps(x_odd, odd[b], _mm512_fmadd_ps(x_even, even[b], sums[r][b]));
    }
  }
  write_acc512<R, B>(sums, acc);
}

// AVX-512 BF16, bfloat16 pairs with bfloat16 inputs (x as pairs of k in 32-bit words): one VDPBF16PS per
// row, block and pair.
template <int R, int B, bool Prefetch>
DSPARK_AVX512_BF16 void span_pairs_dot(const uint32_t* x, int64_t ldx, const uint32_t* block, int64_t stride,
                                       int64_t p_begin, int64_t p_end, float* acc) {
  __m512 sums[R][B];
  read_acc512<R, B>(acc, sums);
  for (int64_t p = p_begin; p < p_end; ++p) {
    __m512bh w[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      if constexpr (Prefetch) prefetch_ahead<64>(block + b * stride + p * kBlock, p);
      w[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(block + b * stride + p * kBlock));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xp = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx + p])));
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) sums[r][b] = _mm512_dpbf16_ps(sums[r][b], w[b], xp);
    }
  }
  write_acc512<R, B>(sums, acc);
}

// ---- driver ------------------------------------------------------------------------------------------

// The span kernels of one path: groups of 1 .. MaxRows rows on one block, one or two rows on several
// blocks at once, and (the AVX-512 per-k path, 32 registers) 3 .. kWideMaxRows rows on kWideBlocks blocks,
// so each broadcast input feeds two multiply-adds; each with and without prefetching. Every output is still
// one chain over k in order, so the bits are those of one block at a time.
constexpr int kOneRowBlocks = 4, kTwoRowBlocks = 2, kWideBlocks = 2, kWideMaxRows = 8;
template <typename X, typename W, int MaxRows>
struct Path {
  using Span = void (*)(const X*, int64_t, const W*, int64_t, int64_t, int64_t, float*);
  Span group[2][MaxRows + 1];       // [prefetch][rows], one block
  Span one_row[2];                  // kOneRowBlocks blocks
  Span two_rows[2];                 // kTwoRowBlocks blocks
  Span wide[2][kWideMaxRows + 1];   // [prefetch][rows], kWideBlocks blocks; nullptr on paths without them
  int64_t prefetch_from_rows;       // the fewest rows that prefetch
  int64_t span_steps;               // steps per span when several row groups share a block
};

template <typename X, typename W, int MaxRows, bool Wide, template <int, int, bool> class Kernel, std::size_t... R,
          std::size_t... V>
constexpr Path<X, W, MaxRows> make_path(int64_t prefetch_from_rows, int64_t span_steps, std::index_sequence<R...>,
                                        std::index_sequence<V...>) {
  using Span = typename Path<X, W, MaxRows>::Span;
  if constexpr (Wide) {
    return {{{nullptr, Kernel<R + 1, 1, false>::run...}, {nullptr, Kernel<R + 1, 1, true>::run...}},
            {Kernel<1, kOneRowBlocks, false>::run, Kernel<1, kOneRowBlocks, true>::run},
            {Kernel<2, kTwoRowBlocks, false>::run, Kernel<2, kTwoRowBlocks, true>::run},
            {{nullptr, Kernel<V + 1, kWideBlocks, false>::run...}, {nullptr, Kernel<V + 1, kWideBlocks, true>::run...}},
            prefetch_from_rows, span_steps};
  } else {
    return {{{nullptr, Kernel<R + 1, 1, false>::run...}, {nullptr, Kernel<R + 1, 1, true>::run...}},
            {Kernel<1, kOneRowBlocks, false>::run, Kernel<1, kOneRowBlocks, true>::run},
            {Kernel<2, kTwoRowBlocks, false>::run, Kernel<2, kTwoRowBlocks, true>::run},
            {{static_cast<Span>(nullptr)}, {static_cast<Span>(nullptr)}},
            prefetch_from_rows, span_steps};
  }
}
template <typename X, typename W, int MaxRows, bool Wide, template <int, int, bool> class Kernel>
constexpr Path<X, W, MaxRows> make_path(int64_t prefetch_from_rows, int64_t span_steps) {
  return make_path<X, W, MaxRows, Wide, Kernel>(prefetch_from_rows, span_steps, std::make_index_sequence<MaxRows>{},
                                                std::make_index_sequence<kWideMaxRows>{});
}

template <typename W> struct Avx2 { template <int R, int B, bool P> struct K { static constexpr auto run = span_avx2<W, R, B, P>; }; };
template <typename W> struct Avx512 { template <int R, int B, bool P> struct K { static constexpr auto run = span_avx512<W, R, B, P>; }; };
template <int R, int B, bool P> struct PairsFma { static constexpr auto run = span_pairs_fma<R, B, P>; };
template <int R, int B, bool P> struct PairsDot { static constexpr auto run = span_pairs_dot<R, B, P>; };

// float32 weights prefetch from 2 rows (one row is purely bound by memory and ran slower with it on an
// AVX2-only CPU), 16-bit weights from 1 (one bfloat16 row ran faster with it; measured: docs/performance.md).
template <typename W> constexpr int64_t kPrefetchFromRows = sizeof(W) == 4 ? 2 : 1;
template <typename W> constexpr auto kAvx2Path = make_path<float, W, 6, false, Avx2<W>::template K>(kPrefetchFromRows<W>, kSpanK);
template <typename W> constexpr auto kAvx512Path = make_path<float, W, 8, true, Avx512<W>::template K>(kPrefetchFromRows<W>, kSpanK);
// Wide groups only where they measured faster: float32 weights at 3-8 rows, and in groups of 4-8 from 9 rows on
// (whole fp32 forwards faster than with one block at a time, in both orders); for bfloat16 pairs they measured the
// same (measured: docs/performance.md).
constexpr auto kPairsFmaPath = make_path<float, uint32_t, 12, false, PairsFma>(1, kSpanK / 2);
constexpr auto kPairsDotPath = make_path<uint32_t, uint32_t, 12, false, PairsDot>(1, kSpanK / 2);

// Where a call's results go: [rows, N] in the input's dtype, rounded from float32 (after adding the float32
// bias, as F.linear's float32 result plus bias rounded by .to() would be) while the block's sums are in L1.
struct Output {
  void* data;
  at::ScalarType dtype;  // float32, bfloat16 or float16
  const float* bias;     // nullptr: none
  int64_t N;
};

template <typename Y>
void store_sums(const float* sums, const float* bias, int64_t width, Y* out) {
  for (int64_t c = 0; c < width; ++c) out[c] = static_cast<Y>(bias == nullptr ? sums[c] : sums[c] + bias[c]);
}

void store_row(const float* sums, int64_t width, const Output& out, int64_t row, int64_t column) {
  const int64_t at = row * out.N + column;
  const float* bias = out.bias == nullptr ? nullptr : out.bias + column;
  switch (out.dtype) {
    case torch::kBFloat16: store_sums(sums, bias, width, static_cast<c10::BFloat16*>(out.data) + at); break;
    case torch::kHalf: store_sums(sums, bias, width, static_cast<c10::Half*>(out.data) + at); break;
    default: store_sums(sums, bias, width, static_cast<float*>(out.data) + at);
  }
}

// All rows x `count` adjacent blocks, the first at column `first_column`. One or two rows take kOneRowBlocks or
// kTwoRowBlocks blocks per kernel call. More rows go in groups of at most MaxRows, of balanced size (8 rows
// under AVX2: 4 + 4), on kWideBlocks blocks at a time where the path has wide kernels, else one; with more than
// one group the block(s) are walked in spans and every group takes its turn on a span while it is in L1, so the
// weights stream from memory at an even pace.
template <typename X, typename W, int MaxRows>
void rows_of_blocks(const Path<X, W, MaxRows>& path, const X* x, int64_t ldx, int64_t rows, int64_t steps,
                    const W* blocks, int64_t count, const Output& out, int64_t first_column, float* acc) {
  const int prefetch = rows >= path.prefetch_from_rows ? 1 : 0;
  const int64_t stride = steps * kBlock;
  const int64_t groups = (rows + MaxRows - 1) / MaxRows;
  // Groups of 3 .. MaxRows rows (more than 2 rows split so) take two blocks at once where the path has wide kernels.
  const bool wide_groups = rows > 2 && MaxRows <= kWideMaxRows && path.wide[0][MaxRows] != nullptr;
  const int64_t wide = rows == 1 ? kOneRowBlocks : rows == 2 ? kTwoRowBlocks : wide_groups ? kWideBlocks : 1;
  const int64_t span = groups == 1 ? steps : path.span_steps;
  for (int64_t b = 0; b < count;) {
    const int64_t tile = b + wide <= count ? wide : 1;
    std::fill(acc, acc + rows * tile * kBlock, 0.0f);
    if (tile > 1 && rows <= 2) {
      const auto kernel = rows == 1 ? path.one_row[prefetch] : path.two_rows[prefetch];
      kernel(x, ldx, blocks + b * stride, stride, 0, steps, acc);
    } else {
      for (int64_t s = 0; s < steps; s += span) {
        const int64_t s_end = std::min<int64_t>(steps, s + span);
        for (int64_t group = 0, first = 0; group < groups; ++group) {
          const int64_t size = (rows - first) / (groups - group);
          const auto kernel = tile > 1 ? path.wide[prefetch][size] : path.group[prefetch][size];
          kernel(x + first * ldx, ldx, blocks + b * stride, stride, s, s_end, acc + first * tile * kBlock);
          first += size;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < tile; ++t) {
        const int64_t column = first_column + (b + t) * kBlock;
        store_row(acc + (r * tile + t) * kBlock, std::min<int64_t>(kBlock, out.N - column), out, r, column);
      }
    b += tile;
  }
}

template <typename X, typename W, int MaxRows>
void run(const Path<X, W, MaxRows>& path, const X* x, int64_t ldx, int64_t rows, int64_t steps, const W* packed,
         const Output& out) {
  const int64_t blocks = (out.N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(rows * kOneRowBlocks * kBlock);
    rows_of_blocks(path, x, ldx, rows, steps, packed + begin * steps * kBlock, end - begin, out, begin * kBlock,
                   acc.data());
  });
}

}  // namespace

// input [..., K] of any float dtype; packed [ceil(N/16), K, 16] (per-k layout) or, bfloat16 only,
// [ceil(N/16), ceil(K/2), 32] (pair layout, AVX-512); returns [..., N] in input's dtype.
torch::Tensor row_block_linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && packed.device().is_cpu(), "row_block_linear runs on CPU tensors");
  const bool pairs = packed.dim() == 3 && packed.size(2) == 2 * kBlock;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kBlock || pairs) && packed.is_contiguous(),
              "packed weight must be [blocks, K, 16] or [blocks, K/2, 32]");
  const int64_t K = input.size(-1);
  const int64_t steps = packed.size(1);
  TORCH_CHECK(pairs ? steps == (K + 1) / 2 : steps == K, "input has ", K, " features, the packed weight ",
              pairs ? 2 * steps : steps);
  TORCH_CHECK(packed.size(0) * kBlock >= out_features, "packed weight has fewer than out_features columns");
  const int isa = g_isa.load(std::memory_order_relaxed);
  TORCH_CHECK(!pairs || (packed.scalar_type() == torch::kBFloat16 && isa >= kAvx512),
              "this weight was packed in bfloat16 pairs for AVX-512, which is not in use; pack it again with "
              "pack_row_blocks");
  const int64_t padded_k = pairs ? 2 * steps : K;  // the pair layout's zero weight for an odd K meets a zero input
  torch::Tensor flat = input.reshape({-1, K});
  const int64_t rows = flat.size(0);
  const bool dot = pairs && isa >= kAvx512Bf16 && input.scalar_type() == torch::kBFloat16;
  torch::Tensor x = flat.to(dot ? torch::kBFloat16 : torch::kFloat32);
  if (padded_k != K) x = at::constant_pad_nd(x, {0, padded_k - K});
  x = x.contiguous();
  const at::ScalarType in_dtype = input.scalar_type();
  const bool direct = in_dtype == torch::kFloat32 || in_dtype == torch::kBFloat16 || in_dtype == torch::kHalf;
  torch::Tensor y = torch::empty({rows, out_features}, input.options().dtype(direct ? in_dtype : torch::kFloat32));
  torch::Tensor bias_f32;
  if (bias.has_value()) bias_f32 = bias->to(torch::kFloat32).contiguous();
  const Output out{y.data_ptr(), y.scalar_type(), bias.has_value() ? bias_f32.data_ptr<float>() : nullptr, out_features};
  if (rows > 0) {
    const void* weights = packed.data_ptr();
    switch (packed.scalar_type()) {
      case torch::kFloat32:
        if (isa >= kAvx512)
          run(kAvx512Path<float>, x.data_ptr<float>(), K, rows, steps, static_cast<const float*>(weights), out);
        else
          run(kAvx2Path<float>, x.data_ptr<float>(), K, rows, steps, static_cast<const float*>(weights), out);
        break;
      case torch::kBFloat16:
        if (dot)
          run(kPairsDotPath, reinterpret_cast<const uint32_t*>(x.data_ptr()), padded_k / 2, rows, steps,
              static_cast<const uint32_t*>(weights), out);
        else if (pairs)
          run(kPairsFmaPath, x.data_ptr<float>(), padded_k, rows, steps, static_cast<const uint32_t*>(weights), out);
        else
          run(kAvx2Path<uint16_t>, x.data_ptr<float>(), K, rows, steps, static_cast<const uint16_t*>(weights), out);
        break;
      case torch::kHalf:
        if (isa >= kAvx512)
          run(kAvx512Path<Half>, x.data_ptr<float>(), K, rows, steps, static_cast<const Half*>(weights), out);
        else
          run(kAvx2Path<Half>, x.data_ptr<float>(), K, rows, steps, static_cast<const Half*>(weights), out);
        break;
      default:
        TORCH_CHECK(false, "row_block_linear: packed weights must be float32, bfloat16 or float16, got ",
                    packed.scalar_type());
    }
  }
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out_features;
  return direct ? y.view(sizes) : y.view(sizes).to(in_dtype);
}

std::string cpu_isa() { return kIsaNames[kCpuIsa]; }
std::string isa() { return kIsaNames[g_isa.load()]; }

// Selects the instruction set for later calls (to compare paths on one machine); never above the CPU's.
void set_isa(const std::string& name) {
  for (int level = kAvx2; level <= kAvx512Bf16; ++level) {
    if (name != kIsaNames[level]) continue;
    TORCH_CHECK(level <= kCpuIsa, "this CPU supports row-block paths up to ", kIsaNames[kCpuIsa], ", not ", name);
    g_isa.store(level);
    return;
  }
  TORCH_CHECK(false, "unknown row-block instruction set '", name, "' (avx2, avx512 or avx512_bf16)");
}

}  // namespace dspark_cpu
