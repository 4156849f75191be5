"""The ``rpc`` transport: rpc_async pushes, dynamic membership repaired around dead members.

Real processes and real failures: receivers are killed with ``ray.kill`` or kept busy
in a user method; the hub must answer within its timeout and the group must keep
admitting new receivers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
import ray
import torch
from ray.experimental import internal_kv

from raysync import BroadcastError, RpcOptions, WeightHub
from raysync.actors.rpc_agent import AgentStatus
from raysync.hub_snapshot import KV_NAMESPACE
from raysync.testing import special_weights
from raysync.transports.rpc import JOIN_TOKEN_KEY, MEMBER_LIST_KEY, open_master_store
from raysync.transports.rpc.rendezvous import _group_store
from tests.helpers import (
    Gate,
    actor_pid,
    assert_bitwise,
    assert_policy_reaches,
    free_and_reach_all,
    hold_until_opened,
    ready,
    start,
    wait_dead,
    wait_process_exit,
    wait_until,
)
from tests.receivers import (
    Collector,
    Holder,
    OtherLearner,
    PlainWorker,
    attach_actor_net,
    close_receiver,
    connect_policy_again,
    fail_next_rpc_join,
    make_policy,
    rpc_versions_kept,
    state_of,
)

_TIMEOUT_S = 10


def start_rpc_hub(actors):
    hub = WeightHub.remote(transport="rpc", options=RpcOptions(timeout_s=_TIMEOUT_S))
    actors.append(hub)
    return hub


def agent_status(hub) -> AgentStatus:
    actor = ray.get_actor(f"raysync-rpc-agent-{hub.config.hub_id}")
    return ray.get(actor.describe.remote())


def test_bitwise_every_version(actors):
    hub = start_rpc_hub(actors)
    template = special_weights()
    holders = [start(actors, Holder, hub, template, f"w{i}") for i in range(3)]
    ready(holders)
    for version in range(1, 4):
        weights = special_weights(float(version))
        report = ray.get(hub.broadcast.remote(weights))
        assert report.version == version and report.acked == ("w0", "w1", "w2")
        for holder in holders:
            assert_bitwise(ray.get(holder.state.remote()), weights)
    # The agent counts an RPC once its future completes, which can be just after the
    # receiver already acked: give its bookkeeping a moment.
    deadline = time.monotonic() + 30
    status = agent_status(hub)
    while status.sent < 9 and time.monotonic() < deadline:
        time.sleep(0.1)
        status = agent_status(hub)
    assert sorted(status.members) == ["w0", "w1", "w2"]
    assert status.sent == 9 and status.failures == ()


def test_a_receiver_closed_while_busy_keeps_none_of_what_landed_for_it(actors):
    """Versions land on the RPC threads while the host is busy; its receiver then
    closed, and their deliveries, queued behind, found it closed and took nothing:
    what had landed was kept for the process's life (a whole model each)."""
    hub = start_rpc_hub(actors)
    template = special_weights()
    busy, other = (start(actors, Holder, hub, template, w) for w in ("busy", "other"))
    ready([busy, other])
    ray.get(hub.broadcast.remote(special_weights(1.0)))
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)
    closing = busy.__ray_call__.remote(close_receiver)  # queued behind the hold
    for value in (2.0, 3.0):
        report = ray.get(
            hub.broadcast.remote(special_weights(value), timeout_s=3, raise_on_failure=False)
        )
        assert report.acked == ("other",), report
    wait_until(lambda: agent_status(hub).sent == 6, what="both versions landed in busy")
    ray.get(gate.open.remote())
    ray.get([blocked, closing])
    assert ray.get(busy.__ray_call__.remote(rpc_versions_kept)) == 0


def test_a_stopped_receiver_holds_up_none_of_the_others_sends(actors):
    """A receiver whose process stopped (SIGSTOP: alive, answering nothing) leaves each
    send's call to it pending for the agent's RPC timeout. Each send waited for its
    calls on a thread of the agent's default pool (6 threads on 2 cores): a few
    broadcasts in a row took them all, and the next ones' versions reached the healthy
    receivers only after their timeout. The agent waits for its calls on its loop."""
    hub = start_rpc_hub(actors)
    template = special_weights()
    victim, *healthy = (start(actors, Holder, hub, template, w) for w in ("stops", "h0", "h1"))
    ready([victim, *healthy])
    ray.get(hub.broadcast.remote(special_weights(1.0)))
    pid = actor_pid(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        pool = min(32, (os.cpu_count() or 1) + 4)  # asyncio.to_thread's threads
        tickets = ray.get(
            [
                hub.broadcast.remote(
                    special_weights(float(v)), wait=False, timeout_s=3, raise_on_failure=False
                )
                for v in range(2, pool + 5)
            ]
        )
        reports = ray.get([hub.wait_for.remote(t, raise_on_failure=False) for t in tickets])
        assert all(r.acked == ("h0", "h1") for r in reports), [r.failed for r in reports]
        last = special_weights(float(pool + 4))
        for holder in healthy:
            assert_bitwise(ray.get(holder.state.remote()), last)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_receiver_leaving_while_another_joins_holds_up_no_plan(actors):
    """A receiver that leaves is taken off the group's member list by the agent, which
    waits for the group's join token; a receiver joining holds it, up to the RPC
    timeout (one whose call to a dead member waits). The planner waited for that under
    the lock its plans take: every broadcast meanwhile failed everyone, "could not
    plan"."""
    import torch.distributed as dist

    hub = start_rpc_hub(actors)
    template = special_weights()
    leaver, *staying = (start(actors, Holder, hub, template, w) for w in ("leaves", "s0", "s1"))
    ready([leaver, *staying])
    ray.get(hub.broadcast.remote(special_weights(1.0)))
    group = dist.PrefixStore("rpc_prefix_0", _group_store(agent_status(hub).url))
    joining = "Token_for_joining_join"  # as torch's join holds it
    assert group.compare_set(JOIN_TOKEN_KEY, "", joining).decode() == joining
    try:
        ray.get(leaver.__ray_call__.remote(close_receiver))
        weights = special_weights(2.0)
        report = ray.get(hub.broadcast.remote(weights, timeout_s=3, raise_on_failure=False))
        assert report.acked == ("s0", "s1"), report.failed
        for holder in staying:
            assert_bitwise(ray.get(holder.state.remote()), weights)
    finally:
        group.set(JOIN_TOKEN_KEY, "")


def test_a_closed_hub_leaves_no_rank_book_in_the_gcs(actors):
    """The receivers' ranks are kept in the GCS for a restarted hub or a new agent; a
    closed hub is neither: they were kept for the cluster's life, one key per hub."""
    hub = start_rpc_hub(actors)
    collector = start(actors, Collector, hub, worker_id="c0", transport="rpc")
    ready([collector])
    key = f"hub/{hub.config.hub_id}/rpc-ranks"
    assert internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) is not None
    ray.get(hub.close.remote())
    ray.get(collector.__ray_call__.remote(close_receiver))  # it leaves the closed hub after
    assert internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) is None


def test_killed_receiver_fails_and_the_next_broadcast_reaches_the_others(actors):
    hub = start_rpc_hub(actors)
    survivors = [start(actors, Collector, hub, worker_id=f"ok{i}") for i in range(2)]
    victim = start(actors, Collector, hub, worker_id="victim")
    ready([*survivors, victim])
    ray.get(hub.broadcast.remote(make_policy()))

    ray.kill(victim)
    wait_dead(victim)  # else the next broadcast's call may still reach it
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False), timeout=60)
    # Each receiver has its own RPC: the dead one fails alone.
    assert report.acked == ("ok0", "ok1")
    assert "died" in report.failed["victim"]
    for s in survivors:
        assert_bitwise(ray.get(s.state.remote()), state_of(learner))

    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner), timeout=60)
    assert report.acked == ("ok0", "ok1") and report.failed == {}
    assert sorted(agent_status(hub).members) == ["ok0", "ok1"]


def test_receiver_joins_after_an_unnoticed_death(actors):
    """A member that died between broadcasts is still on torch's member list, and a
    joiner calls every listed member: the agent must unlist it or the join fails."""
    hub = start_rpc_hub(actors)
    first = start(actors, Collector, hub, worker_id="first")
    doomed = start(actors, Collector, hub, worker_id="doomed")
    ready([first, doomed])
    ray.get(hub.broadcast.remote(make_policy()))
    ray.kill(doomed)  # the hub learns of it only at the next broadcast

    late = start(actors, Collector, hub, worker_id="late")
    assert ray.get(late.version.remote(), timeout=60) == 1
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False), timeout=60)
    assert report.acked == ("first", "late")
    assert "died" in report.failed["doomed"]
    for c in (first, late):
        assert_bitwise(ray.get(c.state.remote()), state_of(learner))


def test_busy_receiver_times_out_alone_and_catches_up(actors):
    hub = start_rpc_hub(actors)
    template = {"w": torch.zeros(2048, 1024)}  # 8 MB
    holders = [start(actors, Holder, hub, template, f"h{i}") for i in range(2)]
    busy = start(actors, Holder, hub, template, "busy")
    ready([*holders, busy])

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)  # one method at a time: its delivery waits
    weights = {"w": torch.randn(2048, 1024)}
    report = ray.get(
        hub.broadcast.remote(weights, timeout_s=3.0, raise_on_failure=False), timeout=60
    )
    assert report.acked == ("h0", "h1")
    assert "within the 3 s timeout" in report.failed["busy"]
    free_and_reach_all(hub, gate, blocked, [*holders, busy], ("busy", "h0", "h1"))


def _unreadable(payload) -> bool:
    """Whether the object-store copy ``payload`` is gone (its owner died)."""
    try:
        payload.arrays(timeout_s=5)
    except ray.exceptions.ObjectLostError:
        return True
    return False


def test_a_version_whose_copy_is_lost_before_the_agent_reads_it_fails_at_once(actors):
    """The learner died between its broadcast and the agent's read of its copy (the
    agent was stopped meanwhile): every receiver fails that version with the agent's
    reason as soon as it tries, not at its timeout with a guess ("did not land ... the
    RPC agent may have died"); the next broadcast reaches them."""
    hub = start_rpc_hub(actors)
    template = {"w": torch.zeros(1024, 256)}  # 1 MB: in the object store, not inlined
    holders = [start(actors, Holder, hub, template, f"w{i}") for i in range(2)]
    ready(holders)
    assert ray.get(hub.broadcast.remote({"w": torch.ones(1024, 256)})).acked == ("w0", "w1")
    agent_pid = actor_pid(ray.get_actor(f"raysync-rpc-agent-{hub.config.hub_id}"))
    learner = start(actors, OtherLearner, hub)
    learner_pid = actor_pid(learner)
    os.kill(agent_pid, signal.SIGSTOP)  # the hub's plan waits for its ping
    try:
        ticket = ray.get(learner.broadcast.remote({"w": torch.full((1024, 256), 2.0)}, wait=False))
        ray.kill(learner)  # its copy in the object store goes with it
        wait_process_exit(learner_pid)
        lost = ray.get(hub.latest.remote("m")).payload  # that copy, version 2
        wait_until(lambda: _unreadable(lost), what="Ray to let the dead learner's copy go")
    finally:
        os.kill(agent_pid, signal.SIGCONT)
    with pytest.raises(BroadcastError) as info:
        ray.get(hub.wait_for.remote(ticket), timeout=60)
    failed = info.value.report.failed
    assert sorted(failed) == ["w0", "w1"], failed
    for why in failed.values():
        assert "could not read the update" in why and "did not land" not in why, why
    weights = {"w": torch.full((1024, 256), 3.0)}
    assert ray.get(hub.broadcast.remote(weights), timeout=60).acked == ("w0", "w1")
    for holder in holders:
        assert_bitwise(ray.get(holder.state.remote()), weights)


def test_pull_mode_reads_the_learner_copy(actors):
    hub = start_rpc_hub(actors)
    puller = start(actors, Collector, hub, worker_id="puller", mode="pull")
    ready([puller])
    learner = make_policy()
    ray.get(hub.broadcast.remote(learner))
    assert ray.get(puller.pull.remote()) == {"policy": 1}
    assert_bitwise(ray.get(puller.state.remote()), state_of(learner))
    assert agent_status(hub).sent == 0


@pytest.mark.parametrize("kill", ["ray.kill", "SIGKILL"])
def test_killed_agent_is_replaced_and_its_members_follow_it(actors, kill):
    """Killed by Ray, or its process by a signal: Ray then kept the agent's name for the
    dead one in the hub, which holds a handle of it, and refused the new agent that
    name at every plan: every broadcast failed every receiver for good."""
    hub = start_rpc_hub(actors)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    ray.get(hub.broadcast.remote(make_policy()))
    before = agent_status(hub)

    agent = ray.get_actor(f"raysync-rpc-agent-{hub.config.hub_id}")
    if kill == "ray.kill":
        ray.kill(agent)
    else:
        os.kill(actor_pid(agent), signal.SIGKILL)
    # The hub finds the agent dead at the next plan, starts a new group and re-admits
    # every member at its rank; each receiver moves to the new group on that delivery.
    assert_policy_reaches(hub, collectors, ("c0", "c1"))
    after = agent_status(hub)
    assert after.url != before.url
    assert sorted(after.members) == ["c0", "c1"]
    assert {int(n.rsplit("_", 1)[1]) for n in after.members.values()} == {
        int(n.rsplit("_", 1)[1]) for n in before.members.values()
    }

    # The new group admits newcomers, and the one after that reaches all three.
    late = start(actors, Collector, hub, worker_id="late")
    assert ray.get(late.version.remote()) == 2
    assert_policy_reaches(hub, [*collectors, late], ("c0", "c1", "late"))


def test_an_agent_replacement_cut_short_by_a_timeout_is_finished_by_the_next_plan(actors):
    """The agent dies; the next broadcast's timeout ends while the hub waits for the new
    agent to start. Its members must still be read from the new agent: the broadcast
    after that reaches every receiver."""
    hub = start_rpc_hub(actors)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    ray.get(hub.broadcast.remote(make_policy()))
    ray.kill(ray.get_actor(f"raysync-rpc-agent-{hub.config.hub_id}"))
    report = ray.get(
        hub.broadcast.remote(make_policy(), timeout_s=0.05, raise_on_failure=False), timeout=60
    )
    assert set(report.failed) == {"c0", "c1"}  # cut short: nobody got it
    assert_policy_reaches(hub, collectors, ("c0", "c1"))


def test_a_live_process_that_left_the_hub_attaches_again(actors):
    """torch RPC keeps a process's rank for life: a receiver process that closed its
    receiver (left the hub) and attaches again gets its old place back."""
    hub = start_rpc_hub(actors)
    worker = start(actors, PlainWorker)
    for attachment in range(2):
        ray.get(worker.__ray_call__.remote(attach_actor_net, hub, worker_id="again"))
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner, model="policy"), timeout=60)
        assert report.acked == ("again",), attachment
        held = ray.get(worker.__ray_call__.remote(lambda w: state_of(w.nets.actor)))
        assert_bitwise(held, state_of(learner))
        ray.get(worker.__ray_call__.remote(lambda w: w.receiver.close()))


def test_a_process_that_left_attaches_again_after_the_agent_was_replaced(actors):
    """A left process's place outlives the agent that gave it: a new agent (the old one
    died meanwhile) gives it back, not a fresh rank torch RPC would refuse."""
    hub = start_rpc_hub(actors)
    worker = start(actors, PlainWorker)
    ray.get(worker.__ray_call__.remote(attach_actor_net, hub, worker_id="again"))
    stays = start(actors, Collector, hub, worker_id="stays")  # the rank after it
    ready([stays])
    assert ray.get(hub.broadcast.remote(make_policy())).acked == ("again", "stays")
    ray.get(worker.__ray_call__.remote(lambda w: w.receiver.close()))
    ray.kill(ray.get_actor(f"raysync-rpc-agent-{hub.config.hub_id}"))
    assert ray.get(hub.broadcast.remote(make_policy())).acked == ("stays",)  # a new agent

    ray.get(worker.__ray_call__.remote(attach_actor_net, hub, worker_id="again"))
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False), timeout=60)
    assert report.acked == ("again", "stays"), report.failed
    held = ray.get(worker.__ray_call__.remote(lambda w: state_of(w.nets.actor)))
    assert_bitwise(held, state_of(learner))


def test_a_receiver_that_registers_again_by_another_transport_leaves_the_group(actors):
    """The hub tells the transport a receiver leaves when it registers again by
    another one: the agent forgets its member (it was kept for good before)."""
    hub = start_rpc_hub(actors)
    stays, moves = (start(actors, Collector, hub, worker_id=w) for w in ("stays", "moves"))
    ready([stays, moves])
    ray.get(hub.broadcast.remote(make_policy()))
    ray.get(moves.__ray_call__.remote(connect_policy_again, hub, transport="object_store"))
    wait_until(lambda: sorted(agent_status(hub).members) == ["stays"], what="moves forgotten")
    learner = make_policy()
    assert ray.get(hub.broadcast.remote(learner)).acked == ("moves", "stays")
    for receiver in (stays, moves):
        assert_bitwise(ray.get(receiver.state.remote()), state_of(learner))


def test_a_receiver_whose_move_to_a_new_agent_failed_moves_at_the_next_version(actors):
    """The agent was replaced; a receiver's move to the new group failed (it fails that
    version). It must try again with the next one, not stay out of every group."""
    hub = start_rpc_hub(actors)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    ray.get(hub.broadcast.remote(make_policy()))
    ray.get(collectors[0].__ray_call__.remote(fail_next_rpc_join))
    ray.kill(ray.get_actor(f"raysync-rpc-agent-{hub.config.hub_id}"))
    report = ray.get(hub.broadcast.remote(make_policy(), raise_on_failure=False), timeout=60)
    assert report.acked == ("c1",) and "(injected)" in report.failed["c0"]
    assert_policy_reaches(hub, collectors, ("c0", "c1"))


#: A process joining the RPC group at ``sys.argv[1]`` as "joiner", rank 2, twice if the
#: first join fails: then it prints the group's join token and, standing for the
#: agent's repair when the hub forgets a dead member, takes "ghost" off the member list
#: before it tries again.
_JOINER = """
import sys
import torch.distributed as dist
import torch.distributed.rpc as rpc
from raysync.transports.options import RpcOptions
from raysync.transports.rpc.rendezvous import (
    JOIN_TOKEN_KEY, MEMBER_LIST_KEY, _group_store, init_rpc
)
for attempt in (1, 2):
    try:
        init_rpc("joiner", 2, sys.argv[1], RpcOptions(timeout_s=2.0))
    except Exception as err:
        group = dist.PrefixStore(f"rpc_prefix_{rpc._init_counter - 1}", _group_store(sys.argv[1]))
        listed = group.get(MEMBER_LIST_KEY).decode()
        token = group.get(JOIN_TOKEN_KEY)
        print(f"join {attempt} failed:", err, "; listed:", listed, "; token:", token)
        group.set(MEMBER_LIST_KEY, listed.replace("ghost-1,", ""))
        with rpc._init_counter_lock:  # as the receiver does before each join
            rpc._init_counter = 0
    else:
        print(f"join {attempt}: joined")
        rpc.shutdown(graceful=False)
        break
"""


def test_a_process_whose_join_failed_can_join_again_and_holds_no_token():
    """torch's dynamic membership takes the group's join token when a join starts and
    gives it back only if the join succeeds: a join failed by a listed member that died
    meanwhile (here one that never was: its address never comes) kept it, and every
    later join, and the agent's edits of the member list, waited on it and failed. And
    torch RPC stayed initialized in that process: its every later join raised "RPC is
    already initialized". And torch left the joiner on the member list (its leave after
    the failure waits on a key of its own join): the next join under its name failed,
    "not unique", once the dead member was unlisted. Real torch RPC, in a process of its
    own (once per process)."""
    import torch.distributed as dist

    url, master = open_master_store("127.0.0.1", 2.0)
    # init_rpc's keys: the group's prefix, then its per-process count of init_rpc calls
    group = dist.PrefixStore("rpc_prefix_0", dist.PrefixStore(urlparse(url).path[1:] + "/", master))
    group.set(MEMBER_LIST_KEY, "ghost-1,")
    joiner = subprocess.run(
        [sys.executable, "-c", _JOINER, url], capture_output=True, text=True, timeout=120
    )
    first, second = joiner.stdout.splitlines()[:2]
    assert first.startswith("join 1 failed:") and "ghost" in first, joiner
    assert second == "join 2: joined", joiner
    assert first.endswith("; listed: ghost-1, ; token: b''"), joiner
