"""The tests' signal between a test and its actors, in a module of its own: an actor's
process imports the module its class lives in, and this one needs neither torch nor
raysync (a Gate's process starts in under half the CPU time of one that imports torch,
and the tests start dozens)."""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class Gate:
    """A signal between a test and its actors: ``wait`` returns once ``open`` was called
    (an actor blocked in ``ray.get(gate.wait.remote())`` holds its method slot until
    the test says so, however slow the machine)."""

    def __init__(self) -> None:
        self._opened = asyncio.Event()

    async def wait(self) -> None:
        await self._opened.wait()

    async def open(self) -> None:
        self._opened.set()
