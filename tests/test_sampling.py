"""Serial sampling (reference path): biases, returned logits, processors, confidences."""

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

from dspark_hf import DSparkDraftModel, serial_sample
from tiny_models import random_target

V, GAMMA = 48, 5


def _draft(head_type="vanilla", with_markov=True, temperatures=None):
    target = random_target(vocab_size=V)
    draft = DSparkDraftModel.from_target(target, block_size=GAMMA, markov_rank=8, markov_head_type=head_type,
                                         confidence_head_with_markov=with_markov)
    torch.manual_seed(1)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.5)
    draft.config.confidence_temperatures = temperatures
    return draft.eval()


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, GAMMA, V, generator=gen), torch.randn(1, GAMMA, 32, generator=gen), torch.tensor([7])


def _manual_rollout(draft, U, H, anchor, tokens):
    """Recomputes U_k + B_k(x_{k-1}) along a given token path, following the paper's equations."""
    head = draft.markov_head
    prev, state, logits = anchor, torch.zeros(1, head.rank), []
    for k in range(GAMMA):
        e = head.markov_w1(prev)
        if head.head_type == "vanilla":
            bias = head.markov_w2(e)
        elif head.head_type == "gated":
            bias = head.markov_w2(torch.sigmoid(head.gate_proj(torch.cat([H[:, k], e], -1))) * e)
        else:
            z = torch.cat([state, e, H[:, k]], -1)
            g, c, o = head.joint_proj(z).chunk(3, -1)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            bias = head.markov_w2(torch.tanh(o))
        logits.append(U[:, k] + bias)
        prev = tokens[:, k]
    return torch.stack(logits, 1)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_greedy_tokens_and_logits_follow_the_markov_equations(head_type):
    draft = _draft(head_type)
    U, H, anchor = _inputs()
    with torch.no_grad():
        out = serial_sample(draft, U, H, anchor, do_sample=False)
        manual = _manual_rollout(draft, U, H, anchor, out.tokens)
    torch.testing.assert_close(out.logits, manual)
    assert out.tokens.tolist() == out.logits.argmax(-1).tolist()
    # the bias matters: the serial path differs from the parallel argmax somewhere
    assert out.tokens.tolist() != U.argmax(-1).tolist()


@pytest.mark.parametrize("with_markov", [True, False])
def test_confidence_uses_previous_token_not_current(with_markov):
    draft = _draft(with_markov=with_markov)
    U, H, anchor = _inputs()
    with torch.no_grad():
        out = serial_sample(draft, U, H, anchor, do_sample=False)
        prev = torch.cat([anchor[:, None], out.tokens[:, :-1]], 1)
        feats = [H, draft.markov_head.markov_w1(prev)] if with_markov else [H]
        expected = torch.sigmoid(draft.confidence_head.proj(torch.cat(feats, -1)).squeeze(-1))
        assert torch.allclose(out.confidences, expected)
        if with_markov:  # x_k itself never enters c_k: features of x_1..x_gamma would give other values
            wrong = torch.sigmoid(draft.confidence_head.proj(
                torch.cat([H, draft.markov_head.markov_w1(out.tokens)], -1)).squeeze(-1))
            assert not torch.allclose(out.confidences, wrong)


def test_calibration_temperatures_scale_confidence_logits():
    temps = [0.5, 1.0, 2.0, 3.0, 4.0]
    U, H, anchor = _inputs()
    with torch.no_grad():
        raw = serial_sample(_draft(), U, H, anchor, do_sample=False).confidences
        scaled = serial_sample(_draft(temperatures=temps), U, H, anchor, do_sample=False).confidences
    expected = torch.sigmoid(torch.logit(raw) / torch.tensor(temps))
    torch.testing.assert_close(scaled, expected, rtol=1e-4, atol=1e-5)


def test_processors_applied_position_by_position_with_drafted_prefix():
    draft = _draft()
    U, H, anchor = _inputs()
    prefix = torch.tensor([[3, 9, 7]])
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), TemperatureLogitsWarper(0.5)])
    with torch.no_grad():
        out = serial_sample(draft, U, H, anchor, do_sample=False, logits_processor=processors, prefix_ids=prefix)
        raw = _manual_rollout(draft, U, H, anchor, out.tokens)
    for k in range(GAMMA):
        seen = torch.cat([prefix, out.tokens[:, :k]], 1)
        expected = processors(seen, raw[:, k].clone())
        torch.testing.assert_close(out.logits[:, k], expected)


def _chi_square_p_value(counts, probs):
    expected = counts.sum() * probs
    chi2 = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0), chi2 / 2).item()


def test_sampled_tokens_follow_returned_logits():
    """Each position's token is drawn from softmax(returned logits): chi-square check at position 1,
    which has power against the logits without the temperature."""
    draft = _draft()
    U, H, anchor = _inputs()
    counts = torch.zeros(V)
    gen = torch.Generator().manual_seed(0)
    warp = LogitsProcessorList([TemperatureLogitsWarper(2.0)])
    with torch.no_grad():
        for _ in range(3000):
            out = serial_sample(draft, U, H, anchor, do_sample=True, generator=gen, logits_processor=warp,
                                prefix_ids=anchor[:, None])
            counts[out.tokens[0, 0]] += 1
    returned = out.logits[0, 0]  # position 1's distribution does not depend on the sampled path
    assert _chi_square_p_value(counts, torch.softmax(returned, -1)) > 1e-3
    assert _chi_square_p_value(counts, torch.softmax(returned * 2.0, -1)) < 1e-6


@pytest.mark.parametrize("do_sample", [False, True])
def test_admission_loop_draws_the_same_prefix_as_the_full_loop(do_sample):
    from dspark_hf import PrefixScheduler

    draft = _draft(temperatures=[1.5, 0.8, 1.0, 1.2, 0.9])
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8)])
    policy = PrefixScheduler([1.0, 0.9, 0.85, 0.8, 0.78, 0.76])
    lengths = set()
    for seed in range(12):
        U, H, anchor = _inputs(seed)
        prefix = torch.tensor([[3, 9, 7]])
        uniforms = torch.rand(1, GAMMA, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            full = serial_sample(draft, U, H, anchor, do_sample=do_sample, logits_processor=processors,
                                 prefix_ids=prefix, uniforms=uniforms)
            part = serial_sample(draft, U, H, anchor, do_sample=do_sample, logits_processor=processors,
                                 prefix_ids=prefix, uniforms=uniforms, admission=policy.start_round(),
                                 max_positions=4)
        keep = policy.admit(full.confidences[0, :4].tolist())
        assert part.num_admitted == keep
        assert part.tokens.tolist() == full.tokens[:, :keep].tolist()
        torch.testing.assert_close(part.logits, full.logits[:, :keep])
        # c_1..c_{keep+1} were offered (the last one refused unless the budget ran out)
        offered = part.confidences.shape[1]
        torch.testing.assert_close(part.confidences, full.confidences[:, :offered])
        lengths.add(keep)
    assert len(lengths) >= 3, f"the test should see several admitted lengths, got {lengths}"


def test_lazy_base_logits_give_the_same_block():
    from dspark_hf import PrefixScheduler

    draft = _draft()
    draft.bind_target(random_target(vocab_size=V))
    policy = PrefixScheduler([1.0, 0.9, 0.85, 0.8, 0.78, 0.76])
    kept = set()
    for seed in range(8):
        _, H, anchor = _inputs(seed)
        with torch.no_grad():
            eager = serial_sample(draft, draft.base_logits(H), H, anchor, do_sample=False,
                                  admission=policy.start_round())
            lazy = serial_sample(draft, None, H, anchor, do_sample=False, admission=policy.start_round())
        assert lazy.tokens.tolist() == eager.tokens.tolist()
        torch.testing.assert_close(lazy.logits, eager.logits)
        kept.add(lazy.num_admitted)
    assert len(kept) >= 2, kept


def test_draw_categorical_follows_the_weights_and_never_draws_a_zero_weight():
    """The sampler the CPU loops use instead of torch.multinomial: per-row chi-square against the
    row's weights (unnormalised, with zeros first, inside and last), with power against a 10% mix
    of the uniform; zero weights never drawn; a seeded generator repeats its draws."""
    from dspark_hf.decoding.serial_block import draw_categorical

    weights = torch.tensor([[0.0, 3.0, 1.0, 0.0, 6.0, 2.0, 0.0],
                            [5.0, 0.0, 0.5, 0.5, 1.0, 0.0, 3.0]])
    draws = 40_000
    tokens = draw_categorical(weights.repeat_interleave(draws, dim=0), torch.Generator().manual_seed(0))
    for row in range(2):
        counts = torch.bincount(tokens[row * draws:(row + 1) * draws], minlength=weights.shape[1]).double()
        support = weights[row] > 0
        assert counts[~support].sum() == 0
        probs = (weights[row] / weights[row].sum()).double()
        assert _chi_square_p_value(counts[support], probs[support]) > 1e-3
        mixed = 0.9 * probs[support] + 0.1 / support.sum()
        assert _chi_square_p_value(counts[support], mixed) < 1e-6
    again = draw_categorical(weights.repeat_interleave(draws, dim=0), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_draw_categorical_refuses_a_row_it_cannot_sample(bad):
    from dspark_hf.decoding.serial_block import draw_categorical

    weights = torch.tensor([[1.0, 2.0, 3.0], [bad, 0.0, 0.0]])
    with pytest.raises(ValueError, match="not finite or sums to 0"):
        draw_categorical(weights)
