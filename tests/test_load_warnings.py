"""Loading a recognised draft layout whose config says ``model_type: "qwen3"`` (DeepSpec, z-lab
DFlash) does not print transformers' "You are using a model of type qwen3 to instantiate a model
of type dspark ... can yield errors" warning; an unrecognised foreign config still does."""

import logging

import pytest
from transformers import Qwen3Config

from dspark_hf import DSparkConfig, DSparkDraftModel
from test_checkpoints import write_deepspec_dflash_folder, write_deepspec_folder
from test_hub import _zlab_folder

MESSAGE = "to instantiate a model of type"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def config_warnings():
    logger = logging.getLogger("transformers.configuration_utils")
    handler = _Records()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("layout", ["deepspec", "deepspec-dflash", "zlab"])
def test_recognised_layouts_load_without_the_model_type_warning(tmp_path, config_warnings, layout):
    if layout == "deepspec":
        write_deepspec_folder(tmp_path)
    elif layout == "deepspec-dflash":
        write_deepspec_dflash_folder(tmp_path)
    else:
        _zlab_folder(tmp_path)
    draft = DSparkDraftModel.from_pretrained(tmp_path)
    config = DSparkConfig.from_pretrained(tmp_path)
    assert draft.config.model_type == config.model_type == "dspark"
    assert not [m for m in config_warnings if MESSAGE in m], config_warnings


def test_an_unrecognised_foreign_config_still_warns(tmp_path, config_warnings):
    plain = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    plain.architectures = ["Qwen3ForCausalLM"]  # a target checkpoint, not a draft
    plain.save_pretrained(tmp_path)
    DSparkConfig.from_pretrained(tmp_path, block_size=7)  # a target config has no block_size
    assert [m for m in config_warnings if MESSAGE in m and "`qwen3`" in m]
