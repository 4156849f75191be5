"""The transport contract, executable: a conformance suite any transport runs against itself.

A transport (built in, or a third party's registered with
:func:`raysync.transports.register_transport`) passes when every version reaches every
receiver bit for bit, late joiners and pulls start on the latest version, a learner
that reuses its memory never lets a receiver see a torn or lost version, a dead receiver
fails only itself, zero copy and buckets are honoured or refused as the transport
declares, and the learner can release its side and broadcast again. Use it from pytest::

    # test_my_transport.py
    from raysync.testing import TransportConformance
    from raysync.transports import register_transport
    from my_package.transport import MyTransport

    register_transport("mine", MyTransport)

    class TestMyTransport(TransportConformance):
        transport = "mine"

The tests of a class share one hub and three receivers (the others they need, they
start), on a real Ray cluster: the one already running in the test process
(``ray.is_initialized()``), else a local one the class starts (``ray_init_kwargs``) and
shuts down. Called in the test (driver) process; the receivers are Ray actors of
:class:`ConformanceReceiver`, importable here by every worker. Needs pytest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import ray
import torch

from raysync.errors import BroadcastError
from raysync.hub_handle import HubHandle
from raysync.hub_launch import WeightHub
from raysync.messages import BroadcastReport
from raysync.receiver import WeightReceiver
from raysync.transports import MemoryFootprint, get_transport

#: The model every conformance receiver holds (model id ``"m"``).
MODEL = "m"


def special_weights(seed: float = 0.0) -> dict[str, torch.Tensor]:
    """A model of values an arithmetic comparison gets wrong (NaN, -0.0, inf,
    subnormals) and of every kind of dtype, each value shifted by ``seed``."""
    generator = torch.Generator().manual_seed(int(seed * 1000) % (2**31))
    return {
        "f32": torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, seed]),
        "w": torch.randn(64, 33, generator=generator) + seed,
        "bf16": (torch.randn(33, 7, generator=generator) + seed).to(torch.bfloat16),
        "f16": torch.randn(5, generator=generator).half(),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "i64": torch.arange(3, dtype=torch.int64) * (1 << 40) + int(seed),
        "flag": torch.tensor([True, False, bool(int(seed) % 2)]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5 + seed, dtype=torch.float64),
    }


def through_bfloat16(tensor: torch.Tensor) -> torch.Tensor:
    """What a receiver holds of ``tensor`` sent with ``wire_dtype=torch.bfloat16``: a
    floating tensor wider than it cast there and back; any other as it is (float16 too:
    as wide, it travels in its own dtype)."""
    if tensor.is_floating_point() and tensor.element_size() > 2:
        return tensor.to(torch.bfloat16).to(tensor.dtype)
    return tensor


def uniform_weights(value: float) -> dict[str, torch.Tensor]:
    """The spec of :func:`special_weights` with every element derived from ``value``, so
    a version mixing two broadcasts is visible (see :meth:`ConformanceReceiver.torn`)."""
    return {k: torch.full_like(v, value) for k, v in special_weights().items()}


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (NaN, -0.0 and subnormals included)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name, want in expected.items():
        got = actual[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        got_bytes = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        want_bytes = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(got_bytes, want_bytes), f"{name}: bytes differ"


def wait_dead(actor: Any, timeout_s: float = 60.0) -> None:
    """Wait until Ray reports an actor gone (killed, or ending by itself). ``ray.kill``
    returns before the process dies, and a call sent in between may still run (and
    return) in it: ask again until a call fails with the actor's death. Ray reports
    that when it takes the kill: the process may still be exiting, its memory mapped
    (a NIXL READ of it still succeeds), so a test that needs the process itself gone
    waits for its pid as well."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{actor} still answers {timeout_s} s after it should be gone"
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=remaining)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)  # alive still: ask again shortly, not in a busy loop


class ConformanceReceiver(WeightReceiver):
    """A receiver holding :func:`special_weights`' spec as a state_dict; it records what
    each applied version looked like at its safe point."""

    def __init__(self, hub: HubHandle, worker_id: str, **connect: Any) -> None:
        self.sd = {k: torch.zeros_like(v) for k, v in special_weights().items()}
        self.applied: list[tuple[int, bool]] = []  # (version, uniform) in apply order
        self.connect_hub(hub, models={MODEL: "sd"}, worker_id=worker_id, **connect)

    def on_weights_applied(self, model: str, version: int) -> None:
        self.applied.append((version, self._uniform()))

    def _uniform(self) -> bool:
        """Whether every element holds the value of one :func:`uniform_weights` call."""
        reference = uniform_weights(float(self.sd["w"].reshape(-1)[0]))
        return all(torch.equal(self.sd[k], reference[k]) for k in reference)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.sd.items()}

    def version(self) -> int:
        return self.weights_version(MODEL)

    def applied_versions(self) -> list[tuple[int, bool]]:
        return list(self.applied)

    def pull(self) -> dict[str, int]:
        return self.pull_weights()

    def data_ptrs(self) -> dict[str, int]:
        """Where each tensor's data lives now (tensors with elements)."""
        return {k: v.data_ptr() for k, v in self.sd.items() if v.numel()}


class PartLearner:
    """One learner of a sharded model (a Ray actor): it sends its own slice of each
    version through its own handle, as an FSDP or pipeline rank would."""

    def __init__(self, hub: HubHandle) -> None:
        self.hub = hub
        self.pending: list[ray.ObjectRef] = []

    def send(self, weights: dict[str, torch.Tensor], **broadcast: Any) -> BroadcastReport:
        """Broadcast this learner's part and wait for the whole version's report."""
        return ray.get(self.hub.broadcast.remote(weights, model=MODEL, **broadcast))

    def send_and_return(self, weights: dict[str, torch.Tensor], **broadcast: Any) -> None:
        """Broadcast this learner's part and return at once (the part is on its way)."""
        self.pending.append(self.hub.broadcast.remote(weights, model=MODEL, **broadcast))


def split_in_parts(weights: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``weights`` dealt into ``parts`` disjoint slices by sorted key (round robin)."""
    names = sorted(weights)
    return [{name: weights[name] for name in names[i::parts]} for i in range(parts)]


class TransportConformance:
    """Subclass it with ``transport = "<registered name>"``; pytest collects the tests.

    ``receiver_options`` are ``ray.remote`` options for the receivers' class (e.g.
    ``{"enable_tensor_transport": True}`` for a transport that needs it);
    ``hub_options`` are keyword arguments of ``WeightHub.remote`` (``options=...``).
    """

    transport: ClassVar[str]
    receiver_options: ClassVar[dict[str, Any]] = {}
    hub_options: ClassVar[dict[str, Any]] = {}
    ray_init_kwargs: ClassVar[dict[str, Any]] = {"num_cpus": 16, "include_dashboard": False}

    @pytest.fixture(scope="class", autouse=True)
    def _ray_cluster(self) -> Iterator[None]:
        if ray.is_initialized():
            yield
            return
        ray.init(**self.ray_init_kwargs)
        try:
            yield
        finally:
            ray.shutdown()

    @pytest.fixture(scope="class")
    def started(self) -> Iterator[list]:
        """The actors the class's tests started, killed after the last one."""
        handles: list = []
        yield handles
        for handle in handles:
            try:
                ray.kill(getattr(handle, "actor", handle))
            except Exception:  # dead already: some tests are about that
                pass

    @pytest.fixture(scope="class")
    def hub(self, started: list) -> HubHandle:
        """One hub for the class: each test targets its own receivers by worker id
        (``workers=``) and checks versions relative to the hub's latest."""
        hub = WeightHub.remote(transport=self.transport, models=(MODEL,), **self.hub_options)
        started.append(hub)
        return hub

    @pytest.fixture(scope="class")
    def crew(self, started: list, hub: HubHandle) -> dict[str, Any]:
        """Three receivers the class's tests share (``crew0`` .. ``crew2``): tests that
        leave them alive use them, so each class starts few actors."""
        workers = ("crew0", "crew1", "crew2")
        return dict(zip(workers, self.receivers(started, hub, *workers), strict=True))

    # -- helpers ------------------------------------------------------------------------
    def receivers(self, started: list, hub: HubHandle, *workers: str, **connect: Any) -> list:
        """New receivers named ``workers``, registered (their ``__init__`` returned)."""
        # Through ray.remote, not .options(): Ray reads enable_tensor_transport only there.
        # Any: Ray's stubs type the actors it starts as ActorHandle | type.
        cls: Any = ray.remote(num_cpus=0, **self.receiver_options)(ConformanceReceiver)
        handles = [cls.remote(hub, worker, **connect) for worker in workers]
        started.extend(handles)
        ray.get([h.__ray_ready__.remote() for h in handles])
        return handles

    @staticmethod
    def broadcast(
        hub: HubHandle, weights: dict[str, torch.Tensor], workers: tuple[str, ...], **kw: Any
    ) -> BroadcastReport:
        """Broadcast to ``workers`` only; the report once they all acked."""
        ref = hub.broadcast.remote(weights, model=MODEL, workers=workers, **kw)
        return ray.get(ref, timeout=120)

    # -- the contract -------------------------------------------------------------------
    def test_every_version_reaches_every_receiver_bitwise(self, hub, crew):
        workers = tuple(crew)
        receivers = list(crew.values())
        for seed in (1.0, 2.0, 3.0):
            weights = special_weights(seed)
            report = self.broadcast(hub, weights, workers)
            assert (report.acked, report.failed) == (workers, {})
            assert report.bytes == sum(t.numel() * t.element_size() for t in weights.values())
            for receiver in receivers:
                assert_bitwise(ray.get(receiver.state.remote()), weights)
                assert ray.get(receiver.version.remote()) == report.version

    def test_late_joiners_and_pulls_start_on_the_latest_version(self, started, hub, crew):
        self.broadcast(hub, special_weights(1.0), ("crew0",))
        latest = special_weights(2.0)
        version = self.broadcast(hub, latest, ("crew0",)).version
        (late,) = self.receivers(started, hub, "late")
        assert ray.get(late.version.remote()) == version  # before its first call returns
        assert_bitwise(ray.get(late.state.remote()), latest)
        (puller,) = self.receivers(started, hub, "puller", mode="pull")
        newest = special_weights(3.0)
        # To every receiver of the model: a pull receiver is not one of its targets.
        ref = hub.broadcast.remote(newest, model=MODEL, raise_on_failure=False)
        report = ray.get(ref, timeout=120)
        assert "puller" not in report.acked and "puller" not in report.failed
        assert {"crew0", "late"} <= set(report.acked)
        assert ray.get(puller.version.remote()) == version  # a pull receiver waits to pull
        assert ray.get(puller.pull.remote()) == {MODEL: report.version}
        assert_bitwise(ray.get(puller.state.remote()), newest)

    def test_versions_in_quick_succession_are_never_torn_or_lost(self, hub, crew):
        """More versions than a transport keeps buffers, sent without waiting: each
        receiver applies them in order, the last one lands, none is a mix of two."""
        workers = ("crew0", "crew1")
        receivers = [crew[w] for w in workers]
        tickets = [
            ray.get(
                hub.broadcast.remote(
                    uniform_weights(float(v)), model=MODEL, workers=workers, wait=False
                )
            )
            for v in range(1, 9)
        ]
        reports = ray.get([hub.wait_for.remote(t) for t in tickets], timeout=120)
        versions = [r.version for r in reports]
        assert versions == sorted(versions) and len(set(versions)) == 8
        assert all(r.acked == workers and r.failed == {} for r in reports)
        for receiver in receivers:
            # Only this test's versions (a receiver catches up on the hub's latest when
            # it registers, another test's).
            applied = ray.get(receiver.applied_versions.remote())
            ours = [(v, uniform) for v, uniform in applied if v >= versions[0]]
            assert [v for v, _ in applied] == sorted(v for v, _ in applied)
            assert ours and all(uniform for _, uniform in ours), applied
            assert ours[-1][0] == versions[-1]
            assert_bitwise(ray.get(receiver.state.remote()), uniform_weights(8.0))

    def test_a_dead_receiver_fails_only_itself(self, started, hub, crew):
        survivor, (victim,) = crew["crew0"], self.receivers(started, hub, "victim")
        both = ("crew0", "victim")
        self.broadcast(hub, special_weights(1.0), both)
        ray.kill(victim, no_restart=True)
        wait_dead(victim)  # else a delivery may still reach it and be applied
        weights = special_weights(2.0)
        with pytest.raises(BroadcastError) as info:
            self.broadcast(hub, weights, both)
        report = info.value.report
        assert report.acked == ("crew0",) and set(report.failed) == {"victim"}
        assert "died" in report.failed["victim"], report.failed
        assert_bitwise(ray.get(survivor.state.remote()), weights)
        # The hub dropped it: it is no receiver any more, the survivor gets what follows.
        registered = {r.worker for r in ray.get(hub.status.remote()).receivers}
        assert "victim" not in registered and "crew0" in registered
        report = self.broadcast(hub, special_weights(3.0), ("crew0",))
        assert (report.acked, report.failed) == (("crew0",), {})

    def test_a_wire_dtype_travels_narrow_and_lands_cast(self, started, hub, crew):
        """``wire_dtype=bfloat16``: floating tensors wider than it travel cast (the report
        counts those bytes) and every receiver, a late joiner's first version and a
        zero-copy one included, holds ``w.to(bfloat16).to(its dtype)`` bit for bit; other
        tensors (float16 among them) travel as they are."""
        weights = special_weights(4.0)
        expected = {k: through_bfloat16(v) for k, v in weights.items()}
        report = self.broadcast(hub, weights, ("crew0",), wire_dtype=torch.bfloat16)
        assert report.bytes == sum(
            t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in weights.values()
        )
        assert_bitwise(ray.get(crew["crew0"].state.remote()), expected)
        (late,) = self.receivers(started, hub, "late-wire")
        assert_bitwise(ray.get(late.state.remote()), expected)
        if get_transport(self.transport).zero_copy is not None:
            # A zero-copy model takes a cast copy as its memory, not the cast bytes.
            (zero_copy,) = self.receivers(started, hub, "zc-wire", zero_copy=True)
            assert_bitwise(ray.get(zero_copy.state.remote()), expected)

    def test_a_version_sent_in_parts_lands_whole(self, started, hub, crew):
        """Two learner processes each send their own keys of one version (sharded
        learners, one of them casting on the wire): every receiver, a late joiner and a
        zero-copy one included, applies the whole version at one safe point, bit for
        bit, and both parts' calls end in the same report."""
        workers = ("crew0", "crew1")
        # Any: Ray's stubs type the actors it starts as ActorHandle | type.
        cls: Any = ray.remote(num_cpus=0, **self.receiver_options)(PartLearner)
        learners = [cls.remote(hub) for _ in range(2)]
        started.extend(learners)
        version = ray.get(hub.status.remote()).versions.get(MODEL, 0)

        def send(
            weights: dict[str, torch.Tensor],
            to: tuple[str, ...],
            second_on_the_wire: torch.dtype | None = None,
        ) -> int:
            """Both parts of a new version, the second cast to ``second_on_the_wire``."""
            nonlocal version
            version += 1
            wire = (None, second_on_the_wire)
            refs = [
                learner.send.remote(
                    part, version=version, part=i, parts=2, workers=to, wire_dtype=wire[i]
                )
                for i, (learner, part) in enumerate(
                    zip(learners, split_in_parts(weights, 2), strict=True)
                )
            ]
            reports = ray.get(refs, timeout=120)
            assert reports[0] == reports[1] and reports[0].version == version
            assert (reports[0].acked, reports[0].failed) == (to, {})
            return version

        v = send(uniform_weights(7.0), workers)
        for receiver in (crew[w] for w in workers):
            assert (v, True) in ray.get(receiver.applied_versions.remote())
            assert_bitwise(ray.get(receiver.state.remote()), uniform_weights(7.0))

        weights = special_weights(5.0)
        cast_part = split_in_parts(weights, 2)[1]
        expected = {k: through_bfloat16(v) if k in cast_part else v for k, v in weights.items()}
        send(weights, workers, second_on_the_wire=torch.bfloat16)
        for receiver in (crew[w] for w in workers):
            assert_bitwise(ray.get(receiver.state.remote()), expected)
        (late,) = self.receivers(started, hub, "late-parts")
        assert_bitwise(ray.get(late.state.remote()), expected)

        if get_transport(self.transport).zero_copy is not None:
            (zero_copy,) = self.receivers(started, hub, "zc-parts", zero_copy=True)
            for seed in (8.0, 9.0):
                send(special_weights(seed), ("zc-parts",))
                assert_bitwise(ray.get(zero_copy.state.remote()), special_weights(seed))

    def test_bucketed_versions_land_bitwise_or_bucket_mb_is_refused_by_name(self, hub, crew):
        """A transport that declares ``buckets`` moves a version in (here, 1 KiB)
        buckets, bit for bit; any other refuses ``bucket_mb`` naming itself (or the
        receivers reading through it) before any receiver is touched."""
        workers = ("crew0", "crew1")
        before = [ray.get(crew[w].version.remote()) for w in workers]
        weights = special_weights(6.0)
        if get_transport(self.transport).buckets:
            report = self.broadcast(hub, weights, workers, bucket_mb=1 / 1024)
            assert (report.acked, report.failed) == (workers, {})
            for worker in workers:
                assert_bitwise(ray.get(crew[worker].state.remote()), weights)
            return
        with pytest.raises(ValueError, match=r"bucket_mb: .*whole versions only") as refused:
            self.broadcast(hub, weights, workers, bucket_mb=1 / 1024)
        assert self.transport in str(refused.value)
        assert [ray.get(crew[w].version.remote()) for w in workers] == before

    def test_declares_what_it_keeps_in_memory(self):
        """Capacity plans (and the benchmarks) read it: copies of a version alive on
        the learner's node and in each receiver, for zero-copy receivers too where the
        transport takes them."""
        cls = get_transport(self.transport)
        assert isinstance(cls.memory, MemoryFootprint), f"{cls.__name__}.memory is not declared"
        if cls.zero_copy is not None:
            assert isinstance(cls.zero_copy_memory, MemoryFootprint), (
                f"{cls.__name__} takes zero-copy receivers: declare zero_copy_memory"
            )
        for footprint in (cls.memory, cls.zero_copy_memory):
            if footprint is not None:
                assert footprint.learner >= 0 and footprint.per_receiver >= 0, footprint

    def test_zero_copy_is_honoured_or_refused_as_declared(self, started, hub):
        if get_transport(self.transport).zero_copy is None:
            with pytest.raises(ray.exceptions.RayActorError, match="zero_copy needs a transport"):
                self.receivers(started, hub, "zc", zero_copy=True)
            return
        (receiver,) = self.receivers(started, hub, "zc", zero_copy=True)
        lived_in = ray.get(receiver.data_ptrs.remote())  # its own memory, at first
        for seed in (1.0, 2.0, 3.0):
            weights = special_weights(seed)
            assert self.broadcast(hub, weights, ("zc",)).acked == ("zc",)
            assert_bitwise(ray.get(receiver.state.remote()), weights)
            # Honoured: the model lives in each version's memory, not copied into.
            now = ray.get(receiver.data_ptrs.remote())
            moved = {k for k in now if now[k] != lived_in[k]}
            assert moved == set(now), f"copied into, not rebound: {set(now) - moved}"
            lived_in = now

    def test_the_learner_releases_its_side_and_broadcasts_again(self, hub, crew):
        receiver = crew["crew0"]
        first = self.broadcast(hub, special_weights(1.0), ("crew0",)).version
        hub.release()
        weights = special_weights(2.0)
        assert self.broadcast(hub, weights, ("crew0",)).version == first + 1
        assert_bitwise(ray.get(receiver.state.remote()), weights)
        hub.release()
