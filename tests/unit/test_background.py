"""raysync/background.py without Ray: tasks held until done, failures logged, cancelled on close."""

from __future__ import annotations

import asyncio
import gc
import logging

from raysync.background import BackgroundTasks


def test_a_task_nobody_else_holds_runs_to_its_end():
    finished = []

    async def work(gate: asyncio.Event) -> None:
        await gate.wait()
        finished.append(True)

    async def main() -> None:
        tasks = BackgroundTasks("test")
        gate = asyncio.Event()
        tasks.spawn(work(gate), "work")
        gc.collect()  # a task held only weakly by asyncio could go here
        gate.set()
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert finished == [True]


def test_a_failed_task_is_logged_with_its_name(caplog):
    async def fail() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        task = BackgroundTasks("planner").spawn(fail(), "hold of 'policy'")
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.ERROR, logger="raysync.background"):
        asyncio.run(main())
    assert "planner: hold of 'policy' failed" in caplog.text and "boom" in caplog.text


def test_close_cancels_what_still_runs():
    async def main() -> bool:
        tasks = BackgroundTasks("hub")
        task = tasks.spawn(asyncio.Event().wait(), "forever")
        await asyncio.sleep(0)
        await asyncio.wait_for(tasks.close(), timeout=5)
        return task.cancelled()

    assert asyncio.run(main())
