"""Benchmark of DSpark's serial sampling loop on a GPU: the compiled CUDA op vs the eager PyTorch loop
(``serial_sample(backend="reference")``) vs ``torch.compile`` of the loop, all measured in one run.

    python examples/bench_serial_op.py                 # gamma 4/7/16, V 49152/151936, r 256, batch 1/32
    python examples/bench_serial_op.py --quick         # fewer repeats, no torch.compile
    python examples/bench_serial_op.py --json out.json --round-share

Per configuration (vanilla Markov head, rank 256, confidence head with the Markov feature, bf16
weights and logits, sampling at temperature 1.0 and greedy) it prints milliseconds per block for
each path and the ratios eager/op and compiled/op. Times are CUDA-event averages over repeated
calls after warm-up; the eager loop's time includes its Python and launch overhead, which is what
a decoding round pays. torch.compile runs the same loop written functionally (softmax +
torch.multinomial sampling), compiled once per gamma with dynamic shapes, for sampling only; a
compile budget skips the rest if compiling is slow.

``--round-share`` also builds a randomly initialised Qwen3-4B-sized target (36 layers, hidden 2560,
vocab 151936, bf16; timings do not depend on the weights' values) and a 5-layer DSpark draft, and
reports the op's share of a full round (draft forward + serial sampling + target verify of
gamma + 1 tokens at a 1024-token context) for gamma 4, 7 and 16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_hf.decoding import cuda_ops  # noqa: E402
from dspark_hf.benchmarks.environment import capture_environment  # noqa: E402
from dspark_hf.benchmarks.measuring import mean_call_ms, write_json_result  # noqa: E402
from dspark_hf.configuration_dspark import DSparkConfig  # noqa: E402
from dspark_hf.modeling_dspark import ConfidenceHead, MarkovHead  # noqa: E402
from dspark_hf.decoding.sampling import serial_sample  # noqa: E402

GAMMAS = (4, 7, 16)
VOCABS = (151936, 49152)
BATCHES = (1, 32)
RANK = 256
HIDDEN = 2560
DTYPE = torch.bfloat16


class Heads(torch.nn.Module):
    """Markov + confidence heads of a DSpark draft (what serial sampling reads)."""

    def __init__(self, vocab: int, gamma: int):
        super().__init__()
        self.config = DSparkConfig(vocab_size=vocab, hidden_size=HIDDEN, num_attention_heads=32, block_size=gamma,
                                   markov_rank=RANK)
        self.markov_head = MarkovHead(self.config)
        self.confidence_head = ConfidenceHead(self.config)


def make_problem(vocab: int, gamma: int, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        heads = Heads(vocab, gamma)
    with torch.no_grad():
        heads.markov_head.markov_w2.weight.normal_(0, RANK ** -0.5)
        heads.markov_head.markov_w1.weight.normal_(0, 1)
    heads = heads.to(DTYPE).eval()
    U = (3 * torch.randn(batch, gamma, vocab, device="cuda")).to(DTYPE)
    H = torch.randn(batch, gamma, HIDDEN, device="cuda").to(DTYPE)
    anchor = torch.randint(0, vocab, (batch,), device="cuda")
    return heads, U, H, anchor


def functional_loop(U, H, anchor, w1, w2, conf_w, conf_b, gamma: int, temperature: float):
    """The reference loop written without in-place slice updates, for torch.compile (sampling)."""
    logits, tokens, prev = [], [], anchor
    prev_tokens = [anchor]
    for k in range(gamma):
        lk = U[:, k].float() + F.linear(F.embedding(prev, w1), w2).float()
        if temperature != 1.0:
            lk = lk / temperature
        prev = torch.multinomial(torch.softmax(lk, dim=-1), 1).squeeze(1)
        logits.append(lk)
        tokens.append(prev)
        prev_tokens.append(prev)
    prev_ids = torch.stack(prev_tokens[:-1], dim=1)
    conf = torch.sigmoid(F.linear(torch.cat([H, F.embedding(prev_ids, w1)], dim=-1), conf_w, conf_b).squeeze(-1).float())
    return torch.stack(tokens, 1), torch.stack(logits, 1), conf


def compiled_loop(gamma: int):
    """torch.compile of :func:`functional_loop` for one gamma (the loop is unrolled), dynamic shapes."""

    def loop(U, H, anchor, w1, w2, conf_w, conf_b):
        return functional_loop(U, H, anchor, w1, w2, conf_w, conf_b, gamma, 1.0)

    return torch.compile(loop, dynamic=True)


def bench_serial(args) -> list[dict]:
    rows = []
    compiled_fns: dict[int, object] = {}
    compile_spent = 0.0
    repeats = 5 if args.quick else 20
    for vocab in VOCABS:
        for gamma in GAMMAS:
            for batch in BATCHES:
                heads, U, H, anchor = make_problem(vocab, gamma, batch)
                m, c = heads.markov_head, heads.confidence_head
                for mode in ("sample", "greedy"):
                    do_sample = mode == "sample"
                    row = {"vocab": vocab, "gamma": gamma, "batch": batch, "rank": RANK, "mode": mode}
                    with torch.no_grad():
                        row["op_ms"] = mean_call_ms(
                            lambda: serial_sample(heads, U, H, anchor, do_sample=do_sample, backend="cuda"), repeats)
                        row["eager_ms"] = mean_call_ms(
                            lambda: serial_sample(heads, U, H, anchor, do_sample=do_sample, backend="reference"),
                            repeats)
                        row["compiled_ms"] = None
                        if do_sample and not args.quick and compile_spent < args.compile_budget_s:
                            fn = compiled_fns.get(gamma)
                            if fn is None:
                                fn = compiled_fns[gamma] = compiled_loop(gamma)
                            args_c = (U, H, anchor, m.markov_w1.weight, m.markov_w2.weight, c.proj.weight,
                                      c.proj.bias)
                            t0 = time.perf_counter()
                            try:
                                fn(*args_c)
                                torch.cuda.synchronize()
                                compile_spent += time.perf_counter() - t0
                                row["compiled_ms"] = mean_call_ms(lambda: fn(*args_c), repeats)
                            except Exception as err:  # report, keep benchmarking
                                compile_spent += time.perf_counter() - t0
                                row["compiled_error"] = f"{type(err).__name__}: {err}"[:300]
                    row["eager_over_op"] = row["eager_ms"] / row["op_ms"]
                    row["compiled_over_op"] = row["compiled_ms"] / row["op_ms"] if row["compiled_ms"] else None
                    rows.append(row)
                    print(format_row(row), flush=True)
                del heads, U, H, anchor
                torch.cuda.empty_cache()
    return rows


def format_row(row: dict) -> str:
    compiled = f"{row['compiled_ms']:9.3f}" if row.get("compiled_ms") else "        -"
    ratio_c = f"{row['compiled_over_op']:7.2f}x" if row.get("compiled_over_op") else "       -"
    return (f"V={row['vocab']:6d} gamma={row['gamma']:2d} batch={row['batch']:2d} {row['mode']:6s} | "
            f"op {row['op_ms']:8.3f} ms | eager {row['eager_ms']:8.3f} ms | compiled {compiled} ms | "
            f"eager/op {row['eager_over_op']:6.2f}x | compiled/op {ratio_c}")


def bench_round_share(args) -> list[dict]:
    """Op time as a share of a full DSpark round on a Qwen3-4B-sized random target."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from dspark_hf import DSparkDraftModel

    config = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        target = Qwen3ForCausalLM(config).to(DTYPE).eval()
    context = 1024
    prompt = torch.randint(0, 151936, (1, context), device="cuda")
    results = []
    with torch.no_grad():
        for gamma in GAMMAS:
            draft = DSparkDraftModel.from_target(target, block_size=gamma, num_hidden_layers=5).eval()
            with torch.no_grad():
                draft.markov_head.markov_w2.weight.normal_(0, RANK ** -0.5)
            # target: prefill the context once, then time verify forwards of gamma + 1 tokens
            cache = DynamicCache()
            out = target(prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
            block = torch.randint(0, 151936, (1, gamma + 1), device="cuda")

            def verify():
                extra = cache.get_seq_length() - context
                if extra > 0:  # drop the last verify's tokens (a negative crop works on every version)
                    cache.crop(-extra)
                target(block, past_key_values=cache, use_cache=True, output_hidden_states=True)

            # draft: context from the target's hidden states, then one block forward
            dcache = draft.new_cache()
            features = torch.cat([out.hidden_states[i + 1] for i in draft.config.target_layer_ids], dim=-1)
            draft.add_context(dcache, features, torch.arange(context, device="cuda")[None])
            block_ids = torch.full((1, gamma), draft.config.mask_token_id, device="cuda")
            positions = torch.arange(context, context + gamma, device="cuda")[None]
            block_out = draft(block_ids, positions, dcache)
            U, Hs, anchor = block_out.logits, block_out.hidden_states, block_ids[:, 0]
            repeats = 5 if args.quick else 20
            t_verify = mean_call_ms(verify, repeats)
            t_draft = mean_call_ms(lambda: draft(block_ids, positions, dcache), repeats)
            t_op = mean_call_ms(lambda: serial_sample(draft, U, Hs, anchor, do_sample=True, backend="cuda"), repeats)
            t_eager = mean_call_ms(lambda: serial_sample(draft, U, Hs, anchor, do_sample=True, backend="reference"),
                                   repeats)
            round_op = t_verify + t_draft + t_op
            results.append({"gamma": gamma, "verify_ms": t_verify, "draft_ms": t_draft, "op_ms": t_op,
                            "eager_ms": t_eager, "round_ms_with_op": round_op, "op_share": t_op / round_op,
                            "eager_share": t_eager / (t_verify + t_draft + t_eager)})
            print(f"round gamma={gamma:2d}: verify {t_verify:.3f} ms, draft {t_draft:.3f} ms, op {t_op:.3f} ms "
                  f"({100 * t_op / round_op:.2f}% of the round), eager loop {t_eager:.3f} ms", flush=True)
            del draft, dcache, cache, out
            torch.cuda.empty_cache()
    if len(results) == len(GAMMAS):
        growth = (results[-1]["op_ms"] - results[0]["op_ms"]) / results[-1]["round_ms_with_op"]
        print(f"op cost growth gamma {GAMMAS[0]} -> {GAMMAS[-1]}: {100 * growth:.2f}% of a gamma-{GAMMAS[-1]} round "
              "(goal: within 1.5%)")
        results.append({"op_growth_share_4_to_16": growth})
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no torch.compile")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--compile-budget-s", type=float, default=240.0,
                        help="stop compiling new torch.compile variants after this many seconds")
    parser.add_argument("--round-share", action="store_true", help="also time full rounds on a Qwen3-4B-sized target")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_serial_op.py needs a CUDA GPU.")
    t0 = time.perf_counter()
    cuda_ops.load_extension()
    build_s = time.perf_counter() - t0
    info = {**capture_environment(), "extension_load_s": build_s}
    print(json.dumps(info), flush=True)
    results = {"info": info, "serial": bench_serial(args)}
    goal = [r for r in results["serial"] if r["gamma"] == 16 and r["vocab"] == 151936 and r["batch"] == 1]
    for r in goal:
        print(f"goal check (gamma 16, V 151936, batch 1, {r['mode']}): eager/op = {r['eager_over_op']:.2f}x "
              "(goal >= 5x)")
    if args.round_share:
        try:
            results["round_share"] = bench_round_share(args)
        except Exception as err:  # the serial numbers above still stand
            print(f"round-share measurement failed: {type(err).__name__}: {err}", flush=True)
            results["round_share_error"] = f"{type(err).__name__}: {err}"
    write_json_result(results, args.json)


if __name__ == "__main__":
    main()
