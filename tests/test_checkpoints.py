"""Loading drafts: DeepSpec layout (built here from docs/design.md section 6, not from our own writer),
DFlash (markov_rank 0), drafts without embedding/LM-head copies, strict key matching."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dspark_hf import DSparkDraftModel, FixedLengthPolicy
from tiny_models import random_target

V, D, HEADS, KV_HEADS, HEAD_DIM, INTER = 48, 32, 4, 2, 8, 64
TARGET_LAYERS, DRAFT_LAYERS, LAYER_IDS, RANK, BLOCK = 4, 2, [0, 2], 8, 4


def deepspec_state_dict(markov_rank=RANK, head_type="vanilla", with_markov_conf=True, embeddings=True, seed=0):
    """Key names and shapes as a DeepSpec checkpoint stores them."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    sd = {}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, D)
        sd[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, D)
        sd[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, D)
        sd[p + "self_attn.o_proj.weight"] = w(D, HEADS * HEAD_DIM)
        sd[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        sd[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = w(INTER, D)
        sd[p + "mlp.up_proj.weight"] = w(INTER, D)
        sd[p + "mlp.down_proj.weight"] = w(D, INTER)
        sd[p + "input_layernorm.weight"] = torch.ones(D)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(D)
    sd["norm.weight"] = torch.ones(D)
    sd["fc.weight"] = w(D, len(LAYER_IDS) * D)
    sd["hidden_norm.weight"] = torch.ones(D)
    if embeddings:
        sd["embed_tokens.weight"] = w(V, D)
        sd["lm_head.weight"] = w(V, D)
    if markov_rank:
        sd["markov_head.markov_w1.weight"] = w(V, markov_rank)
        sd["markov_head.markov_w2.weight"] = w(V, markov_rank)
        if head_type == "gated":
            sd["markov_head.gate_proj.weight"] = w(markov_rank, D + markov_rank)
            sd["markov_head.gate_proj.bias"] = w(markov_rank)
        if head_type == "rnn":
            sd["markov_head.joint_proj.weight"] = w(3 * markov_rank, 2 * markov_rank + D)
            sd["markov_head.joint_proj.bias"] = w(3 * markov_rank)
    sd["confidence_head.proj.weight"] = w(1, D + (markov_rank if with_markov_conf else 0))
    sd["confidence_head.proj.bias"] = w(1)
    return sd


def write_deepspec_folder(folder, markov_rank=RANK, head_type="vanilla", with_markov_conf=True, embeddings=True,
                          state_dict=None):
    """A DeepSpec-layout folder: the target's Qwen3 config.json plus DSpark fields."""
    config = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=INTER, num_hidden_layers=DRAFT_LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=None,
                         tie_word_embeddings=False).to_dict()
    config.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=TARGET_LAYERS,
                  block_size=BLOCK, mask_token_id=V - 1, target_layer_ids=LAYER_IDS, num_anchors=512,
                  enable_confidence_head=True, confidence_head_with_markov=with_markov_conf,
                  markov_rank=markov_rank, markov_head_type=head_type,
                  layer_types=["full_attention"] * DRAFT_LAYERS)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    sd = state_dict if state_dict is not None else deepspec_state_dict(markov_rank, head_type, with_markov_conf,
                                                                       embeddings)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sd


def _generate_matches(draft):
    target = random_target("qwen3", vocab_size=V, hidden_size=D, num_layers=TARGET_LAYERS)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    prompt = torch.tensor([[3, 7, 11, 2, 9]])
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft).tolist() == \
        expected.tolist()
    assert draft.last_generation_stats.num_rounds > 0


@pytest.mark.parametrize("head_type,with_markov_conf", [("vanilla", True), ("gated", True), ("rnn", False)])
def test_deepspec_layout_loads_strictly_and_generates(tmp_path, head_type, with_markov_conf):
    sd = write_deepspec_folder(tmp_path, head_type=head_type, with_markov_conf=with_markov_conf)
    draft = DSparkDraftModel.from_pretrained(tmp_path)
    assert draft.config.model_type == "dspark" and draft.config.markov_head_type == head_type
    assert draft.config.target_layer_ids == LAYER_IDS and draft.config.block_size == BLOCK
    loaded = draft.state_dict()
    assert set(loaded) == set(sd)
    for key, value in sd.items():
        assert torch.equal(loaded[key], value), key
    _generate_matches(draft)


def write_deepspec_dflash_folder(folder):
    """A DeepSpec DFlash draft: markov_rank 0 and no confidence head."""
    sd = deepspec_state_dict(markov_rank=0, with_markov_conf=False)
    del sd["confidence_head.proj.weight"], sd["confidence_head.proj.bias"]
    write_deepspec_folder(folder, markov_rank=0, with_markov_conf=False, state_dict=sd)
    config = json.loads((folder / "config.json").read_text())
    config["enable_confidence_head"] = False
    (folder / "config.json").write_text(json.dumps(config))
    return sd


def test_dflash_checkpoint_markov_rank_zero(tmp_path):
    write_deepspec_dflash_folder(tmp_path)
    draft = DSparkDraftModel.from_pretrained(tmp_path)
    assert draft.markov_head is None and draft.confidence_head is None
    _generate_matches(draft)


def test_checkpoint_without_embeddings_borrows_the_targets(tmp_path):
    write_deepspec_folder(tmp_path, embeddings=False)
    draft = DSparkDraftModel.from_pretrained(tmp_path)
    assert draft.embed_tokens is None and draft.lm_head is None
    _generate_matches(draft)
    # saving keeps it small: no copies written
    draft.save_pretrained(tmp_path / "resaved")
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(load_file(str(tmp_path / "resaved/model.safetensors")))


def test_roundtrip_save_load_identical_drafting(tmp_path):
    target = random_target("llama", vocab_size=V, hidden_size=D, num_layers=TARGET_LAYERS)
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=RANK, markov_head_type="gated")
    torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.1)
    draft.save_pretrained(tmp_path)
    reloaded = DSparkDraftModel.from_pretrained(tmp_path)
    # rotary buffers are not in the checkpoint and must be recomputed on load
    assert torch.equal(reloaded.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)
    prompt = torch.tensor([[1, 5, 9, 13]])
    for d in (draft, reloaded):
        d.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
        target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=d)
    a, b = draft.last_generation_stats.rounds, reloaded.last_generation_stats.rounds
    assert [(r.verified, r.accepted) for r in a] == [(r.verified, r.accepted) for r in b]


def test_missing_key_is_an_error(tmp_path):
    sd = deepspec_state_dict()
    del sd["layers.1.mlp.up_proj.weight"]
    write_deepspec_folder(tmp_path, state_dict=sd)
    with pytest.raises(ValueError, match=r"missing keys \['layers.1.mlp.up_proj.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_unexpected_key_is_an_error(tmp_path):
    sd = deepspec_state_dict()
    sd["markov_head.gate_proj.weight"] = torch.zeros(RANK, D + RANK)  # a gated head's key in a vanilla config
    write_deepspec_folder(tmp_path, state_dict=sd)
    with pytest.raises(ValueError, match="unexpected keys.*gate_proj"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_wrong_shape_is_an_error(tmp_path):
    sd = deepspec_state_dict()
    sd["fc.weight"] = torch.zeros(D, 3 * D)
    write_deepspec_folder(tmp_path, state_dict=sd)
    with pytest.raises(ValueError, match="shape"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_truncated_weights_file_is_an_error(tmp_path):
    write_deepspec_folder(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="broken or incomplete"):
        DSparkDraftModel.from_pretrained(tmp_path)
