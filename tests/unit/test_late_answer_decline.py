"""A pull that stopped waiting declines the hub's late answer of a bucketed version
(raysync/receiver_core.py ``_decline_when_answered``, then the object store's
``ObjectStoreReceiver.decline``), against a real BucketBroker (actors/bucket_broker.py)
on an event loop of its own, the real object-store planner, learner stream and reader.

While nobody who read the version whole can serve it, the hub answers a pull with the
version's own stream: the one its broadcast is delivering to this very receiver.
Declining that answer gave up the receiver's place in the stream, and the broadcast's
read then failed (the receiver caught up only at a later beat). It is left alone now;
a stream served for the declined pull alone is still given up at once (its server and
the broker stop waiting for a reader that never comes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import ray
import torch

from raysync import receiver_core
from raysync.actors.bucket_broker import BucketBroker
from raysync.messages import Ack, AckStatus, ServeRequest, Update, Welcome
from raysync.receiver_core import HeldModel, ReceiverCore, ReceiverIdentity
from raysync.receiver_receipt import AckNow
from raysync.spec import WeightSpec
from raysync.transports.base import ReceiverInfo, VersionDone
from raysync.transports.object_store import buckets
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.planner import ObjectStorePlanner
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from tests.unit.threads import on_a_thread

#: Seconds any one step may take: a failure, not a hang, if it does not happen.
BOUND_S = 30.0
#: Bytes per bucket: a Linear(8, 4) (144 bytes) moves in three buckets.
BUCKET_BYTES = 64
#: The learner's stall: its streams wait 2 * 60 s for a bucket, and a served stream's
#: reader that never begins it is dropped only after that (longer than ``BOUND_S``).
STALL_S = 60.0


async def _not_closed() -> bool:
    return False


#: The hub the broker looks at every few seconds, open for the whole test.
_OPEN_HUB = SimpleNamespace(closed=SimpleNamespace(remote=_not_closed))


class _BrokerActor:
    """The real BucketBroker called as its actor is: each method's ``remote`` runs it on
    the broker's own event loop; from that loop (the hub's planner, in this test) it
    answers with a task to await, from any other thread with a future that the
    stand-in of ``ray`` (:class:`_ObjectStoreRay`) reads."""

    def __init__(self, broker: BucketBroker, loop: asyncio.AbstractEventLoop) -> None:
        self.broker = broker
        self.loop = loop

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self.broker, name)

        async def call(*args: Any) -> Any:
            result = method(*args)
            return await result if inspect.isawaitable(result) else result

        def remote(*args: Any) -> Any:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # a learner's or a receiver's thread
                return asyncio.run_coroutine_threadsafe(call(*args), self.loop)
            return asyncio.ensure_future(call(*args))

        return SimpleNamespace(remote=remote)

    def on_loop(self, coroutine: Any) -> Any:
        """What ``coroutine`` returns, run on the broker's loop (the hub's calls)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(BOUND_S)


class _ObjectStoreRay:
    """Stands for ``ray`` where a bucket stream's learner and readers call it: every
    ref is a future (a broker's answer, or a bucket put)."""

    exceptions = ray.exceptions

    @staticmethod
    def get(ref: concurrent.futures.Future[Any], timeout: float | None = None) -> Any:
        return ref.result(BOUND_S if timeout is None else timeout)

    @staticmethod
    def wait(refs: Sequence[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        done, waiting = concurrent.futures.wait(refs, timeout)
        return list(done), list(waiting)

    @staticmethod
    def get_runtime_context() -> SimpleNamespace:
        return SimpleNamespace(get_actor_id=lambda: None)  # a driver: no sender to watch


def _put(arrays: Sequence[np.ndarray]) -> concurrent.futures.Future[Any]:
    """A bucket put into the object store: a copy of its arrays, as ``put_arrays``
    lays them out (none joined from chunks)."""
    stored: concurrent.futures.Future[Any] = concurrent.futures.Future()
    stored.set_result(((), *(np.array(array, copy=True) for array in arrays)))
    return stored


class _NeverEnds(VersionDone):
    """A broadcast that runs for the whole test."""

    def wait(self, timeout_s: float) -> None:
        raise TimeoutError


@pytest.fixture
def broker(monkeypatch) -> Iterator[_BrokerActor]:
    """The hub's bucket broker on an event loop of its own, and buckets that go through
    futures instead of Ray's object store."""
    monkeypatch.setattr(buckets, "ray", _ObjectStoreRay)
    monkeypatch.setattr(buckets, "put_arrays", _put)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="broker loop", daemon=True)
    thread.start()
    actor = _BrokerActor(BucketBroker(_OPEN_HUB), loop)
    yield actor
    actor.on_loop(_cancel_the_others())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(BOUND_S)
    loop.close()


async def _cancel_the_others() -> None:
    """Stop the broker's timers and watches (the test is over)."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def _info(worker: str, handle: Any = None) -> ReceiverInfo:
    return ReceiverInfo(worker, f"Collector({worker})", "node", "process", handle)


class _Puller:
    """A push receiver ``worker`` of one model (a Linear(8, 4)) with its real transport
    receiver, whose hub answers a pull only after the pull stopped waiting."""

    def __init__(self, worker: str) -> None:
        self.owner = SimpleNamespace(policy=torch.nn.Linear(8, 4))
        self.late: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call = SimpleNamespace(future=lambda: self.late)  # the hub's ``latest`` call
        self.acks: list[Ack] = []
        hub = SimpleNamespace(
            transport="object_store",
            config=SimpleNamespace(hub_id="hub"),
            actor=SimpleNamespace(
                ack=SimpleNamespace(remote=self.acks.append),
                latest=SimpleNamespace(remote=lambda *args, **kwargs: call),
            ),
        )
        identity = ReceiverIdentity(worker, f"Collector({worker})", f"attachment {worker}")
        models = {"policy": HeldModel("policy", "policy")}
        # The transport's receiver as registering opens it: object_store's info is
        # the worker id, by which it reads bucket streams.
        welcome = Welcome("object_store", worker, {})
        self.core = ReceiverCore(self.owner, hub, models, identity, welcome, "token", None)
        self.spec = models["policy"].destination(self.owner)[1]

    def pull_giving_up(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The hub watch's catch-up pull times out before the hub answers."""

        def not_answered(ref: Any, timeout: float | None = None) -> Any:
            raise ray.exceptions.GetTimeoutError("the hub did not answer in time")

        with monkeypatch.context() as patched:
            patched.setattr(receiver_core.ray, "get", not_answered)
            with pytest.raises(ray.exceptions.GetTimeoutError):
                self.core.latest("policy", 5.0)

    def answered_late(self, update: Update) -> None:
        """The hub answers the pull that gave up with ``update``; returns once the
        receiver declined it (on a thread of its own)."""
        self.late.set_result(update)  # its callback starts the decline, in this thread
        for thread in threading.enumerate():
            if thread.name == "raysync-decline":
                thread.join(BOUND_S)

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.owner.policy.state_dict())


def _version(spec: WeightSpec, seed: int) -> dict[str, torch.Tensor]:
    """The learner's tensors of one version of ``spec``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(entry.shape, generator=generator, dtype=entry.dtype)
        for name, entry in zip(spec.names, spec.tensors, strict=True)
    }


def _broadcast(
    broker: _BrokerActor,
    planner: ObjectStorePlanner,
    targets: Sequence[ReceiverInfo],
    sent: Mapping[str, torch.Tensor],
    spec: WeightSpec,
) -> tuple[Update, concurrent.futures.Future[Any]]:
    """Version 1 of ``policy`` as the learner starts its bucket stream, planned by the
    hub for ``targets``; the update, and the learner's ``stream_out`` outcome (it
    streams on a thread of its own)."""
    payload, outgoing = buckets.start_stream(broker, sent, spec, BUCKET_BYTES, STALL_S)
    update = Update("policy", 1, spec.digest, "object_store", payload)
    broker.on_loop(planner.plan(update, spec, targets))
    streamed = on_a_thread(lambda: buckets.stream_out(payload, outgoing, _NeverEnds()))
    return update, streamed


def _planner(broker: _BrokerActor, *receivers: ReceiverInfo) -> ObjectStorePlanner:
    planner = ObjectStorePlanner()
    for info in receivers:
        broker.on_loop(planner.receiver_joined(info))
    return planner


def test_a_declined_late_answer_leaves_the_broadcast_of_the_same_version_its_stream(
    broker, monkeypatch
):
    """The broadcast of bucketed version 1 goes to ``w``; meanwhile ``w``'s hub watch
    pulls, times out, and the hub answers it late with the version's own stream (nobody
    read it whole yet to serve it). Declined, that answer gave up ``w``'s place in the
    stream: the broadcast's read then failed. Now the broadcast is read and applied,
    bitwise, and the stream ends read by every reader."""
    puller = _Puller("w")
    planner = _planner(broker, _info("w"))
    sent = _version(puller.spec, seed=1)
    update, streamed = _broadcast(broker, planner, [_info("w")], sent, puller.spec)

    puller.pull_giving_up(monkeypatch)
    answer = broker.on_loop(planner.plan_pull(update, puller.spec, _info("w")))
    assert answer is update.payload  # the stream the broadcast delivers to ``w``
    puller.answered_late(dataclasses.replace(update, payload=answer))

    receipt = puller.core.receive(update)  # the broadcast's delivery to ``w``
    assert receipt == AckNow(Ack("w", "policy", 1, AckStatus.APPLIED, token="token")), (
        receipt.ack.error if isinstance(receipt, AckNow) else receipt
    )
    assert puller.core.models["policy"].version == 1
    state = puller.state()
    assert all(torch.equal(state[name], sent[name]) for name in puller.spec.names)
    assert streamed.result(BOUND_S) is None
    assert broker.on_loop(_stats(broker)).streams == 0  # read whole: over, nothing held


class _Holder:
    """A receiver that read the version whole, called as the planner calls its actor
    (``serve_call``): it serves ``tensors`` through the stream on a thread of its own,
    by its real transport receiver; ``serving`` is that serve's outcome."""

    def __init__(self, worker: str) -> None:
        self.transport = ObjectStoreReceiver(worker)
        self.tensors: Mapping[str, torch.Tensor] = {}  #: its model, once it read one
        self.serving: concurrent.futures.Future[Any] | None = None
        self.__ray_call__ = SimpleNamespace(
            options=lambda **options: SimpleNamespace(remote=self._serve)
        )

    def _serve(self, serve: Any, attachment: str, request: ServeRequest) -> Any:
        self.serving = on_a_thread(
            lambda: self.transport.serve(request.payload, self.tensors, request.spec)
        )
        return asyncio.wrap_future(self.serving)  # the planner awaits the call


def test_a_declined_late_answer_served_for_that_pull_alone_is_given_up(broker, monkeypatch):
    """``h`` read bucketed version 1 whole; ``w`` joined after and pulls it, and the
    hub has ``h`` serve it a stream of its own. ``w``'s pull gave up before the answer
    came: declined, that stream is given up at once (only that pull held it), so ``h``
    stops serving and the broker holds no bucket of it, instead of both waiting out
    the stream's wait for a reader that never begins it."""
    holder = _Holder("h")
    planner = _planner(broker, _info("h", handle=holder))
    spec = WeightSpec.of(dict(torch.nn.Linear(8, 4).state_dict()))
    sent = _version(spec, seed=2)
    update, streamed = _broadcast(broker, planner, [_info("h")], sent, spec)
    staged = holder.transport.fetch(update.payload, spec)
    holder.tensors = {name: t.clone() for name, t in zip(spec.names, staged, strict=True)}
    holder.transport.release(update.payload, staged)
    assert streamed.result(BOUND_S) is None

    puller = _Puller("w")
    broker.on_loop(planner.receiver_joined(_info("w")))
    puller.pull_giving_up(monkeypatch)
    answer = broker.on_loop(planner.plan_pull(update, puller.spec, _info("w")))
    assert isinstance(answer, BucketStream) and answer.key.served  # for this pull alone
    puller.answered_late(dataclasses.replace(update, payload=answer))

    assert holder.serving is not None and holder.serving.result(BOUND_S) is None
    assert broker.on_loop(_stats(broker)).streams == 0
    assert broker.on_loop(broker.broker.take(answer.key, 0, "w")) == (
        None,
        "this receiver was dropped from the stream: it gave the version up (its ack says why)",
    )


async def _stats(broker: _BrokerActor) -> Any:
    """The broker's stats, once the calls sent to it before ran."""
    return broker.broker.stats()
