"""A version read off its async host's event loop, and its write handed to the loop.

Runs in a receiver's host process. An async host's safe point lives on its event loop
(:mod:`raysync.gate`: a write made there is deferred while coroutines hold the model,
and the last one to leave applies it). A delivery that arrives on another thread (Ray
runs ``__ray_call__`` of an async actor outside its loop; a learner's channel writes on
the compiled-graph thread), or that a mixin's coroutine delivery method sends to a
reading thread (:func:`read_off_loop`), reads the version there and hands only the
write to the loop: the loop goes on serving the host's coroutines while a version is
fetched, however long the transport takes.

A loop whose thread a synchronous method holds (:func:`holding_its_loop`: Ray runs an
async actor's sync methods on their concurrency group's loop, and one may loop for good,
with safe points) would run a write handed to it only once that method returned: the
calling thread runs it instead, standing in for the loop
(:func:`standing_in_for_a_loop`), and the write is deferred to the method's next safe
point as the loop would defer it, rather than waited for.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, TypeVar

#: How often a write handed to a host's loop looks whether that loop still runs.
_LOOP_LOOK_S = 0.1

#: Threads of a process that read versions for its async mixin hosts: as many versions
#: at once as a threaded host's default concurrency reads (a transport's window of
#: versions in flight is sized for that), on threads of raysync's own (the loop's
#: default executor is the user's: one busy with their work would hold a version back).
READING_THREADS = 4

T = TypeVar("T")

#: The loop a version read by :func:`read_off_loop` came from: its write goes back there.
_delivered_on: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "raysync_delivered_on", default=None
)
_readers: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()
#: The loops whose thread a synchronous method holds now, each with how many holds it
#: has (a method reading two receivers' models holds its loop for each).
_held_loops: Counter[asyncio.AbstractEventLoop] = Counter()
_held_loops_lock = threading.Lock()
#: Whether the caller runs a call that a held loop left to it (:func:`standing_in_for_a_loop`).
_standing_in: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "raysync_standing_in", default=False
)


async def read_off_loop(read: Callable[[], T]) -> T:
    """Run in an async host's coroutine: ``read()`` on one of raysync's reading threads,
    in a context of its own (none of the coroutine's reads), the write it hands to its
    host's loop (:func:`call_on_host_loop`) going back to this loop."""
    loop = asyncio.get_running_loop()
    context = contextvars.Context()
    context.run(_delivered_on.set, loop)
    return await loop.run_in_executor(_reading_threads(), context.run, read)


def _reading_threads() -> ThreadPoolExecutor:
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(READING_THREADS, thread_name_prefix="raysync-read")
        return _readers


@contextmanager
def holding_its_loop() -> Iterator[None]:
    """Run in a synchronous method on an event loop (a receiver gate's read): while the
    block runs, a call handed to that loop (:func:`call_on_host_loop`) runs on its
    caller's thread instead, standing in for the loop, which would run it only once the
    method returned."""
    loop = asyncio.get_running_loop()
    with _held_loops_lock:
        _held_loops[loop] += 1
    try:
        yield
    finally:
        with _held_loops_lock:
            _held_loops[loop] -= 1
            if not _held_loops[loop]:
                del _held_loops[loop]


def standing_in_for_a_loop() -> bool:
    """Whether the caller runs a call that :func:`call_on_host_loop` would have handed to
    a loop whose thread a synchronous method holds (:func:`holding_its_loop`): what that
    loop would defer until the method comes to a safe point, the caller defers likewise,
    rather than wait for the method to return."""
    return _standing_in.get()


def call_on_host_loop(loop: asyncio.AbstractEventLoop | None, call: Callable[[], T]) -> T:
    """``call()``'s result, run on the loop the version was delivered on
    (:func:`read_off_loop`), else on ``loop``, when it runs and the caller is not on it
    already; on the calling thread otherwise, or if that loop stops before its turn (a
    user method's own ``asyncio.run`` returned, which cancels the handed task; or a loop
    the user runs per call, which may run it much later). On the calling thread standing
    in for that loop (:func:`standing_in_for_a_loop`) while a synchronous method holds
    its thread, or if one takes it before its turn. Run once, wherever."""
    loop = _delivered_on.get() or loop
    if loop is None or not loop.is_running() or _running_on(loop):
        return call()
    if _held(loop):
        return _standing_in_for_it(call)
    return _OnHostLoop(call).run(loop)


def _held(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a synchronous method holds ``loop``'s thread (:func:`holding_its_loop`)."""
    with _held_loops_lock:
        return loop in _held_loops


def _standing_in_for_it(call: Callable[[], T]) -> T:
    """``call()``'s result, run here for a loop whose thread a synchronous method holds."""
    token = _standing_in.set(True)
    try:
        return call()
    finally:
        _standing_in.reset(token)


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
                self._run(self._call)
            elif _held(loop) and self._take():
                # Behind a synchronous method that began after the hand-over: the task,
                # when the loop runs it, finds the call taken.
                self._run(functools.partial(_standing_in_for_it, self._call))
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set: the call returned

    async def _on_loop(self) -> None:
        if self._take():
            self._run(self._call)

    def _take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
            return not taken

    def _run(self, call: Callable[[], T]) -> None:
        """Run ``call`` (the call, or the call standing in for the loop) once taken."""
        try:
            self._result = call()
        except BaseException as err:  # the calling thread raises it
            self._error = err
        finally:
            self._done.set()


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
