"""Hub integration: Hub-ready export, every loading path against an offline huggingface_hub cache
laid out like a download (fresh interpreters with HF_HUB_OFFLINE=1 and HF_HOME/HF_HUB_CACHE in a
tmp dir), DeepSpec and z-lab DFlash formats, DeepSpec export, push_to_hub, model cards."""

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

import dspark_hf
from dspark_hf import DSparkConfig, DSparkDraftModel, FixedLengthPolicy
from dspark_hf.hub import (
    AUTO_MAP,
    DEEPSPEC_FIELDS,
    checkpoint_format,
    export,
    locate_custom_generate_source,
    push_to_hub,
    render_model_card,
    run_custom_generate,
)
from hub_helpers import (
    PROMPT,
    assert_same_drafting,
    drafting_signature,
    install_in_hub_cache,
    run_isolated,
    zlab_reference_greedy,
)
from test_checkpoints import (
    BLOCK,
    D,
    DRAFT_LAYERS,
    HEAD_DIM,
    HEADS,
    INTER,
    KV_HEADS,
    LAYER_IDS,
    TARGET_LAYERS,
    V,
    deepspec_state_dict,
    write_deepspec_dflash_folder,
    write_deepspec_folder,
)
from tiny_models import random_target

REPO_ROOT = Path(__file__).resolve().parents[1]
DRAFT_REPO, TARGET_REPO = "org/dspark-draft", "org/tiny-target"


def _tokenizer(vocab_size=V):
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w1"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1", bos_token="w0")


def _target(arch="qwen3"):
    return random_target(arch, vocab_size=V, hidden_size=D, num_layers=TARGET_LAYERS, context_scale=0.3)


def _trained_draft(target, **kwargs):
    """A fresh draft with a non-zero Markov head (a fresh one is all zeros)."""
    draft = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=8, **kwargs)
    torch.manual_seed(5)
    torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.2)
    torch.nn.init.normal_(draft.confidence_head.proj.weight, std=0.2)
    return draft.eval()


class FakeHubApi:
    """Records what push_to_hub sends; keeps a copy of the uploaded folder."""

    def __init__(self, store: Path):
        self.store, self.calls = store, []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def upload_folder(self, *, folder_path, repo_id, **kwargs):
        self.calls.append(("upload_folder", dict(repo_id=repo_id, **kwargs)))
        dest = self.store / repo_id.replace("/", "--")
        shutil.copytree(folder_path, dest)
        return dest


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------ Hub-ready export
def test_hf_export_layout_and_thin_remote_code(tmp_path):
    target = _target()
    draft = _trained_draft(target)
    folder = export(draft, tmp_path / "draft", target=target, base_model=TARGET_REPO, repo_id=DRAFT_REPO)
    assert _files(folder) == {
        "config.json", "model.safetensors", "configuration_dspark.py", "modeling_dspark.py",
        "custom_generate/generate.py", "custom_generate/requirements.txt", "README.md",
    }
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "dspark" and config["architectures"] == ["DSparkDraftModel"]
    assert config["auto_map"] == AUTO_MAP
    assert all(field in config for field in DEEPSPEC_FIELDS) and config["anchor_predicts"] is True
    # the draft borrows the target's embedding/LM head, so no copies are written by default
    assert set(load_file(str(folder / "model.safetensors"))) == set(draft.state_dict())
    assert "dspark-hf" in (folder / "custom_generate/requirements.txt").read_text()
    # remote code: imports from the installed package, definitions, nothing else at import time
    for name in ("configuration_dspark.py", "modeling_dspark.py", "custom_generate/generate.py"):
        tree = ast.parse((folder / name).read_text())
        for node in tree.body:
            assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Expr, ast.Assign)), name
            if isinstance(node, ast.ImportFrom):
                assert node.module.startswith("dspark_hf") and node.level == 0, name
            if isinstance(node, ast.Expr):
                assert isinstance(node.value, ast.Constant), name  # the docstring
            if isinstance(node, ast.Assign):
                assert node.targets[0].id == "__all__", name


def test_hf_export_roundtrip_identical_drafting_and_local_auto_model(tmp_path):
    target = _target()
    draft = _trained_draft(target, markov_head_type="gated")
    expected = drafting_signature(draft, target)
    folder = export(draft, tmp_path / "draft", target=target)
    reloaded = DSparkDraftModel.from_pretrained(folder)
    assert_same_drafting(drafting_signature(reloaded, target), expected, atol=0)
    # after `import dspark_hf` the auto classes know the format without trust_remote_code
    auto = AutoModel.from_pretrained(folder)
    assert type(auto) is DSparkDraftModel
    assert_same_drafting(drafting_signature(auto, target), expected, atol=0)
    # embeddings=True writes copies taken from the target
    with_copies = export(draft, tmp_path / "with_copies", target=target, embeddings=True, model_card=False)
    weights = load_file(str(with_copies / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(weights["lm_head.weight"], target.get_output_embeddings().weight)
    assert_same_drafting(drafting_signature(DSparkDraftModel.from_pretrained(with_copies), target), expected, atol=0)


def test_push_to_hub_uploads_the_hub_ready_folder(tmp_path):
    target = _target()
    draft = _trained_draft(target)
    api = FakeHubApi(tmp_path / "hub")
    uploaded = push_to_hub(draft, DRAFT_REPO, target=target, api=api, private=True, base_model=TARGET_REPO)
    (create, create_kwargs), (upload, upload_kwargs) = api.calls
    assert create == "create_repo" and create_kwargs["repo_id"] == DRAFT_REPO and create_kwargs["private"] is True
    assert create_kwargs["exist_ok"] is True
    assert upload == "upload_folder" and upload_kwargs["repo_id"] == DRAFT_REPO
    assert {"config.json", "model.safetensors", "custom_generate/generate.py", "README.md"} <= _files(uploaded)
    assert f'custom_generate="{DRAFT_REPO}"' in (uploaded / "README.md").read_text()
    # the model's own push_to_hub goes through the same export
    api2 = FakeHubApi(tmp_path / "hub2")
    draft.push_to_hub(DRAFT_REPO, api=api2, target=target)
    assert _files(api2.store / "org--dspark-draft") == _files(uploaded)


def test_the_models_push_to_hub_goes_through_the_registered_exporter(monkeypatch):
    """The model module never imports the Hub tooling: dspark_hf.hub registers its push_to_hub on import, and
    without a registered exporter the method says which function to call."""
    from dspark_hf.model import modeling_dspark

    draft = _trained_draft(_target())
    calls = []
    monkeypatch.setattr(modeling_dspark, "_HUB_UPLOAD", [lambda *args, **kwargs: calls.append((args, kwargs)) or "ok"])
    assert draft.push_to_hub(DRAFT_REPO, private=True) == "ok" and calls == [((draft, DRAFT_REPO), {"private": True})]
    monkeypatch.setattr(modeling_dspark, "_HUB_UPLOAD", [])
    with pytest.raises(RuntimeError, match=r"dspark_hf\.push_to_hub\(draft"):
        draft.push_to_hub(DRAFT_REPO)


def test_hub_cache_remote_code_generate_pipeline_and_custom_generate(tmp_path):
    """Draft pushed (fake API) -> stored as a download -> loaded offline in a fresh interpreter."""
    target = _target()
    draft = _trained_draft(target)
    expected = drafting_signature(draft, target)
    uploaded = push_to_hub(draft, DRAFT_REPO, target=target, api=FakeHubApi(tmp_path / "hub"), base_model=TARGET_REPO)
    target.save_pretrained(tmp_path / "target")
    _tokenizer().save_pretrained(tmp_path / "target")
    cache = tmp_path / "hf_home" / "hub"
    install_in_hub_cache(uploaded, DRAFT_REPO, cache)
    install_in_hub_cache(tmp_path / "target", TARGET_REPO, cache)
    local_copy = tmp_path / "local_draft"
    shutil.copytree(uploaded, local_copy)

    report = run_isolated(
        f"""
        import sys, torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
        assert "dspark_hf" not in sys.modules
        draft = AutoModel.from_pretrained("{DRAFT_REPO}", trust_remote_code=True)  # runs the repo's remote code
        import dspark_hf
        from dspark_hf.hub import last_custom_generate_draft
        from hub_helpers import drafting_signature, PROMPT
        report = {{"class": f"{{type(draft).__module__}}.{{type(draft).__name__}}",
                   "isinstance": isinstance(draft, dspark_hf.DSparkDraftModel)}}
        target = AutoModelForCausalLM.from_pretrained("{TARGET_REPO}")
        report["signature"] = drafting_signature(draft, target)
        prompt = torch.tensor([PROMPT])
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False).tolist()
        draft.generation_config.dspark_verify_policy = dspark_hf.FixedLengthPolicy({BLOCK})
        report["assisted_same"] = target.generate(prompt, max_new_tokens=24, do_sample=False,
                                                  assistant_model=draft).tolist() == plain
        report["assisted_rounds"] = draft.last_generation_stats.num_rounds
        tok = AutoTokenizer.from_pretrained("{TARGET_REPO}")
        pipe = pipeline("text-generation", model=target, tokenizer=tok)
        pipe_d = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
        text = "w5 w9 w13 w2"
        report["pipeline_same"] = pipe(text, max_new_tokens=12, do_sample=False) == \\
            pipe_d(text, max_new_tokens=12, do_sample=False)
        for name, source in (("hub", "{DRAFT_REPO}"), ("folder", {str(local_copy)!r})):
            out = target.generate(prompt, max_new_tokens=24, do_sample=False, custom_generate=source,
                                  trust_remote_code=True).tolist()
            used = last_custom_generate_draft()
            report[name] = {{"same": out == plain, "rounds": used.last_generation_stats.num_rounds,
                            "is_own_draft": used is not draft}}
        torch.manual_seed(0)
        sampled = target.generate(prompt, max_new_tokens=16, do_sample=True, custom_generate="{DRAFT_REPO}",
                                  trust_remote_code=True)
        report["sampled_len"] = sampled.shape[1]
        try:
            target.generate(prompt, max_new_tokens=4, custom_generate="{DRAFT_REPO}")
            report["untrusted"] = "no error"
        except ValueError as err:
            report["untrusted"] = str(err)
        """,
        tmp_path / "hf_home",
    )
    assert report["class"] == "dspark_hf.modeling_dspark.DSparkDraftModel" and report["isinstance"]
    assert_same_drafting(report["signature"], expected)
    assert report["assisted_same"] and report["assisted_rounds"] > 0
    assert report["pipeline_same"]
    for name in ("hub", "folder"):
        assert report[name] == {"same": True, "rounds": report[name]["rounds"], "is_own_draft": True}
        assert report[name]["rounds"] > 0
    assert report["sampled_len"] == len(PROMPT) + 16
    assert "trust_remote_code" in report["untrusted"]


def test_missing_package_gives_transformers_pip_install_message(tmp_path):
    """Remote code imports the installed dspark_hf; without it transformers names the package."""
    target = _target()
    folder = export(_trained_draft(target), tmp_path / "draft", model_card=False)
    install_in_hub_cache(folder, DRAFT_REPO, tmp_path / "hf_home" / "hub")
    report = run_isolated(
        f"""
        import os, sys
        # as if dspark-hf were not installed: drop its editable-install finder and source folder
        sys.meta_path = [f for f in sys.meta_path if "dspark_hf" not in str(getattr(f, "__module__", ""))]
        sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "dspark_hf"))]
        try:
            import dspark_hf
            raise SystemExit("dspark_hf is still importable")
        except ModuleNotFoundError:
            pass
        from transformers import AutoModel
        try:
            AutoModel.from_pretrained("{DRAFT_REPO}", trust_remote_code=True)
            report = {{"error": None}}
        except ImportError as err:
            report = {{"error": str(err)}}
        """,
        tmp_path / "hf_home",
    )
    assert report["error"] and "dspark_hf" in report["error"] and "pip install" in report["error"]


# --------------------------------------------------------------------------- DeepSpec / z-lab
def _zlab_folder(folder: Path, *, nested_block_size=False, block_size=BLOCK + 1, seed=3, **overrides) -> dict:
    """A z-lab DFlash checkpoint: Qwen3 config + dflash_config, no embedding/LM head, no heads."""
    state = {k: v for k, v in deepspec_state_dict(markov_rank=0, embeddings=False, seed=seed).items()
             if not k.startswith("confidence_head")}
    config = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=INTER, num_hidden_layers=DRAFT_LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=512, bos_token_id=0, tie_word_embeddings=True).to_dict()
    dflash = {"mask_token_id": V - 1, "target_layer_ids": LAYER_IDS}
    config.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                  num_target_layers=TARGET_LAYERS, dflash_config=dflash)
    if nested_block_size:
        dflash["block_size"] = block_size
    else:
        config["block_size"] = block_size
    for key, value in overrides.items():
        if key.startswith("dflash_"):
            dflash[key[len("dflash_"):]] = value
        else:
            config[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"state": state, "config": config}


def test_hub_cache_deepspec_and_zlab_repos_load_offline(tmp_path):
    cache = tmp_path / "hf_home" / "hub"
    write_deepspec_folder(tmp_path / "deepspec", head_type="gated")
    write_deepspec_dflash_folder(tmp_path / "deepspec_dflash")
    _zlab_folder(tmp_path / "zlab", nested_block_size=True)
    target = _target()
    target.save_pretrained(tmp_path / "target")
    repos = {"deepspec": "deepseek-ai/dspark_tiny_block4", "deepspec_dflash": "deepseek-ai/dflash_tiny_block4",
             "zlab": "z-lab/Tiny-DFlash-b5"}
    for folder, repo in repos.items():
        install_in_hub_cache(tmp_path / folder, repo, cache)
    install_in_hub_cache(tmp_path / "target", TARGET_REPO, cache)
    report = run_isolated(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        repos = {repos!r}
        # without `import dspark_hf` nothing can stop AutoModel: it silently builds a plain Qwen3 model
        report = {{"without_import": type(AutoModel.from_pretrained(repos["deepspec"])).__name__}}
        import dspark_hf
        from dspark_hf import DSparkDraftModel, FixedLengthPolicy
        target = AutoModelForCausalLM.from_pretrained("{TARGET_REPO}")
        prompt = torch.tensor([[3, 7, 11, 2, 9]])
        plain = target.generate(prompt, max_new_tokens=20, do_sample=False).tolist()
        for name, repo in repos.items():
            draft = DSparkDraftModel.from_pretrained(repo)
            draft.generation_config.dspark_verify_policy = FixedLengthPolicy(draft.config.block_size)
            out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft).tolist()
            report[name] = {{"same": out == plain, "rounds": draft.last_generation_stats.num_rounds,
                            "block_size": draft.config.block_size, "markov_rank": draft.config.markov_rank,
                            "anchor_predicts": draft.config.anchor_predicts,
                            "format": dspark_hf.checkpoint_format(draft.config)}}
        for auto in (AutoModel, AutoModelForCausalLM):
            try:
                auto.from_pretrained(repos["deepspec"])
                report[auto.__name__] = "no error"
            except ValueError as err:
                report[auto.__name__] = str(err)
        """,
        tmp_path / "hf_home",
    )
    assert report["without_import"] == "Qwen3Model"  # the documented limitation
    for name in repos:
        assert report[name]["same"] and report[name]["rounds"] > 0, name
    assert report["deepspec"]["markov_rank"] == 8 and report["deepspec"]["anchor_predicts"] is True
    assert report["deepspec_dflash"]["markov_rank"] == 0
    assert report["zlab"] == {"same": True, "rounds": report["zlab"]["rounds"], "block_size": BLOCK,
                              "markov_rank": 0, "anchor_predicts": False, "format": "dspark"}
    for auto in ("AutoModel", "AutoModelForCausalLM"):
        assert "DeepSpec layout" in report[auto] and "DSparkDraftModel.from_pretrained" in report[auto]


def test_auto_classes_refuse_deepspec_layout_in_process(tmp_path):
    write_deepspec_folder(tmp_path)
    for auto in (AutoModel, AutoModelForCausalLM):
        with pytest.raises(ValueError, match="DeepSpec layout.*DSparkDraftModel.from_pretrained"):
            auto.from_pretrained(tmp_path)
    config = Qwen3Config.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="DeepSpec layout"):
        AutoModel.from_config(config)
    # plain Qwen3 configs are untouched
    config.architectures = ["Qwen3ForCausalLM"]
    assert type(AutoModel.from_config(config)).__name__ == "Qwen3Model"
    assert checkpoint_format(json.loads((tmp_path / "config.json").read_text())) == "deepspec"


@pytest.mark.parametrize("nested", [False, True])
def test_zlab_dflash_drafts_exactly_zlabs_positions(tmp_path, nested):
    zlab = _zlab_folder(tmp_path, nested_block_size=nested)
    draft = DSparkDraftModel.from_pretrained(tmp_path)
    assert draft.config.block_size == BLOCK and not draft.config.anchor_predicts
    assert draft.embed_tokens is None and draft.lm_head is None
    assert draft.markov_head is None and draft.confidence_head is None
    assert not hasattr(draft.config, "dflash_config") and getattr(draft.config, "auto_map", None) is None
    target = _target()
    # the draft logits of every full round, from the hidden states of the draft's forward during
    # generate (generation computes the LM head lazily, inside the serial loop)
    captured = []
    hook = draft.register_forward_hook(
        lambda module, args, output: captured.append(module.base_logits(output.hidden_states)[0].clone()))
    max_new = 30
    prompt = torch.tensor([PROMPT])
    out = target.generate(prompt, max_new_tokens=max_new, do_sample=False, assistant_model=draft)
    hook.remove()
    assert out.tolist() == target.generate(prompt, max_new_tokens=max_new, do_sample=False).tolist()
    reference = zlab_reference_greedy(zlab["state"], dict(zlab["config"], block_size=BLOCK + 1), target, PROMPT, max_new)
    assert len(reference) >= 4
    rounds = draft.last_generation_stats.rounds
    for i, (ref_logits, ref_accepted) in enumerate(reference):
        assert captured[i].shape == ref_logits.shape == (BLOCK, V)
        assert torch.allclose(captured[i], ref_logits, atol=1e-4), i
        assert (rounds[i].verified, rounds[i].accepted) == (BLOCK, ref_accepted), i
    # a DSpark-positioned draft with the same weights drafts something else: the positions matter
    config = DSparkConfig.from_pretrained(tmp_path)
    config.anchor_predicts = True
    shifted = DSparkDraftModel(config)
    shifted.load_state_dict(draft.state_dict(), strict=False)
    assert not torch.allclose(
        torch.tensor(drafting_signature(shifted, target)["logits"]),
        torch.tensor(drafting_signature(draft, target)["logits"]),
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"architectures": ["DFlash2DraftModel"], "dflash_selector_rank": 8}, "architectures"),
        ({"layer_types": ["sliding_attention"] * DRAFT_LAYERS, "sliding_window": 8}, "sliding-window"),
        ({"dflash_output_multiplier": 0.2}, "output_multiplier"),
        ({"dflash_final_logit_softcapping": 20.0}, "final_logit_softcapping"),
        ({"dflash_causal": True}, "causal"),
        ({"dflash_projector_type": "domino"}, "projector_type"),
        ({"dflash_target_layer_ids": None}, "target_layer_ids"),
    ],
)
def test_unsupported_zlab_variants_are_rejected_with_the_reason(tmp_path, overrides, message):
    _zlab_folder(tmp_path, **overrides)
    with pytest.raises(ValueError, match=f"z-lab DFlash-family draft.*{message}"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_zlab_draft_exports_to_hf_but_not_to_deepspec(tmp_path):
    _zlab_folder(tmp_path / "zlab")
    draft = DSparkDraftModel.from_pretrained(tmp_path / "zlab")
    target = _target()
    expected = drafting_signature(draft, target)
    folder = export(draft, tmp_path / "hf", target=target)
    assert json.loads((folder / "config.json").read_text())["anchor_predicts"] is False
    assert_same_drafting(drafting_signature(DSparkDraftModel.from_pretrained(folder), target), expected, atol=0)
    with pytest.raises(ValueError, match="anchor_predicts=False.*format='hf'"):
        export(draft, tmp_path / "ds", format="deepspec", target=target)


# ----------------------------------------------------------------------------- DeepSpec export
@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_deepspec_export_layout_and_roundtrip(tmp_path, head_type):
    target = _target()
    draft = _trained_draft(target, markov_head_type=head_type, num_hidden_layers=DRAFT_LAYERS,
                           target_layer_ids=LAYER_IDS)
    expected = drafting_signature(draft, target)
    with pytest.raises(ValueError, match="pass target="):  # borrowed embedding/LM head need the target
        export(draft, tmp_path / "no_target", format="deepspec")
    folder = export(draft, tmp_path / "ds", format="deepspec", target=target)
    assert _files(folder) == {"config.json", "model.safetensors"}
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3DSparkModel"]
    assert "auto_map" not in config and "anchor_predicts" not in config
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == DRAFT_LAYERS
    assert config["layer_types"] == ["full_attention"] * DRAFT_LAYERS
    assert config["rope_theta"] == draft.config.rope_parameters["rope_theta"]  # for transformers 4.x readers
    for field in DEEPSPEC_FIELDS:
        assert config[field] == getattr(draft.config, field), field
    assert Qwen3Config.from_pretrained(folder).num_hidden_layers == DRAFT_LAYERS  # a valid Qwen3 config
    weights = load_file(str(folder / "model.safetensors"))
    reference_keys = set(deepspec_state_dict(head_type=head_type, with_markov_conf=True))
    assert set(weights) == reference_keys  # exactly DeepSpec's key names, embeddings included
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(weights["lm_head.weight"], target.get_output_embeddings().weight)
    reloaded = DSparkDraftModel.from_pretrained(folder)
    assert_same_drafting(drafting_signature(reloaded, target), expected, atol=0)
    prompt = torch.tensor([PROMPT])
    stats = []
    for d in (draft, reloaded):
        d.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
        target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=d)
        stats.append([(r.verified, r.accepted) for r in d.last_generation_stats.rounds])
    assert stats[0] == stats[1]


def test_deepspec_export_of_tied_llama_target_and_bad_arguments(tmp_path):
    target = random_target("llama", vocab_size=V, hidden_size=D, num_layers=TARGET_LAYERS)
    target.get_output_embeddings().weight = target.get_input_embeddings().weight  # tied, like SmolLM2
    draft = _trained_draft(target)
    folder = export(draft, tmp_path / "ds", format="deepspec", target=target)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == V  # built from the draft's fields
    weights = load_file(str(folder / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], weights["lm_head.weight"])  # two separate copies
    assert_same_drafting(drafting_signature(DSparkDraftModel.from_pretrained(folder), target),
                         drafting_signature(draft, target), atol=0)
    with pytest.raises(ValueError, match="format must be one of"):
        export(draft, tmp_path / "x", format="gguf")
    with pytest.raises(ValueError, match="embeddings=False"):
        export(draft, tmp_path / "x", format="deepspec", target=target, embeddings=False)
    other = random_target("llama", vocab_size=V + 2, hidden_size=D, num_layers=TARGET_LAYERS)
    with pytest.raises(ValueError, match="vocab_size"):
        export(draft, tmp_path / "x", target=other)


# ---------------------------------------------------------------------------- custom_generate
def test_locate_custom_generate_source_fallbacks(tmp_path):
    cached = Path("/cache/modules/transformers_modules/my_hyphen_org/d_dot_v1_hyphen_b7/abc123/custom_generate/generate.py")
    assert locate_custom_generate_source(cached) == ("my-org/d.v1-b7", "abc123")
    (tmp_path / "custom_generate").mkdir()
    (tmp_path / "config.json").write_text("{}")
    assert locate_custom_generate_source(tmp_path / "custom_generate" / "generate.py") == (str(tmp_path), None)
    with pytest.raises(ValueError, match="assistant_model="):
        locate_custom_generate_source(Path("/nowhere/generate.py"))


def test_custom_generate_entry_point_uses_a_given_draft_and_refuses_other_assistants():
    target = _target()
    draft = _trained_draft(target)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(BLOCK)
    prompt = torch.tensor([PROMPT])
    out = run_custom_generate(target, inputs=prompt, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert out.tolist() == target.generate(prompt, max_new_tokens=10, do_sample=False).tolist()
    assert draft.last_generation_stats.num_rounds > 0
    with pytest.raises(ValueError, match="runs DSpark decoding"):
        run_custom_generate(target, inputs=prompt, max_new_tokens=4, assistant_model=random_target("llama", num_layers=2))


# -------------------------------------------------------------------------------- model cards
MEASURED = {  # test data for the renderer, not measurements of any draft
    "setup": "test fixture",
    "benchmarks": ["bench-a", "bench-b"],
    "results": {"DSpark (this draft)": {"bench-a": 1.25, "bench-b": 2.5}, "DFlash": {"bench-a": 1.125}},
    "source": "tests/test_hub.py",
}


def _python_blocks(card: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card, flags=re.S)


def _check_snippets(card: str) -> None:
    blocks = _python_blocks(card)
    assert blocks
    for block in blocks:
        tree = ast.parse(block)  # compiles
        compile(tree, "<card>", "exec")
        imports = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
        exec(compile(imports, "<card imports>", "exec"), {})  # and its imports resolve


@pytest.fixture(scope="module")
def card_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cards")
    target = _target()
    draft = _trained_draft(target)
    dflash = DSparkDraftModel.from_target(target, block_size=BLOCK, markov_rank=0, confidence_head=False)
    return {
        "hf": export(draft, root / "hf", target=target, model_card=False),
        "deepspec": export(draft, root / "deepspec", format="deepspec", target=target),
        "dflash": export(dflash, root / "dflash", target=target, model_card=False),
    }


@pytest.mark.parametrize("layout", ["hf", "deepspec", "dflash"])
@pytest.mark.parametrize("measured", [None, MEASURED])
def test_every_model_card_renders_with_valid_metadata_and_snippets(card_folders, layout, measured):
    card = render_model_card(card_folders[layout], measured, base_model=TARGET_REPO, repo_id=DRAFT_REPO,
                             training={"data": "test fixture"})
    data = ModelCard(card).data.to_dict()
    assert data["license"] == "apache-2.0" and data["library_name"] == "transformers"
    assert data["base_model"] == TARGET_REPO and data["pipeline_tag"] == "text-generation"
    assert {"dspark", "speculative-decoding"} <= set(data["tags"])
    for section in ("## Usage", "## Serving engines", "## Training", "## Measured accepted length"):
        assert section in card
    assert "${" not in card and "<this-draft-repo>" not in card
    assert "--speculative-algorithm DSPARK" in card and '"method": "dspark"' in card
    _check_snippets(card)
    if layout == "hf":
        assert f'custom_generate="{DRAFT_REPO}"' in card and "trust_remote_code=True" in card
    else:
        assert "DSparkDraftModel.from_pretrained" in card
    assert ("DFlash draft" in card) == (layout == "dflash")
    if measured is None:
        assert "_Not measured yet._" in card
    else:
        assert "| DSpark (this draft) | 1.25 | 2.50 |" in card and "| DFlash | 1.12 | – |" in card
        assert "Setup: test fixture" in card


def test_model_card_refuses_anything_but_measured_numbers(card_folders):
    for bad in ({"results": {"x": {"a": 1.0}}}, {"setup": "s", "results": {"x": {"a": "about 6"}}},
                {"setup": "s", "results": {"x": {"a": float("nan")}}}, {"setup": "s", "results": {}}):
        with pytest.raises(ValueError, match="measured"):
            render_model_card(card_folders["hf"], bad)
    card = render_model_card(card_folders["hf"])  # no base model known: no base_model metadata, placeholders
    assert "base_model" not in ModelCard(card).data.to_dict()


def test_model_cards_cli_renders_a_card_from_a_folder_and_a_json_of_numbers(card_folders, tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "model_cards"))
    try:
        import render_card
    finally:
        sys.path.pop(0)
    (tmp_path / "measured.json").write_text(json.dumps(MEASURED))
    out = tmp_path / "README.md"
    render_card.main([str(card_folders["hf"]), "--measured", str(tmp_path / "measured.json"),
                      "--base-model", TARGET_REPO, "--repo-id", DRAFT_REPO, "--output", str(out)])
    card = out.read_text()
    assert ModelCard(card).data.to_dict()["base_model"] == TARGET_REPO and "| DSpark (this draft) | 1.25" in card


def test_package_exports():
    for name in ("export", "push_to_hub", "render_model_card", "checkpoint_format", "register_auto_classes"):
        assert name in dspark_hf.__all__ and callable(getattr(dspark_hf, name))


def test_export_command_writes_both_layouts_and_asks_for_the_target_when_it_needs_it(tmp_path, capsys):
    from dspark_hf import cli

    target = _target()
    draft = _trained_draft(target)
    draft.save_pretrained(tmp_path / "saved")  # borrows the target's embedding and LM head
    target.save_pretrained(tmp_path / "target")
    cli.main(["export", str(tmp_path / "saved"), str(tmp_path / "hf"), "--repo-id", DRAFT_REPO])
    assert {"config.json", "model.safetensors", "custom_generate/generate.py", "README.md"} <= _files(tmp_path / "hf")
    with pytest.raises(SystemExit) as exit_info:  # DeepSpec stores embedding copies: needs the target
        cli.main(["export", str(tmp_path / "saved"), str(tmp_path / "ds"), "--format", "deepspec"])
    assert exit_info.value.code == 2 and "--target PATH" in capsys.readouterr().err
    cli.main(["export", str(tmp_path / "saved"), str(tmp_path / "ds"), "--format", "deepspec",
              "--target", str(tmp_path / "target")])
    assert checkpoint_format(json.loads((tmp_path / "ds" / "config.json").read_text())) == "deepspec"
    assert_same_drafting(drafting_signature(DSparkDraftModel.from_pretrained(tmp_path / "ds"), target),
                         drafting_signature(draft, target), atol=0)
