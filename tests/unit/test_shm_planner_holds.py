"""The shared-memory planner's holds when a plan is cut short, on an event loop without
Ray: the holds it took for receivers the hub was to call go, those of receivers the
learner called itself (the direct path: they read the slot whatever becomes of the
plan) stay for them to let go."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from raysync.background import BackgroundTasks
from raysync.transports.base import ReceiverInfo
from raysync.transports.shared_memory.planner import SharedMemoryPlanner
from raysync.transports.shared_memory.wire import SharedMemoryPayload, Slot

HERE, THERE = "learner-node", "other-node"
SLOT = Slot(HERE, pid=11, fd=3, token=b"t", nbytes=64, seq=5)


class _Owner:
    """Stands for a node's owner actor: records each hold and release; its export (for
    other nodes) never answers, so a plan that relays is cut short by its timeout."""

    def __init__(self) -> None:
        self.held: list[tuple[str, ...]] = []
        self.released: list[str] = []
        self.deliver = SimpleNamespace(remote=self._deliver)
        self.release = SimpleNamespace(remote=self._release)
        self.export = SimpleNamespace(remote=lambda *args: asyncio.Future())

    def _deliver(self, pid, seq, model, workers, order, version) -> asyncio.Future[Slot]:
        self.held.append(workers)
        answer: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        answer.set_result(SLOT)
        return answer

    async def _release(self, pid: int, seq: int, worker: str) -> None:
        self.released.append(worker)


def _planner(owners: dict[str, _Owner]) -> SharedMemoryPlanner:
    planner = SharedMemoryPlanner.__new__(SharedMemoryPlanner)  # no Ray: no owners started
    planner._owners = dict[str, Any](owners)
    planner._orders = {node: itertools.count(1) for node in owners}
    planner._latest = {}
    planner._background = BackgroundTasks("test planner")
    return planner


def _receiver(worker: str, node_id: str, called: bool = False) -> ReceiverInfo:
    return ReceiverInfo(worker, f"R({worker})", node_id, "p", None, called_by_learner=called)


def test_a_plan_cut_short_lets_go_only_of_the_holds_of_receivers_the_hub_was_to_call():
    async def run() -> _Owner:
        here = _Owner()
        planner = _planner({HERE: here, THERE: _Owner()})
        update = SimpleNamespace(model="m", version=3, payload=SharedMemoryPayload(SLOT))
        targets = [
            _receiver("called", HERE, called=True),  # the learner delivered it itself
            _receiver("uncalled", HERE),
            _receiver("far", THERE),
        ]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(planner.plan(update, None, targets), 0.05)
        # The holds' let-go runs in the background: wait for it (and the holds' check).
        await asyncio.gather(*planner._background._tasks)
        return here

    here = asyncio.run(run())
    assert here.held == [("called", "uncalled")]  # held for both as the plan began
    assert here.released == ["uncalled"]  # the learner's receiver keeps its hold
