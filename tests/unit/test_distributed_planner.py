"""The ``distributed`` planner's bookkeeping (raysync/transports/distributed/planner.py),
in the hub's event loop, with a stand-in for rank 0's process-group actor (its calls
are what the planner asks of it; the group itself is tests/test_distributed.py's)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from raysync.actors.process_group import ProcessGroupActor
from raysync.spec import WeightSpec
from raysync.transports.base import PLAN_DEADLINE, HubContext, ReceiverInfo, Unplanned
from raysync.transports.distributed import GroupPayload, join_group
from raysync.transports.distributed.group import _everyone_here
from raysync.transports.distributed.planner import DistributedPlanner
from raysync.transports.distributed.wire import StoreAddress
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.object_store.wire import ObjectStorePayload
from raysync.transports.options import DistributedOptions

SPEC = WeightSpec.of({"w": torch.zeros(4)})


class _Call:
    """One remote method of the stand-in: records its arguments, answers ``answer``."""

    def __init__(self, calls: list, name: str, answer: Any) -> None:
        self._calls, self._name, self.answer = calls, name, answer

    def remote(self, *args: Any) -> Any:
        self._calls.append((self._name, args))
        answer = self.answer

        async def reply() -> Any:
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return asyncio.ensure_future(reply())


class _Rank0:
    """Rank 0 as the planner calls it: where its store listens, its collectives (which
    answer None, or raise), and generations called off."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.store_address = _Call(self.calls, "store_address", StoreAddress("127.0.0.1", 1))
        self.broadcast = _Call(self.calls, "broadcast", None)
        self.call_off = _Call(self.calls, "call_off", None)
        self.absent_from = _Call(self.calls, "absent_from", ())

    def called_off(self) -> list[tuple[int, str]]:
        return [(args[0].number, args[1]) for name, args in self.calls if name == "call_off"]


def _info(worker: str) -> ReceiverInfo:
    return ReceiverInfo(worker, f"Collector({worker})", "node", f"process-{worker}", None)


class _Update:
    def __init__(self, version: int) -> None:
        self.model, self.version, self.payload = "m", version, ObjectStorePayload(())


class _AnswersWhenLet:
    """A remote method that is asked at once and answers ``call``'s answer once let."""

    def __init__(self, call: _Call) -> None:
        self.call, self.asked, self.let = call, asyncio.Event(), asyncio.Event()

    def remote(self, *args: Any) -> Any:
        self.asked.set()

        async def reply() -> Any:
            await self.let.wait()
            return await self.call.remote(*args)

        return asyncio.ensure_future(reply())


def _planner(rank0: _Rank0) -> DistributedPlanner:
    return DistributedPlanner(HubContext(actor=None, hub_id="hub"), rank0=rank0)


def test_a_receiver_that_left_while_a_plan_waited_gets_no_place_in_a_generation():
    """Two versions' targets were chosen before the hub heard c2 died; the first's
    generation is called off, and the second's is formed without it (with it, the
    others waited the group's whole timeout at its rendezvous, and failed)."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info(w) for w in ("c0", "c1", "c2")]

    async def run() -> tuple[dict, dict, Any]:
        for target in targets:
            await planner.receiver_joined(target)
        first = await planner.plan(_Update(1), SPEC, targets)
        await planner.receiver_left("c2")
        second = await planner.plan(_Update(2), SPEC, targets)
        return first, second, planner._generation

    first, second, generation = asyncio.run(run())
    assert sorted(first) == ["c0", "c1", "c2"] and first["c2"].generation.number == 1
    assert rank0.called_off() == [(1, "member c2 died or left")]
    assert sorted(second) == ["c0", "c1"]
    assert generation.number == 2 and generation.members == ("c0", "c1")


def test_a_receiver_that_left_while_rank_0_answered_gets_no_place_in_a_generation():
    """c2 left while the plan asked rank 0 where its store listens (a round trip, or
    the whole of Ray restarting rank 0): the generation is formed without it. With it,
    no one called that generation off and c0 and c1 waited the group's whole timeout
    for c2 at its rendezvous."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info(w) for w in ("c0", "c1", "c2")]

    async def run() -> tuple[dict, Any]:
        rank0.store_address = _AnswersWhenLet(rank0.store_address)
        for target in targets:
            await planner.receiver_joined(target)
        planning = asyncio.ensure_future(planner.plan(_Update(1), SPEC, targets))
        await rank0.store_address.asked.wait()  # the plan waits for rank 0's answer
        await planner.receiver_left("c2")
        rank0.store_address.let.set()
        return await planning, planner._generation

    planned, generation = asyncio.run(run())
    assert sorted(planned) == ["c0", "c1"]
    assert generation.members == ("c0", "c1")
    jobs = [args[0] for name, args in rank0.calls if name == "broadcast"]
    assert [job.generation.members for job in jobs] == [("c0", "c1")]


def _restarted(worker: str) -> ReceiverInfo:
    """``worker``'s registration from the process Ray restarted it in."""
    return dataclasses.replace(_info(worker), process=f"new-process-{worker}", attachment="new")


def test_a_former_registration_of_a_worker_that_registered_while_a_plan_waited_is_left_out():
    """c2 died and its targets were chosen before the hub heard; Ray restarted it and
    the new process registered while the plan waited for rank 0. The plan took the
    former registration in (it knew the worker id): that generation, formed after the
    join called the last one off, waited for a c2 no process would be, and nobody
    called it off: c0 and c1 waited the group's whole timeout at its rendezvous."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info(w) for w in ("c0", "c1", "c2")]

    async def run() -> dict:
        rank0.store_address = _AnswersWhenLet(rank0.store_address)
        for target in targets:
            await planner.receiver_joined(target)
        planning = asyncio.ensure_future(planner.plan(_Update(1), SPEC, targets))
        await rank0.store_address.asked.wait()
        await planner.receiver_joined(_restarted("c2"))
        rank0.store_address.let.set()
        return await planning

    assert sorted(asyncio.run(run())) == ["c0", "c1"]
    jobs = [args[0] for name, args in rank0.calls if name == "broadcast"]
    assert [job.generation.members for job in jobs] == [("c0", "c1")]


def test_a_worker_registering_again_is_known_before_the_last_generation_is_called_off():
    """The new process's join calls off the generation its former registration was a
    member of; a plan that ran while rank 0 was asked to took the former registration
    into a new generation that nobody then called off."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info(w) for w in ("c0", "c1", "c2")]

    async def run() -> dict:
        for target in targets:
            await planner.receiver_joined(target)
        await planner.plan(_Update(1), SPEC, targets)
        rank0.call_off = _AnswersWhenLet(rank0.call_off)
        joining = asyncio.ensure_future(planner.receiver_joined(_restarted("c2")))
        await rank0.call_off.asked.wait()
        planned = await planner.plan(_Update(2), SPEC, targets)
        rank0.call_off.let.set()
        await joining
        return planned

    assert sorted(asyncio.run(run())) == ["c0", "c1"]
    jobs = [args[0] for name, args in rank0.calls if name == "broadcast"]
    assert [job.generation.members for job in jobs] == [("c0", "c1", "c2"), ("c0", "c1")]
    assert rank0.called_off() == [(1, "member c2 registered again (a new process)")]


def test_a_plan_whose_every_target_left_plans_nothing():
    rank0 = _Rank0()
    planner = _planner(rank0)

    async def run() -> dict:
        await planner.receiver_joined(_info("c0"))
        await planner.receiver_left("c0")
        return await planner.plan(_Update(1), SPEC, [_info("c0")])

    assert asyncio.run(run()) == {}
    assert [name for name, _ in rank0.calls] == []


@pytest.mark.parametrize("raised", [ValueError("a bug in rank 0"), RuntimeError("gloo")])
def test_a_collective_call_that_raised_leaves_the_next_plans_a_new_generation(raised):
    """Any error of rank 0's last collective (not only its death) is heard once: the
    next plan forms a new generation (it was raised again by every plan: the
    transport stopped for good)."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info("c0")]

    async def run() -> list[dict]:
        await planner.receiver_joined(targets[0])
        rank0.broadcast.answer = raised
        planned = [await planner.plan(_Update(1), SPEC, targets)]
        rank0.broadcast.answer = None
        planned.append(await planner.plan(_Update(2), SPEC, targets))
        planned.append(await planner.plan(_Update(3), SPEC, targets))
        return planned

    first, second, third = asyncio.run(run())
    assert first["c0"].generation.number == 1
    assert second["c0"].generation.number == 2 and third["c0"].generation.number == 2
    assert (second["c0"].seq, third["c0"].seq) == (0, 1)


def test_a_receiver_behind_reads_the_learners_copy_alone_until_it_acks_again():
    """One whose last delivery timed out (busy in a long method) held every member up
    for the group's timeout at each version: it reads the learner's copy by itself,
    and the others form a generation without it; back (acked), it is a member again."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    idle = [_info("c0"), _info("c1")]
    behind = dataclasses.replace(_info("busy"), behind=True)
    update = _Update(2)

    async def run() -> list[dict]:
        for target in [*idle, behind]:
            await planner.receiver_joined(target)
        planned = [await planner.plan(_Update(1), SPEC, [*idle, _info("busy")])]
        planned.append(await planner.plan(update, SPEC, [*idle, behind]))
        planned.append(await planner.plan(_Update(3), SPEC, [*idle, _info("busy")]))
        return planned

    first, second, third = asyncio.run(run())
    assert first["busy"].generation.members == ("busy", "c0", "c1")
    assert second["busy"] is update.payload
    assert second["c0"].generation.members == ("c0", "c1")
    assert third["busy"].generation.members == ("busy", "c0", "c1")
    assert third["busy"].generation.number == 3


def test_a_member_that_never_came_to_a_failed_rendezvous_sits_the_next_versions_out(
    monkeypatch,
):
    """busy did not come to version 1's rendezvous (a long method; the hub marks it
    behind only once that delivery times out, later): version 2, planned as version 1's
    collective failed, made it a member again, and every other member waited the
    group's whole timeout for it once more (their fallback then too late for the
    broadcast). It reads the learner's copy alone for the group's timeout, then is a
    member again."""
    from raysync.transports.distributed import planner as planner_module

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(planner_module.time, "monotonic", lambda: clock.now)
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info(w) for w in ("busy", "c0", "c1")]
    second_update = _Update(2)

    async def run() -> list[dict]:
        for target in targets:
            await planner.receiver_joined(target)
        rank0.broadcast.answer = "rank 0: busy did not join process-group generation 1"
        rank0.absent_from.answer = ("busy",)
        planned = [await planner.plan(_Update(1), SPEC, targets)]
        rank0.broadcast.answer = None
        planned.append(await planner.plan(second_update, SPEC, targets))
        clock.now += planner._settings.timeout_s + 1
        planned.append(await planner.plan(_Update(3), SPEC, targets))
        return planned

    first, second, third = asyncio.run(run())
    assert first["busy"].generation.members == ("busy", "c0", "c1")
    assert ("absent_from", (1,)) in rank0.calls
    assert second["busy"] is second_update.payload
    assert second["c0"].generation.members == ("c0", "c1")
    assert third["busy"].generation.members == ("busy", "c0", "c1")


def test_a_receiver_is_told_the_generations_formed_before_it_registered():
    """It takes no part in those (see DistributedReceiver): the first it is planned in
    is numbered after them."""
    rank0 = _Rank0()
    planner = _planner(rank0)

    async def run() -> tuple[Any, Any, dict]:
        first = await planner.receiver_joined(_info("c0"))
        await planner.plan(_Update(1), SPEC, [_info("c0")])
        again = await planner.receiver_joined(_info("c0"))  # registered again
        return first, again, await planner.plan(_Update(2), SPEC, [_info("c0")])

    first, again, planned = asyncio.run(run())
    assert (first.worker, first.formed_before) == ("c0", 0)
    assert (again.worker, again.formed_before) == ("c0", 1)
    assert planned["c0"].generation.number == 2


def test_a_rank_0_restarted_on_the_same_port_gets_a_new_generation():
    """Ray restarted rank 0 and its store bound the port the old one had: the planner,
    comparing host and port, kept the old generation, whose members broadcast on a
    group whose rank 0 was gone while the new rank 0 waited at that generation's
    rendezvous on an empty store: everyone waited the group's timeout."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    targets = [_info(w) for w in ("c0", "c1")]

    async def run() -> tuple[int, int]:
        for target in targets:
            await planner.receiver_joined(target)
        rank0.store_address.answer = StoreAddress("127.0.0.1", 1, "first")
        first = await planner.plan(_Update(1), SPEC, targets)
        rank0.store_address.answer = StoreAddress("127.0.0.1", 1, "restarted")
        second = await planner.plan(_Update(2), SPEC, targets)
        return first["c0"].generation.number, second["c0"].generation.number

    assert asyncio.run(run()) == (1, 2)


def test_a_process_with_two_receivers_takes_part_in_the_group_once():
    """One actor attached two receivers of the hub under two worker ids: as two ranks
    of one actor, called one at a time, each waited at the rendezvous for the other,
    and the whole group for its timeout, at every version. The second reads the
    learner's copy, or, with none (a bucketed version), fails alone, saying why."""
    rank0 = _Rank0()
    planner = _planner(rank0)
    twin = dataclasses.replace(_info("c1b"), process="process-c1")
    targets = [_info("c0"), _info("c1"), twin]

    async def run() -> dict:
        for target in targets:
            await planner.receiver_joined(target)
        return await planner.plan(_Update(1), SPEC, targets)

    planned = asyncio.run(run())
    assert planned["c1b"] == ObjectStorePayload(())  # the learner's copy
    assert planner._generation.members == ("c0", "c1")

    bucketed = _planner(_Rank0())
    update = _Update(1)
    broker = SimpleNamespace(readers=_Call([], "readers", None))
    update.payload = BucketStream(broker, StreamId("s", 3, 5.0), 1024)

    async def plan_bucketed() -> dict:
        for target in targets:
            await bucketed.receiver_joined(target)
        return await bucketed.plan(update, SPEC, targets)

    unplanned = asyncio.run(plan_bucketed())["c1b"]
    assert isinstance(unplanned, Unplanned) and "takes part in it once" in unplanned.reason


# -- A member that dies as its generation forms ----------------------------------------
# A member that dies right after it arrived at its generation's rendezvous (killed
# 40 ms after ``broadcast.remote``): the hub can no longer call that generation off, and
# every other rank, rank 0 too, waited in gloo's own wait for it, the group's whole
# timeout (30 s, longer than the broadcast's 20 s). The survivors' fallback read came
# too late, and the next version's plan, waiting for rank 0's collective, failed every
# target ("could not plan the delivery within the 20 s timeout", no word of what it
# waited for). Without Ray: the planner with a stand-in for rank 0's actor, and real
# gloo groups in threads.


#: The group's timeout: what the ranks waited for a member that died as it joined.
GROUP_TIMEOUT_S = 30.0
#: What is left of the broadcast's time when the hub asks for the plan.
PLAN_S = 4.0


def _plan_within(planner: Any, version: int, targets: list, plan_s: float) -> dict:
    """``planner``'s plan of ``version`` as the hub asks for it: within ``plan_s``
    (``PLAN_DEADLINE``); a plan that waits longer fails here, after twice that."""

    async def planned() -> dict:
        PLAN_DEADLINE.set(time.monotonic() + plan_s)
        return await planner.plan(_Update(version), SPEC, targets)

    async def run() -> dict:
        return await asyncio.wait_for(planned(), 2 * plan_s)

    return asyncio.run(run())


def test_a_member_dead_right_after_the_rendezvous_holds_the_others_a_share_of_the_plan():
    settings = DistributedOptions(backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    actor = ProcessGroupActor(settings)  # rank 0, in this process
    rank0 = _Rank0()
    rank0.store_address.answer = asyncio.run(actor.store_address())
    planner = _planner(rank0)
    planner._settings = settings
    targets = [_info("a"), _info("dies")]

    async def joined() -> None:
        for target in targets:
            await planner.receiver_joined(target)

    asyncio.run(joined())
    planned = _plan_within(planner, 1, targets, PLAN_S)
    assert all(isinstance(p, GroupPayload) for p in planned.values()), planned
    generation = planned["a"].generation
    job = next(args[0] for name, args in rank0.calls if name == "broadcast")
    outcomes: dict[str, Any] = {}

    def rank_0() -> None:  # the job's join, as rank 0's actor runs it
        outcomes["rank 0"] = actor._collective(job, "its rendezvous", None)

    def member_a() -> None:
        try:
            outcomes["a"] = join_group(generation, planned["a"].rank)
        except Exception as err:  # what the member's fetch falls back on
            outcomes["a"] = err

    def member_that_dies() -> None:
        # Arrives (counted: the rendezvous completes, nobody can call it off), then its
        # process is gone before it makes its part of the group.
        store = dist.TCPStore(
            generation.store.host, generation.store.port, is_master=False, timeout=settings.timeout
        )
        _everyone_here(dist.PrefixStore(generation.prefix, store), generation, 2)
        outcomes["dies"] = "arrived"

    started = time.monotonic()
    threads = [threading.Thread(target=f, daemon=True) for f in (rank_0, member_a)]
    for thread in threads:
        thread.start()
    member_that_dies()
    for thread in threads:
        thread.join(GROUP_TIMEOUT_S + 10)
    waited_s = time.monotonic() - started
    try:
        assert set(outcomes) == {"rank 0", "a", "dies"}, outcomes
        # The others gave the group up within the plan's share (half of what was left
        # of the broadcast's time), not the group's 30 s: a reads the learner's copy in
        # time, and rank 0 is free for the next version.
        assert waited_s < GROUP_TIMEOUT_S / 2, waited_s
        assert isinstance(outcomes["a"], RuntimeError), outcomes["a"]
        for outcome in (str(outcomes["a"]), outcomes["rank 0"]):
            assert f"generation {generation.number} did not form within" in outcome, outcome
    finally:
        asyncio.run(actor.close())


#: A member's process (``sys.argv``: the generation's store host, port, prefix,
#: members and form_s; its rank): it joins the generation, and is stopped as it forms.
_MEMBER = f"""
import sys
from raysync.transports.distributed import Generation, StoreAddress, join_group
from raysync.transports.options import DistributedOptions
host, port, prefix, members, form_s, rank = sys.argv[1:]
generation = Generation(
    1, tuple(members.split(",")), prefix, StoreAddress(host, int(port)),
    DistributedOptions(backend="gloo", timeout_s={GROUP_TIMEOUT_S!r}), form_s=float(form_s),
)
join_group(generation, int(rank))
"""


def test_a_member_stopped_once_it_published_its_address_holds_no_one_past_formation():
    """The member made its part of the group (its address is in the store) and stopped
    there (killed a moment later: its listening socket refuses the others, or the
    process hangs): gloo waited five times its timeout for each connection to it, and
    rank 0 and the other member sat in gloo's constructor for 150 s."""
    import torch.distributed as dist

    from raysync.transports.distributed import Generation, StoreAddress

    settings = DistributedOptions(backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    form_s = PLAN_S / 2  # what the planner gives a generation with PLAN_S left
    generation = Generation(
        1,
        ("a", "stops"),
        "raysync/g1/",
        StoreAddress("127.0.0.1", master.port),
        settings,
        form_s=form_s,
    )
    args = [master.host, str(master.port), generation.prefix, "a,stops", str(form_s), "2"]
    member = subprocess.Popen([sys.executable, "-c", _MEMBER, *args])
    outcomes: dict[str, Any] = {}
    try:
        published = f"{generation.prefix}/0/2"  # gloo's key of rank 2's address
        by = time.monotonic() + GROUP_TIMEOUT_S

        def join(rank: int) -> None:
            try:
                outcomes[str(rank)] = join_group(generation, rank, master if rank == 0 else None)
            except Exception as err:  # what rank 0 reports, and a member falls back on
                outcomes[str(rank)] = err

        threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        while not master.check([published]):  # it arrived and made its part
            assert member.poll() is None and time.monotonic() < by, "rank 2 never formed"
            time.sleep(0.001)
        member.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        for thread in threads:
            thread.join(GROUP_TIMEOUT_S + 10)
        waited_s = time.monotonic() - started
        assert set(outcomes) == {"0", "1"}, outcomes
        for outcome in outcomes.values():
            assert isinstance(outcome, RuntimeError), outcome
            assert "generation 1 did not form within 2 s" in str(outcome), outcome
        assert waited_s < GROUP_TIMEOUT_S / 2, waited_s
    finally:
        member.kill()
        member.wait()


def test_a_plan_whose_last_collective_rank_0_has_not_ended_reads_the_copy_alone(caplog):
    """Rank 0 is still in the last version's collective (its group forming with a
    member that died). The next plan waited for it until the hub gave the plan up, and
    every target failed. It waits half of what is left, says so, and its targets read
    the learner's copy alone; once rank 0 answers, the generation goes on."""
    rank0 = _Rank0()
    answers = _AnswersWhenLet(rank0.broadcast)  # its collectives answer once let
    rank0.broadcast = answers  # type: ignore[assignment]
    planner = _planner(rank0)
    targets = [_info("c0"), _info("c1")]
    updates = [_Update(version) for version in (1, 2, 3)]

    async def run() -> list[Any]:
        for target in targets:
            await planner.receiver_joined(target)
        planned: list[Any] = [await planner.plan(updates[0], SPEC, targets)]
        PLAN_DEADLINE.set(time.monotonic() + 1.0)
        planned.append(await asyncio.wait_for(planner.plan(updates[1], SPEC, targets), 5.0))
        PLAN_DEADLINE.set(None)
        answers.let.set()  # rank 0 ends the first collective: it went well
        planned.append(await planner.plan(updates[2], SPEC, targets))
        return planned

    with caplog.at_level(logging.WARNING, logger="raysync.transports.distributed.planner"):
        first, second, third = asyncio.run(run())
    assert first["c0"].generation.number == 1
    assert second == {"c0": updates[1].payload, "c1": updates[1].payload}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "has not ended collective 0 of process-group generation 1 (version 1 of model "
        "'m' to c0, c1)" in message
        for message in warned
    ), warned
    assert (third["c0"].generation.number, third["c0"].seq) == (1, 1)
