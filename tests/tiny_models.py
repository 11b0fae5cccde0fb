"""Tiny local models for the tests (no downloads).

* :func:`random_target` - a small random Llama, Qwen2, Qwen3 or Mistral causal LM.
* :func:`bigram_target` - a target whose next-token logits are a designed table ``T[current token]``
  (attention and MLP outputs zeroed, one-hot embeddings), so its exact distribution is known.
* :func:`tiny_tokenizer` - a word-level tokenizer with a chat template, built offline.
* :func:`markov_draft` - a DSpark draft whose proposals come only from its Markov head, set to a
  designed table ``D[previous token]``; with ``D`` close to the target's own next-token map the
  draft is right often but not always, which exercises every accepted length.
* :func:`reload_half_on_disk` - a saved 4-layer Llama loaded back with two layers offloaded to disk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dspark_hf import DSparkDraftModel


def random_target(arch: str = "llama", vocab_size: int = 48, hidden_size: int = 32, num_layers: int = 4,
                  seed: int = 0, eos_token_id=None, context_scale: float = 1.0,
                  embed_scale: float = 1.0):
    """A random tiny causal LM; ``context_scale`` < 1 shrinks attention/MLP outputs so the
    current token dominates the next-token choice (while context still matters)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=None)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden_size // 4, tie_word_embeddings=False))
    elif arch == "qwen2":  # biases on the q/k/v projections
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif arch in ("mistral", "mistral-sliding"):
        window = 6 if arch == "mistral-sliding" else None
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window, tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(context_scale)
            layer.mlp.down_proj.weight.mul_(context_scale)
    return model.eval()


def bigram_target(table: torch.Tensor, arch: str = "llama", eos_token_id=None):
    """A real transformers model computing next-token logits ``table[current token]`` (V x V)."""
    vocab = table.shape[0]
    hidden = 2 * vocab
    model = random_target(arch, vocab_size=vocab, hidden_size=hidden, num_layers=2, eos_token_id=eos_token_id)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros(vocab, hidden)
        embed[torch.arange(vocab), torch.arange(vocab)] = 1.0
        model.get_input_embeddings().weight.copy_(embed)
        model.model.norm.weight.fill_(1.0)
        # RMSNorm(e_i) = sqrt(hidden) * e_i, so column i of the head holds table[i] / sqrt(hidden).
        head = torch.zeros(vocab, hidden)
        head[:, :vocab] = table.T / hidden**0.5
        model.get_output_embeddings().weight.copy_(head)
    return model.eval()


def target_next_token_table(target) -> torch.Tensor:
    """The target's next-token logits given only the current token, ``(V, V)``: its bigram part."""
    with torch.no_grad():
        embed = target.get_input_embeddings().weight
        return target.get_output_embeddings()(target.model.norm(embed)).float()


def markov_draft(target, table: torch.Tensor, block_size: int = 4, confidence_logits: torch.Tensor | None = None,
                 head_type: str = "vanilla", draft_vocab_ids=None) -> DSparkDraftModel:
    """A draft proposing ``softmax(table[previous token])`` at every position.

    The backbone output is zeroed (final norm weight 0, so ``U_k = 0``) and the Markov head
    realises ``table`` exactly: ``W1`` = identity rows, ``W2`` = ``table.T``. ``confidence_logits[v]``
    sets ``c_k = sigmoid(confidence_logits[x_{k-1}])``. With ``draft_vocab_ids`` (a reduced draft
    vocabulary) it proposes ``softmax(table[previous token, ids])`` on those ids only.
    """
    vocab = table.shape[0]
    draft = DSparkDraftModel.from_target(target, block_size=block_size, markov_rank=vocab,
                                         markov_head_type=head_type,
                                         confidence_head=confidence_logits is not None,
                                         draft_vocab_ids=draft_vocab_ids).eval()
    with torch.no_grad():
        draft.norm.weight.zero_()
        draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        rows = table.T if draft_vocab_ids is None else table.T[draft.draft_vocab_ids]
        draft.markov_head.markov_w2.weight.copy_(rows.contiguous())
        if head_type == "gated":  # gate saturated open: sigmoid(40) = 1
            draft.markov_head.gate_proj.weight.zero_()
            draft.markov_head.gate_proj.bias.fill_(40.0)
        if confidence_logits is not None:
            proj = draft.confidence_head.proj
            proj.weight.zero_()
            proj.weight[0, draft.config.hidden_size:] = confidence_logits
            proj.bias.zero_()
    return draft


def tiny_tokenizer(words: list[str]):
    """A word-level fast tokenizer over ``words`` (+ ``<unk>``, ``<eos>``) with a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}answer {% endif %}")
    return tokenizer


# Layers 0 and 1 on the CPU, 2 and 3 on disk: how accelerate loads a target too large for memory.
HALF_ON_DISK = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu",
                "model.rotary_emb": "cpu", "lm_head": "cpu"}


def reload_half_on_disk(model, folder: Path):
    """``model`` (a 4-layer :func:`random_target` Llama) saved under ``folder/target`` and loaded back
    with the :data:`HALF_ON_DISK` device map: accelerate's hooks bring layers 2 and 3 in from
    ``folder/offload`` for every forward."""
    if model.config.num_hidden_layers != 4:
        raise ValueError(f"HALF_ON_DISK maps 4 layers; the model has {model.config.num_hidden_layers} "
                         "(build it with random_target(num_layers=4)).")
    model.save_pretrained(folder / "target")
    return AutoModelForCausalLM.from_pretrained(folder / "target", device_map=HALF_ON_DISK,
                                                offload_folder=str(folder / "offload"))


def gemma_like_target(vocab_size: int = 40_000, hidden_size: int = 32, num_layers: int = 4, *,
                      activation_scale: float = 1e6, seed: int = 0, eos_token_id: int = 1):
    """A tiny Gemma 3 text model with the properties real families have and SmolLM2 lacks: a large
    vocabulary (above the reduced-draft-vocabulary threshold), norms stored as offsets (``1 + w``),
    embeddings scaled by ``sqrt(hidden)``, sliding-window layers beside a global one, tied embeddings,
    and a residual stream beyond float16's range: as in real models, a large norm weight (here the
    first layer's post-MLP norm, ``1 + w = activation_scale``) writes values near 1e5 into the residual
    stream, and the final norm brings the logits back to a normal range."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                              num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=hidden_size // 4, sliding_window=8, query_pre_attn_scalar=hidden_size // 4,
                              max_position_embeddings=512, bos_token_id=0, eos_token_id=eos_token_id,
                              pad_token_id=None, tie_word_embeddings=True,
                              layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"])
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():  # offsets away from 0, so the 1 + w convention matters
            if type(module).__name__ == "Gemma3RMSNorm":
                module.weight.uniform_(-0.5, 0.5)
        model.model.layers[0].post_feedforward_layernorm.weight.fill_(activation_scale - 1.0)
        model.get_input_embeddings().weight.mul_(30.0)  # peaked next-token distributions, as trained models have
    return model.eval()
