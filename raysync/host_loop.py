"""A receiver's write handed to its async host's event loop from another thread.

Runs in a receiver's host process. An async host's safe point lives on its event loop
(:mod:`raysync.gate`: a write made there is deferred while coroutines hold the model,
and the last one to leave applies it). A delivery that arrives on another thread (Ray
runs ``__ray_call__`` of an async actor outside its loop; a learner's channel writes on
the compiled-graph thread) reads the version there and hands only the write to the
loop: the loop goes on serving the host's coroutines while a version is fetched, however
long the transport takes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

#: How often a write handed to a host's loop looks whether that loop still runs.
_LOOP_LOOK_S = 0.1

T = TypeVar("T")


def call_on_host_loop(loop: asyncio.AbstractEventLoop | None, call: Callable[[], T]) -> T:
    """``call()``'s result, run on ``loop`` when it runs and the caller is not on it
    already; on the calling thread otherwise, or if that loop stops before its turn (a
    user method's own ``asyncio.run`` returned, which cancels the handed task; or a loop
    the user runs per call, which may run it much later). Run once, wherever."""
    if loop is None or not loop.is_running() or _running_on(loop):
        return call()
    return _OnHostLoop(call).run(loop)


class _OnHostLoop(Generic[T]):
    """One call handed to a host's event loop, run by whichever of the loop and the
    calling thread takes it first."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._taken = False
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    def run(self, loop: asyncio.AbstractEventLoop) -> T:
        """In the calling thread: the call's result, wherever it ran."""
        on_loop = self._on_loop()
        try:
            handed = asyncio.run_coroutine_threadsafe(on_loop, loop)
        except RuntimeError:  # the loop closed since it was seen running
            handed = None
        while not self._done.wait(0 if handed is None else _LOOP_LOOK_S):
            # Run on the loop in one step (no await): not done, and the loop stopped or
            # the task cancelled (``asyncio.run`` cancels what is left as it returns),
            # means the loop never started it.
            never_run = handed is None or handed.cancelled() or not loop.is_running()
            if never_run and self._take():
                on_loop.close()  # never run now (a loop that ended would warn of it)
                self._run()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set: the call returned

    async def _on_loop(self) -> None:
        if self._take():
            self._run()

    def _take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
            return not taken

    def _run(self) -> None:
        try:
            self._result = self._call()
        except BaseException as err:  # the calling thread raises it
            self._error = err
        finally:
            self._done.set()


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
