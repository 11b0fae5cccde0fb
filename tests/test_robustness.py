"""Faults and bad input (issue 16, items 2, 5, 6): corrupt drafts, ill-typed configs, corrupt SPS caches,
policies and devices that cannot work. Each fails loudly with a message naming the problem, or, where
the output can stay the target's (a draft overflowing at run time, a corrupt cache), carries on and
logs it."""

import json
import logging

import pytest
import torch

from dspark_hf import DSparkConfig, DSparkDraftModel, FixedLengthPolicy, PrefixScheduler, ThresholdPolicy
from dspark_hf.modeling_dspark import non_finite_parameters
from dspark_hf.decoding.sampling import serial_sample
from dspark_hf.scheduling.drafting_gate import forget_earlier_gates
from dspark_hf.scheduler import VerifyPolicy, profile_sps, sps_cache_key
from tiny_models import markov_draft, random_target, target_next_token_table

PROMPT = torch.tensor([[1, 2, 3, 4]])
BATCH = torch.tensor([[1, 2, 3, 4], [0, 5, 6, 7]])
BATCH_MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return random_target(vocab_size=48, hidden_size=32, num_layers=4)


def _warnings(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# --------------------------------------------------------------------------- item 2: non-finite drafts
@pytest.mark.parametrize("name,value", [("layers.0.mlp.up_proj.weight", float("nan")),
                                        ("markov_head.markov_w2.weight", float("inf")),
                                        ("confidence_head.proj.bias", float("-inf"))])
def test_checkpoint_with_non_finite_weights_fails_at_load_naming_the_tensor(tmp_path, target, name, value):
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8)
    with torch.no_grad():
        draft.get_parameter(name).view(-1)[-1] = value
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"non-finite.*'{name}'.*{tmp_path}|{tmp_path}.*non-finite.*'{name}'"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_checkpoint_check_lists_every_bad_tensor(tmp_path, target):
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8)
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("nan")
        draft.norm.weight[1] = float("inf")
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        DSparkDraftModel.from_pretrained(tmp_path)
    assert "'fc.weight'" in str(error.value) and "'norm.weight'" in str(error.value)


def _overflowing_draft(target, kind, confidence=True):
    """A draft whose logits stop being finite at run time: float16 LM-head overflow, or NaN weights."""
    if kind == "fp16_overflow":
        draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8, copy_embeddings=True,
                                             confidence_head=confidence)
        draft.half()
        with torch.no_grad():  # weights in range, but |logit| far beyond float16's 65504: inf
            draft.norm.weight.fill_(100.0)
            draft.lm_head.weight.mul_(3e4)
        assert not non_finite_parameters(draft)
    else:
        draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8, confidence_head=confidence)
        with torch.no_grad():
            draft.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    return draft.eval()


class AdmitOnlyPolicy(VerifyPolicy):
    """A user policy with only admit(): the generator decides on the whole block."""

    def admit(self, confidences):
        return len(confidences)


POLICIES = {"fixed": lambda: FixedLengthPolicy(BLOCK), "threshold": lambda: ThresholdPolicy(0.01),
            "scheduler": lambda: PrefixScheduler([1.0, 0.99, 0.98, 0.97, 0.96]), "admit_only": AdmitOnlyPolicy,
            "dflash_default": lambda: None}


@pytest.mark.parametrize("kind", ["fp16_overflow", "nan_weights"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_non_finite_draft_verifies_nothing_at_batch_one(target, caplog, kind, policy):
    draft = _overflowing_draft(target, kind, confidence=policy != "dflash_default")
    draft.generation_config.dspark_verify_policy = POLICIES[policy]()
    for call in range(3):
        if call < 2:  # the first two calls learn afresh; the third keeps what the second's gate learnt
            forget_earlier_gates(draft)
        caplog.clear()
        torch.manual_seed(call)
        out = target.generate(PROMPT, max_new_tokens=12, do_sample=True, assistant_model=draft)
        assert out.shape == (1, PROMPT.shape[1] + 12)
        assert draft.last_generation_stats.verified_tokens == 0
        # once per call; a gate that learnt in an earlier call that drafting pays nothing may skip the draft
        assert len(_warnings(caplog, "non-finite")) == 1 if call < 2 else len(_warnings(caplog, "non-finite")) <= 1
    greedy = target.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert torch.equal(greedy, target.generate(PROMPT, max_new_tokens=12, do_sample=False))
    assert draft.last_generation_stats.verified_tokens == 0


@pytest.mark.parametrize("kind", ["fp16_overflow", "nan_weights"])
@pytest.mark.parametrize("policy", ["fixed", "scheduler", "dflash_default"])
def test_non_finite_draft_verifies_nothing_batched(target, caplog, kind, policy):
    draft = _overflowing_draft(target, kind, confidence=policy != "dflash_default")
    draft.generation_config.dspark_verify_policy = POLICIES[policy]()
    torch.manual_seed(0)
    out = target.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=10, do_sample=True, assistant_model=draft)
    assert out.shape == (2, BATCH.shape[1] + 10)
    assert draft.last_generation_stats.verified_tokens == 0
    assert len(_warnings(caplog, "non-finite")) == 1
    greedy = target.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=10, do_sample=False,
                             assistant_model=draft)
    assert torch.equal(greedy, target.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=10, do_sample=False))


@pytest.mark.parametrize("do_sample", [False, True])
@torch.no_grad()
def test_serial_sample_flags_non_finite_rows_without_raising(target, do_sample):
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK,
                         confidence_logits=torch.zeros(48))
    hidden = torch.randn(3, BLOCK, 32)
    base = torch.randn(3, BLOCK, 48)
    base[1, 2, 7] = float("nan")
    base[2, 0, :] = float("-inf")  # nothing drawable
    sample = serial_sample(draft, base, hidden, torch.tensor([1, 2, 3]), do_sample=do_sample)
    assert sample.finite_rows().tolist() == [True, False, False]
    # The admission loop of one request flags only the positions it drew.
    offered = []
    one = serial_sample(draft, base[1:2], hidden[1:2], torch.tensor([2]), do_sample=do_sample,
                        admission=lambda c: offered.append(c) or len(offered) <= 2)
    assert one.num_admitted == 2 and one.finite_rows().tolist() == [True]
    one = serial_sample(draft, base[1:2], hidden[1:2], torch.tensor([2]), do_sample=do_sample,
                        admission=lambda c: True)
    assert one.finite_rows().tolist() == [False]


def test_partial_minus_inf_is_finite(target):
    """A top-k style -inf mask leaves the distribution well defined: not a fault."""
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK)
    base = torch.randn(1, BLOCK, 48)
    base[..., 10:] = float("-inf")
    sample = serial_sample(draft, base, torch.randn(1, BLOCK, 32), torch.tensor([1]), do_sample=True)
    assert sample.finite_rows().tolist() == [True]


# --------------------------------------------------------------------------- item 5: config validation
@pytest.mark.parametrize(
    "kwargs,field,expected",
    [(dict(block_size="7"), "block_size", "int"),
     (dict(block_size=7.5), "block_size", "int"),
     (dict(block_size=True), "block_size", "int"),
     (dict(target_layer_ids=[0.5]), "target_layer_ids", "int"),
     (dict(target_layer_ids=[1.0, 2]), "target_layer_ids", "int"),
     (dict(target_layer_ids="0,1"), "target_layer_ids", "list"),
     (dict(mask_token_id=1.5), "mask_token_id", "int"),
     (dict(markov_rank="8"), "markov_rank", "int"),
     (dict(num_target_layers=4.0), "num_target_layers", "int"),
     (dict(num_anchors=None), "num_anchors", "int"),
     (dict(hidden_size=32.0), "hidden_size", "int"),
     (dict(num_hidden_layers="2"), "num_hidden_layers", "int"),
     (dict(markov_head_type=3), "markov_head_type", "str"),
     (dict(enable_confidence_head="yes"), "enable_confidence_head", "bool"),
     (dict(anchor_predicts=1), "anchor_predicts", "bool"),
     (dict(confidence_temperatures=[1.0, "2", 1.0, 1.0, 1.0, 1.0, 1.0]), "confidence_temperatures", "number"),
     (dict(rms_norm_eps="1e-6"), "rms_norm_eps", "number")],
)
def test_ill_typed_config_fields_name_field_value_and_type(kwargs, field, expected):
    base = dict(target_layer_ids=[0], mask_token_id=0)
    with pytest.raises(ValueError) as error:
        DSparkConfig(**(base | kwargs))
    message = str(error.value)
    assert field in message and repr(kwargs[field]) in message and expected in message, message


@pytest.mark.parametrize("field", ["num_attention_heads", "num_key_value_heads", "hidden_size", "num_anchors"])
def test_sizes_below_one(field):
    with pytest.raises(ValueError, match=rf"{field} must be >= 1, got 0"):
        DSparkConfig(target_layer_ids=[0], mask_token_id=0, **{field: 0})


def test_heads_must_divide():
    with pytest.raises(ValueError, match="num_attention_heads 4 .*num_key_value_heads 3"):
        DSparkConfig(target_layer_ids=[0], mask_token_id=0, num_attention_heads=4, num_key_value_heads=3)


def test_python_config_keeps_documented_defaults():
    assert DSparkConfig(target_layer_ids=[0], mask_token_id=0).block_size == 7


def _saved_draft(tmp_path, target, **overrides):
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8)
    draft.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key, value in overrides.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return draft


def test_checkpoint_config_without_block_size_is_an_error(tmp_path, target):
    _saved_draft(tmp_path, target, block_size=None)
    with pytest.raises(ValueError, match=r"config.json.*no block_size.*block_size=") as error:
        DSparkDraftModel.from_pretrained(tmp_path)
    assert str(tmp_path) in str(error.value)
    # Given explicitly, the checkpoint loads.
    assert DSparkDraftModel.from_pretrained(tmp_path, block_size=BLOCK).config.block_size == BLOCK


def test_default_block_size_is_written_and_reloads(tmp_path, target):
    draft = DSparkDraftModel.from_target(target, block_size=7, markov_rank=8)
    draft.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["block_size"] == 7
    assert DSparkDraftModel.from_pretrained(tmp_path).config.block_size == 7


@pytest.mark.parametrize("field,value", [("block_size", "4"), ("target_layer_ids", [0.0, 1.0])])
def test_ill_typed_checkpoint_config_fails_at_load(tmp_path, target, field, value):
    _saved_draft(tmp_path, target, **{field: value})
    with pytest.raises(ValueError, match=field):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_shape_mismatch_names_the_tensors_and_shapes(tmp_path, target):
    _saved_draft(tmp_path, target, markov_rank=16)
    with pytest.raises(ValueError) as error:
        DSparkDraftModel.from_pretrained(tmp_path)
    message = str(error.value)
    assert "above report" not in message
    assert "markov_head.markov_w1.weight" in message and "(48, 8)" in message and "(48, 16)" in message, message


# --------------------------------------------------------------------------- item 6: smaller ones
PROFILE = dict(context_length=8, warmup=0, repeats=1, progress=False)


@pytest.mark.parametrize("content", [
    '{"sps": [' + "9" * 400 + ", 1.0, 1.0]}",                     # int too large for a float
    '{"sps": ' + "[" * 100_000 + "]" * 100_000 + "}",              # nesting beyond the recursion limit
    "[" * 100_000 + "]" * 100_000,
    '{"sps": [true, true, true]}',                                  # booleans are not step rates
], ids=["400_digit_int", "nested_in_sps", "nested_top_level", "booleans"])
def test_corrupt_sps_cache_is_reprofiled_and_rewritten(tmp_path, target, caplog, content):
    directory = tmp_path / "sps"
    directory.mkdir()
    path = directory / f"{sps_cache_key(target, 3, context_length=8)}.json"
    path.write_text(content)
    table = profile_sps(target, 3, cache_dir=tmp_path, **PROFILE)
    assert len(table) == 3
    assert [r for r in _warnings(caplog, str(path))], "the warning must name the file"
    assert json.loads(path.read_text())["sps"] == pytest.approx(table)  # rewritten
    caplog.clear()
    assert profile_sps(target, 3, cache_dir=tmp_path, **PROFILE) == table  # served from the rewrite
    assert not _warnings(caplog, str(path))


@pytest.mark.parametrize("batched", [False, True])
# "scheduler" is a valid policy name since settings moved to generation_config; a misspelt name is not.
@pytest.mark.parametrize("policy,hint", [(4, r"FixedLengthPolicy\(4\)"), ("schedular", "VerifyPolicy"),
                                         (FixedLengthPolicy, "an instance")])
def test_verify_policy_that_is_not_a_policy(target, batched, policy, hint):
    draft = markov_draft(target, target_next_token_table(target), block_size=BLOCK)
    draft.generation_config.dspark_verify_policy = policy
    prompt, kwargs = (BATCH, dict(attention_mask=BATCH_MASK)) if batched else (PROMPT, {})
    with pytest.raises(ValueError, match=rf"verify_policy.*{hint}"):
        target.generate(prompt, max_new_tokens=5, assistant_model=draft, **kwargs)


@pytest.mark.parametrize("batched", [False, True])
def test_draft_on_the_meta_device(target, batched):
    config = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8).config
    with torch.device("meta"):
        draft = DSparkDraftModel(config)
    prompt, kwargs = (BATCH, dict(attention_mask=BATCH_MASK)) if batched else (PROMPT, {})
    with pytest.raises(ValueError, match=r"meta device.*from_pretrained"):
        target.generate(prompt, max_new_tokens=5, assistant_model=draft, **kwargs)


def test_from_target_under_a_meta_device_context(target):
    with torch.device("meta"), pytest.raises(ValueError, match=r"meta device.*outside a meta-device context"):
        DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8)
