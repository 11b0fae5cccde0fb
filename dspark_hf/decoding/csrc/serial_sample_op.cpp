// CUDA implementation of the torch operator dspark_hf::serial_sample.
//
// The schema is defined in Python (dspark_hf/cuda_ops.py, with the fake/meta implementation that
// torch.compile traces with); this file registers the CUDA kernel for it. The host code checks the
// inputs, allocates outputs and scratch with the caching allocator and launches the kernels of
// serial_sample_kernels.cu on the current stream. It never synchronises with the device, so the
// operator can be captured in a CUDA graph.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "serial_sample.h"

namespace dspark_hf {
namespace {

ScalarType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ScalarType::kFloat32;
    case at::kBFloat16:
      return ScalarType::kBFloat16;
    case at::kHalf:
      return ScalarType::kFloat16;
    default:
      TORCH_CHECK(false, "dspark_hf::serial_sample supports float32, bfloat16 and float16 inputs, got ", t);
  }
}

// A contiguous copy (or the tensor itself) after checking device and dtype.
at::Tensor checked(const at::Tensor& t, const char* name, const at::Device& device, at::ScalarType dtype) {
  TORCH_CHECK(t.device() == device, "dspark_hf::serial_sample: ", name, " is on ", t.device(),
              ", expected ", device);
  TORCH_CHECK(t.scalar_type() == dtype, "dspark_hf::serial_sample: ", name, " has dtype ", t.scalar_type(),
              ", expected ", dtype, " (all floating inputs share one dtype)");
  return t.contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> serial_sample_cuda(
    const at::Tensor& base_logits_in, const at::Tensor& hidden_states_in, const at::Tensor& anchor_ids_in,
    const std::optional<at::Tensor>& markov_w1_in, const std::optional<at::Tensor>& markov_w2_in,
    const std::optional<at::Tensor>& gate_weight_in, const std::optional<at::Tensor>& gate_bias_in,
    const std::optional<at::Tensor>& confidence_weight_in, const std::optional<at::Tensor>& confidence_bias_in,
    const std::optional<at::Tensor>& confidence_temperatures_in, const std::optional<at::Tensor>& uniforms_in,
    double temperature, int64_t fused_max_rows) {
  TORCH_CHECK(base_logits_in.is_cuda(), "dspark_hf::serial_sample: base_logits must be a CUDA tensor");
  TORCH_CHECK(base_logits_in.dim() == 3, "dspark_hf::serial_sample: base_logits must be (rows, gamma, vocab), got ",
              base_logits_in.sizes());
  const at::Device device = base_logits_in.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::ScalarType dtype = base_logits_in.scalar_type();
  const ScalarType kdtype = kernel_dtype(dtype);

  const int64_t rows = base_logits_in.size(0), gamma = base_logits_in.size(1), vocab = base_logits_in.size(2);
  TORCH_CHECK(rows >= 1 && gamma >= 1 && vocab >= 1, "dspark_hf::serial_sample: empty base_logits ",
              base_logits_in.sizes());
  TORCH_CHECK(rows <= 65535, "dspark_hf::serial_sample: at most 65535 rows, got ", rows);
  TORCH_CHECK(vocab <= std::numeric_limits<int>::max() - kTileV, "dspark_hf::serial_sample: vocabulary too large");
  TORCH_CHECK(temperature > 0.0, "dspark_hf::serial_sample: temperature must be > 0, got ", temperature);

  const at::Tensor base_logits = base_logits_in.contiguous();
  TORCH_CHECK(hidden_states_in.dim() == 3 && hidden_states_in.size(0) == rows && hidden_states_in.size(1) == gamma,
              "dspark_hf::serial_sample: hidden_states must be (rows, gamma, hidden) = (", rows, ", ", gamma,
              ", d), got ", hidden_states_in.sizes());
  const at::Tensor hidden_states = checked(hidden_states_in, "hidden_states", device, dtype);
  const int64_t hidden = hidden_states.size(2);

  TORCH_CHECK(anchor_ids_in.device() == device && anchor_ids_in.numel() == rows,
              "dspark_hf::serial_sample: anchor_ids must hold one token per row on ", device, ", got ",
              anchor_ids_in.sizes(), " on ", anchor_ids_in.device());
  const at::Tensor anchor_ids = anchor_ids_in.reshape({rows}).to(at::kLong).contiguous();

  // Markov head.
  TORCH_CHECK(markov_w1_in.has_value() == markov_w2_in.has_value(),
              "dspark_hf::serial_sample: give both markov_w1 and markov_w2, or neither");
  at::Tensor w1, w2;
  int64_t rank = 0;
  if (markov_w1_in.has_value()) {
    w1 = checked(*markov_w1_in, "markov_w1", device, dtype);
    w2 = checked(*markov_w2_in, "markov_w2", device, dtype);
    TORCH_CHECK(w1.dim() == 2 && w1.size(0) == vocab, "dspark_hf::serial_sample: markov_w1 must be (vocab=", vocab,
                ", rank), got ", w1.sizes());
    rank = w1.size(1);
    TORCH_CHECK(rank >= 1 && rank <= kMaxRank, "dspark_hf::serial_sample: Markov rank must be in [1, ", kMaxRank,
                "], got ", rank);
    TORCH_CHECK(w2.sizes() == w1.sizes(), "dspark_hf::serial_sample: markov_w2 must be (vocab, rank) = ", w1.sizes(),
                ", got ", w2.sizes());
  }

  // Gated head.
  TORCH_CHECK(gate_weight_in.has_value() == gate_bias_in.has_value(),
              "dspark_hf::serial_sample: give both gate_weight and gate_bias, or neither");
  at::Tensor gate_w, gate_b, gate_hidden;
  if (gate_weight_in.has_value()) {
    TORCH_CHECK(rank > 0, "dspark_hf::serial_sample: a gated head needs the Markov weights");
    gate_w = checked(*gate_weight_in, "gate_weight", device, dtype);
    gate_b = checked(*gate_bias_in, "gate_bias", device, dtype);
    TORCH_CHECK(gate_w.dim() == 2 && gate_w.size(0) == rank && gate_w.size(1) == hidden + rank,
                "dspark_hf::serial_sample: gate_weight must be (rank, hidden + rank) = (", rank, ", ", hidden + rank,
                "), got ", gate_w.sizes());
    TORCH_CHECK(gate_b.numel() == rank, "dspark_hf::serial_sample: gate_bias must hold rank=", rank, " values");
    // The gate's hidden-state part does not depend on the drawn tokens: one fp32 GEMM for all positions.
    gate_hidden = at::matmul(hidden_states.to(at::kFloat), gate_w.narrow(1, 0, hidden).to(at::kFloat).t()).contiguous();
  }

  // Confidence head.
  TORCH_CHECK(confidence_weight_in.has_value() == confidence_bias_in.has_value(),
              "dspark_hf::serial_sample: give both confidence_weight and confidence_bias, or neither");
  at::Tensor conf_w, conf_b, conf_temp;
  bool conf_with_markov = false;
  if (confidence_weight_in.has_value()) {
    conf_w = checked(*confidence_weight_in, "confidence_weight", device, dtype);
    conf_b = checked(*confidence_bias_in, "confidence_bias", device, dtype);
    TORCH_CHECK(conf_w.numel() == hidden || (rank > 0 && conf_w.numel() == hidden + rank),
                "dspark_hf::serial_sample: confidence_weight must hold hidden (", hidden, ") or hidden + rank (",
                hidden + rank, ") values, got ", conf_w.numel());
    TORCH_CHECK(conf_b.numel() == 1, "dspark_hf::serial_sample: confidence_bias must hold one value");
    conf_with_markov = conf_w.numel() == hidden + rank && rank > 0;
    if (confidence_temperatures_in.has_value()) {
      conf_temp = checked(*confidence_temperatures_in, "confidence_temperatures", device, at::kFloat);
      TORCH_CHECK(conf_temp.numel() >= gamma, "dspark_hf::serial_sample: confidence_temperatures must hold at least "
                  "gamma=", gamma, " values, got ", conf_temp.numel());
    }
  }

  at::Tensor uniforms;
  if (uniforms_in.has_value()) {
    uniforms = checked(*uniforms_in, "uniforms", device, at::kFloat);
    TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == rows && uniforms.size(1) == gamma,
                "dspark_hf::serial_sample: uniforms must be (rows, gamma) = (", rows, ", ", gamma, "), got ",
                uniforms.sizes());
  }

  // Outputs and scratch.
  const auto long_opts = base_logits.options().dtype(at::kLong);
  const auto float_opts = base_logits.options().dtype(at::kFloat);
  at::Tensor tokens = at::empty({rows, gamma}, long_opts);
  at::Tensor logits = at::empty({rows, gamma, vocab}, float_opts);
  at::Tensor confidences = conf_w.defined() ? at::empty({rows, gamma}, float_opts) : at::empty({0}, float_opts);
  const int64_t num_tiles = (vocab + kTileV - 1) / kTileV;
  at::Tensor tile_max = at::empty({rows, num_tiles}, float_opts);
  at::Tensor tile_arg = at::empty({rows, num_tiles}, base_logits.options().dtype(at::kInt));
  at::Tensor tile_sum = at::empty({uniforms.defined() ? rows : 0, num_tiles}, float_opts);
  at::Tensor feature = at::empty({rows, rank}, base_logits.options());

  // The fused W2 pass needs few rows, a rank it can vectorise and 16-byte aligned rows.
  const bool fused_bias = rank > 0 && rows <= std::min<int64_t>(fused_max_rows, kFusedMaxRows) &&
                          fused_bias_supported(kdtype, static_cast<int>(rank)) &&
                          reinterpret_cast<uintptr_t>(w2.data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(feature.data_ptr()) % 16 == 0;
  at::Tensor bias;
  if (rank > 0 && !fused_bias) bias = at::empty({rows, vocab}, base_logits.options());

  SerialSampleParams p{};
  p.rows = static_cast<int>(rows);
  p.gamma = static_cast<int>(gamma);
  p.vocab = static_cast<int>(vocab);
  p.hidden = static_cast<int>(hidden);
  p.rank = static_cast<int>(rank);
  p.num_tiles = static_cast<int>(num_tiles);
  p.base_logits = base_logits.data_ptr();
  p.hidden_states = hidden_states.data_ptr();
  p.anchor = anchor_ids.data_ptr<int64_t>();
  p.w1 = w1.defined() ? w1.data_ptr() : nullptr;
  p.w2 = w2.defined() ? w2.data_ptr() : nullptr;
  p.gate_w = gate_w.defined() ? gate_w.data_ptr() : nullptr;
  p.gate_b = gate_b.defined() ? gate_b.data_ptr() : nullptr;
  p.gate_hidden = gate_hidden.defined() ? gate_hidden.data_ptr<float>() : nullptr;
  p.conf_w = conf_w.defined() ? conf_w.data_ptr() : nullptr;
  p.conf_b = conf_b.defined() ? conf_b.data_ptr() : nullptr;
  p.conf_with_markov = conf_with_markov;
  p.conf_temp = conf_temp.defined() ? conf_temp.data_ptr<float>() : nullptr;
  p.uniforms = uniforms.defined() ? uniforms.data_ptr<float>() : nullptr;
  p.inv_temperature = 1.0f / static_cast<float>(temperature);
  p.tokens = tokens.data_ptr<int64_t>();
  p.logits = logits.data_ptr<float>();
  p.confidences = conf_w.defined() ? confidences.data_ptr<float>() : nullptr;
  p.feature = rank > 0 ? feature.data_ptr() : nullptr;
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.tile_max = tile_max.data_ptr<float>();
  p.tile_arg = tile_arg.data_ptr<int>();
  p.tile_sum = uniforms.defined() ? tile_sum.data_ptr<float>() : nullptr;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(launch_select_and_prepare(p, kdtype, /*select_pos=*/-1, /*prepare_pos=*/0, stream));
  for (int pos = 0; pos < gamma; ++pos) {
    if (bias.defined()) at::mm_out(bias, feature, w2.t());  // cuBLAS, on the same stream
    C10_CUDA_CHECK(launch_logits(p, kdtype, pos, fused_bias, stream));
    C10_CUDA_CHECK(launch_select_and_prepare(p, kdtype, pos, pos + 1 < gamma ? pos + 1 : -1, stream));
  }
  return {tokens, logits, confidences};
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_hf, CUDA, m) { m.impl("serial_sample", &serial_sample_cuda); }

}  // namespace dspark_hf
