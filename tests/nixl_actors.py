"""Actors for tests/test_nixl.py (a module of their own so Ray workers can import them)."""

from __future__ import annotations

import hashlib
import importlib
import logging
import threading

import ray
import torch

from raysync import WeightReceiver
from tests.helpers import run_in_threads
from tests.receivers import (
    AsyncLeaver,
    Collector,
    Holder,
    _stall_fetches,
    _Stalls,
    make_policy,
    state_of,
)

#: Big enough that one READ takes tens of milliseconds, so kills land mid-transfer.
_BIG_NUMEL = 32 << 20  # 128 MB of float32


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@ray.remote(num_cpus=0)
class HashingCollector(WeightReceiver):
    """Records a digest of its whole model at every apply: a torn apply shows up as a
    digest the learner never broadcast."""

    def __init__(self, hub, model_factory=make_policy):
        self.policy = model_factory()
        self.digests: dict[int, str] = {}
        self.connect_hub(hub, models={"policy": "policy"})

    def on_weights_applied(self, model: str, version: int) -> None:
        self.digests[version] = digest(self.policy.state_dict())

    def seen(self) -> dict[int, str]:
        return dict(self.digests)

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)


def cuda_policy() -> torch.nn.Module:
    """The test policy on this process's GPU (for zero-copy receivers reading VRAM)."""
    return make_policy().cuda()


def big_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(_BIG_NUMEL), "b": torch.zeros(3)}


@ray.remote(num_cpus=0)
class BigCollector(WeightReceiver):
    def __init__(self, hub, worker_id=None):
        self.sd = big_model()
        self.connect_hub(hub, models={"big": "sd"}, worker_id=worker_id)

    def summary(self) -> tuple[int, float, float]:
        w = self.sd["w"]
        return self.weights_version(), float(w.min()), float(w.max())


@ray.remote(num_cpus=0)
class StallingBigCollector(BigCollector.__ray_actor_class__, _Stalls):
    """A BigCollector whose fetches wait while ``<stall_dir>/stall-fetch-<name>``
    exists, having touched ``inside-fetch-<name>`` (``tests.receivers._Stalls``)."""

    def __init__(self, hub, name: str, stall_dir: str):
        self.sd = big_model()
        self.name, self.stall_dir = name, stall_dir
        self.first = self._first_incarnation(stall_dir, name)
        self.connect_hub(hub, models={"big": "sd"}, worker_id=name)
        _stall_fetches(self, self._raysync_receiver.core.transport)


@ray.remote(num_cpus=0)
class Learner:
    """A learner in its own process, so a test can kill it with its registered buffers."""

    def __init__(self, hub):
        self.hub = hub
        self.weights = big_model()

    def broadcast(self, value: float, timeout_s: float):
        self.weights["w"].fill_(value)
        return ray.get(
            self.hub.broadcast.remote(self.weights, model="big", wait=False, timeout_s=timeout_s)
        )


@ray.remote(num_cpus=0)
class PairHolder(WeightReceiver):
    """Holds two models, ``"a"`` and ``"b"``, each a state_dict like ``template``."""

    def __init__(self, hub, template: dict[str, torch.Tensor], worker_id: str):
        self.a = {k: torch.zeros_like(v) for k, v in template.items()}
        self.b = {k: torch.zeros_like(v) for k, v in template.items()}
        self.connect_hub(hub, models={"a": "a", "b": "b"}, worker_id=worker_id)

    def state(self, model: str) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in getattr(self, model).items()}


@ray.remote(num_cpus=0)
class CrossingLearner:
    """A learner that broadcasts two versions from two threads, the hub hearing of the
    first and the transport streaming the second's buckets first: the first's thread,
    once its hub call has left, waits to stream until the second's packs a bucket."""

    def __init__(self, hub):
        self.hub = hub

    def crossed(
        self,
        versions: list[tuple[str, dict[str, torch.Tensor]]],
        ring_module: str,
        ring_class: str,
        wait_s: float,
    ) -> list[ray.ObjectRef]:
        """The broadcast refs of ``versions`` (two of (model, weights)), in order.
        ``ring_module`` / ``ring_class``: where the transport streams a bucketed version
        out of its ring."""
        module = importlib.import_module(ring_module)
        ring = getattr(module, ring_class)
        stream_out, pack_bucket = ring.stream_out, module.pack_bucket
        first_at_hub, second_packing = threading.Event(), threading.Event()

        def streaming(this, *args):
            if threading.current_thread().name == "first":
                first_at_hub.set()
                assert second_packing.wait(wait_s), "the second never packed a bucket"
            return stream_out(this, *args)

        def packing(*args):
            if threading.current_thread().name == "second":
                second_packing.set()
            return pack_bucket(*args)

        refs: list[ray.ObjectRef | None] = [None, None]

        def send(at: int, after: threading.Event | None) -> None:
            if after is not None:
                assert after.wait(wait_s), "the first's hub call never left"
            model, weights = versions[at]
            refs[at] = self.hub.broadcast.remote(weights, model=model)

        ring.stream_out, module.pack_bucket = streaming, packing
        try:
            run_in_threads(("first", send, (0, None)), ("second", send, (1, first_at_hub)))
        finally:
            ring.stream_out, module.pack_bucket = stream_out, pack_bucket
        return refs


# The same actors declared for Ray's NIXL tensor transport (transport "rdt"). Ray reads
# enable_tensor_transport from the class decorator only (.options() ignores it).
_RDT = {"num_cpus": 0, "enable_tensor_transport": True}


@ray.remote(**_RDT)
class RdtCollector(Collector.__ray_actor_class__):
    pass


@ray.remote(**_RDT)
class RdtHashingCollector(HashingCollector.__ray_actor_class__):
    pass


@ray.remote(**_RDT)
class RdtBigCollector(BigCollector.__ray_actor_class__):
    pass


@ray.remote(**_RDT)
class RdtLearner(Learner.__ray_actor_class__):
    pass


@ray.remote(**_RDT)
class RdtHolder(Holder.__ray_actor_class__):
    pass


@ray.remote(**_RDT)
class RdtAsyncHolder(AsyncLeaver.__ray_actor_class__):
    """An async rdt receiver whose ``hold`` keeps its policy held: versions that come
    meanwhile are deferred to its end."""


@ray.remote(**_RDT)
class RdtPairHolder(PairHolder.__ray_actor_class__):
    pass


@ray.remote(**_RDT)
class RdtCrossingLearner(CrossingLearner.__ray_actor_class__):
    pass


def nixl_level_once_rays_agent_is_made(_actor) -> tuple[bool, int]:
    """In an actor: whether raysync made Ray's NIXL agent there, and the level nixl's
    logger is left at (nixl sets it to INFO, on stdout, when it is imported)."""
    from raysync.transports.rdt.agent import ray_agent_progress

    made = ray_agent_progress() is not None
    return made, logging.getLogger("nixl").getEffectiveLevel()


def set_rays_rdt_fetch_limit(_actor, seconds: float) -> None:
    """In an actor: Ray's own limit on one RDT fetch (0: each fetch ends at once, its
    READ started and left running, as one past Ray's limit does)."""
    from ray._private import ray_constants

    ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS = seconds


def staging_set_aside(actor) -> int:
    """In an ``rdt`` receiver: how many staging buffers its pool set aside (a READ into
    each may still run)."""
    pool = actor._raysync_receiver.core.transport.inner._pool
    return sum(len(buffers) for buffers in pool._set_aside.values())


def stall_next_rdt_read(_actor, gate) -> None:
    """In an ``rdt`` receiver: its next READ of an RDT object waits for ``gate`` first,
    holding the object's ref (a reader stalled mid-stream); the later ones go."""
    from raysync.transports.rdt import receiver as rdt_receiver

    read_into = rdt_receiver._read_into

    def stalled(ref: ray.ObjectRef, place: torch.Tensor, what: str) -> None:
        rdt_receiver._read_into = read_into
        ray.get(gate.wait.remote())
        read_into(ref, place, what)

    rdt_receiver._read_into = stalled
