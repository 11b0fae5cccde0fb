"""Batched DSpark generation (batch size > 1): lossless per row, ragged caches, rows finishing alone."""

import itertools

import pytest
import torch
from transformers import pipeline
from transformers.generation.streamers import BaseStreamer

import dspark_hf.decoding.batched as batched
from dspark_hf.decoding import sampling
from dspark_hf import FixedLengthPolicy, PrefixScheduler
from generation_helpers import left_pad
from test_lossless_sampling import CONFIDENCE_LOGITS, DRAFT_PROBS, SPS, TARGET_PROBS, AnticipatingScheduler, _log
from tiny_models import bigram_target, markov_draft, random_target, target_next_token_table, tiny_tokenizer

VOCAB, BLOCK, EOS, PAD = 48, 4, 5, 0
# Flat enough that the scheduler verifies whole blocks for 5 padded rows (B = rows x width).
SMOOTH_SPS = [1 / (1 + 0.02 * b) for b in range(40)]


def _prompts(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, VOCAB, (int(torch.randint(2, 14, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _alone(target, prompt, max_new):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,policy", [("llama", "scheduler"), ("qwen3", "fixed")])
def test_batched_greedy_rows_equal_each_prompt_alone(arch, policy, monkeypatch):
    compactions, selections = [], []
    original_compact, original_select = batched._compact, batched._select_rows
    monkeypatch.setattr(batched, "_compact", lambda *a: compactions.append(1) or original_compact(*a))
    monkeypatch.setattr(batched, "_select_rows", lambda *a: selections.append(1) or original_select(*a))
    target = random_target(arch, eos_token_id=EOS, context_scale=0.5)
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK,
                         confidence_logits=torch.linspace(-2, 4, VOCAB))
    draft.generation_config.dspark_verify_policy = PrefixScheduler(SMOOTH_SPS) if policy == "scheduler" else FixedLengthPolicy(BLOCK)
    accepted = [0] * (BLOCK + 1)
    for seed in range(3):
        prompts = _prompts(5, seed)
        ids, mask = left_pad(prompts, PAD)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=PAD,
                              assistant_model=draft)
        for i, prompt in enumerate(prompts):
            alone = _alone(target, prompt, 60)
            row = out[i, ids.shape[1]:].tolist()
            assert row[: len(alone)] == alone, f"seed {seed} row {i}"
            assert all(t == PAD for t in row[len(alone):])  # a row that stopped early is padded
        for k, n in enumerate(draft.last_generation_stats.accepted_length_histogram()):
            accepted[k] += n
    assert compactions, "the ragged caches should have been compacted at least once"
    assert all(n > 0 for n in accepted[:3]), accepted


def test_rows_finish_independently_and_leave_the_batch(monkeypatch):
    kept_sizes = []
    original_select = batched._select_rows
    monkeypatch.setattr(batched, "_select_rows", lambda t, d, keep: kept_sizes.append(len(keep)) or original_select(t, d, keep))
    table = torch.full((VOCAB, VOCAB), -10.0)
    table[:, 7] = 0.0  # every token is followed by 7 ...
    table[9, EOS] = 10.0  # ... except 9, followed by EOS
    target = bigram_target(table, eos_token_id=EOS)
    draft = markov_draft(target, table, block_size=BLOCK, confidence_logits=torch.full((VOCAB,), 3.0))
    draft.generation_config.dspark_verify_policy = PrefixScheduler(SMOOTH_SPS)
    ids, mask = left_pad([[9], [3, 4], [6, 8, 9]], PAD)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft)
    assert out[0, 3:].tolist() == [EOS] + [PAD] * 11
    assert out[1, 3:].tolist() == [7] * 12
    assert out[2, 3:].tolist() == [EOS] + [PAD] * 11
    assert kept_sizes and kept_sizes[0] == 1  # the two finished rows left after the prefill


def test_pipeline_with_batch_size(monkeypatch):
    batches = []  # the rows of each batched DSpark call: the pipeline must reach the batched loop
    original_run = batched.BatchedDSparkGeneration.run
    monkeypatch.setattr(batched.BatchedDSparkGeneration, "run",
                        lambda self: batches.append(self.num_rows) or original_run(self))
    words = [f"w{i}" for i in range(40)] + ["answer"]
    tokenizer = tiny_tokenizer(words)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = "<unk>"
    target = random_target("llama", vocab_size=VOCAB, context_scale=0.5)
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK,
                         confidence_logits=torch.linspace(-2, 4, VOCAB))
    draft.generation_config.dspark_verify_policy = PrefixScheduler(SMOOTH_SPS)
    texts = ["w1 w2 w3", "w5", "w7 w8 w9 w10 w11", "w12 w13"]
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    expected = [pipe(t, max_new_tokens=15, do_sample=False)[0]["generated_text"] for t in texts]
    assert batches == []  # one prompt at a time goes through transformers' assisted loop
    got = pipe(texts, max_new_tokens=15, do_sample=False, assistant_model=draft, batch_size=4)
    assert [g[0]["generated_text"] for g in got] == expected
    assert batches == [4], batches  # one batched call over the four prompts
    stats = draft.last_generation_stats
    assert {r.row for r in stats.rounds} == {0, 1, 2, 3} and stats.accepted_tokens > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"repetition_penalty": 1.2}, "RepetitionPenaltyLogitsProcessor"),
    ({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
])
def test_unsupported_batched_settings(kwargs, match):
    target = random_target("llama")
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK)
    ids, mask = left_pad([[3, 4], [5, 6, 7]], PAD)
    with pytest.raises(ValueError, match=match):
        target.generate(ids, attention_mask=mask, max_new_tokens=5, assistant_model=draft, **kwargs)


class NullStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


def test_streamer_needs_batch_size_one():
    target = random_target("llama")
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK)
    ids, mask = left_pad([[3, 4], [5, 6, 7]], PAD)
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(ids, attention_mask=mask, max_new_tokens=5, assistant_model=draft, streamer=NullStreamer())


# ------------------------------------------------------------------------- sampling, R > 1
# The batched forward costs rows x width tokens: this slope makes the scheduler verify 0, 1, 2 and 3 tokens.
BATCH_SPS = [1 / (1 + 0.05 * b) for b in range(12)]
ROWS = [[2], [0, 3], [1]]  # last tokens 2, 3, 1: three different exact distributions; row 2 is padded
NUM_TOKENS, NUM_SAMPLES = 3, 1500


def _batched_p_values(policy, seed=0, rows=ROWS, draft_vocab_ids=None, **generate_kwargs):
    """Chi-square p-value per row of batched sampling against the exact distribution; the rounds
    per draft source land in ``_batched_p_values.sources`` (for the context-lookup tests)."""
    target = bigram_target(_log(TARGET_PROBS))
    draft = markov_draft(target, _log(DRAFT_PROBS), block_size=3, confidence_logits=CONFIDENCE_LOGITS,
                         draft_vocab_ids=draft_vocab_ids)
    draft.generation_config.dspark_verify_policy = policy
    draft.generation_config.dspark_adaptive_drafting = False
    ids, mask = left_pad(rows, PAD)
    ids[ids == PAD] = 0
    torch.manual_seed(seed)
    counts = [dict() for _ in rows]
    scheduled, sources = [0] * 4, {}
    for _ in range(NUM_SAMPLES):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NUM_TOKENS + 2, do_sample=True,
                              temperature=1.0, top_k=None, top_p=None, pad_token_id=0, assistant_model=draft,
                              **generate_kwargs)
        for r in range(len(rows)):
            seq = tuple(out[r, ids.shape[1]: ids.shape[1] + NUM_TOKENS].tolist())
            counts[r][seq] = counts[r].get(seq, 0) + 1
        for k, n in enumerate(draft.last_generation_stats.scheduled_length_histogram()[:4]):
            scheduled[k] += n
        for round_stats in draft.last_generation_stats.rounds:
            sources[round_stats.source] = sources.get(round_stats.source, 0) + 1
    _batched_p_values.sources = sources
    p_values = []
    for r, prompt in enumerate(rows):
        chi2, cells = 0.0, 0
        for seq in itertools.product(range(4), repeat=NUM_TOKENS):
            p, prev = 1.0, prompt[-1]
            for y in seq:
                p *= TARGET_PROBS[prev, y].item()
                prev = y
            expected = NUM_SAMPLES * p
            if expected < 1e-9:
                assert seq not in counts[r], f"row {r} generated {seq}, which has probability 0"
                continue
            chi2 += (counts[r].get(seq, 0) - expected) ** 2 / expected
            cells += 1
        p_values.append(torch.special.gammaincc(torch.tensor((cells - 1) / 2.0), torch.tensor(chi2 / 2.0)).item())
    return p_values, scheduled


def test_batched_sampling_matches_the_target_distribution_per_row():
    p_values, scheduled = _batched_p_values(PrefixScheduler(BATCH_SPS))
    assert scheduled[0] > 0 and scheduled[1] > 0 and scheduled[3] > 0, scheduled
    assert min(p_values) > 1e-3, f"a row deviates from the target distribution: p = {p_values}"


def test_batched_sampling_with_a_reduced_draft_draws_over_its_columns_and_matches_the_target(monkeypatch):
    # The batched loop verifies with the serial loop's own q, so a reduced draft (tokens 0, 1, 3) is
    # sampled over its three columns; token 2, outside them, can only come from the residual. Every
    # row must still follow the target.
    widths, real = [], sampling.draw_categorical
    monkeypatch.setattr(sampling, "draw_categorical",
                        lambda probs, generator=None: widths.append(probs.shape[-1]) or real(probs, generator))
    p_values, scheduled = _batched_p_values(PrefixScheduler(BATCH_SPS), draft_vocab_ids=[0, 1, 3])
    assert widths and set(widths) == {3}, set(widths)
    assert scheduled[1] > 0 and scheduled[3] > 0, scheduled
    assert min(p_values) > 1e-3, f"a row deviates from the target distribution: p = {p_values}"
    # Power: the same run with q renormalised over the whole vocabulary (mass on token 2) must fail.
    real_serial = batched.serial_sample

    def misreported(*args, **kwargs):
        sample = real_serial(*args, **kwargs)
        row_max = sample.logits.amax(-1, keepdim=True)
        sample.probabilities = torch.softmax(torch.where(torch.isinf(sample.logits), row_max - 1.0, sample.logits), -1)
        return sample

    monkeypatch.setattr(batched, "serial_sample", misreported)
    p_values, _ = _batched_p_values(PrefixScheduler(BATCH_SPS), draft_vocab_ids=[0, 1, 3])
    assert min(p_values) < 1e-5, f"the test failed to detect a misreported q: p = {p_values}"


def test_batched_anticipating_scheduler_is_detected():
    # Each row takes its globally best prefix (no early stop): whether x_k is verified then depends on
    # c_{k+1}, i.e. on x_k itself (paper Appendix A); admit_batch applies it row by row.
    p_values, _ = _batched_p_values(AnticipatingScheduler(SPS))
    assert min(p_values) < 1e-5, f"the test failed to detect the anticipating scheduler's bias: p = {p_values}"
