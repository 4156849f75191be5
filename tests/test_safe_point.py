"""Torn-weight probes: user code never sees a model that mixes two versions.

The safe point is the receiver's (raysync/gate.py): a transport only stages data
outside it and never touches the model, so these probes run on the default transport;
the conformance kit checks per transport that no applied version is torn."""

from __future__ import annotations

import pytest
import ray

from raysync.transports import DEFAULT_TRANSPORT
from tests.helpers import Gate, ready, start, start_hub, wait_for_file, wait_until
from tests.receivers import (
    AsyncProbe,
    AsyncStalled,
    Collector,
    FanOut,
    GroupLooper,
    HookCaller,
    ThreadedProbe,
    filled,
    make_policy,
    make_probe_model,
    state_of,
    waits_for_a_safe_point,
)

_TEMPLATE = make_probe_model()


def _probe_while_broadcasting(
    actors, hub, probe, safe_points: bool, first: int, broadcasts: int = 12, template=_TEMPLATE
):
    """Broadcast value ``first``, then ``broadcasts`` more while the probe reads its model
    for 2.5 s; the probe's result (reads, torn reads, the values it saw)."""
    ray.get(hub.broadcast.remote(filled(template, float(first))))
    if hub.config.channels:  # the first broadcast asked for the learner's channel
        assert hub.wait_channel("probe") != ()
    entered = start(actors, Gate)
    result_ref = probe.probe.remote(2.5, safe_points, entered)
    ray.get(entered.wait.remote())  # it holds the model before any version is sent
    acks = [
        hub.broadcast.remote(filled(template, float(v)), wait=False)
        for v in range(first + 1, first + broadcasts + 1)
    ]
    tickets = ray.get(acks)
    result = ray.get(result_ref)
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    assert all(r.failed == {} for r in reports)
    if hub.config.channels:  # some of them came by channel, on the compiled-graph thread
        assert any(r.channel for r in reports), reports
    return result


@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
@pytest.mark.parametrize("channels", [False, True], ids=["calls", "channels"])
@pytest.mark.parametrize("probe_cls", [ThreadedProbe, AsyncProbe], ids=["threaded", "async"])
def test_user_code_never_sees_a_torn_model(actors, transport, channels, probe_cls):
    """With safe points, updates land between the actor's reads and none is torn;
    without them, the model holds one version for the whole method (a threaded actor's
    method that never reaches a safe point, an async actor's until it returns). With
    channels the writes come on Ray's compiled-graph thread, beside the methods (a
    model small enough to travel by channel)."""
    width = 128 if channels else 256
    template = make_probe_model(width)
    hub = start_hub(actors, transport, channels=channels)
    probe = start(actors, probe_cls, hub, width=width)
    ready([probe])
    try:
        result = _probe_while_broadcasting(actors, hub, probe, True, first=1, template=template)
        assert result["reads"] > 10
        assert result["torn"] == 0
        # Updates really landed while the probe ran: it saw several versions.
        assert len(result["seen"]) > 1, result

        result = _probe_while_broadcasting(actors, hub, probe, False, first=100, template=template)
        assert result["torn"] == 0
        # It held the model before any of them was sent: they wait for it (the calls'
        # deliveries queue behind it, the channel's writes for its read to end).
        assert result["seen"] == [100.0], result
    finally:
        hub.release()


@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
def test_busy_async_actor_skips_to_the_newest_version(actors, transport):
    hub = start_hub(actors, transport)
    probe = start(actors, AsyncProbe, hub)
    ready([probe])
    ray.get(hub.broadcast.remote(filled(_TEMPLATE, 1.0)))
    entered = start(actors, Gate)
    busy = probe.probe.remote(4.0, False, entered)
    ray.get(entered.wait.remote())  # it holds the model before any version is sent
    tickets = ray.get(
        [hub.broadcast.remote(filled(_TEMPLATE, float(v)), wait=False) for v in range(2, 8)]
    )
    assert ray.get(busy)["seen"] == [1.0]
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    # Every version is acknowledged (the skipped ones as superseded by a newer one) ...
    assert all(r.failed == {} and len(r.acked) == 1 for r in reports)
    # ... but versions that queued up behind the busy method were never applied: only
    # the newest of them was, so the actor held one waiting version, not six.
    applied = ray.get(probe.applied_versions.remote())
    assert applied[0] == 1 and applied[-1] == 7 and applied == sorted(applied)
    assert len(applied) < 7, applied
    assert ray.get(probe.first_value.remote()) == 7.0


def test_an_async_actor_killed_while_its_version_waits_for_a_safe_point_fails_alone_at_once(
    actors,
):
    """The version was staged for the busy actor's next safe point (its delivery call
    had returned) when the actor was killed: nothing acks it any more, and the hub
    waited out the broadcast's whole timeout, then reported a timeout. It asks the actor
    which process it is now, and Ray's answer names the death."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    victim, survivor = start(actors, AsyncProbe, hub), start(actors, AsyncProbe, hub)
    ready([victim, survivor])
    entered = start(actors, Gate)
    victim.probe.remote(600.0, False, entered)  # holds its model until killed
    ray.get(entered.wait.remote())
    sent = hub.broadcast.remote(filled(_TEMPLATE, 2.0), timeout_s=300, raise_on_failure=False)
    wait_until(
        lambda: ray.get(victim.__ray_call__.remote(waits_for_a_safe_point)),
        what="the version waits for the victim's safe point",
    )
    ray.kill(victim, no_restart=True)
    report = ray.get(sent, timeout=60)  # well before the broadcast's 300 s
    assert (len(report.acked), len(report.failed)) == (1, 1), report
    (why,) = report.failed.values()
    assert "died before applying version" in why, why
    assert ray.get(survivor.first_value.remote()) == 2.0


def test_an_async_actor_fanning_out_to_its_own_methods_while_an_update_waits_goes_on(actors):
    """``generate`` holds the model when a broadcast arrives (its apply waits for
    ``generate`` to end) and then gathers ``generate_one`` calls: they see the version
    ``generate`` began with and go, ``generate`` ends, and the update lands (the calls
    used to wait for the update, which waited for ``generate``: stuck for good)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    engine = start(actors, FanOut, hub)
    ready([engine])
    ray.get(hub.broadcast.remote(filled(_TEMPLATE, 1.0)))
    entered = start(actors, Gate)
    generating = engine.generate.remote(3, entered)
    ray.get(entered.wait.remote())  # it holds the model before the version is sent
    report = hub.broadcast.remote(filled(_TEMPLATE, 2.0))
    assert ray.get(generating, timeout=30) == [1.0, 1.0, 1.0]
    assert ray.get(report, timeout=30).failed == {}
    assert ray.get(engine.generate_one.remote()) == 2.0


def test_a_streamed_reply_of_an_async_generator_method_is_of_one_version(actors):
    """An async generator method (a streamed reply) holds the model from its first item
    to its last: a broadcast arriving midway lands after it (it landed between two
    items, and the stream never heard of a deferred delivery)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    engine = start(actors, FanOut, hub)
    ready([engine])
    ray.get(hub.broadcast.remote(filled(_TEMPLATE, 1.0)))
    stream = engine.stream.remote(3)
    first = _next_item(stream)
    report = hub.broadcast.remote(filled(_TEMPLATE, 2.0))
    assert [first, _next_item(stream), _next_item(stream)] == [1.0, 1.0, 1.0]
    assert ray.get(report, timeout=30).failed == {}
    assert ray.get(engine.generate_one.remote()) == 2.0


def test_an_async_actor_starts_its_calls_while_a_version_is_read(actors, tmp_path):
    """A version's read does not hold an async actor: while its fetch is held, calls
    to the actor (from the learner's own process too) start and see the version before,
    and once the fetch goes on the version lands. (The mixin's delivery, a sync method,
    ran where Ray starts the actor's calls: none started until the read returned.)"""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    engine = start(actors, AsyncStalled, hub, str(tmp_path), "engine")
    ready([engine])
    stall = tmp_path / "stall-fetch-engine"
    stall.touch()
    try:
        report = hub.broadcast.remote(filled(make_probe_model(64, 4), 1.0))
        wait_for_file(tmp_path / "inside-fetch-engine")
        assert ray.get(engine.first_value.remote(), timeout=20) == 0.0
    finally:
        stall.unlink()
    done = ray.get(report, timeout=30)
    assert done.acked == ("engine",) and done.failed == {}, done
    assert ray.get(engine.first_value.remote()) == 1.0


def test_a_sync_loop_in_an_async_actors_concurrency_group_takes_versions_at_its_safe_points(
    actors,
):
    """The version's write goes back to the loop its delivery came on, and waits there
    for the loop's safe point: it went to the loop the receiver last saw a reader on,
    this group's, which the method holds, and landed only once the method returned."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    looper = start(actors, GroupLooper, hub)
    ready([looper])
    entered = start(actors, Gate)
    collecting = looper.collect.remote(entered)
    ray.get(entered.wait.remote())  # it loops before the version is sent
    report = ray.get(hub.broadcast.remote(filled(make_probe_model(64, 4), 1.0)), timeout=60)
    assert len(report.acked) == 1 and report.failed == {}, report
    ray.get(looper.stop.remote())
    assert ray.get(collecting, timeout=30) == [0.0, 1.0]


def _next_item(stream, timeout_s: float = 30.0):
    """The next item of a streamed reply; fail if none comes within ``timeout_s``."""
    ready, _ = ray.wait([stream], timeout=timeout_s)
    assert ready, f"no next item within {timeout_s:g} s"
    return ray.get(next(stream))


def test_on_weights_applied_may_call_the_actors_methods_and_close_it(actors):
    """The hook runs inside the apply: a public method of the actor it calls (a reader)
    or ``close()`` (which writes, to move zero-copy models out of shared memory) waited
    for the apply, which waited for the hook, and the actor hung for good."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    caller = start(actors, HookCaller, hub, "caller", close_at=3)
    other = start(actors, Collector, hub, worker_id="other")
    ready([caller, other])
    learners = [make_policy() for _ in range(4)]
    for learner in learners[:3]:
        report = ray.get(hub.broadcast.remote(learner), timeout=60)
        assert report.acked == ("caller", "other"), report
    report = ray.get(hub.broadcast.remote(learners[3]), timeout=60)
    assert (report.acked, report.failed) == (("other",), {})  # it left at version 3
    sums = [float(sum(t.sum() for t in state_of(learner).values())) for learner in learners]
    assert ray.get(caller.seen_sums.remote(), timeout=30) == pytest.approx(sums[:3])
