"""Routes ``generate(..., assistant_model=<DSpark draft>)`` to :class:`DSparkCandidateGenerator`.

transformers has no registration hook for candidate generators: ``GenerationMixin.
_get_candidate_generator`` is a fixed if/elif chain. :func:`install_dspark_dispatch` wraps it and
three other private methods, once, each with its own ``wrap_*`` function, and every wrapper only
acts when the assistant's config is a DSpark/DFlash draft config (recognised by content, since Hub
remote code makes other class objects). Every other call goes to the original method unchanged.
Batch-1 sampled rounds are verified by :mod:`dspark_hf.decoding.verification` (one draw a round
instead of transformers' ``torch.multinomial`` at every position).
"""

from __future__ import annotations

import functools
import inspect

import transformers
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

from ..model.configuration_dspark import is_dspark_config
from .settings import dspark_kwargs_of_call, mark_call_settings, refuse_lossy_settings
from ..scheduling.shared_cost import profile_rewrites_per_call
from .stopping import DeferredStreamer, ExactStopping, cut_output, positional_criteria
from .verification import dspark_sampled_verification, install_sampled_verification

_EXPECTED_PARAMETERS = (
    "generation_config",
    "input_ids",
    "inputs_tensor",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
)
_MARKER = "_dspark_dispatch"


def _check_transformers_api() -> None:
    """Fails loudly if the private API the dispatch relies on has changed."""
    problems = []
    original = getattr(GenerationMixin, "_get_candidate_generator", None)
    if original is None:
        problems.append("GenerationMixin._get_candidate_generator is gone")
    else:
        params = inspect.signature(original).parameters
        missing = [p for p in _EXPECTED_PARAMETERS if p not in params]
        if missing:
            problems.append(f"_get_candidate_generator lacks parameters {missing}")
    if not hasattr(CandidateGenerator, "requires_model_outputs"):
        problems.append("CandidateGenerator.requires_model_outputs is missing")
    prepare = getattr(GenerationMixin, "_prepare_generation_config", None)
    if prepare is None or "generation_config" not in inspect.signature(prepare).parameters:
        problems.append("GenerationMixin._prepare_generation_config(generation_config, **kwargs) changed")
    if not hasattr(GenerationMixin, "_assisted_decoding"):
        problems.append("GenerationMixin._assisted_decoding is gone")
    validate = getattr(GenerationMixin, "_validate_generation_mode", None)
    if validate is None or "generation_mode_kwargs" not in inspect.signature(validate).parameters:
        problems.append("GenerationMixin._validate_generation_mode(generation_mode_kwargs=...) changed")
    if problems:
        raise RuntimeError(
            f"dspark_hf cannot hook into transformers {transformers.__version__}: {'; '.join(problems)}. "
            "Install a supported version: pip install 'transformers>=5.24,<6'."
        )


def _as_dspark_draft(assistant_model):
    """The assistant if it is a DSpark/DFlash draft, else None; a DSpark config on another class is an error."""
    if assistant_model is None or not is_dspark_config(assistant_model.config):
        return None
    if not hasattr(assistant_model, "add_context"):
        raise ValueError(
            f"assistant_model is a {type(assistant_model).__name__} with a DSpark/DFlash config, not a DSpark draft. "
            "Load it with dspark_hf.DSparkDraftModel.from_pretrained(...) instead of AutoModel/AutoModelForCausalLM."
        )
    return assistant_model


def _check_inputs_embeds(input_ids, model_kwargs: dict) -> None:
    """Refuses the ``inputs_embeds`` prompts DSpark generation cannot reproduce exactly."""
    embeds = model_kwargs.get("inputs_embeds")
    if embeds is None:
        return
    if input_ids.shape[0] > 1:
        # The batched loop runs its own prefill from input_ids; embeddings would be ignored.
        raise ValueError(
            f"Batched DSpark generation (batch size {input_ids.shape[0]}) takes the prompts as input_ids, but "
            "inputs_embeds was passed. Pass input_ids with an attention_mask, or generate one prompt at a time "
            "with inputs_embeds."
        )
    mask = model_kwargs.get("attention_mask")
    if embeds.shape[1] > input_ids.shape[1] and mask is not None and not bool(mask.all()):
        # transformers' assisted loop sizes the attention mask by input_ids, which leave out the
        # embedded prompt: with padding in it, the mask would no longer line up with the cache.
        raise ValueError(
            "DSpark generation from inputs_embeds needs a prompt without padding, but the attention_mask has "
            "padded positions. Remove the padding from inputs_embeds, or pass the prompt as input_ids."
        )


def _check_attention_outputs(target, generation_config) -> None:
    """Refuses ``output_attentions`` without eager attention: transformers' assisted loop indexes
    the verify forward's attention weights, which sdpa and flash attention do not return (an
    IndexError there, with or without DSpark)."""
    implementation = getattr(target.config, "_attn_implementation", None)
    if generation_config.output_attentions and implementation != "eager":
        raise ValueError(
            f"output_attentions=True needs attention weights, which the target's {implementation!r} attention does "
            "not return. Load the target with attn_implementation=\"eager\" (or call "
            "target.set_attn_implementation(\"eager\")), or drop output_attentions."
        )


# ----------------------------------------------------------------------------- one wrapper per method
def wrap_prepare_generation_config(original):
    """``_prepare_generation_config``: DSpark's ``generate()`` settings (``dspark_verify_policy``,
    ...) go onto the call's generation config, and which assisted-generation fields the call set
    explicitly is recorded (:func:`~dspark_hf.decoding.settings.mark_call_settings`)."""

    @functools.wraps(original)
    def _prepare_generation_config(self, generation_config=None, **kwargs):
        # DSpark's settings are not GenerationConfig fields: transformers would pass them to the model.
        dspark_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("dspark_")}
        config, model_kwargs = original(self, generation_config, **kwargs)
        mark_call_settings(config, dspark_kwargs, kwargs, generation_config, getattr(self, "generation_config", None))
        return config, model_kwargs

    return _prepare_generation_config


def wrap_validate_generation_mode(original):
    """``_validate_generation_mode``: a mismatched draft, beam search or a lossy setting fails with
    DSpark's own message before transformers' generic tokenizer check; DSpark settings without a
    DSpark draft are refused."""

    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs, *args, **kwargs):
        draft = _as_dspark_draft(generation_mode_kwargs.get("assistant_model"))
        passed = dspark_kwargs_of_call(generation_config)
        if draft is None and passed:
            raise ValueError(
                f"{passed} are DSpark settings, but this generate() call has no DSpark draft as assistant_model. "
                f"Pass assistant_model=<a DSparkDraftModel>, or drop {passed}."
            )
        if draft is not None:
            if generation_mode != GenerationMode.ASSISTED_GENERATION:
                # transformers would drop the assistant with a warning and run another mode.
                raise ValueError(
                    f"DSpark generation supports greedy decoding and sampling, but these settings select "
                    f"{generation_mode} (num_beams={generation_config.num_beams}). Use num_beams=1 and no "
                    "other decoding strategy, or drop assistant_model. DSpark does not support beam search."
                )
            draft.check_target(self)
            refuse_lossy_settings(generation_config, draft)
        return original(self, generation_mode, generation_config, generation_mode_kwargs, *args, **kwargs)

    return _validate_generation_mode


def wrap_get_candidate_generator(original):
    """``_get_candidate_generator``: a DSpark draft gets :class:`DSparkCandidateGenerator`."""

    @functools.wraps(original)
    def _get_candidate_generator(
        self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model=None, **kwargs
    ):
        if _as_dspark_draft(assistant_model) is not None:
            from .candidate_generator import DSparkCandidateGenerator

            return DSparkCandidateGenerator(assistant_model, self, generation_config=generation_config,
                                            logits_processor=logits_processor, batch_size=input_ids.shape[0])
        return original(self, generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
                        logits_processor=logits_processor, model_kwargs=model_kwargs,
                        assistant_model=assistant_model, **kwargs)

    return _get_candidate_generator


def wrap_assisted_decoding(original):
    """``_assisted_decoding``: with a DSpark draft, batch size 1 runs transformers' loop with exact
    stopping (:func:`_decode_one`), batch size > 1 runs :func:`dspark_hf.decoding.batched.batched_dspark_generate`
    instead of transformers' refusal (:func:`_decode_batch`); both inside one
    :func:`~dspark_hf.scheduling.step_rates.profile_rewrites_per_call` scope (the call)."""

    @functools.wraps(original)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config,
                           synced_gpus=False, streamer=None, inputs_tensor=None, assistant_model=None, **model_kwargs):
        draft = _as_dspark_draft(assistant_model)
        if draft is None:
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model, **model_kwargs)
        _check_dspark_call(self, input_ids, generation_config, model_kwargs)
        # A drifting live cost model rewrites its cache file once, when this call ends.
        with profile_rewrites_per_call():
            if input_ids.shape[0] == 1:
                with dspark_sampled_verification():  # sampled rounds drawn once each (verification.py)
                    return _decode_one(original, self, input_ids, logits_processor, stopping_criteria,
                                       generation_config, synced_gpus, streamer, inputs_tensor, assistant_model,
                                       model_kwargs)
            return _decode_batch(self, draft, input_ids, logits_processor, stopping_criteria, generation_config,
                                 streamer, model_kwargs)

    return _assisted_decoding


def _check_dspark_call(target, input_ids, generation_config, model_kwargs: dict) -> None:
    """Refuses what DSpark decoding cannot run exactly: no KV cache, some ``inputs_embeds``
    prompts, attention outputs without eager attention (batch size 1)."""
    if not generation_config.use_cache:
        raise ValueError(
            "DSpark generation verifies drafts against the target's KV cache, but use_cache=False was passed. "
            "Drop use_cache=False (or set use_cache=True) when passing a DSpark assistant_model."
        )
    _check_inputs_embeds(input_ids, model_kwargs)
    if input_ids.shape[0] == 1:
        _check_attention_outputs(target, generation_config)


def _decode_one(original, target, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                streamer, inputs_tensor, assistant_model, model_kwargs: dict):
    """Batch size 1: transformers' assisted loop with :class:`DSparkCandidateGenerator`. Its loop
    checks the stopping criteria only on the end of each accepted block; this checks every
    position a round added, ends the loop at the first that fires and cuts the output there."""
    positional = positional_criteria(stopping_criteria, generation_config)
    if not positional:  # EOS, length and time only: the loop already stops exactly
        return original(target, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                        streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model, **model_kwargs)
    prompt_len = input_ids.shape[1]
    deferred = DeferredStreamer(streamer) if streamer is not None else None
    exact = ExactStopping(stopping_criteria, positional, prompt_len, deferred)
    output = original(target, input_ids, logits_processor, StoppingCriteriaList([exact]), generation_config,
                      synced_gpus, deferred, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
                      **model_kwargs)
    if exact.stop_length is None:
        return output
    return cut_output(output, exact.stop_length, prompt_len)


def _decode_batch(target, draft, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                  model_kwargs: dict):
    """Batch size > 1: DSpark's own batched loop; the output has the shape plain ``generate`` gives."""
    from .batched import batched_dspark_generate, check_batched_support

    check_batched_support(logits_processor, generation_config, streamer)
    sequences = batched_dspark_generate(target, draft, input_ids, model_kwargs.get("attention_mask"),
                                        logits_processor, generation_config, stopping_criteria)
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


# The GenerationMixin methods the dispatch wraps, each with the function that wraps it.
_WRAPPERS = (
    ("_prepare_generation_config", wrap_prepare_generation_config),
    ("_validate_generation_mode", wrap_validate_generation_mode),
    ("_get_candidate_generator", wrap_get_candidate_generator),
    ("_assisted_decoding", wrap_assisted_decoding),
)


def install_dspark_dispatch() -> None:
    """Installs the DSpark dispatch into transformers' generation (idempotent; run on import).

    Four private methods of ``GenerationMixin`` are wrapped, each by its ``wrap_*`` function above;
    a method already wrapped is left alone, and each wrapper keeps the original in
    ``__wrapped_original__``. transformers' ``_speculative_sampling`` is routed to DSpark's
    verification inside batch-1 DSpark calls (:func:`~dspark_hf.decoding.verification.install_sampled_verification`).
    """
    install_sampled_verification()
    pending = [(name, wrap) for name, wrap in _WRAPPERS if not getattr(getattr(GenerationMixin, name), _MARKER, False)]
    if not pending:
        return
    _check_transformers_api()
    for name, wrap in pending:
        original = getattr(GenerationMixin, name)
        wrapper = wrap(original)
        setattr(wrapper, _MARKER, True)
        wrapper.__wrapped_original__ = original
        setattr(GenerationMixin, name, wrapper)


def is_dspark_dispatch_installed() -> bool:
    """Whether every method the dispatch wraps is wrapped."""
    return all(getattr(getattr(GenerationMixin, name), _MARKER, False) for name, _ in _WRAPPERS)


__all__ = ["install_dspark_dispatch", "is_dspark_dispatch_installed"]
