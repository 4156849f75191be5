"""WeightSpec: the names, shapes and dtypes that make up one model's weights.

The learner computes a spec for every broadcast, each receiver computes one for its
model when it registers, and the hub compares them. A spec is small (no tensor data),
hashable and cheap to compare, so the hub can check every broadcast before any
receiver is touched. A spec holds each dtype by name and imports torch only when asked
for torch's dtype: the control plane reads specs without torch (the bucket broker's
process never imports it).
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from raysync.errors import SpecMismatchError

if TYPE_CHECKING:
    import torch

#: How many entries of each side a mismatch message lists before it elides the rest.
_MESSAGE_ENTRIES = 12


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor: its shape and dtype (its device is each process's own).

    The dtype is held by torch's name for it (``"float32"``, ``"bfloat16"``) and its
    size in bytes; :attr:`dtype` is torch's dtype itself. Made with :meth:`of`.
    """

    name: str
    shape: tuple[int, ...]
    dtype_name: str
    itemsize: int

    @classmethod
    def of(cls, name: str, shape: Iterable[int], dtype: torch.dtype) -> TensorSpec:
        """The spec of a tensor called ``name`` of ``shape`` and ``dtype``."""
        return cls(name, tuple(shape), str(dtype).removeprefix("torch."), dtype.itemsize)

    @cached_property
    def dtype(self) -> torch.dtype:
        """torch's dtype (imports torch on first use in a process). Kept by the instance:
        receivers read it per tensor per version, and specs are reused across versions."""
        import torch  # here, not at the top: the control plane reads specs without torch

        return getattr(torch, self.dtype_name)

    def __reduce__(self) -> tuple[Any, tuple[str, tuple[int, ...], str, int]]:
        """Pickled as its fields, without the torch dtype it may keep."""
        return TensorSpec, (self.name, self.shape, self.dtype_name, self.itemsize)

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def describe(self) -> str:
        return f"shape {tuple(self.shape)} {self.dtype_name}"


@dataclass(frozen=True)
class WeightSpec:
    """The ordered (sorted by name) set of tensors of one model."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> WeightSpec:
        """The spec of a flat ``name -> tensor`` mapping (see :func:`raysync.weights.flatten`).

        A learner asks for the same spec on every broadcast: the same instance comes
        back for the same names, shapes and dtypes (a few recent ones are kept), its
        digest and its pickled form computed once.
        """
        return _spec_of_entries(
            tuple((name, t.shape, t.dtype) for name, t in sorted(tensors.items()))
        )

    def cast(self, dtype_of: Callable[[torch.dtype], torch.dtype]) -> WeightSpec:
        """This spec with each tensor's dtype replaced by ``dtype_of(dtype)``."""
        return _spec_of_entries(tuple((t.name, t.shape, dtype_of(t.dtype)) for t in self.tensors))

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        """Pickled as its entries in plain types, once per instance; unpickled, equal
        bytes give the same instance back (a hub receives the same spec with every
        broadcast: it compares it by identity and hashes its digest once)."""
        return _spec_from_wire, (self._wire,)

    @cached_property
    def _wire(self) -> bytes:
        return pickle.dumps(
            tuple((t.name, t.shape, t.dtype_name, t.itemsize) for t in self.tensors)
        )

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @cached_property
    def digest(self) -> str:
        """A short content hash of names, shapes and dtypes.

        Updates carry it instead of the spec: a receiver compares it with the spec it
        registered, so a 1000-tensor spec is not sent to every receiver on every broadcast.
        """
        text = "\n".join(f"{t.name}|{t.shape}|torch.{t.dtype_name}" for t in self.tensors)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def __hash__(self) -> int:
        """The digest's hash: computed once per instance (a 1000-tensor spec's tuple hash
        walked every entry on every lookup; specs key layouts and staging pools)."""
        return hash(self.digest)

    def __len__(self) -> int:
        return len(self.tensors)

    def summary(self) -> str:
        """A short human-readable listing, for error messages."""
        lines = [f"{t.name}: {t.describe()}" for t in self.tensors[:_MESSAGE_ENTRIES]]
        if len(self.tensors) > _MESSAGE_ENTRIES:
            lines.append(f"... and {len(self.tensors) - _MESSAGE_ENTRIES} more")
        return f"{len(self.tensors)} tensors, {self.nbytes} bytes: {{" + ", ".join(lines) + "}"

    def check_matches(self, other: WeightSpec, *, expected: str, got: str) -> None:
        """Raise :class:`SpecMismatchError` unless ``other`` equals this spec.

        ``expected`` and ``got`` name the two sides in the message (for example
        ``"hub spec of model 'policy'"`` and ``"broadcast"``). The message names the
        offending keys (the first ``_MESSAGE_ENTRIES``) with both sides' shape and dtype,
        then both specs.
        """
        if other == self:
            return
        mine = {t.name: t for t in self.tensors}
        theirs = {t.name: t for t in other.tensors}
        problems = []
        missing = sorted(mine.keys() - theirs.keys())
        extra = sorted(theirs.keys() - mine.keys())
        if missing:
            problems.append(f"missing key(s) in {got}: {keys_listed(missing)}")
        if extra:
            problems.append(f"unexpected key(s) in {got}: {keys_listed(extra)}")
        for name in sorted(mine.keys() & theirs.keys()):
            a, b = mine[name], theirs[name]
            if a.shape != b.shape:
                problems.append(
                    f"key {name!r}: {expected} has {a.describe()}, {got} has {b.describe()} "
                    "(shape differs)"
                )
            elif a.dtype_name != b.dtype_name:
                problems.append(
                    f"key {name!r}: {expected} has {a.describe()}, {got} has {b.describe()} "
                    "(dtype differs)"
                )
        head = "; ".join(problems[:_MESSAGE_ENTRIES])
        if len(problems) > _MESSAGE_ENTRIES:
            head += f"; ... and {len(problems) - _MESSAGE_ENTRIES} more problem(s)"
        raise SpecMismatchError(
            f"{got} does not match {expected}: {head}\n"
            f"  {expected}: {self.summary()}\n"
            f"  {got}: {other.summary()}"
        )


#: How many specs :meth:`WeightSpec.of` and unpickling keep for reuse, per process.
_RECENT_SPECS = 16


@functools.lru_cache(maxsize=_RECENT_SPECS)
def _spec_of_entries(entries: tuple[tuple[str, torch.Size, torch.dtype], ...]) -> WeightSpec:
    """The spec of ``(name, shape, dtype)`` entries sorted by name; the same instance
    for equal entries (see :meth:`WeightSpec.of`)."""
    return WeightSpec(tuple(TensorSpec.of(name, shape, dtype) for name, shape, dtype in entries))


@functools.lru_cache(maxsize=_RECENT_SPECS)
def _spec_from_wire(wire: bytes) -> WeightSpec:
    """The spec :meth:`WeightSpec.__reduce__` pickled; the same instance for equal bytes."""
    return WeightSpec(tuple(TensorSpec(*entry) for entry in pickle.loads(wire)))


def keys_listed(names: list[str]) -> str:
    """Key names for a message: the first few quoted, then how many in all."""
    shown = ", ".join(repr(n) for n in names[:_MESSAGE_ENTRIES])
    if len(names) > _MESSAGE_ENTRIES:
        shown += f", ... ({len(names)} in all)"
    return shown
