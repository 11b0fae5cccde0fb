"""On-policy data generation (dspark_hf.training.datagen): batched answers equal single ones, shards are
atomic and resumable, records name their source, and the prompt sources are recorded."""

import gzip
import json
import random
import re
import tomllib
from pathlib import Path

import pytest
import torch

from dspark_hf.training import datagen
from dspark_hf.training.datagen import (
    FORMAT_VERSION,
    generate_batch,
    load_onpolicy_corpus,
    load_plan,
    prepare_folder,
    run_datagen,
    shard_path,
)
from dspark_hf.benchmarks.prompt_sets import default_prompt_dir
from dspark_hf.chat_text import trim_after_eos
from dspark_hf.training.prompt_sources import SOURCES, Prompt, eval_overlap, normalize_text
from tiny_models import random_target, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog runs sits on mat red blue big small sun moon tree house water fire one two three four".split()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(WORDS)


@pytest.fixture(scope="module")
def target():
    model = random_target(vocab_size=48, hidden_size=32, num_layers=2, seed=11)
    model.generation_config.eos_token_id = 7
    return model


def _prompts(count: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) + f" {WORDS[i % 4]}",
                   "test_a" if i % 3 else "test_b", f"item{i}") for i in range(count)]


def _config(**overrides) -> dict:
    config = {"model": "tiny", "sources": ["test_a", "test_b"], "seed": 0, "max_prompt_tokens": 64,
              "max_new_tokens": 10, "batch_size": 2, "shard_size": 4}
    return {**config, **overrides}


def _run(folder: Path, target, tokenizer, max_prompts=None, prompts=None) -> list[dict]:
    config = _config()
    plan = prepare_folder(folder, tokenizer, config, prompts=prompts or _prompts(10))
    run_datagen(target, tokenizer, folder, plan, {**config, "format_version": FORMAT_VERSION},
                max_prompts=max_prompts, show_progress=False)
    return plan


def test_batched_greedy_rows_equal_each_prompt_alone():
    target = random_target(vocab_size=48, hidden_size=32, num_layers=2, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 48, (n,), generator=gen).tolist() for n in (2, 9, 5, 3, 7, 4)]
    # EOS: a token row 0 reaches early, so finished rows (padded after EOS) and trimming are exercised
    free = target.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = free[0, len(prompts[0]) + 3].item()
    batched = generate_batch(target, prompts, do_sample=False, max_new_tokens=12, pad_token_id=0, eos_ids=[eos])
    for ids, answer in zip(prompts, batched):
        alone = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=[eos])
        assert answer == alone[0, len(ids):].tolist()
        assert eos not in answer[:-1]  # nothing after the first EOS
    assert len(batched[0]) <= 4 and batched[0][-1] == eos
    assert any(len(a) == 12 and a[-1] != eos for a in batched)  # and an unfinished row keeps all its tokens


def test_trim_after_eos():
    assert trim_after_eos([5, 3, 9, 3], [3]) == [5, 3]
    assert trim_after_eos([5, 4, 9], [3, 9]) == [5, 4, 9]
    assert trim_after_eos([5, 4, 6], [3]) == [5, 4, 6]


def test_records_modes_sources_and_plan(tmp_path, target, tokenizer):
    plan = _run(tmp_path, target, tokenizer)
    records = load_onpolicy_corpus(tmp_path)
    assert [r["prompt_index"] for r in records] == list(range(10))
    assert sorted(p["text"] for p in plan) == sorted(p.text for p in _prompts(10))
    for record, item in zip(records, plan):
        assert record["source"] == item["source"] and record["source"] in ("test_a", "test_b")
        assert record["mode"] == ("greedy" if record["prompt_index"] % 2 == 0 else "sample")
        assert record["prompt_ids"] == datagen.chat_prompt_ids(tokenizer, item["text"])
        assert 1 <= len(record["answer_ids"]) <= 10
        assert 7 not in record["answer_ids"][:-1]
    # greedy records are the prompt answered alone
    for record in records[::2]:
        ids = torch.tensor([record["prompt_ids"]])
        alone = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                pad_token_id=0)
        assert record["answer_ids"] == alone[0, ids.shape[1]:].tolist()
    assert {r["source"] for r in load_onpolicy_corpus(tmp_path, sources=["test_b"])} == {"test_b"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["source_counts"] == {"test_a": 6, "test_b": 4} and config["num_prompts"] == 10
    assert load_plan(tmp_path) == plan
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "prompts.jsonl.gz", "shard-00000.jsonl.gz", "shard-00001.jsonl.gz", "shard-00002.jsonl.gz"]


def test_resume_skips_finished_shards_and_matches_uninterrupted(tmp_path, target, tokenizer, monkeypatch):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(whole, target, tokenizer)
    real = datagen.generate_batch
    calls = []

    def crash_in_second_shard(*args, **kwargs):
        calls.append(kwargs["do_sample"])
        if len(calls) == 4:  # shard 0 takes 2 batches (greedy, sampled); die in shard 1's second
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(datagen, "generate_batch", crash_in_second_shard)
    with pytest.raises(KeyboardInterrupt):
        _run(resumed, target, tokenizer)
    assert shard_path(resumed, 0).exists() and not shard_path(resumed, 1).exists()
    first = shard_path(resumed, 0).stat()
    calls.clear()
    monkeypatch.setattr(datagen, "generate_batch", lambda *a, **k: calls.append(k["do_sample"]) or real(*a, **k))
    _run(resumed, target, tokenizer)
    assert len(calls) == 4  # shards 1 and 2 only
    assert shard_path(resumed, 0).stat().st_mtime_ns == first.st_mtime_ns
    assert load_onpolicy_corpus(resumed) == load_onpolicy_corpus(whole)
    for k in range(3):  # byte-identical, sampled rows included: seeds are per batch
        assert shard_path(resumed, k).read_bytes() == shard_path(whole, k).read_bytes()


def test_shard_is_never_half_written(tmp_path, target, tokenizer, monkeypatch):
    real, lines = datagen._record_line, []

    def fail_on_third_record(record):
        lines.append(record)
        if len(lines) == 3:
            raise OSError("disk full")
        return real(record)

    config = _config()
    plan = prepare_folder(tmp_path, tokenizer, config, prompts=_prompts(10))
    monkeypatch.setattr(datagen, "_record_line", fail_on_third_record)
    with pytest.raises(OSError, match="disk full"):
        run_datagen(target, tokenizer, tmp_path, plan, {**config, "format_version": FORMAT_VERSION},
                    show_progress=False)
    assert not shard_path(tmp_path, 0).exists()
    assert not list(tmp_path.glob("*.tmp*"))
    monkeypatch.undo()
    # a killed process leaves its temporary file, and a truncated shard may come from elsewhere
    (tmp_path / "shard-00000.jsonl.gz.tmp4242").write_bytes(b"partial")
    reference = tmp_path / "reference"
    _run(reference, target, tokenizer)
    whole = shard_path(reference, 1).read_bytes()
    shard_path(tmp_path, 1).write_bytes(whole[: len(whole) // 2])
    _run(tmp_path, target, tokenizer)
    assert not list(tmp_path.glob("*.tmp*"))
    assert load_onpolicy_corpus(tmp_path) == load_onpolicy_corpus(reference)


def test_max_prompts_then_full_run(tmp_path, target, tokenizer):
    reference = tmp_path / "reference"
    _run(reference, target, tokenizer)
    partial = tmp_path / "partial"
    _run(partial, target, tokenizer, max_prompts=6)
    assert [r["prompt_index"] for r in load_onpolicy_corpus(partial)] == list(range(6))
    assert shard_path(partial, 0).read_bytes() == shard_path(reference, 0).read_bytes()
    _run(partial, target, tokenizer)  # shard 1 held 2 prompts of 4: made again
    assert load_onpolicy_corpus(partial) == load_onpolicy_corpus(reference)


def test_training_cli_trains_on_a_datagen_folder(tmp_path, target, tokenizer, monkeypatch):
    from dspark_hf.training import pipeline
    from dspark_hf.training import train_cli as training

    folder = tmp_path / "corpus"
    config = _config(max_new_tokens=16, batch_size=8, shard_size=16)
    plan = prepare_folder(folder, tokenizer, config, prompts=_prompts(40))
    run_datagen(target, tokenizer, folder, plan, {**config, "format_version": FORMAT_VERSION}, show_progress=False)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    built = []
    real_build = pipeline.build_feature_chunks
    monkeypatch.setattr(pipeline, "build_feature_chunks", lambda *a, **k: built.append(a[1]) or real_build(*a, **k))
    generated = []
    monkeypatch.setattr(pipeline, "run_datagen", lambda *a, **k: generated.append(a))
    training.main(["--target", str(tmp_path / "target"), "--corpus", str(folder), "--output", str(tmp_path / "draft"),
                   "--max-steps", "3", "--markov-rank", "0", "--no-confidence-head", "--max-sequences", "36",
                   "--features", "cached", "--no-progress"])
    assert built[0] == load_onpolicy_corpus(folder)[:36] and not generated  # the shards, as they are
    assert (tmp_path / "draft" / "config.json").exists()
    assert len((tmp_path / "draft" / "train_log.jsonl").read_text().splitlines()) == 1
    assert list((tmp_path / "cache" / "features").glob("*/chunk-*.pt"))  # features outside the data folder
    assert not list(folder.glob("chunk-*"))


def test_folder_with_other_settings_is_refused(tmp_path, tokenizer):
    prepare_folder(tmp_path, tokenizer, _config(), prompts=_prompts(10))
    with pytest.raises(ValueError, match="max_new_tokens: folder has 10, asked for 20"):
        prepare_folder(tmp_path, tokenizer, _config(max_new_tokens=20), prompts=_prompts(10))
    with pytest.raises(FileNotFoundError, match="no finished shard"):
        load_onpolicy_corpus(tmp_path)


def test_plan_drops_long_prompts_and_is_seeded(tmp_path, tokenizer):
    prompts = _prompts(10) + [Prompt(" ".join(WORDS * 4), "test_a", "long")]
    plan = prepare_folder(tmp_path / "a", tokenizer, _config(max_prompt_tokens=20), prompts=prompts)
    assert "long" not in {p["detail"] for p in plan} and len(plan) == 10
    again = prepare_folder(tmp_path / "b", tokenizer, _config(max_prompt_tokens=20), prompts=prompts)
    other = prepare_folder(tmp_path / "c", tokenizer, _config(max_prompt_tokens=20, seed=1), prompts=prompts)
    assert plan == again and plan != other
    with gzip.open(tmp_path / "a" / "prompts.jsonl.gz", "rt") as f:
        assert [json.loads(line) for line in f] == plan


# ------------------------------------------------------------------------------ prompt sources
def test_eval_overlap_finds_planted_prompts():
    template = "Please solve the following problem carefully and give the final answer at the end of it."
    eval_sets = {"set": [f"{template} Problem {i}: a train leaves station number {i} at noon" for i in range(6)]
                 + ["Completely unrelated question about the history of medieval castles in northern Europe and their walls"]}
    clean = eval_overlap(["What is the capital of France?", template], eval_sets)
    assert clean == {"set": {"eval_prompts": 7, "exact": 0, "shared_13gram": 0}}  # the shared template is not overlap
    planted = eval_overlap([eval_sets["set"][2].upper() + "!!", "Tell me: " + eval_sets["set"][6] + " please"],
                           eval_sets)
    assert planted == {"set": {"eval_prompts": 7, "exact": 1, "shared_13gram": 2}}
    assert normalize_text("Héllo,  WORLD!\n") == "héllo world"


def test_every_source_is_documented_and_installable():
    doc = (REPO / "docs" / "training-data.md").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    train = " ".join(extras["train"])
    for name, spec in SOURCES.items():
        assert f"`{name}`" in doc
        for distribution, licence in spec.distributions:
            assert distribution in doc and distribution in train and licence in doc


def test_dm_math_source_is_seeded_and_leaves_global_rngs_alone():
    pytest.importorskip("mathematics_dataset")
    import numpy as np

    from dspark_hf.training.prompt_sources import dm_math_source

    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.random())
    random.seed(123)
    np.random.seed(123)
    first = dm_math_source(per_module=3, seed=0)
    assert (random.random(), np.random.random()) == expected
    assert "object" not in np.__dict__  # the numpy-1 alias is removed again
    # The package iterates sets of objects (statement order in composed questions; variable letters
    # across processes) and sympy's own generator (primes), so some questions vary between calls;
    # the modules and levels asked, and most questions, do not. The plan file is the record.
    again, other = dm_math_source(per_module=3, seed=0), dm_math_source(per_module=3, seed=1)
    assert [p.detail for p in first] == [p.detail for p in again]
    assert sum(a == b for a, b in zip(first, again)) > 0.8 * len(first)
    assert sum(a == b for a, b in zip(first, other)) < 0.2 * len(first)
    modules = {p.detail.split("/")[0] for p in first}
    assert len(modules) >= 40 and all(p.source == "dm_math" and p.text for p in first)


def test_champ_and_code_sources():
    pytest.importorskip("champ_dataset")
    pytest.importorskip("boltons")
    pytest.importorskip("more_itertools")
    from dspark_hf.training.prompt_sources import champ_source, code_source

    champ = champ_source()
    assert len(champ) == 270 and all(p.text and p.detail.startswith("P_") for p in champ)
    code = code_source(seed=0)
    assert code == code_source(seed=0)
    by_object: dict[str, list[str]] = {}
    for p in code:
        qualname, template = p.detail.rsplit("/", 1)
        by_object.setdefault(qualname, []).append(template)
    assert len(by_object) > 300
    assert all(t[0] == "write" and len(t) in (1, 3) for t in by_object.values())
    assert {t for ts in by_object.values() for t in ts[1:]} == {"explain", "test", "review"}
    chunked = next(p.text for p in code if p.detail == "more_itertools.more.chunked/write")
    assert chunked.startswith("Write a Python function `chunked(iterable, n, strict=False)`")


# ------------------------------------------------------------------ committed plan vs eval sets
COMMITTED_PLAN = REPO / "data" / "smollm2-onpolicy"
EVAL_PROMPTS = default_prompt_dir()  # the sets shipped in the package, or $DSPARK_EVAL_PROMPTS


@pytest.mark.skipif(not (COMMITTED_PLAN / "prompts.jsonl.gz").exists(), reason="no committed prompt plan")
@pytest.mark.skipif(not EVAL_PROMPTS.is_dir(), reason="evaluation prompts not available here "
                    "(set DSPARK_EVAL_PROMPTS to a folder of *.jsonl with {'turns': [...]})")
def test_committed_plan_does_not_overlap_the_evaluation_sets():
    from dspark_hf.training.prompt_sources import read_eval_prompts

    eval_sets = read_eval_prompts(EVAL_PROMPTS)
    assert eval_sets and all(eval_sets.values())
    report = eval_overlap((p["text"] for p in load_plan(COMMITTED_PLAN)), eval_sets)
    for name, counts in report.items():
        assert counts["exact"] == 0 and counts["shared_13gram"] == 0, (name, counts)


def test_committed_plan_matches_its_config():
    if not (COMMITTED_PLAN / "prompts.jsonl.gz").exists():
        pytest.skip("no committed prompt plan")
    config = json.loads((COMMITTED_PLAN / "config.json").read_text())
    plan = load_plan(COMMITTED_PLAN)
    assert len(plan) == config["num_prompts"] and [p["prompt_index"] for p in plan] == list(range(len(plan)))
    assert {s: sum(p["source"] == s for p in plan) for s in config["sources"]} == config["source_counts"]
    assert len({normalize_text(p["text"]) for p in plan}) == len(plan)
    assert not re.search(r"gsm8k|humaneval|human-eval|mt-bench|mt_bench", json.dumps(config["source_packages"]), re.I)
