"""The seams between the DSpark core and the CPU engine, as the core sees them without the engine: loading it
(dspark_hf.cpu_engine: a logged fallback to the stock model, a clear ImportError for dspark_hf.optimize_for_cpu)
and the hooks it plugs into (dspark_hf.engine_hooks). With the engine installed its own tests cover it
(cpu_engine/tests/test_cpu_engine_hooks.py)."""

import logging

import pytest
import torch

import dspark_hf
from dspark_hf import cpu_engine, engine_hooks
from tiny_models import random_target


@pytest.fixture
def no_engine(monkeypatch):
    """As if the CPU engine were not installed: the seam looks for a module that does not exist."""
    monkeypatch.setattr(cpu_engine, "ENGINE_MODULE", "dspark_cpu_not_installed_here")
    monkeypatch.setattr(cpu_engine, "_warned", [])


def test_without_the_engine_the_stock_model_runs_and_that_is_logged(no_engine, caplog):
    model = random_target("llama", num_layers=1)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="dspark_hf.cpu_engine"):
        assert cpu_engine.prepare_for_cpu(model, packed_min_rows=1) is model
        assert cpu_engine.prepare_for_cpu(model) is model
    first, second = [r for r in caplog.records if r.name == "dspark_hf.cpu_engine"]
    assert first.levelno == logging.WARNING and second.levelno == logging.INFO  # said once loudly, never silent
    assert "not installed" in first.getMessage() and "pip install -e ./cpu_engine" in first.getMessage()
    assert "stock" in first.getMessage()
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert not cpu_engine.engine_available()


def test_without_the_engine_its_names_raise_an_import_error_that_says_how_to_install_it(no_engine):
    with pytest.raises(ImportError, match=r"pip install -e \./cpu_engine"):
        dspark_hf.optimize_for_cpu
    with pytest.raises(cpu_engine.CpuEngineNotInstalled):
        cpu_engine.load_engine()
    with pytest.raises(AttributeError):  # other missing names stay AttributeErrors
        dspark_hf.no_such_name


def test_an_engine_that_is_there_but_broken_is_not_reported_as_missing(monkeypatch, tmp_path):
    (tmp_path / "engine_missing_a_dependency").mkdir()
    (tmp_path / "engine_missing_a_dependency" / "__init__.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cpu_engine, "ENGINE_MODULE", "engine_missing_a_dependency")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here") as raised:
        cpu_engine.load_engine()
    assert not isinstance(raised.value, cpu_engine.CpuEngineNotInstalled)


def test_the_hooks_do_nothing_without_engines_and_merge_what_engines_say(monkeypatch):
    model, layer = random_target("llama", num_layers=1), torch.nn.Linear(4, 4)
    monkeypatch.setattr(engine_hooks, "_ENGINES", {})
    assert engine_hooks.backend_fingerprint(model) == {} and engine_hooks.pack_like(model.lm_head, layer) is layer
    engine_hooks.register_engine("b", fingerprint=lambda m: {"level": 2})
    engine_hooks.register_engine("a", fingerprint=lambda m: {}, pack_like=lambda source, module: module)
    assert engine_hooks.backend_fingerprint(model) == {"b": {"level": 2}}  # an engine that did nothing adds nothing
    engine_hooks.register_engine("b", fingerprint=lambda m: {"level": 3})  # registering again replaces
    assert engine_hooks.backend_fingerprint(model) == {"b": {"level": 3}}
    assert set(engine_hooks.registered_engines()) == {"a", "b"}
