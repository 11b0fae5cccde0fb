"""Serial sampling in bf16 follows DeepSpec's order of operations (issue: DeepSpec-exact in bf16).

DeepSpec's draft head adds the Markov bias to the base logits in the weights' dtype: for a bf16
draft, ``U_k + B_k`` is a bf16 tensor (the sum rounded to bf16), and both the argmax and the
sampling distribution come from that rounded sum. :func:`deepspec_block` below is written from that
description, independently of dspark_hf's code (plain ``F.embedding`` / ``F.linear`` on the head's
weights, bf16 throughout until the sum is widened). The tests check that both Python paths of
:func:`dspark_hf.serial_sample` (the full-block loop and the admission loop) give exactly its
tokens and logits on the same inputs, and that the check has power: the float32 order (upcast both
terms, then add) proposes other tokens on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from dspark_hf import DSparkDraftModel, serial_sample
from tiny_models import random_target

V, GAMMA, ROWS, RANK = 2048, 7, 24, 32


def _bf16_draft(head_type: str) -> DSparkDraftModel:
    target = random_target(vocab_size=V, hidden_size=64, num_layers=2)
    draft = DSparkDraftModel.from_target(target, block_size=GAMMA, markov_rank=RANK, markov_head_type=head_type)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = draft.markov_head
        head.markov_w1.weight.copy_(torch.randn(head.markov_w1.weight.shape, generator=gen))
        head.markov_w2.weight.copy_(torch.randn(head.markov_w2.weight.shape, generator=gen) * RANK ** -0.5)
        if head_type == "gated":
            head.gate_proj.weight.copy_(torch.randn(head.gate_proj.weight.shape, generator=gen) * 0.2)
    return draft.to(torch.bfloat16).eval()


def _inputs(seed: int = 0):
    """bf16 base logits peaked like a language model's (U ~ N(0, 9)), hidden states, anchors."""
    gen = torch.Generator().manual_seed(seed)
    U = (3.0 * torch.randn(ROWS, GAMMA, V, generator=gen)).to(torch.bfloat16)
    H = torch.randn(ROWS, GAMMA, 64, generator=gen).to(torch.bfloat16)
    anchor = torch.randint(0, V, (ROWS,), generator=gen)
    uniforms = torch.rand(ROWS, GAMMA, generator=gen)
    return U, H, anchor, uniforms


def deepspec_block(draft, U, H, anchor, *, temperature=None, uniforms=None, fp32_add=False):
    """DeepSpec's order of operations for one block: bias in the head's dtype, ``U_k + B_k`` in
    that dtype, then widened to float32 for the temperature and the argmax / inverse-CDF draw.
    ``fp32_add=True`` is the order dspark_hf used before (both terms widened, then added)."""
    head = draft.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    prev, tokens, logits = anchor, [], []
    for k in range(U.shape[1]):
        feature = F.embedding(prev, w1)
        if head.head_type == "gated":
            gate = torch.sigmoid(F.linear(torch.cat([H[:, k], feature], dim=-1), head.gate_proj.weight,
                                          head.gate_proj.bias))
            feature = gate * feature
        bias = F.linear(feature, w2)  # bf16
        row = U[:, k].float() + bias.float() if fp32_add else (U[:, k] + bias).float()
        if temperature is not None:
            row = row / temperature
        if uniforms is None:
            prev = row.argmax(dim=-1)
        else:  # inverse CDF in float64: the smallest v with CDF(v) > u
            cdf = torch.softmax(row.double(), dim=-1).cumsum(-1)
            prev = torch.searchsorted(cdf, (uniforms[:, k].double() * cdf[:, -1])[:, None], right=True)
            prev = prev.squeeze(1).clamp(max=row.shape[-1] - 1)
        tokens.append(prev)
        logits.append(row)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_greedy_bf16_matches_deepspec_order_in_both_paths(head_type):
    draft = _bf16_draft(head_type)
    U, H, anchor, _ = _inputs()
    with torch.no_grad():
        expected_tokens, expected_logits = deepspec_block(draft, U, H, anchor)
        fp32_tokens, _ = deepspec_block(draft, U, H, anchor, fp32_add=True)
        out = serial_sample(draft, U, H, anchor, do_sample=False)
        assert out.logits.dtype == torch.float32
        assert torch.equal(out.tokens, expected_tokens)
        assert torch.equal(out.logits, expected_logits)
        for r in range(ROWS):  # the admission loop (one request at a time), admitting every position
            # The reference runs on the same single row: a bf16 GEMM's rounding may depend on the
            # number of rows on some CPUs, so a 1-row call is compared with a 1-row reference.
            row_tokens, row_logits = deepspec_block(draft, U[r : r + 1], H[r : r + 1], anchor[r : r + 1])
            one = serial_sample(draft, U[r : r + 1], H[r : r + 1], anchor[r : r + 1], do_sample=False,
                                admission=lambda c: True)
            assert one.num_admitted == GAMMA
            assert torch.equal(one.tokens, row_tokens)
            assert torch.equal(one.logits, row_logits)
    # Power: adding in float32 proposes other tokens on these inputs (rounding near-ties).
    differs = (fp32_tokens != expected_tokens).any(dim=1)
    assert int(differs.sum()) >= 2, "the inputs should contain blocks where the two orders disagree"


def test_sampled_bf16_matches_deepspec_order_with_the_same_uniforms():
    draft = _bf16_draft("vanilla")
    U, H, anchor, uniforms = _inputs(seed=1)
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    with torch.no_grad():
        expected_tokens, expected_logits = deepspec_block(draft, U, H, anchor, temperature=0.7, uniforms=uniforms)
        out = serial_sample(draft, U, H, anchor, do_sample=True, logits_processor=warp, prefix_ids=anchor[:, None],
                            uniforms=uniforms)
        row_tokens, row_logits = deepspec_block(draft, U[:1], H[:1], anchor[:1], temperature=0.7,
                                                uniforms=uniforms[:1])
        one = serial_sample(draft, U[:1], H[:1], anchor[:1], do_sample=True, logits_processor=warp,
                            prefix_ids=anchor[:1, None], uniforms=uniforms[:1], admission=lambda c: True)
    assert torch.equal(out.logits, expected_logits)
    assert torch.equal(out.tokens, expected_tokens)
    assert torch.equal(one.tokens, row_tokens) and torch.equal(one.logits, row_logits)


def test_bf16_logits_are_bf16_values_and_fp32_is_unchanged():
    draft = _bf16_draft("vanilla")
    U, H, anchor, _ = _inputs(seed=2)
    with torch.no_grad():
        out = serial_sample(draft, U, H, anchor, do_sample=False)
        assert torch.equal(out.logits, out.logits.bfloat16().float())
        # float32: one rounding of the exact sum, the same as widening both terms and adding
        draft32 = draft.float()
        U32, H32 = U.float() + 1e-3 * torch.randn(U.shape), H.float()
        out32 = serial_sample(draft32, U32, H32, anchor, do_sample=False)
        tokens, logits = deepspec_block(draft32, U32, H32, anchor, fp32_add=True)
    assert torch.equal(out32.tokens, tokens) and torch.equal(out32.logits, logits)
    assert not torch.equal(out32.logits, out32.logits.bfloat16().float())
