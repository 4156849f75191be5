"""The hub's side of learners' channels (:mod:`raysync.learner_channel`): receivers'
replies to a version a learner wrote into its channel, matched to the deliveries that
await them.

The learner's ``submit`` (which books the version) and its ``channel_replies`` call
are two calls that Ray may start in either order, so a reply may come first: it is
kept until its delivery asks for it. Used on the hub's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

#: (learner handle, model, version, worker)
ReplyKey = tuple[str, str, int, str]

#: Replies kept for deliveries not booked yet (a learner whose version the hub versioned
#: anew never books them: the oldest go first).
EARLY_REPLIES_KEPT = 4096


class ChannelReplies:
    def __init__(self) -> None:
        self._waiting: dict[ReplyKey, asyncio.Future[Any]] = {}
        self._early: OrderedDict[ReplyKey, Any] = OrderedDict()

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
            while len(self._early) > EARLY_REPLIES_KEPT:
                self._early.popitem(last=False)
        elif not future.done():
            future.set_result(reply)

    def forget(self, keys: Iterable[ReplyKey]) -> None:
        """The deliveries of ``keys`` ended (a reply that never came: the learner died)."""
        for key in keys:
            self._waiting.pop(key, None)

    def __len__(self) -> int:
        return len(self._waiting) + len(self._early)
