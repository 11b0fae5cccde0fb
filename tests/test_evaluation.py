"""Evaluation helpers: prompt loading and merging per-generation statistics."""

import json

import pytest

from dspark_hf.candidate_generator import DSparkGenerationStats, RoundStats
from dspark_hf.benchmarks.prompt_sets import load_eval_prompts
from dspark_hf.benchmarks.summary import merge_stats


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
