"""What raysync's broadcast is compared with, both halves of each: the memcpy floor (N+1
copies in one process, no Ray), the raw NIXL READ (nixl cells: each receiver's prepared
one-sided READ of the learner's buffer) and the hand-written ``ray.put`` baseline
(object_store cells). The receiver halves run inside the receiver actors
(``broadcast_bench.receivers``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
import torch

from broadcast_bench.units import DTYPE


# -- the memcpy floor ---------------------------------------------------------------------
class Floor:
    """N+1 copies of one flat ``size``-byte buffer in this process: the no-Ray floor.
    ``src`` is also the raw READ's source in nixl cells."""

    def __init__(self, size: int) -> None:
        numel = size // DTYPE.itemsize
        self.src = torch.empty(numel, dtype=DTYPE).fill_(1.0)
        self.dst = torch.empty(numel, dtype=DTYPE).fill_(0.0)

    def run(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n + 1):
            self.dst.copy_(self.src)
        return time.perf_counter() - t0


# -- the raw NIXL READ --------------------------------------------------------------------
#: Seconds one raw READ may take before the receiver gives up.
RAW_READ_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RawSource:
    """A registered buffer in the learner, as a reader addresses it (plain ints and bytes)."""

    agent: str
    metadata: bytes
    address: int
    nbytes: int


def _nixl_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread: nixl's default one
    busy-polls a core for as long as the agent lives, idle or not. Readers progress
    their READs by polling them; the learner progresses the source's while they read
    (``RawReadSource.read``)."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(
        f"bench-raw-{role}-{uuid.uuid4().hex[:12]}",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )


class RawReadSource:
    """The learner's side of the raw READ floor: per nixl cell, an agent with the floor's
    source buffer registered."""

    def __init__(self) -> None:
        self.agent = None
        self._registered = None

    def register(self, buffer: torch.Tensor) -> RawSource:
        self.agent = _nixl_agent("source")
        self._registered = self.agent.register_memory(buffer)
        nbytes = buffer.numel() * buffer.element_size()
        return RawSource(
            self.agent.name, self.agent.get_agent_metadata(), buffer.data_ptr(), nbytes
        )

    def read(self, receivers: list[Any], timeout_s: float) -> tuple[float, list[float]]:
        """Every receiver READs the whole source at once. Returns the seconds from the
        calls until the last READ was done (by the receivers' ``perf_counter``, the
        machine's monotonic clock, so Ray's return trip is not counted) and element 0 of
        what each read. Meanwhile this process progresses the source's agent, which has
        no progress thread: a first READ connects and needs the source to answer, and
        later ones were seen to need it too now and then."""
        started = time.perf_counter()
        refs = [r.raw_read.remote() for r in receivers]
        pending, deadline = refs, time.monotonic() + timeout_s
        while pending:
            self.agent.get_new_notifs()  # progresses the agent's UCX worker
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.001)
            ray.get(done)  # a reader's error, at once
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"raw NIXL READs not done within {timeout_s:g} s")
        results = ray.get(refs)
        return max(t for t, _ in results) - started, [v for _, v in results]

    def close(self) -> None:
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
        self.agent = self._registered = None


@dataclass
class RawReader:
    """A receiver's side of the raw READ floor: its agent and the prepared READ."""

    agent: Any
    registered: Any  #: the model's flat buffer, registered
    xfer: Any  #: the prepared READ of the whole source into it


def prepare_raw_read(flat: torch.Tensor, source: RawSource) -> RawReader:
    """(In a receiver.) Register the model's flat buffer and prepare one READ of the whole
    source into it (the next broadcast overwrites what the READs leave there)."""
    nbytes = flat.numel() * flat.element_size()
    if nbytes != source.nbytes:
        raise ValueError(f"the raw READ source has {source.nbytes} bytes, the model {nbytes}")
    agent = _nixl_agent("reader")
    registered = agent.register_memory(flat)
    agent.add_remote_agent(source.metadata)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(flat.data_ptr(), nbytes, 0)], "DRAM")
    remote = agent.prep_xfer_dlist(source.agent, [(source.address, nbytes, 0)], "DRAM")
    xfer = agent.make_prepped_xfer("READ", local, [0], remote, [0])
    return RawReader(agent, registered, xfer)


def post_raw_read(reader: RawReader, flat: torch.Tensor) -> tuple[float, float]:
    """(In a receiver.) Post the prepared READ and poll it until done: when
    (``perf_counter``) and element 0 of ``flat`` (the source's tag)."""
    agent, xfer = reader.agent, reader.xfer
    started = time.monotonic()
    state = agent.transfer(xfer)
    while state == "PROC":
        if time.monotonic() - started > RAW_READ_TIMEOUT_S:
            raise TimeoutError(f"raw NIXL READ not done after {RAW_READ_TIMEOUT_S:g} s")
        time.sleep(0)
        state = agent.check_xfer_state(xfer)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL READ ended in state {state}")
    return time.perf_counter(), float(flat[0])


# -- the hand-written ray.put baseline ----------------------------------------------------
def put_by_hand(weights: dict[str, torch.Tensor], receivers: list[Any], timeout_s: float) -> float:
    """(In the learner.) One ``ray.put`` of the state_dict as NumPy views; every receiver
    gets it and copies it into its model. Seconds from the put until the last is done."""
    t0 = time.perf_counter()
    ref = ray.put({name: t.numpy() for name, t in weights.items()})
    ray.get([r.apply_baseline.remote([ref]) for r in receivers], timeout=timeout_s)
    return time.perf_counter() - t0


def apply_put_by_hand(model: dict[str, torch.Tensor], refs: list[Any]) -> int:
    """(In a receiver.) Get the put arrays (the ref comes nested in a list, so Ray does
    not resolve it) and copy them into ``model`` in place; returns how many."""
    state = ray.get(refs[0])
    with torch.no_grad():
        for name, array in state.items():
            model[name].copy_(torch.from_numpy(array))
    return len(state)
