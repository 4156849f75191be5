"""Receiver actor classes shared by the tests (module level so Ray can pickle them)."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch

import raysync
from raysync import WeightReceiver, weight_receiver
from raysync.receiver_hub_watch import HEARTBEAT_S


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


def make_probe_model(width: int = 256, layers: int = 8) -> torch.nn.Module:
    """Big enough that copying it takes a while, so a torn read would be seen."""
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def make_many_small_model() -> torch.nn.Module:
    """16 MiB in 128 tensors of 256 KiB and 1 KiB: what the object store puts in one
    object per copy thread of the learner (``put_version``)."""
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(64)])


def filled(model: torch.nn.Module, value: float) -> dict[str, torch.Tensor]:
    """A state_dict of ``model``'s spec with every element equal to ``value``."""
    return {k: torch.full_like(v, value) for k, v in model.state_dict().items()}


#: Threads of gRPC's EventEngine pool (named ``event_engine``), which grows while its
#: threads are busy and shrinks when idle: 3 in a quiet hub, 5 or more in one loaded by
#: other processes, whatever raysync does.
ELASTIC_THREADS = "event_engine"


def process_stats(self) -> dict:
    """Runs inside any actor through ``__ray_call__``: its own fds, RSS and threads (by
    name, ``/proc/self/task/*/comm``; ``threads`` counts all but gRPC's elastic pool)."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    names: dict[str, int] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # it ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "tcp": _established_tcp(),
        "threads": sum(n for name, n in names.items() if name != ELASTIC_THREADS),
        "thread_names": names,
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
    }


def _established_tcp() -> int:
    """How many of this process's fds are established TCP connections (its gRPC
    channels to other Ray processes, and theirs to it)."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:[") : -1])
    established = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            established += fields[3] == "01" and fields[9] in sockets
    return established


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Opaque:
    """A model reachable only through state_dict() / load_state_dict()."""

    def __init__(self) -> None:
        self._w = torch.zeros(6)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self._w.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._w.copy_(state["w"])


class _Inspect:
    """Methods every test receiver offers."""

    def state(self, path: str = "policy") -> dict[str, torch.Tensor]:
        obj = self
        for part in path.split("."):
            obj = getattr(obj, part)
        if hasattr(obj, "flatten_keys"):  # a TensorDict
            return {k: v.clone() for k, v in obj.flatten_keys(".").items()}
        if isinstance(obj, dict):
            return {k: v.clone() for k, v in obj.items()}
        return state_of(obj)

    def version(self, model: str | None = None) -> int:
        return self.weights_version(model)

    def data_ptrs(self, path: str = "policy") -> dict[str, int]:
        return {k: v.data_ptr() for k, v in getattr(self, path).state_dict().items()}


@ray.remote(num_cpus=0)
class HookCaller(WeightReceiver, _Inspect):
    """A policy whose ``on_weights_applied`` calls one of its own public methods (a
    reader of the gate) each time, and closes the receiver at ``close_at``."""

    def __init__(self, hub, worker_id: str, close_at: int):
        self.policy = make_policy()
        self.close_at = close_at
        self.sums: list[float] = []
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=worker_id)

    def on_weights_applied(self, model: str, version: int) -> None:
        self.sums.append(self.weight_sum())
        if version == self.close_at:
            self._raysync_receiver.close()

    def weight_sum(self) -> float:
        return float(sum(p.detach().sum() for p in self.policy.parameters()))

    def seen_sums(self) -> list[float]:
        return list(self.sums)


@ray.remote(num_cpus=0)
class AsyncLeaver(WeightReceiver):
    """An async actor whose hook closes its receiver at ``close_at``; ``hold`` keeps its
    policy held while versions arrive (they are deferred until it returns)."""

    def __init__(self, hub, worker_id: str, close_at: int):
        self.policy = make_policy()
        self.close_at = close_at
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=worker_id)

    def on_weights_applied(self, model: str, version: int) -> None:
        if version == self.close_at:
            self._raysync_receiver.close()

    async def hold(self, entered, leave) -> None:
        await entered.open.remote()
        await leave.wait.remote()

    async def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)


@ray.remote(num_cpus=0)
class Collector(WeightReceiver, _Inspect):
    """The README's collector: one policy."""

    def __init__(
        self,
        hub,
        worker_id=None,
        mode="push",
        model_factory=make_policy,
        transport=None,
        zero_copy=False,
        heartbeat_s=HEARTBEAT_S,
    ):
        self.policy = model_factory()
        self.applied: list[tuple[str, int]] = []
        self.connect_hub(
            hub,
            models={"policy": "policy"},
            worker_id=worker_id,
            mode=mode,
            transport=transport,
            zero_copy=zero_copy,
            heartbeat_s=heartbeat_s,
        )

    def on_weights_applied(self, model: str, version: int) -> None:
        self.applied.append((model, version))

    def applied_versions(self) -> list[tuple[str, int]]:
        return list(self.applied)

    def pull(self) -> dict[str, int]:
        return self.pull_weights()

    def hold(self, gate, entered=None) -> None:
        """See :func:`hold_until`."""
        hold_until(gate, entered)


class _Env:
    def __init__(self) -> None:
        self.transform = [torch.nn.BatchNorm1d(8), torch.nn.Identity()]


class _Nets:
    def __init__(self) -> None:
        self.critic = torch.nn.Linear(8, 1)


@ray.remote(num_cpus=0)
class Labeller(WeightReceiver):
    """Notes, at each version it applies, the value its policy's first weight holds then
    (learners that fill every weight with one value per broadcast: ``broadcast_filled``)."""

    def __init__(self, hub, worker_id):
        self.policy = make_policy()
        self.labels: list[tuple[int, float]] = []
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=worker_id)

    def on_weights_applied(self, model: str, version: int) -> None:
        self.labels.append((version, self.policy[0].weight[0, 0].item()))

    def applied_labels(self) -> list[tuple[int, float]]:
        return list(self.labels)


@ray.remote(num_cpus=0)
class MultiModel(WeightReceiver, _Inspect):
    """Several models behind attribute paths, items and non-Module containers."""

    def __init__(self, hub):
        self.policy = make_policy()
        self.nets = _Nets()
        self.env = _Env()
        # Imported here: tensordict loads torch._dynamo, ~1.3 s per process, and only
        # this receiver needs it.
        from tensordict import TensorDict

        self.td = TensorDict({"a": torch.zeros(3), "b": {"c": torch.zeros(2, 2)}}, [])
        self.sd = {"w": torch.zeros(4), "b": torch.zeros(1)}
        self.connect_hub(
            hub,
            models={
                "policy": "policy",
                "critic": "nets.critic",
                "obs_norm": "env.transform[0]",
                "td": "td",
                "sd": "sd",
            },
        )

    def norm_state(self) -> dict[str, torch.Tensor]:
        return state_of(self.env.transform[0])


@ray.remote(num_cpus=0)
class FailingHook(WeightReceiver, _Inspect):
    def __init__(self, hub):
        self.policy = make_policy()
        self.connect_hub(hub, models={"policy": "policy"})

    def on_weights_applied(self, model: str, version: int) -> None:
        if version >= 2:
            raise RuntimeError(f"hook refuses version {version}")


@ray.remote(num_cpus=0)
class SlowHook(WeightReceiver, _Inspect):
    def __init__(self, hub, delay_s: float, worker_id: str | None = None):
        self.policy = make_policy()
        self.delay_s = delay_s
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=worker_id)

    def on_weights_applied(self, model: str, version: int) -> None:
        if version >= 2:
            time.sleep(self.delay_s)


@ray.remote(num_cpus=0)
class WrongModel(WeightReceiver):
    """Its policy's last layer has 3 outputs instead of 2."""

    def __init__(self, hub):
        self.policy = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
        )
        self.connect_hub(hub, models={"policy": "policy"})

    def ping(self) -> str:
        return "pong"


def _uniform_read(model: torch.nn.Module, split: bool = False):
    values = [float(p.view(-1)[0]) for p in model.parameters()]
    ok = all(bool((p == values[0]).all()) for p in model.parameters())
    return ok, values[0]


@ray.remote(num_cpus=0, max_concurrency=4)
class ThreadedProbe(WeightReceiver):
    """Threaded actor: reads its whole model in a loop while updates land."""

    def __init__(self, hub, zero_copy=False, width=256):
        self.model = make_probe_model(width)
        self.connect_hub(hub, models={"probe": "model"}, zero_copy=zero_copy)

    def probe(self, seconds: float, safe_points: bool, entered=None) -> dict:
        """Read the model for ``seconds``; ``entered`` (a ``Gate``) is opened once this
        method holds the model (a threaded actor may start calls out of order)."""
        if entered is not None:
            ray.get(entered.open.remote())
        torn, seen, reads = 0, set(), 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ok, value = _uniform_read(self.model)
            torn += not ok
            seen.add(value)
            reads += 1
            if safe_points:
                self.weights_safe_point()
        return {"torn": torn, "seen": sorted(seen), "reads": reads}


@ray.remote(num_cpus=0)
class AsyncProbe(WeightReceiver):
    """Async actor: each read spans an await, so a write in between would tear it."""

    def __init__(self, hub, width=256):
        self.model = make_probe_model(width)
        self.applied: list[int] = []
        self.connect_hub(hub, models={"probe": "model"})

    def on_weights_applied(self, model: str, version: int) -> None:
        self.applied.append(version)

    async def applied_versions(self) -> list[int]:
        return list(self.applied)

    async def first_value(self) -> float:
        return float(next(self.model.parameters()).view(-1)[0])

    async def probe(self, seconds: float, safe_points: bool, entered=None) -> dict:
        """Read the model for ``seconds``; ``entered`` (a ``Gate``) is opened once this
        method holds the model (an async actor may start calls out of order)."""
        if entered is not None:
            await entered.open.remote()
        torn, seen, reads = 0, set(), 0
        end = time.monotonic() + seconds
        params = list(self.model.parameters())
        half = len(params) // 2
        while time.monotonic() < end:
            first = [float(p.view(-1)[0]) for p in params[:half]]
            await asyncio.sleep(0.001)
            second = [float(p.view(-1)[0]) for p in params[half:]]
            values = first + second
            torn += len(set(values)) != 1
            seen.add(values[0])
            reads += 1
            if safe_points:
                self.weights_safe_point()
        return {"torn": torn, "seen": sorted(seen), "reads": reads}

    async def version_async(self) -> int:
        return self.weights_version()


@ray.remote(num_cpus=0)
class FanOut(WeightReceiver):
    """Async actor serving like an inference engine: ``generate`` fans out to
    ``generate_one`` (user methods too) with ``asyncio.gather``, once a delivery came
    while it held the model and was deferred to its end."""

    def __init__(self, hub):
        self.model = make_probe_model()
        self.deferred = asyncio.Event()
        self.loop = asyncio.get_running_loop()  # Ray runs an async actor's __init__ there
        self.connect_hub(hub, models={"probe": "model"})

    def _raysync_deliver(self, key, update):
        ack = super()._raysync_deliver(key, update)  # on Ray's thread, off the loop
        if ack is None:  # deferred to the end of the user method that runs
            self.loop.call_soon_threadsafe(self.deferred.set)
        return ack

    async def generate(self, prompts: int, entered=None) -> list[float]:
        """``entered`` (a ``Gate``) is opened once this method holds the model (an async
        actor may start calls out of order)."""
        if entered is not None:
            await entered.open.remote()
        await self.deferred.wait()
        return list(await asyncio.gather(*(self.generate_one() for _ in range(prompts))))

    async def generate_one(self) -> float:
        await asyncio.sleep(0)  # parked once, as a request is
        return float(next(self.model.parameters()).view(-1)[0])

    async def stream(self, tokens: int):
        """A streamed reply (an async generator): its first item, then the rest once a
        delivery came while it streamed and was deferred to its end."""
        yield float(next(self.model.parameters()).view(-1)[0])
        await self.deferred.wait()
        for _ in range(tokens - 1):
            yield float(next(self.model.parameters()).view(-1)[0])


@ray.remote(num_cpus=0)
@weight_receiver
class Decorated:
    def __init__(self, hub):
        self.policy = make_policy()
        self.connect_hub(hub, "policy")

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)

    def version(self) -> int:
        return self.weights_version()


class _Stalls:
    """File handshakes across processes: at stall point ``where`` (``busy``, ``fetch`` or
    ``apply``) the first incarnation of the actor touches ``<dir>/inside-<where>-<name>``
    and waits while ``<dir>/stall-<where>-<name>`` exists. Incarnations Ray restarts
    never stall, so the test can leave the file until the kill is certain."""

    def _first_incarnation(self, stall_dir: str, name: str) -> bool:
        try:
            Path(stall_dir, f"incarnation-{name}").touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    def _stall(self, where: str) -> None:
        if not self.first:
            return
        stall = Path(self.stall_dir, f"stall-{where}-{self.name}")
        if stall.exists():
            Path(self.stall_dir, f"inside-{where}-{self.name}").touch()
            while stall.exists():
                time.sleep(0.01)


@ray.remote(num_cpus=0)
class AsyncStalled(WeightReceiver, _Stalls):
    """An async mixin actor whose fetches stall at ``fetch`` (:class:`_Stalls`)."""

    def __init__(self, hub, stall_dir: str, name: str):
        self.model = make_probe_model(64, 4)
        self.model.load_state_dict(filled(self.model, 0.0))
        self.stall_dir, self.name, self.first = stall_dir, name, True
        self.connect_hub(hub, models={"probe": "model"}, worker_id=name)
        _stall_fetches(self, self._raysync_receiver.core.transport)

    async def first_value(self) -> float:
        return float(next(self.model.parameters()).view(-1)[0])


@ray.remote(num_cpus=0, concurrency_groups={"collect": 1})
class GroupLooper(WeightReceiver):
    """An async mixin actor whose sync ``collect`` loops in a concurrency group of its
    own (Ray runs the group on an event loop of its own, which the method holds),
    letting versions in at its safe points until ``stop``."""

    def __init__(self, hub):
        self.model = make_probe_model(64, 4)
        self.model.load_state_dict(filled(self.model, 0.0))
        self.stopping = threading.Event()
        self.connect_hub(hub, models={"probe": "model"})

    @ray.method(concurrency_group="collect")
    def collect(self, entered) -> list[float]:
        """The first value of each version it saw between its safe points."""
        ray.get(entered.open.remote())
        seen: list[float] = []
        while not self.stopping.is_set():
            value = float(next(self.model.parameters()).view(-1)[0])
            if not seen or seen[-1] != value:
                seen.append(value)
            self.weights_safe_point()
            self.stopping.wait(0.001)  # a step of work
        return seen

    async def stop(self) -> None:
        self.stopping.set()


def _stall_fetches(receiver, transport) -> None:
    """Make ``transport.fetch`` stall (``fetch`` point) before it moves any data."""
    fetch = transport.fetch

    def stalling_fetch(payload, spec):
        receiver._stall("fetch")
        return fetch(payload, spec)

    transport.fetch = stalling_fetch


class Victim(WeightReceiver, _Stalls, _Inspect):
    """A collector that can be held at a known moment of a delivery and killed there.

    Started through :func:`start_victim` with or without Ray restarts. ``connected_at``
    is when this incarnation's ``connect_hub`` returned (``time.time()``).
    """

    def __init__(self, hub, name: str, stall_dir: str, heartbeat_s: float = 0.3):
        self.policy = make_policy()
        self.name = name
        self.stall_dir = stall_dir
        self.first = self._first_incarnation(stall_dir, name)
        self.applied_at: dict[int, float] = {}
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=name, heartbeat_s=heartbeat_s)
        self.connected_at = time.time()
        _stall_fetches(self, self._raysync_receiver.core.transport)

    def on_weights_applied(self, model: str, version: int) -> None:
        self.applied_at[version] = time.time()
        self._stall("apply")

    def busy(self) -> None:
        self._stall("busy")

    def connected(self) -> float:
        return self.connected_at

    def stall_path(self) -> str:
        return self.stall_dir

    def applied_time(self, version: int) -> float:
        """When this incarnation applied ``version`` (``time.time()``)."""
        return self.applied_at[version]


def start_victim(hub, name: str, stall_dir: str, *, restarts: bool):
    """A :class:`Victim` actor; with ``restarts`` Ray restarts it after a kill (and
    retries the test's own calls on the new incarnation)."""
    options = {"num_cpus": 0, "max_restarts": -1 if restarts else 0}
    options["max_task_retries"] = -1 if restarts else 0
    return ray.remote(Victim).options(**options).remote(hub, name, stall_dir)


def hold_until(gate, entered=None) -> None:
    """Hold the calling actor's only method slot (a long rollout step) until the test
    opens ``gate`` (``tests.helpers.Gate``); ``entered`` (a Gate too) is opened on the
    way in."""
    if entered is not None:
        ray.get(entered.open.remote())
    ray.get(gate.wait.remote())


@ray.remote(num_cpus=0)
class Holder(WeightReceiver):
    """A receiver of an arbitrary state_dict, with a method that blocks deliveries."""

    def __init__(
        self,
        hub,
        template: dict[str, torch.Tensor],
        worker_id: str,
        model: str = "m",
        heartbeat_s: float = HEARTBEAT_S,
    ):
        self.sd = {k: torch.zeros_like(v) for k, v in template.items()}
        self.applied: list[int] = []
        self.connect_hub(hub, models={model: "sd"}, worker_id=worker_id, heartbeat_s=heartbeat_s)

    def on_weights_applied(self, model: str, version: int) -> None:
        self.applied.append(version)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.sd.items()}

    def version(self) -> int:
        return self.weights_version()

    def applied_versions(self) -> list[int]:
        """The versions applied, in order."""
        return list(self.applied)

    def hold(self, gate, entered=None) -> None:
        """Hold the actor's only method slot (a long rollout step) until the test opens
        ``gate`` (``tests.helpers.Gate``): no delivery gets in meanwhile. ``entered``
        (a Gate too) is opened on the way in."""
        hold_until(gate, entered)

    def parts_kept(self) -> int:
        """Versions sent in parts that the ``distributed`` receiver read from the
        learners' copies and still keeps the parts of (each pins every part's bytes)."""
        return len(self._raysync_receiver.core.transport.inner._pull._parts_of)


@ray.remote(num_cpus=0, concurrency_groups={"probe": 1})
class BeatCountingHolder(Holder.__ray_actor_class__):  # type: ignore[name-defined]
    """A Holder that counts its hub watch's beats and the delivery calls it runs. The
    beats are read in a concurrency group of their own, answered while ``hold`` keeps
    the default group's one thread (where deliveries queue)."""

    def __init__(self, hub, template, worker_id: str, heartbeat_s: float):
        self.beats = 0
        self.deliveries = 0
        super().__init__(hub, template, worker_id, heartbeat_s=heartbeat_s)
        core = self._raysync_receiver.core
        knows = core.hub_knows_me

        def counted(timeout_s: float) -> bool:
            self.beats += 1
            return knows(timeout_s)

        core.hub_knows_me = counted

    def _raysync_deliver(self, key, update):
        self.deliveries += 1
        return super()._raysync_deliver(key, update)

    @ray.method(concurrency_group="probe")
    def beats_so_far(self) -> int:
        return self.beats

    def deliveries_so_far(self) -> int:
        """Answered in the default group: after every delivery queued before it."""
        return self.deliveries

    def token(self) -> str:
        return self._raysync_receiver.core.token


# -- hosts written without raysync: receivers attach to them (raysync.attach) -------------
@ray.remote(num_cpus=0)
class PlainWorker:
    """An actor class that knows nothing of raysync (one you did not write)."""

    def __init__(self):
        self.nets = torch.nn.ModuleDict({"actor": make_policy()})

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.nets.actor(obs)


def refuse_versions(model: str, version: int) -> None:
    """An ``on_applied`` hook that fails every version (``attach(on_applied=...)``)."""
    raise RuntimeError(f"this host refuses version {version} of {model!r}")


def hold_then_pull(host, gate, entered) -> dict[str, int]:
    """Runs in a receiver through ``__ray_call__``: hold its method slot until ``gate``
    opens (a delivery queues behind), then pull the latest versions itself. ``entered``
    (a Gate too) is opened on the way in."""
    ray.get(entered.open.remote())
    ray.get(gate.wait.remote())
    return host.pull_weights()


def connect_policy_again(host, hub, path: str = "policy", **options) -> None:
    """Runs in a Collector through ``__ray_call__``: ``connect_hub`` again, under the
    same worker id, with its policy at ``path`` and ``options`` (another transport, say)."""
    worker = host._raysync_receiver.worker
    host.connect_hub(hub, models={"policy": path}, worker_id=worker, **options)


def close_receiver(host) -> None:
    """Runs in a WeightReceiver actor through ``__ray_call__``: it stops receiving and
    leaves its hub."""
    host._raysync_receiver.close()


def rpc_versions_kept(_host) -> int:
    """Runs in an actor through ``__ray_call__``: how many versions landed in its
    process's RPC inboxes and are kept there, untaken."""
    from raysync.transports.rpc import receiver as rpc_receiver

    whole = sum(len(versions) for versions in rpc_receiver._INBOX._landed.values())
    return whole + len(rpc_receiver._BUCKETS._landing)


def connect_again_failing_transport(host, hub) -> None:
    """Runs in a Collector through ``__ray_call__``: ``connect_hub`` again, under the same
    worker id, its transport receiver failing to open once the hub accepted it (as a
    NIXL agent that cannot start)."""
    from raysync import receiver_core

    real = receiver_core._open_transport

    def failing(welcome):
        raise RuntimeError("the transport's receiver could not be opened (injected)")

    receiver_core._open_transport = failing
    try:
        connect_policy_again(host, hub)
    finally:
        receiver_core._open_transport = real


def attach_actor_net(host, hub, **options) -> str:
    """Runs in a PlainWorker through ``__ray_call__``: attach its actor net; the worker id."""
    host.receiver = raysync.attach(hub, {"policy": "nets.actor"}, owner=host, **options)
    return host.receiver.worker


@ray.remote(num_cpus=0, max_concurrency=3)
class LoopingWorker:
    """A threaded actor whose loop attaches a receiver and then runs until stopped,
    holding its model with ``receiver.using()`` for each step."""

    def __init__(self):
        self.model = make_probe_model(64, 4)
        self.model.load_state_dict(filled(self.model, 0.0))
        self.attached = threading.Event()
        self.stopping = threading.Event()

    def run(self, hub) -> dict:
        receiver = raysync.attach(hub, self.model)
        self.attached.set()
        torn, seen, steps = 0, [], 0
        while not self.stopping.is_set():
            with receiver.using():
                ok, value = _uniform_read(self.model)
            torn += not ok
            steps += 1
            if not seen or seen[-1] != value:
                seen.append(value)
        receiver.close()
        return {"torn": torn, "seen": seen, "steps": steps, "worker": receiver.worker}

    def wait_attached(self, timeout_s: float) -> bool:
        return self.attached.wait(timeout_s)

    def stop(self) -> None:
        self.stopping.set()


@ray.remote(num_cpus=0)
class AsyncHost:
    """An async actor without the mixin: attaches from a coroutine; each read spans an
    await inside ``receiver.using_async()``, so a write in between would tear it."""

    def __init__(self):
        self.model = make_probe_model(64, 4)
        self.model.load_state_dict(filled(self.model, 0.0))

    async def attach(self, hub) -> None:
        self.receiver = raysync.attach(hub, self.model)

    async def probe(self, seconds: float, entered=None) -> dict:
        """Read the model for ``seconds``, between safe points; ``entered`` (a ``Gate``)
        is opened once this method runs (an async actor may start calls out of order)."""
        if entered is not None:
            await entered.open.remote()
        torn, seen, reads = 0, [], 0
        params = list(self.model.parameters())
        half = len(params) // 2
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            async with self.receiver.using_async():
                first = [float(p.view(-1)[0]) for p in params[:half]]
                await asyncio.sleep(0.001)
                second = [float(p.view(-1)[0]) for p in params[half:]]
            values = first + second
            torn += len(set(values)) != 1
            reads += 1
            if not seen or seen[-1] != values[0]:
                seen.append(values[0])
            await asyncio.sleep(0)  # between reads: where a waiting version lands
        return {"torn": torn, "seen": seen, "reads": reads}


@ray.remote(num_cpus=0)
class AsyncPlain:
    """An async actor that knows nothing of raysync (attached through ``__ray_call__``
    by :func:`attach_telling_arrivals`): its coroutine reads the model with no await."""

    def __init__(self):
        self.model = make_probe_model(64, 4)
        self.model.load_state_dict(filled(self.model, 0.0))
        self.arrived = threading.Event()  # a delivery reached the receiver
        self.reading = threading.Event()  # ... and may go on: the coroutine reads

    async def read_across_a_delivery(self, entered, changed_within_s: float):
        """Open ``entered`` (a ``Gate``: an async actor may start calls out of order),
        await a delivery's arrival (Ray starts ``__ray_call__`` only while the loop is
        free, and no new call while it runs), then, in one step of the loop (no await),
        the model's values and again once it changed or ``changed_within_s`` passed: a
        version written off the loop shows between the two."""
        await entered.open.remote()
        await asyncio.get_running_loop().run_in_executor(None, self.arrived.wait, 60)
        params = [p.detach() for p in self.model.parameters()]
        first = [float(p.view(-1)[0]) for p in params]
        self.reading.set()
        deadline = time.monotonic() + changed_within_s
        while float(params[-1].view(-1)[0]) == first[-1] and time.monotonic() < deadline:
            time.sleep(0.001)  # holds the loop: a write handed to it waits for this step
        return first, [float(p.view(-1)[0]) for p in params], self.arrived.is_set()

    async def values(self) -> list[float]:
        return [float(p.detach().view(-1)[0]) for p in self.model.parameters()]


def attach_telling_arrivals(host, hub) -> str:
    """Runs in an :class:`AsyncPlain` through ``__ray_call__`` (off its event loop):
    attach its model; each delivery then tells ``host.arrived`` as it reaches the
    receiver and goes on once ``host.reading`` is set. The worker id."""
    host.receiver = raysync.attach(hub, host.model)
    core = host.receiver.core
    receive = core.receive

    def receive_telling(update, **options):
        host.arrived.set()
        host.reading.wait(60)
        return receive(update, **options)

    core.receive = receive_telling
    host.reading.set()  # until a test reads across a delivery
    return host.receiver.worker


@ray.remote(num_cpus=0)
class Reader(WeightReceiver, _Inspect):
    """A collector whose method reads its policy twice, at a moment the test chooses."""

    def __init__(self, hub, worker_id: str):
        self.policy = make_policy()
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=worker_id)

    def read_across(self, entered, leave) -> tuple[dict, dict]:
        """The policy when the method starts and again once the test opens ``leave``
        (``tests.helpers.Gate``; ``entered`` is opened on the way in)."""
        first = state_of(self.policy)
        ray.get(entered.open.remote())
        ray.get(leave.wait.remote())
        return first, state_of(self.policy)


@ray.remote(num_cpus=0)
class Rebuilder(WeightReceiver):
    """A collector that may build its policy anew and register it again."""

    def __init__(self, hub):
        self.hub = hub
        self.policy = make_policy()
        self.connect_hub(hub, models={"policy": "policy"}, worker_id="rebuilder")

    def rebuild(self) -> None:
        """A fresh policy object at the same path, registered again."""
        self.policy = make_policy()
        self.connect_hub(self.hub, models={"policy": "policy"}, worker_id="rebuilder")

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)


@ray.remote(num_cpus=0)
class OtherLearner:
    """Another learner of a hub, in a process of its own (every handle on a hub in one
    process is one learner)."""

    def __init__(self, hub):
        self.hub = hub

    def broadcast(self, weights, **options):
        return ray.get(self.hub.broadcast.remote(weights, **options))

    def wait_channel(self, model: str) -> tuple[str, ...]:
        return self.hub.wait_channel(model)

    def broadcast_filled(self, values: list[float]) -> list[tuple[int, float]]:
        """Broadcast ``make_policy()`` with every weight filled with each of ``values``
        in turn, without waiting for a report before the next; each one's version and
        value, once all are acked."""
        return broadcast_filled(self.hub, values)


def broadcast_filled(hub, values: list[float]) -> list[tuple[int, float]]:
    """See :meth:`OtherLearner.broadcast_filled`; in the calling process."""
    policy, results = make_policy(), []
    for value in values:
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.fill_(value)
        results.append(hub.broadcast.remote(policy))  # copied out before it returns
    return [(report.version, value) for report, value in zip(ray.get(results), values, strict=True)]


class _NotesBlocked:
    """A learner side's lock that notes when thread ``name`` has to wait for it."""

    def __init__(self, lock: Any, name: str, blocked: threading.Event) -> None:
        self._lock, self._name, self._blocked = lock, name, blocked

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if threading.current_thread().name == self._name:
            self._blocked.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@ray.remote(num_cpus=0)
class SlotCrossingLearner:
    """A shared-memory learner whose two threads take their slots in one order and
    submit in the other, if the learner lets them: the first's thread, its slot
    written, waits until the second's broadcast ended, the slot the second asked for
    ahead came back and the receiver is held in a method (or until the second waits
    for the first to submit)."""

    def __init__(self, hub):
        self.hub = hub

    def crossed(
        self, versions: list[dict[str, torch.Tensor]], holder: Any, gate: Any, wait_s: float
    ) -> list[ray.ObjectRef]:
        """The results of ``versions`` (two), each broadcast from a thread of its own;
        ``holder`` (a ``Holder``) is held on ``gate`` before the first's submit goes."""
        from raysync.transports.shared_memory.learner import SharedMemorySender
        from tests.helpers import Gate, run_in_threads, wait_until

        send, submitted = SharedMemorySender.send, SharedMemorySender.submitted
        first_written, go = threading.Event(), threading.Event()
        side = self.hub._side
        in_order = side.sending_in_order  # the model's lock, by route key

        def sending(this, *args):
            payload = send(this, *args)
            if threading.current_thread().name == "first":
                first_written.set()
                assert go.wait(wait_s), "the second neither submitted nor waited"
            return payload

        def second_submitted(this, payload, done):
            if threading.current_thread().name != "second":
                return submitted(this, payload, done)
            done.wait(wait_s)
            # The owner took the version's holds (the hub does not wait for them),
            # freeing the learner's older unplanned slots: then the slot ahead is asked.
            wait_until(
                lambda: "pending" not in ray.get(this._owner.stats.remote()).holds,
                wait_s,
                what="the second's version held by the owner",
            )
            submitted(this, payload, done)
            ray.get(this._next[1], timeout=wait_s)  # the slot asked for ahead
            entered = Gate.remote()
            holder.hold.remote(gate, entered)
            ray.get(entered.wait.remote(), timeout=wait_s)
            go.set()
            return None

        refs: list[Any] = [None, None]

        def broadcast(at: int, after: threading.Event | None) -> None:
            if after is not None:
                assert after.wait(wait_s), "the first never wrote its slot"
            refs[at] = self.hub.broadcast.remote(versions[at], raise_on_failure=False)

        SharedMemorySender.send, SharedMemorySender.submitted = sending, second_submitted
        side.sending_in_order = lambda key: _NotesBlocked(in_order(key), "second", go)
        try:
            run_in_threads(
                ("first", broadcast, (0, None)), ("second", broadcast, (1, first_written))
            )
        finally:
            SharedMemorySender.send, SharedMemorySender.submitted = send, submitted
            del side.sending_in_order
        return refs

    def broadcast(self, weights: dict[str, torch.Tensor]) -> list[ray.ObjectRef]:
        """The result of a broadcast of ``weights`` from this learner (in a list: not
        waited for)."""
        return [self.hub.broadcast.remote(weights, raise_on_failure=False)]


class _HangingGets:
    """Ray's module for a shared-memory owner, whose object reads (a relay's read of the
    exported version) hang until ``gate`` opens: a node whose object transfer stalls."""

    def __init__(self, real: Any, gate: Any) -> None:
        self._real, self._gate = real, gate

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self._real.get(self._gate.wait.remote())
        return self._real.get(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def hang_relay_reads(owner, gate) -> None:
    """Runs in a shared-memory owner through ``__ray_call__``: its relays hang reading
    the exported version until ``gate`` (``tests.helpers.Gate``) opens."""
    import sys

    module = sys.modules[type(owner).__module__]
    module.ray = _HangingGets(module.ray, gate)  # type: ignore[attr-defined]


def fail_next_rpc_join(_actor) -> None:
    """Runs in an actor through ``__ray_call__``: its next torch RPC join (moving to a
    replaced agent's group) fails once, as one with a dead or frozen member listed can."""
    from raysync.transports.rpc import receiver as rpc_receiver

    join = rpc_receiver.init_rpc

    def failing(*args, **kwargs):
        rpc_receiver.init_rpc = join
        raise RuntimeError("could not join the RPC group (injected)")

    rpc_receiver.init_rpc = failing


def waits_for_a_safe_point(host) -> bool:
    """Runs in a receiver (``__ray_call__``): whether a version waits for its safe point."""
    return bool(host._raysync_receiver.core.gate._deferred)


def beat_now(host) -> None:
    """Runs in a receiver (``__ray_call__``): its hub watch beats now, on a thread of its
    own as the watch does (one started with a heartbeat too long to come during a test
    registers again when told). Returns at once: the versions the beat applies wait
    for a safe point, behind this call in the host's queue."""
    threading.Thread(target=host._raysync_receiver._watch.beat, daemon=True).start()


def pull_giving_up_at_once(collector) -> str:
    """``collector`` (the actor, through ``__ray_call__``) pulls, waiting for its hub no
    time at all: the hub has not answered yet (it answers once the version's owner held
    the slot for it), unless this thread was descheduled between the call and the wait.
    The name of what the pull raised, or "answered"."""
    try:
        collector.pull_weights(timeout_s=1e-9)
    except ray.exceptions.GetTimeoutError as err:
        return type(err).__name__
    return "answered"


class KillsTheHubOnceItIsAskedToRegister:
    """A hub's actor handle whose first ``register`` call, once sent, kills the hub's
    (frozen) process: the call is in flight as the hub dies. Anything else is the
    handle's."""

    def __init__(self, actor, hub_pid: int) -> None:
        self._actor, self._hub_pid, self._killed = actor, hub_pid, False

    def __getattr__(self, name: str):
        return getattr(self._actor, name)

    @property
    def register(self):
        outer = self

        class Register:
            def remote(self, *args, **kwargs):
                sent = outer._actor.register.remote(*args, **kwargs)
                if not outer._killed:
                    outer._killed = True
                    os.kill(outer._hub_pid, signal.SIGKILL)
                return sent

        return Register()


@ray.remote(num_cpus=0)
class RegistersAsTheHubDies(WeightReceiver):
    """A receiver whose ``__init__`` registers while the hub dies (a receiver Ray
    restarts while it restarts the hub too)."""

    def __init__(self, hub, hub_pid: int) -> None:
        self.policy = make_policy()
        dying = copy.copy(hub)
        dying.actor = KillsTheHubOnceItIsAskedToRegister(hub.actor, hub_pid)
        os.kill(hub_pid, signal.SIGSTOP)
        self.connect_hub(dying, models={"policy": "policy"}, worker_id="joiner")

    def version(self) -> int:
        return self.weights_version("policy")

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)
