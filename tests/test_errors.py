"""Bad input raises a ValueError that names the problem and the fix."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark_hf import DSparkConfig, DSparkDraftModel, FixedLengthPolicy, PrefixScheduler
from tiny_models import markov_draft, random_target, target_next_token_table

PROMPT = torch.tensor([[1, 2, 3, 4]])


def _draft_for(target, **kwargs):
    return DSparkDraftModel.from_target(target, block_size=4, markov_rank=8, **kwargs)


def test_vocab_mismatch():
    draft = _draft_for(random_target(vocab_size=48))
    other = random_target(vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size 48 != target vocab_size 64.*trained for this target"):
        other.generate(PROMPT, max_new_tokens=5, assistant_model=draft)


def test_hidden_size_mismatch():
    draft = _draft_for(random_target(hidden_size=32))
    other = random_target(hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size 32 != target hidden_size 48"):
        other.generate(PROMPT, max_new_tokens=5, assistant_model=draft)


def test_layer_ids_against_a_shallower_target():
    draft = _draft_for(random_target(num_layers=6), target_layer_ids=[1, 3, 4])
    shallow = random_target(num_layers=4)
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 3, 4\] do not fit the target's 4 layers"):
        shallow.generate(PROMPT, max_new_tokens=5, assistant_model=draft)


@pytest.mark.parametrize(
    "ids,match",
    [([2, 1], "strictly increasing"), ([1, 1], "strictly increasing"), ([-2, 1], ">= -1"),
     ([1, 3], "last layer"), ([1, 5], "last layer"), ([], "empty")],
)
def test_bad_target_layer_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        _draft_for(random_target(num_layers=4), target_layer_ids=ids)


def test_mask_token_outside_embedding_table():
    with pytest.raises(ValueError, match="mask_token_id 48 is outside the embedding table"):
        _draft_for(random_target(vocab_size=48), mask_token_id=48)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(markov_head_type="lstm"), "markov_head_type must be one of"),
     (dict(markov_rank=-1), "markov_rank must be >= 0"),
     (dict(block_size=0), "block_size must be >= 1"),
     (dict(markov_rank=0, enable_confidence_head=True, confidence_head_with_markov=True), "needs a Markov head"),
     (dict(confidence_temperatures=[1.0, 2.0]), "confidence_temperatures must hold block_size=7")],
)
def test_bad_config_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DSparkConfig(target_layer_ids=[0], mask_token_id=0, **kwargs)


def test_num_beams():
    target = random_target()
    draft = markov_draft(target, target_next_token_table(target))
    with pytest.raises(ValueError, match="num_beams=2.*Use num_beams=1.*does not support beam search"):
        target.generate(PROMPT, max_new_tokens=5, num_beams=2, assistant_model=draft)


def test_confidence_policy_on_a_dflash_draft():
    target = random_target()
    draft = markov_draft(target, target_next_token_table(target))  # no confidence head
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.8])
    with pytest.raises(ValueError, match="needs confidences.*FixedLengthPolicy"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=draft)


def test_dspark_checkpoint_loaded_as_a_plain_model():
    """AutoModel on a DeepSpec folder builds a plain Qwen3 model; using it as a draft must fail loudly."""
    target = random_target("qwen3")
    config = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         architectures=["Qwen3DSparkModel"], block_size=4, target_layer_ids=[1], mask_token_id=47)
    impostor = Qwen3ForCausalLM(config)
    with pytest.raises(ValueError, match="not a DSpark draft.*DSparkDraftModel.from_pretrained"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=impostor)


def test_draft_without_embeddings_used_standalone():
    draft = _draft_for(random_target())
    fresh = DSparkDraftModel(draft.config)
    fresh.embed_tokens = None
    with pytest.raises(ValueError, match="bind_target"):
        fresh(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None])


def test_bad_policy_arguments():
    with pytest.raises(ValueError):
        FixedLengthPolicy(-1)
    with pytest.raises(ValueError, match="non-increasing"):
        PrefixScheduler([1.0, 2.0])
