// A step's keys and values written into the spare room of a layer's cache buffers (cpu_engine/dspark_cpu/kv_cache.py):
// one call checks that the layer still holds views of the leading part of its buffers with room for the new tokens,
// copies them in and returns the longer views. From Python the checks and the four ops (two copies, two views) cost
// as much as the torch.cat they replace on a 256-token context (benchmarks/kv_append.py; measured:
// docs/performance.md).

#include "cpu_kernels.h"

#include <cstdint>
#include <cstring>

namespace dspark_cpu {
namespace {

// Whether `rows` [B, H, n, D] (D contiguous) fits `buffer` [B, H, capacity, D] (contiguous) from `at` on.
bool fits(const torch::Tensor& buffer, const torch::Tensor& rows, int64_t at) {
  return rows.device().is_cpu() && rows.dim() == 4 && rows.scalar_type() == buffer.scalar_type() && rows.stride(3) == 1 &&
         rows.size(0) == buffer.size(0) && rows.size(1) == buffer.size(1) && rows.size(3) == buffer.size(3) &&
         at + rows.size(2) <= buffer.size(2);
}

// Whether `stored` is buffer[:, :, :length] for some length (what cpu_kv_cache.py left there, maybe cropped since).
bool leading_view(const torch::Tensor& stored, const torch::Tensor& buffer) {
  return buffer.device().is_cpu() && buffer.dim() == 4 && buffer.is_contiguous() && stored.dim() == 4 &&
         stored.scalar_type() == buffer.scalar_type() && stored.data_ptr() == buffer.data_ptr() &&
         stored.strides() == buffer.strides() && stored.size(0) == buffer.size(0) && stored.size(1) == buffer.size(1) &&
         stored.size(3) == buffer.size(3);
}

void write_rows(const torch::Tensor& buffer, const torch::Tensor& rows, int64_t at) {
  const int64_t element = rows.element_size(), row_bytes = rows.size(3) * element;
  char* out = static_cast<char*>(buffer.data_ptr());
  const char* in = static_cast<const char*>(rows.data_ptr());
  for (int64_t b = 0; b < rows.size(0); ++b)
    for (int64_t h = 0; h < rows.size(1); ++h)
      for (int64_t t = 0; t < rows.size(2); ++t)
        std::memcpy(out + (b * buffer.stride(0) + h * buffer.stride(1) + (at + t) * buffer.stride(2)) * element,
                    in + (b * rows.stride(0) + h * rows.stride(1) + t * rows.stride(2)) * element, row_bytes);
}

}  // namespace

c10::optional<std::tuple<torch::Tensor, torch::Tensor>> append_key_value(
    const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& key_buffer,
    const torch::Tensor& value_buffer, const torch::Tensor& key, const torch::Tensor& value) {
  if (!leading_view(keys, key_buffer) || !leading_view(values, value_buffer) || keys.size(2) != values.size(2))
    return c10::nullopt;
  const int64_t length = keys.size(2);
  if (!fits(key_buffer, key, length) || !fits(value_buffer, value, length) || key.size(2) != value.size(2))
    return c10::nullopt;
  write_rows(key_buffer, key, length);
  write_rows(value_buffer, value, length);
  const int64_t end = length + key.size(2);
  return std::make_tuple(key_buffer.narrow(2, 0, end), value_buffer.narrow(2, 0, end));
}

}  // namespace dspark_cpu
