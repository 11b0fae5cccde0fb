"""Evaluation helpers: prompt loading, merging per-generation statistics, and batched evaluation
measuring the same rounds as one prompt at a time."""

import json

import pytest
import torch

from dspark_hf.benchmarks.acceptance import left_padded, measure_acceptance
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.benchmarks.summary import merge_stats
from dspark_hf.decoding.rounds import DSparkGenerationStats, RoundStats
from tiny_models import bigram_target, markov_draft, tiny_tokenizer


def test_load_eval_prompts_first_turns(tmp_path, monkeypatch):
    rows = [{"turns": [f"q{i}", "follow-up"]} for i in range(5)]
    (tmp_path / "mt-bench.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv("DSPARK_EVAL_PROMPTS", str(tmp_path))
    assert load_eval_prompts("mt-bench", 3) == ["q0", "q1", "q2"]
    assert len(load_eval_prompts("mt-bench")) == 5
    with pytest.raises(FileNotFoundError, match="DSPARK_EVAL_PROMPTS"):
        load_eval_prompts("gsm8k")


def test_merge_stats_pools_rounds():
    def stats(*pairs):
        s = DSparkGenerationStats(block_size=3)
        s.rounds = [RoundStats(v, a, 0.0, 0.0, 0.0, 0.0) for v, a in pairs]
        return s

    merged = merge_stats([stats((3, 3), (3, 0)), stats((3, 1))])
    assert merged.num_rounds == 3 and merged.accepted_tokens == 4
    assert merged.mean_accepted_length == pytest.approx(7 / 3)
    assert merged.per_position_acceptance() == [pytest.approx(2 / 3), pytest.approx(1 / 2), 1.0]

WORDS = ["answer", "a", "b", "c", "d", "e", "f", "g", "h", "i"]


def _pair_and_tokenizer():
    """Greedy paths: a -> b -> ... -> f -> EOS ends a row early; g -> h -> i -> g never ends, so a row
    started there runs to max_new_tokens. The draft knows the paths with noise: some rounds reject."""
    tokenizer = tiny_tokenizer(WORDS)
    # the prompt's own last word starts the answer (the bigram target sees only the last token)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = {w: tokenizer.convert_tokens_to_ids(w) for w in WORDS}
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    table = torch.full((vocab, vocab), -4.0)
    for current, following in zip("abcde", "bcdef"):
        table[ids[current], ids[following]] = 4.0
    table[ids["f"], eos] = 4.0
    for current, following in zip("ghi", "hig"):
        table[ids[current], ids[following]] = 4.0
    table[ids["answer"], ids["a"]] = 4.0
    table[eos, eos] = 4.0
    target = bigram_target(table, eos_token_id=eos)
    noisy = table + 3.0 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    return target, markov_draft(target, noisy, block_size=4), tokenizer


def test_left_padded_right_aligns_prompts():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batched_greedy_evaluation_measures_the_same_rounds_as_batch_one():
    target, draft, tokenizer = _pair_and_tokenizer()
    # prompts of different lengths; "g"/"h" rows never reach EOS, the others stop early
    prompts = ["b", "g h", "c d", "h", "a b c"]
    alone = measure_acceptance(target, tokenizer, draft, prompts, do_sample=False, max_new_tokens=24)
    batched = measure_acceptance(target, tokenizer, draft, prompts, do_sample=False, max_new_tokens=24,
                                 batch_size=3)
    # the rows stop at different lengths: some at EOS, the others at the limit
    assert alone["new_tokens"] < len(prompts) * 24 and alone["new_tokens"] > 2 * 24
    assert 1.0 < alone["tau"] < 4.0, alone  # some drafted tokens are rejected, some accepted
    for key in ("rounds", "new_tokens", "tau", "per_position_acceptance"):
        assert batched[key] == alone[key], key


def test_evaluate_cli_takes_any_target_and_a_tokenizer_without_chat_template(tmp_path):
    """`dspark-hf evaluate --target FOLDER`: a local base model (no chat template) and its draft."""
    from dspark_hf import DSparkDraftModel
    from dspark_hf.benchmarks import acceptance, evaluate_cli
    from tiny_models import random_target

    words = "the a of to and is in that it for Janet eggs ducks day sells".split()
    tokenizer = tiny_tokenizer(words)
    tokenizer.chat_template = None  # a base model's tokenizer
    target = random_target("llama", vocab_size=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    DSparkDraftModel.from_target(target, block_size=4).save_pretrained(tmp_path / "draft")
    out = tmp_path / "tau.json"
    evaluate_cli.main(["--drafts", str(tmp_path / "draft"), "--target", str(tmp_path / "target"),
                       "--datasets", "gsm8k", "--modes", "greedy", "--num-prompts", "2", "--max-new-tokens", "8",
                       "--out", str(out)])
    saved = json.loads(out.read_text())
    result = saved["results"]["draft/gsm8k/greedy"]
    assert saved["settings"]["target"] == str(tmp_path / "target")
    assert result["new_tokens"] == 2 * 8 and result["rounds"] > 0  # both prompts answered in full
    assert acceptance.encode_prompt(tokenizer, "Janet sells eggs") == tokenizer("Janet sells eggs")["input_ids"]
