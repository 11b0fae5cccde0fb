"""Where a draft training step's time goes (issue: drafts v2, item 2), on SmolLM2-135M-Instruct.

Runs the real training step (:func:`dspark_hf.training.trainer.step_loss`, backward, AdamW) on records of
an on-policy data folder and prints

* wall time per step split into forward, backward and optimiser, and sequences (blocks) per second;
* a profiler pass that attributes CPU time to operators whose tensors have the vocabulary as a
  dimension (the draft's and the target's LM-head projections, the softmaxes and the TV/CE terms
  over the vocabulary, and their backward) versus everything else.

    python benchmarks/training_step.py --data data/smollm2-onpolicy --steps 6

Nothing is trained or saved. Run it on a quiet machine: it is a timing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark_hf.training.smollm2 import load_smollm2
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    known = TrainingConfig.__dataclass_fields__
    settings = json.loads(args.config.read_text()) if args.config.is_file() else {}
    cfg = TrainingConfig(**{k: v for k, v in settings.items() if k in known})
    target, _ = load_smollm2()
    target.requires_grad_(False)
    draft = make_draft(target, cfg)
    draft.bind_target(target)
    draft.train()
    head = target.get_output_embeddings()
    vocab = head.weight.shape[0]
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.learning_rate)

    layer_ids = list(draft.config.target_layer_ids)
    items = []
    for record in _records(args.data, cfg.sequences_per_step * (args.steps + 2)):
        ids = torch.tensor((record["prompt_ids"] + record["answer_ids"])[: cfg.max_seq_len])
        context, final = target_features(target, ids, layer_ids)
        items.append({"ids": ids, "answer_start": len(record["prompt_ids"]), "context": context, "final": final})
    generator = torch.Generator().manual_seed(0)

    def batch(step: int):
        chosen = items[step * cfg.sequences_per_step:(step + 1) * cfg.sequences_per_step]
        return [(item, sample_anchors(item["ids"].numel(), item["answer_start"], cfg.anchors_per_sequence,
                                      cfg.block_size, generator)) for item in chosen]

    def run_step(step: int) -> tuple[float, float, float, int]:
        pairs = [(item, anchors) for item, anchors in batch(step) if anchors.numel()]
        start = time.perf_counter()
        loss = torch.stack([step_loss(draft, head, item, anchors, cfg)["loss"] for item, anchors in pairs]).mean()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        done = time.perf_counter()
        blocks = sum(int(anchors.numel()) for _, anchors in pairs)
        return forward - start, backward - forward, done - backward, blocks

    run_step(0)  # warm-up
    totals = [0.0, 0.0, 0.0]
    blocks = 0
    for step in range(1, args.steps + 1):
        f, b, o, n = run_step(step)
        totals = [totals[0] + f, totals[1] + b, totals[2] + o]
        blocks += n
    seconds = sum(totals)
    print(f"{args.steps} steps of {cfg.sequences_per_step} sequences x up to {cfg.anchors_per_sequence} blocks of "
          f"{cfg.block_size}, {args.threads} threads, vocabulary {vocab}")
    print(f"per step: {seconds / args.steps * 1e3:.0f} ms = forward {totals[0] / args.steps * 1e3:.0f} + backward "
          f"{totals[1] / args.steps * 1e3:.0f} + optimiser {totals[2] / args.steps * 1e3:.0f} ms")
    print(f"throughput: {args.steps * cfg.sequences_per_step / seconds:.2f} sequences/s, {blocks / seconds:.1f} blocks/s")

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run_step(args.steps + 1)
    by_vocab, other = 0.0, 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key.startswith("ProfilerStep"):
            continue
        touches_vocab = any(vocab in (shape or []) for shape in (event.input_shapes or []))
        if touches_vocab:
            by_vocab += event.self_cpu_time_total
        else:
            other += event.self_cpu_time_total
    share = by_vocab / max(by_vocab + other, 1e-9)
    print(f"profiled step: operators on vocabulary-sized tensors {share:.0%} of self CPU time "
          f"({by_vocab / 1e3:.0f} of {(by_vocab + other) / 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
