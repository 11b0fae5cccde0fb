// Python bindings of dspark_hf's CPU kernels (cpu_kernels.h).
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_block_linear", &dspark_cpu::row_block_linear,
        "x @ W.T + b with W packed in 16-column blocks (AVX2 or AVX-512)");
  m.def("cpu_isa", &dspark_cpu::cpu_isa, "the widest row-block path this CPU offers: avx2, avx512 or avx512_bf16");
  m.def("isa", &dspark_cpu::isa, "the row-block path in use now");
  m.def("set_isa", &dspark_cpu::set_isa, "use this row-block path (at most the CPU's) from now on");
  m.def("few_query_attention", &dspark_cpu::few_query_attention,
        "attention of a few query tokens over a KV cache, each token alone (AVX2 + FMA)");
  m.def("rms_norm", &dspark_cpu::rms_norm,
        "transformers' RMSNorm with PyTorch's roundings and summation order (lanes: its vector width)");
  m.def("rotary_embedding", &dspark_cpu::rotary_embedding,
        "query and key rotated: x * cos + roll(x, D/2) * signed_sin, rounded as PyTorch's separate ops (AVX2)");
  m.def("append_key_value", &dspark_cpu::append_key_value,
        "a step's keys and values written behind the cached views of two buffers; the longer views, or None where "
        "the views are not the buffers' leading part or the rows do not fit");
}
