"""RaySyncScheme in TorchRL's own RayCollector, on real remote collectors.

The set-up is TorchRL's ``TestRayCollector``: ``CountingEnv`` and a policy that acts
with its one weight, so each batch's actions show the weights it was collected with.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.collectors.distributed import RayCollector
from torchrl.testing.mocking_classes import CountingEnv
from torchrl.weight_update import WeightSyncScheme

from raysync import (
    BroadcastError,
    SpecMismatchError,
    UnknownModelError,
    UnknownWorkerError,
    WeightHub,
)
from raysync.hub_handle import DEFAULT_TIMEOUT_S
from raysync.torchrl import RaySyncScheme, _collector_model
from tests.torchrl.policies import (
    CountingPolicy,
    Evaluator,
    MaskedCountingPolicy,
    MismatchedCountingPolicy,
    normalized_counting_env,
)

FRAMES = 8  # per remote collector and batch
REMOTE = {"num_cpus": 0}  # many small actors on a 2-core machine
#: A timeout well past what any test here waits for (TorchRL's own Ray scheme: 60 s).
QUICK_S = 10.0


@pytest.fixture
def retry_waits(monkeypatch) -> list[float]:
    """The waits the scheme's update makes before trying again (for a restarting hub,
    or for collectors to register again): none for bad input, which is refused at once."""
    import raysync.torchrl as scheme_module

    waits: list[float] = []
    clock = scheme_module.time
    monkeypatch.setattr(
        scheme_module,
        "time",
        type(
            "_Clock",
            (),
            {"monotonic": staticmethod(clock.monotonic), "sleep": staticmethod(waits.append)},
        ),
    )
    return waits


def ray_collector(n: int, *, sync: bool, scheme: RaySyncScheme, **kwargs) -> RayCollector:
    return RayCollector(
        [CountingEnv] * n,
        frames_per_batch=FRAMES * n if sync else FRAMES,
        total_frames=10**9,  # the tests stop by themselves
        sync=sync,
        remote_configs=kwargs.pop("remote_configs", REMOTE),
        weight_sync_schemes={"policy": scheme},
        **kwargs,
    )


def ready_again(actor) -> None:
    """Until Ray's new incarnation of ``actor`` answers: a call made while Ray restarts
    it may fail as unavailable (Ray cannot tell whether it ran), and is made again."""
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=60)
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise


def killed_for_good(actor) -> None:
    """``ray.kill`` without restart, returned once Ray says the actor is dead: the kill
    is asynchronous, and a call that reaches the actor first still runs."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"


def actions(batch: TensorDict) -> set[float]:
    return set(batch["action"].float().flatten().tolist())


def set_weight(policy: CountingPolicy, value: float) -> CountingPolicy:
    with torch.no_grad():
        policy.weight.fill_(value)
    return policy


@pytest.fixture(scope="module")
def synced(ray_cluster):
    """Two remote ``Collector``s, ``sync=True``, built from the learner's policy, on a
    hub the scheme starts. Shared by the tests that leave the policy's spec as it is."""
    policy = CountingPolicy()
    scheme = RaySyncScheme()
    collector = ray_collector(2, sync=True, scheme=scheme, policy=policy)
    try:
        yield collector, scheme, policy, iter(collector)
    finally:
        collector.shutdown()


def test_collectors_act_with_each_update_from_their_next_batch(synced):
    collector, scheme, policy, batches = synced
    assert actions(next(batches)) == {1.0}

    collector.update_policy_weights_()  # the learner's policy, as it is now
    assert scheme.last_report.version == 1
    assert scheme.last_report.acked == scheme.workers
    assert actions(next(batches)) == {1.0}

    set_weight(policy, 2.0)
    collector.update_policy_weights_()
    assert actions(next(batches)) == {2.0}

    collector.update_policy_weights_(policy=set_weight(CountingPolicy(), 3.0))
    assert actions(next(batches)) == {3.0}

    collector.update_policy_weights_(TensorDict.from_module(set_weight(CountingPolicy(), 4.0)))
    assert scheme.last_report.version == 4
    assert actions(next(batches)) == {4.0}

    # Only the second remote collector: the batch stacks one row per collector.
    collector.update_policy_weights_({"weight": torch.tensor(5.0)}, worker_ids=[1])
    assert scheme.last_report.acked == scheme.workers[1:]
    batch = next(batches)
    assert actions(batch[0]) == {4.0} and actions(batch[1]) == {5.0}

    status = ray.get(scheme.hub.status.remote())
    held = {r.worker: r.versions["policy"] for r in status.receivers}
    assert held == {scheme.workers[0]: 4, scheme.workers[1]: 5}


def test_a_learner_policy_of_another_spec_is_refused_quickly_and_changes_nothing(
    synced, retry_waits
):
    collector, scheme, _, batches = synced
    before = actions(next(batches))
    versions = ray.get(scheme.hub.status.remote()).versions
    with pytest.raises(SpecMismatchError, match="unexpected"):
        collector.update_policy_weights_(MismatchedCountingPolicy())
    with pytest.raises(SpecMismatchError, match=r"weight.*\(2,\)"):
        collector.update_policy_weights_({"weight": torch.ones(2)})
    assert retry_waits == []  # refused at once, never tried again
    assert ray.get(scheme.hub.status.remote()).versions == versions
    assert actions(next(batches)) == before


def test_a_model_id_the_hub_does_not_know_is_refused_quickly(synced, retry_waits):
    collector, scheme, _, _ = synced
    critic = RaySyncScheme(scheme.hub)
    critic.init_on_sender(model_id="critic", remote_collectors=collector.remote_collectors)
    with pytest.raises(UnknownModelError, match="critic"):
        critic.send({"weight": torch.tensor(1.0)})
    assert retry_waits == []  # refused at once, never tried again


def test_no_worker_ids_send_nothing_at_once():
    """``worker_ids=[]`` names no collector: TorchRL's own schemes send nothing. The hub
    refused the empty list as naming no receiver, and the scheme, taking that for
    collectors not registered yet, flattened and sent the model again every half
    second for its whole timeout, then raised."""

    class _NoHub:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the hub was asked for {name}")

    scheme = RaySyncScheme(timeout_s=QUICK_S)
    scheme.model_id, scheme._workers, scheme._hub = "policy", ("c0", "c1"), _NoHub()
    scheme.send({"weight": torch.ones(1)}, worker_ids=[])
    assert scheme.last_report is None


def test_worker_ids_outside_the_collectors_are_refused(synced):
    collector, scheme, policy, _ = synced
    with pytest.raises(ValueError, match="2 is not a remote collector index"):
        collector.update_policy_weights_(policy, worker_ids=[0, 2])
    # TorchRL's API takes devices too (local collectors): said so, not "not an index".
    with pytest.raises(ValueError, match="worker_ids: cpu is a device; RaySyncScheme updates"):
        scheme.send(policy, worker_ids=torch.device("cpu"))


def test_a_scheme_used_before_init_on_sender_says_so():
    with pytest.raises(RuntimeError, match="not initialized on the sender"):
        RaySyncScheme().send({"weight": torch.tensor(1.0)})


def test_a_scheme_initialized_again_ends_the_hub_it_started_first(ray_cluster):
    """A scheme handed to a second RayCollector (the first one's constructor failed
    after init_on_sender, say) starts its hub again: the first one it started is ended,
    not left running, with its transports' actors, for the driver's life."""
    scheme = RaySyncScheme()
    scheme.init_on_sender(model_id="policy", remote_collectors=["stands for a collector"])
    first = scheme.hub
    scheme.init_on_sender(model_id="policy", remote_collectors=["stands for a collector"])
    try:
        assert scheme.hub is not first
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(first.actor.__ray_ready__.remote(), timeout=60)
    finally:
        scheme.shutdown()


def test_torchrl_builds_it_from_its_backend_registry():
    scheme = WeightSyncScheme.from_backend("raysync", timeout_s=5.0)
    assert isinstance(scheme, RaySyncScheme)


def test_async_collectors_on_a_named_hub_act_with_the_new_weights_once_it_returns(ray_cluster):
    """``sync=False`` and ``policy_factory``: no learner policy, so explicit weights;
    the hub is the user's (by name), the collectors read by a transport of their own."""
    hub = WeightHub.options(name="torchrl-test-hub").remote()
    scheme = RaySyncScheme("torchrl-test-hub", transport="shared_memory")
    collector = ray_collector(2, sync=False, scheme=scheme, policy_factory=CountingPolicy)
    try:
        batches = iter(collector)
        assert actions(next(batches)) == {1.0}
        collector.update_policy_weights_(TensorDict.from_module(set_weight(CountingPolicy(), 2)))
        assert scheme.last_report.transports == ("shared_memory",)
        # Batches already under way when it returned were collected with the old
        # weights: at most one per other collector. Every later one shows the new.
        after = [actions(next(batches)) for _ in range(6)]
        old = [a for a in after if a == {1.0}]
        assert len(old) <= 1 and after[len(old) :] == [{2.0}] * (6 - len(old))
        with pytest.raises(AttributeError, match="policy_factory"):
            collector.update_policy_weights_()  # no learner model to read from
        # Collectors whose policy differs from the hub's: refused as they attach. (Ray
        # cannot store the error of a remote TorchRL collector's method: that actor
        # dies, and its death carries the message.)
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError, match="does not match the hub's spec"):
            ray_collector(
                1,
                sync=False,
                scheme=RaySyncScheme("torchrl-test-hub"),
                policy=MismatchedCountingPolicy(),
            )
        # Refused as it attached, not at the scheme's timeout (a collector's actor starts
        # in seconds, more on two loaded cores: 13 s was seen beside another suite).
        assert time.monotonic() - started < DEFAULT_TIMEOUT_S / 2
    finally:
        collector.shutdown()
    assert not closed(hub)  # not the scheme's: still open
    ray.kill(hub.actor)


def test_two_ray_collectors_on_one_hub_keep_their_policies_apart_by_model(ray_cluster):
    """Two RayCollectors on one given hub, each scheme naming its model there: each
    collector acts with its own learner's updates only, and one built after the other's
    update starts with its own policy (on a shared id it joins late and takes the
    other's latest version)."""
    hub = WeightHub.options(name="torchrl-two-collectors-hub").remote()
    first = RaySyncScheme("torchrl-two-collectors-hub", model="first-policy")
    second = RaySyncScheme("torchrl-two-collectors-hub", model="second-policy")
    collectors = []
    try:
        collectors.append(
            ray_collector(1, sync=True, scheme=first, policy=set_weight(CountingPolicy(), 3.0))
        )
        first_batches = iter(collectors[0])
        collectors[0].update_policy_weights_()
        assert first.last_report.acked == first.workers
        assert actions(next(first_batches)) == {3.0}

        collectors.append(
            ray_collector(1, sync=True, scheme=second, policy=set_weight(CountingPolicy(), 2.0))
        )
        second_batches = iter(collectors[1])
        assert actions(next(second_batches)) == {2.0}
        collectors[1].update_policy_weights_(policy=set_weight(CountingPolicy(), 4.0))
        assert second.last_report.acked == second.workers
        assert actions(next(second_batches)) == {4.0}
        assert actions(next(first_batches)) == {3.0}

        status = ray.get(hub.status.remote())
        held = {r.worker: r.versions for r in status.receivers}
        assert held == {
            first.workers[0]: {"first-policy": 1},
            second.workers[0]: {"second-policy": 1},
        }
    finally:
        for collector in collectors:
            collector.shutdown()
        ray.kill(hub.actor)


def test_an_evaluator_attached_to_the_policy_at_the_hub_gets_each_update(ray_cluster):
    """Every receiver of the scheme's model at a given hub shares its versions: an actor
    of the user's attached to ``"policy"`` there acts with each collector update too (the
    scheme named its collectors only, and the evaluator stayed on its first weights)."""
    hub = WeightHub.options(name="torchrl-evaluator-hub").remote()
    scheme = RaySyncScheme("torchrl-evaluator-hub")
    policy = CountingPolicy()
    collector = ray_collector(1, sync=True, scheme=scheme, policy=policy)
    evaluator = ray.remote(num_cpus=0)(Evaluator).remote("torchrl-evaluator-hub", "evaluator")
    try:
        batches = iter(collector)
        assert ray.get(evaluator.weight.remote()) == 1.0
        for value in (2.0, 3.0):
            collector.update_policy_weights_(policy=set_weight(policy, value))
            assert sorted(scheme.last_report.acked) == sorted([*scheme.workers, "evaluator"])
            assert actions(next(batches)) == {value}
            assert ray.get(evaluator.weight.remote()) == value
    finally:
        collector.shutdown()
        ray.kill(evaluator)
        ray.kill(hub.actor)


def test_a_buffer_the_policy_does_not_save_stays_each_process_own(ray_cluster):
    """A policy's buffer registered with ``persistent=False`` moved with the collectors'
    updates (``TensorDict.from_module``) but not where raysync moves a module (its
    ``state_dict``): an evaluator attaching the policy was refused ("missing key(s) ...
    'mask'"), and so was an update of the learner's ``state_dict()``."""
    hub = WeightHub.options(name="torchrl-masked-hub").remote()
    scheme = RaySyncScheme("torchrl-masked-hub")
    policy = MaskedCountingPolicy()
    collector = ray_collector(1, sync=True, scheme=scheme, policy=policy)
    evaluator = ray.remote(num_cpus=0)(Evaluator).remote(
        "torchrl-masked-hub", "evaluator", MaskedCountingPolicy
    )
    try:
        ray.get(evaluator.__ray_ready__.remote())
        batches = iter(collector)
        policy.mask.fill_(5.0)  # the learner's own: no process acts with it but the learner
        collector.update_policy_weights_(policy=set_weight(policy, 2.0))
        assert sorted(scheme.last_report.acked) == sorted([*scheme.workers, "evaluator"])
        assert actions(next(batches)) == {2.0}
        collector.update_policy_weights_(set_weight(policy, 3.0).state_dict())
        assert sorted(scheme.last_report.acked) == sorted([*scheme.workers, "evaluator"])
        assert actions(next(batches)) == {3.0}
        # TorchRL's usual update, which holds the unsaved buffer too.
        collector.update_policy_weights_(TensorDict.from_module(set_weight(policy, 4.0)))
        assert sorted(scheme.last_report.acked) == sorted([*scheme.workers, "evaluator"])
        assert actions(next(batches)) == {4.0}
        assert ray.get(evaluator.weight.remote()) == 4.0
        assert ray.get(evaluator.buffers.remote()) == {"mask": 1.0}
    finally:
        collector.shutdown()
        ray.kill(evaluator)
        ray.kill(hub.actor)


def test_a_scheme_handed_to_a_second_ray_collector_updates_it(ray_cluster):
    """A scheme whose first RayCollector was used and shut down, handed to a second one:
    that one's updates reach its collectors (TorchRL refused them, as a second connect
    of a scheme that had synchronized once)."""
    scheme = RaySyncScheme()
    policy = set_weight(CountingPolicy(), 2.0)
    first = ray_collector(1, sync=True, scheme=scheme, policy=policy)
    try:
        first.update_policy_weights_()
        assert actions(next(iter(first))) == {2.0}
    finally:
        first.shutdown()
    second = ray_collector(1, sync=True, scheme=scheme, policy=policy)
    try:
        batches = iter(second)
        for value in (3.0, 4.0):
            second.update_policy_weights_(policy=set_weight(policy, value))
            assert scheme.last_report.acked == scheme.workers
            assert actions(next(batches)) == {value}
    finally:
        second.shutdown()


def test_collectors_ended_by_shutdown_leave_a_given_hub(ray_cluster):
    """RayCollector.shutdown kills its collectors before it shuts the scheme: on a hub
    the user gave, their receivers stayed registered, and the next RayCollector's first
    update of the same model failed naming them."""
    hub = WeightHub.options(name="torchrl-shutdown-hub").remote()
    policy = CountingPolicy()
    first_scheme = RaySyncScheme("torchrl-shutdown-hub")
    first = ray_collector(2, sync=True, scheme=first_scheme, policy=policy)
    try:
        first.update_policy_weights_()
    finally:
        first.shutdown()
    try:
        assert ray.get(hub.status.remote()).receivers == ()
        scheme = RaySyncScheme("torchrl-shutdown-hub")
        second = ray_collector(1, sync=True, scheme=scheme, policy=policy)
        try:
            batches = iter(second)
            second.update_policy_weights_(policy=set_weight(policy, 5.0))
            assert scheme.last_report.acked == scheme.workers
            assert actions(next(batches)) == {5.0}
        finally:
            second.shutdown()
    finally:
        ray.kill(hub.actor)


def test_a_model_id_at_the_hub_must_be_a_non_empty_string():
    with pytest.raises(ValueError, match="model must be a non-empty model id"):
        RaySyncScheme(model="")


@pytest.mark.parametrize("timeout_s", [0, float("nan"), float("inf"), True])
def test_a_timeout_that_is_no_positive_finite_number_is_refused(timeout_s):
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        RaySyncScheme(timeout_s=timeout_s)


def test_an_update_after_the_hub_restarted_waits_until_the_collectors_are_back(ray_cluster):
    """A hub Ray restarts knows no collector until each registers again (a heartbeat
    later): an update in between raised UnknownWorkerError; it is tried again."""
    hub = WeightHub.options(name="torchrl-restarting-hub", max_restarts=1).remote()
    policy = CountingPolicy()
    scheme = RaySyncScheme("torchrl-restarting-hub")
    collector = ray_collector(2, sync=True, scheme=scheme, policy=policy)
    try:
        batches = iter(collector)
        collector.update_policy_weights_()
        ray.kill(hub.actor, no_restart=False)
        set_weight(policy, 2.0)
        collector.update_policy_weights_()
        assert scheme.last_report.acked == scheme.workers
        assert actions(next(batches)) == {2.0}
    finally:
        collector.shutdown()
        ray.kill(hub.actor)


def test_an_update_after_a_collector_died_for_good_names_it_at_once(ray_cluster, retry_waits):
    """A remote collector killed for good: the update that finds it dead fails naming
    it, and so does the next one, at once (the hub had dropped it, and the scheme
    waited out its whole timeout as if the hub were restarting). The scheme's report
    says who applied each (it kept the last one that succeeded), and the second error
    says the others got it (it said no update reaches them, as if nothing was sent)."""
    policy = set_weight(CountingPolicy(), 2.0)
    scheme = RaySyncScheme(timeout_s=3 * QUICK_S)
    collector = ray_collector(2, sync=True, scheme=scheme, policy=policy)
    try:
        collector.update_policy_weights_()  # TorchRL's own first-update set-up
        killed_for_good(collector.remote_collectors[1])
        with pytest.raises(BroadcastError, match="died"):
            collector.update_policy_weights_()
        # The failed update's report: the live collector applied it, the dead one did not.
        alive, dead = scheme.workers
        assert scheme.last_report.acked == (alive,) and list(scheme.last_report.failed) == [dead]
        failed_version = scheme.last_report.version
        retry_waits.clear()
        with pytest.raises(
            UnknownWorkerError,
            match=rf"remote collector\(s\) 1 .* died .*version {failed_version + 1} reached "
            "the others",
        ):
            collector.update_policy_weights_()
        assert retry_waits == []  # at once: not waited for as if the hub restarted
        assert scheme.last_report.version == failed_version + 1
        assert scheme.last_report.acked == (alive,)
    finally:
        collector.shutdown()


def test_a_collector_ray_restarted_acts_with_the_next_update(ray_cluster):
    """Ray restarts a remote collector as TorchRL built it, without its receiver (TorchRL
    hands the scheme over once, from RayCollector's constructor): the next update
    attaches the new incarnation again and reaches it. Each collector's policy version
    (``track_policy_version``) is the version it applied: counted per update, the
    survivor's ran ahead by the update sent again, the restarted one's behind."""
    policy = set_weight(CountingPolicy(), 2.0)
    scheme = RaySyncScheme()
    restarting = {**REMOTE, "max_restarts": 1}
    collector = ray_collector(
        2,
        sync=True,
        scheme=scheme,
        policy=policy,
        remote_configs=restarting,
        collector_kwargs={"track_policy_version": True},
    )

    def policy_versions() -> list[int]:
        return ray.get(
            [c.__ray_call__.remote(lambda c: c.policy_version) for c in collector.remote_collectors]
        )

    try:
        batches = iter(collector)
        collector.update_policy_weights_()
        assert actions(next(batches)) == {2.0}
        assert policy_versions() == [scheme.last_report.version] * 2
        died = collector.remote_collectors[1]
        ray.kill(died, no_restart=False)
        ready_again(died)
        set_weight(policy, 3.0)
        collector.update_policy_weights_()
        assert scheme.last_report.acked == scheme.workers
        assert actions(next(batches)) == {3.0}
        assert policy_versions() == [scheme.last_report.version] * 2
        set_weight(policy, 4.0)
        collector.update_policy_weights_()
        assert actions(next(batches)) == {4.0}
        assert policy_versions() == [scheme.last_report.version] * 2
    finally:
        collector.shutdown()


def test_a_collector_ray_restarted_before_the_first_update_is_updated_from_the_next(
    ray_cluster,
):
    """Ray restarts a remote collector before the first update: TorchRL's weight-sync
    set-up (run at the first update) calls the scheme it handed the collector, which
    the new incarnation lacks, and fails; the next update ran the set-up again and
    TorchRL refused the scheme's second connect: no update ever reached a collector.
    The first update hands the new incarnation the scheme again; the next one goes."""
    policy = set_weight(CountingPolicy(), 2.0)
    scheme = RaySyncScheme()
    # Two restarts: the kill's, and one more when TorchRL's set-up call reaches the new
    # incarnation (rather than failing as unavailable) and fails there. Ray cannot store
    # that error: it tests the actor's truth, and a remote TorchRL collector's __len__
    # (total_frames=inf) returns a float; the worker exits and Ray restarts it.
    restarting = {**REMOTE, "max_restarts": 2}
    collector = ray_collector(2, sync=True, scheme=scheme, policy=policy, remote_configs=restarting)
    try:
        died = collector.remote_collectors[1]
        ray.kill(died, no_restart=False)
        ready_again(died)
        try:
            collector.update_policy_weights_()
        except ray.exceptions.RayError:  # TorchRL's set-up, on the restarted one
            collector.update_policy_weights_()
        assert scheme.last_report.acked == scheme.workers
        assert actions(next(iter(collector))) == {2.0}
    finally:
        collector.shutdown()


def test_a_collector_ray_restarted_after_the_hub_dropped_it_is_attached_again(ray_cluster):
    """The hub dropped a remote collector (a delivery found it dead) and the update that
    found it so could not attach its new incarnation (Ray was still starting it): the
    next update found a hub that knew it not, and a live actor, and waited out its whole
    timeout as if the hub were restarting; the collector acted on its old weights for
    good. That update now attaches it again and reaches it."""
    policy = set_weight(CountingPolicy(), 2.0)
    scheme = RaySyncScheme(timeout_s=3 * QUICK_S)
    restarting = {**REMOTE, "max_restarts": 1}
    collector = ray_collector(2, sync=True, scheme=scheme, policy=policy, remote_configs=restarting)
    try:
        batches = iter(collector)
        collector.update_policy_weights_()
        died = collector.remote_collectors[1]
        ray.kill(died, no_restart=False)
        ready_again(died)
        worker = scheme.workers[1]
        token = ray.get(
            scheme.hub.actor.__ray_call__.remote(
                lambda hub: hub._state.receivers[worker].registration.token
            )
        )
        ray.get(scheme.hub.actor.leave.remote(worker, token))  # as when a delivery found it dead
        set_weight(policy, 3.0)
        collector.update_policy_weights_()
        assert scheme.last_report.acked == scheme.workers
        assert actions(next(batches)) == {3.0}
    finally:
        collector.shutdown()


@pytest.mark.parametrize(
    ("collector_class", "sync", "factory"),
    [(MultiSyncCollector, True, True), (MultiAsyncCollector, False, False)],
    ids=["MultiSync-sync-policy_factory", "MultiAsync-async-policy"],
)
def test_updates_reach_the_workers_of_multiprocess_collectors(
    ray_cluster, collector_class, sync, factory
):
    policy = None if factory else CountingPolicy()
    scheme = RaySyncScheme()
    collector = ray_collector(
        1,
        sync=sync,
        scheme=scheme,
        policy=policy,
        policy_factory=CountingPolicy if factory else None,
        collector_class=collector_class,
    )
    hub = scheme.hub
    try:
        batches = iter(collector)
        assert actions(next(batches)) == {1.0}
        collector.update_policy_weights_(TensorDict.from_module(set_weight(CountingPolicy(), 2)))
        # A multi-process collector may hand out one batch its worker had ready.
        after = [actions(next(batches)) for _ in range(3)]
        assert after[1:] == [{2.0}, {2.0}] and after[0] in ({1.0}, {2.0})
    finally:
        collector.shutdown()
    assert scheme.hub is None and closed(hub)  # the scheme's own hub


def closed(hub) -> bool:
    """Whether the hub was closed (its actor is killed right after: it may be gone)."""
    try:
        return ray.get(hub.actor.closed.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True


def test_an_applied_version_of_a_model_besides_the_policy_is_not_passed_on_to_fail():
    """TorchRL's model ids are attribute paths (``"env.transform"``). After a version
    lands in the collector's model, the scheme's hook hands it to the collector's
    ``update_policy_weights_`` only for a model the collector takes that way: a
    ``Collector`` takes its policy and raises ``KeyError`` for any other id (the
    version, applied, then failed its ack: every update raised ``BroadcastError``)."""
    collector = Collector(
        normalized_counting_env, policy=CountingPolicy(), frames_per_batch=FRAMES, total_frames=-1
    )
    passed_on: list[str | None] = []
    take = collector.update_policy_weights_
    collector.update_policy_weights_ = lambda **kw: (passed_on.append(kw["model_id"]), take(**kw))
    try:
        for model_id in ("env.transform", "policy"):
            scheme = RaySyncScheme(model=f"{model_id} at the hub")
            scheme.model_id = model_id
            scheme.context, scheme.model = collector, _collector_model(collector, model_id)
            scheme._pass_on(scheme.hub_model, 1)  # what attach's on_applied runs
        assert passed_on == ["policy"]  # TorchRL's id, not the hub's
    finally:
        collector.shutdown()


def test_a_collector_attached_by_a_call_ray_could_not_confirm_counts_as_attached(monkeypatch):
    """The restarted collector's ``register_scheme_receiver`` ended in
    ActorUnavailableError (it may or may not have run); asked again, the collector
    holds a receiver: it was attached, and the update is sent again (it raised the
    broadcast's failure instead)."""
    import raysync.torchrl as scheme_module

    class _Call:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args, **kwargs) -> str:
            return self.name

    collector = type(
        "_Collector",
        (),
        {"__ray_call__": _Call("holds?"), "register_scheme_receiver": _Call("register")},
    )()
    answers = iter(
        [
            {"c0": False},  # holds no receiver: a new incarnation
            {"c0": scheme_module._UNAVAILABLE},  # register: Ray cannot tell if it ran
            {"c0": True},  # asked again: it did
        ]
    )
    monkeypatch.setattr(
        scheme_module, "_answers", lambda calls, deadline: next(answers) if calls else {}
    )
    scheme = RaySyncScheme()
    scheme.model_id, scheme._workers, scheme._collectors = "policy", ("c0",), (collector,)
    assert scheme._attach_restarted(["c0"], time.monotonic() + QUICK_S)
