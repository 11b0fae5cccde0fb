"""vllm-project/speculators checkpoints: loading, drafting and export, against golden fixtures.

The fixtures in tests/fixtures/speculators/ were written and run by speculators 0.9.0's own code
(tests/fixtures/speculators/regenerate.py, in a side environment); these tests only read them.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

import dspark_hf
from dspark_hf import DSparkConfig, DSparkDraftModel, checkpoint_format
from dspark_hf.hub import export
from dspark_hf.decoding.sampling import serial_sample
from dspark_hf import FixedLengthPolicy

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
REFERENCES = json.loads((FIXTURES / "references.json").read_text())
ROUNDTRIP = json.loads((FIXTURES / "roundtrip.json").read_text())
LOGITS = load_file(str(FIXTURES / "references.safetensors"))
CONTEXTS = load_file(str(FIXTURES / "contexts.safetensors"))
DRAFTS = sorted(REFERENCES["drafts"])
SPECULATORS_DRAFTS = sorted(ROUNDTRIP["drafts"])


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


def propose(draft, target, index):
    """dspark_hf's greedy block for fixture context ``index``: tokens, confidences, logits."""
    tokens, hidden = CONTEXTS[f"tokens_{index}"], CONTEXTS[f"hidden_{index}"]
    anchor = tokens.numel() - 1
    draft.bind_target(target)
    cache = draft.new_cache()
    features = torch.cat([hidden[i + 1] for i in draft.config.target_layer_ids], dim=-1)[None]
    draft.add_context(cache, features, torch.arange(anchor)[None])
    gamma = draft.config.block_size
    block = torch.full((1, gamma), draft.config.mask_token_id)
    block[0, 0] = tokens[anchor]
    with torch.no_grad():
        out = draft(block, torch.arange(anchor, anchor + gamma)[None], cache)
        sample = serial_sample(draft, out.logits, out.hidden_states, tokens[anchor:], do_sample=False)
    return sample


def assert_drafts_like_reference(draft, target, name, atol=1e-4):
    for i, ref in enumerate(REFERENCES["drafts"][name]["contexts"]):
        sample = propose(draft, target, i)
        assert sample.tokens[0].tolist() == ref["tokens"], (name, i)
        expected = LOGITS[f"{name}/{i}"]
        got = sample.logits[0]
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), (name, i)
        finite = torch.isfinite(expected)
        assert torch.allclose(got[finite], expected[finite], atol=atol, rtol=0), (name, i)
        if ref["confidences"] is None:
            assert sample.confidences is None
        else:
            assert torch.allclose(sample.confidences[0], torch.tensor(ref["confidences"]), atol=atol, rtol=0), (name, i)


def copy_fixture(name, dest: Path) -> Path:
    shutil.copytree(FIXTURES / name, dest)
    return dest


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


_DELETE = object()


def file_digest(folder: Path) -> dict:
    out = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
            out[key] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest()}
    return out


# ------------------------------------------------------------------------------ golden drafting
def test_fixtures_are_small_and_cover_the_layouts():
    assert {"dspark_vanilla_full", "dspark_gated_reduced", "dspark_sliding_default", "dflash",
            "dspark_mask_positions", "dspark_mixed_noncausal", "dspark_hf_native"} <= set(DRAFTS)
    for path in FIXTURES.rglob("*"):
        if path.is_file():
            assert path.stat().st_size < 100_000, path
    sliding = REFERENCES["drafts"]["dspark_sliding_default"]
    assert sliding["window_changes_tokens"] or sliding["max_abs_logit_change_without_window"] > 0.1  # it bites
    for name in DRAFTS:  # no near-ties: greedy tokens are a robust check
        assert all(c["min_top2_margin"] > 1e-3 for c in REFERENCES["drafts"][name]["contexts"]), name


@pytest.mark.parametrize("name", DRAFTS)
def test_speculators_checkpoint_drafts_like_speculators(name, target):
    folder = FIXTURES / name
    assert checkpoint_format(json.loads((folder / "config.json").read_text())) == "speculators"
    draft = DSparkDraftModel.from_pretrained(folder, dtype=torch.float32)
    assert draft.embed_tokens is None and draft.lm_head is None  # speculators takes both from the verifier
    assert_drafts_like_reference(draft, target, name)


@pytest.mark.parametrize("name", ["dspark_gated_reduced", "dspark_sliding_default", "dflash"])
def test_automodel_loads_speculators_checkpoints(name, target):
    draft = AutoModel.from_pretrained(FIXTURES / name, dtype=torch.float32)
    assert isinstance(draft, DSparkDraftModel)
    reference = DSparkDraftModel.from_pretrained(FIXTURES / name, dtype=torch.float32)
    assert draft.config.to_dict() == reference.config.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), reference.state_dict().values()))
    assert_drafts_like_reference(draft, target, name)


def test_translated_fields():
    c = DSparkConfig.from_pretrained(FIXTURES / "dspark_sliding_default")
    raw = json.loads((FIXTURES / "dspark_sliding_default" / "config.json").read_text())
    assert c.target_layer_ids == [i - 1 for i in raw["aux_hidden_state_layer_ids"]]
    assert (c.block_size, c.anchor_predicts) == (raw["block_size"], True)
    assert c.layer_types == ["sliding_attention"] and c.sliding_window == 5 and c.sliding_block_causal
    assert c.draft_vocab_size is None and c.num_target_layers is None
    c = DSparkConfig.from_pretrained(FIXTURES / "dflash")
    raw = json.loads((FIXTURES / "dflash" / "config.json").read_text())
    assert (c.block_size, c.anchor_predicts, c.markov_rank, c.enable_confidence_head) == \
        (raw["block_size"] - 1, False, 0, False)
    c = DSparkConfig.from_pretrained(FIXTURES / "dspark_mixed_noncausal")
    assert c.layer_types == ["sliding_attention", "full_attention"] and not c.sliding_block_causal
    assert c.target_layer_ids == [-1, 1] and c.draft_vocab_size == 48
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_gated_reduced")
    d2t = load_file(str(FIXTURES / "dspark_gated_reduced" / "model.safetensors"))["d2t"]
    assert torch.equal(draft.draft_vocab_ids, torch.arange(48) + d2t)


@pytest.mark.parametrize("kind,expected", [("dspark", True), ("dflash", False)])
def test_missing_sample_from_anchor_takes_speculators_default(tmp_path, kind, expected):
    folder = edit_config(copy_fixture("dflash", tmp_path / "d"), sample_from_anchor=_DELETE,
                         speculators_model_type=kind, speculators_config={"algorithm": kind})
    assert DSparkConfig.from_pretrained(folder).anchor_predicts is expected


def test_unsorted_target_layers_reorder_fc(tmp_path, target):
    folder = copy_fixture("dspark_vanilla_full", tmp_path / "d")
    raw = json.loads((folder / "config.json").read_text())
    edit_config(folder, aux_hidden_state_layer_ids=raw["aux_hidden_state_layer_ids"][::-1])
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"] = torch.cat(state["fc.weight"].chunk(2, dim=1)[::-1], dim=1).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    draft = DSparkDraftModel.from_pretrained(folder, dtype=torch.float32)
    assert_drafts_like_reference(draft, target, "dspark_vanilla_full")


def test_sliding_draft_generates_losslessly(target):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_sliding_default", dtype=torch.float32)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(draft.config.block_size)
    prompt = CONTEXTS["tokens_2"][None]
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    got = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist() and draft.last_generation_stats.num_rounds > 0


# ---------------------------------------------------------------------------- masks in general
def test_window_counts_real_context_tokens_under_padding(target):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_mixed_noncausal", dtype=torch.float32)
    draft.bind_target(target)
    tokens, hidden = CONTEXTS["tokens_1"], CONTEXTS["hidden_1"]
    n = tokens.numel() - 1
    features = torch.cat([hidden[i + 1] for i in draft.config.target_layer_ids], dim=-1)[None]
    block = torch.full((1, draft.config.block_size), draft.config.mask_token_id)
    block[0, 0] = tokens[n]
    positions = torch.arange(n, n + draft.config.block_size)[None]
    plain = draft.new_cache()
    draft.add_context(plain, features, torch.arange(n)[None])
    padded = draft.new_cache()  # three padding slots first, one in the middle (a rejected slot)
    pad = torch.zeros(1, 3, features.shape[-1])
    padded_features = torch.cat([pad, features[:, :5], pad[:, :1], features[:, 5:]], dim=1)
    mask = torch.ones(1, n + 4, dtype=torch.bool)
    mask[0, [0, 1, 2, 8]] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    draft.add_context(padded, padded_features, pos, mask)
    with torch.no_grad():
        a = draft(block, positions, plain).logits
        b = draft(block, positions, padded).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_unbounded_noncausal_sliding_layers_equal_full_layers(target):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_mixed_noncausal", dtype=torch.float32)
    full = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_mixed_noncausal", dtype=torch.float32)
    full.config.layer_types = ["full_attention"] * 2
    draft.config.sliding_window = 10 ** 6
    assert torch.equal(propose(draft, target, 2).logits, propose(full, target, 2).logits)
    draft.config.sliding_window = 5  # and the window does change the drafting
    assert not torch.allclose(propose(draft, target, 2).logits, propose(full, target, 2).logits)


def test_sliding_layers_refuse_packed_training_masks():
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_sliding_default", dtype=torch.float32)
    draft.bind_target(AutoModelForCausalLM.from_pretrained(FIXTURES / "target"))
    with pytest.raises(ValueError, match=r"sliding_attention layers \[0\].*training"):
        draft(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], None,
              attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["sliding_attention"]}, "sliding_window is None"),
    ({"layer_types": ["full_attention", "local"], "num_hidden_layers": 2}, "layer_types has"),
    ({"layer_types": [], "num_hidden_layers": 1}, "fewer entries"),
])
def test_layer_type_validation(changes, message):
    base = DSparkConfig.from_pretrained(FIXTURES / "dspark_vanilla_full").to_dict()
    base.update(changes)
    with pytest.raises(ValueError, match=message):
        DSparkConfig.from_dict(base)


def test_deepspec_layout_with_sliding_layers_is_refused(tmp_path):
    from test_checkpoints import write_deepspec_folder

    write_deepspec_folder(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(layer_types=["sliding_attention"] * config["num_hidden_layers"], sliding_window=8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"DeepSpec-layout draft with sliding-window layers.*sliding_window=8"):
        DSparkDraftModel.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------- export
def test_roundtrip_through_speculators_loader_is_identical():
    """Recorded by regenerate.py: fixture -> dspark_hf -> export -> speculators' loader."""
    assert set(SPECULATORS_DRAFTS) == set(DRAFTS) - {"dspark_hf_native"}
    for name, result in ROUNDTRIP["drafts"].items():
        assert result["file_tensors_identical"], name
        assert result["loaded_by_speculators"]["identical"], name
        assert result["config_differences"] == {}, (name, result["config_differences"])
        assert result["proposals_identical"], name
    assert ROUNDTRIP["native"]["file_tensors"] == file_digest(FIXTURES / "dspark_hf_native")


@pytest.mark.parametrize("name", SPECULATORS_DRAFTS)
def test_export_reproduces_speculators_files_and_reloads(name, target, tmp_path):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / name, dtype=torch.bfloat16)
    bf16_target = AutoModelForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.bfloat16)
    folder = export(draft, tmp_path / name, format="speculators", target=bf16_target, base_model="target")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert file_digest(folder) == file_digest(FIXTURES / name)  # the tensors speculators itself wrote
    config = json.loads((folder / "config.json").read_text())
    assert isinstance(config["sample_from_anchor"], bool)  # always written
    original = json.loads((FIXTURES / name / "config.json").read_text())
    volatile = {"transformers_version", "auto_map"}
    assert {k: v for k, v in config.items() if k not in volatile | {"transformer_layer_config"}} == \
        {k: v for k, v in original.items() if k not in volatile | {"transformer_layer_config"}}
    reloaded = DSparkDraftModel.from_pretrained(folder, dtype=torch.bfloat16)
    assert reloaded.config.to_dict() | {"_name_or_path": ""} == draft.config.to_dict() | {"_name_or_path": ""}
    a, b = draft.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_drafts_like_reference(reloaded.float(), target, name)


def test_native_export_reloads_and_drafts_identically(target, tmp_path):
    # bf16 as stored, widened after loading: float32 tensors mmapped from a file can sit at another
    # alignment than fresh ones, and CPU kernels then round the last bit differently
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_hf_native", dtype=torch.bfloat16)
    bf16_target = AutoModelForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.bfloat16)
    folder = export(draft, tmp_path / "again", format="speculators", target=bf16_target, base_model="target")
    again = DSparkDraftModel.from_pretrained(folder, dtype=torch.bfloat16)
    a, b = draft.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    draft, again = draft.float(), again.float()
    for i in range(3):
        x, y = propose(draft, target, i), propose(again, target, i)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.logits, y.logits)


def test_export_refusals(target, tmp_path):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_vanilla_full", dtype=torch.float32)
    with pytest.raises(ValueError, match="never store embed_tokens"):
        export(draft, tmp_path / "a", format="speculators", target=target, embeddings=True)
    with pytest.raises(ValueError, match="names its verifier"):
        export(draft, tmp_path / "b", format="speculators")
    draft.lm_head = torch.nn.Linear(32, 128, bias=False)  # an own head unlike the target's
    with pytest.raises(ValueError, match="own lm_head differs from the target's"):
        export(draft, tmp_path / "c", format="speculators", target=target)
    sliding = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_sliding_default", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"sliding-window layers.*format='speculators'"):
        export(sliding, tmp_path / "d", format="deepspec", target=target)


# --------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes,message", [
    ({"speculators_model_type": "eagle3"}, "speculators_model_type = 'eagle3'"),
    ({"speculators_model_type": "dflash2"}, "speculators_model_type = 'dflash2'"),
    ({"fancy_new_option": 3}, r"not implemented here: \['fancy_new_option'\]"),
    ({"target_hidden_size": 64}, "target_hidden_size = 64"),
    ({"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids is not set"),
    ({"mask_token_id": None}, "mask_token_id is not set"),
    ({"speculators_config": {"algorithm": "eagle3"}}, "speculators_config.algorithm = 'eagle3'"),
    ({"sample_from_anchor": False, "block_size": 1}, "block_size = 1 with sample_from_anchor = False"),
    ({"draft_vocab_size": 500}, "draft_vocab_size = 500"),
])
def test_unsupported_speculators_configs_are_refused(tmp_path, changes, message):
    folder = edit_config(copy_fixture("dspark_vanilla_full", tmp_path / "d"), **changes)
    with pytest.raises(ValueError, match=f"speculators checkpoint.*{message}"):
        DSparkDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        AutoModel.from_pretrained(folder)


def test_partial_rotary_is_refused(tmp_path):
    folder = copy_fixture("dspark_vanilla_full", tmp_path / "d")
    layer = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    layer["rope_parameters"] = {**layer["rope_parameters"], "partial_rotary_factor": 0.5}
    edit_config(folder, transformer_layer_config=layer)
    with pytest.raises(ValueError, match="rope_parameters.*partial"):
        DSparkDraftModel.from_pretrained(folder)


@pytest.mark.parametrize("breakage,message", [("no_d2t", r"no \['d2t'\]"), ("bad_t2d", "t2d does not mark")])
def test_broken_reduced_vocabulary_is_refused(tmp_path, breakage, message):
    folder = copy_fixture("dspark_gated_reduced", tmp_path / "d")
    state = load_file(str(folder / "model.safetensors"))
    if breakage == "no_d2t":
        del state["d2t"]
    else:
        state["t2d"] = state["t2d"].roll(1)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(folder)


def test_speculators_dflash_is_not_taken_for_zlab():
    raw = json.loads((FIXTURES / "dflash" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert checkpoint_format(raw) == "speculators"
    assert "speculators" in dspark_hf.model.checkpoint_formats.CHECKPOINT_FORMATS


# ------------------------------------------------------------------------ other ways to load
def test_hub_id_and_sharded_weights_load(tmp_path, target):
    from hub_helpers import install_in_hub_cache

    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_gated_reduced", dtype=torch.bfloat16)
    bf16_target = AutoModelForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.bfloat16)
    sharded = export(draft, tmp_path / "sharded", format="speculators", target=bf16_target, base_model="target",
                     max_shard_size="8KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    install_in_hub_cache(sharded, "org/spec-draft", tmp_path / "hub")
    loaded = DSparkDraftModel.from_pretrained("org/spec-draft", cache_dir=tmp_path / "hub", dtype=torch.float32)
    assert_drafts_like_reference(loaded, target, "dspark_gated_reduced")
    assert isinstance(AutoModel.from_pretrained("org/spec-draft", cache_dir=tmp_path / "hub"), DSparkDraftModel)


@pytest.mark.parametrize("name", ["dspark_sliding_default", "dspark_mixed_noncausal", "dspark_mask_positions"])
def test_speculators_draft_exports_to_hf_and_drafts_the_same(name, target, tmp_path):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / name, dtype=torch.float32)
    folder = export(draft, tmp_path / "hf", target=target)
    assert checkpoint_format(json.loads((folder / "config.json").read_text())) == "dspark"
    assert_drafts_like_reference(DSparkDraftModel.from_pretrained(folder, dtype=torch.float32), target, name)


def test_last_target_layer_is_refused_when_binding(tmp_path, target):
    folder = edit_config(copy_fixture("dspark_vanilla_full", tmp_path / "d"), aux_hidden_state_layer_ids=[1, 3])
    draft = DSparkDraftModel.from_pretrained(folder)  # the target's depth is not in the file
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 2\].*last layer"):
        draft.bind_target(target)


def test_rnn_head_drafting_at_mask_positions_is_refused(tmp_path, target):
    folder = edit_config(copy_fixture("dspark_mask_positions", tmp_path / "d"), markov_head_type="rnn")
    with pytest.raises(ValueError, match="markov_head_type = 'rnn' with sample_from_anchor = False"):
        DSparkDraftModel.from_pretrained(folder)
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_hf_native", dtype=torch.float32)
    draft.config.anchor_predicts = False
    with pytest.raises(ValueError, match="rnn Markov head.*anchor_predicts=False"):
        export(draft, tmp_path / "e", format="speculators", target=target)


def test_calibration_temperatures_survive_the_speculators_format(tmp_path, target):
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_hf_native", dtype=torch.float32)
    draft.config.confidence_temperatures = [1.0, 1.5, 2.0, 2.5]
    folder = export(draft, tmp_path / "t", format="speculators", target=target, base_model="target")
    assert json.loads((folder / "config.json").read_text())["confidence_temperatures"] == [1.0, 1.5, 2.0, 2.5]
    assert DSparkDraftModel.from_pretrained(folder).config.confidence_temperatures == [1.0, 1.5, 2.0, 2.5]
