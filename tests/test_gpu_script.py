"""tests/gpu/run_gpu_checks.sh on CPU (DRY_RUN=1): the plumbing of the one-command GPU check.

The dry run installs a wheel from a local folder, runs every stage of the quick mode with tiny
shapes (the reference loop standing in for the op), writes each stage's JSON, the summary and the
log into the results folder, and stays within what the device tool brings back. A stage over its
time limit is killed, reported and followed by the next one.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "run_gpu_checks.sh"
STAGE_FILES = ("env.json", "correctness.json", "speed.json", "round.json")


def _gpu_checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "tests" / "gpu" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_wheel(folder: Path) -> Path:
    """A valid pure-Python wheel holding one module, built by hand (no network, no build tools)."""
    name, version = "dspark_wheelcheck", "0.1"
    files = {f"{name}.py": b"VALUE = 42\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def _run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DRY_RUN": "1", "QUICK": "1", "RESULTS_DIR": str(tmp_path / "out"),
                "WHEELS_DIR": str(tmp_path / "wheels"), "DEPS_DIR": str(tmp_path / "deps"), "PYTHON": sys.executable,
                "OMP_NUM_THREADS": "1", **env}
    full_env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT)], env=full_env, capture_output=True, text=True, timeout=900)


def test_scripts_parse():
    for script in ("run_gpu_checks.sh", "prepare_wheelhouse.sh"):
        result = subprocess.run(["bash", "-n", str(ROOT / "tests" / "gpu" / script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_quick_dry_run_writes_every_stage_result(tmp_path):
    _tiny_wheel(tmp_path / "wheels")
    result = _run(tmp_path)
    out = tmp_path / "out"
    log = (out / "run.log").read_text() if (out / "run.log").exists() else result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    # the wheel was installed from the local folder
    assert (tmp_path / "deps" / "dspark_wheelcheck.py").read_text() == "VALUE = 42\n"
    # what comes back from the device tool: at most 8 plain files with plain names
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert set(STAGE_FILES) | {"summary.md", "run.log"} <= set(files), files
    for name in STAGE_FILES:
        data = json.loads((out / name).read_text())
        assert data["status"] == "done" and data["dry_run"] is True, name
        failed = {k: v for k, v in data["items"].items() if isinstance(v, dict) and v.get("ok") is False}
        assert not failed, (name, failed)
    correctness = json.loads((out / "correctness.json").read_text())["items"]
    assert {f"bf16-g{g}-r1-greedy" for g in (7, 16)} <= set(correctness)
    assert correctness["chi-square-bf16-T0.7"]["p_position1_without_temperature"] < 1e-6  # the test has power
    speed = json.loads((out / "speed.json").read_text())["items"]
    assert {"launch-overhead", "r1-g16-greedy", "r64-g16-sample"} <= set(speed)
    rounds = json.loads((out / "round.json").read_text())["items"]
    assert len(rounds["sps-curve"]["sps"]) == 64
    split = rounds["round-op"]["ms_per_round"]
    assert set(split) == {"target_forward", "draft_forward", "serial_loop", "scheduler", "transformers_loop"}
    assert abs(sum(rounds["round-op"]["share"].values()) - 1.0) < 1e-6
    summary = (out / "summary.md").read_text()
    for text in ("## Op vs reference", "## Op speed", "## One DSpark round", "## Targets", "SPS curve",
                 "[ok]     wheels: dspark_wheelcheck", "[ok]     round", "[skipped] build: dry run"):
        assert text in summary, text


def test_a_stage_over_its_limit_is_cut_and_reported(tmp_path):
    result = _run(tmp_path, STAGE_TIMEOUT_S="2")
    out = tmp_path / "out"
    assert result.returncode != 0
    assert json.loads((out / "env.json").read_text())["status"] == "done"  # earlier results are kept
    summary = (out / "summary.md").read_text()
    assert summary.count("timed out after 2 s") == 3, summary  # correctness, speed, round
    assert "[none]   wheels" in summary


def test_record_rewrites_its_file_after_every_item(tmp_path):
    gc = _gpu_checks()
    rec = gc.Record(tmp_path, "speed", dry_run=True)
    assert json.loads((tmp_path / "speed.json").read_text())["status"] == "running"
    rec.check("first", lambda: {"ms": 1.5})
    assert json.loads((tmp_path / "speed.json").read_text())["items"]["first"]["ms"] == 1.5
    rec.check("broken", lambda: 1 / 0)  # recorded, not raised: later items still run
    data = json.loads((tmp_path / "speed.json").read_text())
    assert data["items"]["broken"]["ok"] is False and "ZeroDivisionError" in data["items"]["broken"]["error"]
    # a summary of this cut-short run says what ran, what failed and what did not run
    summary = gc.write_summary(tmp_path).read_text()
    assert "| speed (dry run) | running | 1 | 1 |" in summary and "| round | not run |" in summary
    assert "speed / broken: ZeroDivisionError" in summary
    rec.finish()
    assert json.loads((tmp_path / "speed.json").read_text())["status"] == "done"


@pytest.mark.parametrize("stage", ["env"])
def test_env_stage_stops_the_run_when_dspark_hf_cannot_import(tmp_path, stage):
    gc = _gpu_checks()
    rec = gc.Record(tmp_path, stage, dry_run=True)
    real_import = __import__

    def failing_import(name, *args, **kwargs):
        if name == "dspark_hf":
            raise ImportError("transformers 5.17 is too old")
        return real_import(name, *args, **kwargs)

    import builtins

    builtins.__import__ = failing_import
    try:
        with pytest.raises(SystemExit, match="prepare_wheelhouse.sh"):
            gc.stage_env(rec, dry_run=True)
    finally:
        builtins.__import__ = real_import
    data = json.loads((tmp_path / "env.json").read_text())
    assert data["items"]["import dspark_hf"]["ok"] is False
