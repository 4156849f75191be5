"""A learner's compiled-graph channel to its receivers: ``WeightHub.remote(channels=True)``.

A small version's direct delivery (see :class:`raysync.messages.Route`) costs a Ray call
to each receiver, a put into the object store and a fetch from it; on a busy node those
messages, not the bytes, are the broadcast's time. A Ray compiled graph (``ray.dag``)
keeps shared-memory channels open from the learner to each receiver and back instead:
one write of the version reaches every receiver on the node, and their acks return the
same way.

Who runs what:

* Learner process: one :class:`ReceiverChannel` per hub handle and model. The broadcast
  calls :meth:`ReceiverChannel.deliver` with the route's eligible receivers; it writes
  the version into the graph when the graph is built for exactly those receivers and
  idle, and else answers "not now" (the broadcast calls them the plain way). Its thread
  builds graphs (a new set of receivers: one broadcast later, off the broadcast's path),
  reads the receivers' replies and passes them to the hub (``channel_replies``), and
  tears a broken graph down.
* Receiver host: Ray runs :func:`raysync.receiver_delivery.deliver_on_channel` on the
  actor's compiled-graph thread (Ray's ``_ray_system`` concurrency group), beside its
  methods; the mixin's gate holds the write until none of them reads the model.
* Hub: books the version as for any direct delivery and awaits each receiver's reply
  from ``channel_replies`` (a :class:`~raysync.messages.ChannelLost` reply: the hub
  delivers that receiver itself, so a death is found and reported as before; so too if
  the learner dies before it passed the reply on, which Ray tells the hub by failing
  the graph's loop on that receiver: the learner owns it).

Eligible receivers: the mixin's (every method of theirs holds the gate; an ``attach``
host's methods may not, and its safe point is its method queue), reading by
``object_store``, on the learner's node, for versions of at most
:data:`CHANNEL_MAX_BYTES`. Ray runs one compiled graph at a time on an actor, so a
receiver serves one learner's channel (:func:`raysync.receiver_delivery.claim_channel`);
other learners call it the plain way, until that learner releases it or is found dead
(killed without ``release()``: the next learner's claim takes the receiver over).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode, compiled_dag_node

from raysync.messages import (
    Ack,
    ChannelCall,
    ChannelLost,
    ChannelReply,
    DirectTarget,
    Route,
    Update,
)
from raysync.receiver_delivery import (
    CallStamp,
    claim_channel,
    deliver_on_channel,
    hold_channel,
    release_channel,
)
from raysync.routing import hand_off_of
from raysync.transports.object_store import ObjectStoreTransport

logger = logging.getLogger(__name__)

#: Versions up to this size travel by channel; larger ones the plain way. Measured on
#: two cores (docs/latency.md): 0.1 and 1 MB are faster by channel from one receiver up,
#: 8 MB slower (the learner serializes it into the channel and every receiver copies it
#: out, where the object store maps one copy per node).
CHANNEL_MAX_BYTES = 2 * 2**20

#: How long a broadcast waits for its receivers' replies before it goes on (and the
#: channel's thread passes them to the hub when they come): they come within a few ms
#: when the receivers are idle; a receiver busy in a method answers after it.
COLLECT_WAIT_S = 0.01

#: Share of a broadcast's timeout the channel's thread waits for its receivers'
#: replies. Ray reads a graph's outputs together, so one receiver busy past that holds
#: back every reply: the channel is then taken as broken, and the hub calls each
#: receiver whose reply it lacks in the time left (one that applied the version acks).
REPLIES_WAIT_SHARE = 0.5

#: Room in the graph's buffers beyond the version's bytes (the update's fields, pickled).
BUFFER_SLACK = 64 * 2**10

#: How long building a graph may wait for its receivers' claims.
CLAIM_WAIT_S = 10.0

#: How long a set of receivers whose graph could not be built (one was busy past
#: :data:`CLAIM_WAIT_S`, another learner's channel held one, Ray refused the graph) goes
#: the plain way before a broadcast to it asks for the graph again.
REFUSED_FOR_S = 30.0

#: How long ``close`` waits for the thread to tear the graph down.
CLOSE_WAIT_S = 5.0


def channel_targets(route: Route, node_id: str) -> tuple[DirectTarget, ...]:
    """The receivers of ``route`` a channel from a learner on ``node_id`` may reach."""
    return tuple(
        t
        for t in route.targets
        if t.entry.mixin
        and t.node_id == node_id
        and hand_off_of(t.transport) == ObjectStoreTransport.name
    )


@dataclass(frozen=True)
class _Build:
    members: tuple[tuple[str, str], ...]
    targets: tuple[DirectTarget, ...]
    nbytes: int  #: the version's size: the graph's buffers start that large


@dataclass(frozen=True)
class _Teardown:
    graph: Any
    targets: tuple[DirectTarget, ...]
    stamp: CallStamp  #: its release's, taken as the graph was let go of


@dataclass
class Written:
    """One version written into the channel, until its replies are in."""

    model: str
    version: int
    timeout_s: float  #: the broadcast's: a reply not in by then is ChannelLost
    tokens: dict[str, str]  #: worker -> its registration, in the graph's output order
    graph: Any  #: the compiled graph it was written into
    refs: Any  #: its CompiledDAGRefs, one per worker
    loops: dict[str, Any]  #: worker -> the ref of the graph's loop on it (ChannelCall.loop)
    replies: dict[str, Ack | ChannelLost | None] = field(default_factory=dict)
    done: bool = False  #: every reply is in
    forward: bool = False  #: the broadcast went on without them: the thread tells the hub


class ReceiverChannel:
    """In the learner: the compiled graph to one model's eligible receivers (see the
    module's doc). Thread-safe; :meth:`write` never waits for a receiver."""

    def __init__(self, hub: Any, submitter: str, model: str) -> None:
        self._hub = hub
        self._submitter = submitter
        self._holder = f"{submitter}/{model}"
        self._instance = uuid.uuid4().hex
        self._calls = itertools.count()  #: stamps its claims, holds and releases
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  #: a build ended, replies came
        self._builds = 0  #: builds asked for and not ended
        self._graph: Any = None
        self._targets: tuple[DirectTarget, ...] = ()  #: the graph's, in its output order
        self._members: tuple[tuple[str, str], ...] = ()  #: (worker, token) of the graph
        self._wanted: tuple[tuple[str, str], ...] = ()  #: the last set asked to be built
        #: Sets whose graph could not be built -> when (``time.monotonic()``)
        self._refused: dict[tuple[tuple[str, str], ...], float] = {}
        self._out: Written | None = None  #: the version whose replies are still out
        self._jobs: queue.SimpleQueue[_Build | _Teardown | Written | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="raysync-channel", daemon=True)
        self._thread.start()

    def write(
        self,
        targets: Sequence[DirectTarget],
        workers: set[str] | None,
        update: Update,
        timeout_s: float,
    ) -> Written | None:
        """Write ``update`` to ``targets`` (the route's eligible receivers; ``workers``:
        the broadcast's chosen ones among them, None for all). None when the graph is
        not built for exactly those receivers or a version's replies are still out: the
        broadcast then calls them itself. A new set of receivers is built for the
        broadcasts after this one."""
        members = tuple(sorted((t.worker, t.token) for t in targets))
        with self._lock:
            if members != self._members or self._graph is None:
                if members and members != self._wanted and not self._refused_lately(members):
                    self._wanted = members
                    self._builds += 1
                    nbytes = sum(a.nbytes for a in update.payload.arrays)
                    self._jobs.put(_Build(members, tuple(targets), nbytes))
                return None
            tokens = {t.worker: t.token for t in self._targets}
            if self._out is not None or (workers is not None and workers != set(tokens)):
                return None
            try:
                refs = self._graph.execute(update)
            except Exception as err:  # Ray tore the graph down: a receiver of it died
                logger.info("channel to %s broken: %s", ", ".join(tokens), err)
                broken, self._graph, self._members, self._wanted = self._graph, None, (), ()
                self._jobs.put(_Teardown(broken, self._targets, self._stamp()))
                return None
            # A build asked for another set before this broadcast is not wanted now.
            self._wanted = members
            loops = {t.worker: self._graph.worker_task_refs[t.handle] for t in self._targets}
            written = self._out = Written(
                update.model, update.version, timeout_s, tokens, self._graph, refs, loops
            )
        self._jobs.put(written)
        return written

    def collect(
        self, written: Written, wait_s: float
    ) -> dict[str, tuple[str, ChannelReply | ChannelCall]]:
        """Per worker of ``written``, its registration and its reply if every reply
        came within ``wait_s``; else a :class:`ChannelCall` each, and the thread passes
        the replies to the hub (``channel_replies``) when they come."""
        with self._changed:
            self._changed.wait_for(lambda: written.done, wait_s)
            if not written.done:
                written.forward = True
                return {w: (t, ChannelCall(written.loops[w])) for w, t in written.tokens.items()}
        return {w: (token, ChannelReply(written.replies[w])) for w, token in written.tokens.items()}

    def wait_ready(self, timeout_s: float) -> tuple[str, ...]:
        """Wait up to ``timeout_s`` for the builds asked for to end and for the replies
        of the last version written to be in (until then a broadcast takes the plain
        path); the workers the channel reaches now (none: no graph, or another
        learner's channel holds one of them)."""
        with self._changed:
            self._changed.wait_for(lambda: self._builds == 0 and self._out is None, timeout_s)
            return tuple(t.worker for t in self._targets) if self._graph is not None else ()

    def close(self) -> None:
        """Tear the graph down and stop the thread (the handle's ``release``). Waits a
        few seconds at most: replies still out (a receiver busy in a method) are read
        first, and the graph goes once they are in."""
        self._jobs.put(None)
        self._thread.join(timeout=CLOSE_WAIT_S)

    # -- the channel's thread --------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Build):
                try:
                    self._build(job)
                finally:
                    with self._changed:
                        self._builds -= 1
                        self._changed.notify_all()
            elif isinstance(job, _Teardown):
                self._teardown(job.graph, job.targets, job.stamp)
            else:
                self._answer(job)
        self._teardown()

    def _build(self, job: _Build) -> None:
        with self._lock:
            if job.members != self._wanted:
                return  # a newer set was asked for since, or a broadcast wrote the graph
            # Taken from the channel under the same hold as the check: a broadcast after
            # it finds no graph (and asks for its own set), none writes into the graph
            # being torn down, leaving its set wanted and never built.
            old, old_targets = self._graph, self._targets
            self._graph, self._members = None, ()
        if old is not None:
            self._teardown(old, old_targets)
        # One stamp for the build's claims (and one for its holds): two receivers of one
        # process share its claim, and the second call must not be stale there.
        stamp = self._stamp()
        claims = [
            t.handle.__ray_call__.options(max_task_retries=0).remote(
                claim_channel, self._holder, stamp
            )
            for t in job.targets
        ]
        try:
            claimed = ray.get(claims, timeout=CLAIM_WAIT_S)
        except ray.exceptions.RayError as err:  # a receiver died, or did not answer
            logger.info("no channel to %d receivers: %s", len(job.targets), err)
            claimed = [False]
        if not all(claimed):
            self._refuse(job)
            return
        with InputNode() as version:
            dag = MultiOutputNode(
                [
                    t.handle.__ray_call__.bind(
                        deliver_on_channel, t.attachment, version, t.token
                    )
                    for t in job.targets
                ]
            )
        # Ray 2.60 sizes the learner's input buffers from the process's DAGContext, not
        # from _buffer_size_bytes, and gives each channel ten (one per execution that
        # may be out). Measured: sized from the start, the first executions after a
        # build were as slow (Ray's own warm-up, not a resize); one buffer per channel
        # (a tenth of the pinned memory) cost ~1 ms per 1 MB broadcast to 4 receivers.
        try:
            graph = dag.experimental_compile(_buffer_size_bytes=job.nbytes + BUFFER_SLACK)
        except Exception as err:  # a receiver died meanwhile; Ray refused the graph
            logger.warning("no channel to %d receivers: %s", len(job.targets), err)
            self._refuse(job)
            return
        _spare_from_ray_shutdown(graph)
        stamp = self._stamp()
        holds = [  # were this learner killed, the next one takes its receivers over
            t.handle.__ray_call__.options(max_task_retries=0).remote(
                hold_channel,
                self._holder,
                stamp,
                [graph.worker_task_refs[t.handle]],
                graph.actor_to_executable_tasks[t.handle],
            )
            for t in job.targets
        ]
        try:
            held = ray.get(holds, timeout=CLAIM_WAIT_S)
        except ray.exceptions.RayError as err:  # a receiver died, or did not answer
            logger.info("no channel to %d receivers: %s", len(job.targets), err)
            held = [False]
        if not all(held):  # or the build outlived its claims: another learner's now
            self._teardown(graph, job.targets)
            self._refuse(job)
            return
        with self._lock:
            self._graph, self._targets, self._members = graph, job.targets, job.members

    def _refused_lately(self, members: tuple[tuple[str, str], ...]) -> bool:
        """Whether a graph for ``members`` could not be built within the last
        :data:`REFUSED_FOR_S` (caller holds the lock)."""
        refused = self._refused.get(members)
        return refused is not None and time.monotonic() - refused < REFUSED_FOR_S

    def _refuse(self, job: _Build) -> None:
        """No graph for ``job``'s receivers for :data:`REFUSED_FOR_S`: free what was
        claimed; a broadcast to them after that asks again (the receiver that was busy
        is idle, the other learner's channel let go)."""
        self._release(job.targets)
        with self._lock:
            now = time.monotonic()
            for members in [m for m, at in self._refused.items() if now - at >= REFUSED_FOR_S]:
                del self._refused[members]
            self._refused[job.members] = now
            if self._wanted == job.members:
                self._wanted = ()

    def _answer(self, written: Written) -> None:
        """Read one version's replies; hand them to the broadcast waiting in
        :meth:`collect`, or to the hub if it went on. A channel that broke is torn down
        (every reply still out is :class:`ChannelLost`)."""
        replies: dict[str, Ack | ChannelLost | None] = {}
        broken = None
        for worker, ref in zip(written.tokens, written.refs, strict=True):
            if broken is None:
                try:
                    replies[worker] = ref.get(timeout=written.timeout_s * REPLIES_WAIT_SHARE)
                    continue
                except Exception as err:  # Ray's channel errors, a death, a time-out
                    broken = f"the learner's channel broke ({type(err).__name__}: {err})"
            replies[worker] = ChannelLost(broken)
        stamp: CallStamp | None = None
        with self._changed:
            written.replies, written.done, self._out = replies, True, None
            self._changed.notify_all()
            forward = written.forward
            # Only the graph it was written into, if still the channel's (a build since
            # tore that one down and holds the one it built).
            torn = broken is not None and self._graph is written.graph
            targets = self._targets
            if torn:
                self._graph, self._members, self._wanted = None, (), ()
                # Before a build can see the graph gone and claim its receivers again:
                # a release that reaches one after that claim is stale there.
                stamp = self._stamp()
        if forward:
            self._hub.channel_replies.remote(
                self._submitter, written.model, written.version, replies
            )
        if torn:
            self._teardown(written.graph, targets, stamp)

    def _teardown(
        self,
        graph: Any = None,
        targets: tuple[DirectTarget, ...] | None = None,
        stamp: CallStamp | None = None,
    ) -> None:
        """Tear down ``graph`` (default: the current one) and free its receivers' claims
        (with ``stamp``, taken when the graph was let go of, else as they are freed)."""
        if graph is None:
            with self._lock:
                graph, targets, self._graph = self._graph, self._targets, None
                stamp = self._stamp()
        if graph is None or targets is None:
            return
        try:
            graph.teardown()
        except Exception as err:  # a receiver that died cannot be cancelled: nothing left
            logger.info("channel teardown: %s", err)
        self._release(targets, stamp)

    def _release(self, targets: Sequence[DirectTarget], stamp: CallStamp | None = None) -> None:
        stamp = stamp or self._stamp()
        for t in targets:
            t.handle.__ray_call__.options(max_task_retries=0).remote(
                release_channel, self._holder, stamp
            )

    def _stamp(self) -> CallStamp:
        """The next call's stamp: a receiver runs no call of this channel's stamped
        before one it ran (see :class:`raysync.receiver_delivery.CallStamp`)."""
        return self._instance, next(self._calls)


def _spare_from_ray_shutdown(graph: Any) -> None:
    """Keep ``graph`` out of Ray's list of this process's compiled graphs: ``ray.shutdown()``
    (which Ray also runs at the process's exit) tears each one down with
    ``kill_actors=True``, killing every actor in it, here receivers this learner does not
    own (detached ones, another job's), which must outlive it. The channel tears its
    graph down itself, killing nobody: :meth:`ReceiverChannel.close`, run for every
    channel at exit too (:mod:`raysync.learner_side`)."""
    compiled_dag_node._compiled_dags.pop(graph.get_id(), None)
