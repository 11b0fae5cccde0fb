"""Lossless at the edges (issue 31): a draft that overflows mid-block, short position tables,
lossy transformers options, corrupt step-rate caches, bad policy answers, mis-typed checkpoints and
attention outputs.

Item 1 is a chi-square test with its power check: a float16 Markov draft whose bias is ``inf``
after token 0 must sample exactly the target's distribution (the round is cut before the first
non-finite position), and the old rule (drop the whole round when any position is non-finite, so
that ``x_1 = 0`` decides through position 2 whether ``x_1`` is verified) must be detected.
"""

import itertools
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from dspark_hf import DSparkDraftModel
from dspark_hf.scheduling.policies import VerifyPolicy
from dspark_hf.decoding.serial_block import SerialSample
from dspark_hf.scheduling.shared_cost import shared_cost_model
from dspark_hf.scheduling.step_rates import fitted_context_length, max_positions, profile_sps, sps_cache_key
from tiny_models import bigram_target, markov_draft, random_target, target_next_token_table

# The tables of tests/test_lossless_sampling.py: the repro.
TARGET_PROBS = torch.tensor(
    [[0.5, 0.2, 0.2, 0.1], [0.7, 0.3, 0.0, 0.0], [0.1, 0.3, 0.3, 0.3], [0.6, 0.1, 0.1, 0.2]]
)
DRAFT_PROBS = torch.tensor(
    [[0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.3, 0.3, 0.2, 0.2]]
)
PROMPT = torch.tensor([[2]])
CHAIN_TOKENS = 3000  # batch 1: one long generation, its transitions compared with the target's table
COMPARED = 3  # batched: the first 3 tokens of each row (the target's first, then draft positions 1, 2)
ROWS, BATCH_ROWS = 2000, 500


def _log(p):
    return torch.log(p.clamp_min(1e-12))


def _overflowing_draft(target):
    """The Markov draft of the issue in float16, with bias ``B(0, .) = 2 * 40000 = inf``: every
    position after a drafted (or anchor) 0 has a non-finite distribution; no other does."""
    draft = markov_draft(target, _log(DRAFT_PROBS), block_size=3).half()
    with torch.no_grad():
        draft.markov_head.markov_w1.weight[0, 0] = 2.0
        draft.markov_head.markov_w2.weight[:, 0] = 40000.0
    return draft.eval()


def _exact():
    exact = {}
    for seq in itertools.product(range(4), repeat=COMPARED):
        p, prev = 1.0, PROMPT[0, -1].item()
        for y in seq:
            p *= TARGET_PROBS[prev, y].item()
            prev = y
        exact[seq] = p
    return exact


def _p_value(chi2: float, dof: int) -> float:
    return torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)).item()


def _sampled_p_value(path: str, seed: int = 0) -> float:
    """Chi-square p-value of sampled output against the target's exact distribution.

    ``"batch1"``: the target is a bigram chain, so each emitted token given the one before it must
    follow ``TARGET_PROBS[previous]``, whichever round and block position produced it; one long
    generation gives thousands of rounds (every cut position is exercised) and the transition counts
    are tested row by row (Pearson's test for a Markov chain, sum of (row cells - 1) degrees of
    freedom). ``"batched"``: identical prompts in one batch are independent draws; the first
    ``COMPARED`` tokens of each row are compared with their exact distribution.
    """
    target = bigram_target(_log(TARGET_PROBS))
    draft = _overflowing_draft(target)
    settings = dict(do_sample=True, top_k=None, top_p=None, assistant_model=draft, num_assistant_tokens=3,
                    prompt_lookup_num_tokens=0)
    torch.manual_seed(seed)
    if path == "batch1":
        sequence = target.generate(PROMPT, max_new_tokens=CHAIN_TOKENS, **settings)[0]
        counts = torch.zeros(4, 4).index_put_((sequence[:-1], sequence[1:]), torch.tensor(1.0), accumulate=True)
        possible = TARGET_PROBS > 0
        assert not counts[~possible].any(), "generated a transition the target gives probability 0"
        expected = counts.sum(dim=1, keepdim=True) * TARGET_PROBS
        chi2 = ((counts - expected)[possible] ** 2 / expected[possible]).sum().item()
        return _p_value(chi2, int(possible.sum()) - 4)
    prompts = PROMPT.repeat(BATCH_ROWS, 1)
    counts: dict[tuple, int] = {}
    for _ in range(ROWS // BATCH_ROWS):  # 5 new tokens: the first round drafts and may verify 3
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=5, **settings)
        for row in out[:, 1: 1 + COMPARED].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    chi2, cells = 0.0, 0
    for seq, p in _exact().items():
        if p == 0.0:
            assert seq not in counts, f"generated {seq}, which the target gives probability 0"
            continue
        chi2 += (counts.get(seq, 0) - ROWS * p) ** 2 / (ROWS * p)
        cells += 1
    return _p_value(chi2, cells - 1)


def _whole_round_rule(self: SerialSample) -> torch.Tensor:
    """The old rule: a row with any non-finite drawn position verifies nothing."""
    width = self.tokens.shape[1]
    return torch.where(_finite_lengths(self) == width, width, 0)


_finite_lengths = SerialSample.finite_lengths


# --------------------------------------------------------------------------- item 1: overflow mid-block
@pytest.mark.parametrize("path", ["batch1", "batched"])
def test_draft_overflowing_mid_block_samples_the_target_distribution(path, caplog):
    with caplog.at_level(logging.WARNING):
        p_value = _sampled_p_value(path)
    assert p_value > 1e-3, f"sampling with a draft overflowing mid-block deviates from the target (p={p_value:.2e})"
    assert any("before the first non-finite position" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path", ["batch1", "batched"])
def test_dropping_the_whole_round_is_detected_as_biased(path, monkeypatch):
    """The power check: the same test on the old rule (p = 4e-10 at batch 1, 1e-28 batched)."""
    monkeypatch.setattr(SerialSample, "finite_lengths", _whole_round_rule)
    p_value = _sampled_p_value(path)
    assert p_value < 1e-6, f"the test failed to detect the whole-round rule's bias (p={p_value:.2e})"


@pytest.mark.parametrize("batched", [False, True])
def test_draft_overflowing_mid_block_keeps_greedy_output_and_verifies_the_finite_prefix(batched):
    target = bigram_target(_log(TARGET_PROBS))
    draft = _overflowing_draft(target)
    prompt = torch.tensor([[2], [1]]) if batched else torch.tensor([[2]])
    kwargs = dict(attention_mask=torch.ones_like(prompt)) if batched else {}
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=draft,
                          num_assistant_tokens=3, prompt_lookup_num_tokens=0, **kwargs)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False, **kwargs))
    # From 2 the target emits 1, 0, 0, ...; the draft's argmax after the anchor 1 is 0, whose
    # successor overflows: that round verifies the 0 before it (the old rule verified nothing).
    assert draft.last_generation_stats.verified_tokens > 0


def test_finite_lengths_cut_at_the_first_non_finite_position():
    logits = torch.zeros(3, 4, 5)
    logits[0, 2, 1] = float("inf")  # position 3 of row 0
    logits[1, 0] = float("-inf")  # nothing drawable at position 1 of row 1
    logits[2, :, 3:] = float("-inf")  # a top-k mask: fine
    confidences = torch.full((3, 4), 0.5)
    confidences[2, 3] = float("nan")
    sample = SerialSample(tokens=torch.zeros(3, 4, dtype=torch.long), logits=logits, confidences=confidences)
    assert sample.finite_lengths().tolist() == [2, 0, 3]
    assert sample.finite_rows().tolist() == [False, False, False]


# --------------------------------------------------------------------------- item 2: short position tables
def _gpt2(n_positions: int = 128):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=48, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=None)).eval()


def test_target_with_128_learned_positions_generates_with_default_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))
    target = _gpt2(128)
    draft = DSparkDraftModel.from_target(target, block_size=4, markov_rank=8).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=10, do_sample=False))
    profile_sps(target, 16, warmup=0, repeats=1, progress=False)  # `dspark-hf profile`'s forwards fit too
    (profile,) = (tmp_path / "sps").glob("*-b16.json")
    record = json.loads(profile.read_text())
    assert record["context_length"] + record["max_tokens"] <= 128, record["context_length"]


def test_profile_lengths_fit_the_position_table():
    target = _gpt2(128)
    assert max_positions(target) == 128
    assert fitted_context_length(target, 256, 16) == 112
    assert fitted_context_length(target, 64, 16) == 64
    assert fitted_context_length(random_target(), 256, 16) == 256  # 512 positions: room enough
    with pytest.raises(ValueError, match=r"max_tokens=128 .*128 positions"):
        fitted_context_length(target, 256, 128)
    assert sps_cache_key(target, 16).endswith("-b16")
    assert shared_cost_model(_gpt2(8), progress=False).prior_length == 4  # at most half the positions


# --------------------------------------------------------------------------- item 3: lossy options
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("where", ["call", "draft"])
def test_assistant_ensemble_weight_is_refused(batched, where):
    target = random_target()
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]) if batched else torch.tensor([[1, 2, 3, 4]])
    kwargs = dict(attention_mask=torch.ones_like(prompt)) if batched else {}
    if where == "call":
        kwargs["assistant_ensemble_weight"] = 0.5
    else:
        draft.generation_config.assistant_ensemble_weight = 0.5
    with pytest.raises(ValueError, match=r"assistant_ensemble_weight=0.5 .*lossless"):
        target.generate(prompt, max_new_tokens=5, do_sample=False, assistant_model=draft, **kwargs)


# --------------------------------------------------------------------------- item 4: corrupt step-rate cache
def test_step_rates_without_finite_step_times_are_ignored_and_rewritten(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))
    target = random_target(seed=3)  # a fresh target: the shared cost model is per target
    draft = markov_draft(target, target_next_token_table(target), block_size=4,
                         confidence_logits=torch.zeros(48))
    path = tmp_path / "sps" / f"{sps_cache_key(target, 16)}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sps": [1e-310] * 16}))  # 1 / 1e-310 = inf seconds per step
    with caplog.at_level(logging.WARNING):
        target.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=30, assistant_model=draft)
    assert any(str(path) in r.getMessage() for r in caplog.records), "the warning must name the file"
    # The call started from an estimate and, having run enough rounds, cached its corrected curve there.
    rewritten = json.loads(path.read_text())["sps"]
    assert len(rewritten) == 16 and all(0 < 1.0 / rate < float("inf") for rate in rewritten)


# --------------------------------------------------------------------------- item 5: bad values
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("value", [2.5, True, 0])
def test_max_matching_ngram_size_must_be_a_positive_integer(batched, value):
    target = random_target()
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]) if batched else torch.tensor([[1, 2, 3, 4]])
    kwargs = dict(attention_mask=torch.ones_like(prompt)) if batched else {}
    with pytest.raises(ValueError, match=rf"max_matching_ngram_size={value!r} .*integer >= 1"):
        target.generate(prompt, max_new_tokens=5, assistant_model=draft, prompt_lookup_num_tokens=4,
                        max_matching_ngram_size=value, **kwargs)


class ReturnsPolicy(VerifyPolicy):
    """A user policy with only admit(), answering a fixed (bad) value."""

    requires_confidences = False

    def __init__(self, value):
        self.value = value

    def admit(self, confidences):
        return self.value


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("value", [1.5, -1, 7, True])
def test_admit_must_return_a_length_within_the_offered_block(batched, value):
    target = random_target()
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    draft.generation_config.dspark_verify_policy = ReturnsPolicy(value)
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]) if batched else torch.tensor([[1, 2, 3, 4]])
    kwargs = dict(attention_mask=torch.ones_like(prompt)) if batched else {}
    with pytest.raises(ValueError, match=rf"ReturnsPolicy\.admit(_batch)? returned {value!r} .*from 0 to 4"):
        target.generate(prompt, max_new_tokens=8, assistant_model=draft, **kwargs)


# --------------------------------------------------------------------------- item 6: checkpoint dtypes
def _saved(tmp_path, draft, change):
    draft.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    change(state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_integer_weight_in_a_checkpoint_is_an_error_naming_it(tmp_path):
    draft = DSparkDraftModel.from_target(random_target(), block_size=4, markov_rank=8)

    def quantise(state):
        state["fc.weight"] = (state["fc.weight"] * 100).round().clamp(-127, 127).to(torch.int8)

    folder = _saved(tmp_path, draft, quantise)
    with pytest.raises(ValueError, match=r"'fc.weight': stored as integer, the draft expects floating point"):
        DSparkDraftModel.from_pretrained(folder)


def test_float_ids_in_a_checkpoint_are_an_error_and_other_floats_load(tmp_path):
    target = random_target()
    ids = torch.arange(0, 48, 2)
    draft = markov_draft(target, target_next_token_table(target), block_size=4, draft_vocab_ids=ids)

    def halve(state):  # a float16 copy of float weights is normal: from_pretrained casts it
        for name, tensor in state.items():
            if tensor.is_floating_point():
                state[name] = tensor.half()

    loaded = DSparkDraftModel.from_pretrained(_saved(tmp_path / "half", draft, halve), dtype=torch.float32)
    assert torch.equal(loaded.draft_vocab_ids, ids)

    def float_ids(state):
        state["draft_vocab_ids"] = state["draft_vocab_ids"].float()

    with pytest.raises(ValueError, match=r"'draft_vocab_ids': stored as floating point, the draft expects integer"):
        DSparkDraftModel.from_pretrained(_saved(tmp_path / "ids", draft, float_ids))


# --------------------------------------------------------------------------- item 7: attention outputs
def test_output_attentions_needs_eager_attention():
    target = random_target()
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    prompt = torch.tensor([[1, 2, 3, 4]])
    settings = dict(max_new_tokens=8, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    assert target.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r'output_attentions=True .*attn_implementation="eager"'):
        target.generate(prompt, assistant_model=draft, **settings)
    target.set_attn_implementation("eager")
    out = target.generate(prompt, assistant_model=draft, **settings)
    alone = target.generate(prompt, **settings)
    assert torch.equal(out.sequences, alone.sequences)
    assert len(out.attentions) == len(alone.attentions)
