"""The ``round`` stage of ``tests/gpu/gpu_checks.py``: full DSpark rounds through
``target.generate(assistant_model=draft)`` with a random Qwen3-4B-shaped bf16 target and a
DeepSpec-4B-shaped draft (5 layers, block 7, r = 256, confidence head), timed part by part, plus the
target's profiled SPS curve for 1-64 tokens.

Timing: GPU work is asynchronous, so each part is closed by a synchronisation (forward hooks on the
target, the draft and the LM head; a wrapper around the context ingest) before its wall time is
read; the serial loop and the scheduler end in host reads of their own. The parts of a round:
target forward (the verify step), draft forward (context ingest + block forward + lazy LM head),
serial loop (Markov bias, sampling, confidences and the policy's offers: the op or the reference
loop), scheduler (EOS check) and transformers' loop (everything else in generate's wall time:
acceptance, cache bookkeeping, the candidate generator's glue). The synchronisations cost a little
themselves; they make the split honest, not the round faster. Acceptance with random weights
means nothing: the timings are what count.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time

import torch

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def build_models(device: str, dry_run: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark_hf import DSparkDraftModel

    settings = dict(TINY if dry_run else QWEN3_4B)
    rope_theta = settings.pop("rope_theta", None)
    config = Qwen3Config(**settings, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if rope_theta is not None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(config)
    target = target.to(torch.bfloat16).eval()
    draft = DSparkDraftModel.from_target(target, block_size=7, num_hidden_layers=2 if dry_run else 5,
                                         markov_rank=16 if dry_run else 256, confidence_head=True)
    with torch.no_grad():  # a trained-looking Markov head (from_target starts it at zero)
        draft.markov_head.markov_w2.weight.normal_(0, draft.config.markov_rank ** -0.5)
        draft.markov_head.markov_w1.weight.normal_(0, 1)
    return target, draft.eval()


class PartTimer:
    """Synchronising timers: forward hooks on the target, a sync after the draft's block forward and
    its LM head (so the library's own draft/serial timers see finished GPU work), and a timed
    wrapper around the context ingest."""

    def __init__(self, target, draft, device: str):
        self.device = device
        self.target_calls: list[tuple[int, float]] = []  # (new tokens, seconds)
        self.ingest = 0.0
        self._start = 0.0
        self._handles = [
            target.register_forward_pre_hook(self._pre, with_kwargs=True),
            target.register_forward_hook(self._post_target, with_kwargs=True),
            draft.register_forward_hook(lambda *a: self.sync()),
            target.get_output_embeddings().register_forward_hook(lambda *a: self.sync()),
        ]
        self._draft = draft
        original = draft.add_context

        def timed_ingest(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            self.sync()
            self.ingest += time.perf_counter() - start
            return result

        draft.add_context = timed_ingest

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _pre(self, module, args, kwargs):
        self.sync()
        self._start = time.perf_counter()

    def _post_target(self, module, args, kwargs, output):
        self.sync()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.target_calls.append((int(ids.shape[1]) if ids is not None else -1, time.perf_counter() - self._start))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        del self._draft.add_context  # the instance attribute hid the method


def time_generation(target, draft, device: str, *, prompt_len: int, new_tokens: int, do_sample: bool) -> dict:
    """One generate call, split per round (ms, means over the rounds)."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, target.config.vocab_size - 10, (1, prompt_len), generator=gen).to(device)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=do_sample, assistant_model=draft)
    target.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up (op build, graphs)
    timer = PartTimer(target, draft, device)
    try:
        torch.manual_seed(0)
        timer.sync()
        start = time.perf_counter()
        target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        timer.sync()
        wall = time.perf_counter() - start
    finally:
        timer.remove()
    stats = draft.last_generation_stats
    rounds = stats.num_rounds
    prefill = timer.target_calls[0][1]  # the prompt's forward
    verify_calls = [t for _, t in timer.target_calls[1:]]
    parts = {
        "target_forward": sum(verify_calls),
        "draft_forward": timer.ingest + sum(r.draft_time for r in stats.rounds),
        "serial_loop": sum(r.serial_time for r in stats.rounds),
        "scheduler": sum(r.schedule_time for r in stats.rounds),
    }
    parts["transformers_loop"] = wall - prefill - sum(parts.values())
    ms = {k: v / rounds * 1e3 for k, v in parts.items()}
    round_ms = sum(ms.values())
    return {
        "rounds": rounds, "new_tokens": new_tokens, "verified_per_round": stats.verified_tokens / max(rounds, 1),
        "tau": stats.mean_accepted_length, "prefill_ms": prefill * 1e3, "wall_s": wall,
        "ms_per_round": ms, "round_ms": round_ms, "share": {k: v / round_ms for k, v in ms.items()},
        "dspark_own_share": (ms["serial_loop"] + ms["scheduler"]) / round_ms,
        "outside_forwards_share": (round_ms - ms["target_forward"] - ms["draft_forward"]) / round_ms,
        "verified_histogram": stats.scheduled_length_histogram(),
    }


def sps_curve(target, dry_run: bool) -> dict:
    from dspark_hf import profile_sps

    with tempfile.TemporaryDirectory() as cache:
        sps = profile_sps(target, 64, context_length=32 if dry_run else 256, warmup=0 if dry_run else 1,
                          repeats=1 if dry_run else 3, cache_dir=cache, use_cache=False, progress=False)
        files = glob.glob(os.path.join(cache, "sps", "*.json"))
        record = json.loads(open(files[0]).read()) if files else {}
    return {"sps": sps, "median_step_ms": [t * 1e3 for t in record.get("median_step_seconds", [])],
            "measured_sizes": record.get("measured_sizes"), "context_length": record.get("context_length")}


def run(rec, device: str, dry_run: bool) -> None:
    """The stage: build the models, the SPS curve, then generate under each serial-loop path."""
    from dspark_hf import FixedLengthPolicy, PrefixScheduler

    built = {}

    def build() -> dict:
        built["target"], built["draft"] = build_models(device, dry_run)
        return {"target_params_b": sum(p.numel() for p in built["target"].parameters()) / 1e9,
                "draft_params_m": sum(p.numel() for p in built["draft"].parameters()) / 1e6}

    rec.check("build-models", build)
    if not built:
        return
    target, draft = built["target"], built["draft"]
    curve = rec.check("sps-curve", lambda: sps_curve(target, dry_run))
    draft.generation_config.dspark_adaptive_drafting = False
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(7)  # every round verifies the block: every part runs
    shape = dict(prompt_len=32 if dry_run else 256, new_tokens=12 if dry_run else 64)
    configs = [("op", {"DSPARK_HF_CUDA_OP": "1", "DSPARK_HF_CUDA_GRAPH": "0"}, False),
               ("op-graphed", {"DSPARK_HF_CUDA_OP": "1", "DSPARK_HF_CUDA_GRAPH": "1"}, False),
               ("op-sample", {"DSPARK_HF_CUDA_OP": "1", "DSPARK_HF_CUDA_GRAPH": "0"}, True),
               ("reference", {"DSPARK_HF_CUDA_OP": "0", "DSPARK_HF_CUDA_GRAPH": "0"}, False)]
    if dry_run:  # no op on CPU: the reference loop runs under every name
        configs = [c for c in configs if c[0] != "op-graphed"]
    for name, env, sample in configs:
        os.environ.update(env)
        rec.check(f"round-{name}", lambda sample=sample: time_generation(target, draft, device, do_sample=sample,
                                                                           **shape))
    if curve and curve.get("ok"):
        os.environ.update(configs[0][1])
        draft.generation_config.dspark_verify_policy = PrefixScheduler(curve["sps"])
        rec.check("round-op-scheduler", lambda: time_generation(target, draft, device, do_sample=False, **shape))
