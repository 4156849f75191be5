"""Which learner may deliver which version number itself: the hub's book of routes.

Kept by the hub (``actors/hub.py``), in its process only; no Ray here. On the direct
path a learner calls its receivers itself with the version its route named, and the
receivers apply it before the hub has booked it (that is what makes the path fast).
So a number must never name two broadcasts' weights, or a receiver would act for a
while with one learner's weights under the number the hub gave another's: each number
a route hands out is handed to one learner only, and a broadcast the hub numbers
itself skips a number routed to another learner and not booked yet, which that learner
may be delivering at this very moment (unless its last broadcast of the model went
through the hub). With one learner nothing is skipped: its versions run 1, 2, 3, ...
With several, a number one was routed and another's broadcast overtook is booked by
nobody (the first one's broadcast is numbered anew: the hub's ``_book_direct``): a
gap, never one number for two weights. A learner's number is held up from its route
until its next broadcast has its turn at the hub; one that went through the hub (parts
of a sharded version, buckets, explicit versions) holds nothing up from then until it
is routed again (in its result; the hub routes no number in a bucketed version's).

A learner that ends its side of the hub (``HubHandle.release``) has the hub forget its
numbers; one whose process died without it holds its last number up for good: the
next learner's versions skip that one number. A broadcast given an explicit
``version`` is numbered by its learner, which the hub cannot stop from naming a number
routed to another learner; explicit versions and another learner delivering itself do
not mix on one model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from raysync.bounded import keep_newest

#: Learners with a routed number remembered per model (the oldest forgotten first): a
#: number routed long ago to a learner that never used it is the only kind kept.
LEARNERS_KEPT = 64


class DirectRoutes:
    """The hub's book of the version numbers routes handed to learners (submitter
    ids), per model: a number is kept until the model's published version reaches it
    (booked, by that learner or numbered past it)."""

    def __init__(self) -> None:
        self._routed: dict[str, OrderedDict[str, int]] = {}
        #: Per model, the learners whose last broadcast of it went through the hub.
        self._through_hub: dict[str, OrderedDict[str, None]] = {}

    def submitted(self, model: str, learner: str, *, direct: bool) -> None:
        """A broadcast of ``model`` by ``learner`` reached the hub, delivered by the
        learner itself (``direct``) or to be delivered by the hub."""
        through_hub = self._through_hub.setdefault(model, OrderedDict())
        through_hub.pop(learner, None)
        if not direct:
            through_hub[learner] = None
            keep_newest(through_hub, LEARNERS_KEPT)

    def route(self, model: str, learner: str, published: int) -> int:
        """The number ``learner`` may deliver its next broadcast of ``model`` as
        itself, handed to it now: above ``published`` (the model's latest version) and
        above every number handed to another learner and not booked yet."""
        # It may deliver this one itself, whatever its last broadcast did.
        if model in self._through_hub:
            self._through_hub[model].pop(learner, None)
        routed = self._routed.setdefault(model, OrderedDict())
        self._drop_spent(routed, published)
        number = max([published, *(n for o, n in routed.items() if o != learner)]) + 1
        routed[learner] = number
        routed.move_to_end(learner)
        keep_newest(routed, LEARNERS_KEPT)
        return number

    def next_version(self, model: str, learner: str, published: int) -> int:
        """The number a broadcast of ``model`` by ``learner`` takes when the hub numbers
        it: above ``published`` and above every number routed to another learner and
        not booked yet, but those of learners whose last broadcast went through the hub."""
        routed = self._routed.get(model)
        if routed is None:
            return published + 1
        self._drop_spent(routed, published)
        through_hub: Mapping[str, None] = self._through_hub.get(model, {})
        held = (n for other, n in routed.items() if other != learner and other not in through_hub)
        return max([published, *held]) + 1

    @staticmethod
    def _drop_spent(routed: OrderedDict[str, int], published: int) -> None:
        """Forget the numbers ``published`` reached: booked, or numbered past (no longer
        anyone's to deliver)."""
        for spent in [other for other, number in routed.items() if number <= published]:
            del routed[spent]

    def routed_to_another(self, model: str, learner: str, version: int) -> bool:
        """Whether ``version`` of ``model`` was handed to a learner other than
        ``learner`` (which delivered it though its route named another number)."""
        routed: Mapping[str, int] = self._routed.get(model, {})
        return any(n == version for other, n in routed.items() if other != learner)

    def forget_learner(self, learner: str) -> None:
        """``learner`` ended (its process let its side of the hub go): it delivers none
        of the numbers routed to it."""
        for routed in self._routed.values():
            routed.pop(learner, None)
        for through_hub in self._through_hub.values():
            through_hub.pop(learner, None)

    def forget(self, kept: Iterable[str]) -> None:
        """Forget every model but those of ``kept`` (the models the hub still knows)."""
        keep = set(kept)
        for model in [m for m in self._routed if m not in keep]:
            del self._routed[model]
        for model in [m for m in self._through_hub if m not in keep]:
            del self._through_hub[model]
