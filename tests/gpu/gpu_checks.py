"""The measuring stages of ``tests/gpu/run_gpu_checks.sh`` (one process per stage).

    python tests/gpu/gpu_checks.py STAGE --out DIR [--dry-run]

Stages (each writes ``DIR/STAGE.json`` and rewrites it after every item, so a stage cut short by
its time limit keeps what it measured):

* ``env``: versions, GPU, compiler.
* ``correctness``: the CUDA op against the PyTorch reference at V = 151,936, r = 256, gamma 7 and 16,
  bf16 (``tests/gpu/test_cuda_op.py``'s checks: greedy tokens exactly the argmax of the returned
  logits and the reference's tokens up to explained rounding, logits and confidences against the
  equations, bf16 rounding of ``U + B``), a chi-square test of sampled tokens at that vocabulary,
  CUDA-graph capture of the op and the op's own graphed replay.
* ``speed``: the op (eager launches and CUDA-graph replay) against the eager reference loop at 1 and
  64 rows, gamma 7 and 16; per-launch overhead (a problem too small for the kernels to matter) and
  achieved memory bandwidth (every position streams W2).
* ``round``: a random Qwen3-4B-shaped bf16 target and a DeepSpec-4B-shaped draft (5 layers, block 7,
  r = 256, confidence head) through ``target.generate(assistant_model=draft)``: each round's time
  split into target forward, draft forward, serial loop (op vs reference), scheduler and
  transformers' loop (synchronising hooks), and the profiled SPS curve for 1-64 tokens.
* ``summary``: ``DIR/summary.md`` from whatever JSON files are there (run after every stage).

``--dry-run`` runs the same code on CPU with tiny shapes and the reference loop standing in for the
op (what ``tests/test_gpu_script.py`` checks: the plumbing, not the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

STAGES = ("env", "correctness", "speed", "round")


# ----------------------------------------------------------------------------- recording
class Record:
    """One stage's results, rewritten to ``DIR/STAGE.json`` after every item."""

    def __init__(self, out: Path, stage: str, dry_run: bool):
        self.path = out / f"{stage}.json"
        self.data = {"stage": stage, "dry_run": dry_run, "status": "running", "started_unix": time.time(),
                     "items": {}}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def put(self, name: str, value) -> None:
        self.data["items"][name] = value
        self.save()

    def check(self, name: str, fn) -> dict | None:
        """Runs ``fn()`` (a dict of results); records it with ok / error and the seconds it took."""
        start = time.perf_counter()
        try:
            result = {"ok": True, **(fn() or {})}
        except Exception as err:  # record and go on: later items still run
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(err).__name__}: {err}"[:3000]}
        result["seconds"] = round(time.perf_counter() - start, 3)
        self.put(name, result)
        print(f"[{'ok' if result['ok'] else 'FAILED'}] {self.data['stage']}: {name} ({result['seconds']} s)",
              flush=True)
        return result

    def finish(self) -> None:
        self.data["status"] = "done"
        self.data["seconds"] = round(time.time() - self.data["started_unix"], 1)
        self.save()


# ----------------------------------------------------------------------------- shared helpers
def _setup(dry_run: bool):
    import torch

    if not dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device visible: run with --dry-run on a machine without a GPU")
    return "cpu" if dry_run else "cuda"


def _timer(device: str):
    """ms per call of fn: CUDA events on a GPU, perf_counter on CPU; warm-up calls first."""
    from dspark_hf.benchmarks.measuring import mean_call_ms

    def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
        return mean_call_ms(fn, repeats, warmup=warmup, device=device)

    return timed


def _reference_as_op(heads, U, H, anchor, *, do_sample, temperature, uniforms, fused_max_rows):
    """Dry run: the reference loop where the op would run (same signature as the op runner)."""
    import test_cuda_op as gpu

    return gpu.run_reference(heads, U, H, anchor, do_sample=do_sample, temperature=temperature, uniforms=uniforms)


def _op_call(dry_run: bool):
    """serial_sample_cuda, or the reference loop in a dry run; keyword graph= is accepted by both."""
    from dspark_hf.decoding import cuda_ops
    from dspark_hf.decoding.sampling import serial_sample

    if not dry_run:
        return cuda_ops.serial_sample_cuda

    def reference(draft, U, H, anchor, *, do_sample, temperature=1.0, uniforms=None, generator=None, graph=None):
        import test_cuda_op as gpu

        return serial_sample(draft, U, H, anchor, do_sample=do_sample, logits_processor=gpu.processors(temperature),
                             prefix_ids=anchor[:, None], generator=generator, backend="reference")

    return reference


# ----------------------------------------------------------------------------- stages
def stage_env(rec: Record, dry_run: bool) -> None:
    """Versions, GPU and compiler; exits non-zero when dspark_hf cannot be imported (e.g. an old
    transformers: the script then stops, since no other stage could run)."""
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
    for name, cmd in (("nvcc", ["nvcc", "--version"]), ("commit", ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
            info[name] = out[-1] if out else None
        except (OSError, subprocess.SubprocessError) as err:
            info[name] = f"unavailable ({type(err).__name__})"
    rec.put("environment", info)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    rec.put("transformers_ok", {"ok": (major, minor) >= (5, 24), "needed": ">=5.24"})
    result = rec.check("import dspark_hf", lambda: {"path": str(Path(__import__("dspark_hf").__file__).parent)})
    if not result["ok"]:
        rec.finish()
        sys.exit(f"dspark_hf does not import with transformers {transformers.__version__} (it needs >= 5.24): run "
                 "tests/gpu/prepare_wheelhouse.sh where PyPI is reachable and carry tests/gpu/wheels along")


def stage_correctness(rec: Record, dry_run: bool) -> None:
    import torch

    import test_cuda_op as gpu

    device = _setup(dry_run)
    run_op = _reference_as_op if dry_run else gpu.run_cuda_op
    big = dict(vocab=1000, rank=16, hidden=64) if dry_run else dict(vocab=151936, rank=256, hidden=512)
    bf16 = torch.bfloat16
    with torch.no_grad():
        for gamma in (7, 16):
            cases = [gpu.Case(f"bf16-g{gamma}-r1-greedy", big["vocab"], big["rank"], "vanilla", "markov", bf16, 1,
                              gamma, False, hidden=big["hidden"]),
                     gpu.Case(f"bf16-g{gamma}-r1-sample-T0.7", big["vocab"], big["rank"], "vanilla", "markov", bf16, 1,
                              gamma, True, 0.7, hidden=big["hidden"], seed=1),
                     gpu.Case(f"bf16-g{gamma}-r4-gated-greedy-calibrated", big["vocab"], big["rank"], "gated", "markov",
                              bf16, 4, gamma, False, hidden=big["hidden"], calibrated=True, seed=2),
                     gpu.Case(f"bf16-g{gamma}-r64-greedy-cublas", big["vocab"], big["rank"], "vanilla", "markov", bf16,
                              64, gamma, False, hidden=big["hidden"], seed=3)]
            for case in cases:
                rec.check(case.name, lambda case=case: gpu.run_case(case, device, run_op=run_op))
        dist_case = gpu.Case("distribution", big["vocab"], big["rank"], "vanilla", "markov", bf16, 64, 2, True, 0.7,
                             hidden=big["hidden"], seed=5)
        rec.check("chi-square-bf16-T0.7", lambda: gpu.check_distribution(device, run_op=run_op, calls=40 if dry_run else 100,
                                                                         rows=64, case=dist_case))
        if dry_run:
            rec.put("cuda-graph-capture", {"ok": None, "skipped": "dry run: no CUDA"})
            rec.put("graphed-replay", {"ok": None, "skipped": "dry run: no CUDA"})
        else:
            rec.check("cuda-graph-capture", lambda: _graph_capture(gpu, big))
            rec.check("graphed-replay", lambda: _graphed_replay(gpu, big))


def _graph_capture(gpu, big) -> dict:
    """A caller capturing the op in its own CUDA graph: replays equal eager calls, new inputs are read."""
    import torch

    for rows in (1, 8):
        case = gpu.Case("graph", big["vocab"], big["rank"], "vanilla", "markov", torch.bfloat16, rows, 7, True)
        heads = gpu.make_heads(case, "cuda")
        U, H, anchor, uniforms = gpu.make_inputs(case, "cuda")
        args = lambda: gpu._raw_op_args(heads, U, H, anchor, uniforms)  # noqa: E731
        eager = torch.ops.dspark_hf.serial_sample(*args())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.ops.dspark_hf.serial_sample(*args())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.dspark_hf.serial_sample(*args())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
        U2, H2, anchor2, uniforms2 = gpu.make_inputs(gpu.replace(case, seed=9), "cuda")
        U.copy_(U2), H.copy_(H2), anchor.copy_(anchor2), uniforms.copy_(uniforms2)
        graph.replay()
        fresh = torch.ops.dspark_hf.serial_sample(*args())
        torch.cuda.synchronize()
        assert torch.equal(captured[0], fresh[0]) and torch.equal(captured[2], fresh[2])
    return {"rows": [1, 8]}


def _graphed_replay(gpu, big) -> dict:
    """serial_sample_cuda(graph=True) is bit-identical to the eager op (gamma 7 sampling, 16 greedy)."""
    import torch

    from dspark_hf.decoding import cuda_ops

    for gamma, sample in ((7, True), (16, False)):
        case = gpu.Case("graphed", big["vocab"], big["rank"], "gated", "markov", torch.bfloat16, 1, gamma, sample, 0.7)
        heads = gpu.make_heads(case, "cuda")
        for seed in range(3):
            U, H, anchor, _ = gpu.make_inputs(gpu.replace(case, seed=seed), "cuda")
            outs = [cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=sample, temperature=0.7, graph=g,
                                                generator=torch.Generator("cuda").manual_seed(seed)) for g in (False, True)]
            torch.cuda.synchronize()
            for name in ("tokens", "logits", "confidences", "uniforms"):
                a, b = getattr(outs[0], name), getattr(outs[1], name)
                assert (a is None and b is None) or torch.equal(a, b), f"gamma {gamma}: {name} differ"
    return {"graphs_cached": len(cuda_ops._GRAPHS)}


def stage_speed(rec: Record, dry_run: bool) -> None:
    import torch

    import test_cuda_op as gpu
    from dspark_hf.decoding.sampling import serial_sample

    device = _setup(dry_run)
    timed = _timer(device)
    op = _op_call(dry_run)
    vocab, rank, hidden = (1000, 16, 64) if dry_run else (151936, 256, 2560)
    repeats = 3 if dry_run else 20
    esize = 2  # bf16
    with torch.no_grad():
        # per-launch overhead: kernels too small to matter (V = 256, r = 8, d = 64), gamma 16, one row
        def launches():
            case = gpu.Case("launch", 256, 8, "vanilla", "markov", torch.bfloat16, 1, 16, False, hidden=64)
            heads = gpu.make_heads(case, device)
            U, H, anchor, _ = gpu.make_inputs(case, device)
            eager = timed(lambda: op(heads, U, H, anchor, do_sample=False, graph=False), repeats * 5)
            graphed = None if dry_run else timed(lambda: op(heads, U, H, anchor, do_sample=False, graph=True), repeats * 5)
            host = _host_ms(lambda: op(heads, U, H, anchor, do_sample=False, graph=False), device, repeats * 5)
            n = 1 + 2 * case.gamma
            return {"gamma": 16, "kernel_launches": n, "eager_ms": eager, "graphed_ms": graphed, "host_issue_ms": host,
                    "per_launch_us": eager * 1e3 / n, "graph_saves_ms": None if graphed is None else eager - graphed}

        rec.check("launch-overhead", launches)
        for rows in (1, 64):
            for gamma in (7, 16):
                for mode in ("sample", "greedy") if rows == 1 else ("sample",):
                    sample = mode == "sample"
                    name = f"r{rows}-g{gamma}-{mode}"

                    def measure(rows=rows, gamma=gamma, sample=sample):
                        case = gpu.Case(name, vocab, rank, "vanilla", "markov", torch.bfloat16, rows, gamma, sample,
                                        hidden=hidden)
                        heads = gpu.make_heads(case, device)
                        U, H, anchor, _ = gpu.make_inputs(case, device)
                        ref_ms = timed(lambda: serial_sample(heads, U, H, anchor, do_sample=sample, backend="reference"),
                                       repeats)
                        op_ms = timed(lambda: op(heads, U, H, anchor, do_sample=sample, graph=False), repeats)
                        graph_ms = None if dry_run else timed(lambda: op(heads, U, H, anchor, do_sample=sample, graph=True),
                                                              repeats)
                        # every position streams W2 once and reads U, writes the fp32 logits
                        moved = gamma * (vocab * rank * esize + rows * vocab * (esize + 4))
                        best = min(t for t in (op_ms, graph_ms) if t is not None)
                        return {"rows": rows, "gamma": gamma, "mode": "sample" if sample else "greedy",
                                "path": "fused W2" if rows <= 4 else "cuBLAS bias", "reference_ms": ref_ms,
                                "op_ms": op_ms, "op_graphed_ms": graph_ms, "reference_over_op": ref_ms / best,
                                "bytes_per_call": moved, "achieved_gb_s": moved / (best * 1e-3) / 1e9}

                    rec.check(name, measure)
                    if not dry_run:
                        torch.cuda.empty_cache()


def _host_ms(fn, device: str, repeats: int) -> float:
    """Host time to issue one call (no synchronisation inside the timed loop)."""
    import torch

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = (time.perf_counter() - start) * 1e3 / repeats
    if device == "cuda":
        torch.cuda.synchronize()
    return elapsed


def stage_round(rec: Record, dry_run: bool) -> None:
    import round_profile

    round_profile.run(rec, _setup(dry_run), dry_run)


# ----------------------------------------------------------------------------- summary
def _load(out: Path) -> dict:
    found = {}
    for stage in STAGES:
        path = out / f"{stage}.json"
        if path.exists():
            try:
                found[stage] = json.loads(path.read_text())
            except json.JSONDecodeError:
                found[stage] = {"status": "unreadable", "items": {}}
    return found


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _round_summary_lines(items: dict, speed: dict) -> list[str]:
    """Markdown for the round stage, and the issue's targets with what was measured."""
    lines = []
    rounds = {k[len("round-"):]: v for k, v in items.items() if k.startswith("round-") and v.get("ok")}
    if rounds:
        parts = ["target_forward", "draft_forward", "serial_loop", "scheduler", "transformers_loop"]
        lines += ["", "## One DSpark round (ms per round, mean; share of the round)", "",
                  "| serial loop path | " + " | ".join(parts) + " | round | verified/round |",
                  "|---|" + "---|" * (len(parts) + 2)]
        for name, v in rounds.items():
            cells = [f"{v['ms_per_round'][p]:.3f} ({100 * v['share'][p]:.1f}%)" for p in parts]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {v['round_ms']:.3f} | {v['verified_per_round']:.2f} |")
    curve = items.get("sps-curve", {})
    if curve.get("ok"):
        sps = curve["sps"]
        picks = [b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if b <= len(sps)]
        lines += ["", f"SPS curve (target steps/s, B new tokens on a {curve.get('context_length')}-token context): "
                  + ", ".join(f"B={b}: {sps[b - 1]:.1f}" for b in picks)]
    lines += ["", "## Targets", ""]
    op = rounds.get("op")
    if op:
        serial = op["share"]["serial_loop"]
        lines.append(f"- serial loop <= 1% of a round with the op: {100 * serial:.2f}% "
                     f"({'met' if serial <= 0.01 else 'missed'})")
        own = op["dspark_own_share"]
        lines.append(f"- DSpark's own per-round work outside the two forwards (serial loop + scheduler) <= 5%: "
                     f"{100 * own:.2f}% ({'met' if own <= 0.05 else 'missed'}); everything outside the two forwards, "
                     f"transformers' loop included: {100 * op['outside_forwards_share']:.2f}%")
    for key in ("r1-g16-sample", "r1-g16-greedy"):
        v = speed.get(key, {})
        if v.get("ok"):
            ratio = v["reference_over_op"]
            lines.append(f"- op >= 5x the eager loop at one row, gamma 16 ({v['mode']}): {ratio:.2f}x "
                         f"({'met' if ratio >= 5 else 'missed'}; best of eager launches and graph replay)")
    if len(lines) and lines[-1] == "":
        lines.append("- (no measurements yet)")
    return lines


def write_summary(out: Path) -> Path:
    """``summary.md`` from the stage files present (a cut-short run summarises what it has); no
    torch import, so it is quick to run after every stage."""
    data = _load(out)
    lines = ["# dspark_hf GPU checks", ""]
    env = data.get("env", {}).get("items", {}).get("environment", {})
    if env:
        lines += [f"- date (UTC): {env.get('utc')}", f"- device: {env.get('gpu', 'CPU (dry run)')}, "
                  f"{env.get('sm_count', '-')} SMs, {env.get('memory_gib', '-')} GiB",
                  f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env.get('transformers')}, "
                  f"nvcc: {env.get('nvcc')}, commit {env.get('commit')}", ""]
    lines += ["| stage | status | items ok | items failed |", "|---|---|---|---|"]
    for stage in STAGES:
        st = data.get(stage)
        if st is None:
            lines.append(f"| {stage} | not run | - | - |")
            continue
        items = [v for v in st.get("items", {}).values() if isinstance(v, dict) and "ok" in v]
        lines.append(f"| {stage}{' (dry run)' if st.get('dry_run') else ''} | {st.get('status')} | "
                     f"{sum(1 for v in items if v['ok'])} | {sum(1 for v in items if v['ok'] is False)} |")
    failed = [(s, k, v.get("error", "")) for s, st in data.items() for k, v in st.get("items", {}).items()
              if isinstance(v, dict) and v.get("ok") is False]
    if failed:
        lines += ["", "## Failures", ""] + [f"- {s} / {k}: {e[:400]}" for s, k, e in failed]
    corr = data.get("correctness", {}).get("items", {})
    if corr:
        lines += ["", "## Op vs reference", "", "| check | ok | rows identical | max abs logit diff | notes |",
                  "|---|---|---|---|---|"]
        for name, v in corr.items():
            note = v.get("skipped") or (f"p = {_fmt(v.get('p_position1'), 4)}, power p = "
                                        f"{_fmt(v.get('p_position1_without_temperature'), 8)}"
                                        if "p_position1" in v else "; ".join(v.get("divergences", [])[:2]))
            lines.append(f"| {name} | {v.get('ok')} | {v.get('rows_identical', '-')}/{v.get('rows', '-')} | "
                         f"{_fmt(v.get('logit_max_abs_diff'), 4)} | {note} |")
    speed = data.get("speed", {}).get("items", {})
    if speed:
        lines += ["", "## Op speed (ms per block)", "", "| rows | gamma | mode | path | reference | op | op graphed | "
                  "reference/op | GB/s |", "|---|---|---|---|---|---|---|---|---|"]
        for name, v in speed.items():
            if "rows" in v:
                lines.append(f"| {v['rows']} | {v['gamma']} | {v['mode']} | {v['path']} | {_fmt(v['reference_ms'])} | "
                             f"{_fmt(v['op_ms'])} | {_fmt(v['op_graphed_ms'])} | {_fmt(v['reference_over_op'], 2)}x | "
                             f"{_fmt(v['achieved_gb_s'], 0)} |")
        launch = speed.get("launch-overhead", {})
        if launch.get("ok"):
            lines += ["", f"Launch overhead (V = 256, gamma 16, {launch['kernel_launches']} kernels): eager "
                      f"{_fmt(launch['eager_ms'])} ms per call = {_fmt(launch['per_launch_us'], 1)} us per launch; "
                      f"graphed {_fmt(launch['graphed_ms'])} ms; host issue time {_fmt(launch['host_issue_ms'])} ms."]
    lines += _round_summary_lines(data.get("round", {}).get("items", {}), speed)
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=(*STAGES, "summary"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference loop for the op")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "summary":
        print(write_summary(args.out))
        return
    if not args.dry_run and args.stage != "env":  # the build stage compiled it; this loads the cached build
        from dspark_hf.decoding import cuda_ops

        cuda_ops.load_extension()
    rec = Record(args.out, args.stage, args.dry_run)
    {"env": stage_env, "correctness": stage_correctness, "speed": stage_speed, "round": stage_round}[args.stage](
        rec, args.dry_run)
    rec.finish()


if __name__ == "__main__":
    main()
