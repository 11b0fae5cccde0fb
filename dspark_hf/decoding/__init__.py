"""The decoding path: the generate() dispatch, the batch-1 candidate generator, the batched loop,
the round contract they share, the serial sampling loop and the compiled CUDA op that replaces it on a GPU
(``cuda_ops``, ``cuda_graphs``, sources in ``csrc/``), context lookup, stopping and settings."""
