"""DSparkDraftModel.from_target across the target families transformers ships (issue 16, item 4).

Every family is built here from a tiny random config (no download). Each must give a working draft:
greedy output identical to the target alone at batch 1 and batched, sampling that runs, and the
target hidden states the draft reads equal to the ones transformers returns with
``output_hidden_states=True``. Targets the draft cannot serve fail with an error naming why.
"""

from types import SimpleNamespace

import pytest
import torch
import transformers as T

import dspark_hf.decoding.batched as batched
from dspark_hf import DSparkDraftModel, FixedLengthPolicy
from tiny_models import markov_draft

V, D, LAYERS, HEADS, BLOCK = 64, 32, 4, 4, 4


def _family(model_class, config_class, **sizes):
    """A builder of ``model_class(config_class(...))`` on the shared vocabulary, with ``sizes`` under
    the family's own names (the comments below say where a family departs from Llama's)."""
    return lambda: model_class(config_class(vocab_size=V, bos_token_id=0, eos_token_id=None, **sizes))


# Llama's names for the sizes, which most families use; grouped attention adds 2 key/value heads.
LLAMA_SIZES = dict(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=LAYERS, num_attention_heads=HEADS)
GROUPED = dict(LLAMA_SIZES, num_key_value_heads=2)
FAMILIES = {
    "llama": _family(T.LlamaForCausalLM, T.LlamaConfig, **GROUPED),
    "qwen2": _family(T.Qwen2ForCausalLM, T.Qwen2Config, **GROUPED),
    "qwen3": _family(T.Qwen3ForCausalLM, T.Qwen3Config, **GROUPED, head_dim=8),
    "mistral": _family(T.MistralForCausalLM, T.MistralConfig, **GROUPED),
    "gemma": _family(T.GemmaForCausalLM, T.GemmaConfig, **GROUPED, head_dim=8),
    "phi": _family(T.PhiForCausalLM, T.PhiConfig, **LLAMA_SIZES),  # partial rotary factor 0.5
    "gpt2": _family(T.GPT2LMHeadModel, T.GPT2Config,  # n_embd / n_layer / n_head, n_inner None
                    n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=256),
    "opt": _family(T.OPTForCausalLM, T.OPTConfig,  # ffn_dim, learned positions from the attention mask
                   hidden_size=D, ffn_dim=2 * D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                   max_position_embeddings=256, word_embed_proj_dim=D, pad_token_id=1),
    "falcon": _family(T.FalconForCausalLM, T.FalconConfig,  # ffn_hidden_size None, no intermediate_size
                      hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS),
    "gpt_neox": _family(T.GPTNeoXForCausalLM, T.GPTNeoXConfig, **LLAMA_SIZES),  # partial rotary factor 0.25
}
PROMPT = torch.tensor([[3, 4, 5, 6, 7]])
PAD = 2
BATCH = torch.tensor([[PAD, PAD, 9, 10, 11], [3, 4, 5, 6, 7]])
BATCH_MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def _target(family):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


@torch.no_grad()
def _one_token_table(target) -> torch.Tensor:
    """The target's next-token logits after each single token: a draft proposing from it is often right."""
    return torch.cat([target(torch.tensor([[v]])).logits[:, -1] for v in range(V)]).float()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    target = _target(request.param)
    return request.param, target, _one_token_table(target)


def test_fresh_draft_is_lossless_greedy(family):
    name, target, _ = family
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8).eval()
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=draft), expected)
    assert draft.last_generation_stats.verified_tokens > 0
    assert draft.config.num_target_layers == LAYERS and draft.config.hidden_size == D


def test_accepting_draft_batch_one_and_batched(family):
    name, target, table = family
    draft = markov_draft(target, table, block_size=BLOCK)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=draft), expected)
    assert draft.last_generation_stats.accepted_tokens > 0, "the draft must be right sometimes to test acceptance"

    for row in range(2):  # batched rows equal each prompt alone
        alone = target.generate(BATCH[row:row + 1, BATCH_MASK[row].bool()], max_new_tokens=12, do_sample=False,
                                pad_token_id=PAD)
        batched = target.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=12, do_sample=False,
                                  pad_token_id=PAD, assistant_model=draft)
        assert batched[row, BATCH.shape[1]:].tolist() == alone[0, int(BATCH_MASK[row].sum()):].tolist(), name
    assert draft.last_generation_stats.verified_tokens > 0

    torch.manual_seed(0)
    sampled = target.generate(PROMPT, max_new_tokens=12, do_sample=True, assistant_model=draft)
    assert sampled.shape == (1, PROMPT.shape[1] + 12)


@torch.no_grad()
def test_selected_hidden_states_match_the_full_tuple(family):
    """The draft asks for ``output_hidden_states=[l + 1 for l in target_layer_ids]``; every family must
    return the same tensors there as with ``True`` (layer l's output at index l + 1)."""
    name, target, _ = family
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8)
    indices = [i + 1 for i in draft.config.target_layer_ids]
    full = target(PROMPT, output_hidden_states=True).hidden_states
    selected = target(PROMPT, output_hidden_states=indices).hidden_states
    assert len(full) == LAYERS + 1
    for i in indices:
        assert torch.equal(selected[i], full[i]), (name, i)


def test_opt_with_projected_embeddings_is_refused_by_name():
    torch.manual_seed(0)
    target = _family(T.OPTForCausalLM, T.OPTConfig, hidden_size=D, ffn_dim=2 * D, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, word_embed_proj_dim=16)()
    with pytest.raises(ValueError, match=r"OPTConfig.*input embeddings of width 16 but hidden states of width 32"):
        DSparkDraftModel.from_target(target)


def test_target_without_the_required_sizes_is_refused_by_name():
    class HeadlessConfig(SimpleNamespace):  # a family whose config has no attention-head count
        model_type = "headless"

        def get_text_config(self):
            return self

    target = SimpleNamespace(config=HeadlessConfig(vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS))
    with pytest.raises(ValueError, match=r"cannot read \['num_attention_heads'\].*HeadlessConfig"):
        DSparkDraftModel.from_target(target)


def test_draft_sizes_follow_each_family_spelling():
    sizes = {name: DSparkDraftModel.from_target(_target(name), markov_rank=8).config.intermediate_size
             for name in ("gpt2", "opt", "falcon", "llama")}
    assert sizes == {"gpt2": 4 * D, "opt": 2 * D, "falcon": 4 * D, "llama": 2 * D}
    phi = DSparkDraftModel.from_target(_target("phi"), markov_rank=8)
    assert "partial_rotary_factor" not in (phi.config.rope_parameters or {})


def test_sliding_window_target_batched_with_compaction(monkeypatch):
    """Mistral's cache layers slide: after the batched path compacts its ragged slots the layer's
    own length must follow, and a window the slots could reach is refused (batch 1 still works)."""
    compactions = []
    original = batched._compact
    monkeypatch.setattr(batched, "_compact", lambda *a: compactions.append(1) or original(*a))
    target = _target("mistral")
    draft = markov_draft(target, _one_token_table(target), block_size=BLOCK)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    out = target.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=40, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft)
    assert compactions, "the test must exercise compaction"
    for row in range(2):
        alone = target.generate(BATCH[row:row + 1, BATCH_MASK[row].bool()], max_new_tokens=40, do_sample=False,
                                pad_token_id=PAD)
        assert out[row, BATCH.shape[1]:].tolist() == alone[0, int(BATCH_MASK[row].sum()):].tolist()

    target.config.sliding_window = 64
    with pytest.raises(ValueError, match=r"sliding attention window \(64\).*batch size 1"):
        target.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=40, do_sample=False, pad_token_id=PAD,
                        assistant_model=draft)
    expected = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=40, do_sample=False, assistant_model=draft), expected)
