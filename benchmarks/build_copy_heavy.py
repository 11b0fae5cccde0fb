"""Builds ``dspark_hf/benchmarks/eval_prompts/copy-heavy.jsonl``: chat prompts whose answers copy long spans.

Issue 29 asks that DSpark's hybrid (draft + context lookup) never fall behind transformers' prompt
lookup, measured on prompts with long copied spans, built from permissively licensed text and never
from the evaluation sets. This script writes such a set from the Python standard library that ships
with the interpreter (source code and docstrings; Python Software Foundation License 2.0, a permissive
licence), so it runs offline and needs nothing but Python itself:

* ``edit``: rename an identifier in a stdlib function, or add type hints to it, returning the whole function;
* ``quote``: a module's documentation, to be quoted word for word and then summarised;
* ``choice``: multiple choice among four stdlib docstrings, answered by letter and repeating the option.

The set is written once and committed: stdlib text changes between Python versions, so the file,
not this script, is the benchmark (its header line names the Python version it came from).

    python benchmarks/build_copy_heavy.py            # rewrites the packaged file
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import random
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "dspark_hf" / "benchmarks" / "eval_prompts" / "copy-heavy.jsonl"

# (module, function, identifier to rename) for the edit prompts: 8-30 line pure-Python functions.
EDIT_FUNCTIONS = [
    ("textwrap", "indent", "prefix"),
    ("fnmatch", "filter", "names"),
    ("colorsys", "rgb_to_hsv", "maxc"),
    ("shlex", "quote", "s"),
    ("fnmatch", "fnmatch", "name"),
    ("heapq", "nsmallest", "iterable"),
    ("statistics", "median", "data"),
    ("calendar", "monthrange", "year"),
]
HINT_FUNCTIONS = [
    ("colorsys", "hls_to_rgb"),
    ("textwrap", "dedent"),
    ("textwrap", "shorten"),
    ("statistics", "median_low"),
    ("statistics", "fmean"),
    ("difflib", "get_close_matches"),
    ("string", "capwords"),
    ("html", "escape"),
]
QUOTE_MODULES = ["heapq", "json", "statistics", "difflib", "sched", "tempfile", "collections", "colorsys"]
CHOICE_POOL = [
    ("os.path", "join"), ("os.path", "splitext"), ("shutil", "copytree"), ("shutil", "which"),
    ("textwrap", "fill"), ("textwrap", "dedent"), ("heapq", "merge"), ("heapq", "nlargest"),
    ("bisect", "bisect_left"), ("statistics", "pstdev"), ("statistics", "mode"), ("difflib", "unified_diff"),
    ("json", "dumps"), ("json", "loads"), ("fnmatch", "fnmatchcase"), ("glob", "glob"),
    ("tempfile", "mkdtemp"), ("tempfile", "NamedTemporaryFile"), ("functools", "reduce"), ("itertools", "accumulate"),
    ("html", "unescape"), ("shlex", "split"), ("calendar", "isleap"), ("string", "capwords"),
]


def _object(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _source(module: str, name: str) -> str:
    return inspect.getsource(_object(module, name)).rstrip()


def _paragraphs(text: str) -> str:
    return re.sub(r"\n\s*\n+", "\n\n", inspect.cleandoc(text)).strip()


def edit_prompts(rng: random.Random) -> list[str]:
    prompts = []
    for module, name, identifier in EDIT_FUNCTIONS:
        new = rng.choice(["value", "item", "entry", "token"]) + "_" + identifier.strip("_")
        prompts.append(f"Rename `{identifier}` to `{new}` everywhere in this function from Python's `{module}` module "
                       f"and return the complete updated function, nothing else changed:\n\n```python\n"
                       f"{_source(module, name)}\n```")
    for module, name in HINT_FUNCTIONS:
        prompts.append(f"Add type hints to this function from Python's `{module}` module. Return the whole function "
                       f"with its docstring and body unchanged:\n\n```python\n{_source(module, name)}\n```")
    return prompts


def quote_prompts() -> list[str]:
    prompts = []
    for module in QUOTE_MODULES:
        doc = _paragraphs(importlib.import_module(module).__doc__)
        prompts.append(f"Here is the documentation of Python's `{module}` module:\n\n{doc}\n\n"
                       "First quote its three most important sentences word for word, each on its own line, "
                       "then summarise the module in two sentences.")
    return prompts


def choice_prompts(rng: random.Random, count: int = 8) -> list[str]:
    prompts = []
    for _ in range(count):
        options = rng.sample(CHOICE_POOL, 4)
        answer = rng.randrange(4)
        docs = [inspect.getdoc(_object(m, n)).split("\n\n")[0].replace("\n", " ") for m, n in options]
        module, name = options[answer]
        lines = [f"Which option describes the function `{module}.{name}` of the Python standard library?", ""]
        lines += [f"{'ABCD'[i]}) {doc}" for i, doc in enumerate(docs)]
        lines += ["", "Answer with the letter, then repeat the text of that option exactly."]
        prompts.append("\n".join(lines))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    groups = {"edit": edit_prompts(rng), "quote": quote_prompts(), "choice": choice_prompts(rng)}
    # Interleave the kinds so that the first N prompts (bench --num-prompts N) mix all three.
    order = [(kind, text) for row in zip(*[[(k, t) for t in v] for k, v in groups.items()]) for kind, text in row]
    order += [(k, t) for k, v in groups.items() for t in v[len(groups["quote"]):]]
    with args.out.open("w") as f:
        for kind, text in order:
            f.write(json.dumps({"turns": [text], "kind": kind,
                                "source": f"Python {platform.python_version()} standard library (PSF-2.0)"}) + "\n")
    print(f"wrote {len(order)} prompts to {args.out}")


if __name__ == "__main__":
    main()
