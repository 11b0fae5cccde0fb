"""Token ids in and out of a chat model: prompts with the chat template, answers cut at EOS.

Shared by the tools that talk to a target through text: ``dspark-hf bench`` and ``evaluate``
(:mod:`dspark_hf.benchmarks`), the training data (:mod:`dspark_hf.training.data`,
:mod:`dspark_hf.training.datagen`) and ``benchmarks/`` scripts. Not part of the decoding path (no
runtime module imports it); these helpers lived in ``dspark_hf.training.data``, which still
re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase


def trim_after_eos(tokens: list[int], eos_ids: Iterable[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (all of them when there is none)."""
    eos_ids = set(eos_ids)
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: position + 1]
    return tokens


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt appended."""
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` carries a chat template (instruct models do; base models usually not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, turns: list[dict] | None = None) -> list[int]:
    """Token ids the target answers: the chat template with the generation prompt when the tokenizer
    has one, else plain text (base models).

    ``turns`` (``[{"role", "content"}, ...]``, ending with a user turn) is a conversation; without it
    the prompt is one user turn, ``text``. As plain text a conversation is its turns' contents joined
    by blank lines, tokenised with the tokenizer's own special tokens (its BOS, when it adds one).
    """
    messages = list(turns) if turns else [{"role": "user", "content": text}]
    if has_chat_template(tokenizer):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"])


__all__ = ["chat_prompt_ids", "encode_prompt", "has_chat_template", "trim_after_eos"]
