"""The benchmark: metric computations on synthetic rounds, and the --quick path on a tiny model."""

import json

import pytest
import torch

from dspark_hf import DSparkDraftModel
from dspark_hf.benchmarks import bench_cli as bench
from dspark_hf.benchmarks.runner import RunRecord
from dspark_hf.benchmarks.summary import markdown_table, summarize
from dspark_hf.decoding.rounds import RoundStats
from tiny_models import random_target, tiny_tokenizer


def _round(verified, accepted, verify=0.050, draft=0.010, serial=0.004, schedule=0.001, drafted=True):
    return RoundStats(verified=verified, accepted=accepted, draft_time=draft, serial_time=serial,
                      schedule_time=schedule, verify_time=verify, drafted=drafted)


def test_summary_metrics_on_synthetic_rounds():
    rounds_a = [_round(3, 3), _round(3, 1), _round(0, 0, draft=0.0, serial=0.0, schedule=0.0, drafted=False)]
    rounds_b = [_round(2, 0), _round(3, 2)]
    records = [
        RunRecord("target", "gsm8k", "greedy", 0, new_tokens=10, seconds=1.0, target_prefill_seconds=0.5),
        RunRecord("target", "gsm8k", "greedy", 1, new_tokens=10, seconds=1.0, target_prefill_seconds=0.1),
        RunRecord("target-stock", "gsm8k", "greedy", 0, new_tokens=20, seconds=4.0),
        RunRecord("dspark-scheduler", "gsm8k", "greedy", 0, new_tokens=8, seconds=0.3, prefill_seconds=0.05,
                  rounds=rounds_a, identical=True, target_prefill_seconds=0.1),
        RunRecord("dspark-scheduler", "gsm8k", "greedy", 1, new_tokens=7, seconds=0.2, prefill_seconds=0.05,
                  rounds=rounds_b, identical=True, target_prefill_seconds=0.05),
        RunRecord("early-exit", "gsm8k", "greedy", 0, error="ValueError: unsupported"),
    ]
    rows = {r["method"]: r for r in summarize(records, block_size=3)}
    target, dspark = rows["target"], rows["dspark-scheduler"]
    assert target["tokens_per_s"] == pytest.approx(10.0) and target["speedup"] == pytest.approx(1.0)
    assert dspark["tokens_per_s"] == pytest.approx(15 / 0.5)
    assert dspark["speedup"] == pytest.approx(3.0)
    assert dspark["speedup_vs_stock"] == pytest.approx(6.0) and target["speedup_vs_stock"] == pytest.approx(2.0)
    # decode: each run's time less the target's prefill of its prompt; unknown where a run lacks it (stock here)
    assert target["decode_tokens_per_s"] == pytest.approx(20 / 1.4)
    assert dspark["decode_tokens_per_s"] == pytest.approx(15 / 0.35)
    assert dspark["decode_speedup"] == pytest.approx((15 / 0.35) / (20 / 1.4))
    assert rows["target-stock"]["decode_tokens_per_s"] is None and rows["target-stock"]["decode_speedup"] is None
    # tau: (accepted 6 + 5 rounds) / 5 rounds; efficiency 6 accepted of 11 verified
    assert dspark["tau"] == pytest.approx(11 / 5)
    assert dspark["verify_efficiency"] == pytest.approx(6 / 11)
    # position 1: verified in 4 rounds, accepted in 3; position 2: tried in 3 (verified >= 2, accepted
    # >= 1), passed in 2; position 3: tried in 2 (verified >= 3, accepted >= 2), passed in 1
    assert dspark["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert dspark["scheduled_length_histogram"] == [1, 0, 1, 3]
    assert dspark["drafted_fraction"] == pytest.approx(4 / 5)
    assert dspark["mean_scheduled_length"] == pytest.approx(11 / 5)
    split = dspark["ms_per_round"]
    assert split["target_verify"] == pytest.approx(50.0)
    assert split["draft_forward"] == pytest.approx(8.0)  # 4 drafted rounds x 10 ms over 5 rounds
    wall = 0.3 + 0.2 - 0.1  # prefill excluded
    parts = 5 * 0.050 + 4 * (0.010 + 0.004 + 0.001)
    assert split["other"] == pytest.approx(1e3 * (wall - parts) / 5)
    assert dspark["overhead_share"] == pytest.approx((wall - 0.25 - 0.04) / wall)
    assert dspark["identical_to_target"] is True
    assert rows["early-exit"]["tokens_per_s"] is None and rows["early-exit"]["errors"]
    table = markdown_table(list(rows.values()))
    assert "| gsm8k | greedy | dspark-scheduler | 30.0 | 3.00x | 3.00x | 6.00x | 2.20 | 0.55 | 80% | 0% |" in table
    assert "error: ValueError: unsupported" in table


def test_summary_flags_a_greedy_output_that_differs():
    records = [RunRecord("target", "d", "greedy", 0, new_tokens=4, seconds=1.0),
               RunRecord("prompt-lookup", "d", "greedy", 0, new_tokens=4, seconds=1.0, identical=False)]
    rows = {r["method"]: r for r in summarize(records)}
    assert rows["prompt-lookup"]["identical_to_target"] is False
    assert "**NO**" in markdown_table(list(rows.values()))


def test_quick_bench_on_a_tiny_model(tmp_path):
    words = [f"w{i}" for i in range(40)] + ["answer"]
    target = random_target("llama", vocab_size=48, num_layers=3, context_scale=0.3)
    target_dir, dspark_dir, dflash_dir = tmp_path / "target", tmp_path / "dspark", tmp_path / "dflash"
    target.save_pretrained(target_dir)
    tiny_tokenizer(words).save_pretrained(target_dir)
    DSparkDraftModel.from_target(target, block_size=4, markov_rank=8).save_pretrained(dspark_dir)
    DSparkDraftModel.from_target(target, block_size=4, markov_rank=0, confidence_head=False).save_pretrained(
        dflash_dir)
    candidate_dir = tmp_path / "candidate"  # a reduced-vocabulary draft, weighed against the first
    DSparkDraftModel.from_target(target, block_size=4, markov_rank=8, draft_vocab_ids=range(0, 48, 2)).save_pretrained(
        candidate_dir)
    prompt_dir = tmp_path / "prompts"
    prompt_dir.mkdir()
    gen = torch.Generator().manual_seed(0)
    for dataset in ("gsm8k", "humaneval", "mt-bench"):
        lines = [json.dumps({"turns": [" ".join(words[j] for j in torch.randint(0, 40, (8,), generator=gen))]})
                 for _ in range(3)]
        (prompt_dir / f"{dataset}.jsonl").write_text("\n".join(lines) + "\n")

    out = tmp_path / "out"
    result = bench.main(["--quick", "--target", str(target_dir), "--dspark", str(dspark_dir), "--dflash",
                         str(dflash_dir), "--candidate", str(candidate_dir), "--prompt-dir", str(prompt_dir),
                         "--max-new-tokens", "12", "--out", str(out),
                         "--batch-sizes", "1", "3"])

    for name in ("bench.json", "bench.md", "speedup.png", "acceptance.png", "sps.png"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "bench.json").read_text())
    assert saved["settings"]["datasets"] == ["gsm8k", "humaneval", "mt-bench"]  # the folder has no copy-heavy
    rows = saved["summary"]
    methods = {r["method"] for r in rows}
    assert methods == {"target", "target-stock", "dspark-scheduler", "dspark-no-lookup", "dspark-fixed-3",
                       "dflash-fixed-7", "prompt-lookup", "candidate-scheduler", "candidate-no-lookup"}
    assert len(rows) == 3 * 2 * len(methods)  # datasets x modes x methods
    assert {len([r for r in saved["runs"] if r["method"] == m]) for m in methods} == {3 * 2 * 2}  # 2 prompts
    for row in rows:
        assert not row["errors"], row
        assert 0 < row["decode_tokens_per_s"] and row["tokens_per_s"] < row["decode_tokens_per_s"]  # prefill timed
        if row["method"] == "target":
            assert row["speedup"] == pytest.approx(1.0) and row["decode_speedup"] == pytest.approx(1.0)
        elif row["mode"] == "greedy":
            assert row["identical_to_target"] is True, row
        if row["method"].startswith(("dspark", "dflash", "candidate")):
            assert row["rounds"] > 0 and row["tau"] >= 1.0
            assert sum(row["scheduled_length_histogram"]) == row["rounds"]
    fixed = [r for r in rows if r["method"] == "dspark-fixed-3"]
    assert all(max(k for k, n in enumerate(r["scheduled_length_histogram"]) if n) <= 3 for r in fixed)
    # No call profiled: the cached curve is the one the calls corrected and left (marked estimated).
    assert len(saved["sps"]) == 5 and saved["sps_profile"]["estimated"] and saved["sps_profile"]["observed_sizes"]
    assert result["environment"]["torch"] == torch.__version__
    sweep = json.loads((out / "batch_sweep.json").read_text())["rows"]
    assert [(r["batch_size"], r["mode"]) for r in sweep] == [(1, "greedy"), (1, "sample"), (3, "greedy"), (3, "sample")]
    for r in sweep:
        assert r["identical_to_target"] is (True if r["mode"] == "greedy" else None)
        assert r["prompts"] == (2 if r["batch_size"] == 1 else 3)  # --quick: 2 prompts, at least one batch
        assert r["dspark_batched_tokens_per_s"] > 0 and r["speedup_vs_batched_target"] > 0
        assert r["tau_batch"] >= 1.0 and r["limit"] > 0 and r["limit_padded"] > 0
        assert r["first_call_seconds"] > 0 and r["first_call_speedup"] > 0  # timed apart from the warm calls
        # a padded forward holds at least the verified tokens, at most R x (1 + longest proposal)
        assert r["batch_size"] <= r["mean_verified_tokens_per_round"] <= r["mean_padded_tokens_per_round"] <= r["batch_size"] * 11
    table = (out / "batch_sweep.md").read_text()
    assert (out / "batch_sweep.png").is_file() and "| 3 | sample |" in table and "first call" in table


def test_bench_dtype_option_loads_target_and_drafts_in_that_dtype(tmp_path):
    from dspark_hf.benchmarks.bench_cli import build_parser, load_models

    target = random_target("llama", vocab_size=48, num_layers=3)
    target_dir, draft_dir = tmp_path / "target", tmp_path / "dspark"
    target.save_pretrained(target_dir)
    tiny_tokenizer([f"w{i}" for i in range(40)]).save_pretrained(target_dir)
    DSparkDraftModel.from_target(target, block_size=4, markov_rank=8).save_pretrained(draft_dir)
    args = build_parser().parse_args(["--target", str(target_dir), "--dspark", str(draft_dir), "--dflash", "none",
                                      "--dtype", "bfloat16", "--no-fast-path"])
    loaded, _, stock, drafts = load_models(args)
    assert loaded.dtype == stock.dtype == torch.bfloat16
    assert {p.dtype for p in drafts["dspark"].parameters() if p.is_floating_point()} == {torch.bfloat16}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "int8"])


def test_default_datasets_are_those_in_the_prompt_folder(tmp_path):
    parser = bench.build_parser()
    (tmp_path / "copy-heavy.jsonl").write_text('{"turns": ["x"]}\n')
    args = parser.parse_args(["--prompt-dir", str(tmp_path)])
    bench.resolve_datasets(args, parser)
    assert args.datasets == ["copy-heavy"]
    args = parser.parse_args([])  # the packaged folder holds all four
    bench.resolve_datasets(args, parser)
    assert args.datasets == ["gsm8k", "humaneval", "mt-bench", "copy-heavy"]
    with pytest.raises(SystemExit):
        bench.resolve_datasets(parser.parse_args(["--prompt-dir", str(tmp_path / "none")]), parser)


def test_bench_runs_a_base_model_on_plain_text_prompts(tmp_path):
    """No chat template (a base model): the prompts are the questions as plain text."""
    words = [f"w{i}" for i in range(40)]
    target = random_target("llama", vocab_size=48, num_layers=2, context_scale=0.3)
    target_dir, dspark_dir = tmp_path / "target", tmp_path / "dspark"
    target.save_pretrained(target_dir)
    tokenizer = tiny_tokenizer(words)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(target_dir)
    DSparkDraftModel.from_target(target, block_size=4, markov_rank=8).save_pretrained(dspark_dir)
    prompt_dir = tmp_path / "prompts"
    prompt_dir.mkdir()
    (prompt_dir / "gsm8k.jsonl").write_text(json.dumps({"turns": ["w1 w2 w3 w4"]}) + "\n")
    result = bench.main(["--quick", "--target", str(target_dir), "--dspark", str(dspark_dir), "--dflash", "none",
                         "--prompt-dir", str(prompt_dir), "--datasets", "gsm8k", "--max-new-tokens", "8",
                         "--modes", "greedy", "--out", str(tmp_path / "out"), "--batch-sizes", "2"])
    rows = {row["method"]: row for row in result["summary"]}
    assert rows["dspark-scheduler"]["identical_to_target"] is True and rows["dspark-scheduler"]["new_tokens"] > 0
    assert not [run for run in result["runs"] if run["error"]]
    assert all(row["identical_to_target"] for row in result["batch_sweep"] if row["mode"] == "greedy")
