"""Bookkeeping that remembers the last few of something: a dict (insertion-ordered)
trimmed to its newest entries. Any process; the caller guards the dict."""

from __future__ import annotations

import itertools
from collections.abc import Container
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def keep_newest(entries: dict[K, V], count: int, kept: Container[K] = ()) -> None:
    """Delete the oldest (first inserted) of ``entries`` beyond the newest ``count``,
    but those in ``kept`` (they count, and stay)."""
    droppable = (key for key in entries if key not in kept)
    for key in list(itertools.islice(droppable, max(0, len(entries) - count))):
        del entries[key]
