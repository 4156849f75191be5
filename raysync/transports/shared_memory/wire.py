"""All processes: slots, payloads, the owners' names and the segment header's format.

No torch here: the owner's process never imports it (seconds of CPU and a few hundred
MB on each node's owner); it and these helpers see a segment as a NumPy uint8 array
(``tensor.numpy()`` in the learner and receivers, a view of the same bytes)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

#: Namespace of the owner actors (named per hub and node, looked up by the learner).
OWNER_NAMESPACE = "raysync"
#: Most slots an owner keeps per learner and segment size, beside the latest of each
#: model of that size beyond the first and those held only for receivers
#: (``KEPT_PER_RECEIVER``); a learner waits once all are held.
MAX_SLOTS = 4
#: Slots held only for one receiver, of one model, that its owner's pool may hold beyond
#: ``MAX_SLOTS`` (the hub keeps a call per receiver and model, and models of one size
#: share the pool): a busy receiver's queued call's and, in zero-copy mode, the one its
#: model lives in.
KEPT_PER_RECEIVER = 2
#: How long the learner (or a relaying owner) waits for a slot to be released.
SLOT_WAIT_S = 60.0
#: How long the learner waits for its node's owner to be (re)started by the hub.
OWNER_WAIT_S = 30.0
#: How long an owner waits for the hub's earlier holds when a later one comes first.
ORDER_WAIT_S = 1.0
#: Threads of an owner (a threaded actor: cheaper per call than an event loop, which
#: counts at one release per receiver per version). Calls that wait take one each: a
#: learner's ``acquire``, a hold waiting for its turn, a relay, the planner's watch.
OWNER_THREADS = 32
#: The release board of an owner (see :class:`Board`): a row per receiver that joined
#: on its node, a column per segment; receivers beyond the rows, and segments beyond
#: the columns, release by calling the owner instead.
BOARD_ROWS = 1024
BOARD_COLUMNS = 64
#: How often an owner with no free slot reads its board again while it waits (the
#: board's writes notify nobody; releases by call wake it at once).
BOARD_POLL_S = 0.005

#: Header: [0:16] segment token, [16:24] sequence number of the version in the slot
#: (0 while it is being written), little-endian int64, [24:32] a tag of the model it
#: is of (for the owner: see ``ShmOwner.deliver``); the packed tensors start after it
#: (:class:`raysync.layout.PackedLayout`, at this offset), on a cache line.
HEADER_BYTES = 64
TOKEN_BYTES = 16
_SEQ = slice(16, 24)
_MODEL = slice(24, 32)


def owner_name(hub_id: str, node_id: str) -> str:
    """Name of the owner actor of ``hub_id`` on ``node_id`` (in :data:`OWNER_NAMESPACE`)."""
    return f"raysync-shm-{hub_id}-{node_id}"


@dataclass(frozen=True)
class Slot:
    """Where one version lies: a segment of an owner on a node, and which version."""

    node_id: str
    pid: int  #: the owner's process
    fd: int  #: the segment's descriptor in the owner's process
    token: bytes  #: random, also in the segment's header
    nbytes: int
    seq: int  #: owner-wide sequence number of the version written into it
    #: the segment's column on its owner's release board (-1: none, release by call)
    column: int = -1


@dataclass(frozen=True)
class SharedMemoryPayload:
    """A version in a slot (plain data: no actor handle to pass per update)."""

    slot: Slot
    #: The hub's number of the delivery that held the slot for its receiver (0: a
    #: learner's own payload, held by nobody's plan): a delivery set aside names it to
    #: take that hold back (``ShmOwner.withdraw``). Not compared: the same version.
    placement: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Board:
    """Where one receiver releases its slots: its row of its node's owner's *release
    board*, a segment of int64 cells, one per (receiver, segment), that the receiver
    writes (the sequence number it is done with) and the owner reads when it looks for
    a free slot or holds that version for it, and clears once it used the release. A
    release is one ``pwrite`` there instead of one Ray call per receiver per version."""

    segment: Slot  #: the board's segment (its ``nbytes`` and ``pid``: the owner's)
    row: int  #: the receiver's row

    #: The board segment's size: its header, then the cells row by row.
    NBYTES = HEADER_BYTES + BOARD_ROWS * BOARD_COLUMNS * 8

    def offset(self, column: int) -> int:
        """Byte offset of the receiver's cell for the segment in ``column`` (what
        :meth:`cells` shows at ``[row, column]``)."""
        return HEADER_BYTES + (self.row * BOARD_COLUMNS + column) * 8

    @staticmethod
    def cells(buffer: np.ndarray) -> np.ndarray:
        """The cells of a board segment (its uint8 ``buffer``) as int64 ``[row, column]``."""
        return buffer[HEADER_BYTES:].view(np.int64).reshape(BOARD_ROWS, BOARD_COLUMNS)


@dataclass(frozen=True)
class SharedMemoryReceiverInfo:
    worker: str  #: the receiver's worker id, named in its holds
    owner: str  #: name of the owner on the receiver's node, to release slots to
    #: its row of that owner's release board; None: it releases by calling the owner
    board: Board | None = None


#: The sequence an owner writes into a segment it frees: nothing will be read from it
#: again, and a process that maps it lets its mapping go (``Mappings``).
RETIRED_SEQ = -1


def write_seq(buffer: np.ndarray, seq: int) -> None:
    """Write ``seq`` into the header of a segment (its uint8 ``buffer``)."""
    buffer[_SEQ].view(np.int64)[0] = seq


def read_seq(buffer: np.ndarray) -> int:
    """The sequence number in the header of a segment (its uint8 ``buffer``)."""
    return int(buffer[_SEQ].view(np.int64)[0])


def write_model(buffer: np.ndarray, model: str) -> None:
    """Write which model the version in a segment (its uint8 ``buffer``) is of into its
    header (the learner, before the sequence that says the version is whole)."""
    buffer[_MODEL] = np.frombuffer(_model_tag(model), np.uint8)


def holds_model(buffer: np.ndarray, model: str) -> bool:
    """Whether the header of a segment (its uint8 ``buffer``) names ``model``."""
    return bytes(buffer[_MODEL]) == _model_tag(model)


def _model_tag(model: str) -> bytes:
    return hashlib.blake2b(model.encode(), digest_size=_MODEL.stop - _MODEL.start).digest()
