"""The ``dspark-hf`` command: ``dspark-hf datagen|train|evaluate|bench|profile|export ...``.

Each subcommand is the CLI of one tooling module (``--help`` on it shows its options):
``datagen`` -> :mod:`dspark_hf.training.datagen`, ``train`` -> :mod:`dspark_hf.training.train_cli`,
``evaluate`` -> :mod:`dspark_hf.benchmarks.evaluate_cli`, ``bench`` -> :mod:`dspark_hf.benchmarks.bench_cli`,
``profile`` -> :mod:`dspark_hf.benchmarks.profile_cli`, ``export`` -> :mod:`dspark_hf.hub.export_cli`.
"""

from __future__ import annotations

import importlib
import sys

# Imported only when its subcommand runs, so `dspark-hf <command>` loads one tool. In the order of
# making a draft: its data, training, its quality, its speed, the target's step rates, publishing.
COMMANDS = {"datagen": "dspark_hf.training.datagen", "train": "dspark_hf.training.train_cli",
            "evaluate": "dspark_hf.benchmarks.evaluate_cli", "bench": "dspark_hf.benchmarks.bench_cli",
            "profile": "dspark_hf.benchmarks.profile_cli", "export": "dspark_hf.hub.export_cli"}
# One line per command for `dspark-hf --help` (kept here so the help loads no tool).
SUMMARIES = {
    "datagen": "the on-policy corpus: the target answers a prompt plan into resumable shards",
    "train": "train a DSpark (or DFlash) draft for a target, stage by stage (docs/training.md)",
    "evaluate": "accepted length tau and per-position acceptance of drafts, full block verified",
    "bench": "speed against the target alone and the alternatives, outputs checked (docs/performance.md)",
    "profile": "measure the target's step rates ahead of time (disk cache)",
    "export": "a Hub-ready, vLLM, speculators or DeepSpec folder from a saved draft (docs/formats.md)",
}


def usage() -> str:
    """The text of ``dspark-hf --help``: the usage line and one line per command."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: dspark-hf {{{'|'.join(COMMANDS)}}} [options]   (dspark-hf <command> --help for its options)",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {SUMMARIES[name]}" for name in COMMANDS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Runs ``dspark-hf <command> [options]``; ``--help`` (or no command) lists the commands."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])
        # Asked-for help is the command's output; a wrong command is an error, on stderr.
        print(usage(), file=sys.stdout if asked else sys.stderr)
        if argv and not asked:
            print(f"dspark-hf: unknown command {argv[0]!r}", file=sys.stderr)
        raise SystemExit(0 if asked else 2)
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
