"""The RDT learner's sender (raysync/transports/rdt/learner.py) without Ray: Ray's part
in the learner process is stood in for (NIXL registration, ``ray.put`` of an RDT object,
``wait_tensor_freed``). Once closed, it registers no memory; a model none of whose
versions the hub took lets go of its buffers; the hub's latest keeps its buffer."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import ray.experimental
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, VersionDone
from raysync.transports.rdt import learner as rdt_learner
from raysync.transports.rdt.learner import RdtSender
from raysync.transports.rdt.wire import RdtPayload


class _Ref:
    """An RDT object's ref as ``ray.put`` returns it: ``buffer`` is the sender's own
    tensor (RDT aliases it, Ray keeps no copy), so it reads what a late joiner reads."""

    _numbers = itertools.count(1)

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._number = next(self._numbers)

    def hex(self) -> str:
        return f"{self._number:040x}"


class _Ray:
    """Ray's part in the learner process: the buffers registered with its NIXL agent and
    those let go of (``live``: registered, not yet deregistered), and which RDT objects
    are still referenced (``held``: the hub keeps the model's latest for late joiners)."""

    def __init__(self) -> None:
        self.registered: list[torch.Tensor] = []
        self.deregistered: list[torch.Tensor] = []
        self.held: list[torch.Tensor] = []

    def put(self, tensors: list[torch.Tensor], _tensor_transport: str) -> _Ref:
        assert _tensor_transport == "nixl"
        return _Ref(tensors[0])

    def wait_tensor_freed(self, tensor: torch.Tensor, timeout: float | None = None) -> None:
        if _among(tensor, self.held):
            raise TimeoutError("an ObjectRef to it is still held")

    def live(self) -> list[torch.Tensor]:
        return [b for b in self.registered if not _among(b, self.deregistered)]


def _among(tensor: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return any(tensor is other for other in tensors)


@pytest.fixture
def ray_stand_in(monkeypatch) -> _Ray:
    stand_in = _Ray()
    monkeypatch.setattr(ray.experimental, "register_nixl_memory", stand_in.registered.append)
    monkeypatch.setattr(ray.experimental, "deregister_nixl_memory", stand_in.deregistered.append)
    monkeypatch.setattr(ray.experimental, "wait_tensor_freed", stand_in.wait_tensor_freed)
    monkeypatch.setattr(rdt_learner.ray, "put", stand_in.put)
    monkeypatch.setattr(rdt_learner, "apply_ucx_cuda_defaults", lambda: None)
    monkeypatch.setattr(rdt_learner, "ray_agent_progress", lambda: None)
    monkeypatch.setattr(
        rdt_learner.ray,
        "get_runtime_context",
        lambda: SimpleNamespace(get_actor_id=lambda: None),
    )
    return stand_in


@pytest.fixture
def sender(ray_stand_in):
    sender = RdtSender(hub=SimpleNamespace())
    yield sender
    sender.close()


class _Broadcast(VersionDone):
    """A broadcast's end as the learner's handle tells it: running until :meth:`end`,
    then published (its receivers acked or failed) or refused by the hub before it was
    published (an unknown model, a spec or version it refuses)."""

    def __init__(self, refused: bool | None = None) -> None:
        self._refused = refused  #: None: still running

    def end(self, refused: bool) -> None:
        self._refused = refused

    def wait(self, timeout_s: float) -> None:
        if self._refused is None:
            raise TimeoutError("the broadcast is still running")

    def refused(self) -> bool:
        return bool(self._refused)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=generator), "b": torch.randn(8, generator=generator)}


def _broadcast(sender: RdtSender, weights, model: str, refused: bool | None) -> RdtPayload:
    """Send ``weights`` as a version of ``model`` whose broadcast ended ``refused`` or
    not, or still runs (None)."""
    payload = sender.send(weights, WeightSpec.of(weights), model)
    sender.submitted(payload, _Broadcast(refused))
    return payload


def _holds(payload: RdtPayload, weights: dict[str, torch.Tensor]) -> bool:
    """Whether ``payload``'s buffer still holds that version, bit for bit."""
    layout = PackedLayout.of(WeightSpec.of(weights))
    packed = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(weights, packed)
    return torch.equal(payload.ref.buffer, packed)


def test_a_send_after_the_sender_closed_fails_and_registers_nothing(ray_stand_in):
    """Another thread's broadcast took the sender before the learner's handle closed
    it: its send registered a fresh pair of model-sized buffers that nothing
    deregistered, and the version went out through the released sender."""
    sender = RdtSender(hub=SimpleNamespace())
    sender.close()
    weights = {"w": torch.ones(8)}
    spec = WeightSpec.of(weights)
    with pytest.raises(TransportError, match="closed before version of model 'late'"):
        sender.send(weights, spec, "late")
    with pytest.raises(TransportError, match="closed before a bucketed version"):
        sender.send_buckets(weights, spec, bucket_bytes=16, stall_s=1.0)
    assert ray_stand_in.registered == []


def test_a_first_version_the_hub_refused_lets_go_of_its_buffers_by_the_next_send(
    sender, ray_stand_in
):
    """A misspelt model's buffers (two, each as large as the model) stayed registered
    until the learner's handle closed, though the hub keeps none of its versions."""
    _broadcast(sender, _weights(1), "polcy", refused=True)
    misspelt = ray_stand_in.live()
    assert len(misspelt) == 2
    published = _broadcast(sender, _weights(2), "policy", refused=False)
    assert len(ray_stand_in.deregistered) == 2
    assert all(_among(buffer, ray_stand_in.deregistered) for buffer in misspelt)
    assert len(ray_stand_in.live()) == 2 and _holds(published, _weights(2))


def test_a_refused_broadcast_retried_holds_one_pair_until_a_version_is_taken(sender, ray_stand_in):
    """A retried refused broadcast holds one pair at a time (each retry registers anew,
    the pair before let go of), then the pair of the version the hub took is kept."""
    for seed in range(3):
        _broadcast(sender, _weights(seed), "m", refused=True)
        assert len(ray_stand_in.live()) == 2, f"retry {seed} kept an earlier pair"
    published = _broadcast(sender, _weights(7), "m", refused=False)
    assert len(ray_stand_in.live()) == 2 and _holds(published, _weights(7))
    _broadcast(sender, _weights(8), "other", refused=False)
    assert len(ray_stand_in.live()) == 4, "the pair of a version the hub took was let go of"
    assert _holds(published, _weights(7))


def test_an_abandoned_first_version_lets_go_of_its_buffers_at_once(sender, ray_stand_in):
    weights = _weights(1)
    sender.abandoned(sender.send(weights, WeightSpec.of(weights), "m"), "failed before it left")
    assert len(ray_stand_in.registered) == 2
    assert ray_stand_in.live() == [], "an abandoned first version kept its buffers"


def test_buffers_are_kept_while_their_version_is_on_its_way_or_its_broadcast_runs(
    sender, ray_stand_in
):
    """Whether the hub takes a version is known once its broadcast ends: until then
    its buffers stay registered, whatever other models send meanwhile."""
    weights = _weights(1)
    on_its_way = sender.send(weights, WeightSpec.of(weights), "m")
    _broadcast(sender, _weights(2), "a", refused=False)
    broadcast = _Broadcast()
    sender.submitted(on_its_way, broadcast)
    _broadcast(sender, _weights(3), "b", refused=False)
    assert ray_stand_in.deregistered == []
    broadcast.end(refused=True)
    _broadcast(sender, _weights(4), "c", refused=False)
    assert len(ray_stand_in.deregistered) == 2 and _holds(on_its_way, weights)


def test_refused_versions_after_a_published_one_leave_it_readable_in_its_own_buffer(
    sender, ray_stand_in
):
    """The hub holds the model's latest (its RDT object) for late joiners: the second
    refused version in a row went to the latest's buffer, found it referenced, set it
    aside and registered a new one as large as the model (with stragglers' buffers set
    aside already, it waited 600 s for the latest to be let go of, then failed)."""
    latest_weights = _weights(1)
    latest = _broadcast(sender, latest_weights, "m", refused=False)
    ray_stand_in.held.append(latest.ref.buffer)
    refused = [_broadcast(sender, _weights(seed), "m", refused=True) for seed in (2, 3, 4)]
    assert len(ray_stand_in.registered) == 2, "a refused version set the latest's buffer aside"
    assert all(payload.ref.buffer is refused[0].ref.buffer for payload in refused)
    assert refused[0].ref.buffer is not latest.ref.buffer
    assert ray_stand_in.deregistered == []
    assert _holds(latest, latest_weights), "a refused version overwrote the latest"

    newer = _broadcast(sender, _weights(5), "m", refused=False)  # the hub's latest now
    ray_stand_in.held[:] = [newer.ref.buffer]
    newest = _broadcast(sender, _weights(6), "m", refused=False)
    assert newer.ref.buffer is refused[0].ref.buffer and newest.ref.buffer is latest.ref.buffer
    assert len(ray_stand_in.registered) == 2
    assert _holds(newer, _weights(5)) and _holds(newest, _weights(6))
