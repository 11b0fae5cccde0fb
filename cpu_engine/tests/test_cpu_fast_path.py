"""optimize_for_cpu: same numbers, same generations, safe with ties, saving, device_map and autograd."""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import dspark_cpu.fast_path as fast_path
import dspark_cpu.packed_kernels as packed_kernels
from dspark_cpu import optimize_for_cpu
from dspark_hf import FixedLengthPolicy
from dspark_cpu.fast_path import PackedLinear, is_optimized_for_cpu
from tiny_models import markov_draft, random_target, reload_half_on_disk, target_next_token_table

pytestmark = pytest.mark.skipif(fast_path.fast_path_unavailable_reason() is not None,
                                reason=f"oneDNN packed linears unavailable: {fast_path.fast_path_unavailable_reason()}")
# Both packed kernels where the row-block kernel runs on this CPU (x86 with AVX2, a compiler and ninja).
KERNELS = ["onednn"] + (["row_block"] if fast_path.row_block_usable(torch.float32) else [])


def _prompts(n, seed=0, vocab=48):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, int(torch.randint(4, 20, (1,), generator=generator))), generator=generator)
            for _ in range(n)]


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """No kernel choice remembered, in this process or on disk."""
    monkeypatch.setattr(packed_kernels, "_measured_choices", {})
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))


def _count_packed(model):
    return sum(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_and_greedy_generation_equal_the_stock_model(arch, kernel):
    stock = random_target(arch, num_layers=3)
    fast = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1, packed_kernel=kernel)
    assert {m._dspark_packed_kernel for m in fast.modules() if isinstance(m, PackedLinear)} == {kernel}
    assert _count_packed(fast) == sum(isinstance(m, torch.nn.Linear) for m in stock.modules()) > 0
    ids = torch.randint(0, 48, (2, 23))
    with torch.no_grad():
        expected, got = stock(ids).logits, fast(ids).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()
    for prompt in _prompts(6, seed=1):
        assert (fast.generate(prompt, max_new_tokens=24, do_sample=False).tolist()
                == stock.generate(prompt, max_new_tokens=24, do_sample=False).tolist())


@pytest.mark.parametrize("kernel", KERNELS)
def test_dspark_with_prepared_target_and_draft_is_identical_to_the_stock_target(kernel):
    stock = random_target("llama")
    target = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1, packed_kernel=kernel)
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    optimize_for_cpu(draft, packed_min_rows=1, packed_kernel=kernel)
    assert is_optimized_for_cpu(draft)
    for prompt in _prompts(4, seed=2):
        expected = stock.generate(prompt, max_new_tokens=30, do_sample=False)
        got = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert got.tolist() == expected.tolist()
    assert draft.last_generation_stats.accepted_tokens > 0


def test_idempotent():
    model = optimize_for_cpu(random_target("llama"), packed_min_rows=1)
    packed = {name: m._dspark_packed_weight[1] for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert optimize_for_cpu(model, packed_min_rows=1) is model
    again = {name: m._dspark_packed_weight[1] for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert packed.keys() == again.keys() and all(packed[k] is again[k] for k in packed)


def test_tied_embeddings_and_save_pretrained_write_ordinary_weights(tmp_path):
    torch.manual_seed(0)
    stock = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    assert stock.lm_head.weight is stock.model.embed_tokens.weight
    model = optimize_for_cpu(copy.deepcopy(stock), packed_min_rows=1)
    assert isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is untouched
    assert set(model.state_dict()) == set(stock.state_dict())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not is_optimized_for_cpu(reloaded)
    for name, tensor in stock.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    prompt = _prompts(1)[0]
    assert (model.generate(prompt, max_new_tokens=16, do_sample=False).tolist()
            == stock.generate(prompt, max_new_tokens=16, do_sample=False).tolist())


@pytest.mark.parametrize("kernel", KERNELS)
def test_weights_changed_after_packing_are_repacked(kernel):
    model = optimize_for_cpu(random_target("llama"), packed_min_rows=1, packed_kernel=kernel)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the version counter moves
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # replaced
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5)


def test_autograd_uses_the_stock_path():
    model = optimize_for_cpu(random_target("llama"), packed_min_rows=1)
    ids = torch.randint(0, 48, (1, 9))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_unhandled_dtypes_are_left_alone_and_logged(caplog):
    model = random_target("llama").to(torch.float64)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(model, packed_min_rows=1)
    assert _count_packed(model) == 0
    assert "dtype torch.float64" in caplog.text


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_packed_where_onednn_supports_it(dtype, kernel, tmp_path, caplog):
    stock = random_target("llama", num_layers=2).to(dtype)
    model = copy.deepcopy(stock)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(model, packed_min_rows=1, packed_kernel=kernel)
    reason = fast_path.fast_path_unavailable_reason(dtype)
    if reason is not None:  # this CPU (or build) has no oneDNN kernels for the dtype: left alone, said why
        assert _count_packed(model) == 0 and reason in caplog.text
        return
    assert _count_packed(model) == sum(isinstance(m, torch.nn.Linear) for m in stock.modules())
    # the row-block kernel keeps the weights' own dtype; oneDNN widens them where it has no kernel for the dtype
    kept = dtype if kernel == "row_block" else fast_path.kernel_dtype(dtype)
    assert model.model.layers[0].mlp.up_proj._packed_weight().dtype == kept
    ids = torch.randint(0, 48, (2, 9))
    with torch.no_grad():
        expected, got = stock(ids).logits.float(), model(ids).logits.float()
    assert got.dtype == expected.dtype and torch.allclose(got, expected, rtol=0.05, atol=0.05), (got - expected).abs().max()
    model.save_pretrained(tmp_path)  # the ordinary weights, in the model's dtype
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    for name, tensor in stock.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_a_half_precision_dtype_that_fails_its_probe_is_left_alone_with_the_reason(monkeypatch, caplog):
    real = fast_path.fast_path_unavailable_reason
    monkeypatch.setattr(fast_path, "fast_path_unavailable_reason",
                        lambda dtype=torch.float32: real(dtype) if dtype == torch.float32 else "the bf16 probe failed")
    model = random_target("llama").to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(model, packed_min_rows=1)
    assert _count_packed(model) == 0 and "the bf16 probe failed" in caplog.text


def test_missing_ops_fall_back_with_a_logged_reason(monkeypatch, caplog):
    def broken(x, packed, bias):
        return torch.zeros(*x.shape[:-1], 24)

    monkeypatch.setattr(packed_kernels, "_packed_linear", broken)
    reason = fast_path.fast_path_unavailable_reason()
    assert reason is not None and "different from F.linear" in reason
    model = random_target("llama")
    with caplog.at_level(logging.WARNING, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(model, packed_min_rows=1)
    assert _count_packed(model) == 0
    assert "keeping the stock linear layers" in caplog.text


def test_device_map_with_offloaded_layers(tmp_path, monkeypatch):
    stock = random_target("llama", num_layers=4)
    offloaded = reload_half_on_disk(stock, tmp_path)
    calls = []
    packed_forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: calls.append(1) or packed_forward(self, x))
    optimize_for_cpu(offloaded, packed_min_rows=1)
    calls.clear()
    assert isinstance(offloaded.model.layers[0].mlp.up_proj, PackedLinear)  # on the CPU: packed
    assert not isinstance(offloaded.model.layers[3].mlp.up_proj, PackedLinear)  # on disk: left alone
    draft = markov_draft(stock, target_next_token_table(stock), block_size=4)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    expected = stock.generate(prompt, max_new_tokens=16, do_sample=False)
    assert offloaded.generate(prompt, max_new_tokens=16, do_sample=False).tolist() == expected.tolist()
    got = offloaded.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist()
    assert calls  # accelerate's hooks route through the packed forward


def test_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        optimize_for_cpu("not a model")


def test_rows_below_the_crossover_keep_the_stock_kernel(monkeypatch):
    calls = []
    real = packed_kernels._packed_linear
    monkeypatch.setattr(packed_kernels, "_packed_linear", lambda *args: calls.append(args[0].shape) or real(*args))
    layer = optimize_for_cpu(torch.nn.Sequential(torch.nn.Linear(16, 8)), packed_min_rows=4, packed_kernel="onednn")[0]
    calls.clear()  # the feature probe's call
    with torch.no_grad():
        for rows in (1, 3):
            assert torch.equal(layer(torch.ones(1, rows, 16)), torch.nn.functional.linear(torch.ones(1, rows, 16), layer.weight, layer.bias))
        assert not calls
        layer(torch.ones(2, 2, 16))  # 4 rows in all: batch x tokens
        assert calls == [(2, 2, 16)]


def test_measured_kernel_and_crossover_are_cached_per_shape_and_bounded():
    from dspark_cpu.packed_kernels import _measured_choices, measure_packed_kernel

    weight = torch.randn(40, 24)
    kernel, rows = measure_packed_kernel(weight)
    assert kernel in KERNELS and 1 <= rows <= 17
    key = (40, 24, torch.get_num_threads(), torch.float32, tuple(KERNELS))
    assert _measured_choices[key] == (kernel, rows)
    _measured_choices[key] = ("onednn", 5)
    model = optimize_for_cpu(torch.nn.Sequential(torch.nn.Linear(24, 40)))
    # read from the cache, not measured again
    assert (model[0]._dspark_packed_kernel, model[0]._dspark_packed_min_rows) == ("onednn", 5)


def test_kernel_choices_are_kept_on_disk_per_environment(monkeypatch, fresh_choices, caplog):
    from dspark_cpu import kernel_choices

    timed = []
    monkeypatch.setattr(packed_kernels, "_best_seconds", lambda calls: timed.append(calls) or 1.0)
    assert packed_kernels.measure_packed_kernel(torch.randn(40, 24), ("onednn",)) == ("onednn", 17)  # never faster
    assert timed and kernel_choices.choices_path().is_file()
    timed.clear()
    monkeypatch.setattr(packed_kernels, "_measured_choices", {})  # a new process on the same machine
    assert packed_kernels.measure_packed_kernel(torch.randn(40, 24), ("onednn",)) == ("onednn", 17)
    assert not timed
    # another shape, dtype or candidate set is timed
    packed_kernels.measure_packed_kernel(torch.randn(40, 24).to(torch.bfloat16), ("onednn",))
    assert timed

    # another CPU (or torch, or kernel code) reads another file
    first_file = kernel_choices.choices_path()
    environment = kernel_choices._environment()
    monkeypatch.setattr(kernel_choices, "_environment", lambda: {**environment, "cpu_model": "Another CPU"})
    assert kernel_choices.choices_path() != first_file
    monkeypatch.setattr(packed_kernels, "_measured_choices", {})
    timed.clear()
    packed_kernels.measure_packed_kernel(torch.randn(40, 24), ("onednn",))
    assert timed

    # a damaged file is reported and replaced by the new measurement; an entry naming another kernel is ignored
    kernel_choices.choices_path().write_text("{not json")
    monkeypatch.setattr(packed_kernels, "_measured_choices", {})
    timed.clear()
    with caplog.at_level(logging.WARNING, logger="dspark_cpu.kernel_choices"):
        assert packed_kernels.measure_packed_kernel(torch.randn(40, 24), ("onednn",)) == ("onednn", 17)
    assert timed and "Ignoring the kernel-choice cache" in caplog.text
    key = (40, 24, torch.get_num_threads(), torch.float32, ("onednn",))
    assert kernel_choices.load_choice(key) == ("onednn", 17)
    kernel_choices.store_choice(key, ("row_block", 1))
    assert kernel_choices.load_choice(key) is None


def test_an_unwritable_kernel_choice_cache_warns_once(monkeypatch, tmp_path, fresh_choices, caplog):
    blocker = tmp_path / "not a folder"
    blocker.write_text("")
    monkeypatch.setenv("DSPARK_HF_CACHE", str(blocker))  # kernel_choices/ cannot be made under a file
    monkeypatch.setattr(packed_kernels, "_best_seconds", lambda calls: 1.0)
    with caplog.at_level(logging.WARNING, logger="dspark_cpu.kernel_choices"):
        packed_kernels.measure_packed_kernel(torch.randn(40, 24), ("onednn",))
        packed_kernels.measure_packed_kernel(torch.randn(48, 24), ("onednn",))
    assert caplog.text.count("Could not write the kernel-choice cache") == 1


def test_bad_packed_min_rows_is_refused():
    with pytest.raises(ValueError, match="packed_min_rows"):
        optimize_for_cpu(torch.nn.Sequential(torch.nn.Linear(4, 4)), packed_min_rows=0)


def test_half_precision_without_onednn_kernels_runs_through_float32_copies(monkeypatch, tmp_path, caplog):
    # Any CPU: pretend oneDNN has no bf16 kernels (AVX2-only CPUs), as kernel_dtype reports there.
    for module in (fast_path, packed_kernels):  # it packs (cpu_packed_kernels) and sizes the copies (cpu_fast_path)
        monkeypatch.setattr(module, "kernel_dtype", lambda dtype: torch.float32)
    stock = random_target("llama", num_layers=2).to(torch.bfloat16)
    model = copy.deepcopy(stock)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(model, packed_min_rows=1, packed_kernel="onednn")
    assert "float32 copies of their weights" in caplog.text
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, PackedLinear) and layer._packed_weight().dtype == torch.float32
    ids = torch.randint(0, 48, (2, 9))
    with torch.no_grad():
        expected, got = stock(ids).logits, model(ids).logits
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected.float(), rtol=0.05, atol=0.05), (got.float() - expected.float()).abs().max()
    # widened, multiplied in float32, rounded back: what a bf16 matmul that sums in float32 gives
    x = torch.randn(3, 5, layer.in_features).to(torch.bfloat16)
    with torch.no_grad():
        reference = torch.nn.functional.linear(x.float(), layer.weight.float(), None).to(torch.bfloat16)
        assert torch.allclose(layer(x).float(), reference.float(), rtol=1e-2, atol=1e-2)
    model.save_pretrained(tmp_path)  # the ordinary bf16 weights
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, tensor in stock.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_prepared_model_can_be_deep_copied_and_pickled(tmp_path, kernel):
    model = optimize_for_cpu(random_target("llama", num_layers=2), packed_min_rows=1, packed_kernel=kernel)
    ids = torch.randint(0, 48, (1, 7))
    with torch.no_grad():
        expected = model(ids).logits
        clone = copy.deepcopy(model)  # the opaque packed copies are not copied: the clone packs its own
        assert torch.equal(clone(ids).logits, expected) and is_optimized_for_cpu(clone)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert torch.equal(loaded(ids).logits, expected)


def test_crossover_probe_stops_at_the_first_losing_size_from_the_top(monkeypatch, fresh_choices):
    measured = []

    def fake_best_seconds(calls):
        call = calls[0]
        rows = call.args[0].shape[1]
        packed = call.func is packed_kernels._run_packed
        if packed:
            measured.append(rows)
        # packed wins at 6+ rows and, out of order, at 2 rows; 3 and 4 lose
        return (0.5 if rows >= 6 or rows == 2 else 1.0) if packed else 1.0

    monkeypatch.setattr(packed_kernels, "_best_seconds", fake_best_seconds)
    assert packed_kernels.measure_packed_kernel(torch.randn(40, 24), ("onednn",)) == ("onednn", 6)
    assert measured == [16, 12, 8, 6, 4, 4]  # the loss at 4 is measured twice; 3, 2 and 1 are never timed


@pytest.mark.skipif("row_block" not in KERNELS, reason="the row-block kernel does not run on this machine")
def test_the_kernel_that_costs_least_over_the_probed_sizes_is_chosen(monkeypatch, tmp_path, fresh_choices):
    def fake_best_seconds(calls):
        func = calls[0].func
        if func is torch.nn.functional.linear:
            return 1.0
        if func is packed_kernels._run_packed:  # oneDNN: twice as fast from 6 rows, slower below
            return 0.5 if calls[0].args[0].shape[1] >= 6 else 1.5
        return 0.6  # the row-block kernel: 0.6 at every size

    monkeypatch.setattr(packed_kernels, "_best_seconds", fake_best_seconds)
    # oneDNN: 4 x 0.5 + 4 x 1.0 (F.linear below its crossover) = 6.0; row-block: 8 x 0.6 = 4.8
    assert packed_kernels.measure_packed_kernel(torch.randn(40, 24)) == ("row_block", 1)
    monkeypatch.setattr(packed_kernels, "_measured_choices", {})
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "another cache"))
    # at 0.8 every size the row-block kernel costs 6.4: oneDNN, from its crossover of 6 rows
    monkeypatch.setattr(packed_kernels, "_best_seconds", lambda calls: 0.8 if calls[0].func not in
                        (torch.nn.functional.linear, packed_kernels._run_packed) else fake_best_seconds(calls))
    assert packed_kernels.measure_packed_kernel(torch.randn(40, 24)) == ("onednn", 6)


def test_crossover_probe_reads_distinct_weight_copies(monkeypatch, fresh_choices):
    seen = []
    monkeypatch.setattr(packed_kernels, "_best_seconds", lambda calls: seen.append(calls) or 1.0)
    monkeypatch.setattr(packed_kernels, "_PROBE_BYTES", 40 * 24 * 4 * 8)  # room for 8 copies of a 40x24 fp32 weight
    packed_kernels.measure_packed_kernel(torch.randn(40, 24))
    for calls in seen:  # stock and every kernel (oneDNN's packed copies are opaque: told apart by identity)
        weights = [call.args[1] for call in calls]
        assert len(weights) == 8 and len({id(w) if w.is_mkldnn else w.data_ptr() for w in weights}) == 8


def test_packed_copies_that_would_not_fit_in_memory_are_not_made(monkeypatch, caplog):
    model = random_target("llama", num_layers=2)
    needed = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(fast_path, "available_memory_bytes", lambda: needed)  # 80% of it is not enough
    with caplog.at_level(logging.WARNING, logger="dspark_cpu.fast_path"):
        optimize_for_cpu(model, packed_min_rows=1)
    assert _count_packed(model) == 0 and "packed copies need" in caplog.text and "Free memory" in caplog.text
    monkeypatch.setattr(fast_path, "available_memory_bytes", lambda: 2 * needed)
    optimize_for_cpu(model, packed_min_rows=1)
    assert _count_packed(model) > 0


def test_available_memory_is_read_where_the_system_reports_it():
    import os

    available = fast_path.available_memory_bytes()
    if not os.path.exists("/proc/meminfo"):
        assert available is None
        return
    total_kb = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal:")).split()[1])
    assert available is not None and 0 < available <= total_kb * 1024
