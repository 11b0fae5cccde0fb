"""``dspark-hf train``: a draft for any transformers causal LM, in one path of resumable stages.

1. **target**: ``--target`` (a preset, a folder or a Hub id) loaded and checked
   (:mod:`~dspark_hf.training.target_loading`);
2. **answers**: the prompts (``--prompts FILE`` or the built-in plan) answered by the target itself,
   half greedy and half sampled, with its chat template or as plain text, into shards of a data folder
   (:mod:`~dspark_hf.training.datagen`; or ``--corpus``: a finished data folder used as it is);
3. **features**: the target's hidden states, cached in chunks or recomputed per step
   (:mod:`~dspark_hf.training.features`, ``--features auto|cached|online``);
4. **training**: DSpark, or DFlash with ``markov_rank`` 0 (:func:`~dspark_hf.training.trainer.train`);
5. **calibration**: Sequential Temperature Scaling of the confidence head on held-out answers;
6. **card and export**: ``README.md`` in the draft folder and any ``--export-format`` layouts.

Every stage resumes: the plan, the answer shards and the feature chunks are reused when they match
(they are content-keyed caches), and training continues from its checkpoint with ``--resume``. Under
``accelerate launch`` or ``torchrun`` the processes split the answer shards, the feature chunks and
each step's global batch (:mod:`~dspark_hf.training.distributed`); the main process alone writes
what they share. Each stage's wall time goes to ``OUTPUT/stages.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging as std_logging
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from transformers.utils import logging

from ..cache_dir import default_cache_dir
from ..chat_text import has_chat_template
from ..model.modeling_dspark import DSparkDraftModel, default_target_layer_ids
from .calibration import calibrate_draft
from .data import load_corpus, sharegpt_reference_answers
from .datagen import FORMAT_VERSION, load_onpolicy_corpus, load_plan, prepare_folder, remove_stale_temporaries, run_datagen
from .distributed import Ranks, atomic_write_json
from .features import (FeatureSource, OnlineFeatures, build_feature_chunks, cache_estimate, choose_feature_mode,
                       chunk_paths, feature_dtype, forward_seconds_per_token, free_disk_bytes, load_feature_chunks)
from .prompts import BUILTIN_SOURCES, file_source_name, read_prompts_file
from .target_loading import LoadedTarget, check_target_head, parse_dtype, resolve_target, target_head
from .trainer import TrainingConfig, train

logger = logging.get_logger(__name__)

BUILTIN_DEFAULT_PROMPTS = 320  # the built-in plan holds ~10,000; today's default run answers this many


@dataclass
class PipelineOptions:
    """What ``dspark-hf train`` does besides the :class:`TrainingConfig` (see its ``--help``)."""

    output: str | None = None
    target: str = "smollm2"
    prompts: str | None = None
    num_prompts: int | None = None  # None: every prompt of --prompts, or BUILTIN_DEFAULT_PROMPTS of the plan
    sources: tuple[str, ...] = BUILTIN_SOURCES  # the built-in plan's sources, without --prompts
    corpus: str | None = None
    max_sequences: int | None = None
    reference_answers: int = 0
    data_dir: str | None = None
    feature_dir: str | None = None
    features: str = "auto"
    max_feature_cache_gb: float = 50.0
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256
    generation_batch_size: int = 16
    shard_size: int = 64
    seed: int = 0
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None
    max_time: float | None = None
    prepare_only: bool = False
    resume: bool = False
    fp16: bool = False
    export_formats: tuple[str, ...] = ()
    show_progress: bool = True


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[-60:] or "target"


class StageClock:
    """Wall time of each stage, logged and (main process, with an output folder) appended to ``stages.json``."""

    def __init__(self, output: Path | None, ranks: Ranks):
        self.output, self.ranks, self.stages = output, ranks, []

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.stages.append({"stage": name, "seconds": round(seconds, 3)})
        if self.ranks.is_main:
            logger.warning(f"Stage {name}: {seconds:.1f} s")
            if self.output is not None:
                path = self.output / "stages.json"
                runs = json.loads(path.read_text()) if path.exists() else []
                if not runs or runs[-1].get("finished"):
                    runs.append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "processes": self.ranks.world_size,
                                 "stages": []})
                runs[-1]["stages"] = self.stages
                atomic_write_json(path, runs)

    def finish(self) -> None:
        if self.ranks.is_main and self.output is not None and (self.output / "stages.json").exists():
            runs = json.loads((self.output / "stages.json").read_text())
            runs[-1]["finished"] = True
            atomic_write_json(self.output / "stages.json", runs)


# ---------------------------------------------------------------------------------- set-up
def _accelerator(opts: PipelineOptions, target_dtype: torch.dtype):
    """accelerate's Accelerator on ``--device`` (default: a GPU when there is one), with autocast to the
    target's half precision on GPUs; its process group is the one ``accelerate launch``/``torchrun`` set up."""
    from accelerate import Accelerator

    on_cpu = _device_choice(opts) == "cpu"
    precision = "no"
    if not on_cpu and target_dtype in (torch.bfloat16, torch.float16):
        precision = "bf16" if target_dtype == torch.bfloat16 else "fp16"
    return Accelerator(cpu=on_cpu, mixed_precision=precision)


def _device_choice(opts: PipelineOptions) -> str:
    if opts.device:
        return opts.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _process_device(opts: PipelineOptions) -> torch.device:
    """This process's device: the CPU, or the GPU accelerate gives this rank."""
    from accelerate import PartialState

    choice = _device_choice(opts)
    if choice.startswith("cuda:") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(choice))  # one process: the GPU named; several: accelerate's per rank
    # Generous: the other processes wait at barriers while the main one calibrates and exports, or
    # while the slowest finishes its share of a stage (the default is 30 minutes).
    return PartialState(cpu=choice == "cpu", timeout=timedelta(hours=6)).device


def check_export_formats(formats) -> None:
    """Refuses an unknown ``--export-format`` before any work (the names are dspark_hf.hub's)."""
    from ..hub import FORMATS

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--export-format {', '.join(unknown)}: not a layout dspark_hf.hub.export writes; choose from "
                         f"{', '.join(FORMATS)}.")


# ---------------------------------------------------------------------------------- answers
def _answers(opts: PipelineOptions, loaded: LoadedTarget, ranks: Ranks) -> tuple[list[dict], dict]:
    """The on-policy records (and reference answers), and what the card says about them."""
    tokenizer = loaded.tokenizer
    if opts.corpus:  # a finished data folder: its shards as they are, nothing generated
        records = load_onpolicy_corpus(opts.corpus)[: opts.max_sequences]
        facts = {"data": f"{len(records)} answers of the target from {opts.corpus}"}
        return records + _reference(opts, tokenizer, [p["text"] for p in load_plan(opts.corpus)], ranks), facts
    prompts = read_prompts_file(opts.prompts) if opts.prompts else None
    config = {"model": loaded.name, "sources": [file_source_name(opts.prompts)] if opts.prompts else list(opts.sources),
              "seed": opts.seed, "max_prompt_tokens": opts.max_prompt_tokens, "max_new_tokens": opts.max_new_tokens,
              "batch_size": opts.generation_batch_size, "shard_size": opts.shard_size,
              "prompt_format": "chat template" if has_chat_template(tokenizer) else "plain text"}
    folder = Path(opts.data_dir) if opts.data_dir else (
        default_cache_dir() / "answers" / f"{_slug(loaded.name)}-{_digest(config)}")
    if ranks.is_main:
        try:
            prepare_folder(folder, tokenizer, config, prompts=prompts)
        except ValueError as error:  # made with other settings: name the way out
            raise ValueError(f"{error} (--data-dir)") from None
        remove_stale_temporaries(folder)  # before any process writes its shards
    ranks.barrier()
    plan = load_plan(folder)
    wanted = opts.num_prompts or (len(plan) if opts.prompts else BUILTIN_DEFAULT_PROMPTS)
    count = min(wanted, len(plan))
    if count < wanted:
        logger.warning(f"Answers: {wanted} prompts asked for, the plan holds {count} (prompts longer than "
                       f"--max-prompt-tokens {opts.max_prompt_tokens} are dropped).")
    # Whole shards only: a shard's records then never depend on how many prompts a run asked for.
    whole = min(len(plan), math.ceil(count / opts.shard_size) * opts.shard_size)
    logger.warning(f"Answers: {count} prompts ({config['prompt_format']}) in {folder}, "
                   f"{ranks.world_size} process(es) sharing {math.ceil(whole / opts.shard_size)} shard(s).")
    run_datagen(loaded.model, tokenizer, folder, plan, {**config, "format_version": FORMAT_VERSION}, max_prompts=whole,
                show_progress=opts.show_progress and ranks.is_main, rank=ranks.rank, world_size=ranks.world_size)
    ranks.barrier()
    records = load_onpolicy_corpus(folder)[:count]
    source = f"prompts of {Path(opts.prompts).name}" if opts.prompts else "prompts of the built-in plan"
    facts = {"data": f"{count} {source} answered by the target ({config['prompt_format']}; even-numbered greedy, "
                     f"odd sampled at temperature 1), at most {opts.max_new_tokens} new tokens"}
    return records + _reference(opts, tokenizer, [p["text"] for p in plan], ranks, folder), facts


def _reference(opts: PipelineOptions, tokenizer, planned: list[str], ranks: Ranks, folder: Path | None = None):
    """ShareGPT conversations with their original answers (``--reference-answers``), after the target's own."""
    if not opts.reference_answers:
        return []
    path = (folder or default_cache_dir() / "data") / f"sharegpt_reference.n{opts.reference_answers}.jsonl"
    if ranks.is_main:
        sharegpt_reference_answers(tokenizer, opts.reference_answers, path, exclude_prompts=set(planned),
                                   max_answer_tokens=opts.max_new_tokens)
    ranks.barrier()
    return load_corpus(path)


# ---------------------------------------------------------------------------------- features
def _feature_folder(opts: PipelineOptions, loaded: LoadedTarget) -> Path:
    if opts.feature_dir:
        return Path(opts.feature_dir)
    model = loaded.model
    weights = model.get_output_embeddings().weight
    # a cheap fingerprint of the weights: a retrained target saved in the same folder gets a new cache
    identity = [loaded.name, str(model.dtype), model.num_parameters(), float(weights.flatten()[:4096].double().sum())]
    return default_cache_dir() / "features" / f"{_slug(loaded.name)}-{_digest(identity)}"


def _features(opts: PipelineOptions, cfg: TrainingConfig, loaded: LoadedTarget, records: list[dict],
              ranks: Ranks) -> tuple[FeatureSource, str]:
    target = loaded.model
    with_lse = bool(cfg.draft_vocab_size)
    hidden = target.config.get_text_config().hidden_size
    estimate = cache_estimate(records, cfg.target_layer_ids, hidden, cfg.max_seq_len, with_target_lse=with_lse)
    folder = _feature_folder(opts, loaded)
    paths = chunk_paths(folder, records, cfg.target_layer_ids, cfg.max_seq_len, opts.shard_size, feature_dtype(target))
    decision = None
    if ranks.is_main:
        on_disk = sum(p.stat().st_size for p in paths if p.exists())
        needed = max(0, estimate["bytes"] - on_disk)
        mode, why = choose_feature_mode(opts.features, needed, opts.max_feature_cache_gb * 1e9, free_disk_bytes(folder))
        seconds_per_token = forward_seconds_per_token(target, records, cfg.target_layer_ids, cfg.max_seq_len)
        mean_tokens = estimate["tokens"] / max(1, len(records))
        online_forwards = cfg.max_steps * cfg.sequences_per_step
        logger.warning(
            f"Features for {len(records)} sequences, {estimate['tokens']:,} tokens "
            f"({len(cfg.target_layer_ids)} layers + the final hidden state, width {hidden}). "
            f"Cached: {estimate['bytes'] / 1e9:.3f} GB on disk ({estimate['bytes_per_token'] / 1e3:.1f} KB per token; "
            f"{on_disk / 1e9:.3f} GB already there) and ~{estimate['tokens'] * seconds_per_token:.0f} s of target "
            f"forwards once. Online: no disk, ~{online_forwards * mean_tokens * seconds_per_token:.0f} s of target "
            f"forwards over {cfg.max_steps} steps x {cfg.sequences_per_step} sequences (measured "
            f"{seconds_per_token * 1e3:.3f} ms per token). Using {mode}: {why}.")
        decision = (mode, why)
    mode, _ = ranks.broadcast(decision)
    if mode == "online":
        return OnlineFeatures(target, records, cfg.target_layer_ids, cfg.max_seq_len,
                              head=target_head(target) if with_lse else None), mode
    build_feature_chunks(target, records, cfg.target_layer_ids, folder, cfg.max_seq_len, opts.shard_size, ranks=ranks,
                         head=target_head(target) if with_lse else None,
                         show_progress=opts.show_progress)
    return load_feature_chunks(paths, with_target_lse=with_lse), mode


# ---------------------------------------------------------------------------------- the run
def run_pipeline(opts: PipelineOptions, cfg: TrainingConfig) -> DSparkDraftModel | None:
    """Runs every stage (see the module docstring) and returns the trained draft (None with ``prepare_only``).

    ``cfg`` is completed here: ``seed`` from ``opts``, the target's layers and, for a preset, its
    mask token. Raises ``ValueError`` naming the problem and the fix for bad inputs.
    """
    started = time.monotonic()
    if not opts.prepare_only and not opts.output:
        raise ValueError("--output is required unless --prepare-only.")
    check_export_formats(opts.export_formats)
    unknown = [name for name in opts.sources if name not in BUILTIN_SOURCES]
    if unknown:
        raise ValueError(f"--sources {','.join(unknown)}: no such built-in prompt source; choose from "
                         f"{','.join(BUILTIN_SOURCES)}, or give your own prompts with --prompts FILE.")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    output = Path(opts.output) if opts.output else None
    device = _process_device(opts)
    ranks = Ranks.current()
    if not ranks.is_main:  # one process tells the story; the others speak only of errors
        std_logging.getLogger("dspark_hf").setLevel(std_logging.ERROR)
    clock = StageClock(output, ranks)
    with clock("target"):
        loaded = resolve_target(opts.target, dtype=parse_dtype(opts.dtype), device=device)
        target = loaded.model
        vocab = target.config.get_text_config().vocab_size
        check_target_head(target, [(i * 7 + 1) % vocab for i in range(16)], opts.target)
    accelerator = _accelerator(opts, target.dtype)
    cfg.seed = opts.seed
    if cfg.mask_token_id is None:
        cfg.mask_token_id = loaded.mask_token_id
    if cfg.target_layer_ids is None:
        cfg.target_layer_ids = default_target_layer_ids(target.config.get_text_config().num_hidden_layers,
                                                        cfg.num_hidden_layers)
    with clock("answers"):
        records, data_facts = _answers(opts, loaded, ranks)
    # held out with or without a confidence head, so a DSpark and a DFlash run on one corpus train on the same data
    held = cfg.held_out_sequences
    if len(records) <= held:
        raise ValueError(f"{len(records)} training sequences and {held} held out for calibration leave none to train "
                         "on; answer more prompts (--num-prompts) or hold out fewer (--held-out).")
    with clock("features"):
        source, mode = _features(opts, cfg, loaded, records, ranks)
    if opts.prepare_only:
        clock.finish()
        return None
    deadline = started + opts.max_time if opts.max_time else None
    with clock("training"):
        draft = train(target, source.subset(range(held, len(records))), cfg, output, resume=opts.resume,
                      deadline=deadline, accelerator=accelerator, show_progress=opts.show_progress)
    if ranks.is_main:
        progress = json.loads((output / "training_progress.json").read_text())
        facts = {"target": loaded.name, "method": "DSpark" if cfg.markov_rank > 0 else "DFlash", **data_facts,
                 "training": f"{progress['steps_done']} of {cfg.max_steps} steps x {cfg.sequences_per_step} sequences, "
                             f"learning rate {cfg.learning_rate}, seed {cfg.seed}, {ranks.world_size} process(es)",
                 "features": mode,
                 "command": "dspark-hf train (docs/training.md)"}
        with clock("calibration"):
            if draft.confidence_head is not None and held:
                report = calibrate_draft(draft, target, source.subset(range(held)).items(), output)
                facts["calibration"] = (f"STS on {held} held-out answers, mean ECE "
                                        f"{sum(report['ece_before']) / len(report['ece_before']):.3f} -> "
                                        f"{sum(report['ece_after']) / len(report['ece_after']):.3f}")
        with clock("card and export"):
            _save_card_and_exports(opts, loaded, draft, output, facts)
    ranks.barrier()
    clock.finish()
    return draft


def _save_card_and_exports(opts: PipelineOptions, loaded: LoadedTarget, draft: DSparkDraftModel, output: Path,
                           facts: dict) -> None:
    from ..hub import export, render_model_card

    if opts.fp16:
        draft.half()
    draft.save_pretrained(output)
    (output / "README.md").write_text(render_model_card(output, base_model=loaded.base_model, training=facts),
                                      encoding="utf-8")
    for fmt in opts.export_formats:
        folder = export(draft, output / "export" / fmt, format=fmt, target=loaded.model, training=facts,
                        base_model=loaded.base_model)
        logger.warning(f"Exported the draft ({fmt} layout) to {folder}.")


__all__ = ["BUILTIN_DEFAULT_PROMPTS", "PipelineOptions", "StageClock", "check_export_formats", "run_pipeline"]
