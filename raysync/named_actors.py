"""Hub process: starting a named actor again in place of one that died (a node's
shared-memory owner, the RPC agent).

Ray refuses a name that this process still resolves to the dead actor it was given to:
after an unexpected death (SIGKILL, a lost node, a ``ray.kill`` that lets the actor
restart), for as long as any handle of the dead actor lives in this process. Its
handles outlive the death a while (in calls failing with it, in the tracebacks of
their errors, in reference cycles), and a replacement started at once was refused
with ``ActorAlreadyExistsError`` for good (measured: still refused 8 s after a SIGKILL
while a handle was kept; started at once once it was dropped).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import TypeVar

from ray.exceptions import ActorAlreadyExistsError

T = TypeVar("T")

#: Seconds between tries while Ray still gives the name to the dead actor.
NAME_FREED_LOOK_S = 0.1


async def start_again(start: Callable[[], T], within_s: float) -> T:
    """``start()``, which starts a named actor (or returns without starting one: nothing
    to do any more), tried again every :data:`NAME_FREED_LOOK_S` while Ray says the name
    is taken, collecting this process's garbage first (the dead actor's handles in
    reference cycles), for up to ``within_s``; then ``ActorAlreadyExistsError``. The
    caller drops its own handles of the dead actor before it calls."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return start()
        except ActorAlreadyExistsError:
            if time.monotonic() >= deadline:
                raise
        gc.collect()
        await asyncio.sleep(NAME_FREED_LOOK_S)
