"""``python -m dspark_hf.training`` / ``dspark-hf train``: make a draft for SmolLM2-135M-Instruct.

Steps: the corpus (ShareGPT prompts answered by the target, or a folder of on-policy shards made by
``python -m dspark_hf.training.datagen``) -> the target's features, cached on disk -> training
(:mod:`dspark_hf.training.trainer`) -> Sequential Temperature Scaling of the confidence head
(:mod:`dspark_hf.training.calibration`) -> the saved draft.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers.utils import logging

from ..modeling_dspark import default_target_layer_ids
from ..scheduler import default_cache_dir
from . import smollm2
from .calibration import calibrate_draft
from .data import generate_answers, load_corpus, sharegpt_prompts, sharegpt_reference_answers
from .datagen import load_onpolicy_corpus, load_plan
from .trainer import TrainingConfig, build_feature_cache, train

logger = logging.get_logger(__name__)


def main(argv: list[str] | None = None) -> None:
    """CLI: data (ShareGPT prompts answered by SmolLM2) -> target features -> training -> STS -> save."""
    parser = argparse.ArgumentParser(prog="python -m dspark_hf.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="draft output folder")
    parser.add_argument("--corpus", default=None,
                        help="JSONL corpus (default: <cache>/data/sharegpt_smollm2.jsonl), or a folder made by "
                             "`python -m dspark_hf.training.datagen` (its finished shards are used as they are)")
    parser.add_argument("--max-sequences", type=int, default=None,
                        help="use only the first N records of a datagen folder (the feature cache holds ~4.6 KB "
                             "per token for SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=320)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--reference-answers", type=int, default=0,
                        help="add this many ShareGPT conversations with their original answers (no generation)")
    parser.add_argument("--markov-rank", type=int, default=TrainingConfig.markov_rank,
                        help="rank of the serial Markov head; 0 trains a DFlash draft (default: DSparkConfig's)")
    parser.add_argument("--no-confidence-head", action="store_true")
    parser.add_argument("--max-steps", type=int, default=800)
    parser.add_argument("--learning-rate", type=float, default=TrainingConfig.learning_rate)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-from-draft", default=None,
                        help="warm start from a saved draft folder with the same architecture")
    parser.add_argument("--save-every", type=int, default=TrainingConfig.save_every)
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="also save the draft to OUTPUT/snapshots/step-N every N steps (for a tau-over-steps curve)")
    parser.add_argument("--prepare-only", action="store_true", help="only build the corpus and the feature cache")
    parser.add_argument("--fp16", action="store_true", help="save the draft in fp16")
    parser.add_argument("--draft-vocab-size", type=int, default=0,
                        help="reduced draft vocabulary: the N most frequent answer tokens (0 = the full vocabulary)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.prepare_only and not args.output:
        parser.error("--output is required unless --prepare-only")

    target, tokenizer = smollm2.load_smollm2()
    corpus = Path(args.corpus) if args.corpus else default_cache_dir() / "data" / "sharegpt_smollm2.jsonl"
    if corpus.is_dir():  # on-policy shards from dspark_hf.training.datagen; nothing to generate here
        records = load_onpolicy_corpus(corpus)[: args.max_sequences]
        prompts = [p["text"] for p in load_plan(corpus) if p["source"] == "sharegpt"]
        tag = f"n{len(records)}"
        logger.warning(f"Training corpus: {len(records)} records of {corpus}")
        # features live in the cache, not next to the shards (they are ~1000x larger)
        corpus = default_cache_dir() / "data" / f"{corpus.resolve().name}.jsonl"
    else:
        prompts = sharegpt_prompts(limit=args.num_prompts)
        generate_answers(target, tokenizer, prompts, corpus, max_new_tokens=args.max_new_tokens, batch_size=32)
        records = sorted((r for r in load_corpus(corpus) if r["index"] < args.num_prompts), key=lambda r: r["index"])
        tag = f"n{args.num_prompts}"
    if args.reference_answers:
        reference = corpus.with_name(f"sharegpt_reference.n{args.reference_answers}.jsonl")
        sharegpt_reference_answers(tokenizer, args.reference_answers, reference, exclude_prompts=set(prompts),
                                   max_answer_tokens=args.max_new_tokens)
        records += load_corpus(reference)  # after the target's own answers: the held-out split stays on-policy
        tag += f".ref{args.reference_answers}"
    cfg = TrainingConfig(markov_rank=args.markov_rank, max_steps=args.max_steps, learning_rate=args.learning_rate,
                         confidence_head=not args.no_confidence_head,
                         confidence_head_with_markov=not args.no_confidence_head and args.markov_rank > 0,
                         mask_token_id=smollm2.mask_token_id(tokenizer), init_from_draft=args.init_from_draft,
                         save_every=args.save_every, snapshot_every=args.snapshot_every, draft_vocab_size=args.draft_vocab_size or None)
    cfg.target_layer_ids = default_target_layer_ids(target.config.num_hidden_layers, cfg.num_hidden_layers)
    tokens = sum(min(len(r["prompt_ids"]) + len(r["answer_ids"]), cfg.max_seq_len) for r in records)
    feature_gb = tokens * (len(cfg.target_layer_ids) + 1) * target.config.hidden_size * 2 / 1e9
    logger.warning(f"Feature cache: {len(records)} sequences, {tokens} tokens, ~{feature_gb:.1f} GB, held in memory "
                   "while training (--max-sequences caps it).")
    feature_path = corpus.with_name(f"{corpus.stem}.{tag}.layers{'-'.join(map(str, cfg.target_layer_ids))}.pt")
    items = build_feature_cache(target, records, cfg.target_layer_ids, feature_path, cfg.max_seq_len,
                                with_target_lse=bool(cfg.draft_vocab_size))
    if args.prepare_only:
        return
    held_out, train_items = items[: cfg.held_out_sequences], items[cfg.held_out_sequences :]
    draft = train(target, train_items, cfg, args.output, resume=args.resume)
    if draft.confidence_head is not None:
        report = calibrate_draft(draft, target, held_out, Path(args.output))
        logger.warning(f"Calibration: ECE before {report['ece_before']}, after {report['ece_after']}")
    if args.fp16:
        draft.half()
    draft.save_pretrained(args.output)


if __name__ == "__main__":
    main()
