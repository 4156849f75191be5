"""One dead receiver fails only itself: every transport, every moment it can die.

A receiver is killed (``ray.kill``, a real process death) at one of four moments of a
broadcast, with and without Ray restarting it:

* ``before`` — between two broadcasts: the hub learns of the death only by delivering;
* ``queued`` — right after ``broadcast.remote`` returned, while it is busy in a user
  method (the others are already receiving: inside the collective, the RPCs, the
  reads). A victim that Ray restarts may get that delivery in its new incarnation
  (the kill landed before the hub sent it): it then acks, holding the version;
* ``transfer`` — inside its transport's ``fetch``, before its data moved;
* ``apply`` — at the safe point, after its data arrived.

Every survivor acks that version and holds it bitwise when the ack future resolves; the
victim alone is in ``failed``, with a cause that says it died. A victim that Ray
restarts registers again from ``__init__`` and holds the latest version, bitwise, when
its first call runs (nobody calls it for that).

One test per transport and restart setting goes through the four moments in turn on
one hub, a different victim each time. The transports that form a group
(``distributed``, ``rpc``) are where a death differs most from the rest; ``make test``
runs restarted victims on them and on the default transport, ``make test-all`` both
settings on every transport (each case takes 25-85 s on a 2-core machine: the CI
suite's time limit counts). A victim that stays dead is covered in ``make test``
elsewhere: the conformance kit kills a receiver between broadcasts on every transport,
``tests/test_distributed.py``, ``tests/test_rpc.py`` and ``tests/test_buckets.py`` kill
group members (a distributed one midway through a version), and a restarted victim
here fails at the transfer and apply moments as a dead one does. The
seconds from each kill to the restarted victim holding the version are recorded as test
properties (``--junitxml``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from raysync import DistributedOptions, RpcOptions
from tests.helpers import assert_same, ready, start_hub, transport_params, wait_for_file
from tests.receivers import make_policy, start_victim, state_of

MOMENTS = ("before", "queued", "transfer", "apply")
#: Where each moment holds the victim (None: it is killed while idle).
_STALL_AT = {"before": None, "queued": "busy", "transfer": "fetch", "apply": "apply"}
_TRANSPORT_TIMEOUT_S = 10
_BROADCAST_TIMEOUT_S = 45


#: Short data-path timeouts: a transport that waits for the dead member waits this long.
_OPTIONS = (
    DistributedOptions(timeout_s=_TRANSPORT_TIMEOUT_S),
    RpcOptions(timeout_s=_TRANSPORT_TIMEOUT_S),
)


def _wait_for_incarnation_after(victim, killed_at: float, timeout_s: float = 60.0) -> None:
    """Until the victim's answer comes from an incarnation that connected after the kill
    (an answer may still come from the old one while the kill is on its way)."""
    deadline = time.monotonic() + timeout_s
    while ray.get(victim.connected.remote(), timeout=timeout_s) <= killed_at:
        assert time.monotonic() < deadline, "the victim did not restart"


#: Transports whose members form one group, that a dead member must not take down.
_GROUP_TRANSPORTS = ("distributed", "rpc")


def _cases() -> list:
    """(transport, restarts): restarted victims on the group transports and the default;
    the other cases ``slow``."""
    return [
        pytest.param(
            p.values[0],
            restarts,
            marks=[*p.marks, *(() if restarts else (pytest.mark.slow,))],
            id=f"{p.id}-{label}",
        )
        for restarts, label in ((True, "restarts"), (False, "no_restart"))
        for p in transport_params(heavy=True, keep=_GROUP_TRANSPORTS)
    ]


@pytest.mark.parametrize(("transport", "restarts"), _cases())
def test_dead_receiver_fails_only_itself(actors, tmp_path, record_property, transport, restarts):
    """The four moments in turn, a different victim each time, on one hub: a restarted
    victim is a receiver again for the next moment; one that is not stays dead."""
    hub = start_hub(actors, transport, options=_OPTIONS)
    names = tuple(f"r{i}" for i in range(len(MOMENTS) + 2))
    receivers = {n: start_victim(hub, n, str(tmp_path), restarts=restarts) for n in names}
    actors.extend(receivers.values())
    ready(receivers.values())
    ray.get(hub.broadcast.remote(make_policy()))
    alive = list(names)
    for victim_name, moment in zip(names[1:-1], MOMENTS, strict=True):
        caught_up_s = _kill_at(hub, receivers, tuple(alive), victim_name, moment, restarts)
        if restarts:
            record_property(f"{moment}_caught_up_s", caught_up_s)
        else:
            alive.remove(victim_name)

    # The hub dropped the dead and goes on: the next version reaches everyone alive.
    assert {r.worker for r in ray.get(hub.status.remote()).receivers} == set(alive)
    report = ray.get(hub.broadcast.remote(make_policy(), timeout_s=_BROADCAST_TIMEOUT_S))
    assert report.acked == tuple(alive) and report.failed == {}


def _kill_at(hub, receivers, alive, victim_name, moment, restarts) -> float | None:
    """Kill ``victim_name`` at ``moment`` of one broadcast to ``alive``; check the report
    and every survivor; with ``restarts``, return the seconds from the kill until the
    new incarnation held that version."""
    victim = receivers[victim_name]
    survivors = tuple(n for n in alive if n != victim_name)
    stall_dir = Path(ray.get(victim.stall_path.remote()))
    learner = make_policy()
    where = _STALL_AT[moment]
    if where is None:
        killed_at = time.time()
        ray.kill(victim, no_restart=not restarts)
        if restarts:  # back and registered again before the broadcast: a target like any
            _wait_for_incarnation_after(victim, killed_at)
        ref = hub.broadcast.remote(learner, timeout_s=_BROADCAST_TIMEOUT_S, raise_on_failure=False)
    else:
        stall = stall_dir / f"stall-{where}-{victim_name}"
        stall.touch()
        if where == "busy":
            victim.busy.remote()
            wait_for_file(stall_dir / f"inside-busy-{victim_name}")
        ref = hub.broadcast.remote(learner, timeout_s=_BROADCAST_TIMEOUT_S, raise_on_failure=False)
        if where != "busy":
            wait_for_file(stall_dir / f"inside-{where}-{victim_name}")
        killed_at = time.time()
        ray.kill(victim, no_restart=not restarts)
    report = ray.get(ref, timeout=_BROADCAST_TIMEOUT_S + 30)
    if where is not None:
        stall.unlink()

    if where is None and restarts:
        assert report.acked == alive and report.failed == {}, (moment, report)
    elif moment == "queued" and restarts and report.failed == {}:
        # The kill may land before the hub's delivery reaches the victim: Ray then holds
        # the delivery for the new incarnation, which registered again and applies it.
        assert report.acked == alive, (moment, report)
    else:
        assert report.acked == survivors, (moment, report)
        assert set(report.failed) == {victim_name}, (moment, report)
        assert "died" in report.failed[victim_name], (moment, report.failed[victim_name])
        assert "Victim" in report.failed[victim_name], (moment, report.failed[victim_name])
    for name in survivors:
        assert ray.get(receivers[name].version.remote()) == report.version, (moment, name)
        assert_same(ray.get(receivers[name].state.remote()), state_of(learner))
    if not restarts:
        return None
    # The new incarnation caught up by itself (its __init__ registered again).
    assert ray.get(victim.version.remote(), timeout=60) == report.version, moment
    assert_same(ray.get(victim.state.remote()), state_of(learner))
    return round(ray.get(victim.applied_time.remote(report.version)) - killed_at, 2)
