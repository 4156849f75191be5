"""Unit tests' helper: a call run on a thread of its own, its outcome a future."""

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
