"""generate()/pipeline() integration: dispatch, pass-through for everything else, device_map offload."""

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, pipeline
from transformers.generation.utils import GenerationMixin

import dspark_hf
from dspark_hf import DSparkCandidateGenerator, FixedLengthPolicy, install_dspark_dispatch
from tiny_models import markov_draft, random_target, reload_half_on_disk, target_next_token_table

VOCAB = 48


def _tokenizer():
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1", bos_token="w0")


def _pair(arch="llama", **kwargs):
    target = random_target(arch, **kwargs)
    draft = markov_draft(target, target_next_token_table(target), block_size=4)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    return target, draft


def test_dispatch_is_installed_once_and_idempotent():
    wrapper = GenerationMixin._get_candidate_generator
    install_dspark_dispatch()
    install_dspark_dispatch()
    assert GenerationMixin._get_candidate_generator is wrapper
    assert dspark_hf.is_dspark_dispatch_installed()
    assert not getattr(wrapper.__wrapped_original__, "_dspark_dispatch", False)


def test_pipeline_with_assistant_model():
    target, draft = _pair()
    tok = _tokenizer()
    text = "w5 w9 w13 w2"
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    expected = pipe(text, max_new_tokens=15, do_sample=False)[0]["generated_text"]
    pipe_assisted = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    got = pipe_assisted(text, max_new_tokens=15, do_sample=False)[0]["generated_text"]
    assert got == expected
    assert draft.last_generation_stats is not None and draft.last_generation_stats.num_rounds > 0


def test_other_generation_modes_do_not_touch_dspark(monkeypatch):
    target, _ = _pair()
    classic_assistant = random_target("llama", num_layers=2, seed=3)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42, 4, 8, 15]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)

    def refuse(*args, **kwargs):
        raise AssertionError("DSpark generator must not be built for a non-DSpark generate call")

    monkeypatch.setattr(DSparkCandidateGenerator, "__init__", refuse)
    assert target.generate(prompt, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()
    lookup = target.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    assert lookup.tolist() == expected.tolist()
    assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=classic_assistant)
    assert assisted.tolist() == expected.tolist()


def test_target_offloaded_with_device_map(tmp_path):
    target, draft = _pair("llama", num_layers=4)
    offloaded = reload_half_on_disk(target, tmp_path)
    assert getattr(offloaded, "hf_device_map", None)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    expected = target.generate(prompt, max_new_tokens=16, do_sample=False)
    got = offloaded.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist()
    assert draft.last_generation_stats.accepted_tokens > 0
