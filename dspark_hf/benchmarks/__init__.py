"""Benchmark tooling: how fast and how well DSpark drafts on real prompts.

* :mod:`~dspark_hf.benchmarks.bench_cli`: ``dspark-hf bench``, built from
  :mod:`~dspark_hf.benchmarks.runner` (methods, interleaved runs),
  :mod:`~dspark_hf.benchmarks.batch_sweep` (batch sizes), :mod:`~dspark_hf.benchmarks.summary`
  (metrics, tables) and :mod:`~dspark_hf.benchmarks.plots`;
* :mod:`~dspark_hf.benchmarks.acceptance`: accepted length tau and per-position acceptance, its
  command line in :mod:`~dspark_hf.benchmarks.evaluate_cli` (``dspark-hf evaluate``, or
  ``python -m dspark_hf.benchmarks.evaluation``, which keeps the library's names);
* :mod:`~dspark_hf.benchmarks.profile_cli`: ``dspark-hf profile``, the target's step-rate curve;
* :mod:`~dspark_hf.benchmarks.prompt_sets` and ``eval_prompts/``: the shipped prompt sets;
* :mod:`~dspark_hf.benchmarks.shipped_drafts`: where the repository's SmolLM2 drafts are;
* :mod:`~dspark_hf.benchmarks.environment`: the environment record stored with every result.
* :mod:`~dspark_hf.benchmarks.measuring`: the mean time of a call (CUDA events or perf_counter) and
  the JSON result file, shared by ``benchmarks/``, ``examples/bench_serial_op.py`` and ``tests/gpu``.

Nothing is imported here, so ``python -m dspark_hf.benchmarks.<module>`` runs each module once.
"""
