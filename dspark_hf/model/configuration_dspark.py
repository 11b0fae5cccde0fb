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

from .speculators_format import is_speculators_config_dict, translate_speculators_config

logger = logging.get_logger(__name__)

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
LAYER_TYPES = ("full_attention", "sliding_attention")

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
        anchor_predicts: which block outputs are predictions. ``True`` (DSpark, DeepSpec): the
            block is ``[x0, MASK * (block_size - 1)]`` and the output at the anchor predicts
            ``x_1``. ``False`` (z-lab DFlash checkpoints): the block is ``[x0, MASK * block_size]``,
            each mask position predicts its own token and the anchor's output is unused, so
            ``block_size`` here is z-lab's ``block_size - 1`` (set when such a config is loaded).
        draft_vocab_size: ``None`` (default; DeepSpec and z-lab drafts): the draft proposes from the
            whole vocabulary. ``N``: a reduced draft vocabulary, the N target ids stored as the
            ``draft_vocab_ids`` tensor of the weights; every other token gets draft probability
            zero, which keeps decoding lossless (see :mod:`dspark_hf.model.draft_vocab`).

    Attention layout (defaults: every layer full, the block sees itself whole, as DeepSpec drafts):
        layer_types: one entry per draft layer, ``"full_attention"`` (all context, whole block) or
            ``"sliding_attention"`` (see :mod:`dspark_hf.model.draft_masks`).
        sliding_window: for ``"sliding_attention"`` layers, how many context tokens before the
            anchor a block sees (speculators' window: the block at anchor position ``p`` sees
            context positions ``p - sliding_window .. p - 1``).
        sliding_block_causal: whether ``"sliding_attention"`` layers mask later block positions (a
            block position sees itself and the positions before it); full layers always see the
            whole block. speculators' ``sliding_window_non_causal`` is its negation.

    A z-lab DFlash ``config.json`` (``architectures: ["DFlashDraftModel"]``) is translated on load
    by :meth:`from_dict`; see :func:`translate_zlab_dflash_config`.
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
    sliding_window: int | None = None
    sliding_block_causal: bool = True
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
    anchor_predicts: bool = True
    draft_vocab_size: int | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Loads ``config.json`` from a folder or Hub repo (see :meth:`from_dict` for what is checked)."""
        # Passed on to from_dict so that its errors can name the checkpoint.
        kwargs.setdefault("name_or_path", str(pretrained_model_name_or_path))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """Builds the config from a ``config.json`` dict; a z-lab DFlash dict is translated first.

        A checkpoint's dict must give ``block_size``: nothing in the weights reveals it, so a
        default would silently draft another block length than the draft was trained for (every
        DeepSpec and dspark_hf ``config.json`` records it; z-lab's default of 16 is applied by the
        translation). Keyword overrides (``from_pretrained(path, block_size=...)``) count as given
        and are validated like the file's values.
        """
        name = kwargs.get("name_or_path") or config_dict.get("_name_or_path") or "this checkpoint"
        if is_speculators_config_dict(config_dict):
            config_dict = translate_speculators_config(config_dict, name)
        elif is_zlab_dflash_config_dict(config_dict):
            config_dict = translate_zlab_dflash_config(config_dict)
        elif is_deepspec_config_dict(config_dict):
            _refuse_deepspec_sliding_layers(config_dict, name)
        for key in REQUIRED_CHECKPOINT_FIELDS:
            if key not in config_dict and key not in kwargs:
                raise ValueError(
                    f"The config.json of {name} has no {key} ({REQUIRED_CHECKPOINT_FIELDS[key]}), and nothing in the "
                    f"weights reveals it. Add \"{key}\": <value the draft was trained with> to config.json, or pass "
                    f"{key}=<value> to from_pretrained."
                )
        result = super().from_dict(config_dict, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        config.validate_dspark_fields()  # keyword overrides are set after __post_init__ ran
        return result

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' loader, with a recognised draft layout's ``model_type`` read as ``"dspark"``.

        DeepSpec and z-lab ``config.json`` files are copies of the target's config, so they say
        ``model_type: "qwen3"``; transformers would then warn that a ``qwen3`` checkpoint "can
        yield errors" in a ``dspark`` model. For these layouts that is expected and handled (the
        field is dropped in ``__post_init__`` anyway), so the warning is silenced for them only:
        any other foreign ``model_type`` still warns.
        """
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if is_deepspec_config_dict(config_dict):  # checked here: the model_type rewrite below hides the layout
            _refuse_deepspec_sliding_layers(config_dict, str(pretrained_model_name_or_path))
        if config_dict.get("model_type", cls.model_type) != cls.model_type and is_recognised_draft_config_dict(
            config_dict
        ):
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """No-op. ``import dspark_hf`` registers this class with ``AutoConfig`` itself, and Hub folders
        get thin remote-code files from :func:`dspark_hf.hub.export`. transformers calls this after a
        remote-code load; the default would make every later ``save_pretrained`` copy this module's
        source into the folder, a second implementation that breaks ``isinstance``."""
        return None

    def __post_init__(self, **kwargs):
        # A DeepSpec config.json says model_type "qwen3"; keep the class's "dspark" visible.
        kwargs.pop("model_type", None)
        self._check_field_types()  # before the defaults below compute with these fields
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__(**kwargs)
        self.validate_dspark_fields()

    def _check_field_types(self) -> None:
        """Raises ``ValueError`` naming the field, its value and the expected type for an ill-typed
        field (or a size below 1).

        ``bool`` is not accepted where an int is expected, nor an integral float (``7.0``): a
        config.json holding those was not written by a DSpark/DeepSpec tool.
        """
        for name, (kind, optional) in _FIELD_TYPES.items():
            value = getattr(self, name, None)
            if value is None and optional:
                continue
            if not _is_kind(value, kind):
                raise ValueError(_type_error(name, value, kind, optional))
        for name in _POSITIVE_SIZES:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"DSparkConfig.{name} must be >= 1, got {value}.")
        for name in ("target_layer_ids", "confidence_temperatures"):
            values = getattr(self, name)
            if values is None:
                continue
            kind = "int" if name == "target_layer_ids" else "number"
            if not isinstance(values, (list, tuple)):
                raise ValueError(_type_error(name, values, f"list of {kind}s", True))
            bad = [v for v in values if not _is_kind(v, kind)]
            if bad:
                raise ValueError(
                    f"DSparkConfig.{name} must be a list of {kind}s, got {values!r} (element {bad[0]!r} is a "
                    f"{type(bad[0]).__name__}). Fix it in config.json or in the DSparkConfig(...) call."
                )
            setattr(self, name, list(values))

    def validate_dspark_fields(self) -> None:
        """Checks the DSpark fields that do not need the target; raises ``ValueError`` with the fix."""
        self._check_field_types()
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if kv_heads is not None and heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}; grouped-query "
                "attention shares each key/value head among a whole number of query heads."
            )
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
        if self.target_layer_ids is not None:
            problem = target_layer_ids_problem(self.target_layer_ids, self.num_target_layers)
            if problem is not None:
                raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} {problem}.")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the embedding table (vocab_size {self.vocab_size}); "
                "pick a token id in [0, vocab_size)."
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must lie in [1, vocab_size={self.vocab_size}] "
                "(None = the full vocabulary)."
            )
        self._check_layer_types()
        temps = self.confidence_temperatures
        if temps is not None:
            if len(temps) != self.block_size or any(not t > 0 for t in temps):
                raise ValueError(
                    f"confidence_temperatures must hold block_size={self.block_size} positive values, got {temps}; "
                    "re-run calibration or set it to None."
                )


    def _check_layer_types(self) -> None:
        """Raises ``ValueError`` for layer types the draft cannot run (see :mod:`dspark_hf.model.draft_masks`)."""
        used = list(self.layer_types or [])[: self.num_hidden_layers]
        if len(used) < self.num_hidden_layers:
            raise ValueError(
                f"layer_types {self.layer_types!r} has fewer entries than num_hidden_layers={self.num_hidden_layers}; "
                "give one of \"full_attention\" / \"sliding_attention\" per draft layer."
            )
        bad = sorted({t for t in used if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types has {bad}; a draft layer is one of {LAYER_TYPES}.")
        if "sliding_attention" in used and self.sliding_window is None:
            raise ValueError(
                "layer_types has \"sliding_attention\" layers but sliding_window is None; set sliding_window to the "
                "number of context tokens before the anchor those layers see."
            )


def target_layer_ids_problem(layer_ids: list[int], num_target_layers: int | None) -> str | None:
    """What is wrong with ``layer_ids`` as the target layers a draft reads, completing the sentence
    "target_layer_ids [...] ..."; ``None`` when they are fine.

    The ids must be strictly increasing and ``>= -1`` (``-1`` is the embedding output), and, when
    the target's depth is known, below its last layer: transformers returns that layer after the
    final norm, which is not what the draft was trained on.
    """
    ids = list(layer_ids)
    if not ids:
        return "must not be empty; list at least one target layer index"
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return "must be strictly increasing"
    if ids[0] < -1:
        return "must be >= -1 (-1 = embedding output)"
    if num_target_layers is not None and ids[-1] >= num_target_layers - 1:
        return (f"include or exceed the target's last layer ({num_target_layers - 1}), which transformers returns "
                "after the final norm; use layers below it")
    return None


def hidden_state_indices(layer_ids: list[int]) -> list[int]:
    """Where the outputs of target layers ``layer_ids`` sit in transformers' ``hidden_states``.

    That tuple starts with the embedding output, so layer ``i``'s output is entry ``i + 1`` (and the
    embedding output, layer id ``-1``, is entry 0).
    """
    return [layer_id + 1 for layer_id in layer_ids]


# Fields a checkpoint's config.json must give, with what they mean (see DSparkConfig.from_dict).
REQUIRED_CHECKPOINT_FIELDS = {"block_size": "draft positions per round, gamma"}

# Field -> (expected kind, None allowed). Kinds: "int" (not bool), "number" (int or float, not bool),
# "bool", "str". Checked before anything computes with the values.
_FIELD_TYPES: dict[str, tuple[str, bool]] = {
    "vocab_size": ("int", False),
    "hidden_size": ("int", False),
    "intermediate_size": ("int", False),
    "num_hidden_layers": ("int", False),
    "num_attention_heads": ("int", False),
    "num_key_value_heads": ("int", True),
    "head_dim": ("int", True),
    "max_position_embeddings": ("int", False),
    "hidden_act": ("str", False),
    "rms_norm_eps": ("number", False),
    "attention_bias": ("bool", False),
    "num_target_layers": ("int", True),
    "block_size": ("int", False),
    "mask_token_id": ("int", True),
    "num_anchors": ("int", False),
    "markov_rank": ("int", False),
    "markov_head_type": ("str", False),
    "enable_confidence_head": ("bool", False),
    "confidence_head_with_markov": ("bool", False),
    "anchor_predicts": ("bool", False),
    "draft_vocab_size": ("int", True),
    "sliding_window": ("int", True),
    "sliding_block_causal": ("bool", False),
}


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "num_anchors", "sliding_window")


def _is_kind(value, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == "int" else isinstance(value, (int, float))


def _type_error(name: str, value, kind: str, optional: bool) -> str:
    expected = {"int": "an int", "number": "a number (int or float)", "bool": "a bool (true/false)",
                "str": "a str"}.get(kind, f"a {kind}")
    return (
        f"DSparkConfig.{name} must be {expected}{' or None' if optional else ''}, got {value!r} "
        f"({type(value).__name__}). Fix it in config.json or in the DSparkConfig(...) call."
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


def is_recognised_draft_config_dict(config_dict: dict) -> bool:
    """True for a ``config.json`` dict in a draft layout this library reads although its
    ``model_type`` is not ``"dspark"``: DeepSpec's (a ``...DSparkModel`` architecture), z-lab's DFlash
    or vllm-project/speculators' (no ``model_type`` at all)."""
    return (is_deepspec_config_dict(config_dict) or is_zlab_dflash_config_dict(config_dict)
            or is_speculators_config_dict(config_dict))


def is_deepspec_config_dict(config_dict: dict) -> bool:
    """True for a DeepSpec-layout ``config.json`` dict: a ``...DSparkModel`` architecture under the
    target's ``model_type`` (not ours, not speculators', not z-lab's)."""
    if config_dict.get("model_type") == "dspark" or is_speculators_config_dict(config_dict):
        return False
    architectures = config_dict.get("architectures") or []
    return any(str(a).endswith(DSPARK_ARCHITECTURE_SUFFIXES) for a in architectures) and not \
        is_zlab_dflash_config_dict(config_dict)


def _refuse_deepspec_sliding_layers(config_dict: dict, name: str) -> None:
    """DeepSpec's released drafts use full attention; for a DeepSpec-layout config that declares
    sliding-window layers we do not know DeepSpec's window semantics, so it is refused rather than
    drafted with a guessed window (or, as before, silently with none)."""
    layers = int(config_dict.get("num_hidden_layers") or 1)
    used = list(config_dict.get("layer_types") or [])[:layers]
    if any(t != "full_attention" for t in used) or (not used and config_dict.get("use_sliding_window")):
        shown = f"layer_types={used}" if used else "use_sliding_window=True"
        raise ValueError(
            f"{name} is a DeepSpec-layout draft with sliding-window layers ({shown}, sliding_window="
            f"{config_dict.get('sliding_window')!r}); dspark_hf reproduces DeepSpec drafting with full attention only. "
            "Use DeepSpec's own code for this checkpoint, or set layer_types to full_attention if it was trained so."
        )


# --------------------------------------------------------------------------- z-lab DFlash configs
# Facts from z-lab's published DFlash code (dflash/model.py): a value in ``dflash_config`` wins over
# the top-level one; ``target_layer_ids`` and ``mask_token_id`` are required; ``block_size``
# defaults to 16; the block ``[anchor, MASK * (block_size - 1)]`` is drafted at the mask positions
# (each predicts its own token); the draft has no embedding or LM head (it uses the target's).
ZLAB_DFLASH_ARCHITECTURE = "DFlashDraftModel"
# Fields that change the computation in z-lab's code, with the value that leaves it as plain DFlash.
_ZLAB_NEUTRAL_FIELDS = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "is_causal": False,
    "causal": False,
}
_ZLAB_SUPPORTED_DFLASH_KEYS = {"block_size", "mask_token_id", "target_layer_ids", "num_target_layers"}


def is_zlab_dflash_config_dict(config_dict: dict) -> bool:
    """True for a ``config.json`` from z-lab's DFlash family (a ``dflash_config`` or a DFlash/Domino architecture)."""
    if is_speculators_config_dict(config_dict):  # speculators also names its class DFlashDraftModel
        return False
    architectures = [str(a) for a in (config_dict.get("architectures") or [])]
    return "dflash_config" in config_dict or any(a.startswith(("DFlash", "Domino")) for a in architectures)


def translate_zlab_dflash_config(config_dict: dict) -> dict:
    """Turns a z-lab DFlash ``config.json`` dict into DSparkConfig fields, or raises ``ValueError``.

    Supported: ``architectures: ["DFlashDraftModel"]`` with full (bidirectional) attention and no
    logit/embedding rescaling. The result drafts exactly z-lab's positions: z-lab ``block_size`` B
    becomes ``block_size = B - 1`` draft tokens with ``anchor_predicts = False``; ``markov_rank = 0``
    and no confidence head (plain DFlash, the whole block is verified). Rejected, with the reason:
    other architectures of the family (DFlash2 with its convolutions and candidate selector,
    Domino, ...), sliding-window or causal layers, ``output_multiplier``/``final_logit_softcapping``
    /``input_embedding_scale`` other than neutral, unknown ``dflash_config`` keys.
    """
    src = dict(config_dict)
    name = src.get("_name_or_path") or "this checkpoint"
    architectures = list(src.get("architectures") or [])
    dflash = dict(src.pop("dflash_config", None) or {})

    def fail(reason: str) -> ValueError:
        return ValueError(
            f"{name} is a z-lab DFlash-family draft that dspark_hf cannot run with identical drafting: {reason} "
            "Supported: architectures [\"DFlashDraftModel\"] with full attention. Use z-lab's own code "
            "(AutoModel.from_pretrained(..., trust_remote_code=True) and its spec_generate) for this checkpoint."
        )

    if architectures != [ZLAB_DFLASH_ARCHITECTURE]:
        raise fail(f"architectures {architectures} (only [\"{ZLAB_DFLASH_ARCHITECTURE}\"] is supported).")
    unknown = sorted(set(dflash) - _ZLAB_SUPPORTED_DFLASH_KEYS - set(_ZLAB_NEUTRAL_FIELDS))
    if unknown:
        raise fail(f"dflash_config has fields whose behaviour is not implemented here: {unknown}.")

    def value(key, default=None):
        return dflash[key] if key in dflash else src.get(key, default)

    for key, neutral in _ZLAB_NEUTRAL_FIELDS.items():
        got = value(key, neutral)
        if got != neutral and not (neutral is not None and got is not None and float(got) == float(neutral)):
            raise fail(f"{key} = {got!r} (only {neutral!r} is supported).")
        src.pop(key, None)
    num_layers = int(src.get("num_hidden_layers", 1))
    layer_types = src.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or (not layer_types and src.get("use_sliding_window")):
        raise fail(f"sliding-window attention layers ({layer_types or 'use_sliding_window'}) are not supported.")
    target_layer_ids = value("target_layer_ids")
    mask_token_id = value("mask_token_id")
    if target_layer_ids is None or mask_token_id is None:
        raise fail("dflash_config must give target_layer_ids and mask_token_id.")
    block_size = int(value("block_size", 16))
    if block_size < 2:
        raise fail(f"block_size {block_size} drafts no token (z-lab drafts block_size - 1 tokens).")

    src.pop("auto_map", None)
    src.update(
        architectures=["DSparkDraftModel"],
        block_size=block_size - 1,
        anchor_predicts=False,
        target_layer_ids=[int(i) for i in target_layer_ids],
        mask_token_id=int(mask_token_id),
        num_target_layers=value("num_target_layers"),
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
        tie_word_embeddings=False,  # the draft stores neither; both come from the target
        layer_types=["full_attention"] * num_layers,
    )
    return src


# The public path of the config class (dspark_hf/configuration_dspark.py aliases this module).
DSparkConfig.__module__ = "dspark_hf.configuration_dspark"

__all__ = [
    "DSparkConfig",
    "hidden_state_indices",
    "is_dspark_config",
    "is_deepspec_config_dict",
    "is_recognised_draft_config_dict",
    "is_speculators_config_dict",
    "is_zlab_dflash_config_dict",
    "target_layer_ids_problem",
    "translate_zlab_dflash_config",
]
