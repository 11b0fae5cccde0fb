"""The committed model cards of the shipped drafts: Hub metadata parses, snippets compile and import."""

from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from test_hub import _check_snippets

CARDS = sorted(p for p in (Path(__file__).resolve().parents[1] / "model_cards").glob("*.md") if p.name != "README.md")


def test_shipped_cards_exist():
    assert {p.stem for p in CARDS} >= {"smollm2-135m-dspark", "smollm2-135m-dflash"}


@pytest.mark.parametrize("card_path", CARDS, ids=lambda p: p.stem)
def test_card_metadata_and_snippets(card_path):
    card = card_path.read_text()
    data = ModelCard(card).data.to_dict()
    assert data["license"] == "apache-2.0" and data["library_name"] == "transformers"
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["pipeline_tag"] == "text-generation"
    assert "${" not in card
    _check_snippets(card)


@pytest.mark.parametrize("card_path", CARDS, ids=lambda p: p.stem)
def test_card_serves_with_vllm_only_as_the_draft_allows(card_path):
    """The shipped drafts fit vLLM 0.34.0 through format="vllm" (SmolLM2 is a Llama, which vLLM runs
    with auxiliary hidden states; reduced vocabularies go through d2t); the calibrated DSpark draft
    only without its temperatures, which vLLM ignores. The DeepSpec layout, hence SGLang, refuses
    a reduced vocabulary."""
    import json

    from dspark_hf.hub import vllm_compatibility

    card = card_path.read_text()
    config = json.loads((card_path.parents[1] / "drafts" / card_path.stem / "config.json").read_text())
    assert "**vLLM** 0.34.0" in card and "--format vllm --target HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in card
    calibrated = vllm_compatibility(config) is not None
    assert vllm_compatibility(config, drop_confidence_temperatures=True) is None
    assert ("--drop-confidence-temperatures" in card) == calibrated
    assert "no field for this draft's reduced vocabulary" in card and "sglang.launch_server" not in card
