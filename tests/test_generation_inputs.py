"""Prompt forms and cache settings around DSpark generation: inputs_embeds, use_cache=False."""

import pytest
import torch

from dspark_hf import FixedLengthPolicy
from tiny_models import markov_draft, random_target, target_next_token_table

VOCAB, BLOCK = 48, 4


def _target_and_draft(arch="llama"):
    target = random_target(arch, context_scale=0.5)
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    return target, draft


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_inputs_embeds_only_identical_to_target(arch):
    target, draft = _target_and_draft(arch)
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for length in (1, 6, 15):
        ids = torch.randint(1, VOCAB, (1, length), generator=gen)
        embeds = target.get_input_embeddings()(ids)
        expected = target.generate(inputs_embeds=embeds, max_new_tokens=25, do_sample=False)
        got = target.generate(inputs_embeds=embeds, max_new_tokens=25, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist() and got.shape[1] == 25
        rounds = [(r.verified, r.accepted) for r in draft.last_generation_stats.rounds]
        # The draft's context lines up with the embedded prompt: it drafts exactly as from input_ids.
        target.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=draft)
        assert rounds == [(r.verified, r.accepted) for r in draft.last_generation_stats.rounds]
        accepted += draft.last_generation_stats.accepted_tokens
    assert accepted > 0


def test_padded_inputs_embeds_are_refused():
    target, draft = _target_and_draft()
    embeds = target.get_input_embeddings()(torch.tensor([[0, 0, 5, 9, 13]]))
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="inputs_embeds needs a prompt without padding"):
        target.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=5, assistant_model=draft)


def test_batched_inputs_embeds_are_refused():
    target, draft = _target_and_draft()
    embeds = target.get_input_embeddings()(torch.tensor([[3, 5, 9], [4, 6, 8]]))
    with pytest.raises(ValueError, match="takes the prompts as input_ids, but inputs_embeds was passed"):
        target.generate(inputs_embeds=embeds, max_new_tokens=5, assistant_model=draft)


@pytest.mark.parametrize("rows", [1, 2])
def test_use_cache_false_is_refused_at_every_batch_size(rows):
    target, draft = _target_and_draft()
    ids = torch.randint(1, VOCAB, (rows, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="use_cache=False"):
        target.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, assistant_model=draft)
