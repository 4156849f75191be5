"""The hub's side of learners' channels (:mod:`raysync.learner_channel`): receivers'
replies to a version a learner wrote into its channel, matched to the deliveries that
await them.

The learner's ``submit`` (which books the version) and its ``channel_replies`` call
are two calls that Ray may start in either order, so a reply may come first: it is
kept until its delivery asks for it. A learner that dies before it passed a reply on
fails the delivery's wait for it (:func:`reply_unless_learner_died`), as its death
fails a delivery call it made. Used on the hub's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ray.exceptions import OwnerDiedError

from raysync.bounded import keep_newest

#: (learner handle, model, version, worker)
ReplyKey = tuple[str, str, int, str]

#: Replies kept for deliveries not booked yet (a learner whose version the hub versioned
#: anew never books them: the oldest go first).
EARLY_REPLIES_KEPT = 4096


class ChannelReplies:
    def __init__(self) -> None:
        self._waiting: dict[ReplyKey, asyncio.Future[Any]] = {}
        self._early: OrderedDict[ReplyKey, Any] = OrderedDict()
        #: ref of a channel's loop on a receiver (hex) -> the one wait for its end
        self._loops: dict[str, asyncio.Future[Any]] = {}

    def loop_end(self, loop: Any) -> asyncio.Future[Any]:
        """The end of ``loop``, the ref of a channel's loop on a receiver: one wait per
        loop, which every version's reply waits beside. (A loop ends only with its graph
        or its learner; Ray keeps each wait for a ref until it resolves, cancelled or not:
        one per version and receiver grew the hub for the channel's life.)"""
        key = loop.hex()
        end = self._loops.get(key)
        if end is None:
            end = self._loops[key] = asyncio.ensure_future(loop)
            end.add_done_callback(_retrieve)
            end.add_done_callback(lambda _: self._loops.pop(key, None))
        return end

    def expect(self, key: ReplyKey) -> asyncio.Future[Any]:
        """The future of ``key``'s reply (done at once if it came first)."""
        future = asyncio.get_running_loop().create_future()
        if key in self._early:
            future.set_result(self._early.pop(key))
        else:
            self._waiting[key] = future
        return future

    def arrive(self, key: ReplyKey, reply: Any) -> None:
        """A learner passed on ``key``'s reply."""
        future = self._waiting.pop(key, None)
        if future is None:
            self._early[key] = reply
            keep_newest(self._early, EARLY_REPLIES_KEPT)
        elif not future.done():
            future.set_result(reply)

    def forget(self, keys: Iterable[ReplyKey]) -> None:
        """The deliveries of ``keys`` ended: a reply not come by then is not awaited
        (its future is cancelled)."""
        for key in keys:
            future = self._waiting.pop(key, None)
            if future is not None:
                future.cancel()

    def __len__(self) -> int:
        return len(self._waiting) + len(self._early)


async def reply_unless_learner_died(
    reply: asyncio.Future[Any], loop_end: asyncio.Future[Any]
) -> Any:
    """``reply`` (from :meth:`ChannelReplies.expect`) once it comes; ``OwnerDiedError``
    (an ``ObjectLostError``, as a delivery call of a dead learner fails) if the learner
    dies first: ``loop_end`` (:meth:`ChannelReplies.loop_end`) is the end of its
    channel's loop on the receiver, a task the learner owns. A loop that ends otherwise
    (the learner tore its graph down) leaves the wait to ``reply``: the learner passes
    on what its receivers answered."""
    await asyncio.wait({reply, loop_end}, return_when=asyncio.FIRST_COMPLETED)
    if not reply.done():  # the loop ended first
        error = loop_end.exception()
        if isinstance(error, OwnerDiedError):
            raise error
    return await reply


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a loop's end as seen (asyncio logs an exception nobody retrieved)."""
    if not future.cancelled():
        future.exception()
