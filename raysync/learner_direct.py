"""The direct path, in the learner process: a broadcast whose route the learner holds
(the hub sent it with the previous broadcast's result) reaches the route's receivers
from the learner itself — written into its compiled-graph channel
(:func:`write_channel`, ``channels=True``) or one actor call per receiver
(:func:`deliver_directly`) — while the hub books the version and awaits those calls as
its first delivery (:mod:`raysync.actors.hub_delivery`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from raysync.learner_channel import ReceiverChannel, Written, channel_targets
from raysync.messages import Route, Update
from raysync.receiver_delivery import delivery_call
from raysync.routing import hand_off_of
from raysync.spec import WeightSpec
from raysync.transports import get_transport
from raysync.transports.object_store import ObjectStoreTransport
from raysync.transports.object_store.arrays import as_array
from raysync.transports.object_store.wire import InlinePayload


def write_channel(
    channel: ReceiverChannel,
    route: Route,
    version: int,
    spec: WeightSpec,
    wire_spec: WeightSpec | None,
    wire: dict[str, torch.Tensor],
    workers: Sequence[str] | None,
    node_id: str,
    origin: str,
    timeout_s: float,
) -> Written | None:
    """Write this broadcast, as ``version``, into the learner's channel (from the
    learner ``origin`` on node ``node_id``) to the route's eligible receivers (those of
    ``workers``, if given: all of them or none); None if the channel cannot take it now
    (the broadcast calls them itself)."""
    eligible = channel_targets(route, node_id)
    chosen = None if workers is None else set(workers) & {t.worker for t in eligible}
    travels = wire_spec or spec
    update = Update(
        route.model,
        version,
        spec.digest,
        ObjectStoreTransport.name,
        InlinePayload(tuple(as_array(wire[name]) for name in travels.names)),
        wire_spec,
        origin=origin,
        from_learner=True,
    )
    return channel.write(eligible, chosen, update, timeout_s)


def all_listed(workers: Sequence[str], route: Route) -> bool:
    """Whether ``workers`` names some receivers, each one the route lists (else the
    broadcast goes through the hub, which says what is wrong with the list)."""
    return bool(workers) and set(workers) <= {t.worker for t in route.targets}


def deliver_directly(
    route: Route,
    version: int,
    spec: WeightSpec,
    payloads: dict[str, Any],
    wire_spec: WeightSpec | None,
    workers: Sequence[str] | None,
    origin: str,
    node_id: str,
    reached: Collection[str] = (),
    running: Mapping[str, int] | None = None,
) -> dict[str, tuple[str, Any]]:
    """The direct path, in the learner (on node ``node_id``): call each of ``route``'s
    receivers (those of ``workers`` only, if given; none ``reached`` already through the
    learner's channel; where deliveries take turns, none with as many of this
    process's earlier calls ``running`` (per registration) as its transport lets run,
    ``Transport.direct_calls_running_most``; and, of a transport whose payload is read on the
    learner's node only, those on it) with this broadcast as ``version``; per worker,
    its registration and the call's ref (the hub awaits them as its first delivery, so
    deaths, restarts and deferred acks are handled as for its own calls; it delivers to
    the others)."""
    calls: dict[str, tuple[str, Any]] = {}
    chosen = None if workers is None else set(workers)
    for target in route.targets:
        if (chosen is not None and target.worker not in chosen) or target.worker in reached:
            continue
        transport = get_transport(target.transport)
        if (
            transport.one_call_at_a_time
            and running is not None
            and running.get(target.token, 0) >= transport.direct_calls_running_most
        ):
            continue  # the hub delivers it, the newest version once a call returned
        if transport.learner_delivers_on_its_node and target.node_id != node_id:
            continue
        update = Update(
            route.model,
            version,
            spec.digest,
            target.transport,
            payloads[hand_off_of(target.transport)],
            wire_spec,
            origin=origin,
            from_learner=True,
            token=target.token,
        )
        call = delivery_call(target.handle, target.entry, target.attachment, update)
        calls[target.worker] = (target.token, call)
    return calls
