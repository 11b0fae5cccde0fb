"""What a deeper draft costs per round: the shipped draft's forward with 1, 2 or 3 layers.

    python benchmarks/draft_depth_cost.py                  # SmolLM2 v3 draft, prepared for CPU
    python benchmarks/draft_depth_cost.py --depths 1 2 3 4 --context 512 --repeats 60

A deeper draft starts as the shipped one with identity layers added (the warm start of
``dspark-hf train --draft-layers N --init-from-draft``, the same function here), so it drafts
exactly as the shipped one and only its cost differs. Each depth runs one round's draft work on a cached context of ``--context`` target
features: the block forward and the base logits over the draft vocabulary (what every drafted round
pays before serial sampling). Depths run interleaved repeat by repeat; medians in milliseconds,
and the ratio to one layer, are printed with the CPU model.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from dspark_hf import DSparkDraftModel, optimize_for_cpu
from dspark_hf.benchmarks.environment import capture_environment
from dspark_hf.benchmarks.measuring import write_json_result
from dspark_hf.demo_target import load_smollm2
from dspark_hf.training.trainer import init_from_saved_draft

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-dspark"


def deepened(shipped_path: str, shipped: DSparkDraftModel, depth: int) -> DSparkDraftModel:
    """The shipped draft grown to ``depth`` layers the way training grows it
    (:func:`~dspark_hf.training.trainer.init_from_saved_draft`: its layers first, each added one an
    identity block), so it drafts as the shipped one and only its cost differs."""
    config = copy.deepcopy(shipped.config)
    config.num_hidden_layers = depth
    config.layer_types = [config.layer_types[0]] * depth
    deeper = DSparkDraftModel(config).eval()
    if shipped.draft_vocab_ids is not None:  # the same vocabulary, so the warm start has nothing to report
        deeper.draft_vocab_ids.copy_(shipped.draft_vocab_ids)
    init_from_saved_draft(deeper, shipped_path)
    return deeper


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--draft", default=str(DRAFT))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    target, _ = load_smollm2()
    optimize_for_cpu(target)
    shipped = DSparkDraftModel.from_pretrained(args.draft).float().eval()
    drafts = {}
    for depth in args.depths:
        draft = shipped if depth == len(shipped.layers) else deepened(args.draft, shipped, depth)
        draft.bind_target(target)
        drafts[depth] = optimize_for_cpu(draft)
    width = len(shipped.config.target_layer_ids) * shipped.config.hidden_size
    features = torch.randn(1, args.context, width)
    positions = torch.arange(args.context)[None]
    block = torch.full((1, shipped.config.block_size), shipped.config.mask_token_id)
    block[0, 0] = 1
    block_positions = args.context + torch.arange(shipped.config.block_size)[None]
    caches = {}
    with torch.inference_mode():
        for depth, draft in drafts.items():
            caches[depth] = draft.new_cache()
            draft.add_context(caches[depth], features, positions)
    times = {depth: [] for depth in drafts}
    with torch.inference_mode():
        for repeat in range(args.repeats + 3):
            for depth in (args.depths if repeat % 2 else args.depths[::-1]):
                draft = drafts[depth]
                start = time.perf_counter()
                out = draft(block, block_positions, caches[depth], compute_logits=False)
                draft.base_logits(out.hidden_states)
                if repeat >= 3:
                    times[depth].append(time.perf_counter() - start)
    env = capture_environment()
    base = statistics.median(times[args.depths[0]])
    print(f"CPU: {env.get('cpu_model')}; torch threads {torch.get_num_threads()}; context {args.context}")
    print("layers  draft ms per round  vs first")
    result = {"environment": env, "context": args.context, "rows": []}
    for depth in args.depths:
        median = statistics.median(times[depth])
        result["rows"].append({"layers": depth, "ms": 1e3 * median, "ratio": median / base})
        print(f"{depth:<7} {1e3 * median:18.2f}  {median / base:8.2f}")
    write_json_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
