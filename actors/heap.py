"""What every raysync actor does with its heap once it has started.

A process that imported Ray and torch tracks ~200K Python objects; a full garbage
collection walks them all (~80 ms on 2 cores) and stops the process meanwhile. The
objects a broadcast allocates (a 1000-tensor model's spec, views, messages) trigger one
every few broadcasts, and whoever waits on that actor (the learner's report, every
receiver's delivery) waits for it too. The modules, classes and constants loaded at
start never become garbage, so each actor moves them out of the collector's sight once
its ``__init__`` has run (``gc.freeze``); what it allocates afterwards is collected as
usual, and a full collection walks only that.
"""

from __future__ import annotations

import gc

import ray


def settle_heap() -> None:
    """Exclude every object alive now from later collections (``gc.freeze``).

    Called at the end of each raysync actor's ``__init__``. No collection first: one
    would cost the ~80 ms it saves, on every actor start and restart, to free the few
    cycles the imports left. Only in a Ray actor's own process: a class built directly
    elsewhere (a unit test, a driver) leaves that process's heap alone.
    """
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    gc.freeze()
