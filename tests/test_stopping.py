"""Stopping is exact: DSpark output ends where the target alone stops, at batch size 1 and batched.

transformers' assisted loop checks stopping criteria only at the end of each accepted block; these
tests put stops (custom criteria, stop strings spanning token boundaries, EOS ids) at random
positions inside accepted blocks and compare token for token with the target alone (greedy), or
check that a sampled output ends exactly at its first firing position (seeded sampling), and that
the sampled stopped sequences follow the target's exact distribution.
"""

import itertools

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria

import dspark_hf.decoding.integration as integration
from dspark_hf import FixedLengthPolicy, PrefixScheduler
from dspark_hf.decoding.stopping import first_stops
from generation_helpers import CollectingStreamer, left_pad
from test_lossless_sampling import DRAFT_PROBS, TARGET_PROBS, _log
from tiny_models import bigram_target, markov_draft, random_target, target_next_token_table, tiny_tokenizer

VOCAB, BLOCK, PAD = 48, 4, 0
SMOOTH_SPS = [1 / (1 + 0.12 * b) for b in range(40)]


class StopAfter(StoppingCriteria):
    """Fires on row r once the sequence (prompt included) has ``lengths[r]`` tokens."""

    def __init__(self, lengths):
        self.lengths = torch.as_tensor(lengths)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.lengths[: input_ids.shape[0]]


class StopOnToken(StoppingCriteria):
    """Fires when the last token is one of ``tokens`` (content-based: it fires and unfires)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(sorted(tokens))

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


@pytest.fixture
def cuts(monkeypatch):
    """Records (length before the cut, stop length) for every batch-1 call cut inside a round."""
    recorded = []
    original = integration.cut_output

    def spy(output, stop_length, prompt_len):
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        recorded.append((sequences.shape[1], stop_length))
        return original(output, stop_length, prompt_len)

    monkeypatch.setattr(integration, "cut_output", spy)
    return recorded


def _inside(cuts):
    return sum(before > stop for before, stop in cuts)


def _prompts(n, seed, low=2, high=20):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (1, int(torch.randint(low, high, (1,), generator=gen))), generator=gen)
            for _ in range(n)]


def _target_and_draft(arch="llama", seed=0, policy=None):
    target = random_target(arch, seed=seed, context_scale=0.5)
    # The draft proposes the target's next token given only the current one: whole blocks are often accepted.
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK,
                         confidence_logits=torch.linspace(-2, 4, VOCAB))
    draft.generation_config.dspark_verify_policy = policy or FixedLengthPolicy(BLOCK)
    draft.generation_config.dspark_adaptive_drafting = False
    return target, draft


def _first_firing(criterion, sequence, start):
    """The first length L > start at which ``criterion`` fires on ``sequence[:L]`` (row 0), or None."""
    for length in range(start + 1, sequence.shape[-1] + 1):
        if bool(criterion(sequence[None, :length], None)[0]):
            return length
    return None


def test_first_stops_equals_a_prefix_by_prefix_check():
    # The vectorised search (stop-string windows in one call, EOS by isin, length by arithmetic)
    # against calling every criterion on every prefix, on short and long rows with random starts.
    tokenizer = _word_tokenizer()
    gen = torch.Generator().manual_seed(3)
    fired = 0
    for trial in range(30):
        criteria = [StopStringCriteria(tokenizer, ["b c", "a ab", "g"]), StopOnToken({5, 6}), EosTokenCriteria([7, 8]),
                    MaxLengthCriteria(int(torch.randint(3, 30, (1,), generator=gen)))]
        chosen = [c for c, keep in zip(criteria, torch.rand(4, generator=gen) < 0.6) if keep]
        lengths = torch.randint(1, 25, (4,), generator=gen).tolist()
        sequences = [torch.randint(2, VOCAB, (n,), generator=gen) for n in lengths]
        starts = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lengths]
        expected = [_first_firing(StoppingCriteriaList(chosen), seq, start) if chosen else None
                    for seq, start in zip(sequences, starts)]
        assert first_stops(chosen, sequences, starts) == expected, f"trial {trial}"
        fired += sum(e is not None for e in expected)
    assert fired >= 30


# ------------------------------------------------------------------------------------------ batch 1
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_custom_criteria_at_random_positions_identical_to_target(arch, cuts):
    target, draft = _target_and_draft(arch)
    gen = torch.Generator().manual_seed(1)
    for i, prompt in enumerate(_prompts(10, seed=2)):
        n = prompt.shape[1]
        stop = StoppingCriteriaList([StopAfter([n + int(torch.randint(1, 35, (1,), generator=gen))])])
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False, stopping_criteria=stop)
        got = target.generate(prompt, max_new_tokens=40, do_sample=False, stopping_criteria=stop, assistant_model=draft)
        assert got.tolist() == expected.tolist(), f"prompt {i}: length stop"
        assert expected.shape[1] == int(stop[0].lengths[0])
        # A content stop: a token the target emits at a random position of its free run.
        free = target.generate(prompt, max_new_tokens=40, do_sample=False)
        token = int(free[0, n + int(torch.randint(2, 40, (1,), generator=gen))])
        stop = StoppingCriteriaList([StopOnToken({token})])
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False, stopping_criteria=stop)
        got = target.generate(prompt, max_new_tokens=40, do_sample=False, stopping_criteria=stop, assistant_model=draft)
        assert got.tolist() == expected.tolist(), f"prompt {i}: token stop"
        assert expected[0, -1].item() == token
    assert _inside(cuts) >= 5, f"too few stops fell inside an accepted block: {cuts}"


def _word_tokenizer():
    """48 tokens: <unk>, <eos>, 45 two-letter words and "abcdef" (StopStringCriteria tokenizes that
    word to learn how tokens decode). Decoded text joins words with spaces: "ab cd"."""
    words = ["".join(p) for p in itertools.product("abcdefg", repeat=2)][:45] + ["abcdef"]
    tokenizer = tiny_tokenizer(words)
    assert len(tokenizer) == VOCAB
    return tokenizer


def test_stop_strings_spanning_token_boundaries_identical_to_target(cuts):
    tokenizer = _word_tokenizer()
    target, draft = _target_and_draft("qwen3", seed=3)
    gen = torch.Generator().manual_seed(4)
    spanning = 0
    for i, prompt in enumerate(_prompts(12, seed=5)):
        n = prompt.shape[1]
        free = target.generate(prompt, max_new_tokens=30, do_sample=False)[0].tolist()
        words = tokenizer.convert_ids_to_tokens(free)
        j = n + int(torch.randint(2, 30, (1,), generator=gen))
        if not (words[j - 1].isalpha() and words[j].isalpha()):
            continue
        # The end of one word, the space, the start of the next: only a token boundary can hold it.
        stops = [words[j - 1][-1] + " " + words[j][0], words[j - 1][-1] + " " + words[j] + " zz"]
        expected = target.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=stops,
                                   tokenizer=tokenizer)
        got = target.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=stops, tokenizer=tokenizer,
                              assistant_model=draft)
        assert got.tolist() == expected.tolist(), f"prompt {i}: stop strings {stops}"
        assert expected.shape[1] <= j + 1  # the target alone stopped at (or before) the planted boundary
        spanning += 1
    assert spanning >= 8
    assert _inside(cuts) >= 3, f"too few stops fell inside an accepted block: {cuts}"


def test_eos_from_a_criterion_and_from_the_config(cuts):
    target, draft = _target_and_draft("llama", seed=1)
    gen = torch.Generator().manual_seed(6)
    for i, prompt in enumerate(_prompts(8, seed=7)):
        n = prompt.shape[1]
        free = target.generate(prompt, max_new_tokens=30, do_sample=False)[0]
        eos_a, eos_b = (int(free[n + int(torch.randint(3, 30, (1,), generator=gen))]) for _ in range(2))
        # An EosTokenCriteria passed by the user (generation_config has no EOS id): transformers' loop
        # does not cut at it inside a round.
        kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD,
                      stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_a)]))
        expected = target.generate(prompt, **kwargs)
        got = target.generate(prompt, assistant_model=draft, **kwargs)
        assert got.tolist() == expected.tolist() and expected[0, -1].item() == eos_a, f"prompt {i}: criterion EOS"
        # The config's EOS id together with a length criterion: whichever fires first ends the output.
        kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD, eos_token_id=eos_b,
                      stopping_criteria=StoppingCriteriaList([StopAfter([n + int(torch.randint(1, 30, (1,),
                                                                                             generator=gen))])]))
        expected = target.generate(prompt, **kwargs)
        got = target.generate(prompt, assistant_model=draft, **kwargs)
        assert got.tolist() == expected.tolist(), f"prompt {i}: config EOS and length"
    assert _inside(cuts) >= 4, cuts


def test_streamer_and_returned_outputs_end_at_the_stop(cuts):
    target, draft = _target_and_draft("llama")
    for i, prompt in enumerate(_prompts(8, seed=8)):
        n, new = prompt.shape[1], 7 + i
        stop = StoppingCriteriaList([StopAfter([n + new])])
        streamer = CollectingStreamer()
        kwargs = dict(max_new_tokens=30, do_sample=False, stopping_criteria=stop, return_dict_in_generate=True,
                      output_scores=True, output_logits=True, output_hidden_states=True)
        ref = target.generate(prompt, **kwargs)
        got = target.generate(prompt, assistant_model=draft, streamer=streamer, **kwargs)
        assert got.sequences.tolist() == ref.sequences.tolist()
        assert streamer.tokens == got.sequences[0].tolist() + ["END"]  # nothing past the stop was streamed
        assert len(got.scores) == len(got.logits) == len(got.hidden_states) == len(ref.scores) == new
        for mine, theirs in zip(got.scores, ref.scores):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
        assert got.cache.get_seq_length() == ref.cache.get_seq_length() == n + new - 1
    assert _inside(cuts) >= 3, cuts


def test_seeded_sampling_ends_at_the_first_firing_position(cuts):
    target, draft = _target_and_draft("llama", seed=4, policy=PrefixScheduler(SMOOTH_SPS))
    gen = torch.Generator().manual_seed(9)
    for i, prompt in enumerate(_prompts(12, seed=10)):
        n = prompt.shape[1]
        token_stop = StopOnToken(set(torch.randint(2, VOCAB, (3,), generator=gen).tolist()))
        length_stop = StopAfter([n + int(torch.randint(1, 30, (1,), generator=gen))])
        torch.manual_seed(i)
        out = target.generate(prompt, max_new_tokens=30, do_sample=True, temperature=0.7, assistant_model=draft,
                              stopping_criteria=StoppingCriteriaList([token_stop, length_stop]))[0]
        either = StoppingCriteriaList([token_stop, length_stop])
        assert _first_firing(either, out, n) == out.shape[0], f"sample {i} runs past its first stop"
    assert _inside(cuts) >= 3, cuts


def test_sampled_stopped_sequences_follow_the_target_distribution(cuts):
    # Bigram target and draft over 4 tokens; stop at the first token 1 or after 4 tokens. Each
    # stopped sequence's exact probability is known; sequences running past a 1 have probability 0.
    target = bigram_target(_log(TARGET_PROBS))
    draft = markov_draft(target, _log(DRAFT_PROBS), block_size=3)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(3)
    draft.generation_config.dspark_adaptive_drafting = False
    prompt, max_new, samples = torch.tensor([[2]]), 4, 500
    stop = StoppingCriteriaList([StopOnToken({1})])
    exact = {}
    for length in range(1, max_new + 1):
        for seq in itertools.product(range(4), repeat=length):
            if 1 in seq[:-1] or (length < max_new and seq[-1] != 1):
                continue
            p, prev = 1.0, 2
            for y in seq:
                p, prev = p * TARGET_PROBS[prev, y].item(), y
            if p > 0:
                exact[seq] = p
    torch.manual_seed(0)
    counts = {}
    for _ in range(samples):
        out = target.generate(prompt, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=None,
                              top_p=None, stopping_criteria=stop, assistant_model=draft, pad_token_id=0)
        seq = tuple(out[0, 1:].tolist())
        assert seq in exact, f"generated {seq}, which the target alone never produces"
        counts[seq] = counts.get(seq, 0) + 1
    # Cells expected fewer than 5 times are pooled into one, so the chi-square approximation holds.
    cells = [([s], p) for s, p in exact.items() if samples * p >= 5]
    cells.append(([s for s, p in exact.items() if samples * p < 5], sum(p for p in exact.values() if samples * p < 5)))
    chi2 = sum((sum(counts.get(s, 0) for s in seqs) - samples * p) ** 2 / (samples * p) for seqs, p in cells)
    p_value = torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0), torch.tensor(chi2 / 2.0)).item()
    assert p_value > 1e-3, f"stopped sequences deviate from the target distribution: p = {p_value}"
    assert len(cells) >= 8 and _inside(cuts) >= 20, (len(cells), _inside(cuts))


def test_max_time_keeps_its_meaning():
    target, draft = _target_and_draft("llama")
    prompt = _prompts(1, seed=11)[0]
    # max_time=0 runs out during the prefill: plain generate stops after one token, so does DSpark.
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, max_time=0.0)
    got = target.generate(prompt, max_new_tokens=30, do_sample=False, max_time=0.0, assistant_model=draft)
    assert got.tolist() == expected.tolist() and got.shape[1] == prompt.shape[1] + 1


# ------------------------------------------------------------------------------------------ batched
def _batch(seed, rows=5):
    ids, mask = left_pad([p[0].tolist() for p in _prompts(rows, seed=seed, high=12)], PAD)
    return ids, mask


def _batches(count, first_seed):
    """``count`` batches from seeds ``first_seed``, ``first_seed + 1``, ...; yields (index, ids, mask)."""
    for index in range(count):
        yield index, *_batch(seed=first_seed + index)


def test_batched_rows_stop_at_their_own_first_firing_position():
    tokenizer = _word_tokenizer()
    target, draft = _target_and_draft("llama", seed=5, policy=PrefixScheduler(SMOOTH_SPS))
    gen = torch.Generator().manual_seed(12)
    cut_rows = 0
    for seed, ids, mask in _batches(3, first_seed=20):
        rows, width = ids.shape
        free = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
        words = tokenizer.convert_ids_to_tokens(free[0].tolist())
        j = width + int(torch.randint(3, 40, (1,), generator=gen))
        stop_string = words[j - 1][-1] + " " + words[j][0] if words[j - 1].isalpha() and words[j].isalpha() else "zz"
        per_row = StopAfter((width + torch.randint(1, 40, (rows,), generator=gen)).tolist())
        # With an EOS id set, plain generate pads each row after its own stop (without one it lets
        # finished rows run on until the last row stops, a transformers quirk DSpark does not copy).
        kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD, eos_token_id=1,
                      stopping_criteria=StoppingCriteriaList([per_row]), stop_strings=[stop_string],
                      tokenizer=tokenizer)
        expected = target.generate(ids, **kwargs)
        got = target.generate(ids, assistant_model=draft, **kwargs)
        assert got.tolist() == expected.tolist(), f"seed {seed}"
        cut_rows += sum(int((expected[r, width:] != PAD).sum()) < 40 for r in range(rows))
    assert cut_rows >= 8


def test_batched_seeded_sampling_rows_end_at_their_first_firing_position():
    target, draft = _target_and_draft("qwen3", seed=6, policy=PrefixScheduler(SMOOTH_SPS))
    gen = torch.Generator().manual_seed(13)
    stopped_early = 0
    for seed, ids, mask in _batches(4, first_seed=30):
        rows, width = ids.shape
        token_stop = StopOnToken(set(torch.randint(2, VOCAB, (3,), generator=gen).tolist()))
        length_stop = StopAfter((width + torch.randint(1, 30, (rows,), generator=gen)).tolist())
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=True, temperature=0.7,
                              pad_token_id=PAD, assistant_model=draft,
                              stopping_criteria=StoppingCriteriaList([token_stop, length_stop]))
        for r in range(rows):
            row_stop = StoppingCriteriaList([token_stop, StopAfter([int(length_stop.lengths[r])])])
            first = _first_firing(row_stop, out[r], width)
            if first is None:  # never fired: the row ran to max_new_tokens
                assert out.shape[1] == width + 30, f"seed {seed} row {r} stopped without a reason"
                continue
            # PAD may also be sampled, so only the part after the first firing position is known to be padding.
            assert (out[r, first:] == PAD).all(), f"seed {seed} row {r} runs past its first stop"
            stopped_early += int(first < width + 30)
    assert stopped_early >= 8


def test_batched_max_time():
    target, draft = _target_and_draft("llama")
    ids, mask = _batch(seed=40, rows=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD, max_time=0.0)
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=draft, **kwargs)
    assert got.tolist() == expected.tolist() and got.shape[1] == ids.shape[1] + 1
