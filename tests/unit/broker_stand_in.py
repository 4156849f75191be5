"""A stand-in of the hub's bucket broker for the learner rings' unit tests (nixl's and
rdt's), without Ray: it records every call, and its ``room`` is never answered (read by
a stand-in of ``ray.wait``/``ray.get``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import VersionDone
from raysync.transports.buckets import BucketPlan
from raysync.transports.object_store import buckets
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.object_store.buckets import Outgoing

NEVER = "a room call the broker never answers"
BUCKET = 64  #: bytes of each bucket of :func:`stream_of`


class EndsAfter(VersionDone):
    """A broadcast that ends once asked whether it ended ``after`` times (None: never)."""

    def __init__(self, after: int | None) -> None:
        self._left = after

    def wait(self, timeout_s: float) -> None:
        if self._left is None or self._left > 0:
            if self._left is not None:
                self._left -= 1
            raise TimeoutError


class _Calls:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def remote(self, *args):
        self.calls.append((self.name, *args))
        return NEVER if self.name == "room" else None


def recording_broker(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A broker whose ``room`` never answers (as a restarted one that lost the stream
    holds it up); its calls are recorded in ``broker.calls``."""
    calls: list = []
    names = ("room", "offer", "end")
    stand_in = SimpleNamespace(calls=calls, **{name: _Calls(name, calls) for name in names})
    monkeypatch.setattr(
        buckets, "ray", SimpleNamespace(wait=lambda refs, timeout: ([], refs), get=None)
    )
    return stand_in


def stream_of(broker: object, name: str, count: int) -> tuple[BucketStream, Outgoing]:
    """A stream of ``count`` buckets of :data:`BUCKET` bytes through ``broker``, and
    the learner's side of it."""
    weights = {"w": torch.arange(count * BUCKET // 4, dtype=torch.float32)}
    plan = BucketPlan.of(WeightSpec.of(weights), BUCKET)
    assert plan.count == count
    return BucketStream(broker, StreamId(name, count, 5.0), BUCKET), Outgoing(
        [weights["w"]], plan
    )
