"""The Ray actor classes raysync starts, found by role (hub, learner and hub processes).

The classes live in :mod:`raysync.actors` (the repository's ``actors/`` folder). That
package imports this library; the library never imports it. The binding is declared in
``pyproject.toml`` as entry points of the group ``raysync.actors`` and loaded when an
actor of that role is first started, the way Python finds plugins: a third-party
transport registers the actor that owns its resources the same way.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Any

#: The entry-point group that names raysync's actor classes.
GROUP = "raysync.actors"

HUB = "hub"  #: the control plane (``WeightHubActor``)
PROCESS_GROUP = "process_group"  #: rank 0 of the ``distributed`` transport
RPC_AGENT = "rpc_agent"  #: the sender of the ``rpc`` transport
SHM_OWNER = "shm_owner"  #: a node's shared-memory segments
BUCKET_BROKER = "bucket_broker"  #: hands out the buckets of bucketed versions


def actor_class(role: str) -> type[Any]:
    """The (plain, undecorated) class registered for ``role``; ``LookupError`` naming
    the known roles when none is, e.g. when raysync runs from a source tree that was
    never installed (``pip install -e .`` writes the entry points)."""
    classes = _registered()
    try:
        return classes[role].load()
    except KeyError:
        raise LookupError(
            f"no raysync actor class registered for role {role!r} (entry-point group "
            f"{GROUP!r}; registered: {', '.join(sorted(classes)) or 'none'}); is raysync "
            "installed?"
        ) from None


@functools.cache
def _registered() -> dict:
    return {point.name: point for point in entry_points(group=GROUP)}
