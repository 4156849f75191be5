"""Zero-copy receivers: the model takes the transport's staged version as its memory."""

from __future__ import annotations

import pytest
import ray
import torch
from tensordict import TensorDict

from raysync import BroadcastError, WeightReceiver
from raysync.transports.nixl import NixlTransport
from tests.helpers import Gate, assert_same, ready, start, start_hub, wait_until
from tests.receivers import (
    Opaque,
    ThreadedProbe,
    filled,
    make_policy,
    make_probe_model,
    state_of,
)

_nixl = pytest.mark.skipif(
    not NixlTransport.availability().available,
    reason=f"nixl unavailable: {NixlTransport.availability().reason}",
)


@ray.remote(num_cpus=0)
class Trainer(WeightReceiver):
    """A zero-copy worker that also keeps an optimizer and a TensorDict model."""

    def __init__(self, hub):
        self.policy = make_policy()
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.1)
        self.td = TensorDict({"a": torch.zeros(5), "n": {"b": torch.zeros(2, 3)}}, [])
        self.opaque = Opaque()
        self.connect_hub(
            hub, models={"policy": "policy", "td": "td", "opaque": "opaque"}, zero_copy=True
        )

    def identities(self) -> dict[str, int]:
        """Python object ids: the model's tensors, and those the optimizer steps."""
        own = {f"policy.{k}": id(v) for k, v in self.policy.named_parameters()}
        own.update({f"td.{k}": id(v) for k, v in self.td.flatten_keys(".").items()})
        own["optimizer"] = tuple(id(p) for p in self.optimizer.param_groups[0]["params"])
        own["policy_params"] = tuple(id(p) for p in self.policy.parameters())
        return own

    def storage(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.policy.parameters())

    def policy_state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)

    def td_state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.td.flatten_keys(".").items()}

    def opaque_state(self) -> tuple[torch.Tensor, int]:
        return self.opaque._w.clone(), self.opaque._w.data_ptr()

    def train_step(self) -> float:
        """One SGD step on the live parameters (they are this worker's own memory)."""
        loss = self.policy(torch.ones(1, 8)).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss)


@_nixl
def test_zero_copy_model_lives_in_staged_buffers_and_keeps_its_tensors(actors):
    hub = start_hub(actors, "nixl")
    worker = start(actors, Trainer, hub)
    ready([worker])
    before = ray.get(worker.identities.remote())
    assert before["optimizer"] == before["policy_params"]
    storages = set()
    for step in range(1, 6):
        learner = make_policy()
        td = TensorDict({"a": torch.full((5,), float(step)), "n": {"b": torch.rand(2, 3)}}, [])
        ray.get(hub.broadcast.remote(learner, model="policy"))
        ray.get(hub.broadcast.remote(td, model="td"))
        assert_same(ray.get(worker.policy_state.remote()), state_of(learner))
        assert_same(ray.get(worker.td_state.remote()), {"a": td["a"], "n.b": td["n", "b"]})
        storages.add(ray.get(worker.storage.remote()))
    # Same tensor objects throughout (the optimizer still steps the model's parameters),
    # now living in the transport's buffers: two of them, used in turn.
    assert ray.get(worker.identities.remote()) == before
    assert len(storages) == 2, storages
    # A model reached only through state_dict() is copied into, as without zero copy.
    _, opaque_ptr = ray.get(worker.opaque_state.remote())
    for value in (3.0, 4.0):
        ray.get(hub.broadcast.remote({"w": torch.full((6,), value)}, model="opaque"))
        data, ptr = ray.get(worker.opaque_state.remote())
        assert torch.equal(data, torch.full((6,), value)) and ptr == opaque_ptr
    # The worker may write its parameters (they are its own), and the next version
    # replaces what it wrote.
    ray.get(worker.train_step.remote())
    trained = ray.get(worker.policy_state.remote())
    assert any(not torch.equal(trained[k], v) for k, v in state_of(learner).items())
    ray.get(hub.broadcast.remote(learner, model="policy"))
    assert_same(ray.get(worker.policy_state.remote()), state_of(learner))


@_nixl
def test_zero_copy_threaded_reader_never_sees_a_torn_model(actors):
    hub = start_hub(actors, "nixl")
    probe = start(actors, ThreadedProbe, hub, zero_copy=True)
    ready([probe])
    template = make_probe_model()
    ray.get(hub.broadcast.remote(filled(template, 1.0)))
    result_ref = probe.probe.remote(4.0, True)
    tickets = ray.get(
        [hub.broadcast.remote(filled(template, float(v)), wait=False) for v in range(2, 14)]
    )
    result = ray.get(result_ref)
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    assert all(r.failed == {} for r in reports)
    assert result["torn"] == 0
    assert len(result["seen"]) > 1, result


def test_zero_copy_is_refused_where_staged_data_is_shared(actors):
    """The object store hands out read-only views every reader of a node shares."""
    from tests.receivers import Collector

    hub = start_hub(actors, "object_store")
    collector = start(actors, Collector, hub, zero_copy=True)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ready([collector])
    message = str(info.value)
    assert "zero_copy" in message and "'object_store'" in message and "nixl" in message


@ray.remote(num_cpus=0)
class AsyncZeroCopy(WeightReceiver):
    """An async zero-copy worker on ``shared_memory``: its policy lives in the node's
    read-only segment while it is registered so."""

    def __init__(self, hub):
        self.policy = make_policy()
        self.connect_hub(hub, models={"policy": "policy"}, worker_id="z", zero_copy=True)

    async def hold_then_move(self, entered, gate, hub) -> None:
        """Use the model across an await until the test opens ``gate``, then register
        again by ``object_store``, copied into (``entered`` is opened on the way in)."""
        await entered.open.remote()
        await gate.wait.remote()
        self.connect_hub(hub, models={"policy": "policy"}, worker_id="z", transport="object_store")

    async def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)

    async def version(self) -> int:
        return self.weights_version()


def test_a_version_waiting_when_its_receiver_registers_again_is_not_applied_by_the_old_one(
    actors,
):
    """An async host registers again (another transport, zero copy off) from a method
    that held the model while a version waited for it. That version was staged by the
    old registration, zero copy: applied after, it would leave the model living in the
    read-only segment under a registration that copies into it (the next version killed
    the process). It is not applied: its broadcast names the worker, and the versions
    after it land by the new registration, bitwise."""
    hub = start_hub(actors, "shared_memory")
    worker = start(actors, AsyncZeroCopy, hub)
    ready([worker])
    template = make_policy()
    ray.get(hub.broadcast.remote(filled(template, 1.0)))
    entered, gate = start(actors, Gate), start(actors, Gate)
    moved = worker.hold_then_move.remote(entered, gate, hub)
    ray.get(entered.wait.remote())  # Ray may start an async actor's calls out of order
    assert ray.get(worker.version.remote()) == 1
    second = hub.broadcast.remote(filled(template, 2.0))
    # Asked by __ray_call__: a user method would wait for the version to be applied.
    waiting = worker.__ray_call__
    wait_until(
        lambda: ray.get(waiting.remote(lambda w: len(w._raysync_receiver.core.gate._deferred))),
        what="version 2 waiting for the model",
    )
    ray.get(gate.open.remote())
    ray.get(moved)
    with pytest.raises(BroadcastError, match="registered again") as failed:
        ray.get(second)
    assert set(failed.value.report.failed) == {"z"}
    assert_same(ray.get(worker.state.remote()), filled(template, 1.0))
    for value in (3.0, 4.0):
        report = ray.get(hub.broadcast.remote(filled(template, value)))
        assert report.acked == ("z",)
        assert_same(ray.get(worker.state.remote()), filled(template, value))
