"""The RDT sender's bucket ring (raysync/transports/rdt/ring.py) without Ray: a learner
stopped while it waits for room ends its stream saying why. The broker is a stand-in
recording its calls (as in test_nixl_ring.py)."""

from __future__ import annotations

import pytest
import torch

from raysync.transports.rdt import ring as ring_module
from raysync.transports.rdt.ring import RdtRing
from raysync.transports.rdt.wire import RdtBucketStream
from tests.unit.broker_stand_in import BUCKET, EndsAfter, recording_broker, stream_of


def test_a_learner_interrupted_waiting_for_room_ends_its_stream_saying_why(monkeypatch):
    """Ctrl-C (or a cancelled learner task) while it waits for its readers to make
    room: they were left waiting the stream's whole timeout for a bucket that never
    came, told the learner may have died."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    broker = recording_broker(monkeypatch)
    monkeypatch.setattr(ring_module, "room_or_end", interrupted)
    monkeypatch.setattr(ring_module, "this_actor", lambda: None)
    ring = RdtRing(
        [torch.zeros(BUCKET, dtype=torch.uint8) for _ in range(2)],
        1.0,
        new_slot=lambda like: pytest.fail("no slot is set aside"),
        deregister=lambda slot: None,
    )
    stream, outgoing = stream_of(broker, "v1", 3)
    payload = RdtBucketStream(stream.broker, stream.key, stream.bucket_bytes)
    with pytest.raises(KeyboardInterrupt):
        ring.stream_out(payload, outgoing, EndsAfter(after=None))
    assert broker.calls[-1] == (
        "end",
        stream.key,
        f"the learner failed waiting for room for bucket 0: {KeyboardInterrupt()!r}",
    )
