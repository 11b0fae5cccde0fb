"""Former home of the SmolLM2-135M-Instruct demo target: it lives in :mod:`dspark_hf.demo_target` now.

Kept so that ``from dspark_hf.training.smollm2 import load_smollm2`` (the README quickstart of
earlier versions) goes on working; the names below are the same objects as
:mod:`dspark_hf.demo_target`'s. New code imports from there.
"""

from ..demo_target import MASK_TOKEN, MODEL_NAME, dense_dir, gguf_path, is_available, load_smollm2, mask_token_id

__all__ = ["load_smollm2", "gguf_path", "dense_dir", "is_available", "mask_token_id", "MODEL_NAME", "MASK_TOKEN"]
