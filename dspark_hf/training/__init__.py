"""Training tooling: data, the trainer, calibration and the demo target.

* :mod:`~dspark_hf.training.trainer`: the paper's training recipe (:class:`TrainingConfig`,
  the loss, packed blocks, :func:`train`);
* :mod:`~dspark_hf.training.calibration`: Sequential Temperature Scaling of the confidence head;
* :mod:`~dspark_hf.training.train_cli`: ``python -m dspark_hf.training`` / ``dspark-hf train``;
* :mod:`~dspark_hf.training.data`: ShareGPT prompts answered by the target, chat formatting;
* :mod:`~dspark_hf.training.datagen` and :mod:`~dspark_hf.training.prompt_sources`: the on-policy
  corpus at scale (``python -m dspark_hf.training.datagen``);
* :mod:`~dspark_hf.training.smollm2`: SmolLM2-135M-Instruct, the offline demo target (the
  benchmarks use it too).

Nothing is imported here, so ``python -m dspark_hf.training.<module>`` runs each module once.
"""
