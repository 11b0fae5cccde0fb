// CUDA kernels of DSpark's serial sampling loop (see serial_sample.h for the call sequence).
//
// Numerics follow the PyTorch reference (dspark_hf/sampling.py) as it runs on a GPU:
//   * every dot product accumulates in fp32;
//   * results that the reference produces in the weights' dtype (nn.Linear outputs, sigmoid and
//     products of bf16/fp16 tensors) are rounded to that dtype (round-to-nearest-even) here too;
//   * logits are round(float(U) + float(bias)) * (1.0f / float(T)): U + bias is added in the dtype,
//     as DeepSpec does (dspark_hf.sampling.add_markov_bias; a bf16 sum is rounded to bf16), then
//     widened; PyTorch's CUDA division by a Python scalar multiplies by the fp32 reciprocal;
//   * greedy picks the smallest index among equal maxima, as torch.argmax does;
//   * sampling is the inverse CDF: the smallest v with sum_{i <= v} p_i > u * sum_i p_i, for the
//     caller's uniform u in [0, 1) (dspark_hf.sampling.inverse_cdf_sample is the same rule in fp64).
//
// Degenerate rows (every logit -inf or NaN) give token 0; NaN logits otherwise give an unspecified
// token (the reference's torch.multinomial raises on them).

#include "serial_sample.h"

#include <climits>
#include <cmath>
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace dspark_hf {
namespace {

constexpr int kWarps = kBlockThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ------------------------------------------------------------------------------ dtype helpers

// to_float: exact widening; round: the fp32 value rounded to the dtype and widened back (what a
// PyTorch op producing that dtype stores); from_float: the dtype value itself.
template <typename T>
struct Num;

template <>
struct Num<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
  static __device__ __forceinline__ float round(float x) { return x; }
};

template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
};

template <>
struct Num<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float round(float x) { return __half2float(__float2half_rn(x)); }
};

// Loads 16 bytes (a vector of 16 / sizeof(T) elements) from 16-byte aligned memory, read-only path.
__device__ __forceinline__ uint4 load16(const void* ptr) { return __ldg(reinterpret_cast<const uint4*>(ptr)); }

// Widens the elements packed in a 16-byte vector.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
  const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int e = 0; e < static_cast<int>(16 / sizeof(T)); ++e) out[e] = Num<T>::to_float(values[e]);
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// ------------------------------------------------------------------------------ reductions

// A logit and its vocabulary index; the larger value wins, ties go to the smaller index.
struct MaxArg {
  float value;
  int index;
};

struct MaxArgOp {
  __device__ __forceinline__ MaxArg operator()(const MaxArg& a, const MaxArg& b) const {
    if (a.value > b.value) return a;
    if (b.value > a.value) return b;
    return a.index <= b.index ? a : b;
  }
};

struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(const T& a, const T& b) const { return a > b ? a : b; }
};

struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(const T& a, const T& b) const { return a < b ? a : b; }
};

using BlockReduceMaxArg = cub::BlockReduce<MaxArg, kBlockThreads>;
using BlockReduceFloat = cub::BlockReduce<float, kBlockThreads>;
using BlockReduceInt = cub::BlockReduce<int, kBlockThreads>;
using BlockScanFloat = cub::BlockScan<float, kBlockThreads>;
using BlockScanDouble = cub::BlockScan<double, kBlockThreads>;

// ------------------------------------------------------------------------------ logits kernel

// Fused Markov bias of one tile: s_bias[i][j] = round(W2[v0 + j] . feature[row0 + i]) for the
// block's rows. Each warp takes kUnroll vocabulary rows at a time; every lane reads 16 bytes of
// each (coalesced 512-byte rows for r = 256 in bf16) and multiplies them with its slice of the
// features, held in registers; a warp sum finishes each dot product.
template <typename T>
__device__ void fused_bias_tile(const SerialSampleParams& p, int v0, int row0, int nrows,
                                float (*s_bias)[kTileV]) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int vectors = p.rank / kVec;  // 16-byte vectors per row (host checked the divisibility)
  const T* w2 = static_cast<const T*>(p.w2);
  const T* feature = static_cast<const T*>(p.feature);

  // This lane's slice of each row's feature: vectors lane and lane + 32 of the row.
  float f[kFusedMaxRows][kFusedMaxVectorsPerLane][kVec];
#pragma unroll
  for (int i = 0; i < kFusedMaxRows; ++i) {
#pragma unroll
    for (int c = 0; c < kFusedMaxVectorsPerLane; ++c) {
      const int vec = lane + 32 * c;
      if (i < nrows && vec < vectors) {
        unpack16<T>(load16(feature + static_cast<int64_t>(row0 + i) * p.rank + vec * kVec), f[i][c]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) f[i][c][e] = 0.f;
      }
    }
  }

  for (int base = warp * kUnroll; base < kTileV; base += kWarps * kUnroll) {
    float acc[kUnroll][kFusedMaxRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < kFusedMaxRows; ++i) acc[u][i] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < kFusedMaxVectorsPerLane; ++c) {
      const int vec = lane + 32 * c;
      if (vec < vectors) {
        uint4 raw[kUnroll];  // issue all loads before using any of them
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = v0 + base + u;
          raw[u] = v < p.vocab ? load16(w2 + static_cast<int64_t>(v) * p.rank + vec * kVec) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float w[kVec];
          unpack16<T>(raw[u], w);
#pragma unroll
          for (int i = 0; i < kFusedMaxRows; ++i) {
            if (i < nrows) {
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[u][i] = fmaf(w[e], f[i][c][e], acc[u][i]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < kFusedMaxRows; ++i) {
        if (i < nrows) {  // uniform across the warp: every lane takes part in the shuffles
          const float dot = warp_sum(acc[u][i]);
          if (lane == 0) s_bias[i][base + u] = Num<T>::round(dot);
        }
      }
    }
  }
}

// Logits of position `pos` for one 256-entry vocabulary tile and `rows_per_block` rows:
// l = round(U + bias) * inv_temperature is written to p.logits, and the tile's max / argmax (and, when
// sampling, sum of exp(l - max)) go to the tile partials that select_* reduce.
template <typename T, bool kFusedBias>
__global__ void __launch_bounds__(kBlockThreads)
    logits_kernel(const SerialSampleParams p, const int pos, const int rows_per_block) {
  __shared__ union {
    typename BlockReduceMaxArg::TempStorage max_arg;
    typename BlockReduceFloat::TempStorage sum;
  } temp;
  __shared__ float s_bias[kFusedBias ? kFusedMaxRows : 1][kTileV];
  __shared__ MaxArg s_best;

  const int tile = blockIdx.x;
  const int v0 = tile * kTileV;
  const int row0 = blockIdx.y * rows_per_block;
  const int nrows = min(rows_per_block, p.rows - row0);

  if constexpr (kFusedBias) {
    fused_bias_tile<T>(p, v0, row0, nrows, s_bias);
    __syncthreads();
  }

  const T* base_logits = static_cast<const T*>(p.base_logits);
  const T* bias = static_cast<const T*>(p.bias);
  const int v = v0 + threadIdx.x;
  const bool valid = v < p.vocab;
  for (int i = 0; i < nrows; ++i) {
    const int row = row0 + i;
    const int64_t offset = (static_cast<int64_t>(row) * p.gamma + pos) * p.vocab;
    float logit = -INFINITY;
    if (valid) {
      float b = 0.f;
      if constexpr (kFusedBias) {
        b = s_bias[i][threadIdx.x];
      } else if (bias != nullptr) {
        b = Num<T>::to_float(bias[static_cast<int64_t>(row) * p.vocab + v]);
      }
      logit = Num<T>::round(Num<T>::to_float(base_logits[offset + v]) + b) * p.inv_temperature;
      p.logits[offset + v] = logit;
    }
    const MaxArg best = BlockReduceMaxArg(temp.max_arg).Reduce(MaxArg{logit, valid ? v : INT_MAX}, MaxArgOp());
    if (threadIdx.x == 0) s_best = best;
    __syncthreads();
    const int64_t part = static_cast<int64_t>(row) * p.num_tiles + tile;
    if (p.uniforms != nullptr) {
      const float m = s_best.value;
      const float e = (valid && m != -INFINITY) ? expf(logit - m) : 0.f;
      const float sum = BlockReduceFloat(temp.sum).Sum(e);
      if (threadIdx.x == 0) p.tile_sum[part] = sum;
    }
    if (threadIdx.x == 0) {
      p.tile_max[part] = s_best.value;
      p.tile_arg[part] = s_best.index;
    }
    __syncthreads();  // temp and s_best are reused by the next row
  }
}

// ------------------------------------------------------------------------------ token selection

// Greedy: the largest logit of the row (smallest index on ties), from the tile partials.
__device__ int select_greedy(const SerialSampleParams& p, int row) {
  __shared__ typename BlockReduceMaxArg::TempStorage temp;
  __shared__ int s_token;
  const float* tile_max = p.tile_max + static_cast<int64_t>(row) * p.num_tiles;
  const int* tile_arg = p.tile_arg + static_cast<int64_t>(row) * p.num_tiles;
  MaxArg best{-INFINITY, INT_MAX};
  for (int t = threadIdx.x; t < p.num_tiles; t += kBlockThreads) best = MaxArgOp()(best, MaxArg{tile_max[t], tile_arg[t]});
  best = BlockReduceMaxArg(temp).Reduce(best, MaxArgOp());
  if (threadIdx.x == 0) s_token = best.index == INT_MAX ? 0 : best.index;
  __syncthreads();
  return s_token;
}

// Weight of a tile, sum over its entries of exp(l - m), in the row's scale m (its largest logit).
// Both passes of select_sampled compute it with this one expression, so they agree bit for bit.
__device__ __forceinline__ double tile_weight(float tile_max, float tile_sum, float m) {
  return tile_max == -INFINITY ? 0.0 : static_cast<double>(tile_sum * expf(tile_max - m));
}

// Sampling: the inverse CDF of softmax(logits) at the row's uniform u.
//   1. m = the row's largest logit; tile weights w_t = tile_sum_t * exp(tile_max_t - m).
//   2. Each thread owns a contiguous run of tiles; an exclusive scan (fp64) of the runs' weights
//      gives every thread the weight before its run, and the total W.
//   3. The first tile whose running weight exceeds u * W holds the token (the smallest claimed
//      tile wins; if rounding leaves none, the last tile with weight).
//   4. Inside that tile, an inclusive scan of exp(l - m) finds the first entry past the remainder
//      (if rounding leaves none, the tile's last entry with weight).
__device__ int select_sampled(const SerialSampleParams& p, int row, int pos) {
  __shared__ union {
    typename BlockReduceFloat::TempStorage reduce_float;
    typename BlockReduceInt::TempStorage reduce_int;
    typename BlockScanDouble::TempStorage scan_double;
    typename BlockScanFloat::TempStorage scan_float;
  } temp;
  __shared__ float s_max;
  __shared__ int s_claimed_tile;
  __shared__ int s_last_tile;
  __shared__ double s_residual;
  __shared__ int s_token;

  const int num_tiles = p.num_tiles;
  const float* tile_max = p.tile_max + static_cast<int64_t>(row) * num_tiles;
  const float* tile_sum = p.tile_sum + static_cast<int64_t>(row) * num_tiles;

  // 1. The row's largest logit.
  float m = -INFINITY;
  for (int t = threadIdx.x; t < num_tiles; t += kBlockThreads) m = fmaxf(m, tile_max[t]);
  m = BlockReduceFloat(temp.reduce_float).Reduce(m, MaxOp());
  if (threadIdx.x == 0) {
    s_max = m;
    s_claimed_tile = INT_MAX;
    s_last_tile = -1;
  }
  __syncthreads();
  m = s_max;

  // 2. Weights of this thread's run of tiles, and the weight before it.
  const int per_thread = (num_tiles + kBlockThreads - 1) / kBlockThreads;
  const int t_begin = min(num_tiles, static_cast<int>(threadIdx.x) * per_thread);
  const int t_end = min(num_tiles, t_begin + per_thread);
  double run_weight = 0.0;
  for (int t = t_begin; t < t_end; ++t) run_weight += tile_weight(tile_max[t], tile_sum[t], m);
  double before = 0.0, total = 0.0;
  BlockScanDouble(temp.scan_double).ExclusiveSum(run_weight, before, total);

  // 3. Claim the tile where the running weight passes the target.
  const double target = static_cast<double>(p.uniforms[static_cast<int64_t>(row) * p.gamma + pos]) * total;
  int claimed = INT_MAX;
  double residual = 0.0;
  double running = before;
  for (int t = t_begin; t < t_end; ++t) {
    const double w = tile_weight(tile_max[t], tile_sum[t], m);
    if (w > 0.0) {
      atomicMax(&s_last_tile, t);
      if (running + w > target) {
        claimed = t;
        residual = target - running;
        break;
      }
    }
    running += w;
  }
  if (claimed != INT_MAX) atomicMin(&s_claimed_tile, claimed);
  __syncthreads();
  int tile = s_claimed_tile;
  if (tile != INT_MAX && claimed == tile) s_residual = residual;  // exactly one thread
  __syncthreads();
  float tile_residual;
  if (tile != INT_MAX) {
    tile_residual = static_cast<float>(s_residual);
  } else {  // rounding left the target past every tile: take the last entry with weight
    tile = s_last_tile;
    tile_residual = INFINITY;
  }
  if (tile < 0) {  // no entry has weight (all logits -inf or NaN)
    return 0;
  }

  // 4. Inside the tile.
  const int v = tile * kTileV + threadIdx.x;
  const float* logits = p.logits + (static_cast<int64_t>(row) * p.gamma + pos) * p.vocab;
  const float e = v < p.vocab ? expf(logits[v] - m) : 0.f;
  float inclusive;
  BlockScanFloat(temp.scan_float).InclusiveSum(e, inclusive);
  __syncthreads();
  const int first = BlockReduceInt(temp.reduce_int).Reduce((e > 0.f && inclusive > tile_residual) ? v : INT_MAX, MinOp());
  __syncthreads();
  const int last = BlockReduceInt(temp.reduce_int).Reduce(e > 0.f ? v : -1, MaxOp());
  if (threadIdx.x == 0) s_token = first != INT_MAX ? first : (last >= 0 ? last : 0);
  __syncthreads();
  return s_token;
}

// ------------------------------------------------------------------------------ next position

// Markov feature and confidence of position `pos`, whose previous token is `prev`:
//   confidence: c = sigmoid(round(w . [h_pos; W1[prev]] + b) / T_pos)
//   vanilla:    feature = W1[prev]
//   gated:      feature = round(round(sigmoid(round(Wg [h_pos; W1[prev]] + bg))) * W1[prev])
// The gate's hidden part Wg[:, :d] h_pos is precomputed (p.gate_hidden) for all positions.
template <typename T>
__device__ void prepare_position(const SerialSampleParams& p, int row, int pos, int64_t prev) {
  __shared__ typename BlockReduceFloat::TempStorage temp;
  extern __shared__ float s_dynamic[];  // gated head: 2 * rank floats

  if (prev < 0 || prev >= p.vocab) {
    if (threadIdx.x == 0) {
      printf("dspark_hf serial_sample: previous token %lld of row %d is outside the vocabulary [0, %d)\n",
             static_cast<long long>(prev), row, p.vocab);
    }
    __trap();
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const T* w1_row = p.w1 != nullptr ? static_cast<const T*>(p.w1) + prev * p.rank : nullptr;

  if (p.conf_w != nullptr) {
    const T* conf_w = static_cast<const T*>(p.conf_w);
    const T* h = static_cast<const T*>(p.hidden_states) + (static_cast<int64_t>(row) * p.gamma + pos) * p.hidden;
    float acc = 0.f;
    for (int i = threadIdx.x; i < p.hidden; i += kBlockThreads) acc = fmaf(Num<T>::to_float(conf_w[i]), Num<T>::to_float(h[i]), acc);
    if (p.conf_with_markov) {
      for (int j = threadIdx.x; j < p.rank; j += kBlockThreads) {
        acc = fmaf(Num<T>::to_float(conf_w[p.hidden + j]), Num<T>::to_float(w1_row[j]), acc);
      }
    }
    acc = BlockReduceFloat(temp).Sum(acc);
    if (threadIdx.x == 0) {
      float logit = Num<T>::round(acc + Num<T>::to_float(static_cast<const T*>(p.conf_b)[0]));
      if (p.conf_temp != nullptr) logit = logit / p.conf_temp[pos];
      p.confidences[static_cast<int64_t>(row) * p.gamma + pos] = sigmoidf(logit);
    }
  }

  if (p.rank == 0) return;
  T* feature = static_cast<T*>(p.feature) + static_cast<int64_t>(row) * p.rank;
  if (p.gate_w == nullptr) {
    for (int j = threadIdx.x; j < p.rank; j += kBlockThreads) feature[j] = w1_row[j];
    return;
  }

  float* s_raw = s_dynamic;            // W1[prev]
  float* s_gate = s_dynamic + p.rank;  // sigmoid gate
  for (int j = threadIdx.x; j < p.rank; j += kBlockThreads) s_raw[j] = Num<T>::to_float(w1_row[j]);
  __syncthreads();
  const T* gate_w = static_cast<const T*>(p.gate_w);
  const T* gate_b = static_cast<const T*>(p.gate_b);
  const float* gate_hidden = p.gate_hidden + (static_cast<int64_t>(row) * p.gamma + pos) * p.rank;
  const int64_t ld = static_cast<int64_t>(p.hidden) + p.rank;  // row length of gate_w
  for (int j = warp; j < p.rank; j += kWarps) {  // one warp per gate unit
    const T* w_row = gate_w + j * ld + p.hidden;
    float acc = 0.f;
    for (int i = lane; i < p.rank; i += 32) acc = fmaf(Num<T>::to_float(w_row[i]), s_raw[i], acc);
    acc = warp_sum(acc);
    if (lane == 0) {
      const float pre = Num<T>::round(gate_hidden[j] + acc + Num<T>::to_float(gate_b[j]));
      s_gate[j] = Num<T>::round(sigmoidf(pre));
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < p.rank; j += kBlockThreads) feature[j] = Num<T>::from_float(s_gate[j] * s_raw[j]);
}

// One block per row: the token at select_pos (if >= 0), then the feature/confidence of prepare_pos
// (if >= 0). The two are fused because the second needs the first's token.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    select_and_prepare_kernel(const SerialSampleParams p, const int select_pos, const int prepare_pos) {
  const int row = blockIdx.x;
  int64_t prev = 0;
  if (select_pos >= 0) {
    const int token = p.uniforms != nullptr ? select_sampled(p, row, select_pos) : select_greedy(p, row);
    if (threadIdx.x == 0) p.tokens[static_cast<int64_t>(row) * p.gamma + select_pos] = token;
    prev = token;
  }
  if (prepare_pos < 0) return;
  if (prepare_pos == 0) {
    prev = p.anchor[row];
  } else if (select_pos != prepare_pos - 1) {
    prev = p.tokens[static_cast<int64_t>(row) * p.gamma + prepare_pos - 1];
  }
  prepare_position<T>(p, row, prepare_pos, prev);
}

// ------------------------------------------------------------------------------ launchers

template <typename T>
cudaError_t launch_select_and_prepare_typed(const SerialSampleParams& p, int select_pos, int prepare_pos,
                                            cudaStream_t stream) {
  const size_t dynamic_smem = p.gate_w != nullptr ? 2 * static_cast<size_t>(p.rank) * sizeof(float) : 0;
  select_and_prepare_kernel<T><<<p.rows, kBlockThreads, dynamic_smem, stream>>>(p, select_pos, prepare_pos);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_logits_typed(const SerialSampleParams& p, int pos, bool fused_bias, cudaStream_t stream) {
  if (fused_bias) {
    logits_kernel<T, true><<<dim3(p.num_tiles, 1), kBlockThreads, 0, stream>>>(p, pos, p.rows);
  } else {
    logits_kernel<T, false><<<dim3(p.num_tiles, p.rows), kBlockThreads, 0, stream>>>(p, pos, 1);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_select_and_prepare(const SerialSampleParams& p, ScalarType dtype, int select_pos,
                                      int prepare_pos, cudaStream_t stream) {
  switch (dtype) {
    case ScalarType::kFloat32:
      return launch_select_and_prepare_typed<float>(p, select_pos, prepare_pos, stream);
    case ScalarType::kBFloat16:
      return launch_select_and_prepare_typed<__nv_bfloat16>(p, select_pos, prepare_pos, stream);
    case ScalarType::kFloat16:
      return launch_select_and_prepare_typed<__half>(p, select_pos, prepare_pos, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_logits(const SerialSampleParams& p, ScalarType dtype, int pos, bool fused_bias,
                          cudaStream_t stream) {
  switch (dtype) {
    case ScalarType::kFloat32:
      return launch_logits_typed<float>(p, pos, fused_bias, stream);
    case ScalarType::kBFloat16:
      return launch_logits_typed<__nv_bfloat16>(p, pos, fused_bias, stream);
    case ScalarType::kFloat16:
      return launch_logits_typed<__half>(p, pos, fused_bias, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dspark_hf
