"""Names that moved keep answering at their former homes, as the same objects.

The README quickstart of earlier versions ran ``from dspark_hf.training.smollm2 import load_smollm2``,
and the benchmarks took ``chat_prompt_ids`` / ``trim_after_eos`` from ``dspark_hf.training.data``;
both now re-export from :mod:`dspark_hf.demo_target` and :mod:`dspark_hf.chat_text`.
``python -m dspark_hf.benchmarks.evaluation`` (in docs, model cards and result files) still runs
``dspark-hf evaluate``, and its library's names answer there (their home is ``dspark_hf.benchmarks.acceptance``).
The CPU engine's names (``dspark_cpu``, formerly ``dspark_hf.kernels.cpu_*``) are checked with the engine
(``cpu_engine/tests/test_cpu_engine_hooks.py``: ``dspark_hf.optimize_for_cpu`` is the engine's).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dspark_hf.chat_text
import dspark_hf.demo_target

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET_NAMES = ["load_smollm2", "gguf_path", "dense_dir", "is_available", "mask_token_id", "MODEL_NAME",
                     "MASK_TOKEN"]
CHAT_NAMES = ["chat_prompt_ids", "encode_prompt", "has_chat_template", "trim_after_eos"]


@pytest.mark.parametrize("name", DEMO_TARGET_NAMES)
def test_the_old_demo_target_path_gives_the_same_objects(name):
    from dspark_hf.training import smollm2

    assert getattr(smollm2, name) is getattr(dspark_hf.demo_target, name)


def test_the_old_quickstart_import_line_still_works():
    from dspark_hf.training.smollm2 import load_smollm2, mask_token_id

    assert load_smollm2 is dspark_hf.demo_target.load_smollm2
    assert mask_token_id is dspark_hf.demo_target.mask_token_id


@pytest.mark.parametrize("name", CHAT_NAMES)
def test_the_chat_helpers_answer_at_training_data(name):
    from dspark_hf.training import data

    assert getattr(data, name) is getattr(dspark_hf.chat_text, name)
    assert name in data.__all__


def test_datagen_still_offers_chat_prompt_ids():
    from dspark_hf.training import datagen

    assert datagen.chat_prompt_ids is dspark_hf.chat_text.chat_prompt_ids


def test_the_evaluation_library_keeps_its_functions():
    """The library moved to benchmarks.acceptance (so that `python -m ...evaluation` and the command import it
    and not each other); the old module still offers its names."""
    from dspark_hf.benchmarks import acceptance, evaluate_cli, evaluation

    for name in ("left_padded", "measure_acceptance", "tau_table"):
        assert getattr(evaluation, name) is getattr(acceptance, name)
    assert evaluate_cli.measure_acceptance is acceptance.measure_acceptance
    assert evaluate_cli.tau_table is acceptance.tau_table


@pytest.mark.parametrize("module", ["dspark_hf.benchmarks.evaluation", "dspark_hf.benchmarks.evaluate_cli"])
def test_both_evaluation_module_paths_run_the_cli(module, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dspark-hf evaluate") and "--drafts" in result.stdout
    assert "RuntimeWarning" not in result.stderr  # runpy's warning about a module imported twice


def test_public_module_paths_are_the_moved_modules_themselves():
    """Hub remote code and user code import these paths; each is the very module object of its new
    home, so classes, private helpers and monkeypatching behave as before the move."""
    import importlib

    import dspark_hf
    from dspark_hf.decoding import custom_generate
    from dspark_hf.model import configuration_dspark, modeling_dspark

    for public, home in (("dspark_hf.modeling_dspark", modeling_dspark),
                         ("dspark_hf.configuration_dspark", configuration_dspark),
                         ("dspark_hf.custom_generate", custom_generate)):
        assert importlib.import_module(public) is home
    from dspark_hf.modeling_dspark import DSparkDraftModel
    from dspark_hf.configuration_dspark import DSparkConfig
    from dspark_hf.custom_generate import run_custom_generate
    from dspark_hf.hub import export, run_custom_generate as hub_run_custom_generate
    from dspark_hf.scheduler import PrefixScheduler, shared_cost_model
    from dspark_hf.scheduling.policies import PrefixScheduler as home_scheduler

    assert DSparkDraftModel is dspark_hf.DSparkDraftModel and DSparkConfig is dspark_hf.DSparkConfig
    assert hub_run_custom_generate is run_custom_generate and export is dspark_hf.export
    assert PrefixScheduler is home_scheduler and shared_cost_model is dspark_hf.shared_cost_model
    for name in dspark_hf.__all__:
        assert getattr(dspark_hf, name) is not None, name
