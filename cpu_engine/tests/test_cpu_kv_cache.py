"""Keys and values written in place (cpu_kv_cache): the same cache contents and model outputs as
transformers' concatenation, in one buffer while it has room, and the stock update wherever it does not apply."""

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import dspark_cpu.decoder as cpu_decoder
import dspark_cpu.extension as cpu_extension
import dspark_cpu.kv_cache as cpu_kv_cache
from dspark_hf import kv_buffers
from dspark_cpu.decoder import use_lean_decoder
from dspark_cpu.kv_cache import append_to_cache
from tiny_models import random_target


@pytest.fixture(params=["compiled", "python"])
def path(request, monkeypatch):
    """Each test runs with the compiled append (csrc/cpu_kv_append.cpp) and with the Python one alone."""
    if request.param == "compiled":
        if cpu_extension.extension_problem() is not None:
            pytest.skip(f"the CPU extension is not available here: {cpu_extension.extension_problem()}")
    else:
        monkeypatch.setattr(cpu_kv_cache.extension, "loaded_extension", lambda: None)
    return request.param


def _states(generator, tokens, batch=2, heads=3, dim=8, dtype=torch.float32):
    key = torch.randn(batch, tokens, heads, dim, generator=generator).to(dtype).transpose(1, 2)  # as projections give
    value = torch.randn(batch, heads, tokens, dim, generator=generator).to(dtype)
    return key, value


def _two_caches():
    return DynamicCache(), DynamicCache()


def test_appends_crops_and_growth_give_what_torch_cat_gives(monkeypatch, path):
    monkeypatch.setattr(kv_buffers, "SPARE_TOKENS", 4)  # small room, so the buffer grows several times
    generator = torch.Generator().manual_seed(0)
    stock, in_place = _two_caches()
    buffers_seen = set()
    for tokens, crop in [(7, 0), (1, 0), (3, 2), (1, 0), (5, 1), (1, 0), (9, 0), (2, 2), (2, 0)]:
        for layer_idx in range(2):
            key, value = _states(generator, tokens)
            want = stock.update(key, value, layer_idx)
            got = append_to_cache(in_place, key, value, layer_idx)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            layer = in_place.layers[layer_idx]
            assert got[0] is layer.keys and got[1] is layer.values
            key_buffer, value_buffer = layer.__dict__[cpu_kv_cache._BUFFERS_ATTRIBUTE]
            assert layer.keys.data_ptr() == key_buffer.data_ptr() and layer.values.data_ptr() == value_buffer.data_ptr()
            if layer_idx == 0:
                buffers_seen.add(key_buffer.data_ptr())
        if crop:
            stock.crop(-crop), in_place.crop(-crop)
        assert stock.get_seq_length() == in_place.get_seq_length()
    assert 1 < len(buffers_seen) < 9  # it grew, but not every step


def test_steps_with_room_write_into_the_same_buffer(path):
    generator = torch.Generator().manual_seed(1)
    cache = DynamicCache()
    append_to_cache(cache, *_states(generator, 10), 0)
    buffer = cache.layers[0].__dict__[cpu_kv_cache._BUFFERS_ATTRIBUTE][0]
    assert buffer.shape[2] == 10 + kv_buffers.SPARE_TOKENS
    for _ in range(5):
        append_to_cache(cache, *_states(generator, 3), 0)
        cache.crop(-1)
        assert cache.layers[0].__dict__[cpu_kv_cache._BUFFERS_ATTRIBUTE][0] is buffer
    assert cache.get_seq_length() == 20


def test_tensors_replaced_from_outside_start_a_fresh_buffer(path):
    """batch_select_indices (batched decoding drops finished rows) and reorder_cache assign new tensors."""
    generator = torch.Generator().manual_seed(2)
    stock, in_place = _two_caches()
    first = _states(generator, 6)
    stock.update(*first, 0)
    append_to_cache(in_place, *first, 0)
    for cache in (stock, in_place):
        cache.batch_select_indices(torch.tensor([1]))
    old_buffer = in_place.layers[0].__dict__[cpu_kv_cache._BUFFERS_ATTRIBUTE][0]
    key, value = _states(generator, 2, batch=1)
    want, got = stock.update(key, value, 0), append_to_cache(in_place, key, value, 0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert in_place.layers[0].__dict__[cpu_kv_cache._BUFFERS_ATTRIBUTE][0] is not old_buffer
    assert torch.equal(old_buffer[1, :, :6], want[0][0, :, :6])  # the new buffer started from the selected row


def test_other_layers_and_mismatched_states_take_the_stock_update(monkeypatch, path):
    generator = torch.Generator().manual_seed(3)
    calls = []
    original = DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    cache = DynamicCache()
    append_to_cache(cache, *_states(generator, 4), 0)
    assert not calls
    # a dtype torch.cat would promote: the stock update's result, whatever it is
    key, value = _states(generator, 1, dtype=torch.float64)
    stock = copy.deepcopy(cache)
    want = stock.layers[0].update(key, value)
    got = append_to_cache(cache, key, value, 0)
    assert len(calls) == 2 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got))
    # a different number of heads: torch.cat's own error, not a silent reshape
    with pytest.raises(RuntimeError):
        append_to_cache(cache, *_states(generator, 1, heads=2), 0)

    class OwnLayer(DynamicLayer):  # a subclass may store differently: its own update runs
        pass

    cache = DynamicCache()
    cache.layers.append(OwnLayer())
    calls.clear()
    append_to_cache(cache, *_states(generator, 2), 0)
    assert calls and cpu_kv_cache._BUFFERS_ATTRIBUTE not in cache.layers[0].__dict__


def test_a_sliding_window_layer_keeps_its_own_update():
    model = random_target("mistral-sliding", num_layers=1)
    cache = DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(4)
    key, value = _states(generator, 3, batch=1, heads=2, dim=8)
    append_to_cache(cache, key, value, 0)
    assert type(cache.layers[0]) is not DynamicLayer
    assert cpu_kv_cache._BUFFERS_ATTRIBUTE not in cache.layers[0].__dict__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_decoder_writes_in_place_with_outputs_equal_bit_for_bit(dtype, monkeypatch, path):
    monkeypatch.setattr(kv_buffers, "SPARE_TOKENS", 3)
    stock = random_target("llama", num_layers=2).to(dtype)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    assert lean.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE].append_in_place
    ids = torch.randint(1, 48, (2, 30), generator=torch.Generator().manual_seed(5))
    caches = [DynamicCache(config=stock.config) for _ in range(2)]
    position = 0
    with torch.no_grad():
        for tokens, rejected in [(9, 0), (4, 2), (1, 0), (5, 3), (3, 0), (6, 1), (1, 0)]:
            new = ids[:, position:position + tokens]
            want, got = (model(input_ids=new, cache=cache).logits for model, cache in zip((stock, lean), caches))
            assert torch.equal(want, got)
            for cache in caches:
                cache.crop(-rejected)
            position += tokens - rejected
    assert cpu_kv_cache._BUFFERS_ATTRIBUTE in caches[1].layers[0].__dict__
    assert cpu_kv_cache._BUFFERS_ATTRIBUTE not in caches[0].layers[0].__dict__
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_greedy_generation_with_a_growing_buffer_equals_the_stock_model(monkeypatch, path):
    monkeypatch.setattr(kv_buffers, "SPARE_TOKENS", 5)
    stock = random_target("qwen3", num_layers=2)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    prompt = torch.randint(1, 48, (1, 11), generator=torch.Generator().manual_seed(6))
    settings = dict(do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0)
    assert torch.equal(stock.generate(prompt, **settings), lean.generate(prompt, **settings))


def test_a_probe_difference_turns_writing_in_place_off(monkeypatch):
    """If strided keys gave attention other numbers here, the lean decoder would use the stock update."""
    model = random_target("llama", num_layers=2)

    def shifted(cache, key, value, layer_idx):  # stands in for an attention that reads strided keys differently
        keys, values = cache.update(key, value, layer_idx)
        return keys, values * (1 + 1e-3)

    with monkeypatch.context() as patch:
        patch.setattr(cpu_decoder, "append_to_cache", shifted)
        assert use_lean_decoder(model)
        plan = model.model.__dict__[cpu_decoder._INSTALLED_ATTRIBUTE]
        assert not plan.append_in_place


def test_the_compiled_append_refuses_what_it_cannot_write_in_place():
    if cpu_extension.extension_problem() is not None:
        pytest.skip(f"the CPU extension is not available here: {cpu_extension.extension_problem()}")
    kernels = cpu_extension.loaded_extension()
    generator = torch.Generator().manual_seed(7)
    key_buffer, value_buffer = torch.zeros(2, 3, 6, 8), torch.zeros(2, 3, 6, 8)
    keys, values = key_buffer.narrow(2, 0, 4), value_buffer.narrow(2, 0, 4)
    key, value = _states(generator, 2)
    filled = kernels.append_key_value(keys, values, key_buffer, value_buffer, key, value)
    assert filled is not None and torch.equal(filled[0][:, :, 4:], key) and torch.equal(filled[1][:, :, 4:], value)
    assert filled[0].data_ptr() == key_buffer.data_ptr() and filled[0].shape[2] == 6
    refused = {
        "no room": (keys, values, *_states(generator, 3)),
        "a copy, not a view": (keys.clone(), values, key, value),
        "rows selected": (key_buffer[1:].narrow(2, 0, 4), value_buffer[1:].narrow(2, 0, 4), *_states(generator, 1, batch=1)),
        "another dtype": (keys, values, key.double(), value.double()),
        "other heads": (keys, values, *_states(generator, 1, heads=2)),
        "keys and values of different lengths": (keys, value_buffer.narrow(2, 0, 3), key, value),
        "head dim not contiguous": (keys, values, key.transpose(2, 3).contiguous().transpose(2, 3), value),
    }
    for case, (stored_keys, stored_values, new_key, new_value) in refused.items():
        before = key_buffer.clone()
        assert kernels.append_key_value(stored_keys, stored_values, key_buffer, value_buffer, new_key, new_value) is None, case
        assert torch.equal(key_buffer, before), case


def test_beam_search_and_repeated_rows_equal_the_stock_model(path):
    """Beam search reorders the cache and num_return_sequences repeats its rows: both assign new tensors."""
    stock = random_target("llama", num_layers=2)
    lean = copy.deepcopy(stock)
    assert use_lean_decoder(lean)
    prompt = torch.randint(1, 48, (2, 7), generator=torch.Generator().manual_seed(8))
    for settings in (dict(num_beams=3, do_sample=False, max_new_tokens=12),
                     dict(num_beams=3, num_return_sequences=2, do_sample=False, max_new_tokens=10),
                     dict(do_sample=False, max_new_tokens=300, min_new_tokens=300)):  # past one buffer's room
        want, got = (model.generate(prompt, pad_token_id=0, **settings) for model in (stock, lean))
        assert torch.equal(want, got), settings
