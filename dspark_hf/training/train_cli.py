"""``dspark-hf train`` / ``python -m dspark_hf.training``: make a DSpark (or DFlash) draft for a target.

    dspark-hf train --target Qwen/Qwen3-0.6B --output drafts/qwen3-0.6b-dspark --max-time 2h
    dspark-hf train --target ./my-model --prompts prompts.jsonl --output drafts/mine --export-format hf
    accelerate launch -m dspark_hf.training --target ./my-model --output drafts/mine   # several processes

Stages (docs/training.md): the target's own answers to the prompts -> the target's features (cached
or recomputed per step) -> training -> Sequential Temperature Scaling of the confidence head -> the
draft folder with a model card, and the --export-format layouts. Without --target the target is
SmolLM2-135M-Instruct (the preset ``smollm2``), as before this option existed.
"""

from __future__ import annotations

import argparse
import re

from transformers.utils import logging

from .budget import DEFAULT_TEXT_SHARE
from .features import FEATURE_DTYPES, FEATURE_MODES
from .loss_terms import CE_TARGETS
from .pipeline import BUILTIN_DEFAULT_PROMPTS, PipelineOptions, run_pipeline
from .prompts import BUILTIN_SOURCES
from .target_loading import PRESETS
from .precision import PRECISIONS
from .trainer import TrainingConfig

logger = logging.get_logger(__name__)

DEFAULT_MAX_STEPS = 800  # without --max-time
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from ``3600``, ``90s``, ``45m``, ``2h`` or ``1h30m``."""
    value = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", value)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != value:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write seconds (3600) or e.g. 90m, 2h, 1h30m.")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def build_parser() -> argparse.ArgumentParser:
    """The command's options (``dspark-hf train --help``)."""
    from ..hub import FORMATS

    default = TrainingConfig()
    parser = argparse.ArgumentParser(prog="dspark-hf train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_argument_group("target and output")
    where.add_argument("--target", default="smollm2",
                       help=f"a local model folder, a Hub id, or a preset ({', '.join(PRESETS)}); default smollm2")
    where.add_argument("--output", help="the draft folder (also holds the logs, checkpoint and stages.json)")
    where.add_argument("--dtype", default="auto", help="the target's dtype: auto (its own; float32 on the CPU for a "
                       "half-precision checkpoint), float32, bfloat16, float16")
    where.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available); several processes "
                       "take one GPU each")
    where.add_argument("--export-format", dest="export_formats", nargs="+", default=[], metavar="FORMAT",
                       help=f"also write OUTPUT/export/FORMAT with dspark_hf.hub.export ({', '.join(FORMATS)})")
    where.add_argument("--fp16", action="store_true", help="save the draft in fp16")

    data = parser.add_argument_group("data: the target's own answers")
    data.add_argument("--prompts", help='JSONL, one {"prompt": ...} or {"turns": [...]} per line (default: the built-in '
                      "plan: ShareGPT, code, math; docs/training-data.md)")
    data.add_argument("--sources", default=",".join(BUILTIN_SOURCES),
                      help="the built-in plan's prompt sources, comma-separated (default: all)")
    data.add_argument("--num-prompts", type=int, default=None,
                      help=f"answer the first N prompts (default: all of --prompts, {BUILTIN_DEFAULT_PROMPTS} of the "
                           "built-in plan)")
    data.add_argument("--corpus", default=None, help="train on the finished shards of this data folder as they are "
                      "(made by `python -m dspark_hf.training.datagen` or an earlier run); nothing is generated")
    data.add_argument("--max-sequences", type=int, default=None, help="use only the first N records of --corpus")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--max-prompt-tokens", type=int, default=256, help="drop longer prompts from the plan")
    data.add_argument("--generation-batch-size", type=int, default=16, help="rows per generate call")
    data.add_argument("--shard-size", type=int, default=64,
                      help="prompts per answer shard and records per feature chunk: the unit of resuming and of "
                           "splitting work between processes")
    data.add_argument("--data-dir", default=None, help="where the answers go (default: a folder under "
                      "$DSPARK_HF_CACHE/answers named after the target and these settings)")
    data.add_argument("--reference-answers", type=int, default=None,
                      help="add this many ShareGPT conversations with their original answers as teacher-forced texts "
                           "(no generation; default: what --text-share buys with --max-time, else none)")
    data.add_argument("--text-share", type=float, default=DEFAULT_TEXT_SHARE,
                      help="with --max-time: the fraction of the data time spent on teacher-forced texts (one target "
                           f"forward each) rather than the target's own answers (default {DEFAULT_TEXT_SHARE})")

    feats = parser.add_argument_group("features")
    feats.add_argument("--features", choices=FEATURE_MODES, default="auto",
                       help="cached: the target's hidden states on disk; online: recomputed per step (no disk); auto: "
                            "cached when it fits --max-feature-cache-gb and the free disk")
    feats.add_argument("--max-feature-cache-gb", type=float, default=50.0)
    feats.add_argument("--feature-dir", default=None,
                       help="the feature cache (default: a folder under $DSPARK_HF_CACHE/features for the target)")
    feats.add_argument("--feature-dtype", choices=FEATURE_DTYPES, default="auto",
                       help="the feature cache's dtype (default auto: float16 when the target's values leave it "
                            "headroom, else bfloat16)")
    feats.add_argument("--prepare-only", action="store_true", help="stop after the answers and the feature cache")

    model = parser.add_argument_group("draft and training")
    model.add_argument("--markov-rank", type=int, default=default.markov_rank,
                       help="rank of the serial Markov head; 0 trains a DFlash draft (default: DSparkConfig's)")
    model.add_argument("--no-confidence-head", action="store_true")
    model.add_argument("--block-size", type=int, default=default.block_size)
    model.add_argument("--draft-layers", type=int, default=default.num_hidden_layers)
    model.add_argument("--draft-vocab-size", type=int, default=None,
                       help="reduced draft vocabulary: the N most frequent answer tokens (0 = the full vocabulary; "
                            "default: the full one up to 32,768 ids, else sized from the answers' coverage)")
    model.add_argument("--max-steps", type=int, default=None,
                       help=f"optimiser steps (default: what fits the training stage's share of --max-time, else "
                            f"{DEFAULT_MAX_STEPS})")
    model.add_argument("--max-time", type=parse_duration, default=None,
                       help="the whole command's time budget (3600, 90m, 2h): the target is measured first and every "
                            "stage planned to fit (the plan is printed and kept in stages.json); training stops at "
                            "its deadline with a checkpoint, and --resume goes on")
    model.add_argument("--batch-size", type=int, default=default.sequences_per_step,
                       help="sequences per optimiser step, over all processes together")
    model.add_argument("--anchors-per-sequence", type=int, default=default.anchors_per_sequence)
    model.add_argument("--max-seq-len", type=int, default=default.max_seq_len)
    model.add_argument("--learning-rate", type=float, default=default.learning_rate)
    model.add_argument("--loss-weights", type=float, nargs=3, metavar=("CE", "TV", "CONF"),
                       default=(default.ce_weight, default.tv_weight, default.conf_weight),
                       help="weights of the cross-entropy, total-variation and confidence terms (default "
                            f"{default.ce_weight} {default.tv_weight} {default.conf_weight}, the paper's)")
    model.add_argument("--ce-target", choices=CE_TARGETS, default=default.ce_target,
                       help="the cross-entropy's aim: the sequence's next token (label, the paper's) or the target's "
                            "whole next-token distribution")
    model.add_argument("--precision", choices=PRECISIONS, default=default.precision,
                       help="the draft's matmuls in training: float32, bfloat16 (autocast; the loss stays float32), or auto "
                            "(bfloat16 where this machine runs the draft's widest matmul clearly faster in it)")
    model.add_argument("--warmup-steps", type=int, default=default.warmup_steps)
    model.add_argument("--held-out", type=int, default=default.held_out_sequences,
                       help="answers kept out of training for calibrating the confidence head")
    model.add_argument("--seed", type=int, default=0, help="one seed for the prompt order, sampled answers and training")
    model.add_argument("--init-from-draft", default=None,
                       help="warm start from a saved draft folder with the same architecture")
    model.add_argument("--resume", action="store_true", help="continue training from OUTPUT/checkpoint")
    model.add_argument("--save-every", type=int, default=default.save_every)
    model.add_argument("--snapshot-every", type=int, default=0,
                       help="also save the draft to OUTPUT/snapshots/step-N every N steps (for a tau-over-steps curve)")
    model.add_argument("--log-every", type=int, default=default.log_every)
    model.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    model.add_argument("--no-progress", action="store_true", help="no progress bars")
    model.add_argument("--no-prepare-target", action="store_true",
                       help="run the target as loaded instead of with optimize_for_cpu (which picks kernels by timing, "
                            "so answers may differ from run to run within rounding)")
    model.add_argument("--no-measure", action="store_true",
                       help="skip the final greedy measurement on held-out prompts")
    return parser


def options_from_args(args: argparse.Namespace) -> tuple[PipelineOptions, TrainingConfig]:
    """The pipeline's options and the training configuration a parsed command line asks for."""
    cfg = TrainingConfig(
        markov_rank=args.markov_rank, max_steps=args.max_steps or DEFAULT_MAX_STEPS, learning_rate=args.learning_rate,
        confidence_head=not args.no_confidence_head,
        confidence_head_with_markov=not args.no_confidence_head and args.markov_rank > 0,
        block_size=args.block_size, num_hidden_layers=args.draft_layers, sequences_per_step=args.batch_size,
        anchors_per_sequence=args.anchors_per_sequence, max_seq_len=args.max_seq_len,
        warmup_steps=args.warmup_steps, held_out_sequences=args.held_out, init_from_draft=args.init_from_draft,
        save_every=args.save_every, snapshot_every=args.snapshot_every, log_every=args.log_every,
        draft_vocab_size=args.draft_vocab_size or None, seed=args.seed, ce_weight=args.loss_weights[0],
        tv_weight=args.loss_weights[1], conf_weight=args.loss_weights[2], ce_target=args.ce_target,
        precision=args.precision)
    opts = PipelineOptions(
        output=args.output, target=args.target, prompts=args.prompts, num_prompts=args.num_prompts,
        sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
        corpus=args.corpus, max_sequences=args.max_sequences, reference_answers=args.reference_answers,
        text_share=args.text_share,
        data_dir=args.data_dir, feature_dir=args.feature_dir, features=args.features,
        max_feature_cache_gb=args.max_feature_cache_gb, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, generation_batch_size=args.generation_batch_size,
        shard_size=args.shard_size, seed=args.seed, dtype=args.dtype, device=args.device, threads=args.threads,
        max_time=args.max_time, feature_dtype=args.feature_dtype, prepare_target=not args.no_prepare_target,
        fit_steps=args.max_steps is None, auto_draft_vocab=args.draft_vocab_size is None, measure=not args.no_measure, prepare_only=args.prepare_only, resume=args.resume, fp16=args.fp16,
        export_formats=tuple(args.export_formats), show_progress=not args.no_progress)
    return opts, cfg


def main(argv: list[str] | None = None):
    """CLI: parse the options and run :func:`dspark_hf.training.pipeline.run_pipeline`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prepare_only and not args.output:
        parser.error("--output is required unless --prepare-only")
    opts, cfg = options_from_args(args)
    try:
        return run_pipeline(opts, cfg)
    except ValueError as error:  # bad input: the message names the problem and the fix
        parser.error(str(error))


if __name__ == "__main__":
    main()
