"""ShmOwner (actors/shm_owner.py), driven as the plain class it is: a receiver's release
by call may reach the owner before the hub's hold for that version (the learner
delivers its slot itself and the hub books the holds after), and either order frees the
slot for that receiver and counts as a release by call."""

from __future__ import annotations

import os
import subprocess
import threading
from types import SimpleNamespace

import pytest

from raysync.actors.shm_owner import Hold, ShmOwner

PID = os.getpid()  # the owner runs in this process: its slots name this pid


@pytest.fixture
def owner():
    owner = ShmOwner("node", max_slots=2)
    yield owner
    owner.close()


def test_a_release_by_call_before_or_after_the_hubs_hold_frees_the_slot_and_is_counted(owner):
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")

    owner.release(PID, slot.seq, "early")  # done with it before the hub's hold came
    owner.deliver(PID, slot.seq, "m", ("early", "late"))
    assert owner.stats().holds == ("latest/m", "worker/late")
    assert owner.stats().release_calls == 1

    owner.release(PID, slot.seq, "late")
    stats = owner.stats()
    assert stats.holds == ("latest/m",)
    assert (stats.release_calls, stats.board_releases) == (2, 0)


def test_a_release_of_a_version_the_owner_no_longer_has_is_ignored(owner):
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, slot.seq, "m", ("w0",))

    owner.release(PID + 1, slot.seq, "w0")  # a slot of another (dead) owner's process
    owner.release(PID, slot.seq + 1, "w0")  # a sequence never given out here
    stats = owner.stats()
    assert stats.holds == ("latest/m", "worker/w0")
    assert stats.release_calls == 0


def test_the_latest_hold_follows_the_hubs_version_not_the_slots_order():
    """Two learners (or one learner's threads) take slots in one order and are
    versioned by the hub in another: the latest hold, which keeps the version late
    joiners and pulls are planned to read, stayed on the higher slot number (an older
    version), and the newest version's slot was handed out again."""
    from raysync.transports import TransportError

    owner = ShmOwner("node", max_slots=1)
    try:
        first = owner.acquire(4096, timeout_s=5.0, learner="a")  # versioned second
        second = owner.acquire(4096, timeout_s=5.0, learner="b")  # versioned first
        owner.deliver(PID, second.seq, "m", (), order=1, version=1)
        owner.deliver(PID, first.seq, "m", (), order=2, version=2)
        assert owner._by_seq[first.seq].holds == {Hold.latest("m")}
        assert owner._by_seq[second.seq].holds == set()
        owner.acquire(4096, timeout_s=5.0, learner="b")  # version 1's slot: free again
        with pytest.raises(TransportError, match=r"stayed held for 0.2 s by: latest/m;"):
            owner.acquire(4096, timeout_s=0.2, learner="a")  # version 2's slot: the latest
    finally:
        owner.close()


def test_a_slot_is_not_handed_out_while_the_owner_exports_it(monkeypatch):
    """The owner puts a version into the object store for other nodes outside its
    lock; if a newer version becomes the latest meanwhile, the exported slot has no
    other hold left, and must still not be written before the copy is made."""
    from raysync.actors import shm_owner

    owner = ShmOwner("node", max_slots=3)
    try:
        exported = owner.acquire(4096, timeout_s=5.0, learner="learner")
        owner.deliver(PID, exported.seq, "m", ())  # held as the latest version only
        during: dict[str, object] = {}

        def put(data: object) -> str:
            newer = owner.acquire(4096, timeout_s=5.0, learner="learner")
            owner.deliver(PID, newer.seq, "m", ())  # the latest now: the old one's hold goes
            during["holds"] = owner.stats().holds
            during["next"] = owner.acquire(4096, timeout_s=5.0, learner="learner")
            return "ref"

        monkeypatch.setattr(shm_owner.ray, "put", put)
        assert owner.export(PID, exported.seq) == ["ref"]
        assert during["next"].fd != exported.fd  # another slot: the exported one is held
        assert "exporting/1" in during["holds"]
        assert "exporting/1" not in owner.stats().holds  # and free again once copied
    finally:
        owner.close()


def test_a_relayed_slot_stays_held_until_its_receivers_hold_it(monkeypatch):
    """A second relay of the same model, whenever it comes while the first one copies
    and hands its slot over, must not take that slot (one slot: it would rewrite the
    first version under its receivers). Here it comes at each moment the first relay
    takes the owner's lock after its copy arrived, and finds no free slot."""
    import threading

    import numpy as np

    from raysync.actors import shm_owner
    from raysync.layout import HEADER_BYTES
    from raysync.transports.base import TransportError

    owner = ShmOwner("node", max_slots=1)
    nbytes = 4096
    copied = threading.Event()
    second: list[object] = []

    def get(ref: str) -> np.ndarray:
        copied.set()
        return np.full(nbytes - HEADER_BYTES, 1 if ref == "first" else 2, dtype=np.uint8)

    def relay_second() -> None:
        try:
            second.append(owner.relay(["second"], nbytes, "m", ("w2",), 0.2))
        except TransportError as err:
            second.append(err)

    class EachEntry:
        """The owner's lock, running the second relay (in its own thread, to its end)
        before each entry of the first relay's thread once its copy arrived."""

        def __init__(self, lock: object) -> None:
            self._lock = lock

        def __enter__(self) -> object:
            if copied.is_set() and threading.current_thread() is first_thread:
                racer = threading.Thread(target=relay_second)
                racer.start()
                racer.join()
            return self._lock.__enter__()

        def __exit__(self, *exc: object) -> object:
            return self._lock.__exit__(*exc)

        def __getattr__(self, name: str) -> object:
            return getattr(self._lock, name)

    monkeypatch.setattr(shm_owner.ray, "get", get)
    owner._lock = EachEntry(owner._lock)
    first_thread = threading.current_thread()
    try:
        slot = owner.relay(["first"], nbytes, "m", ("w1",), 5.0)
        assert second and all(isinstance(s, TransportError) for s in second), second
        segment = owner._by_seq[slot.seq]
        assert int(segment.buffer[HEADER_BYTES]) == 1  # the first version, whole
        assert "worker/w1" in owner.stats().holds
    finally:
        owner.close()


def test_an_export_numbered_after_its_hold_comes_before_a_newer_versions_hold(monkeypatch):
    """Exported for other nodes, held here by nothing but being the latest: the hold of
    the next version (the hub's next number) must wait for the export, which would
    otherwise find the slot held by nothing and refuse, failing every other node."""
    import threading

    from raysync.actors import shm_owner

    monkeypatch.setattr(shm_owner.ray, "put", lambda data: "ref")
    owner = ShmOwner("node", max_slots=2)
    try:
        older = owner.acquire(4096, timeout_s=5.0, learner="learner")
        newer = owner.acquire(4096, timeout_s=5.0, learner="learner")
        owner.deliver(PID, older.seq, "m", (), order=1)
        later = threading.Thread(target=owner.deliver, args=(PID, newer.seq, "m", (), 3))
        later.start()  # the newer version's hold reaches the owner before the export
        assert owner.export(PID, older.seq, order=2) == ["ref"]
        later.join()
        assert owner.stats().holds == ("latest/m",)
    finally:
        owner.close()


def test_a_learner_that_left_has_its_slots_freed_once_nothing_holds_them():
    """release() in the learner: its unplanned slot is freed at once; the one receivers
    and late joiners read is freed once they let it go (here: a newer version of
    another learner became the latest); freed board columns are given out again."""
    owner = ShmOwner("node", max_slots=4)
    try:
        read = owner.acquire(4096, timeout_s=5.0, learner="gone", pid=PID)
        owner.deliver(PID, read.seq, "m", ("w0",))
        owner.acquire(4096, timeout_s=5.0, learner="gone", pid=PID)  # ahead, never written
        assert owner.stats().segments == 2
        owner.leave("gone")
        assert owner.stats().segments == 1
        assert owner.stats().holds == ("latest/m", "worker/w0")
        owner.release(PID, read.seq, "w0")
        newer = owner.acquire(4096, timeout_s=5.0, learner="next", pid=PID)
        owner.deliver(PID, newer.seq, "m", ())
        again = owner.acquire(4096, timeout_s=5.0, learner="next", pid=PID)
        stats = owner.stats()
        assert (stats.segments, stats.holds) == (2, ("latest/m", "pending"))
        assert {newer.column, again.column} <= {read.column, read.column + 1}
    finally:
        owner.close()


def test_the_slots_of_a_learner_whose_process_died_are_freed():
    """It never called release(): its process is gone, so its pending slot is freed
    when the owner next looks for a slot, once the hub can no longer plan the version
    in it (``pending_kept_s``: 0 here; the other owner keeps it meanwhile)."""
    import subprocess

    finished = subprocess.Popen(["true"])
    finished.wait()
    for kept_s, segments in ((0.0, 1), (60.0, 2)):
        owner = ShmOwner("node", max_slots=4, pending_kept_s=kept_s)
        try:
            owner.acquire(4096, timeout_s=5.0, learner="died", pid=finished.pid)
            owner.acquire(4096, timeout_s=5.0, learner="lives", pid=PID)
            assert owner.stats().segments == segments
        finally:
            owner.close()


def test_the_slots_of_a_learner_whose_pid_a_new_process_took_are_freed(monkeypatch):
    """The learner's process died and the kernel gave its pid to a new process: the
    pid alone would keep its slots for good; with its start time, it is gone."""
    from raysync.actors import shm_owner

    owner = ShmOwner("node", max_slots=4, pending_kept_s=0.0)
    try:
        owner.acquire(4096, timeout_s=5.0, learner="died", pid=PID)
        started = shm_owner._started_at(PID)
        assert started is not None
        monkeypatch.setattr(shm_owner, "_started_at", lambda pid: started + 1)  # reused
        owner.acquire(4096, timeout_s=5.0, learner="lives", pid=PID)
        assert owner.stats().segments == 1
    finally:
        owner.close()


def test_a_restarted_receiver_holds_the_version_it_reads_again(owner):
    """It released version s on its row of the board, died, and its new process joined
    with the same worker id (the same row): the hold of its catch-up read of s is
    taken, not mistaken for the old release, so the slot is not handed to the learner
    while the new process reads it."""
    board = owner.join("w")
    assert board is not None
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, slot.seq, "m", ("w",))
    owner._cells[board.row, slot.column] = slot.seq  # what its release wrote (pwrite)
    assert owner.stats().holds == ("latest/m",)

    assert owner.join("w") == board  # Ray restarted it: the same row
    owner.deliver(PID, slot.seq, "m", ("w",))  # the hub's catch-up of the latest
    assert owner.stats().holds == ("latest/m", "worker/w")
    newer = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, newer.seq, "m", ())  # the next version: the latest moves on
    assert owner._by_seq[slot.seq].holds == {Hold.of_worker("w")}


def test_a_join_numbered_before_a_hold_runs_first_however_the_threads_start_them(
    owner, monkeypatch
):
    """The hub booked a registration of ``w`` and then planned a version for it; Ray's
    threads started the hold (number 2) before the join (number 1). The join waits for
    nothing and the hold for the join: run after it, the join forgot the hold, and the
    slot the worker was to read was held by nothing but ``latest``."""
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    waits = _waits_for_its_turn(owner, monkeypatch, "has_turn")
    holding = threading.Thread(
        target=owner.deliver, args=(PID, slot.seq, "m", ("w",)), kwargs={"order": 2}
    )
    holding.start()
    assert waits.wait(timeout=30), "the hold did not wait for the join"
    owner.join("w", (), 0, 1)
    holding.join(timeout=30)
    assert not holding.is_alive()
    assert owner.stats().holds == ("latest/m", "worker/w")


def test_a_relay_sent_after_a_join_holds_for_the_worker_after_the_join_ran(
    owner, monkeypatch
):
    """The same on another node: the hub booked ``w``'s registration there (its join,
    number 1) and then relayed a version to it. The relay is not numbered (the holds
    sent after it must not wait for its copy) but names the last call sent before it:
    its hold waits for the join, which would forget it."""
    import numpy as np

    from raysync.actors import shm_owner
    from raysync.layout import HEADER_BYTES

    nbytes = 4096
    monkeypatch.setattr(
        shm_owner.ray, "get", lambda ref: np.ones(nbytes - HEADER_BYTES, dtype=np.uint8)
    )
    relayed: list[object] = []
    relaying = threading.Thread(
        target=lambda: relayed.append(
            owner.relay(["export"], nbytes, "m", ("w",), 5.0, 1, 0, 1)
        )
    )
    waits = _waits_for_its_turn(owner, monkeypatch, "passed")
    relaying.start()
    assert waits.wait(timeout=30), "the relay's hold did not wait for the join"
    owner.join("w", (), 0, 1)
    relaying.join(timeout=30)
    assert relayed, "the relay did not end"
    assert owner.stats().holds == ("latest/m", "worker/w")


def _waits_for_its_turn(owner: ShmOwner, monkeypatch, check: str) -> threading.Event:
    """Set once a call of the owner asks whether its turn came (``check``: the
    ordering's question), i.e. it reached the section that waits for the earlier calls;
    a call that waits out the limit of that wait fails (in its thread)."""
    asked = threading.Event()
    turns = owner._in_order._turns
    ask = getattr(turns, check)

    def asking(*args: object) -> bool:
        asked.set()
        return ask(*args)

    def gave_up(*args: object) -> None:
        raise AssertionError(f"a call waited out its turn: {args}")

    monkeypatch.setattr(turns, check, asking)
    # What waits for the earlier calls is let go by them, not after the wait's limit.
    monkeypatch.setattr(turns, "skip_to_lowest_waiting", gave_up)
    monkeypatch.setattr(turns, "log_read_without", gave_up)
    return asked


def test_a_version_handed_to_a_worker_again_after_it_released_it_is_held_again(owner):
    """A pull receiver registered again: it declined the welcome's catch-up of version
    s (a release on its row of the board) and then pulled s itself. The release stayed
    on the board and cancelled the pull's hold too, so the pull read s (a zero-copy
    model then lived in it) with nothing holding it but ``latest``."""
    board = owner.join("w")
    assert board is not None
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, slot.seq, "m", ("w",), order=1)  # the welcome's catch-up
    owner._cells[board.row, slot.column] = slot.seq  # declined: what its pwrite writes
    owner.deliver(PID, slot.seq, "m", ("w",), order=2)  # its pull of the same version
    assert owner.stats().holds == ("latest/m", "worker/w")
    owner._cells[board.row, slot.column] = slot.seq  # the pull's copy is done
    assert owner.stats().holds == ("latest/m",)


@pytest.mark.parametrize("by_call", [False, True])
def test_a_release_that_came_before_its_hold_forestalls_that_hold_alone(owner, by_call):
    """The worker let version s go before the hold of the delivery it read came (it
    declined a catch-up of s, say); the hub then delivered s to it again (its pull).
    The early release forestalled the first hold and then the second, and the worker
    read s, or lived in it, unheld. (A learner's own call turned down unread is handed
    back apart: ``release_unread``.)"""
    board = owner.join("w")
    assert board is not None
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    if by_call:
        owner.release(PID, slot.seq, "w")
    else:
        owner._cells[board.row, slot.column] = slot.seq
    owner.deliver(PID, slot.seq, "m", ("w",), order=1)  # the hold of the call it let go
    assert owner.stats().holds == ("latest/m",)
    owner.deliver(PID, slot.seq, "m", ("w",), order=2)  # the hub's own delivery of s
    assert owner.stats().holds == ("latest/m", "worker/w")


@pytest.mark.parametrize("turned_down_first", [True, False])
def test_a_learners_call_turned_down_unread_leaves_the_hold_of_the_hubs_own_delivery(
    owner, turned_down_first
):
    """Another learner's version took the number the learner delivered s as: the worker
    turned the learner's own call of s down unread (it held a newer version), and the
    hub numbered s anew and delivered this very slot itself, booking no hold for the
    call. The turn-down, before or after that delivery's hold landed, was taken for its
    release: the zero-copy model then living in s was held by nobody but ``latest``."""
    board = owner.join("w")
    assert board is not None
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    if turned_down_first:
        owner.release_unread(PID, slot.seq, "w")
    owner.deliver(PID, slot.seq, "m", ("w",), order=1)  # the hub's own delivery of s
    if not turned_down_first:
        owner.release_unread(PID, slot.seq, "w")
    assert owner.stats().holds == ("latest/m", "worker/w")
    owner._cells[board.row, slot.column] = slot.seq  # its model moved on
    assert owner.stats().holds == ("latest/m",)


@pytest.mark.parametrize("turned_down_first", [True, False])
def test_a_learners_call_turned_down_unread_takes_back_the_hold_booked_for_that_call(
    owner, turned_down_first
):
    """The hub booked s as the learner delivered it and held it for the workers the
    learner called; one turned the call down unread, before or after that hold landed:
    the hold goes (the worker never reads s), the other's stays until it lets go."""
    for worker in ("w", "reader"):
        assert owner.join(worker) is not None
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    if turned_down_first:
        owner.release_unread(PID, slot.seq, "w")
    owner.deliver(PID, slot.seq, "m", ("w", "reader"), order=1, called=("w", "reader"))
    if not turned_down_first:
        owner.release_unread(PID, slot.seq, "w")
    assert owner.stats().holds == ("latest/m", "worker/reader")
    owner.release(PID, slot.seq, "reader")
    assert owner.stats().holds == ("latest/m",)


def test_a_hold_for_a_worker_gone_that_lands_after_is_not_taken(owner):
    """The hub's hold for a receiver (not awaited) lands after the owner heard it died:
    nothing would ever release it. Once it joins again, its holds count again."""
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.drop_worker("w1")
    owner.deliver(PID, slot.seq, "m", ("w0", "w1"))
    assert owner.stats().holds == ("latest/m", "worker/w0")
    owner.join("w1")
    owner.deliver(PID, slot.seq, "m", ("w1",))
    assert owner.stats().holds == ("latest/m", "worker/w0", "worker/w1")


def test_a_relay_whose_receiver_died_while_it_copied_does_not_hold_for_it(monkeypatch):
    import numpy as np

    from raysync.actors import shm_owner
    from raysync.layout import HEADER_BYTES

    owner = ShmOwner("node", max_slots=1)

    def get(ref: str) -> np.ndarray:
        owner.drop_worker("w1")  # the hub heard w1 died while the relay copied
        return np.zeros(4096 - HEADER_BYTES, dtype=np.uint8)

    monkeypatch.setattr(shm_owner.ray, "get", get)
    try:
        owner.relay(["ref"], 4096, "m", ("w0", "w1"), 5.0)
        assert owner.stats().holds == ("latest/m", "worker/w0")
    finally:
        owner.close()


def test_a_version_handed_to_a_receiver_twice_is_held_until_both_are_released(owner, monkeypatch):
    """A delivery tried again (or a catch-up beside a broadcast of the same version)
    hands one receiver the same slot twice; the owner holds it once for that worker.
    The first handing, superseded by the second at the safe point, is released: the
    slot stays held for the second, which has yet to be copied."""
    import torch

    from raysync.spec import WeightSpec
    from raysync.transports.shared_memory import receiver as shm_receiver
    from raysync.transports.shared_memory.wire import (
        HEADER_BYTES,
        SharedMemoryPayload,
        SharedMemoryReceiverInfo,
        write_seq,
    )

    monkeypatch.setattr(
        shm_receiver.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node")
    )
    spec = WeightSpec.of({"w": torch.zeros(16)})
    board = owner.join("w")
    receiver = shm_receiver.SharedMemoryReceiver(SharedMemoryReceiverInfo("w", "owner", board))
    slot = owner.acquire(HEADER_BYTES + 64, timeout_s=5.0, learner="learner")
    write_seq(owner._by_seq[slot.seq].buffer, slot.seq)  # the learner wrote it
    owner.deliver(PID, slot.seq, "m", ("w",))
    payload = SharedMemoryPayload(slot)
    try:
        first, second = (receiver.fetch(payload, spec) for _ in range(2))
        receiver.release(payload, first)  # superseded by the second
        assert owner.stats().holds == ("latest/m", "worker/w")
        receiver.release(payload, second)  # applied
        assert owner.stats().holds == ("latest/m",)
    finally:
        receiver.close()


def test_a_withdrawn_delivery_takes_back_only_the_holds_it_alone_took(owner):
    """The hub withdraws a delivery that never reached its workers (its plan was cut
    short). The owner holds a slot once per worker: a worker another delivery of the
    version reached keeps its hold until it releases it, one the withdrawn delivery
    alone held lets go, and a withdrawal of a delivery made before the worker's
    release leaves the hold a later delivery took."""
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, slot.seq, "m", ("w0",), placement=1)  # a pull: w0 reads it
    owner.deliver(PID, slot.seq, "m", ("w0", "w1"), placement=2)  # a broadcast of it
    owner.withdraw(PID, slot.seq, ("w0", "w1"), 2)  # cut short: reached neither
    assert owner.stats().holds == ("latest/m", "worker/w0")

    owner.deliver(PID, slot.seq, "m", ("w1",), placement=3)  # not taken for a release
    owner.deliver(PID, slot.seq, "m", ("w0",), placement=4)
    owner.release(PID, slot.seq, "w0")  # done with every delivery it read
    owner.deliver(PID, slot.seq, "m", ("w0",), placement=5)  # a catch-up, read yet
    owner.withdraw(PID, slot.seq, ("w0",), 4)  # held before the release: nothing left
    assert owner.stats().holds == ("latest/m", "worker/w0", "worker/w1")
    owner.withdraw(PID, slot.seq, ("w0", "w1"), 5)  # w1 never had it
    assert owner.stats().holds == ("latest/m", "worker/w1")
    assert owner.stats().release_calls == 1  # a withdrawal is no receiver's release


def _written(owner: ShmOwner, seq: int, model: str) -> None:
    """Write version ``seq`` of ``model`` into its slot's header, as the learner does."""
    from raysync.transports.shared_memory.wire import write_model, write_seq

    header = owner._by_seq[seq].buffer
    write_model(header, model)
    write_seq(header, seq)


def test_a_newer_version_of_one_model_keeps_an_older_one_of_another_model_pending(owner):
    """One learner writes a version of model a, then one of model b; the hub plans b's
    first (each model's deliveries run on their own). a's slot must stay held until
    the hub plans it, or the learner's next version would be written into the slot a's
    receivers are about to read."""
    from raysync.actors.shm_owner import PENDING

    a = owner.acquire(4096, timeout_s=5.0, learner="learner")
    _written(owner, a.seq, "a")
    b = owner.acquire(4096, timeout_s=5.0, learner="learner")
    _written(owner, b.seq, "b")
    owner.deliver(PID, b.seq, "b", ("w0",), order=1, version=1)
    assert PENDING in owner._by_seq[a.seq].holds
    owner.deliver(PID, a.seq, "a", ("w0",), order=2, version=1)
    assert owner._by_seq[a.seq].holds == {Hold.latest("a"), Hold.of_worker("w0")}


def test_a_newer_version_frees_older_pending_slots_of_its_model_and_those_never_written(owner):
    """What the hub refused (an older version of the model it planned) and a slot asked
    for ahead but never written hold nothing: both are freed for the learner."""
    from raysync.actors.shm_owner import PENDING

    refused = owner.acquire(4096, timeout_s=5.0, learner="learner")
    _written(owner, refused.seq, "a")
    unused = owner.acquire(8192, timeout_s=5.0, learner="learner")  # another size came
    newer = owner.acquire(4096, timeout_s=5.0, learner="learner")
    _written(owner, newer.seq, "a")
    owner.deliver(PID, newer.seq, "a", (), order=1, version=2)
    assert PENDING not in owner._by_seq[refused.seq].holds
    assert PENDING not in owner._by_seq[unused.seq].holds


def test_a_segment_the_node_has_no_memory_for_is_a_clear_error_that_keeps_nothing(
    owner, monkeypatch
):
    import errno

    from raysync.actors import shm_owner
    from raysync.transports import TransportError

    def full(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    fds_before = len(os.listdir("/proc/self/fd"))
    with monkeypatch.context() as patched:
        patched.setattr(shm_owner.os, "posix_fallocate", full)
        with pytest.raises(TransportError, match="segment of 4096 bytes .* learner"):
            owner.acquire(4096, timeout_s=5.0, learner="learner")
    assert len(os.listdir("/proc/self/fd")) == fds_before  # its memfd closed
    assert owner.acquire(4096, timeout_s=5.0, learner="learner").column == 0  # column kept


def test_a_slot_asked_for_ahead_after_its_sender_left_is_refused(owner):
    """The learner closed while its call for the next slot was on its way (Ray may run
    that call after the leave): the owner gives it none, rather than hold one for a
    sender that will never write it nor say it is unused."""
    from raysync.transports import TransportError

    owner.leave("gone")
    with pytest.raises(TransportError, match="sender gone closed"):
        owner.acquire(4096, timeout_s=5.0, learner="gone", pid=PID)
    assert owner.stats().segments == 0


def test_a_late_hold_of_a_relayed_version_is_refused_while_its_slot_takes_a_newer_one(
    monkeypatch,
):
    """A relay takes a free slot and waits for the exported bytes outside the lock. A
    hold of the version that slot held before (a plan reusing its relay of an older
    version) was taken meanwhile, on the old sequence: the receiver then read the newer
    version's bytes being copied over the one it was planned. The slot's sequence
    changes when the relay takes it, so such a hold is refused."""
    import threading

    import numpy as np

    from raysync.actors import shm_owner
    from raysync.transports import TransportError
    from raysync.transports.shared_memory.wire import HEADER_BYTES

    nbytes = HEADER_BYTES + 64
    waiting, arrived = threading.Event(), threading.Event()

    def get(ref: np.ndarray) -> np.ndarray:  # the export's bytes: the third's come late
        if ref[0] == 3:
            waiting.set()
            arrived.wait(10)
        return ref

    monkeypatch.setattr(shm_owner, "ray", SimpleNamespace(get=get))
    owner = ShmOwner("node", max_slots=2)
    try:

        def relayed(value: int) -> np.ndarray:
            return np.full(nbytes - HEADER_BYTES, value, dtype=np.uint8)

        first = owner.relay([relayed(1)], nbytes, "m", ("w0",), 5.0, version=1)
        owner.release(PID, first.seq, "w0")
        owner.relay([relayed(2)], nbytes, "m", ("w1",), 5.0, version=2)  # the latest now
        third: list[object] = []
        relaying = threading.Thread(
            target=lambda: third.append(owner.relay([relayed(3)], nbytes, "m", (), 5.0, version=3))
        )
        relaying.start()  # takes the first version's slot, and waits for its bytes
        try:
            assert waiting.wait(10)
            with pytest.raises(TransportError, match="no longer in shared memory"):
                owner.deliver(PID, first.seq, "m", ("w2",), version=1)
        finally:
            arrived.set()
            relaying.join(10)
        assert "worker/w2" not in owner.stats().holds
    finally:
        owner.close()


def test_the_owner_remembers_the_last_closed_senders_only(owner):
    """A learner that releases its hub every step closes a sender per step: the owner
    kept each one's id for its life."""
    from raysync.actors import shm_owner
    from raysync.transports import TransportError

    for step in range(shm_owner.CLOSED_SENDERS_KEPT + 10):
        owner.leave(f"sender {step}")
    assert len(owner._closed_senders) == shm_owner.CLOSED_SENDERS_KEPT
    last = f"sender {shm_owner.CLOSED_SENDERS_KEPT + 9}"
    with pytest.raises(TransportError, match=f"{last} closed"):
        owner.acquire(4096, timeout_s=5.0, learner=last)
    owner.acquire(4096, timeout_s=5.0, learner="sender 0")  # long gone: a sender again


@pytest.fixture
def three_slots():
    owner = ShmOwner("node", max_slots=3)
    yield owner
    owner.close()


def test_a_worker_that_lapsed_keeps_its_holds_until_it_joins_again_keeping_what_it_reads(
    three_slots,
):
    """A driver or task receiver stopped beating (Ray cannot say whether it died): its
    zero-copy model may live in one slot and a version wait for its safe point in
    another. Dropped, it let go of both, and the learner could rewrite them under a
    live model. Lapsed, it keeps them (a hold that lands later is not taken) until it
    joins again, keeping those it says it still reads."""
    owner = three_slots
    owner.join("w", pid=os.getpid())  # alive
    lived_in, staged, later = (owner.acquire(4096, timeout_s=5.0, learner="l") for _ in range(3))
    for slot in (lived_in, staged):
        owner.deliver(PID, slot.seq, "m", ("w",))
    owner.lapse("w")
    owner.deliver(PID, later.seq, "m", ("w",))
    assert owner._by_seq[later.seq].holds == {Hold.latest("m")}
    assert [Hold.of_worker("w") in owner._by_seq[s.seq].holds for s in (lived_in, staged)] == [
        True,
        True,
    ]
    owner.join("w", keep=((PID, staged.seq),))  # its zero-copy model took the staged one
    assert Hold.of_worker("w") not in owner._by_seq[lived_in.seq].holds
    assert Hold.of_worker("w") in owner._by_seq[staged.seq].holds


def test_a_lapsed_worker_whose_process_is_gone_lets_go_of_its_slots(three_slots):
    """Its process ended (a driver that exited without closing its receiver): nothing
    will read its slots again. Kept, each such receiver took one of the learner's few
    slots for good; seen gone when a slot is looked for, it lets go."""
    owner = three_slots
    process = subprocess.Popen(["sleep", "600"])
    try:
        owner.join("w", pid=process.pid)
        slot = owner.acquire(4096, timeout_s=5.0, learner="l")
        owner.deliver(PID, slot.seq, "m", ("w",))
        owner.lapse("w")
        assert Hold.of_worker("w") in owner._by_seq[slot.seq].holds  # alive: kept
    finally:
        process.kill()
        process.wait()
    owner.acquire(4096, timeout_s=5.0, learner="l")
    assert Hold.of_worker("w") not in owner._by_seq[slot.seq].holds


def test_a_registration_dropped_before_its_successor_joined_keeps_the_slot_a_model_lives_in(
    three_slots,
):
    """The process registered ``w`` again, its zero-copy model carried over in slot s;
    a delivery to the retired registration came back ``NOT_ATTACHED`` and the hub
    dropped ``w`` before booking the new registration. The drop let go of s and the
    join, keeping only holds it found, held nothing: once a newer version was the
    latest, the learner could rewrite s under the model."""
    owner = three_slots
    owner.join("w", pid=os.getpid())
    lived_in, other = (owner.acquire(4096, timeout_s=5.0, learner="l") for _ in range(2))
    owner.deliver(PID, lived_in.seq, "m", ("w",))
    owner.deliver(PID, other.seq, "m", ("w",))  # staged by the retired core, not kept
    owner.drop_worker("w")  # the retired registration's NOT_ATTACHED
    owner.join("w", keep=((PID, lived_in.seq),), pid=os.getpid())  # the new registration
    assert owner._by_seq[lived_in.seq].holds == {Hold.of_worker("w")}
    assert owner._by_seq[other.seq].holds == {Hold.latest("m")}


@pytest.mark.parametrize("by_call", [False, True])
def test_a_join_does_not_hold_again_what_was_released_or_not_dropped(three_slots, by_call):
    """What the join holds again is what the drop took and the worker has not let go
    of since (its release, by board or by call, came between the two), never a slot it
    released before the drop (kept by a stale list, it would stay held for good)."""
    owner = three_slots
    board = owner.join("w", pid=os.getpid())
    assert board is not None
    released_after, released_before = (
        owner.acquire(4096, timeout_s=5.0, learner="l") for _ in range(2)
    )
    for slot in (released_after, released_before):
        owner.deliver(PID, slot.seq, "m", ("w",))
    owner._cells[board.row, released_before.column] = released_before.seq
    owner.stats()  # the owner reads the board: that hold goes
    owner.drop_worker("w")
    if by_call:
        owner.release(PID, released_after.seq, "w")
    else:
        owner._cells[board.row, released_after.column] = released_after.seq
    keep = ((PID, released_after.seq), (PID, released_before.seq))
    owner.join("w", keep=keep, pid=os.getpid())
    assert "worker/w" not in owner.stats().holds
    owner.deliver(PID, released_after.seq, "m", ("w",))  # its release was used up
    assert owner._by_seq[released_after.seq].holds == {Hold.of_worker("w")}


@pytest.mark.parametrize("released", ["no", "on the board", "by call"])
def test_a_refused_version_its_learner_delivered_itself_stays_held_for_its_readers(
    three_slots, released
):
    """The learner delivered version s to ``w`` itself (the direct path) and the hub
    then refused s (it came late, or its snapshot could not be saved). It was never
    abandoned: pending until a newer version was planned, which freed it, while ``w``
    still read it (or its zero-copy model lived there). Now the refusal holds it for
    ``w`` until ``w`` lets go (a release that came first forestalls the hold), and lets
    the learner's pending hold go."""
    owner = three_slots
    board = owner.join("w", pid=os.getpid())
    assert board is not None
    refused = owner.acquire(4096, timeout_s=5.0, learner="l")
    _written(owner, refused.seq, "m")
    if released == "on the board":
        owner._cells[board.row, refused.column] = refused.seq
    elif released == "by call":
        owner.release(PID, refused.seq, "w")
    owner.drop_worker("gone")
    owner.abandon(PID, refused.seq, ("w", "gone"), order=1)
    if released != "no":  # free: the learner's next slot
        assert owner._by_seq[refused.seq].holds == set()
        assert owner.acquire(4096, timeout_s=5.0, learner="l").fd == refused.fd
        return
    newer = owner.acquire(4096, timeout_s=5.0, learner="l")
    _written(owner, newer.seq, "m")
    owner.deliver(PID, newer.seq, "m", ("w",), order=2)  # frees l's older pending slots
    assert owner._by_seq[refused.seq].holds == {Hold.of_worker("w")}
    owner._cells[board.row, refused.column] = refused.seq  # w moved on
    assert owner.acquire(4096, timeout_s=5.0, learner="l").fd == refused.fd


def test_a_model_split_anew_lets_go_of_its_former_layouts_latest_and_slots():
    """The learners re-split a model (two parts, then four): the two-part streams get no
    newer version, so their latest holds (and the slots of that size) stayed until the
    hub closed. Late joiners and pulls read the newest version only: the former
    layout's latest goes once a newer version of the new one is here, its slots once
    nothing holds them; the new layout's parts, and other models, keep theirs."""
    owner = ShmOwner("node", max_slots=4)
    try:
        for rank in (0, 1):
            slot = owner.acquire(4096, timeout_s=5.0, learner=f"rank{rank}")
            owner.deliver(PID, slot.seq, f"m[part {rank} of 2]", ("w",), 0, 1)
        other = owner.acquire(1024, timeout_s=5.0, learner="other")
        owner.deliver(PID, other.seq, "n", (), 0, 1)
        for rank in (0, 1):
            owner.release(PID, rank + 1, "w")
            slot = owner.acquire(2048, timeout_s=5.0, learner=f"rank{rank}")
            owner.deliver(PID, slot.seq, f"m[part {rank} of 4]", (), 0, 2)
        assert owner.stats().holds == (
            "latest/m[part 0 of 4]",
            "latest/m[part 1 of 4]",
            "latest/n",
        )
        owner.acquire(2048, timeout_s=5.0, learner="rank0")  # frees what nothing holds
        assert owner.stats().segments == 4, "the former layout's slots were kept"
    finally:
        owner.close()


def test_a_model_relayed_whole_after_parts_frees_the_parts_relays(monkeypatch):
    import numpy as np

    from raysync.actors import shm_owner
    from raysync.layout import HEADER_BYTES

    def get(nbytes: int) -> np.ndarray:
        return np.zeros(nbytes - HEADER_BYTES, dtype=np.uint8)

    monkeypatch.setattr(shm_owner.ray, "get", get)
    owner = ShmOwner("node", max_slots=4)
    try:
        owner.relay([4096], 4096, "m[part 0 of 2]", (), 5.0, 1)
        owner.relay([8192], 8192, "m", (), 5.0, 2)
        assert owner.stats().holds == ("latest/m",)
        owner.relay([8192], 8192, "m", (), 5.0, 3)  # frees what nothing holds
        assert owner.stats().segments == 2, "the parts' relay slot was kept"
    finally:
        owner.close()


def test_a_version_asked_for_ahead_stays_pending_for_its_time_after_its_learner_left(
    monkeypatch,
):
    """Learners ask for their next slot right after each broadcast: a training step
    later they write and submit it, then leave. Kept ``pending_kept_s`` from when it was
    asked for, the version was freed at once, and the hub's plan of it failed as "no
    longer in shared memory"; it is kept that long from when its learner left."""
    from raysync.actors import shm_owner
    from raysync.transports.shared_memory.segments import Mappings
    from raysync.transports.shared_memory.wire import write_seq

    clock = [1000.0]
    monkeypatch.setattr(shm_owner.time, "monotonic", lambda: clock[0])
    owner = ShmOwner("node", max_slots=4, pending_kept_s=10.0)
    try:
        slot = owner.acquire(4096, timeout_s=5.0, learner="l", pid=PID)  # asked for ahead
        clock[0] += 60.0  # a step later: written and submitted
        learner = Mappings(writable=True)
        write_seq(learner.buffer(slot).numpy(), slot.seq)
        learner.clear()
        owner.leave("l")
        owner.acquire(4096, timeout_s=5.0, learner="other", pid=PID)  # frees what it may
        owner.deliver(PID, slot.seq, "m", ("w",))  # the hub plans it, within its time
        assert "worker/w" in owner.stats().holds
    finally:
        owner.close()


def test_a_version_written_under_a_former_owner_is_named_so():
    """The learner's node's owner died after the learner wrote a version, and its watch
    restarted it before the hub planned the version: the new owner said a newer version
    had superseded it and its slot was reused, or that it was not held, sending the
    user after slot pressure instead of the owner's death."""
    from raysync.transports.base import TransportError

    owner = ShmOwner("node", max_slots=1)
    former = os.getpid() + 1
    try:
        with pytest.raises(TransportError, match=rf"owner on node node that died \(pid {former}\)"):
            owner.deliver(former, 1, "m", ("w",))
        with pytest.raises(TransportError, match="its restarted owner"):
            owner.export(former, 1)
    finally:
        owner.close()
