// The CPU kernels compiled into one extension by cpu_engine/dspark_cpu/extension.py (bindings: cpu_bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

namespace dspark_cpu {

// cpu_row_block_linear.cpp
torch::Tensor row_block_linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features,
                               const c10::optional<torch::Tensor>& bias);
std::string cpu_isa();
std::string isa();
void set_isa(const std::string& name);

// cpu_few_query_attention.cpp
torch::Tensor few_query_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  const c10::optional<torch::Tensor>& mask, double scale);

// cpu_rms_norm.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t lanes);

// cpu_rotary.cpp
std::tuple<torch::Tensor, torch::Tensor> rotary_embedding(const torch::Tensor& query, const torch::Tensor& key,
                                                          const torch::Tensor& cos, const torch::Tensor& signed_sin);

// cpu_kv_append.cpp
c10::optional<std::tuple<torch::Tensor, torch::Tensor>> append_key_value(
    const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& key_buffer,
    const torch::Tensor& value_buffer, const torch::Tensor& key, const torch::Tensor& value);

}  // namespace dspark_cpu
