"""Accepted length over training: measured points, a fit, and what the fit predicts.

Each point is a draft measured by ``python -m dspark_hf.benchmarks.evaluation`` (a result file) and
the training it had seen: total optimiser steps from its fresh start (4 sequences each) and the
number of training sequences. The fit is tau = a + b * ln(steps) by least squares over the points
given with ``--fit`` (default: all), the usual shape of a slowly saturating curve; it is an
extrapolation, and says so.

    python benchmarks/tau_curve.py --dataset gsm8k --mode greedy \
        --point v1:1400:1929:results/tau_v1_dspark.json --point v2:3400:4832:results/tau_v2_dspark.json \
        --target 2.5 --out results/tau_curve.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_tau(result_file: str, dataset: str, mode: str) -> dict:
    """The one result in ``result_file`` for ``dataset``/``mode`` (error if none or several)."""
    results = json.loads(Path(result_file).read_text())["results"]
    matches = [v for k, v in results.items() if k.endswith(f"/{dataset}/{mode}")]
    if len(matches) != 1:
        raise SystemExit(f"{result_file}: expected one result for {dataset}/{mode}, found {len(matches)}")
    return matches[0]


def fit_log_steps(steps: list[float], taus: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of tau = a + b * ln(steps)."""
    xs = [math.log(s) for s in steps]
    mean_x, mean_y = sum(xs) / len(xs), sum(taus) / len(taus)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, taus)) / sxx
    return mean_y - b * mean_x, b


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--mode", default="greedy", choices=["greedy", "sample"])
    parser.add_argument("--point", action="append", required=True,
                        help="LABEL:TOTAL_STEPS:SEQUENCES:RESULT_FILE (repeat, in training order)")
    parser.add_argument("--fit", nargs="*", default=None, help="labels of the points to fit (default: all)")
    parser.add_argument("--target", type=float, action="append", default=None, help="tau to extrapolate to")
    parser.add_argument("--seconds-per-step", type=float, default=None,
                        help="measured wall seconds per training step, to turn predicted steps into hours")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    points = []
    for spec in args.point:
        label, steps, sequences, result_file = spec.split(":", 3)
        r = read_tau(result_file, args.dataset, args.mode)
        points.append({"label": label, "steps": int(steps), "sequences": int(sequences), "file": result_file,
                       "tau": r["tau"], "first_position_acceptance": r["per_position_acceptance"][0]})
    print(f"{args.dataset} {args.mode}: tau over training")
    print(f"{'point':>10} {'steps':>7} {'sequences':>9} {'tau':>6} {'acc@1':>6}")
    for p in points:
        print(f"{p['label']:>10} {p['steps']:>7} {p['sequences']:>9} {p['tau']:>6.3f} {p['first_position_acceptance']:>6.3f}")
    fitted = [p for p in points if args.fit is None or p["label"] in args.fit]
    report = {"dataset": args.dataset, "mode": args.mode, "points": points}
    if len(fitted) >= 2:
        a, b = fit_log_steps([p["steps"] for p in fitted], [p["tau"] for p in fitted])
        report["fit"] = {"form": "tau = a + b ln(steps)", "a": a, "b": b, "points": [p["label"] for p in fitted],
                         "gain_per_doubling": b * math.log(2)}
        print(f"fit over {[p['label'] for p in fitted]}: tau = {a:.3f} + {b:.4f} ln(steps)"
              f" (+{b * math.log(2):.3f} per doubling of steps)")
        for target in args.target or []:
            if b <= 0:
                print(f"tau {target}: not reached (the fit does not rise)")
                continue
            steps = math.exp((target - a) / b)
            entry = {"tau": target, "steps": steps}
            line = f"tau {target}: ~{steps:.3g} steps by the fit"
            if args.seconds_per_step:
                entry["hours"] = steps * args.seconds_per_step / 3600
                line += f", ~{entry['hours']:.3g} hours at {args.seconds_per_step} s/step"
            report.setdefault("predictions", []).append(entry)
            print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
