"""The draft's context cache in buffers with spare room: what torch.cat gives, the block never stored,
one buffer while it has room, and concatenation wherever autograd records or tensors were replaced."""

import pytest
import torch

from dspark_hf import DSparkDraftModel
from dspark_hf import kv_buffers
from dspark_hf.model.draft_context_cache import DraftContextCache
from tiny_models import random_target


def _kv(generator, tokens, batch=2, heads=2, dim=8):
    return (torch.randn(batch, heads, tokens, dim, generator=generator),
            torch.randn(batch, heads, tokens, dim, generator=generator))


def test_appends_and_blocks_equal_concatenation_and_blocks_are_not_kept(monkeypatch):
    monkeypatch.setattr(kv_buffers, "SPARE_TOKENS", 5)  # grows several times
    generator = torch.Generator().manual_seed(0)
    cache, context_keys, context_values = DraftContextCache(1), None, None
    buffers = set()
    for tokens in (6, 2, 1, 3, 4, 1, 7, 2):
        keys, values = _kv(generator, tokens)
        cache.append(0, keys, values)
        context_keys = keys if context_keys is None else torch.cat([context_keys, keys], dim=2)
        context_values = values if context_values is None else torch.cat([context_values, values], dim=2)
        assert torch.equal(cache.keys[0], context_keys) and torch.equal(cache.values[0], context_values)
        block_keys, block_values = _kv(generator, 4)
        joined_keys, joined_values = cache.with_block(0, block_keys, block_values)
        assert torch.equal(joined_keys, torch.cat([context_keys, block_keys], dim=2))
        assert torch.equal(joined_values, torch.cat([context_values, block_values], dim=2))
        assert cache.keys[0].shape[2] == context_keys.shape[2]  # the block is not part of the context
        buffers.add(cache.keys[0].data_ptr())
        assert joined_keys.data_ptr() == cache.keys[0].data_ptr()  # written behind it, not copied with it
    assert 1 < len(buffers) < 8


def test_an_empty_cache_gives_the_block_alone():
    cache = DraftContextCache(2)
    keys, values = _kv(torch.Generator().manual_seed(1), 3)
    assert cache.with_block(1, keys, values) == (keys, values)


def test_replaced_tensors_and_autograd_take_concatenation():
    generator = torch.Generator().manual_seed(2)
    cache = DraftContextCache(1)
    cache.append(0, *_kv(generator, 5))
    cache.keys[0], cache.values[0] = cache.keys[0][1:].clone(), cache.values[0][1:].clone()  # batched compaction
    keys, values = _kv(generator, 2, batch=1)
    expected = torch.cat([cache.keys[0], keys], dim=2)
    cache.append(0, keys, values)
    assert torch.equal(cache.keys[0], expected)

    trained = DraftContextCache(1)  # training: keys carry gradients, so nothing is written in place
    keys, values = (t.requires_grad_() for t in _kv(generator, 3))
    trained.append(0, keys * 2, values * 2)
    block_keys, block_values = _kv(generator, 2)
    joined_keys, _ = trained.with_block(0, block_keys, block_values)
    assert type(joined_keys.grad_fn).__name__ == "CatBackward0"
    joined_keys.sum().backward()
    assert torch.equal(keys.grad, torch.full_like(keys, 2.0))


@pytest.mark.parametrize("block_size", [4, 6])
def test_draft_rounds_equal_the_concatenating_cache_bit_for_bit(block_size, monkeypatch):
    target = random_target("llama", num_layers=4)
    draft = DSparkDraftModel.from_target(target, block_size=block_size, markov_rank=8, num_hidden_layers=2).eval()
    draft.bind_target(target)
    monkeypatch.setattr(kv_buffers, "SPARE_TOKENS", 3)
    features = torch.randn(1, 40, len(draft.config.target_layer_ids) * target.config.hidden_size,
                           generator=torch.Generator().manual_seed(3))

    def rounds(in_place: bool):
        with monkeypatch.context() as patch:
            if not in_place:
                patch.setattr(kv_buffers, "joinable", lambda stored, new: False)
            cache, outputs, length = draft.new_cache(), [], 0
            with torch.no_grad():
                for accepted in (9, 2, 1, 5, 3, 1, 4):
                    draft.add_context(cache, features[:, length:length + accepted],
                                      torch.arange(length, length + accepted)[None])
                    length += accepted
                    block = torch.full((1, block_size), draft.config.mask_token_id)
                    out = draft(block, torch.arange(length, length + block_size)[None], cache)
                    outputs.append((out.hidden_states, out.logits))
            return outputs, cache

    (in_place, cache), (concatenated, reference) = rounds(True), rounds(False)
    assert any(b[0] is not None for b in cache._buffers) and all(b[0] is None for b in reference._buffers)
    for (hidden, logits), (want_hidden, want_logits) in zip(in_place, concatenated):
        assert torch.equal(hidden, want_hidden) and torch.equal(logits, want_logits)
