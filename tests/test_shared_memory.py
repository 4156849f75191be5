"""The shared-memory transport on one node: bitwise delivery, no tearing under lag,
holds released, failures of receivers and owners, nothing left behind."""

from __future__ import annotations

import os
import pickle
import signal
import time
from types import SimpleNamespace

import pytest
import ray
import torch

import raysync
from raysync import StaleVersionError, WeightReceiver
from raysync.hub_state import LEASE_BEATS
from raysync.messages import Entry
from raysync.receiver_delivery import delivery_call
from raysync.testing import assert_bitwise, special_weights
from raysync.transports.shared_memory import MAX_SLOTS, OWNER_NAMESPACE, owner_name
from raysync.transports.shared_memory import learner as shm_learner
from tests.helpers import (
    Gate,
    actor_pid,
    assert_same,
    cut_off_heartbeats,
    hold_until_opened,
    ready,
    release_hub,
    start,
    start_hub,
    wait_until,
)
from tests.receivers import (
    BeatCountingHolder,
    Collector,
    Holder,
    SlotCrossingLearner,
    SlowHook,
    filled,
    make_policy,
    make_probe_model,
    pull_giving_up_at_once,
    state_of,
)

TRANSPORT = "shared_memory"
#: What the kernel calls our segments in /proc/<pid>/fd and /proc/<pid>/maps.
SEGMENT = "memfd:raysync-segment"


@ray.remote(num_cpus=0)
class Recorder(WeightReceiver):
    """Records, at each apply, the smallest and largest element of its whole model."""

    def __init__(self, hub, worker_id: str, delay_s: float = 0.0):
        self.model = make_probe_model(width=64, layers=4)
        self.delay_s = delay_s
        self.seen: list[tuple[int, float, float]] = []
        self.connect_hub(hub, models={"probe": "model"}, worker_id=worker_id)

    def on_weights_applied(self, model: str, version: int) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        self.seen.append((version, float(flat.min()), float(flat.max())))
        time.sleep(self.delay_s)

    def record(self) -> list[tuple[int, float, float]]:
        return list(self.seen)

    def pid(self) -> int:
        return os.getpid()


def _owner(hub):
    node_id = ray.get_runtime_context().get_node_id()
    return ray.get_actor(owner_name(hub.config.hub_id, node_id), namespace=OWNER_NAMESPACE)


def _holds(hub) -> tuple[str, ...]:
    return ray.get(_owner(hub).stats.remote()).holds


def _segments_in(pid: int) -> int:
    """How many of our segments process ``pid`` has open or mapped (0 if it is gone)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        with open(f"/proc/{pid}/maps") as maps:
            mapped = sum(SEGMENT in line for line in maps)
    except (FileNotFoundError, ProcessLookupError):
        return 0
    opened = 0
    for fd in fds:
        try:
            opened += SEGMENT in os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
    return opened + mapped


def _our_dev_shm() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if "raysync" in name]


def test_bitwise_mixed_dtypes_every_version_one_write_per_node(actors):
    hub = start_hub(actors, TRANSPORT)
    receivers = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(receivers)
    learner = make_policy()
    for _ in range(3):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p))
        report = ray.get(hub.broadcast.remote(learner))
        assert report.acked == ("c0", "c1", "c2") and report.transports == (TRANSPORT,)
        for r in receivers:
            assert_same(ray.get(r.state.remote()), state_of(learner))
    # Every receiver read the one slot the learner wrote: all got the same payload.
    latest = ray.get(hub.latest.remote("policy"))
    stats = ray.get(_owner(hub).stats.remote())
    assert stats.relays == 0 and stats.exports == 0  # one node: nothing crossed nodes
    assert 1 <= stats.segments <= MAX_SLOTS, stats
    assert latest.payload.slot.seq == 3  # three versions, three writes on this node

    mixed = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "f64": torch.randn(7, dtype=torch.float64),
        "i64": torch.arange(9),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }

    @ray.remote(num_cpus=0)
    class Mixed(Collector.__ray_actor_class__):
        def __init__(self, hub):
            self.sd = {k: torch.zeros_like(v) for k, v in mixed.items()}
            self.applied = []
            self.connect_hub(hub, models={"mixed": "sd"})

    receiver = start(actors, Mixed, hub)
    ready([receiver])
    ray.get(hub.broadcast.remote(mixed, model="mixed"))
    assert_same(ray.get(receiver.state.remote("sd")), mixed)


def test_the_segment_owner_never_imports_torch(actors):
    """A node's owner hands out slots, keeps their holds and relays bytes between nodes;
    it never unpacks a version, so its process does without torch (seconds of CPU at
    each start, on every node, and a few hundred MB for the hub's lifetime)."""
    hub = start_hub(actors, TRANSPORT)
    receiver = start(actors, Collector, hub, worker_id="c")
    ready([receiver])
    learner = make_policy()
    for _ in range(2):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(1.0)
        assert ray.get(hub.broadcast.remote(learner)).acked == ("c",)
        assert_same(ray.get(receiver.state.remote()), state_of(learner))
    # By value, not a function of this module: the owner must not import this module.
    imported_torch = lambda _: "torch" in __import__("sys").modules  # noqa: E731
    assert ray.get(_owner(hub).__ray_call__.remote(imported_torch)) is False


def test_back_to_back_broadcasts_never_tear_a_lagging_reader(actors):
    """wait=False broadcasts faster than one receiver applies them: every version each
    receiver applies is exactly that version's bytes, although the learner writes far
    more versions than there are slots. The lagging receiver holds the slots of the
    calls made to it, so the learner waits for a slot instead of overwriting one being
    read; versions sent while its call runs wait, and the newest of them goes."""
    hub = start_hub(actors, TRANSPORT)
    template = make_probe_model(width=64, layers=4)
    fast = start(actors, Recorder, hub, "fast")
    lagging = start(actors, Recorder, hub, "lagging", 0.3)
    ready([fast, lagging])
    versions = range(1, 3 * MAX_SLOTS + 1)
    tickets = [
        ray.get(hub.broadcast.remote(filled(template, float(v)), wait=False)) for v in versions
    ]
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    assert all(r.acked == ("fast", "lagging") for r in reports), reports
    for receiver in (fast, lagging):
        seen = ray.get(receiver.record.remote())
        applied = [v for v, _, _ in seen]
        assert applied == sorted(set(applied)) and applied[-1] == versions[-1], applied
        torn = [(v, lo, hi) for v, lo, hi in seen if not lo == hi == float(v)]
        assert torn == [], f"versions applied with another version's bytes: {torn}"
    assert ray.get(_owner(hub).stats.remote()).segments <= MAX_SLOTS
    # Every receiver released every version; the latest stays held for late joiners
    # (and the learner may hold the slot it asked for ahead).
    wait_until(lambda: set(_holds(hub)) - {"pending"} == {"latest/probe"}, what="holds released")


def test_the_learner_delivers_its_slot_itself_and_the_holds_land_after(actors):
    """The direct path: after the first broadcast (which tells the learner its route),
    the learner calls the receivers on its node with its slot and the hub books their
    holds in parallel. Receivers are done with a slot before its holds land: the owner
    remembers their releases, so more versions than slots go through and no receiver's
    hold is left behind. Releases are written on the owner's release board, not sent."""
    hub = start_hub(actors, TRANSPORT)
    receivers = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(receivers)
    learner = make_policy()
    directs = []
    for _ in range(2 * MAX_SLOTS + 1):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(1.0)
        report = ray.get(hub.broadcast.remote(learner))
        assert report.acked == ("c0", "c1", "c2"), report
        directs.append(report.direct)
        for r in receivers:
            assert_same(ray.get(r.state.remote()), state_of(learner))
    assert set(directs[1:]) == {("c0", "c1", "c2")}, directs
    assert ray.get(_owner(hub).stats.remote()).segments <= MAX_SLOTS
    wait_until(
        lambda: not any(h.startswith("worker/") for h in _holds(hub)),
        what="every receiver's hold released",
    )
    assert "latest/policy" in _holds(hub)
    # Each receiver released each version on its row of the owner's board: no call.
    stats = ray.get(_owner(hub).stats.remote())
    assert (stats.board_releases, stats.release_calls) == (3 * len(directs), 0), stats


def test_a_handle_unpickled_for_each_broadcast_writes_into_the_same_slots(actors):
    """A learner that gets the hub with each call (a Ray argument is unpickled anew each
    time) sends through its process's one sender: the owner keeps one pool of slots
    for it, not one more per handle for as long as the hub lives."""
    hub = start_hub(actors, TRANSPORT)
    receiver = start(actors, Collector, hub, worker_id="c0")
    ready([receiver])
    learner = make_policy()
    for _ in range(2 * MAX_SLOTS + 1):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(1.0)
        fresh = pickle.loads(pickle.dumps(hub))
        assert ray.get(fresh.broadcast.remote(learner)).acked == ("c0",)
        assert_same(ray.get(receiver.state.remote()), state_of(learner))
    assert ray.get(_owner(hub).stats.remote()).segments <= MAX_SLOTS


def test_a_learners_threads_submit_their_slots_in_the_order_they_took_them(actors):
    """Two threads of one learner broadcast at once, the first taking its slot first.
    Planning a version frees the learner's older slots the hub never planned (versions
    it refused). Had the second's version reached the hub first, the first's slot was
    freed unplanned and handed out again as the next slot: the first's version was
    then held for nobody, and a receiver busy in a method read it after the next
    version was written there (and failed). The second's broadcast waits for the
    first's submit instead."""
    hub = start_hub(actors, TRANSPORT)
    template = filled(make_policy(), 0.0)
    receiver = start(actors, Holder, hub, template, "c0")
    ready([receiver])
    learner = start(actors, SlotCrossingLearner, hub)
    gate = start(actors, Gate)
    versions = [filled(make_policy(), float(v)) for v in (1, 2, 3)]
    refs = ray.get(learner.crossed.remote(versions[:2], receiver, gate, 30.0))
    refs += ray.get(learner.broadcast.remote(versions[2]))  # while the receiver is busy
    ray.get(gate.open.remote())
    reports = ray.get(refs, timeout=60)
    assert [r.failed for r in reports] == [{}, {}, {}], reports
    assert sorted(r.version for r in reports) == [1, 2, 3]
    assert ray.get(receiver.applied_versions.remote()) == [1, 2, 3]
    assert_same(ray.get(receiver.state.remote()), versions[2])


def test_killed_receiver_releases_its_holds(actors):
    hub = start_hub(actors, TRANSPORT)
    survivors = [start(actors, Collector, hub, worker_id=f"ok{i}") for i in range(2)]
    victim_id = "victim"
    victim = start(actors, SlowHook, hub, 30.0, victim_id)
    ready([*survivors, victim])
    ray.get(hub.broadcast.remote(make_policy()))
    ref = hub.broadcast.remote(make_policy(), timeout_s=20, raise_on_failure=False)
    wait_until(lambda: f"worker/{victim_id}" in _holds(hub), what="victim holds version 2")
    ray.kill(victim)
    report = ray.get(ref, timeout=30)
    assert report.acked == ("ok0", "ok1") and "died" in report.failed[victim_id]
    wait_until(lambda: f"worker/{victim_id}" not in _holds(hub), what="victim's hold dropped")
    # More versions than slots still flow: nothing the victim held is lost.
    learner = make_policy()
    for _ in range(MAX_SLOTS + 1):
        report = ray.get(hub.broadcast.remote(learner))
        assert report.acked == ("ok0", "ok1")
    for s in survivors:
        assert_same(ray.get(s.state.remote()), state_of(learner))


@pytest.mark.parametrize("kill", ["ray.kill", "SIGKILL"])
def test_killed_owner_is_restarted_and_leaves_nothing(actors, kill):
    """Killed by Ray, or its process by a signal (as the kernel's OOM killer does): Ray
    then kept the owner's name for the dead one in every process holding a handle of it,
    the hub's new owner was refused its name for good, and every broadcast waited 30-60
    s for an owner that never came."""
    hub = start_hub(actors, TRANSPORT)
    receivers = [start(actors, Recorder, hub, f"r{i}") for i in range(2)]
    ready(receivers)
    template = make_probe_model(width=64, layers=4)
    ray.get(hub.broadcast.remote(filled(template, 1.0)))
    owner = _owner(hub)
    owner_pid = ray.get(hub.latest.remote("probe")).payload.slot.pid
    assert _segments_in(owner_pid) > 0
    if kill == "ray.kill":
        ray.kill(owner)
    else:
        os.kill(owner_pid, signal.SIGKILL)
    # The owner's process and with it every descriptor of its segments are gone.
    wait_until(lambda: _segments_in(owner_pid) == 0, what="dead owner's segments closed")
    # The hub restarts the owner; the learner finds the new one and delivery goes on.
    report = ray.get(hub.broadcast.remote(filled(template, 2.0)))
    assert report.acked == ("r0", "r1")
    assert ray.get(hub.latest.remote("probe")).payload.slot.pid != owner_pid
    for r in receivers:
        assert ray.get(r.record.remote())[-1] == (2, 2.0, 2.0)
    # The receivers' rows were on the dead owner's board: they release to the new
    # owner by call, so more versions than slots still go through.
    for value in range(3, MAX_SLOTS + 4):
        assert ray.get(hub.broadcast.remote(filled(template, float(value)))).acked == ("r0", "r1")
    wait_until(lambda: not any(h.startswith("worker/") for h in _holds(hub)), what="released")
    assert ray.get(_owner(hub).stats.remote()).release_calls > 0
    assert _our_dev_shm() == []


def test_hub_close_frees_every_segment(actors):
    hub = start_hub(actors, TRANSPORT)
    receivers = [start(actors, Recorder, hub, f"r{i}") for i in range(2)]
    ready(receivers)
    template = make_probe_model(width=64, layers=4)
    for v in (1.0, 2.0):
        ray.get(hub.broadcast.remote(filled(template, v)))
    owner_pid = ray.get(hub.latest.remote("probe")).payload.slot.pid
    receiver_pids = ray.get([r.pid.remote() for r in receivers])
    assert _segments_in(owner_pid) > 0 and all(_segments_in(p) > 0 for p in receiver_pids)
    ray.get(hub.close.remote())
    wait_until(lambda: _segments_in(owner_pid) == 0, what="owner's segments closed")
    for r in receivers:
        ray.kill(r)
    # Once the readers are gone too, no process of ours maps a segment: the kernel has
    # freed them. None was ever linked into /dev/shm.
    wait_until(lambda: all(_segments_in(p) == 0 for p in receiver_pids), what="receivers unmapped")
    assert _our_dev_shm() == []


def test_killed_hub_takes_its_owner_and_segments_with_it(actors):
    hub = start_hub(actors, TRANSPORT)
    receiver = start(actors, Recorder, hub, "r0")
    ready([receiver])
    ray.get(hub.broadcast.remote(filled(make_probe_model(width=64, layers=4), 1.0)))
    owner_pid = ray.get(hub.latest.remote("probe")).payload.slot.pid
    assert _segments_in(owner_pid) > 0
    ray.kill(hub.actor)
    # The owner fate-shares with the hub that created it: its process and descriptors go.
    wait_until(lambda: _segments_in(owner_pid) == 0, what="owner gone with the hub")
    assert _our_dev_shm() == []


@ray.remote(num_cpus=0)
class ZeroCopyReader(WeightReceiver):
    """Its policy lives in the node's segment (``zero_copy=True``)."""

    def __init__(self, hub, worker_id: str):
        self.policy = make_policy()
        self.worker_id = worker_id
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=worker_id, zero_copy=True)

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)

    def lives_in_a_segment(self) -> bool:
        """Every parameter lies in one of our segments as mapped in this process."""
        with open("/proc/self/maps") as maps:
            ranges = [
                tuple(int(a, 16) for a in line.split()[0].split("-"))
                for line in maps
                if SEGMENT in line
            ]
        return all(
            any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in self.policy.parameters()
        )

    def reconnect(self, hub, zero_copy: bool = True, transport: str | None = None) -> None:
        self.connect_hub(
            hub,
            models={"policy": "policy"},
            worker_id=self.worker_id,
            zero_copy=zero_copy,
            transport=transport,
        )

    def segment_fds(self) -> int:
        """How many descriptors of our segments (the release board among them) are open."""
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue  # closed meanwhile (the listing's own)
        return sum(SEGMENT in link for link in links)

    def close(self) -> None:
        self._raysync_receiver.close()


def test_zero_copy_models_live_in_the_segment_which_outlives_a_reregistration(actors):
    hub = start_hub(actors, TRANSPORT)
    kept, moving = (start(actors, ZeroCopyReader, hub, w) for w in ("kept", "moving"))
    ready([kept, moving])
    first = make_policy()
    ray.get(hub.broadcast.remote(first))
    for reader in (kept, moving):
        assert_same(ray.get(reader.state.remote()), state_of(first))
        assert ray.get(reader.lives_in_a_segment.remote())
    # Registering again must not free the slot "kept" lives in: the learner writes more
    # versions than there are slots, to "moving" only, and "kept" still holds the first.
    ray.get(kept.reconnect.remote(hub))
    for _ in range(MAX_SLOTS + 2):
        learner = make_policy()
        ray.get(hub.broadcast.remote(learner, workers=["moving"]))
        assert_same(ray.get(moving.state.remote()), state_of(learner))
        assert_same(ray.get(kept.state.remote()), state_of(first))
    # Moving on releases it: one hold per reader, on the latest slot.
    ray.get(hub.broadcast.remote(learner))
    assert_same(ray.get(kept.state.remote()), state_of(learner))
    holds = wait_until(
        lambda: (h := _holds(hub)).count("worker/kept") == 1 and h,
        what="kept's old hold released",
    )
    assert holds.count("worker/moving") == 1, holds
    assert ray.get(_owner(hub).stats.remote()).segments <= MAX_SLOTS


def test_registering_again_leaves_no_descriptor_open(actors):
    """A zero-copy receiver registered again releases the version its model lived in
    once the model moves on, on its former registration's board: that write opened
    the board again and left it open, one descriptor per registration."""
    hub = start_hub(actors, TRANSPORT)
    reader = start(actors, ZeroCopyReader, hub, "reader")
    ready([reader])
    ray.get(hub.broadcast.remote(make_policy()))
    counts = []
    for _ in range(4):
        ray.get(reader.reconnect.remote(hub))
        learner = make_policy()
        ray.get(hub.broadcast.remote(learner))
        assert_same(ray.get(reader.state.remote()), state_of(learner))
        counts.append(ray.get(reader.segment_fds.remote()))
    assert counts == [counts[0]] * 4, counts


def test_a_zero_copy_receiver_registering_again_copying_or_by_another_transport(actors):
    """Registering again without zero copy, or by another transport, moves the model out
    of the segment first: copied into in place where it lived, a read-only mapping, the
    process died at the next version. Leaving the transport drops its holds there."""
    hub = start_hub(actors, TRANSPORT)
    copying, moving = (start(actors, ZeroCopyReader, hub, w) for w in ("copying", "moving"))
    ready([copying, moving])
    first = make_policy()
    ray.get(hub.broadcast.remote(first))
    ray.get(copying.reconnect.remote(hub, zero_copy=False))
    ray.get(moving.reconnect.remote(hub, zero_copy=False, transport="object_store"))
    for reader in (copying, moving):
        assert not ray.get(reader.lives_in_a_segment.remote())
        assert_same(ray.get(reader.state.remote()), state_of(first))
    wait_until(lambda: "worker/moving" not in _holds(hub), what="moving's holds dropped")
    # The learner learns of the object store's hand-off with the first version after
    # the move (the README's "Transports"): "moving" reads from the second.
    for _ in range(MAX_SLOTS + 1):
        learner = make_policy()
        assert "copying" in ray.get(hub.broadcast.remote(learner)).acked
    assert ray.get(hub.broadcast.remote(learner)).acked == ("copying", "moving")
    for reader in (copying, moving):
        assert_same(ray.get(reader.state.remote()), state_of(learner))


def test_a_closed_zero_copy_receiver_keeps_its_version_while_its_slot_is_reused(actors):
    """Closing leaves the hub, which drops the receiver's holds: its model first moves
    into memory of its own, so the versions written into that slot after do not
    reach it."""
    hub = start_hub(actors, TRANSPORT)
    closing, staying = (start(actors, ZeroCopyReader, hub, w) for w in ("closing", "staying"))
    ready([closing, staying])
    first = make_policy()
    ray.get(hub.broadcast.remote(first))
    assert ray.get(closing.lives_in_a_segment.remote())
    ray.get(closing.close.remote())
    assert not ray.get(closing.lives_in_a_segment.remote())
    for _ in range(MAX_SLOTS + 2):
        learner = make_policy()
        assert ray.get(hub.broadcast.remote(learner)).acked == ("staying",)
        assert_same(ray.get(staying.state.remote()), state_of(learner))
        assert_same(ray.get(closing.state.remote()), state_of(first))
    assert not any("closing" in hold for hold in _holds(hub))


def test_a_hub_whose_receivers_all_pull_lets_the_learners_slots_go(actors):
    """No receiver is sent the versions, so nothing is planned: the owner must still
    hear of each (its slots all stayed pending; the learner's next slot then waited
    60 s and failed)."""
    hub = start_hub(actors, TRANSPORT)
    puller = start(actors, Collector, hub, worker_id="puller", mode="pull")
    ready([puller])
    for _ in range(2 * MAX_SLOTS):
        learner = make_policy()
        assert ray.get(hub.broadcast.remote(learner), timeout=30).acked == ()
    assert ray.get(puller.pull.remote()) == {"policy": 2 * MAX_SLOTS}
    assert_same(ray.get(puller.state.remote()), state_of(learner))


def test_a_live_zero_copy_puller_the_hub_stopped_hearing_keeps_its_model(actors):
    """Its hub watch is cut off from the hub past the pull lease: the hub asks Ray,
    finds the actor alive and keeps it, with the slot its model lives in (dropped,
    its holds went and the learner wrote later versions into its model)."""
    hub = start_hub(actors, TRANSPORT)
    beat = 0.3
    puller = start(
        actors, Collector, hub, worker_id="puller", mode="pull", zero_copy=True, heartbeat_s=beat
    )
    ready([puller])
    first = make_policy()
    ray.get(hub.broadcast.remote(first))
    assert ray.get(puller.pull.remote()) == {"policy": 1}
    ray.get(puller.__ray_call__.remote(cut_off_heartbeats))
    deadline = time.monotonic() + 60
    while (heard := _heard_s(hub, "puller")) is not None and heard < (LEASE_BEATS + 3) * beat:
        assert time.monotonic() < deadline, f"heard {heard} s ago"
        time.sleep(beat / 5)  # polling the hub's status: nothing to wait on
    assert heard is not None, "the hub forgot a live puller"
    for _ in range(MAX_SLOTS + 2):
        learner = make_policy()
        ray.get(hub.broadcast.remote(learner))
        assert_same(ray.get(puller.state.remote()), state_of(first))
    assert ray.get(puller.pull.remote()) == {"policy": MAX_SLOTS + 3}
    assert_same(ray.get(puller.state.remote()), state_of(learner))


def _heard_s(hub, worker: str) -> float | None:
    """Seconds since ``hub`` heard ``worker``'s hub watch; None once it forgot it."""
    for receiver in ray.get(hub.status.remote()).receivers:
        if receiver.worker == worker:
            return receiver.heard_s
    return None


@ray.remote(num_cpus=0)
class EqualParts(WeightReceiver):
    """Eight equal tensors: dealt to four learners, every part has the same size."""

    def __init__(self, hub):
        self.sd = {f"t{i}": torch.zeros(64) for i in range(8)}
        self.connect_hub(hub, models={"m": "sd"})

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.sd.items()}


def test_learners_of_a_sharded_model_on_one_node_keep_their_own_slots(actors):
    """Four learners on this node each send one equal-sized part of every version: each
    has its own slots at the owner (with one pool per size, the four latest parts and
    the four slots asked ahead would need more than ``MAX_SLOTS``: a part would wait
    for a slot only the whole version frees), and every version lands whole."""
    from raysync.testing import PartLearner

    hub = start_hub(actors, TRANSPORT, models=["m"])
    receiver = start(actors, EqualParts, hub)
    learners = [start(actors, ray.remote(num_cpus=0)(PartLearner), hub) for _ in range(4)]
    ready([receiver, *learners])
    assert 2 * len(learners) > MAX_SLOTS
    for version in range(1, 5):
        weights = {f"t{i}": torch.full((64,), float(version)) for i in range(8)}
        refs = [
            learner.send.remote(
                {k: weights[k] for k in sorted(weights)[i::4]},
                version=version,
                part=i,
                parts=4,
                timeout_s=20,
            )
            for i, learner in enumerate(learners)
        ]
        assert {r.version for r in ray.get(refs, timeout=60)} == {version}
        assert_same(ray.get(receiver.state.remote()), weights)


def test_the_slots_of_learners_that_released_the_hub_are_freed(actors):
    """Learner processes come and go (restarted, or one per task): each had a pool of
    slots at its node's owner, its last version and the slot it asked for ahead. Those
    of a learner that released the hub (or died: after ``PENDING_KEPT_S``, unit-tested)
    are freed, so the owner holds the slots of the learners that live, not of every
    learner that ever broadcast."""
    from raysync.testing import MODEL, PartLearner

    hub = start_hub(actors, TRANSPORT, models=[MODEL])
    receiver = start(actors, EqualParts, hub)
    ready([receiver])
    weights = {f"t{i}": torch.full((64,), 0.0) for i in range(8)}
    for generation in range(6):
        learner = ray.remote(num_cpus=0)(PartLearner).remote(hub)
        weights = {k: torch.full((64,), float(generation)) for k in weights}
        ray.get(learner.send.remote(weights, timeout_s=20), timeout=60)
        ray.get(learner.__ray_call__.remote(release_hub))
        ray.kill(learner)
        assert_same(ray.get(receiver.state.remote()), weights)
    # Another learner's next slot is found once the others are gone: whatever it finds
    # then, the owner keeps the latest version's slot and this learner's two.
    last = ray.remote(num_cpus=0)(PartLearner).remote(hub)
    ray.get(last.send.remote(weights, timeout_s=20), timeout=60)
    assert ray.get(_owner(hub).stats.remote()).segments <= 3


def test_a_learner_moved_to_a_new_hub_lets_the_closed_ones_segments_go(actors):
    """A learner keeps its side of a hub (its slots' mappings) between broadcasts; once
    that hub is closed and the learner broadcasts on another, the closed hub's segments
    leave its process: a long-lived learner moved from hub to hub holds the memory of
    the hub it uses, not of every one it ever used."""
    from raysync.testing import MODEL, PartLearner

    closing = start_hub(actors, TRANSPORT, models=[MODEL])
    receiver = start(actors, EqualParts, closing)
    ready([receiver])
    learner = ray.remote(num_cpus=0)(PartLearner).remote(closing)
    actors.append(learner)
    weights = {f"t{i}": torch.full((64,), 1.0) for i in range(8)}
    ray.get(learner.send.remote(weights, timeout_s=20), timeout=60)
    pid = actor_pid(learner)
    assert _segments_in(pid) > 0
    ray.get(closing.close.remote())
    ray.kill(receiver)
    assert _segments_in(pid) > 0  # nothing it does tells it yet

    following = start_hub(actors, "object_store", models=[MODEL])
    receiver = start(actors, EqualParts, following)
    ready([receiver])
    ray.get(learner.__ray_call__.remote(lambda self, hub: setattr(self, "hub", hub), following))
    weights = {k: torch.full((64,), 2.0) for k in weights}
    assert ray.get(learner.send.remote(weights, timeout_s=20), timeout=60).acked
    assert_same(ray.get(receiver.state.remote()), weights)
    wait_until(lambda: _segments_in(pid) == 0, what="the closed hub's segments let go")


def _frozen_objects(actor) -> int:
    """How many objects ``actor``'s process keeps out of garbage collection."""
    return ray.get(actor.__ray_call__.remote(lambda self: __import__("gc").get_freeze_count()))


def test_the_hub_and_the_owner_keep_their_start_up_heap_out_of_garbage_collection(actors):
    """A full collection of a process that imported Ray and torch walks ~200K objects
    (~80 ms on 2 cores) and a broadcast waiting on that actor waits for it: raysync's
    actors freeze what they hold once started (raysync/actors/heap.py)."""
    hub = start_hub(actors, TRANSPORT)
    receiver = start(actors, Collector, hub)
    ready([receiver])
    ray.get(hub.broadcast.remote(make_policy()))
    # The imports alone are tens of thousands of objects; a process that never froze has 0.
    assert _frozen_objects(hub.actor) > 20_000
    assert _frozen_objects(_owner(hub)) > 20_000
    assert _frozen_objects(receiver) == 0  # a user's process: its heap is its own


def test_versions_the_hub_refuses_let_their_slots_go(actors, monkeypatch):
    """A version the hub refuses (here a stale explicit version) is never planned: its
    slot stayed pending, so a few refusals in a row held every slot of the learner and
    its next valid broadcast waited out the slot wait and failed."""
    monkeypatch.setattr(shm_learner, "SLOT_WAIT_S", 5.0)  # the learner is this process
    hub = start_hub(actors, TRANSPORT)
    receiver = start(actors, Collector, hub, worker_id="r")
    ready([receiver])
    ray.get(hub.broadcast.remote(make_policy(), version=10))
    for _ in range(2 * MAX_SLOTS):
        with pytest.raises(StaleVersionError, match="10"):
            ray.get(hub.broadcast.remote(make_policy(), version=5))
    fresh = make_policy()
    assert ray.get(hub.broadcast.remote(fresh, version=11), timeout=60).acked == ("r",)
    assert_same(ray.get(receiver.state.remote()), state_of(fresh))
    assert ray.get(receiver.version.remote("policy")) == 11


def test_parts_the_hub_refuses_let_their_slots_go(actors, monkeypatch):
    """The same for a learner's part of a sharded model, which the hub plans as a
    stream of its own."""
    monkeypatch.setattr(shm_learner, "SLOT_WAIT_S", 5.0)  # the learner is this process
    hub = start_hub(actors, TRANSPORT, models=["m"])
    receiver = start(actors, EqualParts, hub)
    ready([receiver])

    def send(version: int, value: float, parts: range = range(2)) -> list[ray.ObjectRef]:
        halves = [{k: weights(value)[k] for k in sorted(weights(value))[i::2]} for i in parts]
        return [
            hub.broadcast.remote(half, model="m", version=version, part=i, parts=2)
            for i, half in zip(parts, halves, strict=True)
        ]

    def weights(value: float) -> dict[str, torch.Tensor]:
        return {f"t{i}": torch.full((64,), value) for i in range(8)}

    ray.get(send(10, 1.0), timeout=60)
    for stale in range(1, 1 + 2 * MAX_SLOTS):  # each version once: a failed one is over
        (refused,) = send(stale, 2.0, parts=range(1))
        with pytest.raises(StaleVersionError, match="10"):
            ray.get(refused, timeout=60)
    assert {r.version for r in ray.get(send(11, 3.0), timeout=60)} == {11}
    assert_same(ray.get(receiver.state.remote()), weights(3.0))


def _sent_while_held(hub, sends, other, gate, held) -> list:
    """Each of ``sends`` (a broadcast with ``wait=False``), after ``other`` applied the
    one before, while a receiver is held in a method (``held``, until ``gate`` opens);
    then the receiver let go, every broadcast's report."""
    tickets = []
    for send in sends:
        tickets.append(ray.get(send()))
        wait_until(
            lambda v=tickets[-1].version: ray.get(other.version.remote()) == v,
            what=f"the free receiver applies version {tickets[-1].version}",
        )
    waiting = [hub.wait_for.remote(t) for t in tickets]
    ray.get(gate.open.remote())
    ray.get(held)
    return ray.get(waiting, timeout=60)


def test_a_receiver_busy_in_a_long_method_holds_no_slot_per_version_broadcast(actors):
    """A default actor on the learner's node, busy in a long method: the learner calls
    it while one of its calls runs; the hub's deliveries of the later versions wait for
    it to return, and each one's plan held its version's slot for it meanwhile.
    After a few versions the learner's slots ran out: every broadcast, to every
    receiver, waited for a slot and failed. Now a delivery that waits holds nothing,
    the newest goes once the receiver is free, and every version is acked by both."""
    hub = start_hub(actors, TRANSPORT)
    holder = start(actors, Holder, hub, special_weights(0.0), "busy")
    other = start(actors, Holder, hub, special_weights(0.0), "other")
    ready([holder, other])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))  # its route comes back
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)
    weights = [special_weights(float(v)) for v in range(2, 4 + 2 * MAX_SLOTS)]
    sends = [lambda w=w: hub.broadcast.remote(w, model="m", wait=False) for w in weights]
    reports = _sent_while_held(hub, sends, other, gate, busy)
    assert [r.version for r in reports] == list(range(2, 4 + 2 * MAX_SLOTS))
    assert all(r.failed == {} and r.acked == ("busy", "other") for r in reports)
    assert ray.get(holder.applied_versions.remote()) == [1, 2, reports[-1].version]
    assert_bitwise(ray.get(holder.state.remote()), weights[-1])
    wait_until(
        lambda: "worker/busy" not in _holds(hub), what="no slot held for the receiver once free"
    )


def test_a_zero_copy_receiver_busy_in_a_long_method_leaves_the_learner_a_slot(actors):
    """A zero-copy receiver on the learner's node lives in one slot; busy in a long
    method, each call queued for it holds another. With two of the learner's calls
    queued and the latest, every slot of four was held: the next broadcast, to every
    receiver, waited 60 s for a slot and failed. The learner calls it while one of its
    calls runs; the rest wait in the hub holding nothing."""
    hub = start_hub(actors, TRANSPORT)
    busy = start(actors, Collector, hub, worker_id="busy", zero_copy=True)
    other = start(actors, Collector, hub, worker_id="other")
    ready([busy, other])
    learner = make_policy()
    ray.get(hub.broadcast.remote(learner, model="policy"))  # its route comes back
    gate = start(actors, Gate)
    held = hold_until_opened(actors, busy, gate)
    sent = []

    def send(value: float) -> ray.ObjectRef:
        with torch.no_grad():
            for p in learner.parameters():
                p.fill_(value)
        sent.append(state_of(learner))
        return hub.broadcast.remote(learner, model="policy", wait=False)

    sends = [lambda v=v: send(float(v)) for v in range(2, 4 + 2 * MAX_SLOTS)]
    reports = _sent_while_held(hub, sends, other, gate, held)
    assert all(r.failed == {} and r.acked == ("busy", "other") for r in reports)
    assert ray.get(busy.version.remote()) == reports[-1].version
    assert_bitwise(ray.get(busy.state.remote()), sent[-1])


def test_receivers_busy_from_different_versions_leave_the_learner_a_slot(actors, monkeypatch):
    """Three collectors on the learner's node, busy in their rollouts from different
    versions on, each hold the slot of the learner's call queued for them (versions 2,
    3 and 4), and the latest is held for everyone: every one of the learner's four
    slots. Its next version waited the slot wait and failed every receiver's broadcast,
    the free receiver's too. The owner's pool now grows by the slots held only for
    receivers: every broadcast is acked by the free receiver, and once the others are
    let go each ends on the latest version, bitwise, and the pool shrinks back."""
    monkeypatch.setattr(shm_learner, "SLOT_WAIT_S", 5.0)  # the learner is this process
    hub = start_hub(actors, TRANSPORT)
    names = ("busy 1", "busy 2", "busy 3")
    busy = [start(actors, Holder, hub, special_weights(0.0), name) for name in names]
    free = start(actors, Holder, hub, special_weights(0.0), "free")
    ready([*busy, free])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))  # its route comes back
    gate = start(actors, Gate)
    versions = range(2, 5 + 2 * MAX_SLOTS)
    weights = {version: special_weights(float(version)) for version in versions}
    tickets, held = [], []

    def send(version: int) -> None:
        tickets.append(ray.get(hub.broadcast.remote(weights[version], model="m", wait=False)))
        wait_until(
            lambda: ray.get(free.version.remote()) == tickets[-1].version,
            what=f"the free receiver applies version {tickets[-1].version}",
        )

    for receiver, version in zip(busy, versions, strict=False):
        held.append(hold_until_opened(actors, receiver, gate))
        send(version)  # its call, queued behind the rollout, holds this version's slot
    wait_until(
        lambda: {f"worker/{name}" for name in names} <= set(_holds(hub)),
        what="each busy receiver's queued call holds its version's slot",
    )
    for version in versions[len(busy) :]:
        send(version)
    # Each receiver holds one slot at most beyond the pool's four: a busy one its
    # queued call's (the hub keeps one call per receiver and model, the later versions
    # wait in it holding nothing), the free one the version it has not released yet.
    receivers = len(busy) + 1
    assert ray.get(_owner(hub).stats.remote()).segments <= MAX_SLOTS + receivers

    waiting = [hub.wait_for.remote(ticket) for ticket in tickets]
    ray.get(gate.open.remote())
    ray.get(held)
    reports = ray.get(waiting, timeout=60)
    assert [r.version for r in reports] == list(versions)
    assert all("free" in r.acked for r in reports), reports
    for receiver in (*busy, free):
        wait_until(
            lambda receiver=receiver: ray.get(receiver.version.remote()) == versions[-1],
            what="every receiver on the latest version",
        )
        assert_bitwise(ray.get(receiver.state.remote()), weights[versions[-1]])
    wait_until(
        lambda: ray.get(_owner(hub).stats.remote()).segments <= MAX_SLOTS,
        what="the pool shrunk back once the busy receivers let go",
    )


def test_a_host_busy_past_its_catch_up_call_pins_no_slot_per_beat(actors):
    """The hub forgot a receiver while its host is busy in a long method: its hub watch
    registers again and the version the hub offers waits behind the method. Each later
    beat asked the hub for the latest version again, which held that version's slot for
    the receiver, and handed it back unread: every version broadcast meanwhile stayed
    held for good (the learner's slots ran out). Once the host is free, the receiver
    holds nothing but what it has not read yet."""
    hub = start_hub(actors, TRANSPORT)
    holder = start(actors, BeatCountingHolder, hub, special_weights(0.0), "busy", 0.2)
    other = start(actors, Holder, hub, special_weights(0.0), "other")
    ready([holder, other])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    ray.get(hub.broadcast.remote(special_weights(2.0), model="m", workers=["other"]))
    token = ray.get(holder.token.remote())
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)
    ray.get(hub.actor.leave.remote("busy", token))  # its watch registers again
    for value in (3.0, 4.0, 5.0):
        beats = ray.get(holder.beats_so_far.remote())
        wait_until(  # the first waits the offered version's 5 s call timeout
            lambda beats=beats: ray.get(holder.beats_so_far.remote()) >= beats + 3,
            timeout_s=60,
            what="three hub-watch beats while the host is busy",
        )
        ray.get(hub.broadcast.remote(special_weights(value), model="m", workers=["other"]))
    ray.get(gate.open.remote())
    ray.get(busy)
    wait_until(
        lambda: {r.worker: r.versions for r in ray.get(hub.status.remote()).receivers}
        == {"busy": {"m": 5}, "other": {"m": 5}},
        what="the hub's books say both hold version 5",
    )
    assert_bitwise(ray.get(holder.state.remote()), special_weights(5.0))
    wait_until(
        lambda: "worker/busy" not in _holds(hub), what="no slot held for the caught-up receiver"
    )
    assert sorted(_holds(hub)) == ["latest/m", "pending"]  # and the slot asked for ahead


def test_a_duplicate_delivery_leaves_the_slot_a_zero_copy_model_lives_in_held(actors):
    """The hub delivers a version again after a call it lost (a version applied already
    acks as superseded). The receiver turned it down unread and released its slot: the
    one its zero-copy model lives in, whose hold then went, so the learner could write a
    later version into the running model."""
    hub = start_hub(actors, TRANSPORT)
    receiver = start(actors, Collector, hub, worker_id="zc", zero_copy=True)
    other = start(actors, Collector, hub, worker_id="other")
    ready([receiver, other])
    weights = make_policy()
    ray.get(hub.broadcast.remote(weights))
    assert "worker/zc" in _holds(hub)  # its model lives in the slot
    attachment = ray.get(
        receiver.__ray_call__.remote(lambda r: r._raysync_receiver.core.identity.attachment)
    )
    latest = ray.get(hub.latest.remote("policy"))
    duplicate = ray.get(delivery_call(receiver, Entry.MIXIN_METHOD, attachment, latest))
    assert duplicate.status.value == "superseded"
    assert "worker/zc" in _holds(hub)
    for _ in range(2 * MAX_SLOTS):  # the learner's slots go round
        ray.get(hub.broadcast.remote(make_policy(), workers=["other"]))
    assert_same(ray.get(receiver.state.remote()), state_of(weights))


@ray.remote(num_cpus=0)
class AsyncHolder(WeightReceiver):
    """An async receiver of a state_dict: versions that arrive while ``hold`` runs wait
    for it to return (deferred at the gate), their data staged in the slot."""

    def __init__(self, hub, template: dict[str, torch.Tensor], worker_id: str, heartbeat_s):
        self.sd = {k: torch.zeros_like(v) for k, v in template.items()}
        self.connect_hub(hub, models={"m": "sd"}, worker_id=worker_id, heartbeat_s=heartbeat_s)

    async def hold(self, entered, leave) -> None:
        await entered.open.remote()
        await leave.wait.remote()

    async def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.sd.items()}


def _busy_beside_other(actors):
    """A hub, an async receiver ``busy`` (returned) and a receiver ``other``, both
    holding version 1 of model ``m``, ``special_weights(1.0)``."""
    hub = start_hub(actors, TRANSPORT)
    template = special_weights(0.0)
    busy = start(actors, AsyncHolder, hub, template, "busy", 0.2)
    other = start(actors, Holder, hub, template, "other")
    ready([busy, other])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    return hub, busy


def _slots_go_round(hub) -> None:
    """Versions 3 on, to ``other`` alone, until the learner wrote each of its slots again."""
    for value in range(3, MAX_SLOTS + 5):
        sent = hub.broadcast.remote(special_weights(float(value)), model="m", workers=["other"])
        assert ray.get(sent, timeout=60).acked == ("other",)


def test_a_version_staged_before_registering_again_stays_held_until_it_is_copied(actors):
    """The hub forgets a receiver whose async method runs while version 2 waits at its
    gate: its hub watch registers again, and the welcome's catch-up fetches version 2
    anew (held for it again), taking the staged one's place at the gate. Releasing the
    staged one (the transport receiver of the registration replaced) let go of the
    owner's one hold for the receiver, the catch-up's: once a newer version took the
    latest hold, the learner wrote later versions into the slot, and the receiver
    copied those bytes in as version 2 when its method returned."""

    def registration_and_deferred(receiver) -> tuple[str, list[tuple[int, str]]]:
        """(Run in ``busy``; defined here, so that Ray ships it by value.) Its
        registration's token and, for each version waiting at its gate, the version and
        the token that version is acked to."""
        core = receiver._raysync_receiver.core
        waiting = [p.apply.args for p in core.gate._deferred]
        return core.token, [(update.version, token) for update, _, _, token in waiting]

    def seen() -> tuple[str, list[tuple[int, str]]]:
        return ray.get(busy.__ray_call__.remote(registration_and_deferred))

    hub, busy = _busy_beside_other(actors)
    entered, leave = start(actors, Gate), start(actors, Gate)
    holding = busy.hold.remote(entered, leave)
    ray.get(entered.wait.remote())
    hub.broadcast.remote(special_weights(2.0), model="m", wait=False)
    token, _ = wait_until(
        lambda: (found := seen())[1] and found, what="version 2 waiting at busy's gate"
    )
    ray.get(hub.actor.leave.remote("busy", token))  # its watch registers again
    wait_until(
        lambda: (found := seen())[0] != token and found[1] == [(2, found[0])],
        what="the catch-up's version 2 waiting in the staged one's place",
    )
    _slots_go_round(hub)
    ray.get(leave.open.remote())
    ray.get(holding)
    assert_bitwise(ray.get(busy.state.remote()), special_weights(2.0))


def test_a_version_whose_hold_was_lost_while_staged_is_not_applied(actors):
    """The hub forgets a receiver (its heartbeats stopped) while version 2 waits at its
    gate, staged in the learner's slot: the owner lets go of its holds, the learner's
    slots go round and another version is written into that slot. The receiver's method
    returns before it could register again: the slot's bytes were copied in as version 2
    (another version's, silently). The slot's header now says it was rewritten: version 2
    fails there and the model keeps version 1."""

    def deferred(receiver) -> tuple[str, list[int]]:
        """(Run in ``busy``.) Its registration's token and the versions at its gate."""
        core = receiver._raysync_receiver.core
        return core.token, [p.apply.args[0].version for p in core.gate._deferred]

    hub, busy = _busy_beside_other(actors)
    ray.get(busy.__ray_call__.remote(cut_off_heartbeats))  # it cannot register again
    entered, leave = start(actors, Gate), start(actors, Gate)
    holding = busy.hold.remote(entered, leave)
    ray.get(entered.wait.remote())
    hub.broadcast.remote(special_weights(2.0), model="m", wait=False)
    token, _ = wait_until(
        lambda: (found := ray.get(busy.__ray_call__.remote(deferred)))[1] == [2] and found,
        what="version 2 waiting at busy's gate",
    )
    ray.get(hub.actor.leave.remote("busy", token))  # as when its heartbeats stopped
    wait_until(lambda: not any("busy" in h for h in _holds(hub)), what="busy's holds let go")
    _slots_go_round(hub)
    ray.get(leave.open.remote())
    ray.get(holding)
    assert_bitwise(ray.get(busy.state.remote()), special_weights(1.0))


def test_a_driver_zero_copy_receiver_that_stops_beating_keeps_the_slot_its_model_lives_in(
    actors,
):
    """A driver's (or task's) receiver has no actor Ray could say is alive: the hub
    forgets it once its heartbeats lapse, and the owner let go of its holds with it,
    among them the slot its zero-copy model lives in. The learner's slots went round
    and wrote later versions into the model under it. The holds stay until it
    registers again."""
    hub = start_hub(actors, TRANSPORT, models=["policy"])
    mine = make_policy()
    receiver = raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=0.2, zero_copy=True)
    try:
        ray.get(hub.broadcast.remote(filled(mine, 1.0), model="policy", timeout_s=30))
        assert receiver.pull() == {"policy": 1}
        cut_off_heartbeats(SimpleNamespace(_raysync_receiver=receiver))
        wait_until(lambda: ray.get(hub.status.remote()).receivers == (), what="the hub forgot it")
        for value in range(2, MAX_SLOTS + 5):
            ray.get(hub.broadcast.remote(filled(mine, float(value)), model="policy", timeout_s=30))
        assert_same(state_of(mine), filled(mine, 1.0))
    finally:
        receiver.close()


def test_pulls_that_gave_up_on_the_hub_leave_the_learner_its_slots(actors):
    """A pull receiver stops waiting for its hub (the pull timed out); the hub answers
    all the same, the version's slot held for it. Nothing read that answer: each such
    pull kept one of the learner's slots, and once they all were, the learner's next
    broadcast waited out its slot wait and failed. Each late answer is declined as it
    comes, and the puller's next pull reads the latest version. (A pull the hub answered
    all the same, its thread descheduled between the call and the wait on a busy
    machine, read its version: the next version is pulled again.)"""
    hub = start_hub(actors, TRANSPORT)
    puller = start(actors, Collector, hub, worker_id="puller", mode="pull")
    ready([puller])
    gave_up = sent = 0
    while gave_up < 2 * MAX_SLOTS:
        assert sent < 4 * MAX_SLOTS, f"only {gave_up} of {sent} pulls gave up"
        learner = make_policy()
        assert ray.get(hub.broadcast.remote(learner), timeout=60).acked == ()
        sent += 1
        outcome = ray.get(puller.__ray_call__.remote(pull_giving_up_at_once))
        assert outcome in ("GetTimeoutError", "answered")
        gave_up += outcome == "GetTimeoutError"
    wait_until(lambda: "worker/puller" not in _holds(hub), what="every late answer declined")
    assert ray.get(puller.pull.remote()) == {"policy": sent}
    assert_same(ray.get(puller.state.remote()), state_of(learner))
