"""The ``dspark-hf`` command: ``dspark-hf bench|train|evaluate|profile ...``.

Each subcommand is the CLI of one module (``--help`` on it shows its options):
``bench`` -> :mod:`dspark_hf.bench`, ``train`` -> :mod:`dspark_hf.training`,
``evaluate`` -> :mod:`dspark_hf.evaluation`, ``profile`` -> :mod:`dspark_hf.profile_cli`.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"bench": "dspark_hf.bench", "train": "dspark_hf.training", "evaluate": "dspark_hf.evaluation",
            "profile": "dspark_hf.profile_cli"}


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
