"""Fast kernels: the CUDA serial-sampling op with CUDA graphs, and the CPU fast path."""
