"""Tasks an async actor starts and does not await at once (hub and owner processes).

``asyncio`` keeps only a weak reference to a task: one nobody holds may be collected
before it finishes, and its exception is reported, if ever, only then. A
:class:`BackgroundTasks` holds each task until it is done, logs the exception of one
that failed, and cancels the rest when its owner closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundTasks:
    """The running tasks of one owner (a planner, the hub), by reference until done."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        """Run ``coroutine`` on the running loop; ``what`` names it in a failure's log."""
        task = asyncio.get_running_loop().create_task(coroutine, name=f"{self._owner}: {what}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        """Cancel the tasks still running and wait for them to end."""
        tasks, self._tasks = set(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
