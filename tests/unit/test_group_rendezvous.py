"""raysync/transports/distributed/group.py with real gloo groups in threads (no Ray):
rank 0's store keeps no generation's rendezvous keys once its members have joined."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from raysync.transports.distributed import (
    Generation,
    StoreAddress,
    absent_members,
    forget_rendezvous,
    join_group,
)
from raysync.transports.options import DistributedOptions

TIMEOUT_S = 30.0


def test_rank_zero_forgets_each_generations_rendezvous_keys():
    """Each generation's keys (gloo's, one per rank, and ours) grew rank 0's store by
    every membership change, for the hub's life."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    settings = DistributedOptions(backend="gloo", timeout_s=TIMEOUT_S)
    for number, members in enumerate([("a", "b"), ("a", "b", "c"), ("c",)], start=1):
        generation = Generation(
            number, members, f"raysync/g{number}/", StoreAddress("127.0.0.1", master.port), settings
        )
        groups: dict[int, Any] = {}
        errors: list[BaseException] = []

        def join(rank: int, generation: Generation = generation, groups=groups, errors=errors):
            try:
                groups[rank] = join_group(generation, rank, master if rank == 0 else None)
            except BaseException as err:  # reported below, in the test's thread
                errors.append(err)

        threads = [
            threading.Thread(target=join, args=(rank,), daemon=True)
            for rank in range(1, generation.world_size)
        ]
        for thread in threads:
            thread.start()
        join(0)
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert not errors and len(groups) == generation.world_size, errors
        assert any(k.startswith(generation.prefix) for k in master.list_keys())
        forget_rendezvous(master, generation)
        assert master.list_keys() == [], master.list_keys()
        for group in groups.values():
            group.shutdown()


def test_a_generation_called_off_after_rank_zero_joined_it_leaves_no_key():
    """A member of a joined generation leaves (or dies): the hub calls the generation
    off, which changes nothing once everyone joined; it wrote the "go" key again, after
    rank 0 had deleted its keys, and that key stayed in rank 0's store for good."""
    import asyncio

    from raysync.actors.process_group import ProcessGroupActor
    from raysync.spec import WeightSpec
    from raysync.transports.distributed import BroadcastJob

    settings = DistributedOptions(backend="gloo", timeout_s=TIMEOUT_S)
    actor = ProcessGroupActor(settings)
    address = asyncio.run(actor.store_address())
    generation = Generation(1, ("a",), "raysync/g1/", address, settings)
    errors: list[BaseException] = []
    groups: list[Any] = []

    def member() -> None:
        try:
            groups.append(join_group(generation, 1, None))
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    thread = threading.Thread(target=member, daemon=True)
    thread.start()
    job = BroadcastJob(generation, 1, "m", 1, WeightSpec.of({}), source=None)  # type: ignore[arg-type]
    assert actor._collective(job, "join", None) is None
    thread.join(TIMEOUT_S)
    assert not errors, errors
    asyncio.run(actor.call_off(generation, "member a left"))
    assert [k for k in actor._store.list_keys() if k.startswith(generation.prefix)] == []
    for group in groups:
        group.shutdown()
    asyncio.run(actor.close())


def test_a_rendezvous_that_times_out_names_the_members_that_never_came():
    """Every member's error said only that not every rank joined: with one member busy,
    the hub's failures named none of them, and the user had to guess which one."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    settings = DistributedOptions(backend="gloo", timeout_s=1.0)
    generation = Generation(
        7, ("here", "busy"), "raysync/g7/", StoreAddress("127.0.0.1", master.port), settings
    )
    errors: list[BaseException] = []

    def member() -> None:
        try:
            join_group(generation, 1, None)
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    thread = threading.Thread(target=member, daemon=True)
    thread.start()
    try:
        join_group(generation, 0, master)
    except RuntimeError as err:
        errors.append(err)
    thread.join(TIMEOUT_S)
    assert len(errors) == 2, errors
    for err in errors:
        message = str(err)
        assert "busy did not join process-group generation 7 within 1 s" in message, message
        assert "here" not in message and "rank 0 (" not in message, message
    assert absent_members(master, generation) == ("busy",)  # what rank 0 tells the hub


def test_rank_zero_keeps_the_keys_of_only_the_last_failed_rendezvous():
    """A generation whose rendezvous failed (a member died before it joined, and the
    hub called it off) kept its keys in rank 0's store for the hub's life."""
    import asyncio

    from raysync.actors import process_group
    from raysync.spec import WeightSpec
    from raysync.transports.distributed import BroadcastJob

    settings = DistributedOptions(backend="gloo", timeout_s=TIMEOUT_S)
    actor = process_group.ProcessGroupActor(settings)
    address = asyncio.run(actor.store_address())
    kept = process_group._FAILED_RENDEZVOUS_KEPT
    generations = [
        Generation(n, ("a",), f"raysync/g{n}/", address, settings) for n in range(1, kept + 3)
    ]
    for generation in generations:
        asyncio.run(actor.call_off(generation, "member a died"))
        job = BroadcastJob(generation, 0, "m", 1, WeightSpec.of({}), source=None)  # type: ignore[arg-type]
        assert "member a died" in (actor._collective(job, "join", None) or "")
    prefixes = {key.split("/")[1] for key in actor._store.list_keys()}
    assert prefixes == {f"g{g.number}" for g in generations[-kept:]}, prefixes
    asyncio.run(actor.call_off(generations[0], "called off again"))  # writes no key back
    assert not [k for k in actor._store.list_keys() if k.startswith(generations[0].prefix)]
    asyncio.run(actor.close())


def test_a_generation_of_an_earlier_rank_zero_called_off_leaves_no_key():
    """Ray restarted rank 0; before the hub's next plan heard of it, a member of the old
    incarnation's generation left and the hub called that generation off: the new
    store got its "go" key, which nothing ever deleted."""
    import asyncio

    from raysync.actors.process_group import ProcessGroupActor

    settings = DistributedOptions(backend="gloo", timeout_s=TIMEOUT_S)
    actor = ProcessGroupActor(settings)
    address = asyncio.run(actor.store_address())
    earlier = StoreAddress(address.host, address.port, "an earlier incarnation")
    generation = Generation(3, ("a",), "raysync/g3/", earlier, settings)
    asyncio.run(actor.call_off(generation, "member a left"))
    assert actor._store.list_keys() == []
    asyncio.run(actor.close())


def test_rank_zero_gives_a_bucketed_versions_rendezvous_up_within_a_buckets_limit():
    """A member of a bucketed version's generation is late (busy): rank 0 waited at the
    rendezvous for the group's whole timeout, taking no bucket. The stream's readers of
    another transport took the first buckets meanwhile, and the broker, after its stall
    time, dropped rank 0 and freed them: the members it adopted then found them gone,
    and the healthy ones failed with the late one. It waits a bucket's limit at most
    (half the broker's stall time), and adopts them in time."""
    import asyncio

    import torch

    from raysync.actors.process_group import ProcessGroupActor
    from raysync.spec import WeightSpec
    from raysync.transports.distributed import BroadcastJob
    from raysync.transports.object_store.bucket_stream import BucketStream, StreamId

    calls: list[tuple] = []

    async def answered() -> None:
        return None

    broker = SimpleNamespace(
        readers=SimpleNamespace(
            remote=lambda *args: calls.append(("readers", *args)) or answered()
        ),
        take=SimpleNamespace(remote=lambda *args: calls.append(("take", *args))),
    )
    settings = DistributedOptions(backend="gloo", timeout_s=TIMEOUT_S)
    actor = ProcessGroupActor(settings)
    try:
        address = asyncio.run(actor.store_address())
        generation = Generation(1, ("late",), "raysync/g1/", address, settings)  # never joins
        stream = BucketStream(broker, StreamId("s", 2, 1.0), 64)  # stall 0.5 s: limit 0.25 s
        job = BroadcastJob(generation, 1, "m", 1, WeightSpec.of({"w": torch.zeros(32)}), stream)
        reason = asyncio.run(actor._relay(job, "relay"))
        assert reason is not None and "late did not join" in reason, reason
        assert "within 0.25 s" in reason, reason
        assert ("readers", stream.key, ["late"]) in calls  # adopted: reads from the broker
    finally:
        asyncio.run(actor.close())


def test_a_member_that_gives_up_calls_the_rendezvous_off_for_the_others():
    """Rank 1 gives up waiting for rank 3; still counted, it let rank 3, arriving later,
    complete the count: ranks 0, 2 and 3 went into the group and waited there for rank 1
    a whole timeout more (its collective's fallback then too late for the broadcast).
    Its giving up now ends the others' wait, with its word."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    settings = DistributedOptions(backend="gloo", timeout_s=5.0)
    generation = Generation(
        3,
        ("early", "here", "late"),
        "raysync/g3/",
        StoreAddress("127.0.0.1", master.port),
        settings,
    )
    errors: dict[int, BaseException] = {}
    gave_up = threading.Event()

    def member(rank: int, after: threading.Event | None = None) -> None:
        if after is not None:
            assert after.wait(TIMEOUT_S)
        try:  # rank 1 waits less than the others: it gives up first
            rendezvous_s = 0.5 if rank == 1 else None
            join_group(generation, rank, master if rank == 0 else None, rendezvous_s)
        except BaseException as err:  # reported below, in the test's thread
            errors[rank] = err
        if rank == 1:
            gave_up.set()

    threads = [
        threading.Thread(target=member, args=(1,), daemon=True),
        threading.Thread(target=member, args=(2,), daemon=True),
        threading.Thread(target=member, args=(3, gave_up), daemon=True),  # comes after
    ]
    for thread in threads:
        thread.start()
    member(0)
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert sorted(errors) == [0, 1, 2, 3], errors
    assert "late did not join process-group generation 3 within 0.5 s" in str(errors[1])
    for rank in (0, 2, 3):  # the word of the rank that gave up, not gloo's own wait
        assert "rank 1 gave up: late did not join" in str(errors[rank]), errors[rank]
