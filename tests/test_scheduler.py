"""Tests for the verification policies (dspark_hf.scheduling.policies), the drafting gate and the SPS profiler
(dspark_hf.scheduling.step_rates), and for the dspark_hf.scheduler names kept for compatibility."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dspark_hf.scheduler
from dspark_hf.scheduling.cost_model import monotone_step_times
from dspark_hf.scheduling.drafting_gate import DraftingGate
from dspark_hf.scheduling.policies import FixedLengthPolicy, PrefixScheduler, ThresholdPolicy, VerifyPolicy
from dspark_hf.scheduling.step_rates import profile_sps, sps_cache_key
from generation_helpers import offered_count


# ---------------------------------------------------------------------------------------------
# PrefixScheduler, one request
# ---------------------------------------------------------------------------------------------


def test_worked_example_from_design():
    scheduler = PrefixScheduler([1000, 520, 400, 340, 280])
    confidences = [0.95, 0.92, 0.85, 0.30]
    thetas = scheduler.throughputs(confidences)
    assert thetas == pytest.approx([1000.0, 1014.0, 1129.6, 1212.7, 1061.1], abs=0.1)
    assert scheduler.admit(confidences) == 3


def _anticipating_search(sps: list[float], confidences: list[float]) -> int:
    """The WRONG scheduler of the paper's Appendix A: evaluates every k, returns the global argmax."""
    thetas = [sps[0]]
    expected, survival = 1.0, 1.0
    for k, c in enumerate(confidences, start=1):
        survival *= c
        expected += survival
        thetas.append(sps[k] * expected)
    return max(range(len(thetas)), key=lambda k: thetas[k])


@pytest.mark.parametrize("c2", [0.9, 0.0])
def test_appendix_a_early_stop_is_non_anticipating(c2):
    sps = [1.0, 0.5, 0.45]
    scheduler = PrefixScheduler(sps)
    thetas = scheduler.throughputs([0.8, c2])
    # Theta_0 = 1.0, Theta_1 = 1.8 * 0.5 = 0.9 <= Theta_0: stop before c2 is ever looked at.
    assert thetas == pytest.approx([1.0, 0.9])
    assert scheduler.admit([0.8, c2]) == 0


def test_appendix_a_global_search_would_depend_on_the_token():
    sps = [1.0, 0.5, 0.45]
    # c2 is computed from x1: the global search admits x1 or not depending on x1 itself.
    assert _anticipating_search(sps, [0.8, 0.9]) == 2  # Theta_2 = 2.52 * 0.45 = 1.134
    assert _anticipating_search(sps, [0.8, 0.0]) == 0  # Theta_2 = 1.8 * 0.45 = 0.81


def _first_token_distribution(policy) -> tuple[float, float]:
    """Exact output distribution of the first token in the Appendix A setting.

    Vocabulary {A, B}; target (0.7, 0.3), draft (0.5, 0.5); c1 = 0.8 known before drafting; c2 is
    0.9 when x1 = A and 0.0 when x1 = B. Standard speculative sampling on the admitted prefix.
    """
    p_target = {"A": 0.7, "B": 0.3}
    p_draft = {"A": 0.5, "B": 0.5}
    c2_given_x1 = {"A": 0.9, "B": 0.0}
    residual_total = sum(max(0.0, p_target[v] - p_draft[v]) for v in p_target)
    residual = {v: max(0.0, p_target[v] - p_draft[v]) / residual_total for v in p_target}
    out = {"A": 0.0, "B": 0.0}
    for x1, q in p_draft.items():
        keep = policy([0.8, c2_given_x1[x1]])
        if keep >= 1:
            accept = min(1.0, p_target[x1] / p_draft[x1])
            out[x1] += q * accept
            for v in out:
                out[v] += q * (1.0 - accept) * residual[v]
        else:  # not verified: the target samples the token itself
            for v in out:
                out[v] += q * p_target[v]
    return out["A"], out["B"]


def test_scheduler_keeps_the_target_distribution():
    sps = [1.0, 0.5, 0.45]
    assert _first_token_distribution(PrefixScheduler(sps).admit) == pytest.approx((0.7, 0.3))
    # Without the early stop the output is biased, as in the paper.
    biased = _first_token_distribution(lambda c: _anticipating_search(sps, c))
    assert biased == pytest.approx((0.85, 0.15))


def _random_table(rng: random.Random, length: int) -> list[float]:
    table = [rng.uniform(50.0, 100.0)]
    for _ in range(length - 1):
        table.append(table[-1] * rng.uniform(0.6, 1.0))
    return table


def test_admission_of_k_depends_only_on_first_k_confidences():
    rng = random.Random(1234)
    for _ in range(300):
        gamma = rng.randint(1, 8)
        scheduler = PrefixScheduler(_random_table(rng, rng.randint(1, 10)))
        confidences = [rng.choice([rng.random(), 1.0, 0.0]) for _ in range(gamma)]
        keep = scheduler.admit(confidences)
        for k in range(1, gamma + 1):
            other = confidences[:k] + [rng.random() for _ in range(gamma - k)]
            assert (scheduler.admit(other) >= k) == (keep >= k)


def test_flat_table_admits_every_positive_confidence():
    scheduler = PrefixScheduler([5.0] * 6)
    assert scheduler.admit([0.5, 0.1, 0.9, 0.01]) == 4
    assert scheduler.admit([0.5, 0.1, 0.9, 0.01, 0.3]) == 5


def test_steep_table_admits_nothing():
    scheduler = PrefixScheduler([1.0, 0.4, 0.3, 0.25, 0.2])  # SPS(2) = SPS(1) / 2.5
    assert scheduler.admit([0.99, 0.99, 0.99, 0.99]) == 0
    assert scheduler.admit([1.0, 1.0, 1.0, 1.0]) == 0


def test_zero_confidence_stops_before_it():
    scheduler = PrefixScheduler([5.0] * 6)
    assert scheduler.admit([0.5, 0.0, 0.9]) == 1
    assert scheduler.admit([0.0, 0.9]) == 0
    assert PrefixScheduler([1000, 520, 400, 340, 280]).admit([0.95, 0.92, 0.0, 0.9]) == 2


def test_empty_confidences_and_tensor_input():
    scheduler = PrefixScheduler([1000, 520, 400, 340, 280])
    assert scheduler.admit([]) == 0
    assert scheduler.throughputs([]) == [1000.0]
    assert scheduler.admit(torch.tensor([0.95, 0.92, 0.85, 0.30])) == 3


def test_invalid_confidences_raise():
    scheduler = PrefixScheduler([1.0, 1.0])
    for bad in ([1.5], [-0.1], [float("nan")]):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            scheduler.admit(bad)
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            scheduler.admit_batch([[0.5], bad])


def test_extrapolation_beyond_the_table():
    scheduler = PrefixScheduler([10.0, 8.0])
    assert scheduler.step_rate(1) == 10.0
    assert scheduler.step_rate(2) == 8.0
    assert scheduler.step_rate(4) == pytest.approx(8.0 * 2 / 4)
    assert scheduler.step_rate(16) == pytest.approx(1.0)
    # Flat table of two entries: with c = 1 everywhere Theta stays at SPS(2) * 2 beyond it.
    flat = PrefixScheduler([10.0, 10.0])
    assert flat.throughputs([1.0, 1.0, 1.0]) == pytest.approx([10.0, 20.0, 20.0])
    assert flat.admit([1.0, 1.0, 1.0]) == 1
    # Extrapolation decides: B = 3 -> SPS = 20/3; Theta_2 = (1 + .9 + .81) * 20/3 = 18.07 < 19.
    assert flat.throughputs([0.9, 0.9]) == pytest.approx([10.0, 19.0, 2.71 * 20 / 3])
    with pytest.raises(ValueError):
        scheduler.step_rate(0)


# ---------------------------------------------------------------------------------------------
# PrefixScheduler, many requests
# ---------------------------------------------------------------------------------------------


def test_batch_hand_computed():
    # The batched forward is a rectangle: R rows x W = 1 + the longest admitted position, so
    # Theta = E * SPS(R * W), and opening column j adds a_{r,j} of every row that has one.
    scheduler = PrefixScheduler([100, 100, 90, 80, 60, 50])
    # a: r0 = 0.9, 0.72; r1 = 0.5, 0.25. W=1, B=2: best = 200; column 1: W=2, B=4:
    # (2 + 0.9 + 0.5) * 80 = 272; column 2: W=3, B=6: (3.4 + 0.72 + 0.25) * 50 = 218.5 stop.
    confidences = [[0.9, 0.8], [0.5, 0.5]]
    assert scheduler.batch_throughputs(confidences) == pytest.approx([200.0, 272.0, 218.5])
    assert scheduler.admit_batch(confidences) == [1, 1]
    # a: r0 = 0.9, 0.45; r1 = 0.6, 0.3: column 1: 3.5 * 80 = 280; column 2: 4.25 * 50 = 212.5 stop.
    assert scheduler.batch_throughputs([[0.9, 0.5], [0.6, 0.5]]) == pytest.approx([200.0, 280.0, 212.5])
    assert scheduler.admit_batch([[0.9, 0.5], [0.6, 0.5]]) == [1, 1]


def test_a_column_no_single_row_pays_for_is_opened_by_the_rows_together():
    # Eight rows; one more column costs 29% (T(16) / T(8) as measured for SmolLM2 at R = 8 on
    # the 2-core AMD EPYC). No row's first position (a = 0.6) pays for the column alone
    # (8.6 / 8 < 1.29), all eight together do (12.8 / 8 > 1.29).
    table = [1 / 56.9] * 15 + [1 / 73.5] * 8 + [1 / 87.9] * 8
    scheduler = PrefixScheduler(table)
    lengths = scheduler.admit_batch([[0.6, 0.5]] * 8)
    assert lengths == [1] * 8
    # c_2 = 0.5: a column adds 8 * 0.3 = 2.4 to E = 12.8; 15.2 / 12.8 < 87.9 / 73.5, so it stops.
    assert scheduler.batch_throughputs([[0.6, 0.5]] * 8) == pytest.approx(
        [8 / 56.9, 12.8 / 73.5, 15.2 / 87.9])
    # Too little confidence in the column: nothing is verified.
    assert scheduler.admit_batch([[0.2]] * 8) == [0] * 8


def test_batch_three_requests_hand_computed():
    scheduler = PrefixScheduler([100, 100, 100, 100, 100, 90, 80, 70, 60])
    # a: r0 = 0.5; r1 = 0.95, 0.285; r2 = 0.9. W=1, B=3: 300; column 1: W=2, B=6:
    # (3 + 0.5 + 0.95 + 0.9) * 90 = 481.5; column 2: W=3, B=9: 5.635 * 60 = 338.1 stop.
    confidences = [[0.5], [0.95, 0.3], [0.9]]
    assert scheduler.batch_throughputs(confidences) == pytest.approx([300.0, 481.5, 338.1])
    assert scheduler.admit_batch(confidences) == [1, 1, 1]
    # A lookup copy of 2 tokens already makes the forward 3 wide: every position up to j = 2 is
    # free and verified. W=3, B=9: 5.635 * 60 = 338.1, and no column is left to open.
    assert scheduler.batch_throughputs(confidences, min_width=3) == pytest.approx([338.1])
    assert scheduler.admit_batch(confidences, min_width=3) == [1, 2, 1]


def test_batch_columns_hand_computed():
    scheduler = PrefixScheduler([10, 10, 10, 10, 10, 10, 1])
    # c = 1: column 1 W=2 B=4: 4 * 10 = 40; column 2 W=3 B=6: 60; column 3 needs W=4, B=8,
    # past the table: SPS = 1 * 7 / 8, 8 * 7 / 8 = 7: stop.
    assert scheduler.admit_batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]) == [2, 2]
    assert scheduler.batch_throughputs([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]) == pytest.approx([20, 40, 60, 7])
    # Rows of different lengths: a: r0 = 0.7; r1 = 0.8, 0.8, 0.4. Column 1: 3.5 * 10 = 35;
    # column 2 (row 1 only): 4.3 * 10 = 43; column 3: 4.7 * 7 / 8 stop.
    assert scheduler.admit_batch([[0.7], [0.8, 1.0, 0.5]]) == [1, 2]


def test_batch_of_one_equals_single_request():
    rng = random.Random(7)
    for _ in range(200):
        scheduler = PrefixScheduler(_random_table(rng, rng.randint(1, 9)))
        confidences = [rng.choice([rng.random(), 1.0, 0.0, 0.99]) for _ in range(rng.randint(0, 8))]
        assert scheduler.admit_batch([confidences]) == [scheduler.admit(confidences)]
        if all(c > 0 for c in confidences):  # the batch path skips a = 0 candidates altogether
            assert scheduler.batch_throughputs([confidences]) == pytest.approx(scheduler.throughputs(confidences))


def test_batch_is_non_anticipating_and_admits_prefixes():
    rng = random.Random(99)
    for _ in range(200):
        num_requests = rng.randint(1, 4)
        scheduler = PrefixScheduler(_random_table(rng, rng.randint(1, 30)))
        batch = [[rng.choice([rng.random(), 1.0, 0.9]) for _ in range(rng.randint(0, 6))] for _ in range(num_requests)]
        lengths = scheduler.admit_batch(batch)
        assert all(0 <= n <= len(c) for n, c in zip(lengths, batch))
        # Whether (r, j) is admitted never depends on c_{r, j+1..} (computed from x_{r,j} onwards).
        for r, confidences in enumerate(batch):
            for j in range(1, len(confidences) + 1):
                changed = [list(c) for c in batch]
                changed[r] = confidences[:j] + [rng.random() for _ in range(len(confidences) - j)]
                assert (scheduler.admit_batch(changed)[r] >= j) == (lengths[r] >= j)


def test_batch_empty():
    assert PrefixScheduler([1.0]).admit_batch([]) == []
    assert PrefixScheduler([1.0, 1.0]).admit_batch([[], []]) == [0, 0]


# ---------------------------------------------------------------------------------------------
# Table validation and the other policies
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table, message",
    [
        ([], "empty"),
        ([1.0, float("nan")], "finite"),
        ([float("inf"), 1.0], "finite"),
        ([1.0, 0.0], "> 0"),
        ([1.0, -2.0], "> 0"),
        ([1.0, 2.0], "non-increasing"),
        (["fast"], "sequence of numbers"),
    ],
)
def test_bad_tables_raise_with_the_fix(table, message):
    with pytest.raises(ValueError, match=message) as info:
        PrefixScheduler(table)
    assert "profile_sps" in str(info.value)


def test_fixed_length_policy():
    policy = FixedLengthPolicy(3)
    assert isinstance(policy, VerifyPolicy)
    assert policy.requires_confidences is False
    assert policy.admit([0.0] * 7) == 3
    assert policy.admit([0.0] * 2) == 2
    assert policy.admit([]) == 0
    assert policy.admit_batch([[0.1] * 7, [0.1], []]) == [3, 1, 0]
    assert FixedLengthPolicy(0).admit([1.0] * 5) == 0
    with pytest.raises(ValueError, match="gamma"):
        FixedLengthPolicy(-1)
    with pytest.raises(ValueError, match="integer"):
        FixedLengthPolicy(2.5)


def test_threshold_policy():
    policy = ThresholdPolicy(0.5)
    assert policy.requires_confidences is True
    # prefix products 0.9, 0.72, 0.504, 0.252
    assert policy.admit([0.9, 0.8, 0.7, 0.5]) == 3
    assert policy.admit([0.4, 1.0]) == 0
    assert policy.admit([]) == 0
    # Stops at the first failure, never looks further.
    assert policy.admit([0.9, 0.5, 1.0]) == 1
    assert policy.admit_batch([[0.9, 0.8, 0.7, 0.5], [0.4], [1.0, 1.0]]) == [3, 0, 2]
    assert ThresholdPolicy(1.0).admit([1.0, 1.0, 0.999]) == 2
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            ThresholdPolicy(bad)


# ---------------------------------------------------------------------------------------------
# monotone_step_times
# ---------------------------------------------------------------------------------------------


def test_monotone_step_times_pools_a_dip():
    assert monotone_step_times([1.0, 1.2, 1.1, 1.3]) == pytest.approx([1.0, 1.15, 1.15, 1.3])
    # A dip deeper than one neighbour is pooled with several.
    assert monotone_step_times([1.0, 1.3, 1.2, 0.8, 2.0]) == pytest.approx([1.0, 1.1, 1.1, 1.1, 2.0])


def test_monotone_step_times_keeps_a_cliff():
    times = [1.0, 1.0, 1.01, 2.0, 2.0, 2.02]
    assert monotone_step_times(times) == pytest.approx(times)
    noisy_cliff = [1.0, 1.01, 2.0, 1.98, 2.02]
    assert monotone_step_times(noisy_cliff) == pytest.approx([1.0, 1.01, 1.99, 1.99, 2.02])


def test_monotone_step_times_is_non_decreasing_and_preserves_mean():
    rng = random.Random(5)
    for _ in range(100):
        times = [rng.uniform(0.5, 2.0) for _ in range(rng.randint(1, 20))]
        fitted = monotone_step_times(times)
        assert len(fitted) == len(times)
        assert all(b >= a - 1e-12 for a, b in zip(fitted, fitted[1:]))
        assert sum(fitted) == pytest.approx(sum(times))
    assert monotone_step_times([]) == []


# ---------------------------------------------------------------------------------------------
# profile_sps
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    # One intra-op thread: for a model this small, waking a thread pool costs more than the
    # forward itself (and makes these tests slow on busy machines).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    yield LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)


PROFILE_KWARGS = dict(context_length=32, warmup=1, repeats=2, progress=False)


def _count_forwards(model, monkeypatch):
    calls = []
    original = model.forward

    @functools.wraps(original)
    def counting(*args, **kwargs):
        record = {k: v for k, v in kwargs.items() if k != "input_ids"} | {"n": kwargs["input_ids"].shape[1]}
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        record["cached_before"] = cache.get_seq_length()  # what the step saw
        calls.append(record)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    return calls


def test_profile_sps_measures_and_caches(tiny_llama, tmp_path, monkeypatch):
    model = tiny_llama
    calls = _count_forwards(model, monkeypatch)
    table = profile_sps(model, 4, cache_dir=tmp_path, **PROFILE_KWARGS)
    assert len(table) == 4
    assert all(isinstance(v, float) and v > 0 for v in table)
    assert all(b <= a for a, b in zip(table, table[1:]))
    PrefixScheduler(table)  # a valid table

    # One prefill of the context, then (warmup + repeats) rounds over B = 1..4.
    assert calls[0]["n"] == 32
    timed = calls[1:]
    assert sorted(c["n"] for c in timed) == sorted([1, 2, 3, 4] * 3)
    for c in timed:
        assert c["use_cache"] is True and c["logits_to_keep"] == c["n"]
        assert "cache" in c and "past_key_values" not in c  # the non-deprecated 5.24 name
        assert c["cached_before"] == 32  # the cache is rolled back to the context after every step
    assert timed[-1]["cache"].get_seq_length() == 32
    assert model.training is False

    files = list((tmp_path / "sps").glob("*.json"))
    assert [f.stem for f in files] == [sps_cache_key(model, 4, context_length=32)]
    record = json.loads(files[0].read_text())
    assert record["sps"] == pytest.approx(table)
    assert len(record["median_step_seconds"]) == 4
    assert record["fitted_step_seconds"] == pytest.approx([1.0 / v for v in table])
    assert record["environment"]["dtype"] == "torch.float32"
    assert record["environment"]["device_type"] == "cpu"

    # Second call: served from the cache, the model is not run.
    def boom(*args, **kwargs):
        raise AssertionError("the model must not run when the table is cached")

    monkeypatch.setattr(model, "forward", boom)
    assert profile_sps(model, 4, cache_dir=tmp_path, **PROFILE_KWARGS) == table
    # A shorter table is served from the longer one.
    assert profile_sps(model, 3, cache_dir=tmp_path, **PROFILE_KWARGS) == table[:3]
    # A longer one, or a different context, is not in the cache.
    with pytest.raises(AssertionError, match="must not run"):
        profile_sps(model, 5, cache_dir=tmp_path, **PROFILE_KWARGS)
    with pytest.raises(AssertionError, match="must not run"):
        profile_sps(model, 4, cache_dir=tmp_path, **(PROFILE_KWARGS | {"context_length": 16}))
    # use_cache=False measures again.
    with pytest.raises(AssertionError, match="must not run"):
        profile_sps(model, 4, cache_dir=tmp_path, use_cache=False, **PROFILE_KWARGS)


def test_profile_sps_large_tables_measure_a_grid(tiny_llama, tmp_path, monkeypatch):
    calls = _count_forwards(tiny_llama, monkeypatch)
    table = profile_sps(tiny_llama, 21, cache_dir=tmp_path, dense_up_to=4, stride=8, **PROFILE_KWARGS)
    assert len(table) == 21 and all(b <= a for a, b in zip(table, table[1:]))
    assert sorted({c["n"] for c in calls[1:]}) == [1, 2, 3, 4, 12, 20, 21]
    record = json.loads(next((tmp_path / "sps").glob("*.json")).read_text())
    assert record["measured_sizes"] == [1, 2, 3, 4, 12, 20, 21]
    medians = record["median_step_seconds"]
    # B = 8 lies halfway between the measured 4 and 12
    assert medians[7] == pytest.approx((medians[3] + medians[11]) / 2)


def test_profile_sps_cache_dir_from_env_and_restores_training_mode(tiny_llama, tmp_path, monkeypatch):
    model = tiny_llama
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "env_cache"))
    model.train()
    try:
        table = profile_sps(model, 2, **PROFILE_KWARGS)
        assert model.training is True
    finally:
        model.eval()
    assert len(table) == 2
    assert len(list((tmp_path / "env_cache" / "sps").glob("*.json"))) == 1


def test_cache_key_changes_with_max_tokens_dtype_and_context(tiny_llama):
    model = tiny_llama
    key = sps_cache_key(model, 4, context_length=32)
    assert key == sps_cache_key(model, 4, context_length=32)
    assert key != sps_cache_key(model, 8, context_length=32)
    assert key != sps_cache_key(model, 4, context_length=64)
    model.to(torch.bfloat16)
    try:
        assert key != sps_cache_key(model, 4, context_length=32)
    finally:
        model.to(torch.float32)
    assert key == sps_cache_key(model, 4, context_length=32)


def test_profile_sps_rebuilds_when_the_cache_cannot_be_cropped(tiny_llama, tmp_path, monkeypatch):
    from transformers import DynamicCache

    def no_crop(self, *args, **kwargs):
        raise NotImplementedError("not croppable")

    monkeypatch.setattr(DynamicCache, "crop", no_crop)
    table = profile_sps(tiny_llama, 3, cache_dir=tmp_path, **PROFILE_KWARGS)
    assert len(table) == 3 and all(v > 0 for v in table)


def test_profile_sps_argument_validation(tiny_llama, tmp_path):
    for kwargs in ({"max_tokens": 0}, {"max_tokens": 2, "repeats": 0}, {"max_tokens": 2, "context_length": 0}):
        with pytest.raises(ValueError, match=">= "):
            profile_sps(tiny_llama, cache_dir=tmp_path, progress=False, **kwargs)


def test_from_model_builds_a_scheduler(tiny_llama, tmp_path):
    scheduler = PrefixScheduler.from_model(tiny_llama, 3, cache_dir=tmp_path, **PROFILE_KWARGS)
    assert len(scheduler.sps) == 3
    assert 0 <= scheduler.admit([0.9, 0.9, 0.9]) <= 3


# ----------------------------------------------------------------------------- drafting gate


def test_drafting_gate_explores_then_skips_with_probes():
    gate = DraftingGate(window=4, probe_every=5, min_rounds=2, probe_budget=10.0, warmup_rounds=0)  # probe_every governs
    assert gate.should_draft()  # nothing observed yet
    gate.record_drafted(1, 0.15)  # 1 token in 150 ms: a draft that never hits
    assert gate.should_draft()  # fewer than min_rounds drafted rounds
    gate.record_drafted(1, 0.15)
    assert gate.should_draft()  # no plain step timed yet: cannot compare
    gate.record_plain(0.06)  # a plain step: 1 token in 60 ms beats 1 in 150 ms
    decisions = [gate.should_draft() for _ in range(10)]
    assert decisions == [False, False, False, False, True] * 2  # one probe in every probe_every rounds


def test_drafting_gate_spaces_costly_probes_to_keep_within_its_budget():
    gate = DraftingGate(window=4, probe_every=5, min_rounds=1, warmup_rounds=0)  # probe_budget 2%
    gate.record_drafted(16, 0.30)  # a batch of 16 rows: a drafted round costs 300 ms
    gate.record_plain(0.12, tokens=16)  # a plain batched step 120 ms: 133 tokens/s beats 53
    assert gate.probe_interval() == 75  # (0.30 - 0.12) / (0.02 * 0.12)
    decisions = [gate.should_draft() for _ in range(150)]
    assert decisions.count(True) == 2 and decisions[74] and decisions[149]
    cheap = DraftingGate(window=4, probe_every=5, min_rounds=1, warmup_rounds=0)
    cheap.record_drafted(1, 0.0605)
    cheap.record_plain(0.06)
    assert cheap.probe_interval() == 5  # a probe barely dearer than a plain step: probe_every


def test_drafting_gate_resumes_when_drafting_pays_again():
    gate = DraftingGate(window=3, probe_every=4, min_rounds=1, warmup_rounds=0)
    gate.record_drafted(1, 0.15)
    gate.record_plain(0.06)
    assert not gate.should_draft()
    for _ in range(3):  # probes that now produce 4 tokens in 120 ms (33 tokens/s > 16.7)
        gate.record_drafted(4, 0.12)
    assert gate.drafted_rate() == pytest.approx(12 / 0.36)
    assert all(gate.should_draft() for _ in range(5))


def test_drafting_gate_rejects_bad_settings():
    with pytest.raises(ValueError, match="window"):
        DraftingGate(window=0)
    with pytest.raises(ValueError, match="warmup_rounds >= 0"):
        DraftingGate(warmup_rounds=-1)


def test_drafting_gate_times_a_plain_round_instead_of_trusting_its_estimate():
    """A cost-model estimate of the plain step (batched) is a prior: after min_rounds drafted rounds
    the gate takes one plain round, and from then on compares with what it timed."""
    gate = DraftingGate(min_rounds=2, warmup_rounds=0)
    gate.plain_estimate = (16, 0.4)  # a profile taken under load: 40 tokens/s
    gate.record_drafted(20, 0.2)  # 100 tokens/s: far above the estimate
    assert gate.should_draft()  # fewer than min_rounds drafted rounds
    gate.record_drafted(20, 0.2)
    assert not gate.should_draft()  # time a plain round before trusting the estimate
    gate.record_plain(0.1, tokens=16)  # the real plain step: 160 tokens/s beats drafting
    assert not gate.should_draft()
    fast_draft = DraftingGate(min_rounds=1, warmup_rounds=0)
    fast_draft.plain_estimate = (16, 0.4)
    fast_draft.record_drafted(40, 0.2)
    assert not fast_draft.should_draft()
    fast_draft.record_plain(0.4, tokens=16)  # the estimate was right: 200 tokens/s beat 40
    assert fast_draft.should_draft()


def test_drafting_gate_does_not_record_its_warm_up_round():
    """The first drafted round of a call ran cold (0.26 s against 0.07 s, R = 4 on the 2-core CPU):
    recorded, it turned drafting off for the whole call (the second assert fails with warmup_rounds=0)."""
    from dspark_hf.scheduling.drafting_gate import record_gate_round

    def run(warmup_rounds):
        gate = DraftingGate(min_rounds=2, warmup_rounds=warmup_rounds)
        for seconds in (0.26, 0.07, 0.07):  # 7 tokens per drafted round; the last two ran warm
            record_gate_round(gate, drafted=True, verified=4, produced=7, seconds=seconds, drafting_seconds=0.02,
                              sequences=4)
        record_gate_round(gate, drafted=False, verified=0, produced=4, seconds=0.045, drafting_seconds=0.0, sequences=4)
        return gate

    warm = run(1)
    assert warm.drafted_rate() == pytest.approx(14 / 0.14) and warm.should_draft()  # 100 tok/s beat 89
    assert not run(0).should_draft()  # 21 tokens in 0.40 s: 52 tok/s, and the probes ~100 rounds apart
    cold_plain = DraftingGate(warmup_rounds=1)
    record_gate_round(cold_plain, drafted=True, verified=0, produced=4, seconds=0.3, drafting_seconds=0.05, sequences=4)
    assert cold_plain.plain_rate() is None  # the cold verify forward is no plain step's time either


@pytest.mark.parametrize("policy", [PrefixScheduler([1.0, 0.8, 0.7, 0.65]), ThresholdPolicy(0.3), FixedLengthPolicy(2)])
def test_incremental_offer_matches_admit(policy):
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        confidences = torch.rand(int(torch.randint(0, 6, (1,), generator=gen)), generator=gen).tolist()
        assert offered_count(policy, confidences) == policy.admit(confidences)


def test_scheduler_module_still_offers_every_name_it_had():
    import dspark_hf.cache_dir
    import dspark_hf.scheduling.cost_model
    import dspark_hf.scheduling.drafting_gate
    import dspark_hf.scheduling.policies
    import dspark_hf.scheduling.shared_cost
    import dspark_hf.scheduling.step_rates

    homes = (dspark_hf.scheduling.policies, dspark_hf.scheduling.drafting_gate, dspark_hf.scheduling.step_rates,
             dspark_hf.scheduling.shared_cost, dspark_hf.scheduling.cost_model, dspark_hf.cache_dir)
    for name in dspark_hf.scheduler.__all__:
        home = next(module for module in homes if name in vars(module))
        assert getattr(dspark_hf.scheduler, name) is getattr(home, name), name
