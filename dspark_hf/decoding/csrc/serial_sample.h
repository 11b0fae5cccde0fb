// DSpark serial sampling on the GPU: what the torch-facing host code (serial_sample_op.cpp) and the
// CUDA kernels (serial_sample_kernels.cu) share. Plain C++ only: the kernels are built by nvcc
// without any torch header, so they compile on any machine with the CUDA toolkit.
//
// One call draws a block of `gamma` tokens for each of `rows` requests, left to right:
//
//   prepare(0)                                  feature_0 = W1[x_0] (gated: * gate), c_1
//   for k in 0 .. gamma-1:
//     [cuBLAS] bias = feature_k @ W2^T          only on the "cuBLAS bias" path (see below)
//     logits(k)                                 l = round(U_k + B_k) / T, written out; per-tile max,
//                                               argmax and sum of exp over 256-entry tiles
//     select(k) + prepare(k+1)                  token x_{k+1} from the tile partials (argmax, or
//                                               inverse CDF at a given uniform), then the next
//                                               position's Markov feature and confidence
//
// Two ways to get the Markov bias B_k = W2 @ feature_k (a V x r matrix times one r-vector per row):
//   * fused: the logits kernel reads W2 itself, 16 bytes per lane, and keeps the bias in shared
//     memory (one pass over W2 per position, no intermediate), for at most kFusedMaxRows rows;
//   * cuBLAS: for larger batches a tensor-core GEMM writes the bias, the logits kernel adds it.
// Both round the bias to the weights' dtype (nn.Linear in that dtype), add it to U_k and round the
// sum to the dtype too before widening it to fp32, as DeepSpec and the PyTorch reference do
// (U_k + B_k in the draft's dtype, then .float()), so greedy tokens agree with them.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace dspark_hf {

// Floating dtype of the logits, hidden states and head weights (one dtype for all of them).
enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int kBlockThreads = 256;      // threads of every block
constexpr int kTileV = kBlockThreads;   // vocabulary entries per tile: one per thread
constexpr int kFusedMaxRows = 4;        // most rows the fused W2 pass handles (registers)
constexpr int kFusedMaxVectorsPerLane = 2;  // fused pass: 16-byte pieces of a W2 row per lane
constexpr int kMaxRank = 4096;          // Markov rank limit (shared memory of the prepare step)

inline int element_size(ScalarType t) { return t == ScalarType::kFloat32 ? 4 : 2; }

// The fused W2 pass reads each W2 row as 16-byte vectors, at most kFusedMaxVectorsPerLane per lane:
// rank must be a multiple of the vector width and at most 32 * kFusedMaxVectorsPerLane vectors
// (r <= 512 for bf16/fp16, r <= 256 for fp32). Other ranks use the cuBLAS bias path.
inline bool fused_bias_supported(ScalarType t, int rank) {
  const int vec = 16 / element_size(t);
  return rank > 0 && rank % vec == 0 && rank / vec <= 32 * kFusedMaxVectorsPerLane;
}

struct SerialSampleParams {
  // Sizes.
  int rows;       // R, requests
  int gamma;      // positions per block
  int vocab;      // V
  int hidden;     // d, backbone hidden size
  int rank;       // r, Markov rank; 0 = no Markov head (plain DFlash)
  int num_tiles;  // ceil(V / kTileV)

  // Inputs, all contiguous; `dtype` unless noted.
  const void* base_logits;    // U, (R, gamma, V)
  const void* hidden_states;  // h, (R, gamma, d)
  const int64_t* anchor;      // x_0, (R,)
  const void* w1;             // Markov W1, (V, r), or null
  const void* w2;             // Markov W2 (nn.Linear r -> V weight), (V, r), or null
  const void* gate_w;         // gated head: gate_proj weight (r, d + r), or null
  const void* gate_b;         // gated head: gate_proj bias (r,)
  const float* gate_hidden;   // fp32 (R, gamma, r): gate_w[:, :d] @ h_k, computed before the loop
  const void* conf_w;         // confidence head weight, d (+ r with the Markov feature), or null
  const void* conf_b;         // confidence head bias, 1 value
  bool conf_with_markov;      // whether conf_w also covers W1[x_{k-1}]
  const float* conf_temp;     // fp32 calibration temperatures (>= gamma values), or null
  const float* uniforms;      // fp32 (R, gamma) in [0, 1) when sampling; null = greedy
  float inv_temperature;      // 1 / T, computed as 1.0f / float(T) like PyTorch's CUDA division

  // Outputs.
  int64_t* tokens;            // (R, gamma)
  float* logits;              // (R, gamma, V): the logits each token was drawn from
  float* confidences;         // (R, gamma), or null without a confidence head

  // Scratch.
  void* feature;              // dtype (R, r): Markov feature of the position being drawn
  const void* bias;           // dtype (R, V): bias from cuBLAS, or null (fused or no Markov head)
  float* tile_max;            // (R, num_tiles): largest logit of each tile
  int* tile_arg;              // (R, num_tiles): its smallest index
  float* tile_sum;            // (R, num_tiles): sum over the tile of exp(l - tile_max) (sampling)
};

// Launches on `stream`; each returns cudaGetLastError() after its launch.
//
// select_and_prepare: one block per row. With select_pos >= 0 it picks the token at select_pos from
// the tile partials; with prepare_pos >= 0 it then builds the Markov feature and the confidence of
// prepare_pos (whose previous token is the anchor when prepare_pos == 0).
cudaError_t launch_select_and_prepare(const SerialSampleParams& p, ScalarType dtype, int select_pos,
                                      int prepare_pos, cudaStream_t stream);

// logits: one block per (tile, row), or per tile with all rows when fused_bias is set.
cudaError_t launch_logits(const SerialSampleParams& p, ScalarType dtype, int pos, bool fused_bias,
                          cudaStream_t stream);

}  // namespace dspark_hf
