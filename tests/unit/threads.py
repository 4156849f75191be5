"""Unit tests' helpers: a call run on a thread of its own, its outcome a future; a lock
and a condition that say when a thread had to wait for them."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


def on_a_thread(target: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """``target()`` run on a daemon thread of its own (a learner, a receiver serving, a
    pull beside the hub watch): its outcome. Daemon: one a failed test leaves waiting
    does not hold the interpreter's exit."""
    outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            outcome.set_result(target())
        except BaseException as err:
            outcome.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return outcome


class SaysWhenWaitedFor:
    """A re-entrant lock (a receiver core's ``_registering``) that sets ``waited`` once a
    thread has to wait for it (another thread registers in its place meanwhile)."""

    def __init__(self, waited: threading.Event | None = None) -> None:
        self._lock = threading.RLock()
        self.waited = threading.Event() if waited is None else waited

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


class SaysWhenWaitedOn(threading.Condition):
    """A condition (a receiver core's ``_replacing_changed``) that sets ``waited`` once a
    thread waits on it (a registration waits for another one that retired the core
    first)."""

    def __init__(self, waited: threading.Event | None = None) -> None:
        super().__init__()
        self.waited = threading.Event() if waited is None else waited

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)
