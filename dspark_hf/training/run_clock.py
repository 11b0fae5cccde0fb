"""The clock ``--max-time`` is counted on: the seconds the command ran, less the time it was stopped.

A long ``dspark-hf train`` is often paused (``kill -STOP`` / ``kill -CONT``, a suspended shell job, a
machine put to sleep) so that something else can have the CPU for a while, a timing on the same cores for
one. Counted in wall time, those minutes would come out of the budget: the run would train less than it
was given and its step-time estimate would include the pause. A stopped process cannot see its stop
begin, so a daemon thread wakes every :data:`TICK` seconds; a wake that comes more than :data:`GAP`
seconds late means the process was stopped (a thread waiting for the interpreter lock waits milliseconds,
not seconds), and the lateness is counted as paused. :func:`budget_time` is ``time.monotonic()`` less
the paused seconds; every deadline of the pipeline (:mod:`~dspark_hf.training.budget`) is a value of it.
"""

from __future__ import annotations

import threading
import time

__all__ = ["GAP", "TICK", "budget_time", "paused_seconds"]

TICK = 0.25
GAP = 2.0


class _PauseWatcher:
    def __init__(self) -> None:
        self.paused = 0.0
        self.last_wake = time.monotonic()
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="dspark-hf-run-clock", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(TICK)
            with self.lock:
                now = time.monotonic()
                self.paused += self._late(now)
                self.last_wake = now

    def _late(self, now: float) -> float:
        late = now - self.last_wake - TICK
        return late if late > GAP else 0.0

    def paused_until(self, now: float) -> float:
        # A pause that just ended is counted even before the thread's next wake sees it.
        with self.lock:
            return self.paused + self._late(now)


_watcher: list[_PauseWatcher] = []
_start_lock = threading.Lock()


def _the_watcher() -> _PauseWatcher:
    with _start_lock:
        if not _watcher:
            _watcher.append(_PauseWatcher())
        return _watcher[0]


def budget_time() -> float:
    """``time.monotonic()`` less the seconds this process has spent stopped since the first call (which starts
    the watching thread): the clock the pipeline's stage deadlines are set and checked on."""
    watcher = _the_watcher()
    now = time.monotonic()
    return now - watcher.paused_until(now)


def paused_seconds() -> float:
    """The seconds counted as paused so far in this process (0 before the first :func:`budget_time`)."""
    return _watcher[0].paused_until(time.monotonic()) if _watcher else 0.0
