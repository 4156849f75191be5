"""A learner's view of one broadcast's end (raysync/hub_handle.py ``_BroadcastDone``), for
its senders, without Ray: Ray's ``wait`` and ``get`` stand in for a ticket that is ready
on the hub's node and not yet in the learner's."""

from __future__ import annotations

import ray

from raysync.hub_handle import _BroadcastDone


def test_a_ticket_ready_elsewhere_but_not_here_yet_is_not_an_ended_broadcast(monkeypatch):
    """``ended`` saw the ticket ready (``fetch_local=False``: ready on the hub's node, a
    large ticket stored there), then could not get it at once, and took that timeout
    for a failed submit: the senders ended their streams and every reader failed a
    healthy version."""

    def not_here_yet(ref, timeout=None):
        raise ray.exceptions.GetTimeoutError("not local yet")

    monkeypatch.setattr(ray, "wait", lambda refs, **kwargs: (list(refs), []))
    monkeypatch.setattr(ray, "get", not_here_yet)
    done = _BroadcastDone("the hub's actor", "the ticket's ref", waits=False)  # type: ignore[arg-type]
    assert done.ended() is False


def test_a_submit_that_failed_is_an_ended_broadcast(monkeypatch):
    def failed(ref, timeout=None):
        raise ray.exceptions.RayTaskError("submit", "the hub refused it", ValueError("spec"))

    monkeypatch.setattr(ray, "wait", lambda refs, **kwargs: (list(refs), []))
    monkeypatch.setattr(ray, "get", failed)
    done = _BroadcastDone("the hub's actor", "the ticket's ref", waits=False)  # type: ignore[arg-type]
    assert done.ended() is True
