"""Learner process: progressing the learner's NIXL agent, fast while a version may be read.

Receivers READ the learner's registered buffers. Where UCX has a one-sided path between
the two processes (cross-memory attach or shared memory on one host, ``cuda_ipc`` for
VRAM, RDMA across hosts) the bytes move without the learner, whose agent only answers a
receiver's first connection and keeps idle endpoints alive. Where it has none, UCX moves
host memory over TCP (hosts on plain Ethernet, or a container that forbids cross-memory
attach, as on the H200 machine of docs/buckets.md's fourth run) and emulates the READ
with messages that the learner's agent must answer: each READ then waits for the
learner's next progress call.
Progressed every 5 ms, 1 MB in 16 tensors took 12-15 ms to read over TCP (0.7 ms with
cross-memory attach); every 0.1 ms while a broadcast runs, 2.9 ms.

So the agent is progressed every :data:`READ_PROGRESS_S` from the moment a version is
handed to receivers until its broadcast ends, and every :data:`IDLE_PROGRESS_S` in
between (a late joiner's READ is served, slowly). nixl's own progress thread would sleep
on UCX's event file descriptor instead, but its Python agent always starts it with no
delay (a busy loop on one core for as long as the agent lives).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from raysync.transports.base import VersionDone

logger = logging.getLogger(__name__)

#: While a broadcast of this learner runs: how often its agent is progressed (seconds).
READ_PROGRESS_S = 0.0001
#: Between broadcasts (seconds): connection set-up and upkeep, a late joiner's READ.
IDLE_PROGRESS_S = 0.005
#: How often, while fast, the thread asks whether the broadcasts it serves have ended.
END_CHECK_S = 0.002


class SourceProgress:
    """A daemon thread that progresses a learner's agent for as long as ``owner`` lives,
    or until :meth:`stop`.

    Created by the ``nixl`` learner's sender, and for Ray's agent in each ``rdt`` process
    (:mod:`raysync.transports.rdt.agent`); ``serving`` is called by the sender (any thread
    of the learner process) when a version becomes readable, with the end of its
    broadcast."""

    def __init__(self, owner: object, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._serving: list[VersionDone] = []
        self._wake = threading.Event()
        self._closed = False
        threading.Thread(
            target=self._run, name=f"raysync-nixl-progress-{agent.name}", daemon=True
        ).start()
        weakref.finalize(owner, self.stop)

    def serving(self, done: VersionDone) -> None:
        """Receivers may read a version until ``done`` ends: progress fast until then."""
        with self._lock:
            self._serving.append(done)
        self._wake.set()

    def fast(self) -> bool:
        """Whether a broadcast this agent serves is still running (forgets ended ones)."""
        with self._lock:
            self._serving = [done for done in self._serving if not done.ended()]
            return bool(self._serving)

    def stop(self) -> None:
        """No more progress: its owner closed (or was collected)."""
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        fast, next_check = False, 0.0
        while not self._closed:
            try:
                self._agent.get_new_notifs()  # progresses the agent's UCX worker
            except Exception as err:
                logger.debug("progressing nixl agent %s failed: %s", self._agent.name, err)
            now = time.monotonic()
            if not fast or now >= next_check:
                fast, next_check = self.fast(), now + END_CHECK_S
            if fast:
                time.sleep(READ_PROGRESS_S)
            else:
                self._wake.wait(IDLE_PROGRESS_S)
                self._wake.clear()
