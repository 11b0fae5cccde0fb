"""``dspark-hf export``: write a saved draft in a loadable layout (:func:`dspark_hf.hub.export`).

    dspark-hf export drafts/smollm2-135m-dspark out/dspark-hf --target <target path|id>
    dspark-hf export drafts/smollm2-135m-dspark out/dspark-deepspec --format deepspec --target <target>
    dspark-hf export drafts/smollm2-135m-dflash out/dflash-vllm --format vllm --target <target>
    dspark-hf export drafts/smollm2-135m-dspark out/dspark-speculators --format speculators --target <target>

``--format hf`` (default) writes the Hub-ready transformers folder (remote code,
``custom_generate/``, model card); ``--format deepspec`` writes DeepSpec's layout for serving
engines; ``--format vllm`` writes the folder vLLM 0.34.0 serves (``vllm serve <target>
--speculative-config '{"method": "dspark", "model": "<folder>"}'``) or says why it cannot, and
needs ``--target``; ``--format speculators`` writes vllm-project/speculators' format (its verifier is
the target's name, or ``--base-model``). A draft that borrows the target's embedding and LM head needs ``--target``
whenever the layout stores copies of them (always for DeepSpec). Upload the folder with ``hf upload`` or use
:func:`dspark_hf.hub.push_to_hub` from Python.
"""

from __future__ import annotations

import argparse

from ..model.modeling_dspark import DSparkDraftModel
from .draft_export import FORMATS, export


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="dspark-hf export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("draft", help="the draft: a folder or Hub id that DSparkDraftModel.from_pretrained reads")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--format", choices=FORMATS, default="hf")
    parser.add_argument("--target", help="the target model (folder or Hub id): checked against the draft, and the "
                        "source of embedding/LM-head copies and of the card's base_model")
    parser.add_argument("--embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="store embed_tokens/lm_head (default: as the draft has them; always for deepspec)")
    parser.add_argument("--no-model-card", dest="model_card", action="store_false", default=None,
                        help="do not write README.md")
    parser.add_argument("--drop-confidence-temperatures", action="store_true",
                        help="vllm only: export a calibrated draft without its confidence temperatures (vLLM ignores them)")
    parser.add_argument("--repo-id", help="the draft's Hub id, used in the card's snippets")
    parser.add_argument("--base-model", help="the target's Hub id for the card (default: the target's, when "
                        "loaded from the Hub); with --format speculators, the verifier it names (default: the "
                        "target's name or path)")
    args = parser.parse_args(argv)

    draft = DSparkDraftModel.from_pretrained(args.draft)
    target = None
    if args.target:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=draft.dtype)
    try:
        folder = export(draft, args.output, format=args.format, target=target, embeddings=args.embeddings,
                        model_card=args.model_card, repo_id=args.repo_id, base_model=args.base_model,
                        drop_confidence_temperatures=args.drop_confidence_temperatures)
    except ValueError as error:  # e.g. a borrowed embedding without a target: say so without a traceback
        hint = " On the command line that is --target PATH." if "target=" in str(error) else ""
        parser.error(f"{error}{hint}")
    print(f"wrote {folder} ({args.format} layout)")
    return folder


if __name__ == "__main__":
    main()
