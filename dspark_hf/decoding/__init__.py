"""The decoding path: the generate() dispatch, the batch-1 candidate generator, the batched loop,
the round contract they share, the serial sampling loop, context lookup, stopping and settings."""
