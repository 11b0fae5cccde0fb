"""Where a draft training step's time goes (issue: drafts v2, item 2), on SmolLM2-135M-Instruct.

Runs the real training step (:func:`dspark_hf.training.trainer.step_loss`, backward, AdamW) on records of
an on-policy data folder and prints

* wall time per step split into forward, backward and optimiser, and sequences (blocks) per second;
* a profiler pass that attributes CPU time to operators whose tensors have the vocabulary as a
  dimension (the draft's and the target's LM-head projections, the softmaxes and the TV/CE terms
  over the vocabulary, and their backward) versus everything else.

    python benchmarks/training_step.py --data data/smollm2-onpolicy --steps 6

``--precision float32 bfloat16`` times the draft's matmuls in both precisions the same way.
``--prepare-target`` prepares the target with the CPU engine first, as ``dspark-hf train`` does.

``--draft-vocab-size 0 8192 16384`` times drafts with those draft vocabularies (0 = the full one,
:mod:`dspark_hf.model.draft_vocab`) in one run, their steps interleaved on the same batches, and prints each
one's time relative to the first: on a busy machine the ratio means more than the absolute numbers.
The reduced vocabularies are the most frequent answer tokens of the data folder's records.

Nothing is trained or saved. Run it on a quiet machine: it is a timing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark_hf.cpu_engine import prepare_for_cpu
from dspark_hf.demo_target import load_smollm2
from dspark_hf.training.datagen import load_onpolicy_corpus
from dspark_hf.training.draft_vocab_training import (add_target_lse, answer_tokens, select_draft_vocab, special_token_ids,
                                            token_counts)
from dspark_hf.training.precision import precision_context
from dspark_hf.training.trainer import TrainingConfig, make_draft, sample_anchors, step_loss, target_features


def _records(folder: Path, count: int) -> list[dict]:
    records = []
    for shard in sorted(folder.glob("shard-*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as lines:
            records.extend(json.loads(line) for line in lines)
        if len(records) >= count:
            break
    if not records:
        raise SystemExit(f"No shard-*.jsonl.gz records in {folder}; make them with python -m dspark_hf.training.datagen.")
    return records[:count]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/smollm2-onpolicy"))
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--config", type=Path, default=Path("drafts/smollm2-135m-dspark/training_config.json"),
                        help="training_config.json whose draft and batch settings to use")
    parser.add_argument("--draft-vocab-size", type=int, nargs="+", default=[0],
                        help="draft vocabulary sizes to time side by side (0 = the full vocabulary)")
    parser.add_argument("--precision", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                        help="training precisions to time side by side (each with every vocabulary size)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--top", type=int, default=0, help="also print the profiled step's N costliest operators")
    parser.add_argument("--prepare-target", action="store_true",
                        help="prepare the target with the CPU engine first, as dspark-hf train does (its packed LM "
                             "head then serves the draft's and the target's logits)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    known = TrainingConfig.__dataclass_fields__
    settings = json.loads(args.config.read_text()) if args.config.is_file() else {}
    # a timing needs no warm start (the shipped config names the folder its draft grew from)
    base_cfg = TrainingConfig(**{k: v for k, v in settings.items() if k in known and k != "init_from_draft"})
    target, _ = load_smollm2()
    target.requires_grad_(False)
    if args.prepare_target:
        prepare_for_cpu(target)
    head = target.get_output_embeddings()
    vocab = head.weight.shape[0]
    counts = None
    if any(args.draft_vocab_size):
        counts = token_counts(answer_tokens(load_onpolicy_corpus(args.data)), vocab)
    variants = []  # (label, cfg, draft, optimizer)
    for size, precision in [(size, p) for size in args.draft_vocab_size for p in args.precision]:
        cfg = replace(base_cfg, draft_vocab_size=size or None, precision=precision)
        ids = select_draft_vocab(counts, size, special_token_ids(target, cfg.mask_token_id)) if size else None
        torch.manual_seed(cfg.seed)
        draft = make_draft(target, cfg, ids)
        draft.bind_target(target)
        draft.train()
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.learning_rate)
        variants.append((f"vocabulary {size or vocab}, {precision}", cfg, draft, optimizer))
    cfg = base_cfg

    layer_ids = list(base_cfg.target_layer_ids or variants[0][2].config.target_layer_ids)
    items = []
    for record in _records(args.data, cfg.sequences_per_step * (args.steps + 2)):
        ids = torch.tensor((record["prompt_ids"] + record["answer_ids"])[: cfg.max_seq_len])
        context, final = target_features(target, ids, layer_ids)
        items.append({"ids": ids, "answer_start": len(record["prompt_ids"]), "context": context, "final": final})
    if any(args.draft_vocab_size):
        add_target_lse(items, head)  # cached with the features in training; not part of a step
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(args.steps + 2):
        chosen = items[step * cfg.sequences_per_step:(step + 1) * cfg.sequences_per_step]
        pairs = [(item, sample_anchors(item["ids"].numel(), item["answer_start"], cfg.anchors_per_sequence,
                                       cfg.block_size, generator)) for item in chosen]
        batches.append([(item, anchors) for item, anchors in pairs if anchors.numel()])

    def run_step(variant, step: int) -> tuple[float, float, float, int]:
        _, step_cfg, draft, optimizer = variant
        pairs = batches[step]
        start = time.perf_counter()
        with precision_context(step_cfg.precision, head.weight.device):
            loss = torch.stack([step_loss(draft, head, item, anchors, step_cfg)["loss"] for item, anchors in pairs]).mean()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        done = time.perf_counter()
        blocks = sum(int(anchors.numel()) for _, anchors in pairs)
        return forward - start, backward - forward, done - backward, blocks

    for variant in variants:
        run_step(variant, 0)  # warm-up
    totals = [[0.0, 0.0, 0.0] for _ in variants]
    blocks = [0 for _ in variants]
    for step in range(1, args.steps + 1):
        for index, variant in enumerate(variants):  # interleaved: each variant sees the same machine load
            f, b, o, n = run_step(variant, step)
            totals[index] = [totals[index][0] + f, totals[index][1] + b, totals[index][2] + o]
            blocks[index] += n
    print(f"{args.steps} steps of {cfg.sequences_per_step} sequences x up to {cfg.anchors_per_sequence} blocks of "
          f"{cfg.block_size}, {args.threads} threads, target vocabulary {vocab}")
    first = sum(totals[0])
    for (label, *_), total, count in zip(variants, totals, blocks):
        seconds = sum(total)
        print(f"{label}: per step {seconds / args.steps * 1e3:.0f} ms = forward {total[0] / args.steps * 1e3:.0f} + "
              f"backward {total[1] / args.steps * 1e3:.0f} + optimiser {total[2] / args.steps * 1e3:.0f} ms; "
              f"{args.steps * cfg.sequences_per_step / seconds:.2f} sequences/s, {count / seconds:.1f} blocks/s; "
              f"time x{seconds / first:.2f} of {variants[0][0]}, speed-up x{first / seconds:.2f}")
    if args.no_profile:
        return
    for variant in variants:
        sizes = {vocab, variant[2].config.draft_vocab_size or vocab}
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run_step(variant, args.steps + 1)
        by_vocab, other = 0.0, 0.0
        for event in prof.key_averages(group_by_input_shape=True):
            if event.key.startswith("ProfilerStep"):
                continue
            touches_vocab = any(sizes & set(shape or []) for shape in (event.input_shapes or []))
            if touches_vocab:
                by_vocab += event.self_cpu_time_total
            else:
                other += event.self_cpu_time_total
        share = by_vocab / max(by_vocab + other, 1e-9)
        print(f"{variant[0]}, profiled step: operators on vocabulary-sized tensors {share:.0%} of self CPU time "
              f"({by_vocab / 1e3:.0f} of {(by_vocab + other) / 1e3:.0f} ms)")
        if args.top:
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                                     max_name_column_width=40))


if __name__ == "__main__":
    main()
