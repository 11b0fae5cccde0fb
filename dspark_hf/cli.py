"""The ``dspark-hf`` command: ``dspark-hf bench|train|datagen|evaluate|profile|export ...``.

Each subcommand is the CLI of one tooling module (``--help`` on it shows its options):
``bench`` -> :mod:`dspark_hf.benchmarks.bench_cli`, ``train`` -> :mod:`dspark_hf.training.train_cli`,
``datagen`` -> :mod:`dspark_hf.training.datagen`,
``evaluate`` -> :mod:`dspark_hf.benchmarks.evaluation`, ``profile`` -> :mod:`dspark_hf.benchmarks.profile_cli`,
``export`` -> :mod:`dspark_hf.hub.export_cli`.
"""

from __future__ import annotations

import importlib
import sys

# Imported only when its subcommand runs, so `dspark-hf <command>` loads one tool.
COMMANDS = {"bench": "dspark_hf.benchmarks.bench_cli", "train": "dspark_hf.training.train_cli",
            "datagen": "dspark_hf.training.datagen", "evaluate": "dspark_hf.benchmarks.evaluation",
            "profile": "dspark_hf.benchmarks.profile_cli", "export": "dspark_hf.hub.export_cli"}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        names = "|".join(COMMANDS)
        print(f"usage: dspark-hf {{{names}}} [options]   (dspark-hf <command> --help for its options)",
              file=sys.stderr)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
