"""Training tooling: data, the trainer and calibration.

* :mod:`~dspark_hf.training.trainer`: the paper's training recipe (:class:`TrainingConfig`,
  the loss, packed blocks, :func:`train`);
* :mod:`~dspark_hf.training.calibration`: Sequential Temperature Scaling of the confidence head;
* :mod:`~dspark_hf.training.pipeline`: ``dspark-hf train`` for any target, stage by stage (answers,
  features, training, calibration, card and export), its command line in
  :mod:`~dspark_hf.training.train_cli` (``python -m dspark_hf.training``);
* :mod:`~dspark_hf.training.target_loading`: ``--target`` resolved (presets, folders, Hub ids) and the
  target's logits as its family computes them;
* :mod:`~dspark_hf.training.features`: the target's features, cached in chunks or computed online;
* :mod:`~dspark_hf.training.distributed`: several processes (data parallel) and atomic files;
* :mod:`~dspark_hf.training.prompts`: the ``--prompts`` JSONL file;
* :mod:`~dspark_hf.training.data`: ShareGPT prompts answered by the target (chat formatting and EOS
  trimming live in :mod:`dspark_hf.chat_text`; ``data`` still re-exports them);
* :mod:`~dspark_hf.training.datagen` and :mod:`~dspark_hf.training.prompt_sources`: the on-policy
  corpus at scale (``python -m dspark_hf.training.datagen``);
* :mod:`~dspark_hf.training.smollm2`: a re-export of :mod:`dspark_hf.demo_target` (SmolLM2-135M-Instruct,
  the offline demo target), kept for older code.

Nothing is imported here, so ``python -m dspark_hf.training.<module>`` runs each module once.
"""
