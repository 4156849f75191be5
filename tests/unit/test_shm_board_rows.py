"""ShmOwner (actors/shm_owner.py), driven as the plain class it is: the rows of its
release board, over a long life with receivers that come and go. A row goes back to a
new worker once every process it was handed to is gone for good (and starts clean),
never while one of them may still write there."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from raysync.actors import shm_owner
from raysync.actors.shm_owner import ShmOwner

PID = os.getpid()  # the owner runs in this process: its slots name this pid
ROWS = 2  #: the board's rows in these tests (the owner reads ``BOARD_ROWS`` as it joins)


@pytest.fixture
def owner(monkeypatch) -> Iterator[ShmOwner]:
    monkeypatch.setattr(shm_owner, "BOARD_ROWS", ROWS)
    owner = ShmOwner("node", max_slots=2)
    yield owner
    owner.close()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Receivers' processes the test starts (each lives until the test ends it)."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        _end(process)


def _start(processes: list[subprocess.Popen]) -> int:
    """A new live process, as a receiver's; its pid."""
    process = subprocess.Popen(["sleep", "600"])
    processes.append(process)
    return process.pid


def _end(process: subprocess.Popen) -> None:
    """The process is gone for good (reaped: its pid names nothing, or a new process)."""
    process.kill()
    process.wait()


def _end_pid(processes: list[subprocess.Popen], pid: int) -> None:
    _end(next(process for process in processes if process.pid == pid))


@pytest.mark.parametrize("dropped", [True, False], ids=["dropped", "not yet dropped"])
def test_receivers_that_join_and_die_one_after_another_each_get_a_row(owner, processes, dropped):
    """Restarted actors or collectors that come and go: once as many had joined as the
    board has rows, every later one got none and released each version by a call. The
    row of one whose process died (whether or not the hub dropped it yet) is its
    successor's."""
    for index in range(ROWS + 3):
        worker = f"collector {index}"
        pid = _start(processes)
        board = owner.join(worker, pid=pid)
        assert board is not None, f"{worker} got no row of the release board"
        assert board.row < ROWS
        _end_pid(processes, pid)
        if dropped:
            owner.drop_worker(worker)


def test_workers_of_one_dead_process_give_back_each_its_row(owner, processes):
    """A process hosts a receiver per model: when it dies, each of their rows is free."""
    pid = _start(processes)
    rows = {owner.join(f"model {index}", pid=pid).row for index in range(ROWS)}
    _end_pid(processes, pid)
    again = {owner.join(f"next {index}", pid=PID).row for index in range(ROWS)}
    assert again == rows == set(range(ROWS))


@pytest.mark.parametrize("former", ["left, alive", "process not known"])
def test_a_row_that_may_still_be_written_is_not_given_to_another_worker(owner, processes, former):
    """A receiver that left in a process that lives may still release a version there
    late (as may one whose process the owner does not know): given to a new worker,
    that release would let go of the new worker's hold on the slot it reads."""
    pid = _start(processes) if former == "left, alive" else 0
    first = owner.join("former", pid=pid)
    owner.drop_worker("former")
    others = [owner.join(f"other {index}", pid=PID) for index in range(ROWS - 1)]
    assert first is not None and all(board is not None for board in others)
    assert owner.join("new", pid=PID) is None  # releases by call instead
    if former == "left, alive":
        _end_pid(processes, pid)
        assert owner.join("newer", pid=PID).row == first.row


def test_a_row_is_given_back_only_once_every_process_it_was_handed_to_is_gone(owner, processes):
    """A worker rejoined from a new process while the old one lives (it may still
    write there): its row is kept until both are gone."""
    old, new = _start(processes), _start(processes)
    row = owner.join("w", pid=old).row
    assert owner.join("w", pid=new).row == row  # the same row again
    for index in range(ROWS - 1):
        owner.join(f"other {index}", pid=PID)
    _end_pid(processes, new)
    assert owner.join("next", pid=PID) is None
    _end_pid(processes, old)
    assert owner.join("next", pid=PID).row == row


def test_a_reused_row_starts_clean(owner, processes):
    """The dead worker had written a release the owner had not read yet: left in its
    row, it was read as the new worker's release of that version, which it had not
    read, and the slot could be rewritten under it."""
    pid = _start(processes)
    dead = owner.join("dead", pid=pid)
    for index in range(ROWS - 1):
        owner.join(f"other {index}", pid=PID)
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, slot.seq, "m", ("dead",))
    owner._cells[dead.row, slot.column] = slot.seq  # its release, not read yet
    _end_pid(processes, pid)

    board = owner.join("new", pid=PID)
    assert board is not None and board.row == dead.row
    assert not owner._cells[board.row].any()
    owner.deliver(PID, slot.seq, "m", ("new",))
    assert "worker/new" in owner.stats().holds  # the owner read its board: still held
    owner._cells[board.row, slot.column] = slot.seq  # the new worker's own release
    assert "worker/new" not in owner.stats().holds


def test_a_row_whose_writer_was_not_read_as_it_joined_is_kept(owner, processes):
    """The owner could not read when the receiver's process started as it joined: it
    cannot tell that process from a later one of the same pid, so the row is kept
    while that pid names any process (here the same, alive)."""
    pid = _start(processes)
    with pytest.MonkeyPatch.context() as unread:
        unread.setattr(shm_owner, "_started_at", lambda pid: None)
        assert owner.join("former", pid=pid) is not None
    owner.drop_worker("former")
    for index in range(ROWS - 1):
        owner.join(f"other {index}", pid=PID)
    assert owner.join("new", pid=PID) is None
