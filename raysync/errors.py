"""The exceptions raysync raises. Every one derives from :class:`RaySyncError`.

Errors raised inside the hub actor reach the learner through ``ray.get(ack)``; Ray
re-raises them as a subclass of both ``RayTaskError`` and the original class, so
``except SpecMismatchError`` works on the learner as written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysync.messages import BroadcastReport


class RaySyncError(Exception):
    """Root of every error raysync raises on purpose."""


class InvalidWeightsError(RaySyncError, ValueError):
    """The weights handed to ``broadcast`` are not a valid set of tensors.

    Raised in the learner process, before anything is put or sent.
    """


class SpecMismatchError(RaySyncError, ValueError):
    """Two weight specs disagree: a broadcast or a receiver's model against the hub's spec.

    Raised before any receiver is touched; the message names the offending keys (the
    first 12) with both sides' shape and dtype.
    """


class UnknownModelError(RaySyncError, KeyError):
    """A model id the hub does not know (or an ambiguous default)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class UnknownWorkerError(RaySyncError, KeyError):
    """A worker id the hub does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ModelPathError(RaySyncError, AttributeError):
    """A receiver's model path (``"env.transform[0]"``) does not resolve on the actor."""


class TransportUnavailableError(RaySyncError, RuntimeError):
    """A transport was chosen that cannot run here; the message says why."""


class StaleVersionError(RaySyncError, ValueError):
    """A broadcast asked for a version not above the model's current one."""


class HubNotFoundError(RaySyncError, LookupError):
    """No hub of that name appeared within the timeout."""


class HubClosedError(RaySyncError, RuntimeError):
    """The hub is shutting down and accepts no more broadcasts."""


class HubSnapshotError(RaySyncError, RuntimeError):
    """The hub could not save a version to Ray's GCS (where a restarted hub reads its
    versions back): the broadcast was refused, nothing published."""


class IncompleteVersionError(RaySyncError, RuntimeError):
    """A version sent in parts (sharded learners) failed before it was whole: a part did
    not arrive within the timeout, or one was refused (the message says which and why).
    No receiver was touched: nothing of the version was applied."""


class BroadcastError(RaySyncError):
    """At least one targeted receiver did not apply the version.

    ``report`` holds the whole outcome: who acked, who failed and why.
    """

    def __init__(self, report: BroadcastReport) -> None:
        self.report = report
        failures = "\n".join(
            f"  - {worker}: {reason}" for worker, reason in sorted(report.failed.items())
        )
        super().__init__(
            f"version {report.version} of model {report.model!r} failed on "
            f"{len(report.failed)} of {len(report.acked) + len(report.failed)} receiver(s):\n"
            f"{failures}"
        )

    def __reduce__(self):
        return (type(self), (self.report,))
