"""`dspark-hf train --target ...` end to end on tiny local targets (issue 26): families no other test
trains, a tokenizer without a chat template, the prompts file, cached and online features, a time
budget with resume, several processes against one, and the errors that name their fix."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from dspark_hf import DSparkDraftModel, FixedLengthPolicy
from dspark_hf import demo_target
from dspark_hf.training import train_cli
from dspark_hf.training.datagen import load_onpolicy_corpus, load_plan, shards_for_rank
from dspark_hf.training.distributed import Ranks
from dspark_hf.training.features import choose_feature_mode
from dspark_hf.training.prompts import PromptFileError, read_prompts_file
from dspark_hf.training.target_loading import resolve_target
from tiny_models import tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog runs sits on mat red blue big small sun moon tree house water fire one two three four".split()
V, D = 64, 32
EOS = 1  # "<eos>" of tiny_tokenizer
SIZES = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=0, eos_token_id=EOS, pad_token_id=None)
# Families no other test trains; gemma2 and granite post-process their logits (soft-cap, scaling),
# which training must reproduce (the pipeline checks it against the real logits).
FAMILIES = {
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SIZES)),
    "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **SIZES, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=2.0)),
    "granite": lambda: T.GraniteForCausalLM(T.GraniteConfig(**SIZES, logits_scaling=4.0)),
    "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**SIZES)),
    "stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(**SIZES)),
}
TINY = ["--num-prompts", "12", "--max-new-tokens", "10", "--shard-size", "4", "--generation-batch-size", "4",
        "--max-steps", "4", "--batch-size", "4", "--block-size", "4", "--markov-rank", "8", "--held-out", "4",
        "--warmup-steps", "2", "--max-seq-len", "48", "--save-every", "2", "--log-every", "2",
        "--anchors-per-sequence", "4", "--no-progress", "--threads", "1"]
# The default run adds the CPU fast path on the target and the final measurement; most tests leave them out
# (kernel timing per test) and test_the_default_run_plans_its_budget_and_measures_the_draft covers them.
FAST = ["--no-prepare-target", "--no-measure"]


pytestmark = pytest.mark.usefixtures("isolated_training")


def _save_target(folder: Path, family: str = "phi3", chat_template: bool = True) -> Path:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    tokenizer = tiny_tokenizer(WORDS)
    assert tokenizer.eos_token_id == EOS
    if not chat_template:
        tokenizer.chat_template = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _prompts_file(path: Path, count: int = 16) -> Path:
    rng = random.Random(0)
    lines = [json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))})
             for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(tmp_path: Path, target: Path, output: str, *extra: str) -> Path:
    out = tmp_path / output
    train_cli.main(["--target", str(target), "--prompts", str(_prompts_file(tmp_path / "prompts.jsonl")),
                    "--output", str(out), "--data-dir", str(tmp_path / "data"), *TINY, *FAST, *extra])
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trains_end_to_end_and_the_draft_is_lossless(tmp_path, family):
    chat = family != "olmo2"  # olmo2's tokenizer has no chat template: its prompts are plain text
    target_dir = _save_target(tmp_path / "target", family, chat_template=chat)
    out = _train(tmp_path, target_dir, "draft", "--export-format", "hf")
    for name in ("config.json", "model.safetensors", "README.md", "calibration.json", "train_log.jsonl",
                 "stages.json", "export/hf/config.json"):
        assert (out / name).exists(), name
    stages = [s["stage"] for s in json.loads((out / "stages.json").read_text())[-1]["stages"]]
    assert stages == ["setup", "answers", "features", "training", "calibration", "card and export"]

    loaded = resolve_target(str(target_dir))
    records = load_onpolicy_corpus(tmp_path / "data")
    plan = {p["prompt_index"]: p for p in load_plan(tmp_path / "data")}
    for record in records[:3]:
        text = plan[record["prompt_index"]]["text"]
        if chat:
            expected = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        else:
            expected = loaded.tokenizer(text)["input_ids"]
        assert record["prompt_ids"] == list(expected)

    draft = DSparkDraftModel.from_pretrained(out).eval()
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    prompt = torch.tensor([records[0]["prompt_ids"]])
    alone = loaded.model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assisted = loaded.model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                     assistant_model=draft)
    assert torch.equal(assisted, alone)
    assert draft.last_generation_stats.verified_tokens > 0


def test_online_and_cached_features_train_the_identical_draft(tmp_path):
    target = _save_target(tmp_path / "target")
    for vocab in ("0", "12"):  # the full vocabulary, and a reduced one (the target normaliser per position)
        cached = _train(tmp_path, target, f"cached{vocab}", "--features", "cached", "--draft-vocab-size", vocab,
                        "--feature-dir", str(tmp_path / "features"))
        online = _train(tmp_path, target, f"online{vocab}", "--features", "online", "--draft-vocab-size", vocab,
                        "--feature-dir", str(tmp_path / f"unused{vocab}"))
        assert list((tmp_path / "features").glob("chunk-*.pt")) and not (tmp_path / f"unused{vocab}").exists()
        a, b = _weights(cached), _weights(online)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), vocab
    # auto goes online when the cache would not fit its budget
    auto = _train(tmp_path, target, "auto", "--features", "auto", "--max-feature-cache-gb", "0",
                  "--feature-dir", str(tmp_path / "budget"))
    assert not (tmp_path / "budget").exists()
    assert all(torch.equal(v, _weights(online.parent / "online0")[k]) for k, v in _weights(auto).items())


def test_feature_mode_choice():
    assert choose_feature_mode("auto", 10, budget_bytes=100, free_bytes=1000)[0] == "cached"
    assert choose_feature_mode("auto", 200, budget_bytes=100, free_bytes=1000) == (
        "online", "the cache (0.00 GB) exceeds --max-feature-cache-gb (1e-07 GB)")
    assert choose_feature_mode("auto", 95, budget_bytes=1000, free_bytes=100)[0] == "online"
    assert choose_feature_mode("cached", 10**15, budget_bytes=1, free_bytes=1)[0] == "cached"
    with pytest.raises(ValueError, match="not one of auto, cached, online"):
        choose_feature_mode("disk", 1, 1, 1)


def test_time_budget_stops_cleanly_and_resume_equals_an_uninterrupted_run(tmp_path):
    target = _save_target(tmp_path / "target")
    whole = _train(tmp_path, target, "whole", "--features", "cached")
    # a budget already spent when training starts: one step, a checkpoint, the draft saved (on the answers made
    # above: with prompts to answer, a budget this short is refused before any work, as the next test shows)
    cut = _train(tmp_path, target, "cut", "--features", "cached", "--max-time", "0.001", "--corpus",
                 str(tmp_path / "data"))
    progress = json.loads((cut / "training_progress.json").read_text())
    assert progress == {"steps_done": 1, "max_steps": 4, "stopped_by_time_budget": True, "processes": 1,
                        "precision": "float32"}
    assert json.loads((cut / "checkpoint" / "step.json").read_text()) == {"step": 1}
    assert (cut / "model.safetensors").exists()
    resumed = _train(tmp_path, target, "cut", "--features", "cached", "--resume", "--corpus", str(tmp_path / "data"))
    a, b = _weights(whole), _weights(resumed)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_budget_too_short_for_the_data_is_refused_before_any_answer(tmp_path, capsys):
    target = _save_target(tmp_path / "target")
    with pytest.raises(SystemExit):
        _train(tmp_path, target, "short", "--max-time", "0.001")
    error = capsys.readouterr().err
    assert "is too short for this target on this machine" in error and "Give at least --max-time" in error
    assert not list((tmp_path / "data").glob("shard-*"))  # nothing was answered


def test_plan_split_between_processes_has_no_overlap_and_no_loss():
    for count in (0, 1, 5, 16, 17):
        for world in (1, 2, 3, 5):
            shares = [shards_for_rank(count, rank, world) for rank in range(world)]
            assert sorted(sum(shares, [])) == list(range(count))  # none lost, none twice
            assert shares == [Ranks(rank, world).share(count) for rank in range(world)]
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        shards_for_rank(4, 2, 2)


def test_two_processes_train_the_one_process_draft(tmp_path):
    target = _save_target(tmp_path / "target")
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    common = ["--target", str(target), "--prompts", str(prompts), *TINY, *FAST, "--features", "cached"]
    one = tmp_path / "one"
    train_cli.main([*common, "--output", str(one), "--data-dir", str(tmp_path / "data1"),
                    "--feature-dir", str(tmp_path / "feat1")])
    two = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dspark_hf.training", *common, "--output", str(two),
                          "--data-dir", str(tmp_path / "data2"), "--feature-dir", str(tmp_path / "feat2")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es) sharing 3 shard(s)" in run.stderr
    assert json.loads((two / "training_progress.json").read_text())["processes"] == 2
    # the split plan: every prompt answered once, and the same answers as one process
    records = load_onpolicy_corpus(tmp_path / "data2")
    assert [r["prompt_index"] for r in records] == list(range(12))
    assert records == load_onpolicy_corpus(tmp_path / "data1")
    assert sorted(p.name for p in (tmp_path / "feat2").iterdir()) == sorted(p.name for p in (tmp_path / "feat1").iterdir())
    a, b = _weights(one), _weights(two)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6), key


def test_prompts_file_prompt_and_turns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "one", "id": "x"}),
        "",
        json.dumps({"turns": ["hi", "hello", "how are you"]}),
        json.dumps({"turns": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}]}),
        json.dumps({"turns": ["alone"]}),
    ]) + "\n")
    prompts = read_prompts_file(path)
    assert [p.text for p in prompts] == ["one", "how are you", "why", "alone"]
    assert prompts[0].detail == "x" and prompts[0].turns == () and prompts[3].turns == ()
    assert prompts[1].messages() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                     {"role": "user", "content": "how are you"}]
    tokenizer = tiny_tokenizer(WORDS)
    from dspark_hf.chat_text import encode_prompt

    assert encode_prompt(tokenizer, "cat", None) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "cat"}], add_generation_prompt=True, return_dict=True)["input_ids"]
    tokenizer.chat_template = None
    assert encode_prompt(tokenizer, "dog", [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "sun"},
                                            {"role": "user", "content": "dog"}]) == tokenizer("cat\n\nsun\n\ndog")["input_ids"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "hi"}', r'line 2: the object has neither "prompt" nor "turns" \(keys: text\)'),
    ("not json", "line 2: not JSON"),
    ('{"turns": ["q", "a"]}', "line 2: the last turn is the assistant's"),
    ('{"turns": [3]}', "line 2: turn 1 is neither a string nor a message"),
    ('{"prompt": ""}', 'line 2: "prompt" must be a non-empty string'),
])
def test_prompts_file_errors_name_the_line_and_the_fix(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(PromptFileError, match=message):
        read_prompts_file(path)


def test_cli_errors_name_the_problem_before_any_work(tmp_path, capsys):
    torch.manual_seed(0)
    opt = T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=D, ffn_dim=2 * D, num_hidden_layers=4,
                                       num_attention_heads=4, word_embed_proj_dim=16))
    opt.save_pretrained(tmp_path / "opt")
    tiny_tokenizer(WORDS).save_pretrained(tmp_path / "opt")
    cases = [
        (["--target", str(tmp_path / "opt")], "no DSpark draft can be built for it.*width 16"),
        (["--target", str(tmp_path / "missing-folder-or-hub-id")], "cannot load it as a transformers causal LM"),
        (["--target", str(tmp_path / "opt"), "--export-format", "onnx"], "--export-format onnx: not a layout"),
        (["--max-time", "soon"], "'soon' is not a duration"),
        (["--target", str(tmp_path / "opt"), "--sources", "sharegpt,wiki"], "--sources wiki: no such built-in"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            train_cli.main([*argv, "--output", str(tmp_path / "out"), "--prompts", str(_prompts_file(tmp_path / "p.jsonl"))])
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "out").exists()


def test_a_logit_rule_the_trainer_does_not_know_is_refused(tmp_path, monkeypatch):
    from dspark_hf.training import target_loading

    torch.manual_seed(0)
    gemma2 = FAMILIES["gemma2"]().eval()
    ids = list(range(2, 18))
    target_loading.check_target_head(gemma2, ids, "gemma2")  # the soft-cap is reproduced
    monkeypatch.setattr(target_loading, "target_head", lambda target: target.get_output_embeddings())
    with pytest.raises(ValueError, match="Gemma2Config family post-processes logits"):
        target_loading.check_target_head(gemma2, ids, "gemma2")


def test_durations():
    assert [train_cli.parse_duration(t) for t in ("3600", "90s", "45m", "2h", "1h30m", "1.5h")] == [
        3600, 90, 2700, 7200, 5400, 5400]


def test_the_smollm2_preset_is_the_default_target(monkeypatch, tmp_path):
    target_dir = _save_target(tmp_path / "target")
    tokenizer = T.AutoTokenizer.from_pretrained(target_dir)
    model = T.AutoModelForCausalLM.from_pretrained(target_dir)
    monkeypatch.setattr(demo_target, "load_smollm2", lambda dtype=torch.float32: (model, tokenizer))
    monkeypatch.setattr(demo_target, "mask_token_id", lambda tok: 5)
    args = train_cli.build_parser().parse_args(["--output", "x"])
    assert args.target == "smollm2"
    loaded = resolve_target(args.target)
    assert loaded.name == demo_target.MODEL_NAME and loaded.mask_token_id == 5 and loaded.model is model


def test_builtin_plan_is_used_without_a_prompts_file(tmp_path, monkeypatch):
    from dspark_hf.training import datagen
    from dspark_hf.training.prompt_sources import SOURCES, Prompt

    target = _save_target(tmp_path / "target")
    monkeypatch.setattr(datagen, "load_sources", lambda names, seed=0: [
        Prompt(f"{WORDS[i % 20]} {WORDS[(3 * i) % 20]}", names[i % len(names)]) for i in range(40)])
    out = tmp_path / "draft"
    train_cli.main(["--target", str(target), "--output", str(out), *TINY, *FAST, "--features", "online"])
    folders = list((tmp_path / "cache" / "answers").iterdir())
    config = json.loads((folders[0] / "config.json").read_text())
    assert config["sources"] == list(SOURCES) and config["num_prompts"] == 40
    assert len(load_onpolicy_corpus(folders[0])) == 12


def test_reference_texts_avoid_only_the_prompts_the_target_answered():
    """The built-in plan holds nearly every ShareGPT prompt; excluding the whole plan left 12 texts."""
    from dspark_hf.training.pipeline import _answered_texts

    plan = [{"prompt_index": i, "text": f"prompt {i}"} for i in range(10)]
    records = [{"prompt_index": 3}, {"prompt_index": 7}, {"index": 0, "mode": "reference"}]
    assert _answered_texts(plan, records) == ["prompt 3", "prompt 7"]


def test_reference_texts_plan_estimate_matches_the_records_and_only_a_planned_count_may_fall_short(
        monkeypatch, tmp_path, caplog):
    """The plan's mean text length and the texts stage read the same records; a count the user asked for
    (--reference-answers) that cannot be met is an error, a plan's estimate is met as far as it can be."""
    from dspark_hf.training import data

    conversations = [{"conversations": [{"from": "human", "value": f"the cat sits on the mat {i}"},
                                        {"from": "gpt", "value": " ".join(["dog"] * (i % 5 + 1))}]} for i in range(12)]
    conversations.append({"conversations": [{"from": "human", "value": " ".join(["sun"] * 300)},
                                            {"from": "gpt", "value": "moon"}]})  # a prompt too long: skipped
    monkeypatch.setattr(data, "iter_sharegpt_conversations", lambda path=None: iter(conversations))
    data.sharegpt_exchanges.cache_clear()
    try:
        tokenizer = tiny_tokenizer(WORDS)
        exclude = {"the cat sits on the mat 3"}
        path = data.sharegpt_reference_answers(tokenizer, 12, tmp_path / "all.jsonl", exclude_prompts=exclude,
                                               max_prompt_tokens=64, strict=False, show_progress=False)
        records = data.load_corpus(path)
        assert len(records) == 11 and "planned" in caplog.text  # 13 exchanges, one excluded, one too long
        assert all(r["answer_ids"][-1] == tokenizer.eos_token_id and r["mode"] == "reference" for r in records)
        with pytest.raises(ValueError, match="Only 11 ShareGPT exchanges qualify"):
            data.sharegpt_reference_answers(tokenizer, 12, tmp_path / "strict.jsonl", exclude_prompts=exclude,
                                            max_prompt_tokens=64, show_progress=False)
        mean = data.reference_text_tokens(tokenizer, max_prompt_tokens=64, sample=100)
        every = data.load_corpus(data.sharegpt_reference_answers(tokenizer, 12, tmp_path / "every.jsonl",
                                                                 max_prompt_tokens=64, show_progress=False))
        assert mean == pytest.approx(sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in every) / 12)
    finally:
        data.sharegpt_exchanges.cache_clear()
