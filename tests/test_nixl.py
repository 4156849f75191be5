"""The NIXL transport: buffer reuse, re-handshakes, and peers killed mid-read."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import sys
import threading
import time

import pytest
import ray
import torch

from raysync import BroadcastReport, TransportUnavailableError, WeightHub
from raysync.copies import copy_on_this_thread
from raysync.spec import WeightSpec
from raysync.transports import HubContext, TransportError, VersionDone
from raysync.transports.buckets import BucketPlan
from raysync.transports.nixl import NixlReceiver, NixlSender, NixlTransport
from raysync.transports.nixl import receiver as nixl_receiver
from raysync.transports.nixl.agent import new_agent
from raysync.transports.nixl.progress import SourceProgress
from tests.helpers import (
    Gate,
    actor_pid,
    assert_same,
    ready,
    start,
    start_hub,
    wait_for_file,
    wait_process_exit,
    wait_until,
)
from tests.nixl_actors import (
    BigCollector,
    HashingCollector,
    Learner,
    StallingBigCollector,
    big_model,
    digest,
)
from tests.receivers import Collector, Holder, make_policy, state_of

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        not NixlTransport.availability().available,
        reason=f"nixl unavailable: {NixlTransport.availability().reason}",
    ),
]


def _wait_restarted(handle, old_pid: int, timeout_s: float = 60.0) -> None:
    """Until the restarted actor answers (its __init__ has reconnected to the hub). The
    old process may still answer right after ``ray.kill``, so wait for a new pid."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if actor_pid(handle) != old_pid:
                return
        except ray.exceptions.ActorUnavailableError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the actor did not restart within {timeout_s:g} s")
        time.sleep(0.2)


def _report(hub, ticket, timeout_s: float) -> BroadcastReport:
    return ray.get(hub.wait_for.remote(ticket, raise_on_failure=False), timeout=timeout_s)


# -- the sender and receiver halves in one process (no Ray) ------------------------------


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {
        "a": torch.full((1000,), value),
        "b": torch.full((3, 5), value, dtype=torch.float64),
        "c": torch.tensor([True, False]),
        "d": torch.arange(7, dtype=torch.int16) + int(value),
    }


def _named(spec: WeightSpec, staged) -> dict[str, torch.Tensor]:
    """A fetch's staged tensors by name."""
    return dict(zip(spec.names, staged, strict=True))


def _assert_reads(receiver: NixlReceiver, payload, spec: WeightSpec, expected) -> None:
    """``receiver`` fetches ``payload`` as ``expected`` bitwise, then lets it go."""
    staged = receiver.fetch(payload, spec)
    assert_same(_named(spec, staged), expected)
    receiver.release(payload, staged)


def _publish(
    sender: NixlSender, weights: dict[str, torch.Tensor], spec: WeightSpec, model: str = "m"
):
    """What a HubHandle does: ``send``, hand the payload over, then ``submitted`` writes."""
    payload = sender.send(weights, spec, model)
    sender.submitted(payload, None)
    return payload


def test_overwritten_buffer_is_detected_never_returned():
    """The stamp rule: a payload whose buffer was written again fails; the latest reads."""
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        spec = WeightSpec.of(_weights(0.0))
        payloads = [_publish(sender, _weights(float(v)), spec) for v in (1, 2, 3)]
        # Buffers alternate: version 3 went into version 1's buffer.
        assert payloads[2].region == payloads[0].region != payloads[1].region
        with pytest.raises(TransportError, match="overwrote its buffer"):
            receiver.fetch(payloads[0], spec)
        for payload, value in ((payloads[1], 2.0), (payloads[2], 3.0)):
            _assert_reads(receiver, payload, spec, _weights(value))
    finally:
        receiver.close()
        sender.close()


def test_a_sender_opened_again_never_repeats_a_stamp_of_the_one_before():
    """A learner that releases its hub closes its sender; the next broadcast opens a new
    one, whose buffers may sit at the old ones' addresses. Its stamps began at 1 again,
    so a reader of the old sender's version (a late joiner's, a pull's) could take a
    new version's bytes, stamped alike, for it."""
    spec = WeightSpec.of(_weights(0.0))
    first = NixlSender()
    try:
        before = [_publish(first, _weights(1.0), spec).stamp for _ in range(2)]
    finally:
        first.close()
    again = NixlSender()
    try:
        after = _publish(again, _weights(2.0), spec).stamp
    finally:
        again.close()
    assert after > max(before)


def test_a_models_latest_version_is_not_written_over_by_another_model_of_its_spec():
    """Two models of one spec (a policy and its reference copy), broadcast a, b, a, a:
    b's latest stays readable (for late joiners) in a buffer of b's own."""
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        spec = WeightSpec.of(_weights(0.0))
        b_latest = None
        for model, value in (("a", 1), ("b", 2), ("a", 3), ("a", 4)):
            payload = _publish(sender, _weights(float(value)), spec, model)
            if model == "b":
                b_latest = payload
        _assert_reads(receiver, b_latest, spec, _weights(2.0))
    finally:
        receiver.close()
        sender.close()


class _Never(VersionDone):
    """A broadcast that never ends (the test plays the hub)."""

    def wait(self, timeout_s: float) -> None:
        raise TimeoutError


def test_a_ring_slot_written_again_is_detected_never_applied(actors):
    """A reader that took bucket 0 of a bucketed version and was then dropped (it held
    the others up) reads it only after the learner's ring moved on to the next version:
    the slot's stamp says so, and the read fails instead of staging another version's
    bytes. The test plays the hub's planner (it names the readers at the broker)."""
    hub = start_hub(actors, "nixl")
    sender = NixlSender(HubContext(hub.actor, hub.config.hub_id))
    receiver = NixlReceiver("slow")
    weights = {"a": torch.arange(3000, dtype=torch.float32)}
    spec = WeightSpec.of(weights)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = sender.send_buckets(weights, spec, 1024, stall_s=30.0)
            ray.get(first.broker.readers.remote(first.key, ["slow"]))
            streaming = pool.submit(sender.submitted, first, _Never())
            boxed, why = ray.get(first.broker.take.remote(first.key, 0, "slow"))
            assert why is None
            ray.get(first.broker.drop_reader.remote("slow"))  # the hub drops it
            streaming.result(timeout=30)  # no reader left: the learner stops the version
            second = sender.send_buckets({"a": -weights["a"]}, spec, 1024, stall_s=30.0)
            ray.get(first.broker.readers.remote(second.key, ["other"]))
            streaming = pool.submit(sender.submitted, second, _Never())
            again, why = ray.get(second.broker.take.remote(second.key, 0, "other"))
            assert why is None and again[0].slot == boxed[0].slot  # the same slot, rewritten
            plan = BucketPlan.of(spec, 1024)
            staging = receiver._ring_pool._take(spec)  # outside a fill: a probe
            receiver._load(first.agent, first.metadata, first.registration)
            with pytest.raises(TransportError, match="wrote the ring slot of bucket 0"):
                receiver._read_ring_bucket(first, staging, plan, 0, boxed[0])
            receiver._read_ring_bucket(second, staging, plan, 0, again[0])  # the current one
            bucket = staging.views[0][: 1024 // 4].cpu()  # VRAM where the machine has CUDA
            assert torch.equal(bucket, -weights["a"][: 1024 // 4])
            ray.get(second.broker.end.remote(second.key, "the test is over"))
            streaming.result(timeout=30)
    finally:
        receiver.close()
        sender.close()


def test_agents_are_quiet_unless_raysync_logs_at_debug(monkeypatch):
    """nixl prints INFO lines on stdout in every process with an agent; raysync keeps
    them out unless its own logger is at DEBUG (``NIXL_LOG_LEVEL`` set by a user wins)."""
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    nixl_logger, raysync_logger = logging.getLogger("nixl"), logging.getLogger("raysync")
    levels = nixl_logger.level, raysync_logger.level
    seen = _Collect()
    nixl_logger.addHandler(seen)  # beside nixl's own stdout handler: what reaches it
    try:
        new_agent("quiet")
        assert not any("Initialized NIXL agent" in m for m in seen.messages), seen.messages
        raysync_logger.setLevel(logging.DEBUG)
        new_agent("loud")
        assert any("Initialized NIXL agent" in m for m in seen.messages), seen.messages
    finally:
        nixl_logger.removeHandler(seen)
        nixl_logger.setLevel(levels[0])
        raysync_logger.setLevel(levels[1])


def test_agents_let_cuda_ipc_serve_reads_unless_the_user_said_otherwise(monkeypatch):
    """Without NVLink UCX turns cuda_ipc GETs off and VRAM READs fall back to TCP (0.25
    GiB/s on one H100): agents in a process that sees CUDA start with them on (without
    CUDA the variable is left unset: UCX would print that it is unused); a value the user
    set is kept."""
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    new_agent("gets")
    expected = "on" if torch.cuda.is_available() else None
    assert os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == expected
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "off")
    new_agent("user")
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_receiver_keeps_only_the_learner_agents_it_read_last(monkeypatch):
    """A learner that released its side or restarted is a new agent, and never says the
    old one is gone: the receiver forgets the least recently read past AGENTS_KEPT
    (metadata and prepared READs), and loads one again if it comes back."""
    monkeypatch.setattr(nixl_receiver, "AGENTS_KEPT", 2)
    senders, receiver = [NixlSender() for _ in range(3)], NixlReceiver()
    try:
        spec = WeightSpec.of(_weights(0.0))

        def read(sender: NixlSender, value: float) -> None:
            payload = _publish(sender, _weights(value), spec)
            _assert_reads(receiver, payload, spec, _weights(value))

        for value, sender in enumerate(senders, start=1):
            read(sender, float(value))
        agents = [sender._agent.name for sender in senders]
        assert list(receiver._sources) == agents[1:]
        prepared = {key[0] for s in receiver._pool.created() for key in s.reads}
        assert prepared <= set(agents[1:])
        read(senders[0], 4.0)  # forgotten, then back: loaded again
        assert list(receiver._sources) == [agents[2], agents[0]]
    finally:
        receiver.close()
        for sender in senders:
            sender.close()


def test_a_payload_of_an_earlier_registration_is_read_with_the_metadata_loaded():
    """A learner's metadata only grows: a receiver that loaded a later registration
    reads an earlier one's buffers without loading the older metadata again."""
    sender, receiver = NixlSender(), NixlReceiver()
    loads = []
    add_remote_agent = receiver._agent.add_remote_agent
    receiver._agent.add_remote_agent = lambda metadata: loads.append(add_remote_agent(metadata))
    try:
        small, large = _weights(1.0), {"w": torch.arange(64.0)}
        earlier = _publish(sender, small, WeightSpec.of(small))
        later = _publish(sender, large, WeightSpec.of(large))  # registers a second pair
        assert later.registration > earlier.registration
        for payload, weights in ((later, large), (earlier, small)):
            spec = WeightSpec.of(weights)
            _assert_reads(receiver, payload, spec, weights)
        assert len(loads) == 1
    finally:
        receiver.close()
        sender.close()


def test_a_buffer_another_thread_sent_into_is_written_before_it_is_taken():
    """Three sends of one spec before the first is written (three threads): the third,
    which takes the first's buffer, waits until the first is written; the first is
    not lost (its ``submitted`` raised 'was not sent here'), and a version abandoned
    instead frees its buffer at once, its readers told."""
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        spec = WeightSpec.of(_weights(0.0))
        first = sender.send(_weights(1.0), spec, "m")
        second = sender.send(_weights(2.0), spec, "m")
        sender.submitted(second, None)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            third = pool.submit(sender.send, _weights(3.0), spec, "m")
            deadline = time.monotonic() + 30
            while not sender._written._waiters:  # type: ignore[attr-defined]
                assert not third.done(), "the third send took a buffer not yet written"
                assert time.monotonic() < deadline
                time.sleep(0.001)  # polling a condition: nothing to wait on
            sender.submitted(first, None)
            third_payload = third.result(timeout=30)
        assert third_payload.region == first.region
        sender.submitted(third_payload, None)
        for payload, value in ((second, 2.0), (third_payload, 3.0)):
            _assert_reads(receiver, payload, spec, _weights(value))
        fourth = sender.send(_weights(4.0), spec, "m")
        sender.abandoned(fourth, "the broadcast failed")
        with pytest.raises(TransportError, match="failed while writing stamp"):
            receiver.fetch(fourth, spec)
        fifth = _publish(sender, _weights(5.0), spec)  # took the fourth's buffer at once
        _assert_reads(receiver, fifth, spec, _weights(5.0))
    finally:
        receiver.close()
        sender.close()


def test_a_buffer_being_written_is_never_taken_however_long_the_write(monkeypatch):
    """A send that gives up waiting for another thread's version (``WRITTEN_WAIT_S``)
    only ever takes a buffer that version was never written into: one whose write is
    under way (a multi-GB version) is waited for to its end. Taken mid-write, both
    versions were written at once, and a bucket could mix them under a stamp."""
    from raysync.transports.nixl import learner as nixl_learner

    sender, receiver = NixlSender(), NixlReceiver()
    writing, write_on = threading.Event(), threading.Event()

    def slow_copy(destination: torch.Tensor, source: torch.Tensor) -> None:
        writing.set()
        assert write_on.wait(30), "the test never let the write go on"
        copy_on_this_thread(destination, source)

    try:
        spec = WeightSpec.of(_weights(0.0))
        first = sender.send(_weights(1.0), spec, "m")
        sender.submitted(sender.send(_weights(2.0), spec, "m"), None)  # the other buffer
        monkeypatch.setattr(nixl_learner, "WRITTEN_WAIT_S", 0.05)
        monkeypatch.setattr(nixl_learner, "copy_on_this_thread", slow_copy)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            written = pool.submit(sender.submitted, first, None)
            assert writing.wait(30), "the first version's write did not start"
            third = pool.submit(sender.send, _weights(3.0), spec, "m")  # first's buffer
            try:
                with pytest.raises(concurrent.futures.TimeoutError):
                    third.result(timeout=1.0)  # 20 times the bound: still waiting
            finally:
                write_on.set()
            written.result(timeout=30)
            third_payload = third.result(timeout=30)
        assert third_payload.region == first.region
        sender.submitted(third_payload, None)
        _assert_reads(receiver, third_payload, spec, _weights(3.0))
    finally:
        write_on.set()
        receiver.close()
        sender.close()


class _Held(VersionDone):
    """A broadcast that ends when the test says so, and says when a send waits for it."""

    def __init__(self) -> None:
        self.waited, self.over = threading.Event(), threading.Event()

    def wait(self, timeout_s: float) -> None:
        if timeout_s > 0:  # a send waiting (``ended`` asks with 0)
            self.waited.set()
        if not self.over.wait(timeout_s):
            raise TimeoutError("still running")


def test_a_send_waiting_for_its_buffer_lets_other_versions_be_written():
    """Two models broadcast from two threads: model b's version is at the hub, unwritten,
    when the other thread's send of model a waits for the broadcast that last filled
    a's buffer, which a receiver reading in the hub's order ends only after it read b's.
    b's version is written meanwhile (``send`` waited under the lock ``submitted``
    takes: b stayed unwritten until a's broadcast timed out)."""
    sender, receiver = NixlSender(), NixlReceiver()
    a_spec, b_weights = WeightSpec.of(_weights(0.0)), {"w": torch.arange(10.0)}
    b_spec, a_first = WeightSpec.of(b_weights), _Held()
    try:
        b = sender.send(b_weights, b_spec, "b")  # handed to the hub, written later
        sender.submitted(sender.send(_weights(1.0), a_spec, "a"), a_first)
        _publish(sender, _weights(2.0), a_spec, "a")  # the pair's other buffer
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            third = pool.submit(sender.send, _weights(3.0), a_spec, "a")
            assert a_first.waited.wait(30), "the third send did not wait for the first's end"
            written = pool.submit(sender.submitted, b, None)
            try:
                written.result(timeout=30)
            finally:
                a_first.over.set()
            third_payload = third.result(timeout=30)
        _assert_reads(receiver, b, b_spec, b_weights)
        sender.submitted(third_payload, None)
        _assert_reads(receiver, third_payload, a_spec, _weights(3.0))
    finally:
        receiver.close()
        sender.close()


def test_staged_data_is_kept_until_released():
    """Two fetched updates waiting for one safe point do not share a staging buffer."""
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        spec = WeightSpec.of(_weights(0.0))
        first_payload = _publish(sender, _weights(1.0), spec)
        first = receiver.fetch(first_payload, spec)
        second = receiver.fetch(_publish(sender, _weights(2.0), spec), spec)
        assert_same(_named(spec, first), _weights(1.0))
        assert_same(_named(spec, second), _weights(2.0))
        receiver.release(first_payload, first)
        third = receiver.fetch(_publish(sender, _weights(3.0), spec), spec)
        assert third[0].data_ptr() == first[0].data_ptr()  # the released buffer is reused
        assert_same(_named(spec, second), _weights(2.0))
    finally:
        receiver.close()
        sender.close()


def test_a_read_that_timed_out_leaves_its_buffer_out_of_later_versions(monkeypatch):
    """A READ still running when its wait timed out may land late: its staging buffer
    is never filled again (the next versions are read into another)."""
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        weights = {"a": torch.full((1 << 20,), 1.0)}
        spec = WeightSpec.of(weights)
        monkeypatch.setattr(nixl_receiver, "READ_TIMEOUT_S", -1.0)  # any READ not done yet
        with pytest.raises(TransportError, match="did not finish within -1 s"):
            receiver.fetch(_publish(sender, weights, spec), spec)
        [aside] = receiver._pool.created()
        monkeypatch.undo()
        for value in (2.0, 3.0):
            payload = _publish(sender, {"a": torch.full((1 << 20,), value)}, spec)
            staged = receiver.fetch(payload, spec)
            assert_same(_named(spec, staged), {"a": torch.full((1 << 20,), value)})
            start = aside.tensor.data_ptr()
            assert not start <= staged[0].data_ptr() < start + aside.tensor.numel()
            receiver.release(payload, staged)
        assert len(receiver._pool.created()) == 2
    finally:
        receiver.close()
        sender.close()


def test_a_read_is_given_time_by_its_size(monkeypatch):
    """A version the learner has written is one READ of it all: a fixed limit failed
    every large model on a slow link, however long the broadcast's timeout. Here no
    fixed time at all, and a byte a second: the READs of 4 MB are waited for."""
    monkeypatch.setattr(nixl_receiver, "READ_TIMEOUT_S", 0.0)
    monkeypatch.setattr(nixl_receiver, "READ_FLOOR_BYTES_PER_S", 1.0)
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        weights = {"a": torch.full((1 << 20,), 5.0)}
        spec = WeightSpec.of(weights)
        _assert_reads(receiver, _publish(sender, weights, spec), spec, weights)
    finally:
        receiver.close()
        sender.close()


def test_reader_follows_the_learner_bucket_by_bucket(monkeypatch):
    """A READ posted before the learner wrote the version waits for each bucket and
    gets the whole version; a learner that fails while writing fails its reader."""
    from raysync.transports.nixl import wire

    monkeypatch.setattr(wire, "BUCKET_BYTES", 1024)  # several buckets for a small model
    wire.Frame.of.cache_clear()
    sender, receiver = NixlSender(), NixlReceiver()
    big = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(5, dtype=torch.int64)}
    spec = WeightSpec.of(big)
    try:
        assert len(wire.Frame.of(spec).buckets) > 5
        payload = sender.send(big, spec, "m")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fetched = pool.submit(receiver.fetch, payload, spec)
            with pytest.raises(concurrent.futures.TimeoutError):
                fetched.result(timeout=0.3)  # nothing written yet: the reader waits
            sender.submitted(payload, None)
            staged = fetched.result(timeout=30)
        assert_same(_named(spec, staged), big)
        receiver.release(payload, staged)

        # Tensors that do not fill the spec break the pack part-way: a real failure.
        payload = sender.send({"a": torch.zeros(10), "b": big["b"]}, spec, "m")
        with pytest.raises(ValueError):  # numpy's, from the pack's copy
            sender.submitted(payload, None)
        with pytest.raises(TransportError, match="failed while writing"):
            receiver.fetch(payload, spec)
    finally:
        receiver.close()
        sender.close()
        wire.Frame.of.cache_clear()


def test_a_reader_reads_what_is_written_then_waits_for_the_rest(monkeypatch):
    """The learner stops before bucket 3 until the reader waits for it: the reader has
    read buckets 0-2 as written, reads the rest as they come and gets the version; a
    reader that looks after the learner is done reads it in one request."""
    from raysync.transports.nixl import learner, wire

    monkeypatch.setattr(wire, "BUCKET_BYTES", 1024)
    wire.Frame.of.cache_clear()
    sender, receiver = NixlSender(), NixlReceiver()
    big = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(5, dtype=torch.int64)}
    spec = WeightSpec.of(big)
    frame = wire.Frame.of(spec)
    awaited: list[int] = []
    reader_at_bucket_3 = threading.Event()
    await_buckets = receiver._await_buckets

    def recording(read, index, payload, stamps):
        awaited.append(index)
        if index == 3:
            reader_at_bucket_3.set()
        return await_buckets(read, index, payload, stamps)

    monkeypatch.setattr(receiver, "_await_buckets", recording)
    try:
        payload = sender.send(big, spec, "m")
        bucket_3_at = payload.region.address + frame.buckets[3][0]

        def copy_after_the_reader_waits(destination, source):
            if destination.data_ptr() >= bucket_3_at:
                assert reader_at_bucket_3.wait(30), "the reader never waited for bucket 3"
            copy_on_this_thread(destination, source)

        monkeypatch.setattr(learner, "copy_on_this_thread", copy_after_the_reader_waits)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fetched = pool.submit(receiver.fetch, payload, spec)
            sender.submitted(payload, None)
            staged = fetched.result(timeout=30)
        assert len(frame.buckets) > 5 and 3 in awaited
        assert_same(_named(spec, staged), big)
        receiver.release(payload, staged)

        awaited.clear()
        staged = receiver.fetch(payload, spec)  # written whole by now
        assert awaited == [0]
        assert_same(_named(spec, staged), big)
        receiver.release(payload, staged)
    finally:
        receiver.close()
        sender.close()
        wire.Frame.of.cache_clear()


def test_unavailable_nixl_fails_fast_with_one_line(ray_cluster, monkeypatch):
    from raysync.transports import nixl

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # "import nixl._api" now fails
    nixl.nixl_availability.cache_clear()
    try:
        availability = NixlTransport.availability()
        assert not availability.available
        assert "nixl package is not installed" in availability.reason
        assert "\n" not in availability.reason
        with pytest.raises(TransportUnavailableError, match="'nixl' is not available"):
            WeightHub.remote(transport="nixl")
    finally:
        nixl.nixl_availability.cache_clear()


# -- end to end ----------------------------------------------------------------------------


def test_back_to_back_broadcasts_never_tear(actors):
    """Many broadcasts in flight over two buffers: every applied version is bitwise one
    the learner sent, and every receiver ends on the last."""
    hub = start_hub(actors, "nixl")
    receivers = [start(actors, HashingCollector, hub) for _ in range(3)]
    ready(receivers)
    sent: dict[int, str] = {}
    tickets = []
    for _ in range(16):
        weights = state_of(make_policy())
        ticket = ray.get(hub.broadcast.remote(weights, wait=False))
        sent[ticket.version] = digest(weights)
        tickets.append(ticket)
    reports = [_report(hub, t, 60) for t in tickets]
    assert all(r.failed == {} for r in reports), [r.failed for r in reports if r.failed]
    last = max(sent)
    for receiver in receivers:
        seen = ray.get(receiver.seen.remote())
        assert max(seen) == last
        for version, applied in seen.items():
            assert applied == sent[version], f"version {version} applied torn or wrong data"
        assert digest(ray.get(receiver.state.remote())) == sent[last]


def test_a_receiver_busy_past_its_timeouts_is_sent_the_latest_version_once_free(actors):
    """A receiver busy in a long method: its first timed-out call reads the learner's
    buffer late, written again since (the stamps fail the read); the later versions
    made it no call (each read late, failed or applied in turn, once it was free).
    Free again, it is sent the latest version."""
    hub = start_hub(actors, "nixl")
    busy = start(actors, Holder, hub, state_of(make_policy()), "busy")
    ready([busy])
    ray.get(hub.broadcast.remote(state_of(make_policy()), model="m"))
    gate, entered = start(actors, Gate), start(actors, Gate)
    blocked = busy.hold.remote(gate, entered)
    ray.get(entered.wait.remote())  # busy from now on (else version 2 may go first)
    for version in (2, 3, 4):
        weights = state_of(make_policy())
        sent = hub.broadcast.remote(weights, model="m", timeout_s=1.0, raise_on_failure=False)
        report = ray.get(sent, timeout=60)
        assert (report.version, set(report.failed)) == (version, {"busy"})
    ray.get(gate.open.remote())
    ray.get(blocked)
    wait_until(lambda: ray.get(busy.version.remote()) == 4, what="busy holds version 4")
    assert ray.get(busy.applied_versions.remote()) == [1, 4]
    assert_same(ray.get(busy.state.remote()), weights)


def test_restarted_and_new_receivers_handshake_again(actors):
    hub = start_hub(actors, "nixl")
    restarting = start(actors, Collector.options(max_restarts=1), hub, worker_id="r")
    ready([restarting])
    learner = make_policy()
    ray.get(hub.broadcast.remote(learner))
    old_pid = actor_pid(restarting)
    ray.kill(restarting, no_restart=False)
    _wait_restarted(restarting, old_pid)
    late = start(actors, Collector, hub, worker_id="late")
    # Both come up with a fresh agent and read the latest version from the same buffer.
    assert_same(ray.get(restarting.state.remote()), state_of(learner))
    assert_same(ray.get(late.state.remote()), state_of(learner))
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(-1)
    report = ray.get(hub.broadcast.remote(learner))
    assert report.acked == ("late", "r")
    for receiver in (restarting, late):
        assert_same(ray.get(receiver.state.remote()), state_of(learner))


def test_new_spec_registers_new_buffers_and_receivers_follow(actors):
    """A second model (a new spec) makes the learner register memory again; receivers
    load its metadata again and keep reading both models."""
    from tests.receivers import MultiModel

    hub = start_hub(actors, "nixl")
    receiver = start(actors, MultiModel, hub)
    ready([receiver])
    for _ in range(2):
        policy, critic = make_policy(), torch.nn.Linear(8, 1)
        ray.get(hub.broadcast.remote(policy, model="policy"))
        ray.get(hub.broadcast.remote(critic, model="critic"))
    assert_same(ray.get(receiver.state.remote("policy")), state_of(policy))
    assert_same(ray.get(receiver.state.remote("nets.critic")), state_of(critic))


def test_learner_killed_while_receivers_read_fails_the_broadcast_within_the_timeout(
    actors, tmp_path
):
    hub = start_hub(actors, "nixl")
    names = ("b0", "b1")
    receivers = [start(actors, StallingBigCollector, hub, n, str(tmp_path)) for n in names]
    ready(receivers)
    learner = Learner.remote(hub)
    actors.append(learner)
    first = ray.get(learner.broadcast.remote(1.0, 30))
    assert _report(hub, first, 45).ok  # version 1 everywhere: connections are up
    for name in names:  # version 2's fetches wait for the learner's death
        (tmp_path / f"stall-fetch-{name}").touch()
    ticket = ray.get(learner.broadcast.remote(2.0, 30))
    for name in names:
        wait_for_file(tmp_path / f"inside-fetch-{name}")
    learner_pid = actor_pid(learner)
    ray.kill(learner)
    wait_process_exit(learner_pid)  # a READ from a process still exiting would succeed
    for name in names:
        (tmp_path / f"stall-fetch-{name}").unlink()
    report = _report(hub, ticket, 45)
    assert set(report.failed) == set(names), report
    for worker, reason in report.failed.items():
        assert "TransportError" in reason and "learner agent raysync-learner-" in reason, (
            worker,
            reason,
        )
    for receiver in receivers:  # the failed version never reached the model
        assert ray.get(receiver.summary.remote()) == (1, 1.0, 1.0)
    # A new learner (the driver) reaches every receiver: they forgot the dead agent.
    weights = big_model()
    weights["w"].fill_(3.0)
    report = ray.get(hub.broadcast.remote(weights, model="big"))
    assert len(report.acked) == 2
    assert all(ray.get(r.summary.remote()) == (3, 3.0, 3.0) for r in receivers)


def test_killed_receiver_mid_read_leaves_the_others_and_the_learner_fine(actors):
    hub = start_hub(actors, "nixl")
    doomed = start(actors, BigCollector, hub, worker_id="doomed")
    survivor = start(actors, BigCollector, hub, worker_id="survivor")
    ready([doomed, survivor])
    weights = big_model()
    weights["w"].fill_(1.0)
    ticket = ray.get(hub.broadcast.remote(weights, model="big", wait=False, timeout_s=30))
    ray.kill(doomed)
    report = _report(hub, ticket, 45)
    assert report.acked == ("survivor",)
    assert "doomed" in report.failed
    assert ray.get(survivor.summary.remote()) == (1, 1.0, 1.0)
    weights["w"].fill_(2.0)
    report = ray.get(hub.broadcast.remote(weights, model="big"))
    assert report.acked == ("survivor",) and report.failed == {}
    assert ray.get(survivor.summary.remote()) == (2, 2.0, 2.0)


def test_over_tcp_alone_every_version_arrives_bitwise(actors):
    """UCX with TCP alone (hosts without cross-memory attach or RDMA): the learner's agent
    must answer every READ, which its progress thread does while a broadcast runs."""
    tcp_only = {"runtime_env": {"env_vars": {"UCX_TLS": "tcp,self"}}}
    hub = start_hub(actors, "nixl")
    receivers = [
        start(actors, BigCollector.options(**tcp_only), hub, worker_id=f"tcp{i}") for i in (0, 1)
    ]
    ready(receivers)
    learner = start(actors, Learner.options(**tcp_only), hub)
    for value in (1.0, 2.0, 3.0):
        report = _report(hub, ray.get(learner.broadcast.remote(value, 30)), 45)
        assert report.acked == ("tcp0", "tcp1") and report.failed == {}, report
        version = report.version
        for receiver in receivers:
            assert ray.get(receiver.summary.remote()) == (version, value, value)


class _Ends(VersionDone):
    def __init__(self) -> None:
        self.over = False

    def wait(self, timeout_s: float) -> None:
        if not self.over:
            raise TimeoutError("still running")


class _CountingAgent:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def get_new_notifs(self) -> dict:
        self.calls += 1
        return {}


def test_the_learner_agent_is_progressed_fast_only_while_its_broadcasts_run():
    owner = type("Owner", (), {})()
    agent = _CountingAgent()
    progress = SourceProgress(owner, agent)
    assert not progress.fast()
    first, second = _Ends(), _Ends()
    progress.serving(first)
    progress.serving(second)
    assert progress.fast()
    first.over = True
    assert progress.fast()  # the second still runs
    second.over = True
    assert not progress.fast()
    calls = agent.calls
    deadline = time.monotonic() + 10
    while agent.calls == calls and time.monotonic() < deadline:
        time.sleep(0.001)
    assert agent.calls > calls  # idle, it still progresses (connections, late joiners)
    del owner  # the thread ends with its owner
    gc.collect()
    deadline = time.monotonic() + 10
    thread = "raysync-nixl-progress-counting"
    while any(t.name == thread and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the progress thread outlived its owner"
        time.sleep(0.001)


# -- GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_weights_are_registered_as_vram_and_read_bitwise():
    sender, receiver = NixlSender(), NixlReceiver()
    try:
        weights = {k: v.cuda() for k, v in _weights(1.5).items()}
        spec = WeightSpec.of(weights)
        payload = _publish(sender, weights, spec)
        assert payload.region.mem_type == "VRAM"
        staged = receiver.fetch(payload, spec)
        assert all(t.is_cuda for t in staged)
        assert_same(_named(spec, staged), weights)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.gpu
def test_gpu_learner_to_gpu_receivers(actors):
    hub = start_hub(actors, "nixl")
    receivers = [start(actors, Collector.options(num_gpus=0.1), hub) for _ in range(2)]
    ready(receivers)
    learner = make_policy().cuda()
    report = ray.get(hub.broadcast.remote(learner))
    assert len(report.acked) == 2
    expected = {k: v.cpu() for k, v in state_of(learner).items()}
    for receiver in receivers:
        assert_same({k: v.cpu() for k, v in ray.get(receiver.state.remote()).items()}, expected)


@pytest.mark.gpu
def test_gpu_zero_copy_receiver_takes_the_vram_staging_as_its_model(actors):
    from tests.nixl_actors import cuda_policy

    hub = start_hub(actors, "nixl")
    receiver = start(
        actors, Collector.options(num_gpus=0.1), hub, model_factory=cuda_policy, zero_copy=True
    )
    ready([receiver])
    pointers = set()
    for _ in range(4):
        learner = make_policy().cuda()
        ray.get(hub.broadcast.remote(learner))
        expected = {k: v.cpu() for k, v in state_of(learner).items()}
        assert_same({k: v.cpu() for k, v in ray.get(receiver.state.remote()).items()}, expected)
        pointers.add(tuple(ray.get(receiver.data_ptrs.remote()).values()))
    assert len(pointers) == 2  # two VRAM staging buffers, the model living in each in turn
