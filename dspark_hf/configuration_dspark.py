"""Configuration of DSpark (and DFlash) draft models.

The field names follow the released DeepSpec checkpoints: their ``config.json`` is a copy of the
target's config (``model_type: "qwen3"``, ``architectures: ["Qwen3DSparkModel"]``) plus the DSpark
fields below, so such a file loads into :class:`DSparkConfig` unchanged. Drafts saved by this
library carry ``model_type: "dspark"``.

The class is written dataclass-style (annotated fields and ``__post_init__``), as transformers 5.x
turns every config class into a dataclass; a custom ``__init__`` would break subclasses.
"""

from __future__ import annotations

from transformers import PreTrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

# Architectures a DSpark/DFlash draft config may declare (ours and DeepSpec's).
DSPARK_ARCHITECTURE_SUFFIXES = ("DSparkModel", "DSparkDraftModel")


class DSparkConfig(PreTrainedConfig):
    r"""Configuration of a DSpark draft: a few Qwen3-style layers conditioned on target hidden states.

    Backbone fields (copied from the target so both agree on tokens, width and positions):
    ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers`` (draft layers),
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_act``,
    ``max_position_embeddings``, ``rms_norm_eps``, ``rope_parameters``, ``attention_bias``,
    ``bos_token_id``, ``eos_token_id``, ``pad_token_id``.

    DSpark fields:
        num_target_layers: number of layers of the target model.
        target_layer_ids: strictly increasing target layer indices whose outputs condition the
            draft (``-1`` = embedding output). The target's last layer is not allowed: transformers
            returns its post-norm value.
        block_size: gamma, draft positions per round (anchor + ``block_size - 1`` masks in,
            ``block_size`` predictions out).
        mask_token_id: embedding row fed at the masked block positions.
        num_anchors: anchors sampled per training sequence (training only).
        markov_rank: rank r of the serial Markov head; 0 means plain DFlash (no serial head).
        markov_head_type: ``"vanilla"``, ``"gated"`` or ``"rnn"``.
        enable_confidence_head: whether the draft predicts per-position acceptance ``c_k``.
        confidence_head_with_markov: whether ``c_k`` also sees ``W1[x_{k-1}]``.
        confidence_temperatures: optional per-position temperatures from Sequential Temperature
            Scaling (``c_k = sigmoid(logit_k / T_k)``); ``None`` means uncalibrated.
    """

    model_type = "dspark"

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_target_layers: int | None = None
    target_layer_ids: list[int] | None = None
    block_size: int = 7
    mask_token_id: int | None = None
    num_anchors: int = 512
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None

    def __post_init__(self, **kwargs):
        # A DeepSpec config.json says model_type "qwen3"; keep the class's "dspark" visible.
        kwargs.pop("model_type", None)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__(**kwargs)
        self.validate_dspark_fields()

    def validate_dspark_fields(self) -> None:
        """Checks the DSpark fields that do not need the target; raises ``ValueError`` with the fix."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = plain DFlash), got {self.markov_rank}.")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}."
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "confidence_head_with_markov=True needs a Markov head (markov_rank > 0); set "
                "confidence_head_with_markov=False for a DFlash-style draft with a confidence head."
            )
        ids = self.target_layer_ids
        if ids is not None:
            if len(ids) == 0:
                raise ValueError("target_layer_ids is empty; list at least one target layer index.")
            if any(b <= a for a, b in zip(ids, ids[1:])):
                raise ValueError(f"target_layer_ids must be strictly increasing, got {list(ids)}.")
            if ids[0] < -1:
                raise ValueError(f"target_layer_ids must be >= -1 (-1 = embedding output), got {list(ids)}.")
            if self.num_target_layers is not None and ids[-1] >= self.num_target_layers - 1:
                raise ValueError(
                    f"target_layer_ids {list(ids)} include or exceed the target's last layer "
                    f"({self.num_target_layers - 1}); transformers returns that layer after the final norm. "
                    "Use layers below it."
                )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the embedding table (vocab_size {self.vocab_size}); "
                "pick a token id in [0, vocab_size)."
            )
        temps = self.confidence_temperatures
        if temps is not None:
            if len(temps) != self.block_size or any(not t > 0 for t in temps):
                raise ValueError(
                    f"confidence_temperatures must hold block_size={self.block_size} positive values, got {temps}; "
                    "re-run calibration or set it to None."
                )


def is_dspark_config(config) -> bool:
    """True for a DSpark/DFlash draft config, whichever class object defined it.

    Hub remote code creates its own class objects, so recognition goes by the config's contents
    (``model_type`` or the declared architecture), never by ``isinstance``.
    """
    if getattr(config, "model_type", None) == "dspark" or type(config).model_type == "dspark":
        return True
    architectures = getattr(config, "architectures", None) or []
    return any(str(a).endswith(DSPARK_ARCHITECTURE_SUFFIXES) for a in architectures)


__all__ = ["DSparkConfig", "is_dspark_config"]
