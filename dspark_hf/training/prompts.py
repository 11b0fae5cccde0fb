"""The prompts a target answers for its draft's training data: a JSONL file, or the built-in plan.

``--prompts FILE``: one JSON object per line, either

* ``{"prompt": "..."}``: one user turn; or
* ``{"turns": [...]}``: a conversation the target continues. Items are strings, which alternate
  user, assistant, user, ... from the first, or ``{"role", "content"}`` messages; the last turn must
  be the user's (the target answers it). An evaluation-set file whose ``turns`` are successive user
  questions without answers is not this shape: write one ``{"prompt": ...}`` per question.

Blank lines are skipped; other keys (``"id"``, ``"source"``, ...) are kept as the prompt's
``detail``/``source``. A line that breaks these rules stops the run with its line number.

Without a file, the built-in plan is every source of :mod:`dspark_hf.training.prompt_sources`
(ShareGPT, DeepMind mathematics, CHAMP, code from documented Python packages), as
``python -m dspark_hf.training.datagen`` makes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .prompt_sources import SOURCES, Prompt

ROLES = ("system", "user", "assistant")


class PromptFileError(ValueError):
    """A ``--prompts`` line that is not a prompt; the message names the file, the line and the fix."""


def _turns(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise PromptFileError(f'{where}: "turns" must be a non-empty list of strings or {{"role", "content"}} messages.')
    turns = []
    for position, turn in enumerate(value):
        if isinstance(turn, str):
            turns.append(("user" if position % 2 == 0 else "assistant", turn))
        elif isinstance(turn, dict) and turn.get("role") in ROLES and isinstance(turn.get("content"), str):
            turns.append((turn["role"], turn["content"]))
        else:
            raise PromptFileError(f'{where}: turn {position + 1} is neither a string nor a message with a "role" '
                                  f"({', '.join(ROLES)}) and a string \"content\".")
    if turns[-1][0] != "user":
        raise PromptFileError(f"{where}: the last turn is the {turns[-1][0]}'s; the target answers a user turn, so "
                              "end the conversation with one (strings alternate user, assistant, user, ...).")
    return tuple(turns)


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """The prompts of a ``--prompts`` JSONL file, in file order (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"--prompts {path}: no such file.")
    prompts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"--prompts {path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptFileError(f"{where}: not JSON ({error.msg}); write one JSON object per line.") from None
            if not isinstance(record, dict):
                raise PromptFileError(f'{where}: a JSON object with "prompt" or "turns" is expected, got '
                                      f"{type(record).__name__}.")
            source, detail = str(record.get("source", path.stem)), str(record.get("id", f"line{number}"))
            if "prompt" in record:
                if not isinstance(record["prompt"], str) or not record["prompt"].strip():
                    raise PromptFileError(f'{where}: "prompt" must be a non-empty string.')
                prompts.append(Prompt(record["prompt"], source, detail))
            elif "turns" in record:
                turns = _turns(record["turns"], where)
                prompts.append(Prompt(turns[-1][1], source, detail, turns if len(turns) > 1 else ()))
            else:
                raise PromptFileError(f'{where}: the object has neither "prompt" nor "turns" (keys: '
                                      f'{", ".join(sorted(record)) or "none"}); give one of them.')
    if not prompts:
        raise PromptFileError(f"--prompts {path}: the file holds no prompt.")
    return prompts


def file_source_name(path: str | Path) -> str:
    """How a data folder's config names a prompts file: its name and a hash of its bytes, so answers
    made from another version of the file are never mixed with these."""
    path = Path(path)
    return f"file:{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


BUILTIN_SOURCES = tuple(SOURCES)

__all__ = ["BUILTIN_SOURCES", "PromptFileError", "file_source_name", "read_prompts_file"]
