"""The transport contract, executable: a conformance suite any transport runs against itself.

A transport (built in, or a third party's registered with
:func:`raysync.transports.register_transport`) passes when every version reaches every
receiver bit for bit, late joiners and pulls start on the latest version, a learner
that reuses its memory never lets a receiver see a torn or lost version, a dead receiver
fails only itself, zero copy is honoured or refused as the transport declares, and the
learner can release its side and broadcast again. Use it from pytest::

    # test_my_transport.py
    from raysync.testing import TransportConformance
    from raysync.transports import register_transport
    from my_package.transport import MyTransport

    register_transport("mine", MyTransport)

    class TestMyTransport(TransportConformance):
        transport = "mine"

Each test starts its own hub and receivers on a real Ray cluster: the one already
running in the test process (``ray.is_initialized()``), else a local one the class
starts (``ray_init_kwargs``) and shuts down. Called in the test (driver) process; the
receivers are Ray actors of :class:`ConformanceReceiver`, importable here by every
worker. Needs pytest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import ray
import torch

from raysync.errors import BroadcastError
from raysync.hub_handle import HubHandle, WeightHub
from raysync.messages import BroadcastReport
from raysync.receiver import WeightReceiver
from raysync.transports import get_transport

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


class TransportConformance:
    """Subclass it with ``transport = "<registered name>"``; pytest collects the tests.

    ``receiver_options`` are Ray actor options for the receivers (e.g.
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

    @pytest.fixture
    def started(self) -> Iterator[list]:
        """The actors a test started, killed after it."""
        handles: list = []
        yield handles
        for handle in handles:
            try:
                ray.kill(getattr(handle, "actor", handle))
            except Exception:  # dead already: some tests are about that
                pass

    # -- helpers ------------------------------------------------------------------------
    def hub(self, started: list) -> HubHandle:
        hub = WeightHub.remote(transport=self.transport, models=(MODEL,), **self.hub_options)
        started.append(hub)
        return hub

    def receivers(self, started: list, hub: HubHandle, *workers: str, **connect: Any) -> list:
        cls = ray.remote(ConformanceReceiver).options(num_cpus=0, **self.receiver_options)
        handles = [cls.remote(hub, worker, **connect) for worker in workers]
        started.extend(handles)
        ray.get([h.__ray_ready__.remote() for h in handles])
        return handles

    @staticmethod
    def broadcast(hub: HubHandle, weights: dict[str, torch.Tensor], **kw: Any) -> BroadcastReport:
        return ray.get(hub.broadcast.remote(weights, model=MODEL, **kw), timeout=120)

    # -- the contract -------------------------------------------------------------------
    def test_every_version_reaches_every_receiver_bitwise(self, started):
        hub = self.hub(started)
        receivers = self.receivers(started, hub, "r0", "r1", "r2")
        for version in (1, 2, 3):
            weights = special_weights(float(version))
            report = self.broadcast(hub, weights)
            assert (report.version, report.acked, report.failed) == (
                version,
                ("r0", "r1", "r2"),
                {},
            )
            assert report.bytes == sum(t.numel() * t.element_size() for t in weights.values())
            for receiver in receivers:
                assert_bitwise(ray.get(receiver.state.remote()), weights)
                assert ray.get(receiver.version.remote()) == version

    def test_late_joiners_and_pulls_start_on_the_latest_version(self, started):
        hub = self.hub(started)
        self.receivers(started, hub, "first")
        self.broadcast(hub, special_weights(1.0))
        latest = special_weights(2.0)
        self.broadcast(hub, latest)
        (late,) = self.receivers(started, hub, "late")
        assert ray.get(late.version.remote()) == 2  # before its first call returns
        assert_bitwise(ray.get(late.state.remote()), latest)
        (puller,) = self.receivers(started, hub, "puller", mode="pull")
        newest = special_weights(3.0)
        report = self.broadcast(hub, newest)
        assert report.acked == ("first", "late")  # a pull receiver is not pushed to
        assert ray.get(puller.pull.remote()) == {MODEL: 3}
        assert_bitwise(ray.get(puller.state.remote()), newest)

    def test_versions_in_quick_succession_are_never_torn_or_lost(self, started):
        """More versions than a transport keeps buffers, sent without waiting: each
        receiver applies them in order, the last one lands, none is a mix of two."""
        hub = self.hub(started)
        receivers = self.receivers(started, hub, "r0", "r1")
        tickets = [
            ray.get(hub.broadcast.remote(uniform_weights(float(v)), model=MODEL, wait=False))
            for v in range(1, 9)
        ]
        reports = ray.get([hub.wait_for.remote(t) for t in tickets], timeout=120)
        assert [r.version for r in reports] == list(range(1, 9))
        assert all(r.failed == {} for r in reports)
        for receiver in receivers:
            applied = ray.get(receiver.applied_versions.remote())
            assert [v for v, _ in applied] == sorted(v for v, _ in applied)
            assert all(uniform for _, uniform in applied), applied
            assert applied[-1][0] == 8
            assert_bitwise(ray.get(receiver.state.remote()), uniform_weights(8.0))

    def test_a_dead_receiver_fails_only_itself(self, started):
        hub = self.hub(started)
        survivor, victim = self.receivers(started, hub, "survivor", "victim")
        self.broadcast(hub, special_weights(1.0))
        ray.kill(victim, no_restart=True)
        weights = special_weights(2.0)
        with pytest.raises(BroadcastError) as info:
            self.broadcast(hub, weights)
        report = info.value.report
        assert report.acked == ("survivor",) and set(report.failed) == {"victim"}
        assert "died" in report.failed["victim"], report.failed
        assert_bitwise(ray.get(survivor.state.remote()), weights)
        # The hub dropped it: the next version reaches the survivor and fails nobody.
        report = self.broadcast(hub, special_weights(3.0))
        assert (report.acked, report.failed) == (("survivor",), {})

    def test_zero_copy_is_honoured_or_refused_as_declared(self, started):
        hub = self.hub(started)
        if get_transport(self.transport).zero_copy is None:
            with pytest.raises(ray.exceptions.RayActorError, match="zero_copy needs a transport"):
                self.receivers(started, hub, "zc", zero_copy=True)
            return
        (receiver,) = self.receivers(started, hub, "zc", zero_copy=True)
        for version in (1, 2, 3):
            weights = special_weights(float(version))
            assert self.broadcast(hub, weights).acked == ("zc",)
            assert_bitwise(ray.get(receiver.state.remote()), weights)

    def test_the_learner_releases_its_side_and_broadcasts_again(self, started):
        hub = self.hub(started)
        (receiver,) = self.receivers(started, hub, "r0")
        self.broadcast(hub, special_weights(1.0))
        hub.release()
        weights = special_weights(2.0)
        assert self.broadcast(hub, weights).version == 2
        assert_bitwise(ray.get(receiver.state.remote()), weights)
        hub.release()
