"""Renders the README.md model card of an exported DSpark draft folder.

    python model_cards/render_card.py DRAFT_FOLDER --base-model ORG/TARGET --repo-id ORG/DRAFT \
        [--measured measured.json] [--training training.json] [--output DRAFT_FOLDER/README.md]

DRAFT_FOLDER is a folder written by ``dspark_hf.hub.export`` (transformers or DeepSpec layout).
``measured.json`` holds measured accepted lengths (see ``dspark_hf.hub.render_model_card``):
``{"setup": "...", "results": {method: {benchmark: tau}}, "benchmarks": [...], "source": "..."}``;
without it the card says the draft is not measured yet. ``training.json`` is a flat dict of facts
about the training run. The template is ``dspark_hf/hub/templates/model_card.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_hf.hub import render_model_card


def _load(path: str | None):
    return None if path is None else json.loads(Path(path).read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft_folder")
    parser.add_argument("--base-model", help="the target model's Hub id")
    parser.add_argument("--repo-id", help="the draft's Hub id (used in the usage snippets)")
    parser.add_argument("--measured", help="JSON file of measured numbers")
    parser.add_argument("--training", help="JSON file of training-run facts")
    parser.add_argument("--license", default="apache-2.0")
    parser.add_argument("--output", help="where to write the card (default: DRAFT_FOLDER/README.md)")
    args = parser.parse_args(argv)
    card = render_model_card(
        args.draft_folder,
        _load(args.measured),
        base_model=args.base_model,
        repo_id=args.repo_id,
        training=_load(args.training),
        license=args.license,
    )
    output = Path(args.output or Path(args.draft_folder) / "README.md")
    output.write_text(card, encoding="utf-8")
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    main()
