"""ApplyGate: the safe point at which a receiver's model changes version.

Runs in the receiver process. User methods of a receiver actor are *readers*; applying
an update is the *writer*. A write waits until no user method is running, and user
methods that start while a write is waiting wait for it, so user code never sees a
model that mixes two versions. This covers every way Ray runs actor methods:

* default actors (one method at a time): a delivery never overlaps a user method, the
  gate is uncontended;
* threaded actors (``max_concurrency > 1``): the delivery thread blocks until running
  user methods return, new ones wait for the write (for :data:`WRITER_FIRST_S` at most:
  a running one may wait for one of them);
* async actors: deliveries run on the event loop thread while user coroutines may be
  parked at an ``await``. The write cannot block the loop, so it is *deferred*: the
  last user coroutine to finish applies it, and the ack is sent then. Coroutines that
  start meanwhile wait for it (for :data:`WRITER_FIRST_S` at most, as threads do), but
  for those a running user method started itself (``asyncio.gather`` of other user
  methods), which go at once: their caller waits for them. A write from another thread
  of an async host (a pull in ``asyncio.to_thread``) waits for the coroutines as for
  threads (or for a safe point of the only one left: it waits for the write, which
  applies without the loop), and coroutines that start meanwhile wait for it likewise.
  A synchronous user method, which Ray runs on the loop, cannot wait for a write that
  waits (the coroutines it waits for are parked on that loop): it goes at once and is
  counted, so a write from another thread waits for it, or for its next safe point if
  it is the only reader left; only one already running ends first. One a coroutine
  runs through ``to_thread`` while it reads goes at once too (its starter holds the
  model), and is counted: it holds the model if its starter returns first (it was not
  awaited). A delivery that arrives off the loop while a synchronous user method
  holds its thread (a concurrency group's, looping for good with safe points) is not
  left waiting there: its own thread stands in for the loop (:mod:`raysync.host_loop`)
  and defers the write as the loop would, for that method's next safe point.

Each gate (a receiver's) holds its own reads: a user method reading the models of two
receivers in one process holds each of them, and a write or safe point of one gate
counts or lends nothing of another's.

A long-running user method (``while True: collect()``) opens safe points itself with
:meth:`safe_point`; nested calls and :meth:`write` from inside a user method (pull
mode) account for the caller's own read.

Deferred writes of the same key (a model) supersede each other: when a newer one is
deferred, the older one is dropped at once (``supersede``: the receiver frees its
staged data, so an async actor busy through many broadcasts holds one version, not
all of them) and its outcome is decided when the newer one has run.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from raysync.host_loop import holding_its_loop, standing_in_for_a_loop

logger = logging.getLogger(__name__)

#: How long a write keeps user methods that start meanwhile waiting for it. After that
#: they start again, and the write goes once none runs (or at a safe point of the only
#: one running, or at those of the methods running, when each has come to a safe point
#: lately: see :meth:`ApplyGate.safe_point`): a user method that
#: waits for another call of the actor (a pool's thread, a coroutine that feeds its
#: queue), which waits for the write, no longer deadlocks the actor for good.
WRITER_FIRST_S = 60.0


@dataclass
class _Read:
    """The reads a user method holds on one gate: ``depth`` counted in the gate's readers
    (nested async reads count each; 0 once the outermost ended) and who opened it, the
    task on an event loop or the thread. ``lent``: how many of them the writes (or safe
    points) of threads that run for it took out of the count while they wait,
    ``lenders``: how many such threads do (see :meth:`ApplyGate._lend`). ``parent``: the
    read of another thread or task that a thread's read began inside (a sync user method
    run through ``to_thread``): a write of that thread runs for both."""

    depth: int
    opener: object
    lent: int = 0
    lenders: int = 0
    parent: _Read | None = None


def _holding(read: _Read | None) -> bool:
    """Whether ``read`` (the caller's own) holds the model: not lent to a write of a
    thread that runs for it (:meth:`ApplyGate._lend`; its opener pulls through
    ``to_thread``, say), which goes on while another reader of it would read."""
    return read is not None and not read.lenders


def _opener() -> object:
    """Who opens a read where the caller runs: its task on an event loop, else its thread."""
    return asyncio.current_task() if on_event_loop() else threading.current_thread()


def _nested_in(own: _Read | None) -> bool:
    """Whether a sync read is nested in ``own`` (the caller's, see
    :meth:`ApplyGate._own_read`): one its own thread or task opened that holds the
    model. A thread's read inside a read another opened (a sync user method run through
    ``to_thread``) is its own, counted: the opener may return first (a thread not
    awaited), and the model would change under this one."""
    return own is not None and _holding(own) and own.opener is _opener()


def _with_parents(read: _Read | None) -> Iterator[_Read]:
    """``read``, then the reads it began inside, outermost last."""
    while read is not None:
        yield read
        read = read.parent


class Deferred:
    """Returned by :meth:`ApplyGate.write` when the write will run later (async actors)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = Deferred()


def on_event_loop() -> bool:
    """Whether the calling code runs on an asyncio event loop (an async actor's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass
class _Pending:
    """A deferred write, and the outcomes of the older writes it superseded."""

    apply: Callable[[], Any]
    key: Hashable | None
    supersede: Callable[[], Callable[[Any], Any]] | None
    rank: Any = 0  #: which of two writes of one key is the newer (the higher)
    followers: list[Callable[[Any], Any]] = field(default_factory=list)


class ApplyGate:
    """Readers/writer gate between user methods and weight applies (see module doc)."""

    def __init__(
        self, finish_deferred: Callable[[Any], None], writer_first_s: float = WRITER_FIRST_S
    ) -> None:
        """``finish_deferred(result)`` receives what a deferred write returned;
        ``writer_first_s``: see :data:`WRITER_FIRST_S`."""
        self._writer_first_s = writer_first_s
        self._cond = threading.Condition()
        self._readers = 0
        self._writers_waiting = 0  #: thread writes new readers wait for (their first turn)
        #: every thread write waiting, past its first turn too (a safe point lends to it)
        self._writers_blocked = 0
        #: The reads of threads that came to a safe point while a thread write was
        #: blocked, by ``id``, and when they last came (``time.monotonic()``), until no
        #: write is blocked: they come to one again (see :meth:`safe_point`).
        self._at_safe_points: dict[int, tuple[_Read, float]] = {}
        self._writing = False
        #: the thread running the write, while ``_writing``: what it calls while it
        #: applies (``on_weights_applied``: a user method, a pull) is inside that write
        self._writer: int | None = None
        self._deferred: list[_Pending] = []
        self._finish_deferred = finish_deferred
        #: Coroutines waiting for the deferred writes to run, each a future of its loop
        self._drained_waiters: list[asyncio.Future[None]] = []
        #: When the oldest deferred write was deferred (``time.monotonic()``), while any is.
        self._deferred_since: float | None = None
        self._said_overdue = False  #: whether the deferred writes' wait was logged
        #: Coroutines' futures, done when the write of another thread ends (or lets
        #: new readers in: :data:`WRITER_FIRST_S`).
        self._thread_write_waiters: list[asyncio.Future[None]] = []
        #: The event loop async readers run on (an async host), once one has read.
        self.loop: asyncio.AbstractEventLoop | None = None
        #: The read of this gate the current thread or task holds (re-entrant user
        #: methods). This gate's own: a process may hold several receivers, each with its
        #: gate, and a read of one holds nothing of another's model. Tasks and threads
        #: started inside a read copy it (``create_task``, ``to_thread``): see
        #: :meth:`_own_read`.
        self._held: contextvars.ContextVar[_Read | None] = contextvars.ContextVar(
            f"raysync_gate_held_{id(self)}", default=None
        )

    def finish_deferred_with(self, finish_deferred: Callable[[Any], None]) -> None:
        """Hand deferred writes' results to ``finish_deferred`` from now on: a receiver
        registered again keeps its gate, whose readers (a user method registering
        again among them) still hold the model, and acks through its new registration."""
        self._finish_deferred = finish_deferred

    def note_loop(self, host_loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """Remember the event loop the caller runs on, else ``host_loop`` if given (an
        async host's: a delivery that arrives off it is handed to it); whether there is
        one."""
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            if host_loop is None:
                return False
            self.loop = host_loop
        return True

    def _note_loop_of_sync_reader(self) -> bool:
        """Whether a sync user method runs on an event loop; that loop is remembered
        only while the gate knows none that runs. Ray runs an async actor's sync
        methods of a concurrency group on that group's loop: one that loops for good
        (``while True: collect()``, with safe points) was then the loop a delivery that
        arrives off every loop (a channel's, a ``__ray_call__``) is handed to, where the
        write waited behind it instead of being deferred to its safe point by the loop
        the async readers run on."""
        if self.loop is not None and self.loop.is_running():
            return on_event_loop()
        return self.note_loop()

    # -- the read the caller holds -----------------------------------------------------
    def _own_read(self) -> _Read | None:
        """The read of this gate the caller holds itself: on an event loop, one its own
        task opened and has not ended (a task started inside a read copied it, but the
        read is not its own: it may outlive it, or run while the opener is parked
        mid-read); in a thread, any that has not ended (its own, or that of the
        coroutine that started this thread through ``to_thread``, which holds the
        model for it, or did when the thread started)."""
        read = self._held.get()
        if read is None or read.depth == 0:
            return None
        if not on_event_loop():
            return read
        return read if read.opener is asyncio.current_task() else None

    def _inside_a_read(self) -> bool:
        """Whether the calling task was started inside a read of this gate that still
        runs (its opener may be waiting for it: ``asyncio.gather`` of other user
        methods) and holds the model (not lent to a write: its opener pulls through
        ``to_thread``, say)."""
        read = self._held.get()
        return read is not None and read.depth > 0 and not read.lenders

    def _own_reads(self) -> int:
        """How many of the gate's readers the caller's own read counts now: none while
        it is lent (:meth:`_lend` took them out of the count already)."""
        read = self._own_read()
        return read.depth if read is not None and _holding(read) else 0

    def _unset_held(self, token: contextvars.Token[_Read | None]) -> None:
        """End the read ``token`` began in this context. A read that ends in another
        context (an async generator method left unclosed, closed by asyncio's finalizer
        in a task of its own) has nothing to reset there: it still leaves the gate."""
        try:
            self._held.reset(token)
        except ValueError:
            pass

    # -- readers: user methods -------------------------------------------------------
    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the model steady for a synchronous user method."""
        on_loop = self._note_loop_of_sync_reader()
        own = self._own_read()
        if _nested_in(own) or self._writes_here():
            # Nested call, or a call made while this thread applies a write: no apply
            # can run on this thread until it returns.
            yield
            return
        if on_loop:  # counted at once (see the module doc): the loop cannot wait
            try:  # for a write that waits, only for another thread's that runs
                # A delivery to this loop meanwhile is deferred by its own thread.
                with (
                    holding_its_loop(),
                    self._counted(asyncio.current_task(), lambda: self._writing),
                ):
                    yield
            finally:  # the deferred writes it held back run as it leaves, if last
                self._run_deferred_if_idle()
            return
        try:  # a read of its own, inside the one it was started in, if any (own)
            with self._counted(threading.current_thread(), self._thread_waits_while(own), own):
                yield
        finally:
            with self._cond:
                last_out = not self._readers and bool(self._deferred)
            if last_out:  # deferred by a coroutine while this thread read (an async host)
                self._run_deferred_soon()

    def _thread_waits_while(self, started_in: _Read | None) -> Callable[[], bool]:
        """What a thread's read waits for before it is counted (asked holding the lock):
        a write that runs or waits, new readers going after it in its first turn. A
        thread started inside a read that holds the model (a sync user method run
        through ``to_thread``, awaited or not) waits only for one that runs (a deferred
        write at its starter's safe point): a write waiting waits for that read, whose
        opener may be awaiting this thread."""
        if _holding(started_in):
            return lambda: self._writing
        return lambda: bool(self._writing or self._writers_waiting)

    @contextmanager
    def _counted(
        self, opener: object, wait_while: Callable[[], bool], parent: _Read | None = None
    ) -> Iterator[None]:
        """One read of ``opener`` (a thread, or the task of a sync method on the loop),
        counted once ``wait_while()`` is false (asked holding the gate's lock);
        ``parent``: the read of another that a thread's read began inside (its
        ``to_thread`` starter's)."""
        with self._cond:
            while wait_while():
                self._cond.wait()
            self._count_reader_in()
        read = _Read(1, opener, parent=parent)
        token = self._held.set(read)
        try:
            yield
        finally:
            read.depth = 0
            self._unset_held(token)
            with self._cond:
                self._leave(read)

    @asynccontextmanager
    async def reading_async(self) -> AsyncIterator[None]:
        """Hold the model steady for an async user method (async actors)."""
        self.note_loop()
        own = self._own_read()
        if not _holding(own):
            own = None  # lent to a write: a read of its own, counted, waiting for it
        # Started by a user method that reads: it goes at once (its caller may wait for it).
        held = own.depth if own is not None else int(self._inside_a_read())
        while not self._enter_async(held):
            if self._deferred:
                self._run_deferred_if_idle()  # no reader left to run them: this one does
            if self._deferred and self._deferred_go_first():
                await self._deferred_drained_or_overdue()
                continue
            # A write of another thread, or of another loop (an actor's concurrency
            # group): it wakes this loop when it ends. (Deferred writes overdue no longer
            # keep this one waiting: it does not wait for them again.)
            ended = self._thread_write_ended()
            if ended is not None:
                await ended
        read = own or _Read(0, asyncio.current_task())
        read.depth += 1
        token = self._held.set(read)
        try:
            yield
        finally:
            read.depth -= 1
            self._unset_held(token)
            with self._cond:
                self._leave(read)  # a write waiting in another thread goes on
            self._run_deferred_if_idle()

    def _leave(self, read: _Read) -> None:
        """One of ``read``'s reads ended (called holding the gate's lock; its depth is
        already down): out of the count, unless a waiting write took it out already."""
        if read.lent:
            read.lent -= 1
        else:
            self._readers -= 1
        if not read.depth:
            self._at_safe_points.pop(id(read), None)
        self._cond.notify_all()

    def _lend(self, read: _Read | None) -> None:
        """A write (or safe point) in a thread that runs for ``read`` (its own, or that
        of the coroutine that started it through ``to_thread``) takes what ``read``
        holds out of the count while it waits, and what the reads it began inside hold
        (its ``parent``s: a sync user method run through ``to_thread`` that pulls runs
        for the coroutine awaiting it too); the first of several such threads (two
        pulls gathered) takes it all (called holding the lock)."""
        for each in _with_parents(read):
            each.lenders += 1
            if each.lenders == 1:
                each.lent = each.depth
                self._readers -= each.depth

    def _take_back(self, read: _Read | None) -> None:
        """Count again what :meth:`_lend` took out of ``read`` (and its parents) and
        that has not ended meanwhile (a coroutine that did not wait for the thread may
        have left), once the last thread that runs for it is done."""
        for each in _with_parents(read):
            each.lenders -= 1
            if not each.lenders:
                self._readers += each.lent
                each.lent = 0

    def _enter_async(self, held: int) -> bool:
        """Count an async reader in, unless a write goes first (a nested read never
        waits: its caller holds the model already; deferred writes go first for
        ``writer_first_s`` only)."""
        with self._cond:
            if not held and (self._deferred_go_first() or self._writing or self._writers_waiting):
                return False
            self._count_reader_in()
            return True

    def _count_reader_in(self) -> None:
        """Count a new reader (holding the lock). A safe point that lent its read to a
        write past its first turn waits only while no one else reads: it is woken to
        see that someone now does (it would wait for that reader, which may wait for
        it)."""
        self._readers += 1
        if self._writers_blocked:
            self._cond.notify_all()

    def _deferred_go_first(self) -> bool:
        """Whether deferred writes keep new readers waiting: for ``writer_first_s``."""
        since = self._deferred_since
        return since is not None and time.monotonic() - since < self._writer_first_s

    async def _deferred_drained_or_overdue(self) -> None:
        """Wait until the deferred writes ran, or have kept new readers waiting for
        ``writer_first_s`` (then say so, once)."""
        since = self._deferred_since
        if since is None:
            return
        left = self._writer_first_s - (time.monotonic() - since)
        drained = asyncio.get_running_loop().create_future()
        with self._cond:
            if not self._deferred:
                return
            self._drained_waiters.append(drained)
        try:
            await asyncio.wait_for(drained, max(0.0, left))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            if self._deferred_since == since and not self._said_overdue:
                self._said_overdue = True
                logger.warning(
                    "a weight update waited %g s for the user coroutines running to "
                    "return; new ones no longer wait for it (one may wait for another "
                    "call of this actor, which waited for the update)",
                    self._writer_first_s,
                )

    def _thread_write_ended(self) -> asyncio.Future[None] | None:
        """A future of this loop's, done when the write of another thread now running
        or waiting ends; None if there is none any more. (Not a thread of the loop's
        executor blocked on the condition: coroutines holding the model may need those
        threads to finish, and the write waits for them.)"""
        with self._cond:
            if not (self._writing or self._writers_waiting):
                return None
            ended = asyncio.get_running_loop().create_future()
            self._thread_write_waiters.append(ended)
            return ended

    def between_writes(self, mark: Callable[[], None]) -> None:
        """Run ``mark`` (short, never waiting) at a moment no other thread applies a
        write: a write that starts after it sees what it set. On an event loop, it
        blocks the loop while another thread's write applies (a pull through
        ``asyncio.to_thread``; an apply does not need the loop)."""
        with self._cond:
            while self._writing and not self._writes_here():
                self._cond.wait()
            mark()

    def safe_point(self) -> None:
        """Let waiting writes through from inside a long-running user method.

        A thread write past its first turn (:data:`WRITER_FIRST_S`) goes at a moment with
        no reader. Where every other method running has come to a safe point while the
        write waited, the last time less than :data:`WRITER_FIRST_S` ago (two threads,
        each in ``while True: collect(); safe_point()``), a safe point waits for theirs
        until then: returning at once, each would find the other running, at every
        turn, and the write would wait for as long as they loop. One in a long step
        since its last safe point holds the others that long at most, as a write's
        first turn does. Inside a write on its own thread (``on_weights_applied``
        calling a method with safe points) it returns at once: it waited for that write.
        On an event loop it applies the deferred writes, and lets in a thread write
        that waits for it alone (:meth:`_let_in_thread_writes`).
        """
        if self._writes_here():
            return
        if on_event_loop():
            self._run_deferred_if_idle(own=self._own_reads())
            self._let_in_thread_writes(self._own_read())
            return
        read = self._own_read()
        with self._cond:
            deferred = bool(self._deferred)  # by the loop of an async host, held by read
            if not (self._writers_waiting or self._writing or self._writers_blocked or deferred):
                return
            self._lend(read)
            if self._writers_blocked and read is not None:
                self._at_safe_points[id(read)] = (read, time.monotonic())
            self._cond.notify_all()
            if deferred:  # run on their loop, if no other reader holds them back
                self._run_deferred_soon()
            # A write past its first turn (or deferred ones) waits for a moment with no
            # reader: this one waits for it if it made that moment (others may wait for
            # this one, and the last of them to leave runs deferred writes), or if the
            # readers left are methods that come to safe points: until one comes.
            while True:
                if (
                    self._writers_waiting
                    or self._writing
                    or ((self._writers_blocked or self._deferred) and not self._readers)
                ):
                    self._cond.wait()
                elif self._writers_blocked and (until := self._others_looping(read)) is not None:
                    self._cond.wait(max(0.0, until - time.monotonic()))
                else:
                    break
            self._take_back(read)

    def _let_in_thread_writes(self, read: _Read | None) -> None:
        """At a safe point on the loop of ``read`` (the caller's): let in the writes of
        other threads that wait for it alone, and wait until they ran. Else they waited
        for as long as it ran (a sync method looping for good, and a receiver retired
        from a thread as it closes). It never waits for one that other readers hold
        back: coroutines parked on this loop may be among them, and it holds the loop."""
        with self._cond:
            if read is None or not self._writers_blocked:
                return
            self._lend(read)
            self._cond.notify_all()
            while self._writing or (self._writers_blocked and not self._readers):
                self._cond.wait()
            self._take_back(read)

    def _others_looping(self, read: _Read | None) -> float | None:
        """If every reader but ``read`` (the caller's, lent) came to a safe point while a
        thread write was blocked, the last time less than :data:`WRITER_FIRST_S` ago:
        when the first of them will have been away that long; else None (holding the
        lock)."""
        if read is None:
            return None
        others = [
            (r, at) for r, at in self._at_safe_points.values() if r is not read and not r.lenders
        ]
        if not others or sum(r.depth for r, _ in others) != self._readers:
            return None
        until = min(at for _, at in others) + self._writer_first_s
        return until if time.monotonic() < until else None

    # -- the writer: applying an update -------------------------------------------------
    def write(
        self,
        apply: Callable[[], Any],
        key: Hashable | None = None,
        supersede: Callable[[], Callable[[Any], Any]] | None = None,
        rank: Any = 0,
    ) -> Any:
        """Run ``apply`` when no user method is running; return its result or DEFERRED.

        A deferred write with a ``supersede`` is dropped if a newer write of the same
        ``key`` is deferred after it: ``supersede()`` runs then and returns a function
        that, given the newer write's result, makes this write's result (which goes to
        ``finish_deferred`` like any deferred result). Newer means of a ``rank`` at
        least as high: a write that comes while one of a higher rank waits (an older
        version delivered late) is the one dropped, following the waiting one.
        """
        if self._writes_here():  # called while this thread applies a write: inside it
            return apply()
        held = self._own_reads()
        this_write = (apply, key, supersede, rank)
        if on_event_loop():
            self.note_loop()  # the thread readers holding it back hand it to this loop
            run_soon = asyncio.get_running_loop().call_soon
            return self._apply_or_defer(
                held, lambda: run_soon(self._run_deferred_if_idle), *this_write
            )
        if standing_in_for_a_loop():  # for a loop a sync reader holds: never wait for it
            return self._apply_or_defer(held, self._run_deferred_here, *this_write)
        read = self._own_read()
        with self._cond:
            self._lend(read)
            self._writers_waiting += 1
            self._writers_blocked += 1
            self._cond.notify_all()
            first_until = time.monotonic() + self._writer_first_s
            first = True  #: counted in _writers_waiting: new readers wait for it
            while self._readers or self._writing:
                if not first:
                    self._cond.wait()
                elif (left := first_until - time.monotonic()) > 0:
                    self._cond.wait(left)
                else:  # a reader it waits for may wait for another reader: let them in
                    first = False
                    self._writers_waiting -= 1
                    self._cond.notify_all()
                    self._wake_coroutines_waiting()
                    logger.warning(
                        "a weight update waited %g s for the user methods running to "
                        "return; new ones no longer wait for it (one may wait for a call "
                        "of another thread, which waited for the update)",
                        self._writer_first_s,
                    )
            if first:
                self._writers_waiting -= 1
            self._writers_blocked -= 1
            if not self._writers_blocked:
                self._at_safe_points.clear()
            self._writing, self._writer = True, threading.get_ident()
        try:
            return apply()
        finally:
            with self._cond:
                self._writing, self._writer = False, None
                self._take_back(read)
                self._cond.notify_all()
                deferred_waiting = bool(self._deferred)
                self._wake_coroutines_waiting()
            if deferred_waiting:  # held back by this write: run them on their loop
                self._run_deferred_soon()

    def _apply_or_defer(
        self,
        held: int,
        run_deferred_soon: Callable[[], Any],
        apply: Callable[[], Any],
        key: Hashable | None,
        supersede: Callable[[], Callable[[Any], Any]] | None,
        rank: Any,
    ) -> Any:
        """:meth:`write` on an event loop, or standing in for one (see
        :func:`raysync.host_loop.standing_in_for_a_loop`), which never waits for a
        reader: ``apply``'s result at once if no reader but the caller's ``held`` ones
        holds the model, else DEFERRED, for the last reader out or a safe point
        (``run_deferred_soon()`` if the readers left before it was listed)."""
        with self._cond:
            idle = not (
                self._readers - held or self._deferred or self._writing or self._writers_waiting
            )
            if idle:
                self._writing, self._writer = True, threading.get_ident()
        if idle:
            try:
                return apply()
            finally:
                with self._cond:
                    self._writing, self._writer = False, None
                    self._cond.notify_all()
                    self._wake_coroutines_waiting()  # of other loops
        if self._defer(_Pending(apply, key, supersede, rank), held):
            run_deferred_soon()
        return DEFERRED

    def _defer(self, pending: _Pending, held: int) -> bool:
        """List ``pending`` among the deferred writes, dropping the older ones of its key;
        whether the readers but the caller's ``held`` ones, and the writes that made it
        wait, left before it was listed. False if it follows a newer one instead."""
        # Under the lock: another loop of the actor (a concurrency group's) may take
        # the deferred writes to run them meanwhile.
        with self._cond:
            if pending.key is not None:
                waiting = [p for p in self._deferred if p.key == pending.key and p.supersede]
                newer = [p for p in waiting if p.rank > pending.rank]
                if newer and pending.supersede is not None:
                    newer[-1].followers.append(pending.supersede())
                    return False
                for older in waiting:
                    assert older.supersede is not None  # waiting: writes that have one
                    self._deferred.remove(older)
                    pending.followers += [older.supersede(), *older.followers]
            self._deferred.append(pending)
            if self._deferred_since is None:
                self._deferred_since = time.monotonic()
            return not (self._readers - held or self._writing or self._writers_waiting)

    def _wake_coroutines_waiting(self) -> None:
        """Let the coroutines waiting for a thread's write try to read again (called
        holding the gate's lock)."""
        waiters, self._thread_write_waiters = self._thread_write_waiters, []
        for ended in waiters:
            _call_soon(ended.get_loop(), _set_done, ended)

    def _writes_here(self) -> bool:
        """Whether the calling thread is the one applying a write now."""
        return self._writer == threading.get_ident()

    def _run_deferred_soon(self) -> None:
        """From a thread: run the deferred writes on the loop that deferred them, or
        here if that loop runs no more (a user method's own ``asyncio.run`` read the
        model and ended: nothing else would run them, their acks would never go, and a
        thread's ``safe_point`` would wait for them for good)."""
        loop = self.loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._run_deferred_if_idle)
            return
        self._run_deferred_here()

    def _run_deferred_here(self) -> None:
        """Run the deferred writes on the calling thread, if no reader holds them back."""
        try:
            self._run_deferred_if_idle()
        except Exception:  # each write's outcome went to its ack; as the loop would
            logger.exception("a deferred weight update raised")

    def _run_deferred_if_idle(self, own: int = 0) -> None:
        """Run the deferred writes (on the loop; on a thread once it ended), if no
        reader but the caller's ``own`` reads holds the model and no write from another
        thread runs. Every one runs and readers waiting for them go on, even if one
        raises (raised here after)."""
        with self._cond:
            if self._readers - own or not self._deferred or self._writing:
                return
            pending, self._deferred, self._deferred_since = self._deferred, [], None
            self._said_overdue = False
            # a write from another thread waits for these
            self._writing, self._writer = True, threading.get_ident()
        failure: Exception | None = None
        try:
            for write in pending:
                try:
                    result = write.apply()
                except Exception as err:
                    failure = failure or err
                    continue
                # Each version's outcome on its own: one that cannot be sent (its ack)
                # leaves the versions it superseded theirs.
                for follower in [None, *write.followers]:
                    try:
                        self._finish_deferred(result if follower is None else follower(result))
                    except Exception as err:
                        failure = failure or err
        finally:
            with self._cond:
                self._writing, self._writer = False, None
                self._cond.notify_all()
                self._wake_coroutines_waiting()
                drained, self._drained_waiters = self._drained_waiters, []
                # Deferred meanwhile by another loop, which found these writes running
                # and left the new ones to them.
                deferred_meanwhile = bool(self._deferred)
            for waiter in drained:  # each on its own loop (an actor's concurrency groups)
                _call_soon(waiter.get_loop(), _set_done, waiter)
            if deferred_meanwhile:
                self._run_deferred_soon()
        if failure is not None:
            raise failure


def _call_soon(
    loop: asyncio.AbstractEventLoop | None, callback: Callable[..., None], *args: Any
) -> None:
    """Run ``callback(*args)`` on ``loop`` from another thread, unless it is gone."""
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(callback, *args)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
