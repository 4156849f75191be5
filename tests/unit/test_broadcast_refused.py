"""Whether a broadcast's end was the hub refusing it before publishing
(raysync/hub_handle.py ``_BroadcastDone.refused``), without Ray: Ray's ``wait`` and
``get`` stand in for the submit's result. The nixl sender writes the buffer of a refused
version again; one taken for refused but published would lose the hub's latest, so
anything but a known refusal counts as published."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from raysync.errors import (
    BroadcastError,
    HubSnapshotError,
    IncompleteVersionError,
    SpecMismatchError,
    StaleVersionError,
    UnknownWorkerError,
)
from raysync.hub_handle import _BroadcastDone


def _ended_with(monkeypatch, outcome, waits: bool = True) -> _BroadcastDone:
    """A broadcast whose submit's result is ready here and is ``outcome`` (an exception
    is raised by ``ray.get``, as Ray re-raises the hub's: an instance of its class);
    ``waits``: the broadcast's ``wait``."""

    def get(ref, timeout=None):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(ray, "wait", lambda refs, **kwargs: (list(refs), []))
    monkeypatch.setattr(ray, "get", get)
    return _BroadcastDone("the hub's actor", "the result's ref", waits=waits)  # type: ignore[arg-type]


def _from_the_hub(cause: Exception) -> Exception:
    return ray.exceptions.RayTaskError("submit", "traceback", cause).as_instanceof_cause()


@pytest.mark.parametrize(
    "cause",
    [
        StaleVersionError("version 3 is not above 5"),
        UnknownWorkerError("r2 is not registered"),
        SpecMismatchError("w: shape"),
        HubSnapshotError("nothing was published"),
        IncompleteVersionError("part 1 never came"),
    ],
)
def test_a_submit_refused_before_publishing_is_refused(monkeypatch, cause):
    assert _ended_with(monkeypatch, _from_the_hub(cause)).refused() is True


def test_a_version_published_with_failed_receivers_is_not_refused(monkeypatch):
    report = SimpleNamespace(model="m", version=3, acked=(), failed={"r1": "timed out"})
    failed = _from_the_hub(BroadcastError(report))  # type: ignore[arg-type]
    assert _ended_with(monkeypatch, failed).refused() is False


@pytest.mark.parametrize(
    "outcome",
    [
        ray.exceptions.RayActorError(),  # the hub died: published or not, unknown
        ray.exceptions.GetTimeoutError("ready on the hub's node, not here yet"),
        _from_the_hub(RuntimeError("an unforeseen error in the hub")),
        "the report",  # published, every receiver acked
    ],
)
def test_an_end_that_may_have_published_is_not_refused(monkeypatch, outcome):
    assert _ended_with(monkeypatch, outcome).refused() is False


def test_a_broadcast_still_running_is_not_refused(monkeypatch):
    monkeypatch.setattr(ray, "wait", lambda refs, **kwargs: ([], list(refs)))
    done = _BroadcastDone("the hub's actor", "the result's ref", waits=True)  # type: ignore[arg-type]
    assert done.refused() is False


@pytest.mark.parametrize("waits", [True, False])
def test_a_refusal_ends_the_wait_of_a_send_that_must_know_whether_it_was_published(
    monkeypatch, waits
):
    """The nixl sender waits for a version's broadcast to end before it picks the buffer
    of the next one, when either buffer may hold the hub's latest: a refusal ends that
    wait as soon as the submit's result is in (the hub's ``wait_for`` is never asked:
    a string stands in for its actor), and then says it was refused."""
    done = _ended_with(monkeypatch, _from_the_hub(StaleVersionError("3 is not above 5")), waits)
    done.wait(600.0)
    assert done.refused() is True
