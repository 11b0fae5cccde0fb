"""The live cost model: a wrong profile is corrected by observed verify times, robustly, monotonically;
one model per target and process; a profile far from the live times is reported and rewritten."""

import functools
import json
import logging
import math
import random

import pytest
import torch

import dspark_hf.scheduling.shared_cost as shared_cost_module
import dspark_hf.scheduling.step_rates as step_rates_module
from dspark_hf import FixedLengthPolicy, PrefixScheduler, StepCostModel, shared_cost_model
from dspark_hf.scheduling.step_rates import profile_sps, sps_cache_key
from tiny_models import markov_draft, random_target, target_next_token_table

TRUE_SECONDS = [0.050, 0.056, 0.052, 0.053, 0.054, 0.056, 0.058, 0.060]  # a flat CPU curve (ms-level noise)


def _truth(b):
    return TRUE_SECONDS[b - 1]


def _feed(model, rounds, seed=0, outliers=0.05):
    rng = random.Random(seed)
    for _ in range(rounds):
        b = rng.randint(1, len(TRUE_SECONDS))
        seconds = _truth(b) * math.exp(rng.gauss(0.0, 0.05))
        if rng.random() < outliers:
            seconds *= 10.0  # a page fault or a GC pause
        model.observe(b, seconds)


@pytest.mark.parametrize("factor", [3.0, 1 / 3])
def test_a_profile_wrong_by_a_factor_is_corrected_within_a_few_dozen_rounds(factor):
    model = StepCostModel([t * factor for t in TRUE_SECONDS])
    _feed(model, 40)
    estimate = model.step_seconds(len(TRUE_SECONDS))
    errors = [abs(e / t - 1.0) for e, t in zip(estimate, TRUE_SECONDS)]
    assert max(errors) < 0.15, errors


def test_a_profile_with_the_wrong_shape_is_corrected_where_observed():
    steep = [0.065, 0.108, 0.096, 0.095, 0.095, 0.097, 0.099, 0.100]  # profiled stock, running packed
    model = StepCostModel(steep)
    _feed(model, 60, seed=1)
    estimate = model.step_seconds(8)
    assert estimate[1] / estimate[0] < 1.25  # the cliff at B = 2 is gone
    assert all(abs(e / t - 1.0) < 0.2 for e, t in zip(estimate, TRUE_SECONDS))


def test_one_outlier_moves_the_estimate_little():
    model = StepCostModel(TRUE_SECONDS)
    _feed(model, 50, outliers=0.0)
    before = model.seconds(3)
    model.observe(3, before * 100.0)
    assert model.seconds(3) / before < 1.05  # medians of recent rounds: one outlier changes nothing


def test_the_table_stays_non_increasing_and_positive():
    model = StepCostModel(TRUE_SECONDS)
    rng = random.Random(3)
    for _ in range(200):
        model.observe(rng.randint(1, 12), rng.uniform(0.001, 1.0))
        table = model.sps(12)
        assert all(r > 0 for r in table) and all(table[i] <= table[i - 1] for i in range(1, len(table)))


def test_bad_observations_are_ignored_and_bad_priors_rejected():
    model = StepCostModel(TRUE_SECONDS)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(2, seconds)
    model.observe(0, 0.05)
    assert model.num_observations == 0
    with pytest.raises(ValueError, match="positive finite"):
        StepCostModel([0.05, float("nan")])
    with pytest.raises(ValueError, match="window"):
        StepCostModel(TRUE_SECONDS, window=0)


def test_drift_is_reported_once_per_change():
    reports = []
    model = StepCostModel([t * 3.0 for t in TRUE_SECONDS], on_drift=reports.append)
    _feed(model, 15, outliers=0.0)
    assert reports == []  # not before min_observations
    _feed(model, 60, seed=5, outliers=0.0)
    assert len(reports) == 1 and reports[0] is model


def test_live_scheduler_reads_corrected_table():
    table = [1 / t for t in sorted(TRUE_SECONDS)]
    scheduler = PrefixScheduler(table, live=True)
    static = PrefixScheduler(table)
    for _ in range(30):
        scheduler.observe_verify(1, 0.2)  # the machine got 4x slower
        static.observe_verify(1, 0.2)
    assert static.sps == tuple(table)
    assert scheduler.sps[0] == pytest.approx(5.0, rel=0.1)
    with pytest.raises(ValueError, match="either"):
        PrefixScheduler([1.0], cost_model=StepCostModel([1.0]))
    with pytest.raises(ValueError, match="needs"):
        PrefixScheduler()


def _pair():
    target = random_target("llama")
    draft = markov_draft(target, target_next_token_table(target), block_size=4,
                         confidence_logits=torch.full((48,), 2.0))
    return target, draft


def _count_forwards(target):
    widths = []
    target.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape), with_kwargs=True)
    return widths


def test_no_call_profiles_the_target_and_the_next_process_starts_from_the_calls_curves(monkeypatch, tmp_path):
    """A fresh cache, batch sizes 1, 2, 3: every target forward inside generate is the generation's own
    (a prefill, then one verify forward per round), never a profile's; the cost models start from
    estimates, and each call caches its corrected curve, which the next process reads as its prior."""
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(step_rates_module, "profile_sps", lambda *a, **k: pytest.fail("profiled inside generate"))
    target, draft = _pair()
    prompts = torch.randint(3, 48, (3, 6))
    for rows in (1, 2, 3, 2, 1):
        batch = prompts[:rows]
        expected = target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=30, do_sample=False)
        widths = _count_forwards(target)
        got = target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=30, do_sample=False,
                              assistant_model=draft)
        target._forward_pre_hooks.clear()
        assert got.tolist() == expected.tolist()
        rounds = round(sum(1.0 / r.batch_rows for r in draft.last_generation_stats.rounds))
        assert len(widths) == 1 + rounds, (rows, widths)  # the prefill, then one forward per round
        assert widths[0] == (rows, 6) and all(shape[0] <= rows and shape[1] <= 11 for shape in widths[1:])
    models = {rows: shared_cost_model(target, rows=rows) for rows in (1, 2, 3)}
    assert all(model.estimated and model.num_observations > 0 for model in models.values())
    assert models[2] is not models[1] and models[2].prior_length == 2 * 11  # rows x (1 + 10 lookup tokens)
    cached = sorted(p.name for p in (tmp_path / "sps").glob("*.json"))
    assert len(cached) == 3 and all(json.loads((tmp_path / "sps" / name).read_text())["estimated"] for name in cached)
    # A new process (no models in memory) starts from the cached curves, still without profiling.
    shared_cost_module._shared_cost_models.clear()
    again = shared_cost_model(target)
    record = json.loads(next((tmp_path / "sps").glob(f"{sps_cache_key(target, 16)}.json")).read_text())
    assert again is not models[1] and again.estimated and again.num_observations == 0
    assert again.prior(1) == pytest.approx(1.0 / record["sps"][0])
    assert record["live_corrected"]["observations"] == models[1].num_observations


def test_the_estimated_prior_of_a_batch_follows_the_one_row_curve_and_unseen_sizes_follow_seen_ones():
    target, _ = _pair()
    generic = shared_cost_module.estimated_step_seconds(target, 4)
    growth = shared_cost_module.ESTIMATE_GROWTH_PER_TOKEN["cpu"]
    assert generic[3] / generic[0] == pytest.approx(1 + 3 * growth)
    one_row = StepCostModel([0.010, 0.011, 0.012, 0.020], estimated=True)
    for _ in range(4):
        one_row.observe(4, 0.040)  # B = 4 costs twice the prior
    batch = shared_cost_module.estimated_step_seconds(target, 8, known=one_row)
    assert batch[3] == pytest.approx(0.040) and batch[7] > batch[3]  # the tail grows past the table
    model = StepCostModel([0.01 * b for b in range(1, 9)])
    for b, seconds in ((2, 0.02), (6, 0.03)):  # B = 6 is half the prior
        for _ in range(6):
            model.observe(b, seconds)
    low, high = model.log_correction(2), model.log_correction(6)
    assert model.log_correction(4) == pytest.approx((low + high) / 2)  # between two seen sizes
    assert model.log_correction(8) == pytest.approx(high) and model.log_correction(1) == pytest.approx(low)


def test_a_far_off_cached_profile_is_reported_and_rewritten(tmp_path, caplog):
    target, draft = _pair()
    key = sps_cache_key(target, 8)
    path = tmp_path / "sps" / f"{key}.json"
    path.parent.mkdir(parents=True)
    absurd = [1 / 10.0] * 8  # 10 s per step: far slower than this tiny model
    path.write_text(json.dumps({"sps": absurd}))
    model = shared_cost_model(target, cache_dir=tmp_path)
    assert model.prior(1) == pytest.approx(10.0)
    draft.generation_config.dspark_verify_policy = PrefixScheduler(cost_model=model, max_tokens=5)
    with caplog.at_level(logging.WARNING, logger="dspark_hf.scheduling.shared_cost"):
        target.generate(torch.randint(3, 48, (1, 6)), max_new_tokens=60, do_sample=False, assistant_model=draft)
    assert "differ from its profiled SPS table" in caplog.text and str(path) in caplog.text
    rewritten = json.loads(path.read_text())
    assert rewritten["live_corrected"]["observations"] >= 16
    assert rewritten["sps"][0] > 10 * absurd[0]


def test_fixed_policies_ignore_observations():
    policy = FixedLengthPolicy(3)
    policy.observe_verify(4, 1.0)  # the hook exists on every policy and is a no-op here
    assert policy.admit([0.1, 0.1, 0.1, 0.1]) == 3


def test_profile_command_writes_the_table_the_default_scheduler_then_reads(tmp_path, monkeypatch):
    from dspark_hf.benchmarks import profile_cli

    target = random_target("llama")
    target.save_pretrained(tmp_path / "target")
    sps = profile_cli.main(["--target", str(tmp_path / "target"), "--max-tokens", "24", "--cache-dir", str(tmp_path),
                            "--batch-sizes", "2", "--max-width", "3"])
    assert len(sps) == 24
    from transformers import AutoModelForCausalLM
    from dspark_hf.cpu_engine import prepare_for_cpu

    # Prepared as the command prepared it: by the CPU engine where it is installed, else both stock (logged).
    served = prepare_for_cpu(AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval())
    monkeypatch.setattr(step_rates_module, "profile_sps", lambda *a, **k: pytest.fail("profiled again"))
    model = shared_cost_model(served, cache_dir=tmp_path)
    assert model.prior_length == 24 and not model.estimated
    batched = shared_cost_model(served, cache_dir=tmp_path, rows=2)  # measured with 2 rows at widths 1..3
    assert batched.prior_length == 6 and not batched.estimated and batched is not model


class SwingingTimes(PrefixScheduler):
    """Reports verify times alternately as measured and 50x slower, switching every 12 rounds: the
    live estimate moves far from what it last reported again and again (a forced drift)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rounds = 0

    def observe_verify(self, num_tokens, seconds):
        self.rounds += 1
        super().observe_verify(num_tokens, seconds * (50.0 if self.rounds // 12 % 2 else 1.0))


def test_drift_warns_once_per_target_and_rewrites_the_cache_once_per_call(tmp_path, monkeypatch, caplog):
    target, draft = _pair()
    path = tmp_path / "sps" / f"{sps_cache_key(target, 8)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"sps": [1 / 10.0] * 8}))  # 10 s per step: drifts from the first rounds on
    model = shared_cost_model(target, cache_dir=tmp_path)
    draft.generation_config.dspark_verify_policy = SwingingTimes(cost_model=model, max_tokens=5)
    writes = []
    write = step_rates_module._write_record
    monkeypatch.setattr(step_rates_module, "_write_record", lambda where, record: writes.append(where) or write(where, record))
    calls = 3
    with caplog.at_level(logging.DEBUG, logger="dspark_hf.scheduling.shared_cost"):
        for _ in range(calls):  # at most 2 tokens a round: 30+ rounds a call
            target.generate(torch.randint(3, 48, (1, 6)), max_new_tokens=60, do_sample=False, assistant_model=draft,
                            num_assistant_tokens=1)
    reports = [r for r in caplog.records if "differ from its profiled SPS table" in r.getMessage()]
    assert len(reports) > calls, "the forced drift should be reported several times per call"
    assert [r.levelno for r in reports].count(logging.WARNING) == 1  # once per target and process
    assert all(r.levelno == logging.DEBUG for r in reports[1:])
    assert 1 <= len(writes) <= calls and set(writes) == {path}  # at most once per generate call
    assert json.loads(path.read_text())["live_corrected"]["observations"] == model.num_observations


def test_a_batched_profile_runs_rows_on_their_own_contexts_and_is_keyed_apart(monkeypatch, tmp_path):
    """profile_sps(rows=R): forwards of R rows x W tokens over an R-row cache, multiples of R only."""
    target, _ = _pair()
    shapes = []
    forward = type(target).forward
    monkeypatch.setattr(type(target), "forward", functools.wraps(forward)(lambda self, *a, **k: shapes.append(
        tuple((k.get("input_ids") if k.get("input_ids") is not None else a[0]).shape)) or forward(self, *a, **k)))
    table = profile_sps(target, 9, rows=3, warmup=0, repeats=1, cache_dir=tmp_path, progress=False)
    assert len(table) == 9 and all(a >= b for a, b in zip(table, table[1:]))
    assert shapes[0] == (3, 256) and sorted(set(shapes[1:])) == [(3, 1), (3, 2), (3, 3)]
    # Unmeasured sizes take the measured size below them (below 3: the time of 3 rows x 1 token).
    assert len(set(table[0:5])) == 1 and len(set(table[5:8])) == 1
    assert sps_cache_key(target, 9, rows=3) != sps_cache_key(target, 9)
    assert (tmp_path / "sps" / f"{sps_cache_key(target, 9, rows=3)}.json").is_file()
    with pytest.raises(ValueError, match="one token per row"):
        profile_sps(target, 2, rows=3, cache_dir=tmp_path, progress=False)


def test_the_profile_key_names_the_cpu_and_the_engines_fingerprint(monkeypatch):
    """The key holds the CPU model and the backend fingerprint (dspark_hf.engine_hooks): what the engines that
    prepared the model say about it. A fake engine here; the CPU engine's own fingerprint (packed linears, the
    kernels' code digest, the lean decoder) is tested with it (cpu_engine/tests/test_cpu_engine_hooks.py)."""
    import dspark_hf.scheduling.step_rates as step_rates
    from dspark_hf import engine_hooks

    target, _ = _pair()
    key = sps_cache_key(target, 8)
    monkeypatch.setattr(step_rates, "cpu_model", lambda: "Another CPU")
    assert sps_cache_key(target, 8) != key  # a profile from another processor is not reused
    code, prepared = {"digest": "first"}, set()
    fake = engine_hooks.EngineHooks(fingerprint=lambda model: {"code": code["digest"]} if id(model) in prepared else {})
    monkeypatch.setattr(engine_hooks, "_ENGINES", {"fake": fake})
    stock_key = sps_cache_key(target, 8)
    code["digest"] = "second"
    assert sps_cache_key(target, 8) == stock_key  # a stock model's profile does not depend on an engine's code
    monkeypatch.setattr(engine_hooks, "_ENGINES", {})
    assert sps_cache_key(target, 8) == stock_key  # nor on which engines are installed
    monkeypatch.setattr(engine_hooks, "_ENGINES", {"fake": fake})
    prepared.add(id(target))
    prepared_key = sps_cache_key(target, 8)
    assert prepared_key != stock_key  # a prepared model is profiled apart from the stock one
    code["digest"] = "first"
    assert sps_cache_key(target, 8) != prepared_key  # and again when the engine's code changes
