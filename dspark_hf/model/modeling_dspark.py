"""The DSpark draft model: a DFlash-style parallel backbone plus the serial Markov head and the
confidence head.

Data flow of one round (docs/design.md, section 4):

1. :meth:`DSparkDraftModel.add_context` turns the target's hidden states of ``target_layer_ids``
   for newly accepted tokens into per-layer context keys/values (``fc`` -> ``hidden_norm`` ->
   ``k_proj``/``v_proj`` -> ``k_norm`` -> RoPE) and appends them to a :class:`DraftContextCache`.
2. :meth:`DSparkDraftModel.forward` runs the block ``[x0, MASK * (gamma - 1)]`` through the layers:
   queries from the block only, keys/values ``[context; block]``, no causal mask. It returns the
   final-normed hidden states ``h_k`` and base logits ``U_k``; the block's own keys/values are never
   stored, so nothing needs dropping afterwards.
3. :mod:`dspark_hf.decoding.sampling` draws tokens left to right with the Markov bias and computes ``c_k``
   (the two heads are in :mod:`dspark_hf.model.heads`).

State-dict names follow the DeepSpec checkpoints (``layers.{i}.self_attn.q_proj``, ``fc``,
``hidden_norm``, ``markov_head.markov_w1``, ``confidence_head.proj``, ...). ``embed_tokens`` and
``lm_head`` are optional: a draft without them borrows the target's (see :meth:`bind_target`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half
from transformers.utils import logging

from . import draft_vocab

from . import speculators_format
from .checkpoint_dtypes import check_checkpoint_dtypes
from .configuration_dspark import DSparkConfig, target_layer_ids_problem
from .draft_context_cache import DraftContextCache
from .draft_masks import layer_attention_masks
from .heads import ConfidenceHead, MarkovHead
from .draft_runtime import DraftRuntimeSettings
from .targets import draft_backbone_fields

logger = logging.get_logger(__name__)

OPTIONAL_MODULES = ("embed_tokens", "lm_head")


def _drop_load_report(record) -> bool:
    """Logging filter: hides transformers' weight-loading report (DSpark raises its own errors)."""
    return "LOAD REPORT" not in str(record.msg)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for ``x`` of shape (batch, heads, seq, head_dim); cos/sin (batch, seq, head_dim)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DSparkAttention(nn.Module):
    """Qwen3-style attention whose keys/values are ``[context; block]`` and whose queries are the block."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of ``x`` (batch, seq, hidden) -> (batch, kv_heads, seq, head_dim)."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        keys = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        values = self.v_proj(x).view(shape).transpose(1, 2)
        return _rope(keys, cos, sin), values

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: DraftContextCache | None,
        layer_idx: int,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        queries = self.q_norm(self.q_proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim))
        queries = _rope(queries.transpose(1, 2), cos, sin)
        keys, values = self.project_kv(hidden_states, cos, sin)
        if context is not None:
            keys, values = context.with_block(layer_idx, keys, values)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attention_mask, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin, context, layer_idx, attention_mask):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), cos, sin, context, layer_idx, attention_mask
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class DraftBlockOutput:
    """Output of one draft forward over a block.

    Attributes:
        hidden_states: final-normed hidden states ``h_1..h_gamma``, shape (R, gamma, hidden_size).
        logits: base logits ``U_1..U_gamma`` (before the Markov bias), shape (R, gamma, vocab_size),
            or ``None`` when the forward was asked not to compute them (see :meth:`DSparkDraftModel.base_logits`).
    """

    hidden_states: torch.Tensor
    logits: torch.Tensor | None


# The Hub exporter's upload (dspark_hf.hub.push_to_hub), set by register_hub_upload when dspark_hf.hub is imported.
_HUB_UPLOAD: list = []


def register_hub_upload(upload) -> None:
    """Sets the function :meth:`DSparkPreTrainedModel.push_to_hub` delegates to, ``upload(draft, repo_id, **kwargs)``
    (:mod:`dspark_hf.hub` registers its :func:`~dspark_hf.hub.push_to_hub` on import)."""
    _HUB_UPLOAD[:] = [upload]


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "input_ids"
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        # transformers' generic init covers Linear/Embedding/RMSNorm and recomputes the rotary
        # buffers (non-persistent, so absent from checkpoints); it skips loaded weights.
        super()._init_weights(module)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """No-op: ``import dspark_hf`` registers the draft with ``AutoModel``, and
        :func:`dspark_hf.hub.export` writes thin remote-code files (transformers' default would copy
        this module's source into every later ``save_pretrained`` folder)."""
        return None

    def push_to_hub(self, repo_id: str, **kwargs):
        """Uploads a Hub-ready folder (remote code, ``custom_generate``, model card); see
        :func:`dspark_hf.push_to_hub` for the arguments (``draft.push_to_hub(repo_id, ...)`` is
        ``dspark_hf.push_to_hub(draft, repo_id, ...)``)."""
        # transformers users call push_to_hub on the model; the Hub exporter does the work. It registers
        # itself here when dspark_hf.hub is imported (the package facade imports it), so this module
        # never imports the tooling (tests/test_layout.py).
        if not _HUB_UPLOAD:
            raise RuntimeError("DSparkDraftModel.push_to_hub uploads through dspark_hf's Hub exporter, which "
                               "registers when dspark_hf.hub is imported: call dspark_hf.push_to_hub(draft, "
                               f"{repo_id!r}, ...) (or import dspark_hf.hub first).")
        return _HUB_UPLOAD[0](self, repo_id, **kwargs)


class DSparkDraftModel(DSparkPreTrainedModel, DraftRuntimeSettings):
    """DSpark (or, with ``markov_rank = 0``, DFlash) draft model.

    Use it as ``target.generate(**inputs, assistant_model=draft)`` after ``import dspark_hf``.
    Build one with :meth:`from_pretrained` (our format or a DeepSpec checkpoint, strict key
    matching) or :meth:`from_target` (freshly initialised for any causal LM).

    Run-time settings live on ``draft.generation_config`` or in the ``generate()`` call, where
    transformers users set speculation (``dspark_verify_policy``, ``dspark_adaptive_drafting``,
    ``num_assistant_tokens``, ``assistant_confidence_threshold``, ...; see :mod:`dspark_hf.decoding.settings`).
    ``last_generation_stats`` holds the statistics of this thread's latest call.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.target_layer_ids is None:
            raise ValueError(
                "DSparkConfig.target_layer_ids is not set; build the draft with DSparkDraftModel.from_target(target) "
                "or give the target layers whose hidden states condition it."
            )
        if config.mask_token_id is None:
            raise ValueError("DSparkConfig.mask_token_id is not set; pick a token id in [0, vocab_size).")
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        # Reduced draft vocabulary: its N target ids, saved with the weights (None: the full vocabulary);
        # the caches hold the gathered LM-head rows and the CUDA op's padded W2 (never saved).
        size = config.draft_vocab_size
        self.register_buffer(draft_vocab.BUFFER_NAME, torch.arange(size) if size is not None else None)
        self._draft_vocab_caches = (draft_vocab.new_cache(), draft_vocab.new_cache())
        # Target modules borrowed when the checkpoint has no copies; a tuple keeps them out of
        # state_dict/parameters so they are neither saved nor moved with the draft.
        self._borrowed: tuple[nn.Module | None, nn.Module | None] = (None, None)
        self.post_init()
        # Speculation settings a transformers user sets on an assistant (dspark_verify_policy,
        # num_assistant_tokens, ...); a call's generate() kwargs override them. A draft does not
        # generate on its own, so transformers does not create this for it.
        if getattr(self, "generation_config", None) is None:
            self.generation_config = GenerationConfig()

    # ----------------------------------------------------------------- construction / loading
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        *,
        block_size: int = 7,
        num_hidden_layers: int = 1,
        target_layer_ids: list[int] | None = None,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        mask_token_id: int | None = None,
        copy_embeddings: bool = False,
        draft_vocab_ids=None,
    ) -> "DSparkDraftModel":
        """A freshly initialised draft for any transformers causal LM ``target``.

        The config copies what target and draft must agree on (vocab and hidden size, heads, rope
        settings, special token ids), read through each family's config names (GPT-2's ``n_embd``,
        OPT's ``ffn_dim``, ...; see :func:`dspark_hf.model.targets.draft_backbone_fields`, which raises
        ``ValueError`` naming what a target lacks). Defaults: ``target_layer_ids`` spread evenly over
        ``[1, L - 3]`` of the target's ``L`` layers (never its last layer), as many as draft layers
        but at least 3 (when the target has them); ``mask_token_id`` = the target's pad token when
        it differs from EOS, else the last vocabulary row. Without ``copy_embeddings`` the draft
        stores no embedding/LM-head and borrows the target's. ``draft_vocab_ids`` (N distinct target
        ids) makes a reduced draft vocabulary (:mod:`dspark_hf.model.draft_vocab`); ``None`` keeps all tokens.
        """
        fields = draft_backbone_fields(target)
        if draft_vocab_ids is not None:
            draft_vocab_ids = draft_vocab.as_draft_vocab_ids(draft_vocab_ids, fields["vocab_size"])
        num_target_layers = fields["num_target_layers"]
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        if mask_token_id is None:
            eos = fields["eos_token_id"] if isinstance(fields["eos_token_id"], list) else [fields["eos_token_id"]]
            pad = fields["pad_token_id"]
            mask_token_id = pad if pad is not None and pad not in eos else fields["vocab_size"] - 1
        config = DSparkConfig(
            **fields,
            num_hidden_layers=num_hidden_layers,
            target_layer_ids=list(target_layer_ids),
            block_size=block_size,
            mask_token_id=mask_token_id,
            markov_rank=markov_rank,
            markov_head_type=markov_head_type,
            enable_confidence_head=confidence_head,
            confidence_head_with_markov=confidence_head_with_markov and confidence_head,
            draft_vocab_size=None if draft_vocab_ids is None else draft_vocab_ids.numel(),
            architectures=["DSparkDraftModel"],
        )
        draft = cls(config)
        if draft_vocab_ids is not None:
            draft.draft_vocab_ids.copy_(draft_vocab_ids)
        if draft.markov_head is not None:
            # A fresh Markov head starts as a zero bias, so an untrained draft behaves like DFlash.
            nn.init.zeros_(draft.markov_head.markov_w2.weight)
        draft._check_not_on_meta()  # a meta-device context cannot be moved to the target's device
        dtype = target.get_input_embeddings().weight.dtype
        draft.to(device=target.get_input_embeddings().weight.device, dtype=dtype)
        if copy_embeddings:
            if type(target.get_input_embeddings()) is not nn.Embedding:  # e.g. Gemma's scales by sqrt(hidden)
                raise ValueError(
                    f"copy_embeddings=True: the target's embedding is a {type(target.get_input_embeddings()).__name__}, "
                    "whose forward is more than a table lookup; a copied table would change the draft's inputs. "
                    "Leave copy_embeddings off so the draft borrows the target's embedding module.")
            draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
            draft.lm_head.weight.data.copy_(target.get_output_embeddings().weight.data)
        else:
            draft.embed_tokens = None
            draft.lm_head = None
        draft.bind_target(target)
        return draft

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Loads a draft (ours, DeepSpec, z-lab or speculators layout) with strict key matching.

        A missing or unexpected weight raises ``ValueError``, except that ``embed_tokens`` and
        ``lm_head`` may be absent together with all their keys; the draft then borrows the
        target's at generation time. A speculators checkpoint's weights are translated first
        (:mod:`dspark_hf.model.speculators_format`).
        """
        want_info = kwargs.pop("output_loading_info", False)
        source = pretrained_model_name_or_path
        translated = speculators_format.translated_state_dict(pretrained_model_name_or_path, kwargs)
        if translated is not None:  # transformers then reads config.json from `config` and weights from here
            kwargs.setdefault("config", pretrained_model_name_or_path)
            kwargs["state_dict"], source = translated, None
        # Shape mismatches come back in the loading info and are raised below with names and shapes;
        # transformers' own error only points at its load report, which is hidden here.
        kwargs["ignore_mismatched_sizes"] = True
        # transformers logs a "newly initialized" report for absent embed_tokens/lm_head, which is
        # expected here; key problems are reported below as an error instead.
        report_logger = logging.get_logger("transformers.modeling_utils")
        report_logger.addFilter(_drop_load_report)
        try:
            model, info = super().from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        except RuntimeError as err:
            if "ignore_mismatched_sizes" in str(err) or "size mismatch" in str(err):
                raise ValueError(
                    f"Checkpoint {pretrained_model_name_or_path!s} has weights whose shapes do not match its config "
                    "(vocab_size, hidden_size, markov_rank, number of target layers). Check that config.json "
                    f"belongs to these weights. Details: {err}"
                ) from err
            raise
        except SafetensorError as err:
            raise ValueError(
                f"The weights of {pretrained_model_name_or_path!s} are broken or incomplete ({err}). "
                "Re-download or re-save the checkpoint."
            ) from err
        finally:
            report_logger.removeFilter(_drop_load_report)
        missing = set(info.get("missing_keys", []))
        absent_optional = [name for name in OPTIONAL_MODULES if f"{name}.weight" in missing]
        missing -= {f"{name}.weight" for name in absent_optional}
        unexpected = set(info.get("unexpected_keys", []))
        mismatched = info.get("mismatched_keys", [])
        mismatched = draft_vocab.check_loaded_draft_vocab(model, missing, unexpected, mismatched,
                                                          str(pretrained_model_name_or_path))
        if missing or unexpected or mismatched:
            shapes = [f"{key}: checkpoint {tuple(saved)}, config expects {tuple(expected)}"
                      for key, saved, expected in sorted(mismatched, key=lambda m: m[0])]
            raise ValueError(
                f"Checkpoint {pretrained_model_name_or_path!s} does not match a DSpark draft with this config: "
                f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}, "
                f"shape mismatches [{'; '.join(shapes)}]. Check that config.json belongs to these weights "
                "(vocab_size, hidden_size, intermediate_size, markov_rank, markov_head_type, enable_confidence_head, "
                "confidence_head_with_markov, target_layer_ids, num_hidden_layers) and that the file is complete."
            )
        for name in absent_optional:
            setattr(model, name, None)
        bad = non_finite_parameters(model)
        if bad:
            raise ValueError(
                f"Checkpoint {pretrained_model_name_or_path!s} has non-finite values (NaN or inf) in "
                f"{len(bad)} tensor(s): {', '.join(repr(name) for name in bad)}. The file is corrupt or the "
                "training diverged; re-download or re-save the checkpoint, or use an earlier training checkpoint."
            )
        check_checkpoint_dtypes(model, pretrained_model_name_or_path, kwargs)  # e.g. int8 stored for a float weight
        if absent_optional:
            logger.info(f"Draft has no {' / '.join(absent_optional)}; it will use the target's.")
        return (model, info) if want_info else model

    # ------------------------------------------------------------------ target binding / checks
    def bind_target(self, target: PreTrainedModel) -> None:
        """Checks that ``target`` fits this draft and borrows its embedding/LM head where needed.

        A draft in eval mode with a reduced draft vocabulary also builds its reduced LM head here (the
        vocabulary's rows of the head, packed as an engine prepared the head): called once after preparing
        both models (``optimize_for_cpu``), it takes that cost out of the first ``generate``. ``generate``
        calls it too; a head already built for the same weights is kept.
        """
        embed, lm_head = self.check_target(target)
        self._borrowed = (
            None if self.embed_tokens is not None else embed,
            None if self.lm_head is not None else lm_head,
        )
        if self.draft_vocab_ids is not None and not self.training:
            head = self._lm_head()
            draft_vocab.gathered_head(head, self.draft_vocab_ids, self._draft_vocab_caches[0])

    def check_target(self, target: PreTrainedModel) -> tuple[nn.Module, nn.Module]:
        """Checks that ``target`` fits this draft; returns the embedding and LM head the draft will use.

        Raises ``ValueError`` naming the mismatch (vocab size, hidden size, layer ids, mask id), or a
        draft whose weights are on the ``meta`` device (built without loading any values).
        """
        self._check_not_on_meta()
        tc = target.config.get_text_config()
        c = self.config
        if tc.vocab_size != c.vocab_size:
            raise ValueError(
                f"Draft vocab_size {c.vocab_size} != target vocab_size {tc.vocab_size}: this draft was made for "
                "another tokenizer. Use a draft trained for this target (or DSparkDraftModel.from_target)."
            )
        if tc.hidden_size != c.hidden_size:
            raise ValueError(
                f"Draft hidden_size {c.hidden_size} != target hidden_size {tc.hidden_size}: the draft reads the "
                "target's hidden states. Use a draft trained for this target."
            )
        n_layers = tc.num_hidden_layers
        problem = target_layer_ids_problem(c.target_layer_ids, n_layers)
        if problem is not None:
            raise ValueError(
                f"target_layer_ids {list(c.target_layer_ids)} do not fit the target's {n_layers} layers: they "
                f"{problem}. Use a draft trained for this target."
            )
        if c.num_target_layers is not None and c.num_target_layers != n_layers:
            raise ValueError(
                f"Draft was trained on a target with {c.num_target_layers} layers, this target has {n_layers}. "
                "Use a draft trained for this target."
            )
        embed = self.embed_tokens if self.embed_tokens is not None else target.get_input_embeddings()
        lm_head = self.lm_head if self.lm_head is not None else target.get_output_embeddings()
        if not 0 <= c.mask_token_id < embed.weight.shape[0]:
            raise ValueError(
                f"mask_token_id {c.mask_token_id} is outside the embedding table ({embed.weight.shape[0]} rows); "
                "set config.mask_token_id to a valid row."
            )
        if lm_head is None:
            raise ValueError("Neither the draft nor the target has an LM head (get_output_embeddings() is None).")
        return embed, lm_head

    def _check_not_on_meta(self) -> None:
        on_meta = next((name for name, p in self.named_parameters() if p.device.type == "meta"), None)
        if on_meta is not None:
            raise ValueError(
                f"The draft's weights are on the meta device (no values; e.g. built under `with torch.device('meta')` "
                f"or loaded with a device_map that offloaded them), first: {on_meta!r}. Load the draft with "
                "DSparkDraftModel.from_pretrained(...) or DSparkDraftModel.from_target(target) outside a meta-device "
                "context, or materialise it with draft.to_empty(device=...) and load a state dict."
            )

    def _embedding(self) -> nn.Module:
        embed = self.embed_tokens if self.embed_tokens is not None else self._borrowed[0]
        if embed is None:
            raise ValueError("This draft has no embed_tokens; call draft.bind_target(target) first.")
        return embed

    def _lm_head(self) -> nn.Module:
        head = self.lm_head if self.lm_head is not None else self._borrowed[1]
        if head is None:
            raise ValueError("This draft has no lm_head; call draft.bind_target(target) first.")
        return head

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    # -------------------------------------------------------------------------------- forward
    def new_cache(self) -> DraftContextCache:
        return DraftContextCache(len(self.layers))

    def add_context(
        self,
        cache: DraftContextCache,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        """Appends context keys/values for new accepted tokens.

        Args:
            target_hidden: concatenated target hidden states of ``target_layer_ids``, (R, n, m*d).
            position_ids: absolute positions of those tokens, (R, n).
            key_mask: (R, n) bool, False for padding tokens; ``None`` when all are real.
        """
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(context, position_ids)
        for idx, layer in enumerate(self.layers):
            keys, values = layer.self_attn.project_kv(context, cos, sin)
            cache.append(idx, keys, values)
        cache.append_mask(key_mask, target_hidden.shape[1], target_hidden.shape[0], context.device)
        cache.length += target_hidden.shape[1]

    def forward(
        self,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | None = None,
        compute_logits: bool = True,
    ) -> DraftBlockOutput:
        """Runs one block (R, gamma) at ``position_ids`` against the cached context.

        With ``compute_logits=False`` the LM head is skipped (``logits`` is None): generation
        computes the base logits only once the verify policy admits a first position, because
        the vocabulary projection is most of a small draft's cost and the policy often admits none.

        Every block position sees the whole block and all context (no causal mask), except in
        ``sliding_attention`` layers (:mod:`dspark_hf.model.draft_masks`). Training packs many blocks
        into one row and passes ``attention_mask`` (bool, broadcastable to (R, heads, block
        tokens, context + block tokens)) so each block sees only its own tokens and the context
        before its anchor.
        """
        mask_positions_predict = not getattr(self.config, "anchor_predicts", True)
        if mask_positions_predict:
            input_ids, position_ids = self._extend_block_for_mask_predictions(input_ids, position_ids)
        embed = self._embedding()
        hidden = embed(input_ids.to(embed.weight.device)).to(self.fc.weight.device, self.fc.weight.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        masks = layer_attention_masks(self.config, attention_mask, cache, tuple(input_ids.shape), hidden.device)
        for idx, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, cache, idx, masks[idx])
        hidden = self.norm(hidden)
        if mask_positions_predict:  # z-lab layout: the anchor's output predicts nothing
            hidden = hidden[:, 1:]
        return DraftBlockOutput(hidden_states=hidden, logits=self.base_logits(hidden) if compute_logits else None)

    def base_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Base logits ``U`` (the LM head) of final-normed hidden states (..., hidden_size), over the
        whole vocabulary: with a reduced draft vocabulary ``-inf`` outside it (draft probability 0)."""
        logits = self.draft_vocab_logits(hidden_states)
        if self.draft_vocab_ids is not None:
            logits = draft_vocab.scatter_to_vocab(logits, self.draft_vocab_ids, self.config.vocab_size, float("-inf"))
        return logits.to(hidden_states.device)

    def draft_vocab_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Base logits over the draft vocabulary only: (..., N) in ``draft_vocab_ids`` order for a reduced
        one (what training computes its loss on), else the full LM head (on the head's device). A reduced
        head runs the way an engine prepared the target's in eval mode, as a plain matmul in train mode."""
        head = self._lm_head()
        if self.draft_vocab_ids is None:
            return head(hidden_states.to(head.weight.device, head.weight.dtype))
        return draft_vocab.subset_logits(head, hidden_states, self.draft_vocab_ids, self._draft_vocab_caches[0],
                                         prepared=not self.training)

    def _extend_block_for_mask_predictions(self, input_ids, position_ids):
        """z-lab DFlash layout (``anchor_predicts=False``, inference blocks only): the block
        ``[x0, MASK * (gamma - 1)]`` becomes ``[x0, MASK * gamma]`` at the next position, so that the
        gamma mask positions predict ``x_1..x_gamma`` (each its own token), exactly as z-lab drafts."""
        extra = torch.full_like(input_ids[:, :1], self.config.mask_token_id)
        return torch.cat([input_ids, extra], dim=1), torch.cat([position_ids, position_ids[:, -1:] + 1], dim=1)


def non_finite_parameters(model: nn.Module) -> list[str]:
    """Names of the floating-point parameters of ``model`` holding a NaN or an infinity.

    One ``aminmax`` per tensor (min and max propagate NaN, and an infinity is an extreme), so no
    tensor-sized temporary is made; the flags of each device are read back with one transfer.
    Parameters on the ``meta`` device hold no values and are skipped.
    """
    names: dict[torch.device, list[str]] = {}
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.device.type == "meta" or param.numel() == 0:
            continue
        low, high = torch.aminmax(param.detach())
        names.setdefault(param.device, []).append(name)
        flags.setdefault(param.device, []).append(torch.isfinite(low) & torch.isfinite(high))
    return [name for device in names for name, ok in zip(names[device], torch.stack(flags[device]).tolist())
            if not ok]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers spread evenly over ``[1, L - 3]`` (DFlash's rule), never the last layer.

    As many ids as draft layers, but at least 3 where the target has the layers, because a
    one-layer draft fed a single target layer sees too little of the target.
    """
    if num_target_layers < 2:
        raise ValueError("The target needs at least 2 layers (its last layer cannot feed the draft).")
    usable = num_target_layers - 1  # layers 0 .. L-2
    count = min(max(num_draft_layers, 3), usable)
    start, end = min(1, usable - 1), max(min(1, usable - 1), num_target_layers - 3)
    if count == 1:
        return [(start + end) // 2]
    ids = sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})
    if len(ids) < count:  # narrow targets: fall back to consecutive layers
        ids = list(range(usable - count, usable))
    return ids


# Users, pickles and Hub remote code name these classes by their public path, which is this very module
# (dspark_hf/modeling_dspark.py aliases it), so the move into model/ does not change what they print.
DSparkPreTrainedModel.__module__ = DSparkDraftModel.__module__ = "dspark_hf.modeling_dspark"

__all__ = ["DSparkDraftModel", "DSparkPreTrainedModel", "DraftBlockOutput", "DraftContextCache", "register_hub_upload",
           "default_target_layer_ids", "non_finite_parameters"]
