"""The budget's clock (dspark_hf.training.run_clock): time a process spends stopped (kill -STOP) is not
counted against --max-time, time it runs is."""

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import time
from dspark_hf.training.run_clock import budget_time, paused_seconds
budget, wall = budget_time(), time.monotonic()
print("ready", flush=True)
time.sleep(6.0)
print(budget_time() - budget, time.monotonic() - wall, paused_seconds(), flush=True)
"""


def _run_child(stop_for: float) -> tuple[float, float, float]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        if stop_for:
            time.sleep(0.5)
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(stop_for)
            os.kill(child.pid, signal.SIGCONT)
        budget, wall, paused = map(float, child.stdout.readline().split())
    finally:
        child.kill()
        child.wait()
    return budget, wall, paused


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
def test_a_stopped_process_does_not_spend_its_budget():
    budget, wall, paused = _run_child(stop_for=3.5)
    assert wall >= 5.9  # the child's sleep ran through the stop
    assert 3.0 <= paused <= 4.2, paused
    assert abs(budget - (wall - paused)) < 0.05 and budget <= wall - 3.0


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
def test_a_running_process_spends_its_budget_in_wall_time():
    budget, wall, paused = _run_child(stop_for=0.0)
    assert paused == 0.0 and abs(budget - wall) < 0.05 and wall >= 5.9
