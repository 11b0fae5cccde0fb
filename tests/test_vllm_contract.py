"""format="vllm" against vLLM 0.34.0's Qwen3 DSpark loader, checked from vLLM's source (vLLM is not
installed or run here).

The contract lives in ``tests/fixtures/vllm/qwen3_dspark_0.34.0.json``, read from the wheel
``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl``: the config fields that
``vllm/model_executor/models/qwen3_dspark.py`` (``Qwen3DSparkForCausalLM``),
``vllm/model_executor/models/qwen3_dflash.py``, ``vllm/v1/worker/gpu/spec_decode/dspark/`` and
``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` read (with vLLM's defaults), the fields
that would change vLLM's behaviour, and the renaming rules and parameters of
``Qwen3DSparkForCausalLM.load_weights``. :func:`check_vllm_folder` applies that table to a folder:
every field present with its type, every weight mapped by the same rules to a parameter of the right
shape, nothing stray, nothing required missing. Every export that claims vLLM compatibility goes
through it, and every refusal names its reason.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from dspark_hf import DSparkDraftModel
from dspark_hf.hub import export, render_model_card
from dspark_hf.hub.vllm_export import VLLM_VERSION, vllm_compatibility, vllm_serve_command
from hub_helpers import assert_same_drafting, drafting_signature
from test_checkpoints import BLOCK, D, V
from test_hub import _target, _zlab_folder

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm" / "qwen3_dspark_0.34.0.json"
CONTRACT = json.loads(FIXTURE.read_text())
VLLM_MODEL_FILE = "vllm/model_executor/models/qwen3_dspark.py"  # inside the vLLM 0.34.0 wheel
REDUCED_IDS = list(range(0, V, 3))  # 16 of the 48 target ids


# ------------------------------------------------------------------------------ the contract
def _is_type(value, kind: str) -> bool:
    if kind == "int|None":
        return value is None or _is_type(value, "int")
    if kind.startswith("list["):
        return isinstance(value, list) and all(_is_type(v, kind[5:-1]) for v in value)
    checks = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool), "bool": lambda v: isinstance(v, bool),
              "str": lambda v: isinstance(v, str), "dict": lambda v: isinstance(v, dict),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    return checks[kind](value)


def effective_fields(config: dict) -> dict:
    """The values vLLM works with: the file's, else vLLM's defaults from the contract."""
    fields = {}
    for name, spec in CONTRACT["config"]["fields"].items():
        fields[name] = config[name] if config.get(name) is not None else spec["vllm_default"]
    fields["head_dim"] = config.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    fields["draft_vocab_size"] = config.get("draft_vocab_size") or fields["vocab_size"]
    return fields


def _condition(name: str, fields: dict) -> bool:
    return {"always": True, "never": False, "attention_bias": bool(fields["attention_bias"]),
            "confidence_head": bool(fields["enable_confidence_head"]),
            "reduced_vocab": fields["draft_vocab_size"] < fields["vocab_size"]}[name]


def vllm_parameters(fields: dict) -> dict:
    """(vLLM parameter, shard) -> (shape, dtype, required) for a config, from the contract's table."""
    namespace = {"len": len, **{k: v for k, v in fields.items() if v is not None}}
    params = {}
    for row in CONTRACT["weights"]["parameters"]:
        if not _condition(row["exists"], fields):
            continue
        shape = tuple(int(eval(expr, {"__builtins__": {}}, namespace)) for expr in row["shape"])
        layers = range(fields["num_hidden_layers"]) if "{i}" in row["param"] else [None]
        for i in layers:
            name = row["param"].replace("{i}", str(i))
            params[(name, row.get("shard"))] = (shape, row.get("dtype"), _condition(row["required"], fields))
    return params


def vllm_load_name(name: str, checkpoint: set[str], fields: dict):
    """What ``Qwen3DSparkForCausalLM.load_weights`` makes of checkpoint key ``name``: ``None`` (skipped
    or dropped) or (parameter, shard), following the contract's rules in vLLM's order."""
    rules = CONTRACT["weights"]["loader"]
    if any(s in name for s in rules["skip_containing"]):
        return None
    prefixed = not any(s in name for s in rules["no_model_prefix_containing"])
    for old, new in rules["rename"].items():
        name = name.replace(old, new)
    if prefixed:
        name = rules["model_prefix"] + name
    drop = list(rules["drop_containing"])
    drop += [s for s in rules["drop_containing_when_not_in_checkpoint"]
             if not any(s in key.replace("d2t", "draft_id_to_target_id") for key in checkpoint)]
    if not fields["enable_confidence_head"]:
        drop += rules["drop_containing_without_confidence_head"]
    if any(s in name for s in drop):
        return None
    shard = None
    if name.startswith(rules["model_prefix"]):  # DFlashQwen3Model.load_weights: stacked-parameter rules
        inner = name[len(rules["model_prefix"]):]
        for old, new, shard_id in rules["stacked"]:
            if old in inner:
                inner, shard = inner.replace(old, new, 1), shard_id
        name = rules["model_prefix"] + inner
    return name, shard


def check_vllm_folder(folder: Path, *, strict: bool = True) -> dict:
    """Asserts that vLLM 0.34.0's Qwen3 DSpark class loads ``folder``; returns the effective fields.

    ``strict``: every field the contract lists is written (our vLLM export), rather than left to
    vLLM's default (a DeepSpec folder).
    """
    config = json.loads((folder / "config.json").read_text())
    spec = CONTRACT["config"]
    assert config["model_type"] == spec["model_type"]
    assert config["architectures"][0] == spec["architecture"]
    assert CONTRACT["architectures"][config["architectures"][0]] == "qwen3_dspark.Qwen3DSparkForCausalLM"
    for name, field in spec["fields"].items():
        if name in config:
            assert _is_type(config[name], field["type"]), (name, config[name])
        else:
            assert not strict or name == "draft_vocab_size", f"config.json lacks {name} ({field['read_in']})"
    assert not set(spec["must_be_absent"]) & set(config), set(spec["must_be_absent"]) & set(config)
    fields = effective_fields(config)
    assert fields["hidden_act"] == spec["fields"]["hidden_act"]["only"]
    assert set(fields["layer_types"][: fields["num_hidden_layers"]]) == {spec["fields"]["layer_types"]["only"]}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        shapes = {key: (tuple(handle.get_slice(key).get_shape()), handle.get_slice(key).get_dtype())
                  for key in handle.keys()}
    assert vllm_load_problems(shapes, fields) == []
    return fields


def vllm_load_problems(shapes: dict, fields: dict) -> list[str]:
    """Stray, mis-shaped and missing weights as vLLM's loader would meet them (empty: it loads)."""
    params, loaded, problems = vllm_parameters(fields), set(), []
    ignored = tuple(CONTRACT["weights"]["loader"]["ignored_unexpected_suffixes"])
    for key, (shape, dtype) in shapes.items():
        mapped = vllm_load_name(key, set(shapes), fields)
        if mapped is None:
            continue
        if mapped not in params:
            if not key.endswith(ignored):
                problems.append(f"stray {key} -> {mapped[0]}")
            continue
        expected, expected_dtype, _ = params[mapped]
        if shape != expected or (expected_dtype is not None and dtype.lower() != {"int64": "i64"}[expected_dtype]):
            problems.append(f"{key}: {shape} {dtype}, vLLM's {mapped} is {expected} {expected_dtype or ''}")
        loaded.add(mapped)
    problems += [f"missing {name}" for name, (_, _, required) in params.items() if required and name not in loaded]
    return problems


def assert_serves_like(draft: DSparkDraftModel, fields: dict) -> None:
    """vLLM's effective values describe ``draft``'s drafting."""
    c = draft.config
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "block_size", "mask_token_id",
                 "target_layer_ids", "enable_confidence_head", "confidence_head_with_markov", "attention_bias"):
        assert fields[name] == getattr(c, name), name
    assert fields["rope_parameters"]["rope_theta"] == c.rope_parameters["rope_theta"]
    assert fields["sample_from_anchor"] == c.anchor_predicts
    assert fields["draft_vocab_size"] == (c.draft_vocab_size or c.vocab_size)
    assert fields["markov_rank"] == (c.markov_rank or 1)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------ exports
def _draft(target, *, rank=8, confidence=True, reduced=False, temperatures=False, copy_embeddings=False):
    if rank:
        draft = _trained_draft(target, markov_rank=rank, confidence_head=confidence,
                               draft_vocab_ids=REDUCED_IDS if reduced else None, copy_embeddings=copy_embeddings)
    else:
        draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=0, confidence_head=confidence,
                                             confidence_head_with_markov=False, copy_embeddings=copy_embeddings,
                                             draft_vocab_ids=REDUCED_IDS if reduced else None).eval()
    if temperatures:
        draft.config.confidence_temperatures = [1.0 + 0.1 * k for k in range(BLOCK)]
    return draft


def _trained_draft(target, *, markov_rank, **kwargs):  # test_hub's, with a rank argument
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=markov_rank, **kwargs)
    torch.manual_seed(5)
    torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.2)
    if draft.confidence_head is not None:
        torch.nn.init.normal_(draft.confidence_head.proj.weight, std=0.2)
    return draft.eval()


CASES = {
    "vanilla, full vocabulary, confidence head": {},
    "vanilla, full vocabulary, no confidence head": {"confidence": False},
    "vanilla, reduced vocabulary, confidence head": {"reduced": True},
    "vanilla, reduced vocabulary, no confidence head": {"reduced": True, "confidence": False},
    "vanilla, own embedding and LM head": {"copy_embeddings": True},
    "vanilla, calibrated, temperatures dropped": {"temperatures": True},
    "DFlash (markov_rank 0)": {"rank": 0, "confidence": False},
    "DFlash (markov_rank 0) with a confidence head": {"rank": 0},
    "DFlash (markov_rank 0), reduced vocabulary": {"rank": 0, "confidence": False, "reduced": True},
}


@pytest.mark.parametrize("case", CASES)
def test_vllm_export_meets_vllms_contract_and_drafts_the_same(tmp_path, case):
    target = _target()
    draft = _draft(target, **CASES[case])
    folder = export(draft, tmp_path / "vllm", format="vllm", target=target,
                    drop_confidence_temperatures=CASES[case].get("temperatures", False))
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors"}
    fields = check_vllm_folder(folder)
    assert_serves_like(draft, fields)
    assert vllm_compatibility(json.loads((folder / "config.json").read_text())) is None
    config, weights = json.loads((folder / "config.json").read_text()), _weights(folder)
    assert "confidence_temperatures" not in config and "draft_vocab_ids" not in weights
    own = draft.embed_tokens is not None
    assert ("embed_tokens.weight" in weights) == own  # borrowed: vLLM shares the target's, as dspark_hf does
    if draft.config.markov_rank == 0:  # a zero rank-1 head adds exactly 0 to every logit
        assert not weights["markov_head.markov_w1.weight"].any() and not weights["markov_head.markov_w2.weight"].any()
    if draft.config.draft_vocab_size is None:
        draft.config.confidence_temperatures = None  # dropped: same drafts, uncalibrated confidences
        expected = drafting_signature(draft, target)
        assert_same_drafting(drafting_signature(DSparkDraftModel.from_pretrained(folder), target), expected, atol=0)
        return
    # Reduced vocabulary: vLLM's draft id i is target id i + d2t[i], and row i of lm_head/markov_w2 is its row.
    ids = draft.draft_vocab_ids
    assert torch.equal(torch.arange(ids.numel()) + weights["d2t"], ids)
    head = (draft.lm_head if draft.lm_head is not None else target.get_output_embeddings()).weight
    assert torch.equal(weights["lm_head.weight"], head[ids])
    if draft.config.markov_rank:
        assert torch.equal(weights["markov_head.markov_w2.weight"], draft.markov_head.markov_w2.weight)
        assert torch.equal(weights["markov_head.markov_w1.weight"], draft.markov_head.markov_w1.weight)


def test_zlab_draft_exports_with_sample_from_anchor_false(tmp_path):
    _zlab_folder(tmp_path / "zlab")
    draft = DSparkDraftModel.from_pretrained(tmp_path / "zlab")
    target = _target()
    folder = export(draft, tmp_path / "vllm", format="vllm", target=target)
    fields = check_vllm_folder(folder)
    assert fields["sample_from_anchor"] is False  # vLLM's 1 + N fill-in block: each mask drafts its own position
    assert_serves_like(draft, fields)
    assert_same_drafting(drafting_signature(DSparkDraftModel.from_pretrained(folder), target),
                         drafting_signature(draft, target), atol=0)


def test_deepspec_export_of_a_vanilla_draft_stays_servable_and_a_gated_one_is_not(tmp_path):
    target = _target()
    vanilla = export(_trained_draft(target, markov_rank=8), tmp_path / "vanilla", format="deepspec", target=target)
    fields = check_vllm_folder(vanilla, strict=False)  # sample_from_anchor absent: vLLM's default, True
    assert fields["sample_from_anchor"] is True
    assert vllm_compatibility(json.loads((vanilla / "config.json").read_text())) is None
    for head_type, module in (("gated", "gate_up_proj"), ("rnn", "joint_proj")):
        draft = _trained_draft(target, markov_rank=8, markov_head_type=head_type)
        folder = export(draft, tmp_path / head_type, format="deepspec", target=target)
        reason = vllm_compatibility(json.loads((folder / "config.json").read_text()))
        assert reason is not None and f"markov_head_type='{head_type}'" in reason and module in reason
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            shapes = {k: (tuple(handle.get_slice(k).get_shape()), handle.get_slice(k).get_dtype()) for k in handle.keys()}
        problems = vllm_load_problems(shapes, effective_fields(json.loads((folder / "config.json").read_text())))
        assert any(p.startswith("stray markov_head.") and module in p for p in problems), problems


def test_hf_export_is_not_a_vllm_layout(tmp_path):
    target = _target()
    config = json.loads((export(_trained_draft(target, markov_rank=8), tmp_path / "hf", target=target,
                                model_card=False) / "config.json").read_text())
    # vLLM maps this architecture to its DeepSeek-V4 DSpark class, and does not know model_type "dspark".
    assert config["model_type"] == "dspark" and config["architectures"] == ["DSparkDraftModel"]
    assert "deepseek_v4" in CONTRACT["architectures"][config["architectures"][0]]


def _gelu_target():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh",
                                        max_position_embeddings=512)).eval()


def _gpt2_target():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=4, n_head=4, n_positions=512,
                                      bos_token_id=0, eos_token_id=1)).eval()


def _biased_head_target():
    target = _target()
    target.lm_head.bias = torch.nn.Parameter(torch.zeros(V))
    return target


REFUSALS = {  # name -> (target builder, draft kwargs, export kwargs, message)
    "gated Markov head": (_target, {"markov_head_type": "gated"}, {}, r"markov_head_type='gated'.*gate_up_proj"),
    "rnn Markov head": (_target, {"markov_head_type": "rnn"}, {}, r"markov_head_type='rnn'.*joint_proj"),
    "non-silu activation": (_gelu_target, {}, {}, r"hidden_act='gelu_pytorch_tanh'.*silu"),
    "confidence temperatures": (_target, {"temperatures": True}, {}, r"confidence_temperatures.*drop_confidence_temperatures=True"),
    "target without auxiliary hidden states": (_gpt2_target, {}, {}, r"GPT2LMHeadModel.*SupportsEagle3"),
    "target LM head with a bias": (_biased_head_target, {}, {}, r"LM head, which has a bias"),
    "no target": (_target, {}, {"target": None}, r"needs target="),
    "reduced vocabulary without its lm_head": (_target, {"reduced": True}, {"embeddings": False}, r"embeddings=False.*reduced"),
    "model card": (_target, {}, {"model_card": True}, r"no model card"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_every_refusal_names_its_reason(tmp_path, name):
    make_target, draft_kwargs, export_kwargs, message = REFUSALS[name]
    target = make_target()
    kwargs = dict(draft_kwargs)
    temperatures = kwargs.pop("temperatures", False)
    reduced = kwargs.pop("reduced", False)
    draft = _trained_draft(target, markov_rank=8, draft_vocab_ids=REDUCED_IDS if reduced else None, **kwargs)
    if temperatures:
        draft.config.confidence_temperatures = [1.0] * BLOCK
    with pytest.raises(ValueError, match=message):
        export(draft, tmp_path / "vllm", format="vllm", **{"target": target, **export_kwargs})
    assert not (tmp_path / "vllm" / "config.json").exists()


def test_sliding_window_layers_are_refused():
    reason = vllm_compatibility({"layer_types": ["sliding_attention"], "sliding_window": 8})
    assert reason is not None and "sliding_attention" in reason and "_resolve_layer_attention" in reason


def test_contract_names_its_version_and_the_serve_command():
    assert CONTRACT["vllm_version"] == VLLM_VERSION == "0.34.0"
    assert VLLM_MODEL_FILE in CONTRACT["config"]["fields"]["markov_rank"]["read_in"]
    command = vllm_serve_command("Qwen/Qwen3-4B", "my-draft-vllm", 7)
    assert '"method": "dspark"' in command and '"num_speculative_tokens": 7' in command


def test_export_command_writes_the_vllm_folder_or_says_why_not(tmp_path, capsys):
    from dspark_hf import cli

    target = _target()
    draft = _trained_draft(target, markov_rank=8)
    draft.config.confidence_temperatures = [1.0] * BLOCK
    draft.save_pretrained(tmp_path / "saved")
    target.save_pretrained(tmp_path / "target")
    args = ["export", str(tmp_path / "saved"), str(tmp_path / "vllm"), "--format", "vllm", "--target",
            str(tmp_path / "target")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2 and "--drop-confidence-temperatures" in capsys.readouterr().err
    cli.main(args + ["--drop-confidence-temperatures"])
    check_vllm_folder(tmp_path / "vllm")


def test_model_card_prints_the_vllm_commands_only_for_drafts_that_fit(tmp_path):
    target = _target()
    folders = {"vanilla": export(_trained_draft(target, markov_rank=8), tmp_path / "vanilla", target=target,
                                 model_card=False),
               "gated": export(_trained_draft(target, markov_rank=8, markov_head_type="gated"), tmp_path / "gated",
                               format="deepspec", target=target)}
    calibrated = _trained_draft(target, markov_rank=8)
    calibrated.config.confidence_temperatures = [1.0] * BLOCK
    folders["calibrated"] = export(calibrated, tmp_path / "calibrated", target=target, model_card=False)
    cards = {name: render_model_card(folder, base_model="org/tiny-target", repo_id="org/draft")
             for name, folder in folders.items()}
    for name, card in cards.items():
        serving = card[card.index("## Serving engines"):card.index("## Training")]
        assert f"vLLM** {VLLM_VERSION}" in serving or f"vLLM {VLLM_VERSION} cannot serve" in serving
        fits = name != "gated"
        assert ("vllm serve org/tiny-target" in serving) == fits
        assert ("dspark-hf export org/draft my-draft-vllm --format vllm --target org/tiny-target" in serving) == fits
        assert ("--drop-confidence-temperatures" in serving) == (name == "calibrated")
    assert "markov_head_type='gated'" in cards["gated"] and "gate_up_proj" in cards["gated"]
