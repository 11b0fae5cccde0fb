"""The evaluation prompt sets (GSM8K, HumanEval, MT-Bench) that every benchmark runs on, and the
copy-heavy set that ``dspark-hf bench`` adds.

They ship inside the package in ``dspark_hf/benchmarks/eval_prompts/`` (sources and licences in
its README), so benchmarks work from any install; ``$DSPARK_EVAL_PROMPTS`` or an explicit folder
points them elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DATASETS = ("gsm8k", "humaneval", "mt-bench")
# Prompts whose answers copy long spans (code edits, quotations, multiple choice), built from the Python
# standard library by benchmarks/build_copy_heavy.py: a speed set only (no reference answers, no tau protocol).
COPY_HEAVY = "copy-heavy"
BENCH_DATASETS = DATASETS + (COPY_HEAVY,)
PACKAGED_PROMPT_DIR = Path(__file__).resolve().parent / "eval_prompts"


def default_prompt_dir() -> Path:
    """``$DSPARK_EVAL_PROMPTS`` if set, else the prompt sets shipped in the package
    (``dspark_hf/benchmarks/eval_prompts``: GSM8K test, HumanEval, MT-Bench; sources and licences in its README)."""
    env = os.environ.get("DSPARK_EVAL_PROMPTS")
    if env:
        return Path(env)
    return PACKAGED_PROMPT_DIR


def load_eval_prompts(dataset: str, limit: int | None = None, prompt_dir: str | Path | None = None) -> list[str]:
    """First turns of ``<prompt_dir>/<dataset>.jsonl`` (records with a ``turns`` list), in file order."""
    path = Path(prompt_dir or default_prompt_dir()) / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; set DSPARK_EVAL_PROMPTS to the folder holding {dataset}.jsonl.")
    prompts = []
    with path.open() as f:
        for line in f:
            if line.strip():
                prompts.append(json.loads(line)["turns"][0])
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


__all__ = ["BENCH_DATASETS", "COPY_HEAVY", "DATASETS", "PACKAGED_PROMPT_DIR", "default_prompt_dir", "load_eval_prompts"]
