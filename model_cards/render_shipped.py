"""Renders the model cards of the shipped SmolLM2-135M-Instruct drafts from measured results.

    python model_cards/render_shipped.py [--results results/tau_dspark.json results/tau_dflash.json]

Reads the JSON files written by ``python -m dspark_hf.benchmarks.evaluation`` and writes
``model_cards/smollm2-135m-dspark.md`` and ``model_cards/smollm2-135m-dflash.md``. Only the
benchmarks present in the results appear in the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_hf.hub import render_model_card

ROOT = Path(__file__).resolve().parents[1]
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DRAFTS = {"smollm2-135m-dspark": "DSpark", "smollm2-135m-dflash": "DFlash"}


def measured_table(result_files: list[Path], this_draft: str) -> dict | None:
    results: dict[str, dict[str, float]] = {}
    settings = None
    for path in result_files:
        data = json.loads(path.read_text())
        settings = settings or data["settings"]
        for key, value in data["results"].items():
            draft, dataset, mode = key.split("/")
            method = DRAFTS.get(draft, draft) + (" (this draft)" if draft == this_draft else "")
            results.setdefault(method, {})[f"{dataset} ({mode})"] = round(value["tau"], 2)
    if not results:
        return None
    env = json.loads(result_files[0].read_text())["environment"]
    # results written before the benchmarks shared capture_environment() call the field "threads"
    threads = env.get("torch_threads", env.get("threads"))
    return {
        "setup": (f"target SmolLM2-135M-Instruct fp32 on CPU ({threads} thread), first {settings['num_prompts']} "
                  f"prompts per dataset ({settings.get('batch_size', 1)} per batch), chat template, "
                  f"{settings['max_new_tokens']} new tokens, full block verified; "
                  f"greedy and temperature 1.0; measured {env['date']}"),
        "results": results,
        "source": "python -m dspark_hf.benchmarks.evaluation (results/tau_*.json)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", nargs="+", default=[str(ROOT / "results/tau_dspark.json"),
                                                         str(ROOT / "results/tau_dflash.json")])
    args = parser.parse_args()
    files = [Path(p) for p in args.results if Path(p).exists()]
    for name in DRAFTS:
        folder = ROOT / "drafts" / name
        training = json.loads((folder / "training_config.json").read_text())
        log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
        # Log lines come every `log_every` steps; extrapolate the first interval from the rest.
        minutes = (log[-1]["time"] - log[0]["time"]) / 60 * log[-1]["step"] / (log[-1]["step"] - log[0]["step"])
        facts = {"data": "the first 5,120 records of data/smollm2-onpolicy: the target's own answers (half greedy, half "
                         "temperature 1.0) to ShareGPT first turns, DeepMind mathematics, CHAMP and code-docstring "
                         "prompts (docs/training-data.md; 32 held out for calibration)",
                 "draft vocabulary": f"{training['draft_vocab_size']:,} ids: the most frequent answer tokens of the "
                                     "training split and the special tokens (docs/training.md)",
                 "warm start": "the v2 draft (git commit 344dacc): 2,000 steps on 4,864 on-policy records, itself "
                               "warm-started from v1 (1,400 steps; git commit 29be359)",
                 "steps": training["max_steps"], "sequences per step": training["sequences_per_step"],
                 "anchors per sequence": training["anchors_per_sequence"], "learning rate": training["learning_rate"],
                 "hardware": f"2-core CPU, one thread, {minutes:.0f} minutes of training steps (from the training log)",
                 "reproduce": f"bash examples/train_smollm2_drafts.sh 5120 {training['max_steps']}"}
        card = render_model_card(folder, measured_table(files, name), base_model=BASE_MODEL,
                                 repo_id=f"dspark-hf/{name}", training=facts)
        (ROOT / "model_cards" / f"{name}.md").write_text(card)
        print(f"wrote model_cards/{name}.md")


if __name__ == "__main__":
    main()
