"""The pure parts of learners' channels (raysync/learner_channel.py), without Ray: the
hub's matching of channel replies to deliveries (a reply may come before its booking),
a receiver process's claim on its compiled-graph thread, the object store receiver's
copy of an inline version, which route targets a channel may reach, and the channel's
build racing a broadcast (its thread driven by the test, Ray's calls stood in for)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import ray
import torch
from ray.exceptions import OwnerDiedError

import raysync.learner_channel
import raysync.receiver_delivery
from raysync.channel_replies import (
    EARLY_REPLIES_KEPT,
    ChannelReplies,
    reply_unless_learner_died,
)
from raysync.learner_channel import ReceiverChannel, _Build, channel_targets
from raysync.messages import DirectTarget, Entry, Route, Update
from raysync.receiver_delivery import _ChannelClaim, claim_channel
from raysync.spec import WeightSpec
from raysync.transports.object_store.arrays import as_array
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.object_store.wire import InlinePayload


def test_a_reply_that_comes_after_its_booking_resolves_the_awaited_future():
    async def scenario():
        replies = ChannelReplies()
        future = replies.expect(("learner", "policy", 3, "c0"))
        assert not future.done()
        replies.arrive(("learner", "policy", 3, "c0"), "ack")
        return await future, len(replies)

    assert asyncio.run(scenario()) == ("ack", 0)


def test_a_reply_that_comes_before_its_booking_is_kept_for_it():
    async def scenario():
        replies = ChannelReplies()
        replies.arrive(("learner", "policy", 3, "c0"), None)
        future = replies.expect(("learner", "policy", 3, "c0"))
        other = replies.expect(("learner", "policy", 3, "c1"))  # no reply yet
        return future.done(), future.result(), other.done(), len(replies)

    assert asyncio.run(scenario()) == (True, None, False, 1)


def test_replies_never_booked_are_kept_up_to_a_bound_and_forgotten_deliveries_dropped():
    async def scenario():
        replies = ChannelReplies()
        for version in range(EARLY_REPLIES_KEPT + 10):
            replies.arrive(("learner", "policy", version, "c0"), None)
        kept = len(replies)
        oldest = replies.expect(("learner", "policy", 0, "c0"))  # pushed out: waits
        waits = not oldest.done()
        replies.forget([("learner", "policy", 0, "c0")])  # its wait is called off
        return kept, waits, oldest.cancelled(), len(replies)

    assert asyncio.run(scenario()) == (EARLY_REPLIES_KEPT, True, True, EARLY_REPLIES_KEPT)


def test_the_wait_for_a_reply_fails_when_its_learner_dies_and_only_then():
    """The learner owns its channel's loop on the receiver (a Ray task's ref, stood in
    for by a future): its death fails the loop with OwnerDiedError and the wait with it;
    a loop that ends otherwise (the graph torn down) leaves the wait to the reply."""

    async def scenario():
        replies = ChannelReplies()
        died = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(
            reply_unless_learner_died(replies.expect(("l", "policy", 2, "c0")), died)
        )
        died.set_exception(OwnerDiedError("ff" * 28, None, "the test's"))
        dead = False
        try:
            await waiting
        except OwnerDiedError:
            dead = True
        torn = asyncio.get_running_loop().create_future()
        torn.set_result(None)
        reply = replies.expect(("l", "policy", 3, "c0"))
        asyncio.get_running_loop().call_soon(replies.arrive, ("l", "policy", 3, "c0"), "ack")
        return dead, await reply_unless_learner_died(reply, torn)

    assert asyncio.run(scenario()) == (True, "ack")


class _LoopRef:
    """Stands in for the ref of a channel's loop: awaitable, named by ``hex``."""

    def __init__(self, name: str, end: asyncio.Future) -> None:
        self._name, self._end = name, end

    def hex(self) -> str:
        return self._name

    def __await__(self):
        return self._end.__await__()


def test_every_reply_through_one_loop_waits_beside_one_wait_for_its_end():
    """Each version's reply waited for its channel's loop to end with a wait of its
    own, cancelled once the reply came: Ray keeps a wait for a ref until the ref
    resolves, and a loop ends only with its graph: one kept per version and receiver.
    One wait per loop now, dropped once the loop ended."""

    async def scenario():
        replies = ChannelReplies()
        end = asyncio.get_running_loop().create_future()
        ref = _LoopRef("loop-c0", end)
        waits = {id(replies.loop_end(ref)) for _ in range(3)}
        for version in (1, 2, 3):
            key = ("l", "policy", version, "c0")
            reply = replies.expect(key)
            replies.arrive(key, "ack")
            assert await reply_unless_learner_died(reply, replies.loop_end(ref)) == "ack"
        shared = replies.loop_end(ref)
        kept_while_running = len(replies._loops)
        end.set_exception(OwnerDiedError("ff" * 28, None, "the test's"))
        await asyncio.wait({shared})  # wakes after its own done callbacks ran
        return len(waits), kept_while_running, len(replies._loops), shared.cancelled()

    assert asyncio.run(scenario()) == (1, 1, 0, False)


def test_a_process_serves_one_learners_channel_at_a_time():
    claim = _ChannelClaim()
    assert claim.claim(None, "a/policy", ("a", 0))
    assert claim.claim(None, "a/policy", ("a", 1))  # its own again: a rebuild
    assert not claim.claim(None, "b/policy", ("b", 0))
    claim.release("b/policy", ("b", 1))  # not the holder: no effect
    assert not claim.claim(None, "b/policy", ("b", 2))
    claim.release("a/policy", ("a", 2))
    assert claim.claim(None, "b/policy", ("b", 3))


def test_a_release_sent_before_a_rebuilds_claim_and_run_after_it_is_stale():
    """A threaded receiver runs a learner's calls in any order: the release of a torn
    graph, sent before the next build's claim, ran after it and wiped it. That graph
    then ran here unclaimed, its hold was dropped, and another learner's claim was
    granted: its graph waited behind the first on the actor's one graph thread."""
    claim = _ChannelClaim()
    assert claim.claim(None, "a/policy", ("a", 0))
    assert claim.claim(None, "a/policy", ("a", 2))  # the rebuild's claim ran first
    claim.release("a/policy", ("a", 1))  # the torn graph's, sent before it
    assert not claim.claim(None, "b/policy", ("b", 0))  # still a's
    claim.hold("a/policy", ("a", 3), "the rebuild's loop", [])
    assert claim._holder == "a/policy" and claim._loop == "the rebuild's loop"
    claim.release("a/policy", ("a", 4))
    assert not claim.claim(None, "a/policy", ("a", 1))  # a stale claim is refused
    assert claim._holder is None
    # A channel the learner made anew counts its own calls from 0.
    assert claim.claim(None, "a/policy", ("a again", 0))
    claim.release("a/policy", ("a again", 1))
    assert claim.claim(None, "b/policy", ("b", 1))


def test_a_builds_claims_of_two_receivers_of_one_process_carry_one_stamp(monkeypatch):
    """Two attachments of one actor are both targets of a build: each claim got a stamp
    of its own, and the one that ran second there, stamped first, was refused as stale
    (the set kept off the channel, again at each try)."""
    channel = ReceiverChannel(hub=None, submitter="learner", model="policy")
    channel.close()  # its thread ends: the test runs the build itself
    sent: list[tuple] = []
    one_process = _Recording(sent)
    targets = (_target("c0", handle=one_process), _target("c1", handle=one_process))
    members = tuple((t.worker, t.token) for t in targets)
    channel._wanted = members
    monkeypatch.setattr(
        raysync.learner_channel,
        "ray",
        SimpleNamespace(get=_claims_unanswered, exceptions=ray.exceptions),
    )
    channel._build(_Build(members, targets, nbytes=8))
    claims = [args for args in sent if args[0] is claim_channel]
    assert len(claims) == 2 and claims[0][2] == claims[1][2]
    claim = _ChannelClaim()
    assert all(claim.claim(None, holder, stamp) for _, holder, stamp in reversed(claims))


def test_a_learner_that_died_while_building_keeps_others_out_for_a_while_only(monkeypatch):
    """A learner killed between its claims and its holds named no graph loop to watch:
    its claim kept every other learner's channel out of this process for good. It
    expires; a live learner whose build outlived it finds its hold refused."""
    from raysync import receiver_delivery

    now = [1000.0]
    monkeypatch.setattr(receiver_delivery, "time", SimpleNamespace(monotonic=lambda: now[0]))
    claim = _ChannelClaim()
    assert claim.claim(None, "a/policy", ("a", 0))
    now[0] += receiver_delivery.BUILD_CLAIM_EXPIRES_S - 1
    assert not claim.claim(None, "b/policy", ("b", 0))  # a may still be building
    now[0] += 2
    assert claim.claim(None, "b/policy", ("b", 1))
    assert not claim.hold("a/policy", ("a", 1), "a's loop", [])  # a's build outlived it
    assert claim.hold("b/policy", ("b", 2), "b's loop", [])
    assert claim._holder == "b/policy" and claim._loop == "b's loop"


def test_an_inline_version_is_copied_out_of_the_channels_buffer():
    weights = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    spec = WeightSpec.of(weights)
    arrays = tuple(as_array(weights[name]) for name in spec.names)
    for array in arrays:
        array.flags.writeable = False  # as the channel hands them over
    fetched = ObjectStoreReceiver().fetch(InlinePayload(arrays), spec)
    for name, array, tensor in zip(spec.names, arrays, fetched, strict=True):
        assert torch.equal(tensor, weights[name]) and tensor.dtype == weights[name].dtype
        assert not np.shares_memory(tensor.view(torch.uint8).numpy(), array)


def test_a_broadcast_as_a_build_begins_goes_the_plain_way_and_asks_for_its_set(monkeypatch):
    """The channel's thread begins building a graph for receivers {c0, c1} while the
    next broadcast goes to the graph's {c0} again. It wrote into the graph being torn
    down, and left {c0} wanted and never built: every later broadcast to {c0} took
    the plain path. Now it finds no graph, takes the plain path and asks for {c0}."""
    channel = ReceiverChannel(hub=None, submitter="learner", model="policy")
    channel.close()  # its thread ends: the test runs the thread's jobs itself
    graph = _Graph()
    one = (_target("c0", handle=_Unanswered()),)
    two = (*one, _target("c1", handle=_Unanswered()))
    channel._graph, channel._targets = graph, one
    channel._members = channel._wanted = tuple((t.worker, t.token) for t in one)
    assert channel.write(two, None, _update(2), timeout_s=5.0) is None  # asks for {c0, c1}
    build = channel._jobs.get_nowait()

    teardown = channel._teardown

    def broadcast_to_one_then_teardown(*args):
        assert channel.write(one, None, _update(3), timeout_s=5.0) is None
        teardown(*args)

    monkeypatch.setattr(channel, "_teardown", broadcast_to_one_then_teardown)
    monkeypatch.setattr(
        raysync.learner_channel,
        "ray",
        SimpleNamespace(get=_claims_unanswered, exceptions=ray.exceptions),
    )
    channel._build(build)  # {c0, c1} not claimed in time: refused for a while

    assert graph.executed == [] and graph.torn
    asked = channel._jobs.get_nowait()
    assert asked.members == (("c0", "token-c0"),)


class _Graph:
    """A compiled graph that records what was written into it."""

    def __init__(self) -> None:
        self.executed: list = []
        self.torn = False

    def execute(self, update):
        self.executed.append(update.version)
        return [None]

    def teardown(self) -> None:
        self.torn = True


class _Unanswered:
    """A receiver's actor handle whose calls are sent and never answered."""

    def __init__(self) -> None:
        self.__ray_call__ = self

    def options(self, **_):
        return self

    def remote(self, *_):
        return None


class _Recording(_Unanswered):
    """A receiver's actor handle that records each call's arguments, never answered."""

    def __init__(self, sent: list[tuple]) -> None:
        super().__init__()
        self.sent = sent

    def remote(self, *args):
        self.sent.append(args)
        return None


def _claims_unanswered(refs, timeout=None):
    raise ray.exceptions.GetTimeoutError("no receiver answered (the test's)")


def _update(version: int):
    return SimpleNamespace(model="policy", version=version, payload=SimpleNamespace(arrays=()))


def _target(
    worker: str, *, entry=Entry.MIXIN_METHOD, node="n1", transport="object_store", handle=None
):
    return DirectTarget(worker, f"token-{worker}", transport, handle, entry, f"key-{worker}", node)


def test_a_channel_reaches_mixin_receivers_on_the_learners_node_that_read_the_object_store():
    route = Route(
        ("object_store",),
        "policy",
        4,
        None,
        (
            _target("mixin"),
            _target("attached", entry=Entry.RAY_CALL),
            _target("elsewhere", node="n2"),
            _target("by_nixl", transport="nixl"),
        ),
    )
    assert [t.worker for t in channel_targets(route, "n1")] == ["mixin"]


def test_a_version_from_the_channel_is_delivered_to_the_registration_it_was_built_for(
    monkeypatch,
):
    """One version goes to every receiver of the graph; each names the registration the
    graph was built for, so a deferred ack answers the one the hub awaits."""
    delivered = []

    def deliver(host, key, update):
        delivered.append((key, update.token))

    monkeypatch.setattr(raysync.receiver_delivery, "deliver", deliver)
    update = Update("policy", 3, "digest", "object_store", None, from_learner=True)
    for key, token in [("c0 key", "t0"), ("c1 key", "t1")]:
        raysync.receiver_delivery.deliver_on_channel(None, key, update, token)
    assert delivered == [("c0 key", "t0"), ("c1 key", "t1")]
