"""Model cards (``README.md``) for exported DSpark drafts.

:func:`render_model_card` reads the facts of a draft folder written by :func:`dspark_hf.hub.export`
(``config.json`` and the safetensors headers), adds measured accepted lengths when given (never
estimated ones) and fills the templates in ``dspark_hf/hub/templates/`` (``model_card.md`` with
``card_usage_hf.md`` or ``card_usage_deepspec.md``). ``model_cards/render_card.py`` is its command
line.
"""

from __future__ import annotations

import json
import math
import os
import string
from pathlib import Path

from ..model.checkpoint_formats import checkpoint_format
from .template_files import read_template
from .vllm_export import VLLM_VERSION, vllm_compatibility, vllm_serve_command

CARD_TAGS = ["dspark", "speculative-decoding", "draft-model", "dflash"]


def _read_folder_facts(folder: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """``config.json`` and the weight shapes (from the safetensors headers) of a draft folder."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return config, shapes


def _check_measured(measured: dict) -> None:
    if not isinstance(measured, dict) or not isinstance(measured.get("setup"), str) or not measured["setup"].strip():
        raise ValueError("measured needs a non-empty 'setup' string (hardware, dtype, temperature, prompts, lengths).")
    results = measured.get("results")
    if not isinstance(results, dict) or not results:
        raise ValueError("measured needs 'results': {method: {benchmark: tau}} with at least one method.")
    for method, row in results.items():
        if not isinstance(row, dict) or not row:
            raise ValueError(f"measured['results'][{method!r}] must be a non-empty {{benchmark: tau}} dict.")
        for bench, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(
                    f"measured['results'][{method!r}][{bench!r}] = {value!r} is not a measured number; "
                    "leave a benchmark out rather than filling it in."
                )


def _tau_table(measured: dict | None) -> str:
    if measured is None:
        return (
            "_Not measured yet._ This section is filled from benchmark runs "
            "(`render_model_card(folder, measured=...)`); numbers are never estimated."
        )
    _check_measured(measured)
    results = measured["results"]
    benchmarks = list(measured.get("benchmarks") or [])
    for row in results.values():
        benchmarks += [b for b in row if b not in benchmarks]
    lines = [
        "| method | " + " | ".join(benchmarks) + " |",
        "|---|" + "---:|" * len(benchmarks),
    ]
    for method, row in results.items():
        cells = [f"{row[b]:.2f}" if b in row else "–" for b in benchmarks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + f"\n\nSetup: {measured['setup'].strip()}"
    if measured.get("source"):
        text += f"\n\nSource: {measured['source']}"
    return text


def _training_section(training: dict | None) -> str:
    if not training:
        return "_Training details for this draft are not recorded here._"
    return "\n".join(f"- **{key}**: {value}" for key, value in training.items())


def _vllm_serving(config: dict, draft_source: str, target_id: str, block_size: int) -> str:
    """The card's vLLM paragraph: the export and serve commands when vLLM serves the draft, else why not."""
    reason = vllm_compatibility(config)
    needs_drop = reason is not None and vllm_compatibility(config, drop_confidence_temperatures=True) is None
    if reason is not None and not needs_drop:
        return f"**vLLM.** {reason}"
    if needs_drop:
        intro = (f"**vLLM** {VLLM_VERSION} does not read this draft's calibration (`confidence_temperatures`): its "
                 "adaptive verification would schedule from uncalibrated confidences. To serve the draft anyway, export "
                 "it without them (drafting is unchanged) and serve the folder:")
    else:
        intro = (f"**vLLM** {VLLM_VERSION} serves this draft with its `Qwen3DSparkForCausalLM` class from the folder "
                 "that `format=\"vllm\"` writes:")
    flag = " --drop-confidence-temperatures" if needs_drop else ""
    commands = (f"```bash\ndspark-hf export {draft_source} my-draft-vllm --format vllm --target {target_id}{flag}\n"
                f"{vllm_serve_command(target_id, 'my-draft-vllm', block_size)}\n```")
    notes = [f"dspark_hf checks that folder against vLLM {VLLM_VERSION}'s source (loader, config fields, weight names "
             "and shapes); it has not run vLLM. The export also checks that vLLM runs the target with the auxiliary "
             "hidden states the draft reads."]
    if config.get("enable_confidence_head", False):
        notes.append("vLLM verifies the whole block unless the speculative config adds "
                     "`\"enable_adaptive_verification\": true`, which schedules verification from the confidence head "
                     "(run in fp32, without temperatures).")
    else:
        notes.append("This draft has no confidence head: vLLM verifies the whole block, as dspark_hf does.")
    if not config.get("markov_rank"):
        notes.append("The vLLM folder has a rank-1 Markov head of zeros (vLLM's class always builds one); it adds "
                     "nothing to the logits.")
    if config.get("draft_vocab_size"):
        notes.append(f"The reduced vocabulary is written as vLLM's `d2t` offsets and a {config['draft_vocab_size']:,}"
                     "-row `lm_head`.")
    return f"{intro}\n\n{commands}\n\n" + " ".join(notes)


def _sglang_serving(config: dict, target_id: str) -> str:
    """The card's SGLang paragraph: the DeepSpec-layout command, or why that layout cannot hold the draft."""
    blocker = None
    if config.get("draft_vocab_size"):
        blocker = "has no field for this draft's reduced vocabulary"
    elif not config.get("anchor_predicts", True):
        blocker = "has no field for drafts made at the mask positions (anchor_predicts=False)"
    elif any(t != "full_attention" for t in config.get("layer_types") or []):
        blocker = "drafts with full attention only, and this draft has sliding-window layers"
    if blocker is not None:
        return (f"**SGLang** reads the DeepSpec layout, which {blocker}, so `format=\"deepspec\"` refuses this draft; "
                "dspark_hf has no SGLang route for it.")
    return ("**SGLang** reads the DeepSpec layout (`config.json` with `model_type: \"qwen3\"`, `architectures: "
            "[\"Qwen3DSparkModel\"]`, embedding and LM-head copies), which `dspark_hf.hub.export(draft, folder, "
            "format=\"deepspec\", target=target)` writes. This command is not tested by dspark_hf: check the flag "
            "names against your SGLang version.\n\n"
            f"```bash\npython -m sglang.launch_server --model-path {target_id} \\\n"
            "  --speculative-algorithm DSPARK --speculative-draft-model-path <deepspec-draft-folder-or-repo>\n```")


def render_model_card(
    draft_folder: str | os.PathLike,
    measured: dict | None = None,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    training: dict | None = None,
    license: str = "apache-2.0",
    template: str | os.PathLike | None = None,
) -> str:
    """A ``README.md`` model card for an exported draft folder (``"hf"`` or ``"deepspec"`` layout).

    Facts (layers, block size, heads, target layers, parameters, dtype) are read from the folder's
    ``config.json`` and safetensors headers. Hub metadata: ``license``, ``library_name:
    transformers``, ``base_model`` (when given), ``pipeline_tag: text-generation``, ``tags``.

    Args:
        measured: measured accepted lengths, or ``None`` for a "not measured yet" section. Shape:
            ``{"setup": "<hardware, dtype, temperature, prompts, lengths>", "results": {method:
            {benchmark: tau}}, "benchmarks": [column order] (optional), "source": "<where the numbers
            come from>" (optional)}``. Values must be real numbers; a missing benchmark is left out.
        base_model: the target's Hub id.
        repo_id: the draft's Hub id, used in the snippets (a placeholder when ``None``).
        training: facts of this draft's training run (rendered as a list), or ``None``.
        template: another card template (``string.Template`` syntax, same placeholders).
    """
    from huggingface_hub import ModelCardData

    folder = Path(draft_folder)
    config, shapes = _read_folder_facts(folder)
    fmt = checkpoint_format(config)
    if fmt not in ("dspark", "deepspec"):
        raise ValueError(f"{folder} is not a DSpark draft folder written by dspark_hf.hub.export (format {fmt}).")
    layout = "deepspec" if fmt == "deepspec" else "hf"
    markov_rank = int(config.get("markov_rank", 0))
    confidence = bool(config.get("enable_confidence_head", False))
    anchor_predicts = bool(config.get("anchor_predicts", True))
    method = "DSpark" if markov_rank > 0 or confidence else "DFlash"
    tags = list(CARD_TAGS) + (["custom_generate"] if layout == "hf" else ["deepspec"])
    metadata = ModelCardData(
        license=license,
        library_name="transformers",
        base_model=base_model,
        pipeline_tag="text-generation",
        tags=tags,
    ).to_yaml()
    block_size = int(config["block_size"])
    own_embeddings = "embed_tokens.weight" in shapes and "lm_head.weight" in shapes
    params = sum(math.prod(shape) for key, shape in shapes.items() if key != "draft_vocab_ids")  # ids: not weights
    facts = [
        ("Layout", "transformers (`model_type: dspark`, remote code)" if layout == "hf"
         else "DeepSpec (`model_type: qwen3`, `Qwen3DSparkModel`)"),
        ("Draft layers", config.get("num_hidden_layers")),
        ("Hidden size / vocabulary", f"{config.get('hidden_size')} / {config.get('vocab_size')}"),
        ("Draft tokens per round (`block_size`)", block_size),
        ("Drafted positions", "anchor + masks (DSpark)" if anchor_predicts else "mask positions (z-lab DFlash)"),
        ("Serial head", f"Markov, {config.get('markov_head_type')}, rank {markov_rank}" if markov_rank
         else "none (DFlash)"),
        ("Confidence head", ("yes" + (", calibrated" if config.get("confidence_temperatures") else ", uncalibrated"))
         if confidence else "no (the whole block is verified)"),
        ("Target layers read", f"{config.get('target_layer_ids')} of {config.get('num_target_layers')}"),
        ("Mask token id", config.get("mask_token_id")),
        ("Embedding / LM head", "stored (copies of the target's)" if own_embeddings else "borrowed from the target"),
        *([("Draft vocabulary", f"{config['draft_vocab_size']:,} of the {config.get('vocab_size'):,} target tokens "
            "(`draft_vocab_ids`); the others get draft probability 0 and still come from the target")]
          if config.get("draft_vocab_size") else []),
        ("Parameters stored", f"{params:,}"),
        ("Weights dtype", config.get("dtype") or config.get("torch_dtype")),
    ]
    if method == "DSpark":
        recipe = (
            "Method (DSpark paper, section 3.3): the target is frozen and the draft shares its embedding and LM "
            "head. Random anchors per sequence form blocks of `block_size` positions; the loss is 0.1 · cross-entropy "
            "+ 0.9 · total variation against the target's distribution + 1.0 · binary cross-entropy of the confidence "
            "head against `1 - ½‖p_draft − p_target‖₁`, each position weighted by `exp(−(k−1)/block_size)`. "
            "Confidences may then be calibrated by Sequential Temperature Scaling."
        )
    else:
        recipe = "This draft has no serial head and no confidence head; see the DFlash paper (arXiv:2602.06036) for its recipe."
    if method == "DSpark":
        description = (
            "DSpark adds to the DFlash parallel draft a light serial sampling loop (a low-rank Markov bias "
            "from the token just drawn) and a confidence head whose per-position acceptance estimates let a "
            "profiled scheduler verify only the prefix of the block that pays off on the running hardware."
        )
    else:
        description = "A DFlash parallel draft: one forward drafts the whole block, which the target verifies in full."
    shown_base = base_model or "<target-model-id>"
    values = {
        "metadata": metadata.strip(),
        "title": f"{repo_id.split('/')[-1] if repo_id else folder.name}: {method} draft"
        + (f" for {base_model}" if base_model else ""),
        "method": method,
        "method_description": description,
        "base_model": shown_base,
        "base_model_ref": f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model
        else "its target model (not recorded in this card)",
        "repo_id": repo_id or "<org>/<this-draft-repo>",
        "block_size": block_size,
        "facts_table": "\n".join(f"| {k} | {v} |" for k, v in facts),
        "training": _training_section(training),
        "method_recipe": recipe,
        "tau_table": _tau_table(measured),
    }
    values["vllm_serving"] = _vllm_serving(config, values["repo_id"], shown_base, block_size)
    values["sglang_serving"] = _sglang_serving(config, shown_base)
    usage = string.Template(read_template(f"card_usage_{layout}.md")).substitute(values)
    text = Path(template).read_text(encoding="utf-8") if template is not None else read_template("model_card.md")
    return string.Template(text).substitute(values, usage=usage.strip())


__all__ = ["CARD_TAGS", "render_model_card"]
