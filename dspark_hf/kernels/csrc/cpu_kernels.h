// The CPU kernels compiled into one extension by dspark_hf/kernels/cpu_extension.py (bindings: cpu_bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <string>

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

}  // namespace dspark_cpu
