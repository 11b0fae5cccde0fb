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
