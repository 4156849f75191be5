"""A receiver whose hub forgot it registers again once, whoever finds out first
(raysync/receiver_core.py ``register_again``): its hub watch's heartbeat
(raysync/receiver_hub_watch.py) and a pull both find the hub no longer knows the
registration, and the one that comes second, after the other registered again, no
longer registers over it (a new token and transport receiver, the first one's thrown
away, and one more round trip with the hub). Each still gets what it needs: the pull
asks the hub again, and the hub watch stays connected and delivers, or catches up,
what the hub's welcome offered.

A real ReceiverCore and HubWatch, with the object store's transport receiver reading
inline versions; the hub is a stand-in that restarted (it knows no registration until
one registers again), whose calls answer with futures (read by this test's
``ray.get``), and one of them later, once the test lets it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch

from raysync import receiver_core
from raysync.errors import UnknownWorkerError
from raysync.messages import Ack, AckStatus, Update, Welcome
from raysync.receiver_core import HeldModel, ReceiverCore, ReceiverIdentity
from raysync.receiver_hub_watch import HubConnection, HubWatch
from raysync.spec import WeightSpec
from raysync.transports.object_store.wire import InlinePayload
from tests.unit.threads import on_a_thread

WORKER = "collector-1"
BEAT = 0.5
#: Seconds any one step may take: a failure, not a hang, if it does not happen.
BOUND_S = 30.0


def _version(spec: WeightSpec, model: str, version: int) -> Update:
    """Version ``version`` of ``model``, every value ``version + 0.5``, carried inline."""
    arrays = tuple(
        torch.full(entry.shape, version + 0.5, dtype=entry.dtype).numpy() for entry in spec.tensors
    )
    return Update(model, version, spec.digest, "object_store", InlinePayload(arrays))


class _RestartedHub:
    """Stands for a HubHandle whose hub restarted: it knows no registration of the
    receiver until one registers again, then offers and answers pulls with ``latest``.
    Every call answers with a future; :meth:`hold` keeps the answer of a method's next
    call (found as the call comes) until :meth:`release`."""

    transport = "object_store"

    def __init__(self, latest: dict[str, Update]) -> None:
        self.config = SimpleNamespace(hub_id="hub")
        self.latest = latest
        self.known: set[str] = set()  #: tokens it knows
        self.registered: list[str] = []  #: tokens registered, in order
        self.acks: list[Ack] = []
        self.asked: dict[str, threading.Event] = {}  #: held method -> its call came
        self._holding: set[str] = set()
        #: held method -> its call's answer as found, and the reply the caller waits on
        self._held: dict[str, tuple[concurrent.futures.Future[Any], ...]] = {}
        self.actor = SimpleNamespace(
            heartbeat=self._method("heartbeat", self._heartbeat),
            register=self._method("register", self._register),
            latest=self._method("latest", self._latest),
            ack=SimpleNamespace(remote=self.acks.append),
        )

    def hold(self, name: str) -> None:
        self._holding.add(name)
        self.asked[name] = threading.Event()

    def release(self, name: str) -> None:
        found, reply = self._held.pop(name)
        error = found.exception()
        if error is None:
            reply.set_result(found.result())
        else:
            reply.set_exception(error)

    def _method(self, name: str, answer: Callable[..., Any]) -> SimpleNamespace:
        def remote(*args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
            found: concurrent.futures.Future[Any] = concurrent.futures.Future()
            try:
                found.set_result(answer(*args, **kwargs))
            except Exception as err:
                found.set_exception(err)
            if name not in self._holding:
                return found
            self._holding.discard(name)
            reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._held[name] = (found, reply)
            self.asked[name].set()
            return reply

        return SimpleNamespace(remote=remote)

    def _heartbeat(self, worker: str, token: str) -> bool:
        return token in self.known

    def _register(self, registration: Any) -> Welcome:
        self.registered.append(registration.token)
        self.known = {registration.token}
        offered = {
            model: update
            for model, update in self.latest.items()
            if registration.versions[model] < update.version
        }
        return Welcome("object_store", registration.worker, offered)

    def _latest(
        self, model: str, have_version: int = 0, worker: str = "", have_origin: str = ""
    ) -> Update | None:
        if not self.known:  # by worker, as the hub's: it knows no registration of it
            raise ray.exceptions.RayTaskError(
                "latest", "(the hub's traceback)", UnknownWorkerError(f"{worker!r} unknown")
            ).as_instanceof_cause()
        update = self.latest[model]
        return update if have_version < update.version else None


class _Receiver:
    """A push receiver (a driver: no actor) of ``policy`` and ``critic``, its hub
    restarted, and its hub watch (its beats run when the test calls them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.owner = SimpleNamespace(policy=torch.nn.Linear(3, 2), critic=torch.nn.Linear(2, 1))
        models = {name: HeldModel(name, name) for name in ("policy", "critic")}
        self.specs = {name: held.destination(self.owner)[1] for name, held in models.items()}
        self.sent = {
            "policy": _version(self.specs["policy"], "policy", 3),
            "critic": _version(self.specs["critic"], "critic", 2),
        }
        self.hub = _RestartedHub(self.sent)
        monkeypatch.setattr(
            receiver_core.ray, "get", lambda ref, timeout=None: ref.result(timeout or BOUND_S)
        )
        # A driver's runtime context (asking Ray for one starts a local cluster).
        context = SimpleNamespace(
            get_node_id=lambda: "node",
            get_worker_id=lambda: "driver",
            get_actor_id=lambda: None,
        )
        monkeypatch.setattr(receiver_core.ray, "get_runtime_context", lambda: context)
        identity = ReceiverIdentity(WORKER, "Driver", "attachment", heartbeat_s=BEAT)
        welcome = Welcome("object_store", WORKER, {})
        self.core = ReceiverCore(self.owner, self.hub, models, identity, welcome, "first", None)
        self.watch = HubWatch(self.core, BEAT)

    def holds_what_was_sent(self, model: str) -> bool:
        """Whether ``model`` holds the version sent of it, bitwise."""
        update = self.sent[model]
        model_tensors = dict(getattr(self.owner, model).state_dict())
        return self.core.models[model].version == update.version and all(
            torch.equal(model_tensors[name], torch.from_numpy(array))
            for name, array in zip(self.specs[model].names, update.payload.arrays, strict=True)
        )


CONNECTED = HubConnection(watched=True, connected=True, reregistering_since=None, last_error=None)


def test_a_pull_that_finds_the_hub_watch_registered_again_asks_the_hub_again(monkeypatch):
    """A pull asks the restarted hub, which answers that it does not know the
    receiver; before that answer comes, the hub watch's beat registers again and
    delivers the versions the welcome offers. The pull then asks the hub again under
    that registration, instead of registering over it."""
    receiver = _Receiver(monkeypatch)
    core, hub = receiver.core, receiver.hub
    hub.hold("latest")
    pulled = on_a_thread(lambda: core.latest("policy", BOUND_S))
    assert hub.asked["latest"].wait(BOUND_S)  # the hub does not know the receiver

    assert receiver.watch.beat() == BEAT  # registers again, delivers policy and critic
    registered = core.token, core.transport
    hub.release("latest")

    assert pulled.result(BOUND_S) is None  # asked again: it holds the latest already
    assert hub.registered == [registered[0]], "the pull registered over the watch's"
    assert (core.token, core.transport) == registered
    assert receiver.holds_what_was_sent("policy") and receiver.holds_what_was_sent("critic")
    assert receiver.watch.connection() == CONNECTED
    assert [(a.model, a.version, a.status) for a in hub.acks] == [
        ("policy", 3, AckStatus.APPLIED),
        ("critic", 2, AckStatus.APPLIED),
    ]


def test_the_hub_watch_that_finds_a_pull_registered_again_catches_up_without_registering(
    monkeypatch,
):
    """The hub watch's heartbeat finds the restarted hub not knowing the receiver;
    before that answer comes, a pull of ``policy`` registers again (declining what the
    welcome offers, the models left behind for the watch) and gets ``policy``. The
    watch then neither registers over that registration nor ends: it stays connected
    and catches up ``critic``, which the welcome offered."""
    receiver = _Receiver(monkeypatch)
    core, hub = receiver.core, receiver.hub
    hub.hold("heartbeat")
    beat = on_a_thread(receiver.watch.beat)
    assert hub.asked["heartbeat"].wait(BOUND_S)  # the hub does not know "first"

    pulled = core.latest("policy", BOUND_S)  # registers again
    assert pulled == receiver.sent["policy"]
    core.apply_now(pulled, "while pulling")
    assert core.behind == {"policy", "critic"}  # the welcome's, declined by the pull
    registered = core.token, core.transport
    hub.release("heartbeat")

    assert beat.result(BOUND_S) == BEAT
    assert hub.registered == [registered[0]], "the watch registered over the pull's"
    assert (core.token, core.transport) == registered
    assert receiver.watch.connection() == CONNECTED
    assert core.behind == set()
    assert receiver.holds_what_was_sent("policy") and receiver.holds_what_was_sent("critic")
    assert [(a.model, a.version, a.status) for a in hub.acks] == [
        ("policy", 3, AckStatus.APPLIED),
        ("critic", 2, AckStatus.APPLIED),
    ]
