"""Receiver processes and the rank-0 actor: joining a generation and its broadcasts;
the hub, through rank 0's actor, calling a generation off."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, cast

import torch

from raysync.transports.distributed.wire import Generation
from raysync.transports.object_store.bucket_stream import streams_of
from raysync.transports.options import MIN_TIMEOUT_S, DistributedOptions
from raysync.transports.process_groups import node_ip
from raysync.transports.staging import staging_device as process_staging_device

#: Keys under a generation's prefix: how many members arrived at its rendezvous, and
#: what ended the wait: ``_EVERYONE`` (the last member to arrive), or why the hub called
#: it off. Whichever comes first is the word every member reads (a compare-and-set).
#: Each rank also leaves ``_HERE`` + its rank, so that a wait that times out names the
#: members that never came.
_ARRIVED, _GO, _HERE = "raysync/arrived", "raysync/go", "raysync/here/"
_EVERYONE = b"everyone"
#: gloo waits this many times its timeout for a pair's first connection ("a longer
#: timeout when waiting for initial connect", ``gloo/transport/tcp/pair.h``): a member
#: that died after it published its address held each peer 5 times the timeout.
_GLOO_CONNECT_WAITS = 5


def join_group(
    generation: Generation,
    rank: int,
    store: torch.distributed.Store | None = None,
    rendezvous_s: float | None = None,
) -> Any:
    """This process's member object of ``generation`` (rendezvous plus a barrier).

    ``store`` is the master store (rank 0); other ranks connect to the generation's
    address. Returns once every member has joined, so the rendezvous keys are no
    longer needed; raises on timeout (the group's, or ``rendezvous_s`` for the
    rendezvous if given), or as soon as the hub calls the generation off
    (:func:`call_off`: a member it knows is dead will never join). Once every member
    has arrived, the group forms (gloo's connections, the barrier) within
    :func:`formation_s`: a member that died right after it arrived can no longer be
    called off, and gloo waited for it the group's whole timeout, on every rank.
    """
    import torch.distributed as dist

    settings = generation.settings
    if store is None:
        store = dist.TCPStore(
            generation.store.host,
            generation.store.port,
            is_master=False,
            timeout=settings.timeout,
        )
    prefixed = dist.PrefixStore(generation.prefix, store)
    _everyone_here(prefixed, generation, rank, rendezvous_s)
    form_s = formation_s(generation, rendezvous_s)
    forming = datetime.timedelta(seconds=form_s)
    formed_by = time.monotonic() + form_s
    group: Any = None  # torch's stubs give these backends no barrier(); both have one
    try:
        if settings.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch private
            # gloo's wait for each rank's address, and (times _GLOO_CONNECT_WAITS) for
            # each connection
            options._timeout = datetime.timedelta(
                seconds=max(MIN_TIMEOUT_S, form_s / _GLOO_CONNECT_WAITS)
            )
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
            group = dist.ProcessGroupGloo(prefixed, rank, generation.world_size, options)
        else:
            # NCCL's watchdog, on a member's death or a timed-out collective, by default
            # tears this whole process down (mode 3), receiver actor and all: one death
            # would end every member. Mode 2 aborts the communicator only; the collective
            # then raises here and the member falls back as over gloo. Read when the group
            # is made; a setting of the user's own stands.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = forming
            group = dist.ProcessGroupNCCL(prefixed, rank, generation.world_size, options)
        left = datetime.timedelta(seconds=max(MIN_TIMEOUT_S, formed_by - time.monotonic()))
        _default_timeout(group, left)  # the barrier's own, not gloo's connection wait
        barrier = group.barrier()
        barrier.wait(left)
    except Exception as err:
        if group is not None:  # its connections closed now: the others fail at once
            group.shutdown()
        raise RuntimeError(
            f"process-group generation {generation.number} did not form within {form_s:g} s "
            f"of every rank's arrival at its rendezvous (a member may have died as it "
            f"joined): {err}"
        ) from None
    _default_timeout(group, settings.timeout)  # collectives: the group's own
    return group


def _default_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """The timeout of ``group``'s operations that name none (every collective of
    :func:`run_broadcast` names its own), where the backend lets it be changed."""
    if hasattr(group, "_set_default_timeout"):
        group._set_default_timeout(timeout)


def formation_s(generation: Generation, rendezvous_s: float | None = None) -> float:
    """How long a rank of ``generation`` waits for its group to form once every member
    arrived at its rendezvous: the generation's ``form_s`` (a share of the broadcast's
    time, from the planner), or ``rendezvous_s`` if shorter, never more than the
    group's timeout nor less than
    :data:`~raysync.transports.options.MIN_TIMEOUT_S`."""
    limits = [generation.settings.timeout_s, generation.form_s, rendezvous_s]
    return max(MIN_TIMEOUT_S, min(limit for limit in limits if limit is not None))


def forget_rendezvous(store: Any, generation: Generation) -> None:
    """Rank 0's actor, once it joined ``generation`` (``store``: the master store):
    delete the generation's keys, gloo's and ours. Every member has joined by then and
    reads them no more; kept, they grew rank 0's store by every membership change for
    the hub's life."""
    for key in store.list_keys():
        if key.startswith(generation.prefix):
            store.delete_key(key)


def _everyone_here(
    store: Any, generation: Generation, rank: int, timeout_s: float | None = None
) -> None:
    """Wait until every member of ``generation`` has arrived at its rendezvous, or the
    hub called it off; raise on the timeout (the group's, or ``timeout_s``), or with
    why it was called off.

    One blocking wait on one key, set once, by the last member to arrive or by
    :func:`call_off`: gloo's own rendezvous would wait the whole timeout for a member
    that died before joining, and every member with it.
    """
    import torch.distributed as dist

    store.set(f"{_HERE}{rank}", b"")  # before counting: the last to count is here
    if store.add(_ARRIVED, 1) == generation.world_size:
        store.compare_set(_GO, "", _EVERYONE)
    if timeout_s is None:
        timeout_s = generation.settings.timeout_s
    try:
        store.wait([_GO], datetime.timedelta(seconds=timeout_s))
        word = store.get(_GO)
    except dist.DistStoreError:
        # Given up: the others hear it at once (counted, this rank would otherwise let
        # the last to arrive send everyone into the group, to wait there for it a whole
        # timeout more), unless that word came first.
        gave_up = (
            f"rank {rank} gave up: {_absent(store, generation)} did not join process-group "
            f"generation {generation.number} within {timeout_s:g} s"
        )
        word = store.compare_set(_GO, "", cast(str, gave_up.encode()))
    if word != _EVERYONE:
        raise RuntimeError(f"process-group generation {generation.number}: {word.decode()}")


def _not_arrived(store: Any, generation: Generation) -> list[int]:
    """The ranks of ``generation`` that have not arrived at its rendezvous (``store``:
    the generation's, under its prefix)."""
    return [rank for rank in range(generation.world_size) if not store.check([f"{_HERE}{rank}"])]


def _absent(store: Any, generation: Generation) -> str:
    """The ranks of ``generation`` that have not arrived at its rendezvous, by name
    (a member by its worker id, rank 0 as the hub's process-group actor)."""
    names = ["rank 0 (the hub's process-group actor)", *generation.members]
    absent = [names[rank] for rank in _not_arrived(store, generation)]
    return " and ".join(absent) if absent else "the last rank (it came as the wait ended)"


def absent_members(store: Any, generation: Generation) -> tuple[str, ...]:
    """Rank 0's actor, its rendezvous of ``generation`` failed (``store``: the master
    store): the members (worker ids) that had not arrived."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(generation.prefix, store)
    missing = _not_arrived(prefixed, generation)
    return tuple(generation.members[rank - 1] for rank in missing if rank)  # rank 0 asks


def call_off(store: Any, generation: Generation, why: str) -> None:
    """Rank 0's actor, for the hub: members waiting at ``generation``'s rendezvous stop
    waiting and raise with ``why`` (``store`` is the master store). Once every member
    has arrived, the generation goes on: a member that died after joining fails its
    collectives, which then fail at once for every other member."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(generation.prefix, store)
    # torch's stub types the value str; the store takes bytes, and get() returns bytes.
    prefixed.compare_set(_GO, "", cast(str, f"the hub called it off: {why}".encode()))


def run_broadcast(
    group: Any,
    buffer: torch.Tensor,
    settings: DistributedOptions,
    *,
    agree: bool = False,
    timeout_s: float | None = None,
) -> None:
    """Broadcast ``buffer`` from rank 0 (every member calls this, with the same
    ``agree``); raises on failure, or after ``timeout_s`` (default: the group's).

    ``agree`` (a bucket of a bucketed version), with three ranks or more: then agree
    that every member has it, with one allreduce of one element. gloo broadcasts down a
    binomial tree, NCCL along rings and trees, so a member passes what it got on to
    others, and one busy member fails the member that forwards to it although that one
    got every byte. Without the agreement rank 0 went on to the next buckets (the broker
    freed this one) while the forwarder, failed, had to read this bucket again from the
    broker: gone. With it, a collective that fails anywhere fails on every rank, and
    rank 0 stops at the bucket the others read on from. A whole version needs none: a
    member that fails reads the learner's copy, which outlives the broadcast (the
    allreduce cost a 1 MB broadcast to four 1-3 ms, a 64 MB one 5-15 %).
    """
    import torch.distributed as dist

    timeout = settings.timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timeout
    group.broadcast([buffer], options).wait(timeout)
    if agree and group.size() >= 3:
        agreed = dist.AllreduceOptions()
        agreed.timeout = timeout
        group.allreduce([torch.zeros(1, device=buffer.device)], agreed).wait(timeout)
    if buffer.device.type == "cuda":
        torch.cuda.current_stream(buffer.device).synchronize()


def bucket_timeout_s(settings: DistributedOptions, source: object) -> float:
    """How long rank 0 and each member wait for one bucket's collective of a bucketed
    version from ``source`` (the learner's streams): the group's timeout, or half the
    time the bucket broker waits for a reader that holds its stream up, if shorter.
    Rank 0 is the stream's one reader: had it waited longer, the broker would drop it
    and end the stream, and the members, failing after it, would find it over; they
    fail as early, so they read on from the broker within that time. Never under
    :data:`~raysync.transports.options.MIN_TIMEOUT_S`: torch keeps whole milliseconds
    and reads 0 ms as no timeout (a broadcast's ``timeout_s`` of 3 ms made it 0.75)."""
    shortest = min([settings.timeout_s, *(s.key.stall_s / 2 for s in streams_of(source))])
    return max(MIN_TIMEOUT_S, shortest)


def staging_device(settings: DistributedOptions) -> torch.device:
    """Where a member stages a collective's version: this process's CUDA device for
    NCCL (the one current where the receiver was made, not in the thread that reads: a
    threaded or async host reads on Ray's threads, where device 0 is current), else
    CPU."""
    if settings.backend == "nccl":
        return process_staging_device()
    return torch.device("cpu")
